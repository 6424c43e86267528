"""The S3-compatible object-store tier (`storage_tier: "s3"`): AWS S3, MinIO, Ceph RGW...

Needs boto3 (``pip install 'kv-offload[s3]'``).
"""

from kv_offload.backends.s3.config import S3TierConfig
from kv_offload.backends.s3.tier import S3Tier

__all__ = ["S3Tier", "S3TierConfig"]
