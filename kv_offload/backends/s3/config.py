"""Settings of the S3-compatible object-store tier: the `storage_options` of `"s3"`."""

from __future__ import annotations

from dataclasses import dataclass

from kv_offload.backends.common.options import check_remote_bounds, option
from kv_offload.backends.record import CHECKSUM, RecordCodec
from kv_offload.errors import ConfigError

ADDRESSING_STYLES = ("auto", "path", "virtual")


@dataclass(frozen=True)
class S3TierConfig:
    """Bucket, endpoint, client-side budget and the bounds on every wait.

    Credentials come from boto3's standard chain (environment, shared config files, instance
    or container roles); none is an option here, so none lands in a config file.
    """

    bucket: str = option("str", doc="the bucket (it must exist)")
    bytes_to_use: int = option("size", doc="budget of the objects this engine writes, "
                                           "LRU-evicted by it (other writers' objects are "
                                           "never evicted by it; see evict_others)")
    layout_fingerprint: str = ""  # given by the connector, not an option
    codec: RecordCodec = CHECKSUM  # given by the connector (secret_file), not an option
    endpoint_url: str | None = option("optional_str", None, "e.g. http://minio:9000; None: "
                                                            "AWS")
    prefix: str = option("str", "kv-offload/", "key prefix of every object")
    region_name: str | None = option("optional_str", None, "region (None: boto3's default)")
    addressing_style: str | None = option("optional_str", None, "'path', 'virtual' or 'auto' "
                                                                "(None: path with "
                                                                "endpoint_url, else auto)")
    connections: int = option("count", 8, "HTTP connections, one I/O thread each")
    helper_process: bool = option("bool", True, "run the requests in a helper process, so "
                                                "botocore's CPU (~4 ms per request) is not "
                                                "spent under the engine process's "
                                                "interpreter lock (remote_client.py); "
                                                "false: in the engine's process")
    helper_nice: int = option("nice", 0, "added to the helper process's nice value (0 to "
                                         "19): when the CPUs are busy, the engine's "
                                         "threads run before botocore's")
    timeout_s: float = option("seconds", 5.0, "bound on each socket read")
    request_timeout_s: float = option("seconds", 15.0, "bound on one whole request (a PUT, "
                                                       "a GET, a listing request), however "
                                                       "slowly the endpoint sends")
    connect_timeout_s: float = option("seconds", 2.0, "bound on each connect")
    max_attempts: int = option("count", 1, "attempts per request, retries included")
    refresh_interval_s: float = option("seconds", 1.0, "seconds between two polls of the "
                                                       "listing crawl (0: list only at "
                                                       "start)")
    list_pages_per_refresh: int = option("count", 1, "listing pages (1000 objects each) "
                                                     "per poll: bounds the CPU spent "
                                                     "listing")
    list_request_objects: int | None = option(
        "optional_count", None, "objects per ListObjectsV2 request, at most 1000 (None: "
        "for the crawl, the garbage collector's young threshold / 14, i.e. 50: no full "
        "collections set off by it; 1000 for the start-up listing. 1000: 20x fewer "
        "requests, billed per request on AWS)")
    conditional_put: bool = option("bool", True, "write with If-None-Match: * (an object "
                                                 "already there is not sent again)")
    retry_interval_s: float = option("seconds", 1.0, "while the endpoint is unreachable, "
                                                     "how often one call tries again")
    evict_others: bool = option("bool", False, "also evict objects other writers (or this "
                                               "engine before a restart) stored, keeping the "
                                               "whole prefix within bytes_to_use: only for a "
                                               "prefix no other engine uses")

    def __post_init__(self) -> None:
        check_remote_bounds(self)
        if self.list_request_objects is not None and self.list_request_objects > 1000:
            raise ConfigError(f"storage_options.list_request_objects must be at most 1000 "
                              f"(S3's largest ListObjectsV2 page), got "
                              f"{self.list_request_objects!r}")
        if self.endpoint_url is not None and not self.endpoint_url.startswith(
                ("http://", "https://")):
            raise ConfigError(f"storage_options.endpoint_url must start with http:// or "
                              f"https://, got {self.endpoint_url!r}")
        if self.addressing_style not in (None, *ADDRESSING_STYLES):
            raise ConfigError(f"storage_options.addressing_style must be one of "
                              f"{list(ADDRESSING_STYLES)}, got {self.addressing_style!r}")
