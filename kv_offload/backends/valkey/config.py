"""Settings of the Valkey/Redis tier: the `storage_options` of `storage_tier: "valkey"`."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from kv_offload.backends.options import check_remote_bounds, option
from kv_offload.backends.record import CHECKSUM, RecordCodec
from kv_offload.errors import ConfigError

URL_SCHEMES = ("redis", "rediss", "unix")


@dataclass(frozen=True)
class ValkeyTierConfig:
    """Where the server is, how keys are named, and the bounds on every wait.

    Every socket read and write is bounded by ``timeout_s`` (a connect by
    ``connect_timeout_s``): a dead or paused server costs a job at most that long, and then,
    for ``retry_interval_s``, nothing at all (jobs fail fast as misses).
    """

    url: str = option("str", doc="redis://[user:password@]HOST:PORT/DB, rediss:// for TLS, "
                                 "or unix:///path/to.sock")
    layout_fingerprint: str = ""  # given by the connector, not an option
    codec: RecordCodec = CHECKSUM  # given by the connector (secret_file), not an option
    key_prefix: str = option("str", "kv-offload:", "prefix of every key (a namespace shared "
                                                   "by the servers that share a cache)")
    timeout_s: float = option("seconds", 1.0, "bound on each socket read or write")
    connect_timeout_s: float = option("seconds", 1.0, "bound on each connect")
    connections: int = option("count", 4, "connections to the server, one I/O thread each")
    batch_bytes: int = option("size", 64 << 20, "value bytes per pipelined batch")
    refresh_interval_s: float = option("seconds", 5.0, "seconds between background SCANs "
                                                       "of the keys (0: only at start)")
    scan_count: int = option("count", 1000, "COUNT hint of each SCAN call")
    retry_interval_s: float = option("seconds", 1.0, "while the server is unreachable, how "
                                                     "often one call tries again")

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
        db = parts.path.strip("/")
        if parts.scheme != "unix" and db and not db.isdigit():
            raise ConfigError(f"storage_options.url: the database must be a number, got "
                              f"{db!r} in {self.url!r}")

    @property
    def display_url(self) -> str:
        """The URL without its password, for log lines."""
        parts = urlsplit(self.url)
        host = parts.netloc.rsplit("@", 1)[-1]
        return urlunsplit((parts.scheme, host, parts.path, "", ""))
