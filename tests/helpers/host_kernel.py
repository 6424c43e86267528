"""Compile a CUDA kernel source for the host, with the system C++ compiler.

The source string is compiled verbatim between a small shim and a launcher:
- the shim defines what a simple CUDA kernel takes from CUDA C++: `__global__`,
  the built-in `threadIdx`/`blockIdx`/`blockDim`/`gridDim`, and `int4` (16 bytes,
  16-byte aligned, like CUDA's). Nothing else: a kernel that synchronises its
  threads (`__syncthreads`) or uses shared memory does not compile here, because
  running threads one after another would not mean what it means on a GPU;
- the launcher `kvo_launch_<name>(grid x,y,z, block x,y,z, void** args)` runs every
  block, and in it every thread, as plain loops; `args[i]` points at the value of
  parameter i, the convention of `cuLaunchKernel`'s kernelParams.

Builds are cached per hash of everything compiled (shim, source, launcher, flags,
compiler) under `$KV_OFFLOAD_CACHE_DIR` or `~/.cache/kv-offload/host-kernels`, and
loaded once per process.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

SHIM = r"""
#include <cstddef>
#include <type_traits>
#include <utility>

struct uint3 { unsigned int x, y, z; };
struct dim3 { unsigned int x, y, z; };
struct __attribute__((aligned(16))) int4 { int x, y, z, w; };
#define __global__
static uint3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;

namespace kvo_host {
template <typename... A, std::size_t... I>
inline void call(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(args[I])...);
}

template <typename... A>
inline void run_grid(void (*kernel)(A...), dim3 grid, dim3 block, void** args) {
    gridDim = grid;
    blockDim = block;
    for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
    for (unsigned bx = 0; bx < grid.x; ++bx) {
        blockIdx = uint3{bx, by, bz};
        for (unsigned tz = 0; tz < block.z; ++tz)
        for (unsigned ty = 0; ty < block.y; ++ty)
        for (unsigned tx = 0; tx < block.x; ++tx) {
            threadIdx = uint3{tx, ty, tz};
            call(kernel, args, std::index_sequence_for<A...>{});
        }
    }
}
}  // namespace kvo_host
"""

LAUNCHER = r"""
extern "C" void kvo_launch_{name}(unsigned gx, unsigned gy, unsigned gz,
                                  unsigned bx, unsigned by, unsigned bz, void** args) {
    kvo_host::run_grid({name}, dim3{gx, gy, gz}, dim3{bx, by, bz}, args);
}
"""

FLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared", "-fno-strict-aliasing", "-x", "c++")

_loaded: dict[str, HostKernel] = {}
_lock = threading.Lock()


def compiler() -> str | None:
    """The system C++ compiler, if there is one."""
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def cache_dir() -> Path:
    root = os.environ.get("KV_OFFLOAD_CACHE_DIR") or Path.home() / ".cache" / "kv-offload"
    return Path(root) / "host-kernels"


class HostKernel:
    """One kernel of a source string, compiled for the host."""

    def __init__(self, library: ctypes.CDLL, name: str, path: Path) -> None:
        self.name = name
        self.path = path
        self._library = library  # keeps the library loaded
        self._launch = getattr(library, f"kvo_launch_{name}")
        self._launch.argtypes = [ctypes.c_uint] * 6 + [ctypes.c_void_p]
        self._launch.restype = None

    def __call__(self, grid: tuple[int, int, int], block: tuple[int, int, int],
                 args: Sequence[np.ndarray]) -> None:
        """Run the grid; `args` are 0-d arrays holding each parameter's value."""
        pointers = (ctypes.c_void_p * max(1, len(args)))(*[a.ctypes.data for a in args])
        self._launch(*grid, *block, pointers)


def compile_kernel(source: str, name: str) -> HostKernel:
    """Compile (or load from the cache) kernel `name` of the CUDA `source`."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX) to build the kernel for the host")
    text = SHIM + "\n#line 1 \"kernel.cu\"\n" + source + LAUNCHER.replace("{name}", name)
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256("\0".join([text, *FLAGS, version]).encode()).hexdigest()[:24]
    with _lock:
        if digest in _loaded:
            return _loaded[digest]
        path = cache_dir() / f"{name}-{digest}.so"
        if not path.exists():
            _build(cxx, text, path)
        kernel = _loaded[digest] = HostKernel(ctypes.CDLL(str(path)), name, path)
        return kernel


def _build(cxx: str, text: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        source = Path(tmp) / "kernel.cu"
        source.write_text(text)
        out = Path(tmp) / path.name
        done = subprocess.run([cxx, *FLAGS, str(source), "-o", str(out)],
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"host build of the kernel failed:\n{done.stderr}")
        os.replace(out, path)  # atomic: a concurrent build of the same hash is harmless
