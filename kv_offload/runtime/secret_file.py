"""Reading `secret_file`: the shared secret that authenticates (and may encrypt) stored records.

The file is checked at start-up, in every process, before anything is stored: it must be a
regular file this process can read, readable by its owner only (group/other bits clear, as
ssh insists for private keys: a secret everyone on the host can read authenticates nothing),
and hold at least ``MIN_SECRET_BYTES`` bytes once surrounding whitespace (a trailing newline
from ``openssl rand -hex 32 > FILE``) is stripped. ``kv-offload secret new PATH``
(`kv_offload.tools.secret_cmd`) makes such a file. Every failure is a ``ConfigError`` naming
the key, the path and the fix; the secret itself is never put in a message, a log line or a
repr: only the path travels in the config, the bytes are read where the keys are derived.
"""

from __future__ import annotations

import os
import stat

from kv_offload.errors import ConfigError

MIN_SECRET_BYTES = 16
CREATE_HINT = "create one with: kv-offload secret new {path}"


def read_private_file(path: str, key: str, what: str, *, max_bytes: int = 1 << 16) -> bytes:
    """The bytes of ``path`` (at most ``max_bytes``), a credential named by config key ``key``
    that holds ``what``: a regular file this process can read, readable and writable by its
    owner only. Every failure is a ``ConfigError`` naming the key, the path and the fix, never
    the content. Opened without blocking (a FIFO planted there must not hang the engine)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"{key} {path!r} does not exist; expected a file holding {what}") \
            from None
    except OSError as e:
        raise ConfigError(f"{key} {path!r} cannot be opened ({e.strerror}); expected a file "
                          f"this process can read") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{key} {path!r} is not a regular file; expected a file holding "
                              f"{what}")
        if st.st_mode & 0o077:
            raise ConfigError(f"{key} {path!r} can be read or written by group/other (mode "
                              f"{stat.S_IMODE(st.st_mode):04o}); run: chmod 600 {path}")
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise ConfigError(f"{key} {path!r} cannot be read ({e.strerror})") from None
    finally:
        os.close(fd)
    if len(raw) > max_bytes:
        raise ConfigError(f"{key} {path!r} is larger than {max_bytes} bytes; expected a file "
                          f"holding {what}")
    return raw


def read_secret(path: str, *, key: str = "secret_file") -> bytes:
    """The secret held in ``path``, after the checks above (``key`` names the config key)."""
    if not os.path.exists(path):
        raise ConfigError(f"{key} {path!r} does not exist; " + CREATE_HINT.format(path=path))
    secret = read_private_file(path, key, "the shared secret").strip()
    if not secret:
        raise ConfigError(f"{key} {path!r} is empty; " + CREATE_HINT.format(path=path))
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"{key} {path!r} holds {len(secret)} bytes; expected at least "
                          f"{MIN_SECRET_BYTES}: " + CREATE_HINT.format(path=path))
    return secret
