"""``Pipeline(like=...)``: results as another framework's arrays over the same memory."""

from __future__ import annotations

import concurrent.futures
import gc
import importlib.util

import numpy as np
import pytest

import ringflow as rf


def f(x, y):
    y[...] = x * 2 + 1


def copy(x, y):
    if isinstance(x, tuple):
        y[0][...], y[1]["k"][...] = x[0], x[1]["k"]
    else:
        y[...] = x


HAVE_TORCH = importlib.util.find_spec("torch") is not None


@pytest.mark.parametrize("kwargs, match", [
    ({"like": "jax"}, "like must be one of 'numpy', 'torch', 'cupy'"),
    # (an array holding the name: `in` and `==` compare its elements, and it passed as 'numpy')
    ({"like": np.array(["numpy"])}, r"like must be one of 'numpy', 'torch', 'cupy' or None, got array\(\['numpy'\]"),
    ({"like": ["torch"]}, "like must be one of 'numpy', 'torch', 'cupy' or None, got \\['torch'\\]"),
    ({"like": "cupy"}, "like='cupy' needs deliver='device'"),
    ({"like": "numpy", "deliver": "device"}, "like='numpy' cannot hold results on the device"),
    ({"like": "torch", "deliver": "device"}, "needs a CUDA GPU|needs torch"),
    ({"like": "numpy", "consume": lambda i, it, r: r}, "with consume= the consumer makes the result"),
])
def test_like_choices_that_cannot_work_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rf.Pipeline(f, device=rf.device("sim"), chunk_bytes=4096, **kwargs)


def test_like_numpy_is_the_default():
    with rf.Pipeline(f, device=rf.device("sim"), chunk_bytes=4096, like="numpy") as pipe:
        r = pipe.submit(np.ones(4, np.float32)).result()
    assert type(r) is np.ndarray and rf.host.buffer(r) is not None


@pytest.mark.skipif(HAVE_TORCH, reason="checks the message when torch is missing")
def test_like_torch_without_torch_says_so():
    with pytest.raises(ValueError, match="like='torch' needs torch"):
        rf.Pipeline(f, device=rf.device("sim"), chunk_bytes=4096, like="torch")


@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
def test_like_torch_gives_tensors_over_the_pinned_results():
    import torch

    with rf.Pipeline(f, device=rf.device("sim"), chunk_bytes=4096, like="torch") as pipe:
        r = pipe.submit(np.arange(4, dtype=np.float32)).result()
    with rf.Pipeline(copy, device=rf.device("sim"), chunk_bytes=4096, like="torch") as pipe:
        t = pipe.submit((np.ones(2, np.float32), {"k": np.zeros(3, np.int16)})).result()
    assert isinstance(r, torch.Tensor) and r.tolist() == [1.0, 3.0, 5.0, 7.0]
    assert isinstance(t[0], torch.Tensor) and isinstance(t[1]["k"], torch.Tensor)
    assert t[0].tolist() == [1.0, 1.0] and t[1]["k"].tolist() == [0, 0, 0]


@pytest.mark.parametrize("coalesce", [True, False])
@pytest.mark.parametrize("dtype", list("?bBhHiIlLqQefdFD"))
def test_like_torch_gives_a_tensor_for_every_device_dtype_however_numpy_spells_it(dtype, coalesce):
    # numpy has two scalar types for one 64-bit dtype ('L' and 'Q' are both uint64 on Linux,
    # equal as dtypes): PyTorch takes only one of each pair, by its type, not its size
    torch = pytest.importorskip("torch")
    x = np.arange(6).astype(dtype).reshape(2, 3)
    with rf.Pipeline(copy, device=rf.device("sim"), chunk_bytes=4096, like="torch", coalesce=coalesce) as pipe:
        r = pipe.submit(x).result(timeout=30)
        packed = pipe.submit((x, {"k": x[:1]})).result(timeout=30)
    assert isinstance(r, torch.Tensor) and tuple(r.shape) == (2, 3)
    assert np.array_equal(r.numpy(), x) and r.numpy().dtype == x.dtype
    assert isinstance(packed[1]["k"], torch.Tensor) and np.array_equal(packed[1]["k"].numpy(), x[:1])


def refuse_uint16(monkeypatch):
    """torch.from_numpy refusing uint16 arrays, as an older PyTorch (which has no uint16 tensors) does."""
    torch = pytest.importorskip("torch")
    from_numpy = torch.from_numpy

    def old_from_numpy(a):
        if a.dtype == np.uint16:
            raise TypeError("can't convert np.ndarray of type numpy.uint16. The only supported types are: ...")
        return from_numpy(a)

    monkeypatch.setattr(torch, "from_numpy", old_from_numpy)


