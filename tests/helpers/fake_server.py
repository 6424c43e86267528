"""A stand-in for vLLM's API server process tree, for the launcher tests (not a vLLM mock:
it only has the process behaviour `VllmServer` relies on).

    python fake_server.py --port N [--orphan] [--exit-at-start]

Answers `GET /health` with 200 on 127.0.0.1:N and starts one child process in its own process
group, like vLLM's engine core. On SIGTERM it stops its child and exits 0 — unless
`--orphan`: then the child ignores SIGTERM and is left behind, as a broken shutdown would
leave an engine process. `--exit-at-start` exits with status 3 before listening.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CHILD = ("import signal, time\n"
         "if {ignore}: signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
         "time.sleep(600)\n")


class Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--orphan", action="store_true")
    parser.add_argument("--exit-at-start", action="store_true")
    args = parser.parse_args()
    if args.exit_at_start:
        print("fake server: refusing to start", flush=True)
        return 3
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(ignore=args.orphan)])
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Health)

    def stop(signum: int, frame: object) -> None:
        if not args.orphan:
            child.terminate()
            child.wait()
        threading.Thread(target=server.shutdown).start()

    signal.signal(signal.SIGTERM, stop)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
