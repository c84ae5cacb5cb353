"""The dtypes a device array may have and a sample of those it may not, with what the refusal
says to do instead: shared by the device layer's, the simulated GPU's, the pipeline's and the
CUDA backend's tests of the one rule (``ringflow._device.protocol.check_device_dtype``)."""

from __future__ import annotations

import re

import numpy as np

# every dtype an array on a device may have (bool, integers, floats and complex numbers)
DEVICE_DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
                 "float32", "float64", "complex64", "complex128"]

# (dtype, what the refusal's advice says): numpy holds each of them, no GPU array type does
NOT_DEVICE_DTYPES = [
    (np.dtype("M8[s]"), r"a\.view\(np\.int64\)"),
    (np.dtype("m8[ns]"), r"a\.view\(np\.int64\)"),
    (np.dtype("U3"), r"a\.view\(np\.uint32\)"),
    (np.dtype("S4"), r"a\.view\(np\.uint8\)"),
    (np.dtype(np.longdouble), r"a\.astype\(np\.float64\)"),
    (np.dtype(np.clongdouble), r"a\.astype\(np\.complex128\)"),
    (np.dtype("V4"), r"a\.view\(np\.uint32\)"),
    (np.dtype("V7"), r"a\.view\(np\.uint8\)"),
    (np.dtype([("a", "f4"), ("b", "i2")]), r"each field as an array of its own"),
]
NOT_DEVICE_IDS = ["datetime64", "timedelta64", "str", "bytes", "longdouble", "clongdouble", "V4", "V7", "record"]


def refusal(dtype: np.dtype, advice: str) -> str:
    """The pattern a refusal of ``dtype`` matches after its argument's name: the dtype, the
    dtypes a device takes, and ``advice``."""
    return (rf"dtype {re.escape(str(dtype))} cannot be an array on a GPU .*a device array's dtype is bool, int8 to int64, "
            rf"uint8 to uint64, float16, float32, float64, complex64 or complex128: .*{advice}")


def holding_no_uint16(dev):
    """``dev``, whose arrays hold no uint16 (as a GPU's do when it hands computes the tensors of a
    PyTorch without unsigned 16-bit ones): its :meth:`check_dtype` narrows the rule."""
    rule = dev.check_dtype

    def check_dtype(name, dtype):
        rule(name, dtype)
        if dtype == np.uint16:
            raise TypeError(f"{name}: dtype {dtype} is not held by this device's arrays")

    dev.check_dtype = check_dtype
    return dev
