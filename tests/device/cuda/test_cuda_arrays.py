"""The arrays a compute receives on a CUDA device: every device dtype becomes an array of that
dtype in each framework (GPU), and PyTorch's own gaps are refused by name (CPU, with a stand-in
for an older PyTorch)."""

from __future__ import annotations

import numpy as np
import pytest

from ringflow._device.cuda import arrays
from tests.helpers.dtypes import DEVICE_DTYPES

from .helpers_cuda import array_kinds


class _OlderTorch:
    """What an older PyTorch's numpy import does: no tensors of unsigned 16, 32 or 64 bits."""

    __version__ = "2.0.1"

    @staticmethod
    def from_numpy(a):
        if a.dtype.kind == "u" and a.itemsize > 1:
            raise TypeError(f"can't convert np.ndarray of type numpy.{a.dtype}")
        return a


def _older_torch_adapter():
    adapter = arrays.TorchAdapter.__new__(arrays.TorchAdapter)  # no GPU here: not through __init__
    adapter._torch = _OlderTorch
    adapter.unheld = arrays.torch_unheld(_OlderTorch)
    return adapter


def test_the_device_dtypes_an_older_torch_lacks_are_found_on_the_host():
    assert arrays.torch_unheld(_OlderTorch) == {np.dtype("u2"), np.dtype("u4"), np.dtype("u8")}


@pytest.mark.parametrize("dtype", ["uint16", "uint32", "uint64"])
def test_a_dtype_torch_lacks_is_refused_by_name_with_what_to_do(dtype):
    adapter = _older_torch_adapter()
    with pytest.raises(TypeError, match=rf"^x: dtype {dtype} cannot be a tensor of PyTorch 2\.0\.1.*array='cupy'.*"
                                        rf"a\.view\(np\.int{8 * np.dtype(dtype).itemsize}\)"):
        adapter.check_dtype("x", np.dtype(dtype))


@pytest.mark.parametrize("dtype", [d for d in DEVICE_DTYPES if d not in ("uint16", "uint32", "uint64")])
def test_the_device_dtypes_an_older_torch_has_are_taken(dtype):
    _older_torch_adapter().check_dtype("x", np.dtype(dtype))


def _framework_dtype(kind, a):
    """The numpy dtype of ``a``, an array ``kind`` handed a compute."""
    if kind == "torch":
        return np.dtype(str(a.dtype).removeprefix("torch."))
    return np.dtype(a.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("kind", array_kinds())
def test_every_device_dtype_is_an_array_of_that_dtype_in_each_framework(kind, dtype):
    """What the simulated GPU takes, each array type holds (PyTorch: what this PyTorch has;
    what it lacks is refused when the array is made, naming the dtype)."""
    from ringflow._device.cuda import CudaDevice

    with CudaDevice(0, array=kind) as dev:
        buf = dev.allocate(256)
        if kind == "torch" and np.dtype(dtype) in dev._adapter.unheld:
            with pytest.raises(TypeError, match=rf"^array\(dtype\): dtype {dtype} cannot be a tensor of PyTorch"):
                buf.array(dtype, (2, 4))
        else:
            arg = buf.array(dtype, (2, 4))
            seen = []
            stream = dev.create_stream()
            stream.launch(lambda a: seen.append((tuple(a.shape), _framework_dtype(kind, a))), arg)
            stream.sync()
            assert seen == [((2, 4), np.dtype(dtype))]
            assert _framework_dtype(kind, dev.device_array(arg)) == np.dtype(dtype)
            stream.close()
        buf.close()
        assert dev.live().total == 0, dev.live()
