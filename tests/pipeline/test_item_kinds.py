"""What a pipeline of plain arrays accepts as an item: numpy arrays, CPU DLPack producers (torch
CPU tensors), and objects with ``__array__``, each viewed without a copy; device arrays are
refused by name (items are host memory)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import ringflow as rf
from tests.helpers.dlpack import DLPackOnly


def f(x, y):
    y[...] = x * 2 + 1


class CudaDlpack(DLPackOnly):
    def __dlpack_device__(self):
        return (2, 0)  # kDLCUDA


class WithArray:
    def __init__(self, a):
        self._a = a

    def __array__(self, dtype=None, copy=None):
        return self._a


class DeviceArray:
    __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0, False), "version": 3}


def kinds(a):
    return {"numpy": a, "dlpack": DLPackOnly(a), "__array__": WithArray(a), "non-contiguous": a[::2]}


@pytest.mark.parametrize("kind", ["numpy", "dlpack", "__array__", "non-contiguous"])
@pytest.mark.parametrize("how", ["submit", "map", "asubmit"])
def test_every_host_kind_comes_back_exact(kind, how):
    dev = rf.device("sim", chaos=True, seed=1)
    base = [np.random.default_rng(i).standard_normal(64).astype(np.float32) for i in range(6)]
    items = [kinds(a)[kind] for a in base]
    arrays = [a[::2] if kind == "non-contiguous" else a for a in base]
    with rf.Pipeline(f, device=dev, chunk_bytes=4096) as pipe:
        if how == "submit":
            out = [fu.result() for fu in [pipe.submit(it) for it in items]]
        elif how == "map":
            out = list(pipe.map(items))
        else:
            async def go():
                return [await pipe.asubmit(it) for it in items]
            out = asyncio.run(go())
    for a, r in zip(arrays, out, strict=True):
        np.testing.assert_array_equal(r, a * 2 + 1)


def test_a_cpu_tensor_is_viewed_not_copied_before_staging():
    a = np.arange(8, dtype=np.float32)
    from ringflow._pipeline.validate import as_host_array

    assert np.shares_memory(as_host_array(DLPackOnly(a)), a) and np.shares_memory(as_host_array(WithArray(a)), a)


@pytest.mark.parametrize("item, match", [
    (DeviceArray(), "must be host arrays; got a device array"),
    (CudaDlpack(np.ones(3, np.float32)), "DLPack device type 2"),
    (WithArray(np.array([object()])), "holds Python objects"),
    ("a string", "must be numpy arrays, torch CPU tensors"),
    (3.5, "must be numpy arrays"),
])
def test_device_arrays_and_non_arrays_are_refused_by_name(item, match):
    with rf.Pipeline(f, device=rf.device("sim"), chunk_bytes=4096) as pipe:
        with pytest.raises(TypeError, match=match):
            pipe.submit(item)
        # refused before acceptance: the pipeline goes on
        assert np.array_equal(pipe.submit(np.ones(4, np.float32)).result(), np.full(4, 3, np.float32))
        with pytest.raises(TypeError, match=match):
            list(pipe.map([np.ones(4, np.float32), item]))
    assert pipe.stats().in_flight == 0


def test_torch_cpu_tensors_when_torch_is_there():
    torch = pytest.importorskip("torch")
    t = torch.arange(10, dtype=torch.float32)
    with rf.Pipeline(f, device=rf.device("sim"), chunk_bytes=4096) as pipe:
        r = pipe.submit(t).result()
    np.testing.assert_array_equal(r, np.arange(10, dtype=np.float32) * 2 + 1)
