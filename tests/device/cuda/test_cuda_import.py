"""CPU tests: the CUDA backend imports and explains itself on a machine without a GPU."""

from __future__ import annotations

import importlib

import pytest

import ringflow as rf


def test_backend_imports_without_a_gpu():
    cuda = importlib.import_module("ringflow._device.cuda")
    ok, reason = cuda.probe()
    assert isinstance(ok, bool)
    assert isinstance(reason, str) and reason


def test_probe_and_factory_agree():
    cuda = importlib.import_module("ringflow._device.cuda")
    assert cuda.probe() == rf.cuda_available()


def test_no_gpu_here_gives_clear_errors():
    cuda = importlib.import_module("ringflow._device.cuda")
    ok, reason = cuda.probe()
    if ok:
        pytest.skip("a GPU is usable here")
    with pytest.raises(RuntimeError, match="not usable"):
        rf.device("cuda:0")
    with pytest.raises(RuntimeError, match="no usable CUDA GPU"):
        cuda.CudaDevice(0)
    assert rf.device("auto").backend == "sim"


def test_unknown_array_kind_is_refused():
    from ringflow._device.cuda.arrays import resolve

    with pytest.raises(ValueError, match="unknown array type"):
        resolve("jax")
    assert resolve("dlpack").name == "dlpack"


def test_sticky_error_names_are_recognised():
    from ringflow._device.cuda._lib import device_error, is_sticky

    assert is_sticky(RuntimeError("CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered"))
    assert is_sticky(RuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered"))
    assert not is_sticky(RuntimeError("CUDA_ERROR_OUT_OF_MEMORY: out of memory"))
    err = device_error("waiting", RuntimeError("CUDA_ERROR_LAUNCH_FAILED: unspecified launch failure"))
    assert err.sticky and "context is broken" in str(err)


def test_out_of_memory_is_a_memory_error_that_leaves_the_context_usable(monkeypatch):
    """cuda.core's CUDAError naming CUDA_ERROR_OUT_OF_MEMORY (and a cuda.bindings result of it)
    becomes an OutOfMemoryError: a DeviceError, never sticky, and a MemoryError, so the ring the
    pipeline failed to allocate is named as on the simulated GPU."""
    import enum

    from ringflow._device.cuda import _lib
    from ringflow._errors import DeviceError, OutOfMemoryError
    from ringflow._pipeline.ring import allocate_ring
    from ringflow._pipeline.states import RingKind

    for text in ("CUDA_ERROR_OUT_OF_MEMORY: out of memory", "cudaErrorMemoryAllocation: out of memory"):
        err = _lib.device_error("allocating 4096 bytes of device memory", RuntimeError(text))
        assert isinstance(err, OutOfMemoryError) and isinstance(err, DeviceError) and isinstance(err, MemoryError)
        assert not err.sticky and "context is broken" not in str(err)
        assert str(err).startswith(f"allocating 4096 bytes of device memory failed: RuntimeError: {text}")
        assert "not a broken context" in str(err)

    class Result(enum.IntEnum):  # stands for cuda.bindings' CUresult
        CUDA_ERROR_OUT_OF_MEMORY = 2

    with pytest.raises(OutOfMemoryError, match="cuMemHostRegister of 64 bytes failed: CUDA_ERROR_OUT_OF_MEMORY") as info:
        _lib.check((Result.CUDA_ERROR_OUT_OF_MEMORY,), "cuMemHostRegister of 64 bytes")
    assert not info.value.sticky

    # translate(), as the backend wraps cuda.core's calls (cuda.core's error type stood in for)
    monkeypatch.setattr(_lib, "cuda_errors", lambda: (RuntimeError,))

    def allocate(nbytes):
        with _lib.translate(f"allocating {nbytes} bytes of device memory"):
            raise RuntimeError("CUDA_ERROR_OUT_OF_MEMORY: out of memory")

    with pytest.raises(OutOfMemoryError, match="allocating 4096 bytes of device memory failed"):
        allocate(4096)
    with pytest.raises(MemoryError, match=r"device-in ring: 4 slots of chunk_bytes=1024 bytes, 4096 bytes.*smaller "
                                          r"chunk_bytes or fewer slots"):
        allocate_ring(allocate, RingKind.DEVICE_IN, 1024, 4)


def test_thread_worker_pool_runs_tasks_without_a_gpu():

    from ringflow._device.cuda.pool import ThreadWorkerPool, WorkerThreads

    threads = WorkerThreads()
    with pytest.raises(ValueError):
        ThreadWorkerPool(0, threads)
    pool = ThreadWorkerPool(2, threads)
    ok = pool.submit(sum, [1, 2, 3])
    bad = pool.submit(lambda: 1 / 0)
    for task in (ok, bad):
        task.sync()
        assert task.is_done
    assert ok.result() == 6
    start, end = ok.span
    assert end is not None and end >= start
    with pytest.raises(ZeroDivisionError):
        bad.result()
    pool.close()
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(print)
    # the threads belong to the device's WorkerThreads: closing a pool leaves them running, for
    # the next pool of its size
    again = ThreadWorkerPool(2, threads)
    assert again._executor is pool._executor
    task = again.submit(sum, [4])
    task.sync()
    assert task.result() == 4
    again.close()
    threads.shutdown()


@pytest.mark.parametrize("module, cls, names", [("ringflow._device.cuda.stream", "CudaStream", ("owner", "closed")),
                                                ("ringflow._device.sim.stream", "SimStream", ("owner",))])
def test_each_backends_stream_reads_its_device_and_state_as_properties(module, cls, names):
    """``owner`` (and the CUDA stream's ``closed``) are plain properties (the class is checked
    without a GPU: a mangled decorator there once made ``owner`` uncallable on a GPU)."""
    import inspect

    stream_cls = getattr(importlib.import_module(module), cls)
    for name in names:
        attr = inspect.getattr_static(stream_cls, name)
        assert isinstance(attr, property) and inspect.isfunction(attr.fget), (cls, name, attr)
