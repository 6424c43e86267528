"""`VllmServer`'s process handling, on a stand-in process tree (fake_server.py): health wait,
start failures, SIGTERM shutdown, and orphans found by pid and killed.

The real vLLM server goes through the same code in tests/e2e/test_serving.py; an orphaned
engine process cannot be provoked there on purpose, so the orphan is planted here.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

psutil = pytest.importorskip("psutil")
pytest.importorskip("httpx")

from kv_offload.errors import ServerStartError  # noqa: E402
from kv_offload.serving.server import ServerSettings, VllmServer  # noqa: E402

FAKE_SERVER = Path(__file__).parents[2] / "helpers" / "fake_server.py"


@dataclass(frozen=True)
class FakeSettings(ServerSettings):
    flags: tuple[str, ...] = ()

    def command(self, host: str, port: int) -> list[str]:
        return [sys.executable, str(FAKE_SERVER), "--port", str(port), *self.flags]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_server_that_stops_its_children_shuts_down_cleanly(tmp_path):
    with VllmServer(FakeSettings(model="fake"), tmp_path) as server:
        assert server.url.startswith("http://127.0.0.1:")
        assert len(server.pids) == 2  # the server and its child
        report = server.stop(timeout_s=20)
    assert report.clean and report.exit_code == 0
    assert report.pids == server.pids and report.leftover_pids == ()
    assert all(gone(pid) for pid in report.pids)


def test_a_process_left_behind_at_shutdown_is_reported_by_pid_and_killed(tmp_path):
    with VllmServer(FakeSettings(model="fake", flags=("--orphan",)), tmp_path) as server:
        child = server.pids[1]
        report = server.stop(timeout_s=20)
    assert report.exit_code == 0  # the server itself exited as asked
    assert report.leftover_pids == (child,)
    assert report.killed and not report.clean
    assert gone(child)


def test_a_server_that_exits_while_starting_raises_with_its_log(tmp_path):
    server = VllmServer(FakeSettings(model="fake", flags=("--exit-at-start",)), tmp_path)
    with pytest.raises(ServerStartError, match=r"exited with status 3(.|\n)*refusing to start"):
        server.start(timeout_s=20)


def test_the_command_line_is_the_documented_module_form_with_the_connector_config():
    settings = ServerSettings(model="/m", kv_transfer_config={"kv_connector": "X"},
                              max_num_seqs=4)
    cmd = settings.command("127.0.0.1", 8123)
    assert cmd[:4] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]
    assert cmd[cmd.index("--kv-transfer-config") + 1] == '{"kv_connector": "X"}'
    assert cmd[cmd.index("--port") + 1] == "8123"
    assert "--enable-prompt-tokens-details" in cmd
    assert cmd[cmd.index("--max-num-seqs") + 1] == "4"
