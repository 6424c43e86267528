"""The model's weights identity: every byte of its weight files, or the name its operator gives.

Stored KV is served only to the same weights (it is part of the layout fingerprint:
`kv_offload.vllm.fingerprint`). Where the identity comes from, in order:

1. ``model_identity`` in the config: the operator's name for these weights (a deploy
   version, a checkpoint id). Nothing is read; the operator promises it changes whenever
   the weights do.
2. Local weight files (`weight_files`): the model is a directory (every weight file under
   it), a single file (a GGUF), or a Hugging Face hub cache snapshot (found without network;
   its links into the cache's blobs are followed). The identity is a digest, over the files
   in name order, of each one's relative path, size and whole-content digest
   (`kv_offload.runtime.file_digests`: every byte is read once, then remembered by size,
   mtime, ctime, inode and device, so a restart reads nothing and an edit in place, even
   with its mtime restored, is read again).
3. None: no local weight files (a model streamed from a remote store, a hub model neither
   cached nor downloaded yet).

When: the connector starts `PendingWeights` as it is built, before vLLM loads the weights,
so both read the same files at once (the second from the page cache); the store opens only
once the identity is known (`PendingWeights.result()`, at ``register_kv_caches``, after vLLM
loaded the weights), so nothing is stored or served under an identity not yet known. The
files are listed and checked again then: a hub model downloaded during the load, or a file
that changed meanwhile, is read then.

Without an identity, a storage tier (records that outlive the process, or are shared) is a
start-up error naming ``model_identity``; with host memory only, the model's name and
revision key the cache (the host tier ends with the process, and the weights cannot change
under a running engine).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kv_offload.errors import ConfigError
from kv_offload.runtime.file_digests import FileDigests

logger = logging.getLogger("kv_offload")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


@dataclass(frozen=True)
class WeightFiles:
    """The weight files of a model: paths under ``root``, in name order."""

    root: Path
    files: tuple[Path, ...]


@dataclass(frozen=True)
class WeightsIdentity:
    """What stored KV is keyed on for these weights, and how it was found (for the log)."""

    digest: str
    source: str  # "model_identity" or "content"
    files: int = 0
    total_bytes: int = 0
    read_bytes: int = 0  # (0: every digest was remembered)
    seconds: float = 0.0

    def describe(self) -> str:
        if self.source == "model_identity":
            return "weights named by model_identity"
        read = "remembered" if not self.read_bytes else \
            f"{self.read_bytes / 2**30:.2f} GiB read in {self.seconds:.1f} s"
        return (f"weights identified by content ({self.files} files, "
                f"{self.total_bytes / 2**30:.2f} GiB, {read})")


def weight_files(model: str, revision: str | None = None) -> WeightFiles | None:
    """The local weight files of ``model`` (a directory, a single weight file, or a hub
    cache snapshot), or None when there are none here."""
    path = Path(model)
    if path.is_file() and path.suffix in WEIGHT_SUFFIXES:  # (a single-file model: GGUF)
        return WeightFiles(path.parent, (path,))
    directory = path if path.is_dir() else _hub_snapshot(model, revision)
    if directory is None:
        return None
    files = tuple(sorted(p for p in directory.rglob("*")
                         if p.suffix in WEIGHT_SUFFIXES and p.is_file()))
    return WeightFiles(directory, files) if files else None


def identify_weights(model: str, revision: str | None = None, *,
                     named: str | None = None,
                     digests: FileDigests | None = None) -> WeightsIdentity | None:
    """The identity of ``model``'s weights (see the module docstring); None: none found.
    Raises OSError when a weight file cannot be read."""
    if named is not None:
        return WeightsIdentity(xxhash.xxh3_128_hexdigest(named.encode()), "model_identity")
    found = weight_files(model, revision)
    if found is None:
        return None
    started = time.monotonic()
    each = (digests or FileDigests()).digests(found.files)
    identity = xxhash.xxh3_128()
    for file in each:
        identity.update(f"{file.path.relative_to(found.root)}\0{file.size}\0{file.digest}\n"
                        .encode())
    return WeightsIdentity(identity.hexdigest(), "content", len(each),
                           sum(f.size for f in each),
                           sum(f.size for f in each if not f.remembered),
                           time.monotonic() - started)


def looks_remote(model: str) -> bool:
    """A model named by a URL (``s3://``, ``gs://``...): its weights are never local files."""
    return "://" in model and not os.path.exists(model)


class PendingWeights:
    """The weights identity, worked out on a thread from the moment the connector is built
    (see "When" in the module docstring)."""

    def __init__(self, model: str, revision: str | None, named: str | None = None,
                 digests: FileDigests | None = None) -> None:
        self.model, self.revision, self.named = model, revision, named
        self._digests = digests or FileDigests()
        self._thread: threading.Thread | None = None
        if named is None and not looks_remote(model):
            self._thread = threading.Thread(target=self._warm, daemon=True,
                                            name="kv-offload-weights")
            self._thread.start()

    def _warm(self) -> None:
        try:  # (remembers the digests; `result` lists and checks the files again)
            identify_weights(self.model, self.revision, digests=self._digests)
        except Exception as exc:  # (result() reads again and raises what it finds)
            logger.debug("kv-offload: early weights digest failed: %s", exc)

    def result(self) -> WeightsIdentity | None:
        """The identity now (waits for the early digest; reads what changed since)."""
        if self._thread is not None:
            self._thread.join()
        return identify_weights(self.model, self.revision, named=self.named,
                                digests=self._digests)


def require_identity(identity: WeightsIdentity | None, model: str,
                     storage_tier: str | None) -> None:
    """With a storage tier, no identity is a start-up error naming the fix."""
    if identity is None and storage_tier is not None:
        raise ConfigError(
            f"the weights of {model!r} are not local files, so kv-offload cannot tell them "
            f"apart from other weights under the same name, and storage_tier "
            f"{storage_tier!r} keeps records beyond this process; set model_identity in "
            f"kv_connector_extra_config to a string that changes whenever the weights do "
            f"(e.g. a deploy version or checkpoint id)")


def _hub_snapshot(model: str, revision: str | None) -> Path | None:
    """The Hugging Face cache snapshot of ``model`` at ``revision``, without network."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception as exc:  # not in the cache (yet): no local files
        logger.debug("kv-offload: no hub cache snapshot of %r (%s)", model, exc)
        return None
