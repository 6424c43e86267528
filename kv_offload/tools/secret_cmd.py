"""`kv-offload secret new PATH`: create the file `secret_file` names, safely, in one step.

A shared storage tier (valkey, s3) starts only with `secret_file` (or the opt-out
`trusted_store`), so making a good secret file must be as easy as naming one. This writes
32 bytes from `secrets.token_bytes` (the OS's CSPRNG: 256 bits, twice the
`MIN_SECRET_BYTES` the reader insists on) into a file it creates:
- with `O_CREAT | O_EXCL`: it never overwrites. A secret that changes under running engines
  turns every stored record into a miss, and a planted symlink or file is refused rather than
  followed or truncated (`O_EXCL` fails on any existing name, a dangling link included);
- with mode 0600 from the start (then `fchmod`, since a umask may clear owner bits): no moment
  where group or other could read it, and `runtime.secret_file.read_private_file` accepts it;
- removed again if the write fails (a short file would be refused at start-up anyway).

It prints the absolute path and the config line to add, never the secret: the bytes exist only
in the file. Exit status 2 when the file cannot be created (it exists, its folder does not,
no permission), with the reason on stderr; the file is then untouched.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys

from kv_offload.tools.report import SubcommandParser

SECRET_BYTES = 32


def add_secret_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="secret_action", required=True, metavar="ACTION",
                                    parser_class=SubcommandParser)
    new = actions.add_parser(
        "new", help="create a new secret file (mode 0600; never overwrites)",
        description=f"Create PATH holding {SECRET_BYTES} random bytes, readable by its owner "
                    f"only, and print the secret_file line to add to kv_connector_extra_config. "
                    f"An existing PATH is never overwritten. The secret is never printed: copy "
                    f"the file itself to every server that shares the store.")
    new.add_argument("path", metavar="PATH", help="where to create the secret file")
    new.set_defaults(run=run_secret_new)


def run_secret_new(args: argparse.Namespace) -> int:
    path = os.path.abspath(os.path.expanduser(args.path))
    try:
        write_new_secret(path)
    except FileExistsError:
        print(f"kv-offload secret new: {path!r} already exists; it is never overwritten (engines "
              f"still using the old secret would stop serving each other's records). Choose "
              f"another path, or remove the file first if no engine uses it.", file=sys.stderr)
        return 2
    except FileNotFoundError:
        print(f"kv-offload secret new: the folder {os.path.dirname(path)!r} does not exist; "
              f"create it first (mode 0700 for a folder of secrets)", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"kv-offload secret new: cannot create {path!r}: {e.strerror or e}",
              file=sys.stderr)
        return 2
    print(f"Wrote a new secret ({SECRET_BYTES} random bytes, mode 0600) to {path}.\n"
          f"Copy this file (same bytes, mode 0600) to every server that shares the storage "
          f"tier, and add to kv_connector_extra_config:\n"
          f"  \"secret_file\": {json.dumps(path)}")
    return 0


def write_new_secret(path: str) -> None:
    """Create `path` (never an existing one) holding `SECRET_BYTES` random bytes, mode 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # (the umask may have cleared owner bits; never adds others')
        data = memoryview(secrets.token_bytes(SECRET_BYTES))
        while data:
            data = data[os.write(fd, data):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(path)  # ours (O_EXCL): a partial secret must not be left to be used
        raise
    os.close(fd)
