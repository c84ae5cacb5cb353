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


def test_thread_worker_pool_runs_tasks_without_a_gpu():
    import concurrent.futures as cf

    from ringflow._device.cuda.pool import ThreadWorkerPool

    executor = cf.ThreadPoolExecutor(2)
    with pytest.raises(ValueError):
        ThreadWorkerPool(0, executor)
    pool = ThreadWorkerPool(2, executor)
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
    # the threads belong to the executor (the device's): closing a pool leaves them running
    again = ThreadWorkerPool(2, executor)
    task = again.submit(sum, [4])
    task.sync()
    assert task.result() == 4
    again.close()
    executor.shutdown()


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
