"""The device protocol's shared behaviour, as every backend inherits it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ringflow._device import protocol
from tests.helpers import unit_device
from tests.helpers.dtypes import DEVICE_DTYPES, NOT_DEVICE_DTYPES, NOT_DEVICE_IDS, refusal


@pytest.mark.parametrize("seconds,error", [(-1.0, ValueError), (math.nan, ValueError), (1e300, ValueError),
                                           ("1", TypeError), (None, TypeError)], ids=repr)
def test_a_real_clock_sleep_checks_seconds_as_the_simulated_one_does(seconds, error):
    """The sleep a real GPU inherits refuses what the simulated GPU's refuses, in the same words."""
    with pytest.raises(error, match=r"sleep\(seconds\) must be a number of seconds"):
        protocol.Device.sleep(unit_device(), seconds)


def test_a_real_clock_sleep_of_zero_returns():
    protocol.Device.sleep(unit_device(), 0)


@pytest.mark.parametrize("dtype", DEVICE_DTYPES + [np.longlong, np.intc, np.ulonglong, "=f4", np.dtype("f4").newbyteorder("=")])
def test_the_dtypes_of_device_arrays_are_taken(dtype):
    protocol.check_device_dtype("x", np.dtype(dtype))


@pytest.mark.parametrize("dtype,advice", NOT_DEVICE_DTYPES, ids=NOT_DEVICE_IDS)
def test_a_dtype_no_gpu_array_holds_is_refused_naming_the_argument_and_what_to_pass(dtype, advice):
    """numpy holds dates, strings, records, raw bytes and long doubles, so the simulated GPU moved
    and computed on them; CuPy, PyTorch and CUDA kernels have no such types, so on a GPU the same
    program failed in the framework, at the first compute. One rule refuses them on both."""
    with pytest.raises(TypeError, match=r"^x: " + refusal(dtype, advice)):
        protocol.check_device_dtype("x", dtype)


@pytest.mark.parametrize("dtype,error,says", [
    (np.dtype(object), TypeError, r"dtype object holds Python objects.*use a numeric dtype"),
    (np.dtype([("a", "f4"), ("b", object)]), TypeError, r"dtype .* holds Python objects"),
    (np.dtype(">f4"), TypeError, r"dtype >f4 is in non-native byte order.*newbyteorder"),
    (np.dtype("V0"), ValueError, r"dtype \|V0 has items of 0 bytes.*such as 'u1'"),
], ids=["object", "object field", "swapped", "V0"])
def test_objects_swapped_bytes_and_empty_items_keep_their_own_words(dtype, error, says):
    with pytest.raises(error, match=r"^x: " + says):
        protocol.check_device_dtype("x", dtype)


@pytest.mark.parametrize("dtype,advice", NOT_DEVICE_DTYPES[:3], ids=NOT_DEVICE_IDS[:3])
def test_a_device_checks_dtypes_by_the_rule_unless_its_backend_narrows_it(dtype, advice):
    device = unit_device()
    with pytest.raises(TypeError, match=r"^items: " + refusal(dtype, advice)):
        protocol.Device.check_dtype(device, "items", dtype)
    for taken in DEVICE_DTYPES:
        protocol.Device.check_dtype(device, "items", np.dtype(taken))
