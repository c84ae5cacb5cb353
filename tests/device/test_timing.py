"""Event timing over the protocol, checked on the simulated GPU's exact clock."""

import pytest

import ringflow as rf
from ringflow._device.timing import time_events


def test_time_events_measures_the_enqueued_work():
    dev = rf.device("sim", profile="unit")
    s = dev.create_stream()
    h, d = dev.allocate_host(10**6), dev.allocate(10**6)
    times = time_events(s, lambda: s.copy(d, h), warmup=1, repeats=3)
    assert times == pytest.approx([1e-3] * 3)  # 1 MB at 1 GB/s
