"""The host executor itself (host_cuda.py, host_kernel.py) against the CUDA runtime
documentation, without our copier: the GPU path's tests are only as good as it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kv_offload.kernels.runtime import MEMCPY_DEFAULT, MemcpyAttributes

from helpers.host_cuda import HostCudaError, HostCudaRuntime
from helpers.host_kernel import compile_kernel, compiler


@pytest.fixture
def rt():
    return HostCudaRuntime(sync_timeout_s=0.2)


def device(rt: HostCudaRuntime, nbytes: int, seed: int = 0) -> torch.Tensor:
    buffer = torch.from_numpy(np.random.default_rng(seed).integers(0, 256, nbytes,
                                                                   dtype=np.uint8))
    rt.register(buffer)
    return buffer


def test_memcpy2d_copies_height_rows_of_width_bytes_between_pitches(rt):
    src, dst = device(rt, 4096, 1), device(rt, 4096, 2)
    expected = dst.numpy().copy()
    expected[100:100 + 5 * 300].reshape(5, 300)[:, :40] = \
        src.numpy()[7:7 + 5 * 64].reshape(5, 64)[:, :40]
    stream = rt.new_stream()
    rt.memcpy2d_async(dst.data_ptr() + 100, 300, src.data_ptr() + 7, 64, 40, 5, MEMCPY_DEFAULT,
                      stream)
    assert not np.array_equal(dst.numpy(), expected)  # nothing runs while enqueueing
    rt.run()
    assert np.array_equal(dst.numpy(), expected)


@pytest.mark.parametrize("args, code", [
    (dict(width=65, spitch=64), "cudaErrorInvalidPitchValue"),
    (dict(width=65, dpitch=64), "cudaErrorInvalidPitchValue"),
    (dict(kind=9), "cudaErrorInvalidMemcpyDirection"),
    (dict(height=100), "cudaErrorInvalidValue"),  # runs past the allocation
])
def test_memcpy2d_refuses_what_the_runtime_refuses(rt, args, code):
    src, dst = device(rt, 4096), device(rt, 4096)
    call = dict(dst=dst.data_ptr(), dpitch=128, src=src.data_ptr(), spitch=128, width=64,
                height=2, kind=MEMCPY_DEFAULT, stream=rt.new_stream()) | args
    with pytest.raises(HostCudaError, match=code):
        rt.memcpy2d_async(**call)


def test_pitches_above_the_device_maximum_are_refused():
    rt = HostCudaRuntime(max_pitch=1024)
    src, dst = device(rt, 8192), device(rt, 8192)
    with pytest.raises(HostCudaError, match="cudaErrorInvalidPitchValue"):
        rt.memcpy2d_async(dst.data_ptr(), 2048, src.data_ptr(), 64, 64, 2, MEMCPY_DEFAULT,
                          rt.new_stream())


def test_a_wait_holds_the_stream_for_the_record_made_before_it(rt):
    src, dst = device(rt, 256, 1), device(rt, 256, 2)
    copy, event = rt.new_stream(), rt.new_event()
    assert rt.query(event)  # never recorded: complete
    rt.hold(rt.engine)
    rt.enqueue_host(rt.engine, lambda: src.fill_(9), "forward")
    rt.record(event, rt.engine)
    rt.stream_wait_event(copy, event)
    rt.memcpy2d_async(dst.data_ptr(), 256, src.data_ptr(), 256, 256, 1, MEMCPY_DEFAULT, copy)
    done = rt.new_event()
    rt.record(done, copy)
    assert not rt.query(done) and not rt.query(event)
    rt.release(rt.engine)
    assert rt.query(done) and (dst == 9).all()


def test_without_a_wait_the_copy_stream_runs_ahead(rt):
    src, dst = device(rt, 256, 1), device(rt, 256, 2)
    before = src.clone()
    copy = rt.new_stream()
    rt.hold(rt.engine)
    rt.enqueue_host(rt.engine, lambda: src.fill_(9), "forward")
    rt.memcpy2d_async(dst.data_ptr(), 256, src.data_ptr(), 256, 256, 1, MEMCPY_DEFAULT, copy)
    rt.run()
    assert torch.equal(dst, before)  # read before the forward wrote


def test_synchronize_on_work_that_cannot_finish_reports_a_deadlock(rt):
    event = rt.new_event()
    rt.hold(rt.engine)
    rt.record(event, rt.engine)
    with pytest.raises(HostCudaError, match="never completes"):
        rt.synchronize(event)


def batch_args(rt, **changes):
    src, dst = device(rt, 1024, 1), device(rt, 1024, 2)
    args = dict(dsts=np.array([dst.data_ptr(), dst.data_ptr() + 512]),
                srcs=np.array([src.data_ptr(), src.data_ptr() + 512]), sizes=np.array([100, 200]),
                attrs=[MemcpyAttributes()], attrs_idxs=[0], stream=rt.new_stream())
    return args | changes, src, dst


def test_a_batch_copies_each_descriptor(rt):
    args, src, dst = batch_args(rt)
    expected = dst.clone()
    expected[:100], expected[512:712] = src[:100], src[512:712]
    rt.memcpy_batch_async(**args)
    rt.run()
    assert torch.equal(dst, expected)


@pytest.mark.parametrize("changes", [
    dict(attrs_idxs=[1]),
    dict(attrs=[MemcpyAttributes(), MemcpyAttributes()], attrs_idxs=[0, 0]),
    dict(attrs=[MemcpyAttributes()] * 3, attrs_idxs=[0, 1, 2]),
    dict(attrs=[MemcpyAttributes(src_access_order=0)]),
    dict(sizes=np.array([100])),
    dict(sizes=np.array([600, 10])),  # the first copy overlaps the second's destination
])
def test_a_batch_refuses_what_the_runtime_refuses(rt, changes):
    args, _, _ = batch_args(rt, **changes)
    with pytest.raises(HostCudaError, match="cudaErrorInvalidValue"):
        rt.memcpy_batch_async(**args)


def test_a_batch_is_refused_on_the_legacy_null_stream(rt):
    args, _, _ = batch_args(rt, stream=rt.engine)
    with pytest.raises(HostCudaError, match="legacy NULL stream"):
        rt.memcpy_batch_async(**args)


@pytest.mark.skipif(compiler() is None, reason="needs a C++ compiler")
def test_the_host_kernel_runs_every_block_and_thread_with_cuda_builtins():
    source = r"""
    extern "C" __global__ void ids(unsigned int* out, int scale) {
        unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
        out[i] = scale * (blockIdx.x * 1000 + threadIdx.x) + gridDim.x;
    }"""
    kernel = compile_kernel(source, "ids")
    out = np.zeros(3 * 4, dtype=np.uint32)
    kernel((3, 1, 1), (4, 1, 1), [np.array(out.ctypes.data, dtype=np.uint64),
                                  np.array(2, dtype=np.int32)])
    expected = [2 * (b * 1000 + t) + 3 for b in range(3) for t in range(4)]
    assert out.tolist() == expected
    assert compile_kernel(source, "ids") is kernel  # cached per source hash


@pytest.mark.skipif(compiler() is None, reason="needs a C++ compiler")
def test_a_kernel_that_synchronizes_threads_is_refused():
    source = r"""extern "C" __global__ void k(int* x) { x[threadIdx.x] = 1; __syncthreads(); }"""
    with pytest.raises(RuntimeError, match="host build of the kernel failed"):
        compile_kernel(source, "k")
