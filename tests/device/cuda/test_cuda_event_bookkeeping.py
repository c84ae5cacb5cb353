"""The CUDA backend's per-event bookkeeping (live count, reuse of collected events), on any machine:
a :class:`CudaEvent` over a stand-in CUDA event and a device with nothing behind it."""

from __future__ import annotations

import gc
import sys
import types

import pytest

from ringflow import DeviceError
from ringflow._device.cuda._live import LiveRegistry
from ringflow._device.cuda.stream import IDLE_EVENTS_MAX, CudaEvent
from tests.helpers.threads import racing


def _shell_device():
    """What an event touches of its device: the live registry, the idle list, ``_closed``."""
    return types.SimpleNamespace(_live=LiveRegistry(), _idle_events=[], _closed=False)


class _StandInEvent:
    """A cuda.core event's part that an event's close uses."""

    def close(self):
        pass


def _event(dev, *, timing=False):
    return CudaEvent(dev, _StandInEvent(), timing, stream=None)


def test_each_event_is_counted_live_once_until_dropped_or_closed():
    dev = _shell_device()
    events = [_event(dev) for _ in range(5)]
    assert dev._live.counts().events == 5
    events[0].close()
    events[0].close()  # harmless twice
    assert dev._live.counts().events == 4
    del events[0]  # closed, then collected: not uncounted again
    assert dev._live.counts().events == 4
    events.clear()
    gc.collect()
    assert dev._live.counts().events == 0


def test_a_collected_untimed_event_is_kept_for_reuse_and_a_timed_or_failed_one_is_not():
    dev = _shell_device()
    plain, timed, failed = _event(dev), _event(dev, timing=True), _event(dev)
    failed._error = RuntimeError("sticky")
    kept = plain._cc
    del plain, timed, failed
    assert dev._idle_events == [kept]


def test_a_closed_device_keeps_no_event_and_a_full_idle_list_takes_no_more():
    dev = _shell_device()
    dev._closed = True
    event = _event(dev)
    del event
    assert dev._idle_events == [] and dev._live.counts().events == 0
    dev = _shell_device()
    dev._idle_events.extend(object() for _ in range(IDLE_EVENTS_MAX))
    event = _event(dev)
    del event
    assert len(dev._idle_events) == IDLE_EVENTS_MAX and dev._live.counts().events == 0


def test_dropping_an_event_makes_no_further_python_call():
    """A call drops every chunk's event as it returns: the drop is one finaliser, nothing more."""
    dev = _shell_device()
    event = _event(dev)
    calls = []

    def profile(frame, what, arg):
        if what == "call":
            calls.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        del event
    finally:
        sys.setprofile(None)
    assert calls == ["__del__"], calls
    assert dev._live.counts().events == 0 and len(dev._idle_events) == 1


def test_events_made_and_dropped_from_many_threads_at_once_are_counted_exactly():
    dev = _shell_device()

    def churn():
        for _ in range(3000):
            held = [_event(dev) for _ in range(3)]
            held[1].close()
            del held

    racing(churn, 4)
    gc.collect()
    assert dev._live.counts().events == 0


class _CUDAError(Exception):
    """Stands for the error type cuda.core raises for a failed driver call."""


class _FailingStream:
    """A cuda.core stream whose record and wait fail with ``exc``."""

    def __init__(self, exc):
        self.exc = exc

    def record(self, **kw):
        raise self.exc

    def wait(self, event):
        raise self.exc


def _shell_stream(dev, cc):
    from ringflow._device.cuda.stream import CudaStream

    stream = object.__new__(CudaStream)
    stream._closed, stream._device, stream._cc = False, dev, cc
    stream.handle, stream.priority, dev.index = 0x1234, 0, 0  # what its repr shows
    dev._ensure_current = lambda: None
    dev._idle_events.append(_StandInEvent())  # a record reuses it (making one needs cuda.core)
    return stream


@pytest.mark.parametrize("op", ["record", "wait"])
@pytest.mark.parametrize("error, expected", [
    (_CUDAError("CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access"), DeviceError),
    (KeyError("not the device's"), KeyError)], ids=["cuda-error", "other-error"])
def test_record_and_wait_report_a_cuda_error_as_a_device_error_and_pass_any_other_on(monkeypatch, op, error, expected):
    """A CUDA error becomes a DeviceError naming the operation (sticky for a broken context, the
    CUDA error its cause); any other error passes on unchanged."""
    from ringflow._device.cuda import _lib

    monkeypatch.setattr(_lib, "cuda_errors", lambda: (_CUDAError,))
    dev = _shell_device()
    stream = _shell_stream(dev, _FailingStream(error))
    pending = _event(dev)
    with pytest.raises(expected) as info:
        stream.record() if op == "record" else stream.wait(pending)
    if expected is DeviceError:
        assert ("recording an event on" if op == "record" else "wait for") in str(info.value)
        assert info.value.sticky and info.value.__cause__ is error
    else:
        assert info.value is error
