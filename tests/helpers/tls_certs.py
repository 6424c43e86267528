"""Certificates for the TLS tests, made with the ``openssl`` command line: a CA, a server
certificate for 127.0.0.1/localhost and a client certificate signed by it; and a second,
unrelated CA with its own client certificate, for the tests that must be refused."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


def openssl_binary() -> str | None:
    return shutil.which("openssl")


def _run(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@dataclass(frozen=True)
class Authority:
    """A CA and the certificates it signed (paths to PEM files)."""

    ca_file: str
    client_cert_file: str
    client_key_file: str
    server_cert_file: str
    server_key_file: str


def make_authority(directory: Path, name: str) -> Authority:
    """A CA named ``name`` in ``directory``, a server certificate for 127.0.0.1 and
    localhost, and a client certificate, all signed by it."""
    d = directory / name
    d.mkdir(parents=True)
    _run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-keyout", "ca.key",
         "-out", "ca.pem", "-subj", f"/CN={name} test CA", cwd=d)
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for who, ext in (("server", ["-extfile", "server.ext"]), ("client", [])):
        _run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{who}.key", "-out",
             f"{who}.csr", "-subj", f"/CN={name} {who}", cwd=d)
        _run("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "2", "-out", f"{who}.pem", *ext, cwd=d)
    for key in d.glob("*.key"):
        key.chmod(0o600)
    return Authority(str(d / "ca.pem"), str(d / "client.pem"), str(d / "client.key"),
                     str(d / "server.pem"), str(d / "server.key"))
