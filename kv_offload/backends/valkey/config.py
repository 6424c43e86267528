"""Settings of the Valkey/Redis tier: the `storage_options` of `storage_tier: "valkey"`.

Credentials: vLLM logs its whole config (``kv_transfer_config`` included) at start, so a
password in the URL would land in every log. A URL with a password is refused; the password
goes in a file named by ``password_file`` (readable by its owner only, like an SSH key), read
when the tier connects and kept only in the client's connection settings: never in this
config, its repr, an error message or a log line. ``username`` names an ACL user (Valkey and
Redis 6+); without it the password is the server's ``requirepass``.

TLS (``rediss://``): ``tls_ca_file`` names the CA that signed the server's certificate (the
server's name or IP in the URL must match it), ``tls_cert_file`` + ``tls_key_file`` this
client's certificate for servers that ask for one (``tls-auth-clients yes``). The files are
checked at start-up (present, regular, readable) and then read by the TLS library only: their
content is never in this config, an error message or a log line.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit, urlunsplit

from kv_offload.backends.common.options import check_remote_bounds, option
from kv_offload.backends.record import CHECKSUM, RecordCodec
from kv_offload.errors import ConfigError
from kv_offload.runtime.secret_file import read_private_file

URL_SCHEMES = ("redis", "rediss", "unix")


@dataclass(frozen=True)
class ValkeyTierConfig:
    """Where the server is, how keys are named, and the bounds on every wait.

    Every socket read and write is bounded by ``timeout_s`` (a connect by
    ``connect_timeout_s``): a dead or paused server costs a job at most that long, and then,
    for ``retry_interval_s``, nothing at all (jobs fail fast as misses).
    """

    url: str = option("str", doc="redis://HOST:PORT/DB, rediss:// for TLS, or "
                                 "unix:///path/to.sock (no password: see password_file)")
    layout_fingerprint: str = ""  # given by the connector, not an option
    codec: RecordCodec = CHECKSUM  # given by the connector (secret_file), not an option
    key_prefix: str = option("str", "kv-offload:", "prefix of every key (a namespace shared "
                                                   "by the servers that share a cache)")
    timeout_s: float = option("seconds", 1.0, "bound on each socket read or write")
    request_timeout_s: float = option("seconds", 5.0, "bound on one whole request (a "
                                                      "pipelined batch, a SCAN page), however "
                                                      "slowly the server sends")
    connect_timeout_s: float = option("seconds", 1.0, "bound on each connect")
    connections: int = option("count", 4, "connections to the server, one I/O thread each")
    batch_bytes: int = option("size", 64 << 20, "value bytes per pipelined batch")
    refresh_interval_s: float = option("seconds", 0.5, "seconds between two polls of the "
                                                       "keyspace notifications and the paced "
                                                       "SCAN (0: SCAN only at start)")
    scan_count: int = option("count", 1000, "COUNT hint of each SCAN call")
    scan_pages_per_refresh: int = option("count", 1, "SCAN calls per primary per poll: "
                                                     "bounds the work of the paced SCAN")
    keyspace_events: bool = option("bool", True, "subscribe to keyspace notifications of "
                                                 "the tier's keys (enabled with CONFIG SET "
                                                 "where the server allows it)")
    events_per_poll: int = option("count", 20_000, "keyspace notifications applied per "
                                                   "server per poll, at most")
    retry_interval_s: float = option("seconds", 1.0, "while the server is unreachable, how "
                                                     "often one call tries again")
    password_file: str | None = option("optional_str", None, "a file holding the password "
                                                             "(mode 0600 or stricter)")
    username: str | None = option("optional_str", None, "the ACL user (None: the default "
                                                        "user, or requirepass)")
    tls_ca_file: str | None = option("optional_str", None, "rediss:// only: the CA "
                                     "certificate(s), PEM, that signed the server's "
                                     "certificate (None: the system's CAs)")
    tls_cert_file: str | None = option("optional_str", None, "rediss:// only: this client's "
                                       "certificate, PEM (servers with tls-auth-clients)")
    tls_key_file: str | None = option("optional_str", None, "rediss:// only: the private key "
                                      "of tls_cert_file, PEM")

    def __post_init__(self) -> None:
        check_remote_bounds(self)
        parts = urlsplit(self.url)
        if parts.scheme not in URL_SCHEMES:
            raise ConfigError(f"storage_options.url must start with one of "
                              f"{[s + '://' for s in URL_SCHEMES]}, got {self.url!r}")
        if parts.scheme != "unix" and not parts.hostname:
            raise ConfigError(f"storage_options.url names no host: {self.url!r} (expected "
                              f"redis://HOST:PORT/DB)")
        try:
            parts.port  # noqa: B018 (parsing the port is the check)
        except ValueError as e:
            raise ConfigError(f"storage_options.url has a bad port: {self.url!r} ({e})") from e
        if parts.password is not None:
            # Refused rather than hidden: vLLM itself logs kv_transfer_config at start.
            raise ConfigError("storage_options.url must not carry a password (vLLM logs its "
                              "config at start): put the password in a file readable only "
                              "by you and name it in storage_options.password_file "
                              f"(url given: {self.display_url!r})")
        if parts.username and self.username is not None:
            raise ConfigError("storage_options.username and a user in storage_options.url "
                              "both name the ACL user; give only one")
        if self.password_file is not None:
            read_password(self.password_file)  # (at start-up: missing, unreadable, too open)
        self._check_tls(parts.scheme)
        db = parts.path.strip("/")
        if parts.scheme != "unix" and db and not db.isdigit():
            raise ConfigError(f"storage_options.url: the database must be a number, got "
                              f"{db!r} in {self.url!r}")

    def _check_tls(self, scheme: str) -> None:
        files = {"tls_ca_file": self.tls_ca_file, "tls_cert_file": self.tls_cert_file,
                 "tls_key_file": self.tls_key_file}
        given = [name for name, path in files.items() if path is not None]
        if given and scheme != "rediss":
            raise ConfigError(f"storage_options.{given[0]} is for TLS connections: the url "
                              f"must start with rediss://, got {self.display_url!r}")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ConfigError("storage_options.tls_cert_file and storage_options.tls_key_file "
                              "go together (a client certificate and its private key)")
        for name in given:
            check_readable_file(f"storage_options.{name}", files[name])

    def tls(self) -> dict[str, str]:
        """redis-py's ``ssl_*`` arguments for the TLS files given (empty without TLS)."""
        found = {}
        if self.tls_ca_file is not None:
            found["ssl_ca_certs"] = self.tls_ca_file
        if self.tls_cert_file is not None:
            found["ssl_certfile"] = self.tls_cert_file
            found["ssl_keyfile"] = self.tls_key_file
        return found

    @property
    def display_url(self) -> str:
        """The URL without any credentials, for log lines."""
        parts = urlsplit(self.url)
        host = parts.netloc.rsplit("@", 1)[-1]
        return urlunsplit((parts.scheme, host, parts.path, "", ""))

    def credentials(self) -> dict[str, str]:
        """redis-py's ``username``/``password`` arguments (read from ``password_file`` now).
        Never logged: callers hand them straight to the client."""
        found: dict[str, str] = {}
        user = self.username or unquote(urlsplit(self.url).username or "") or None
        if user is not None:
            found["username"] = user
        if self.password_file is not None:
            found["password"] = read_password(self.password_file)
        return found


def check_readable_file(what: str, path: str) -> None:
    """Raise ``ConfigError`` (naming ``what`` and the path, never the content) unless
    ``path`` is a regular file this process can read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(f"{what} {path!r} cannot be opened: {e.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"{what} {path!r} is not a regular file")
    finally:
        os.close(fd)


def read_password(path: str) -> str:
    """The password in ``path`` (one line; a trailing newline is not part of it). Raises
    ``ConfigError`` (naming the file, never its content) if it is missing, not a regular
    file, readable by group or others, or empty."""
    raw = read_private_file(path, "storage_options.password_file", "the server's password")
    try:
        password = raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError:  # (its message would quote a byte of the password)
        raise ConfigError(f"storage_options.password_file {path!r} is not UTF-8 text") from None
    if not password:
        raise ConfigError(f"storage_options.password_file {path!r} is empty")
    return password
