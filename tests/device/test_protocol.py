"""The device protocol's shared behaviour, as every backend inherits it."""

from __future__ import annotations

import math

import pytest

from ringflow._device import protocol
from tests.helpers import unit_device


@pytest.mark.parametrize("seconds,error", [(-1.0, ValueError), (math.nan, ValueError), (1e300, ValueError),
                                           ("1", TypeError), (None, TypeError)], ids=repr)
def test_a_real_clock_sleep_checks_seconds_as_the_simulated_one_does(seconds, error):
    """The sleep a real GPU inherits refuses what the simulated GPU's refuses, in the same words."""
    with pytest.raises(error, match=r"sleep\(seconds\) must be a number of seconds"):
        protocol.Device.sleep(unit_device(), seconds)


def test_a_real_clock_sleep_of_zero_returns():
    protocol.Device.sleep(unit_device(), 0)
