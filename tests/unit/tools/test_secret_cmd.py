"""`kv-offload secret new PATH` as a user runs it (a real subprocess): a 32-byte file, mode
0600 whatever the umask, that `secret_file` accepts; never an overwrite, never a followed
link; and the secret itself in no output."""

from __future__ import annotations

import base64
import os
import stat

import pytest

from kv_offload.config import parse_config

from unit.tools.test_cli import kv_offload_cli


def printed_forms(secret: bytes) -> list[str]:
    """Every way a secret could leak into text output."""
    return [secret.hex(), secret.hex().upper(), base64.b64encode(secret).decode(),
            base64.urlsafe_b64encode(secret).decode().rstrip("="), repr(secret)[2:-1]]


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o277])
def test_secret_new_creates_32_random_bytes_readable_by_the_owner_only(tmp_path, umask):
    path = tmp_path / "secret"
    old = os.umask(umask)  # (the child inherits it; 0o277 would leave a bare open() 0400)
    try:
        proc = kv_offload_cli("secret", "new", str(path), cwd=tmp_path, timeout=60)
    finally:
        os.umask(old)
    assert proc.returncode == 0, proc.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(path.read_bytes()) == 32
    config = parse_config({"cpu_bytes_to_use": "1MiB", "secret_file": str(path)})
    assert config.secret_file == str(path)


def test_secret_new_prints_the_config_line_and_never_the_secret(tmp_path):
    path = tmp_path / "secret"
    proc = kv_offload_cli("secret", "new", str(path), cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert f'"secret_file": "{path}"' in proc.stdout
    secret = path.read_bytes()
    output = proc.stdout + proc.stderr
    for form in printed_forms(secret):
        assert form not in output


def test_two_new_secrets_differ(tmp_path):
    for name in ("a", "b"):
        assert kv_offload_cli("secret", "new", str(tmp_path / name), cwd=tmp_path,
                              timeout=60).returncode == 0
    assert (tmp_path / "a").read_bytes() != (tmp_path / "b").read_bytes()


def test_secret_new_refuses_to_overwrite_an_existing_file_and_leaves_it_unchanged(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(b"the secret every engine already shares\n")
    path.chmod(0o600)
    proc = kv_offload_cli("secret", "new", str(path), cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert "already exists" in proc.stderr and "Traceback" not in proc.stderr
    assert path.read_bytes() == b"the secret every engine already shares\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_secret_new_refuses_a_planted_symlink_and_creates_nothing_at_its_target(tmp_path):
    target, link = tmp_path / "elsewhere", tmp_path / "secret"
    link.symlink_to(target)  # dangling: a plain open(O_CREAT) would create the target
    proc = kv_offload_cli("secret", "new", str(link), cwd=tmp_path, timeout=60)
    assert proc.returncode == 2 and "already exists" in proc.stderr
    assert not target.exists()


def test_secret_new_in_a_missing_folder_exits_2_naming_the_folder(tmp_path):
    path = tmp_path / "nonexistent" / "secret"
    proc = kv_offload_cli("secret", "new", str(path), cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert f"the folder '{path.parent}' does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
