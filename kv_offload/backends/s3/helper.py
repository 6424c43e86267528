"""The S3 tier's helper process: it runs the tier's S3 requests, so that botocore's CPU is
not spent under the engine process's interpreter lock.

Why: one S3 request costs about 4 ms of CPU in botocore (building and signing the request,
the endpoint rules, http.client, parsing the reply: `benchmarks/bench_s3_request_cpu.py`).
Run on the tier's I/O threads inside the engine's process, every millisecond of it is one
the engine's own thread may wait for the interpreter lock in the middle of a step. Here it
runs in a process of its own; the engine's process only moves the bytes over a socket.

Started by `remote_client.HelperClient` (never by hand) as ``python <this file>``, not as a
module of the package: importing `kv_offload` imports torch (3 s and ~300 MB at start), and
this process needs boto3 and three small modules of ours. So `main` first registers our
packages as bare ones (their ``__init__`` not run) and only then imports what it needs.

Protocol, over `multiprocessing.connection` channels on a Unix socket, each authenticated
with the key the parent wrote on stdin, one request at a time per channel:
- request: ``pickle((method, kwargs, timeout_s, has_body))``, then the ``Body`` bytes as the
  next message when ``has_body``;
- reply: ``pickle((outcome, value, has_body))``, then the body of a ``get_object`` reply;
  ``outcome`` is "ok" (value: botocore's reply dict, ``Body`` taken out), "client_error"
  (value: ``(response, operation_name)``), "botocore_error" (value: its text), "os_error"
  (value: ``(errno, text)``) or "bug" (value: the traceback).
The parent's first stdin line holds the settings (JSON: the socket's path, the key, the
client's options, the parent's ``sys.path``, ``helper_nice``); stdin stays open as the
lifeline: at its end (the parent closed it, or died) this process exits.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import threading
import traceback
import types
from pathlib import Path

# The methods the tier calls; nothing else is run for a caller.
METHODS = frozenset({"put_object", "get_object", "head_object", "delete_object",
                     "delete_objects", "list_objects_v2"})
UNRANGED_READ_LIMIT = 1 << 20  # a GET without a Range (the generation record: ~100 bytes)


def _bare_packages() -> None:
    """Make ``kv_offload``, ``kv_offload.backends`` and its ``common`` and ``s3`` importable
    without running their ``__init__`` (which import torch and every tier)."""
    root = Path(__file__).resolve().parents[3]  # (the directory holding kv_offload/)
    for name in ("kv_offload", "kv_offload.backends", "kv_offload.backends.common",
                 "kv_offload.backends.s3"):
        package = types.ModuleType(name)
        package.__path__ = [str(root.joinpath(*name.split(".")))]
        sys.modules.setdefault(name, package)


def read_limit(range_header: str | None) -> int:
    """How much of a reply's body to read: the requested range (``bytes=0-N``), else
    `UNRANGED_READ_LIMIT` (an object larger than that is no record of ours anyway)."""
    if range_header and range_header.startswith("bytes=0-"):
        last = range_header[len("bytes=0-"):]
        if last.isdigit():
            return int(last) + 1
    return UNRANGED_READ_LIMIT


def serve(channel, s3, request_deadline, errors: tuple[type, type]) -> None:
    """Answer one channel's requests until it closes."""
    # (imported here, like main's imports: only once `_bare_packages` made it importable)
    from kv_offload.backends.s3.client import read_body

    client_error, botocore_error = errors
    while True:
        try:
            method, kwargs, timeout_s, has_body = pickle.loads(channel.recv_bytes())
            if has_body:
                kwargs["Body"] = channel.recv_bytes()
        except (EOFError, OSError):
            return  # the parent closed it (or gave up on it after a timeout)
        body = None
        try:
            if method not in METHODS:
                raise ValueError(f"the S3 helper does not run {method!r}")
            with request_deadline(timeout_s):
                reply = getattr(s3, method)(**kwargs)
                if method == "get_object":  # (a stalled body: a botocore_error answer)
                    body = read_body(reply, read_limit(kwargs.get("Range")))
                    del reply["Body"]
            answer = ("ok", reply)
        except client_error as e:
            answer = ("client_error", (e.response, e.operation_name))
        except botocore_error as e:
            answer = ("botocore_error", f"{type(e).__name__}: {e}")
        except OSError as e:
            answer = ("os_error", (e.errno, str(e)))
        except Exception:
            answer = ("bug", traceback.format_exc())
        try:
            header = pickle.dumps((*answer, body is not None))
        except Exception:  # (a reply that cannot be pickled: say so, do not go silent)
            header, body = pickle.dumps(("bug", traceback.format_exc(), False)), None
        try:
            channel.send_bytes(header)
            if body is not None:
                channel.send_bytes(body)
        except (OSError, ValueError):
            return  # the parent is gone, or stopped waiting and closed the channel


def _exit_at_end_of_stdin() -> None:
    sys.stdin.buffer.read()  # returns at EOF: the parent closed our lifeline, or died
    os._exit(0)


def main() -> None:
    settings = json.loads(sys.stdin.buffer.readline())
    os.nice(settings["nice"])  # (first: every thread started below inherits it)
    sys.path[:] = settings["sys_path"]  # (the parent's: the same boto3 and botocore)
    _bare_packages()
    from multiprocessing.connection import Listener

    from botocore.exceptions import BotoCoreError, ClientError

    from kv_offload.backends.common.deadline import install_deadlines, request_deadline
    from kv_offload.backends.s3.client import make_client
    from kv_offload.backends.s3.config import S3TierConfig

    s3 = make_client(S3TierConfig(**settings["client"]))
    if not install_deadlines(s3):  # pragma: no cover - a botocore unlike ours
        print("kv-offload S3 helper: cannot bound whole requests with this botocore; only "
              "each socket read is bounded (timeout_s)", file=sys.stderr)
    listener = Listener(settings["address"], family="AF_UNIX",
                        authkey=bytes.fromhex(settings["authkey"]))
    threading.Thread(target=_exit_at_end_of_stdin, daemon=True).start()
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        try:
            channel = listener.accept()
        except Exception:  # (a connection that failed the key: not ours)
            continue
        threading.Thread(target=serve, args=(channel, s3, request_deadline,
                                             (ClientError, BotoCoreError)),
                         daemon=True, name="kv-s3-helper").start()


if __name__ == "__main__":
    main()