@pytest.mark.parametrize("coalesce", [True, False])
def test_like_torch_a_result_torch_refuses_fails_its_item_alone_by_name(monkeypatch, coalesce):
    refuse_uint16(monkeypatch)
    with rf.Pipeline(copy, device=rf.device("sim"), chunk_bytes=1 << 16, like="torch", coalesce=coalesce,
                     on_error="continue") as pipe:
        items = [np.full(100, i, np.uint16 if i % 3 == 1 else np.float32) for i in range(30)]
        futs = [pipe.submit(x) for x in items]
        for i, fut in enumerate(futs):
            if i % 3 == 1:
                with pytest.raises(rf.StageError) as info:
                    fut.result(timeout=30)
                assert "like='torch'" in str(info.value) and "uint16" in str(info.value)
                assert "like unset" in str(info.value)
            else:
                assert fut.result(timeout=30).tolist() == [float(i)] * 100
        assert pipe.submit(np.ones(3, np.float32)).result(timeout=30).tolist() == [1.0] * 3
        assert pipe.stats().failed == 10


@pytest.mark.parametrize("coalesce", [True, False])
def test_like_torch_a_result_torch_refuses_stops_the_pipeline_under_on_error_raise(monkeypatch, coalesce):
    refuse_uint16(monkeypatch)
    with rf.Pipeline(copy, device=rf.device("sim"), chunk_bytes=1 << 16, like="torch", coalesce=coalesce) as pipe:
        futs = []
        for i in range(30):
            try:
                futs.append(pipe.submit(np.full(100, i, np.uint16 if i == 5 else np.float32)))
            except RuntimeError as err:  # the failure came first and stopped the pipeline
                assert "no longer accepts work" in str(err)
                break
        ends = []
        for fut in futs:  # every item ends: none is left waiting
            try:
                fut.result(timeout=30)
                ends.append("delivered")
            except rf.StageError as err:
                assert "like='torch'" in str(err) and err.stage == "consume"
                ends.append("failed")
            except concurrent.futures.CancelledError:
                ends.append("cancelled")
        assert ends[5] == "failed" and ends.count("failed") == 1
        with pytest.raises(RuntimeError, match="no longer accepts work"):
            pipe.submit(np.ones(3, np.float32))


@pytest.mark.parametrize("coalesce", [True, False])
def test_like_torch_a_kept_tensor_holds_its_pool_block_until_dropped(coalesce):
    torch = pytest.importorskip("torch")
    dev = rf.device("sim")
    with rf.Pipeline(f, device=dev, chunk_bytes=1 << 16, like="torch", coalesce=coalesce) as pipe:
        kept = pipe.submit(np.full(1000, 3, np.float32)).result(timeout=30)
        for _ in range(3):  # more work than the pool has blocks free: freed blocks are taken again
            outs = [pipe.submit(np.full(1000, i, np.float32)).result(timeout=30) for i in range(40)]
            assert kept.data_ptr() not in {o.data_ptr() for o in outs}
            del outs
            gc.collect()
        assert isinstance(kept, torch.Tensor) and bool((kept == 7).all())
        if not coalesce:  # (a shared chunk's slab is held by the pipeline's open slab too)
            held = rf.host.stats(device=dev).in_use_bytes
            del kept
            gc.collect()
            assert rf.host.stats(device=dev).in_use_bytes < held


@pytest.mark.parametrize("error", [ImportError("No module named 'torch'"),
                                   OSError("libtorch_cpu.so: cannot open shared object file")])
def test_like_torch_that_cannot_be_imported_is_named_at_construction(monkeypatch, error):
    # (a broken install fails its import with an OSError from the loader, not an ImportError)
    import builtins

    real_import = builtins.__import__

    def failing_import(name, *args, **kwargs):
        if name == "torch":
            raise error
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", failing_import)
    with pytest.raises(ValueError, match=r"like='torch' needs torch, which cannot be imported here \(.*"
                                         + str(error).split(":")[0]):
        rf.Pipeline(f, device=rf.device("sim"), chunk_bytes=4096, like="torch")


@pytest.mark.parametrize("index", [0, 1])
def test_device_results_as_tensors_are_made_on_the_pipelines_own_gpu(monkeypatch, index):
    """On a host of several GPUs a device result lives on the pipeline's GPU: torch.as_tensor(a,
    device="cuda") makes the tensor on PyTorch's current GPU, copying a result of cuda:1 to cuda:0
    when that is current on the converting thread. (CuPy takes the GPU of the memory itself.)"""
    import sys
    import types

    from ringflow._pipeline.like import converter

    calls = []
    fake = types.ModuleType("torch")
    fake.as_tensor = lambda a, device=None: calls.append(device) or a
    monkeypatch.setitem(sys.modules, "torch", fake)
    convert = converter("torch", "device", types.SimpleNamespace(backend="cuda", index=index))
    a = object()
    assert convert(a) is a and calls == [f"cuda:{index}"]
