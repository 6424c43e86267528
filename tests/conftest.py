"""Every test process remembers weight digests in a directory of its own (never the user's
~/.cache/kv-offload): tests edit weights in place and must see only their own digests."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("KV_OFFLOAD_CACHE_DIR", tempfile.mkdtemp(prefix="kv-offload-digests-"))
