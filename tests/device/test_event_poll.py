"""The native poll of CUDA events (``ringflow._device.cuda.event_poll``), on the CPU: libc's
``abs`` stands in for ``cuEventQuery``, so an "event" whose handle is 600 (``CUDA_ERROR_NOT_READY``)
is pending and any other is done. The poll on a real GPU runs in ``pytest -m gpu``."""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time

import pytest

from ringflow._device.cuda import event_poll
from ringflow._device.protocol import WakeWord

PENDING = event_poll.NOT_READY


@pytest.fixture(scope="module")
def poller():
    try:
        lib = event_poll.library()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"no C compiler here ({exc})")
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    return event_poll.EventPoller(lib, ctypes.cast(libc.abs, ctypes.c_void_p).value)


def test_the_first_event_no_longer_pending_is_returned(poller):
    assert poller.poll([PENDING, 7, 9], timeout=1.0) == 1
    assert poller.poll([3], timeout=0.0) == 0  # done at the first look, however short the time


def test_a_poll_of_pending_events_ends_when_its_time_is_up(poller):
    t0 = time.perf_counter()
    assert poller.poll([PENDING, PENDING], timeout=0.02) == -2
    assert 0.02 <= time.perf_counter() - t0 < 1.0


def test_a_wake_word_set_by_another_thread_ends_the_poll(poller):
    wake = WakeWord()
    threading.Timer(0.02, wake.set).start()
    t0 = time.perf_counter()
    assert poller.poll([PENDING], timeout=10.0, wake=wake.word) == -1
    assert time.perf_counter() - t0 < 5.0
    assert wake.is_set()
    wake.clear()
    assert wake.word.value == 0 and not wake.is_set()
    assert poller.poll([PENDING], timeout=0.005, wake=wake.word) == -2


def test_the_polling_thread_holds_no_gil_meanwhile(poller):
    """Another Python thread runs freely during a poll: with the GIL held (or taken back at each
    round) it would get a switch interval's turn at most."""
    counted = [0]
    stop = threading.Event()

    def count():
        while not stop.is_set():
            counted[0] += 1

    t = threading.Thread(target=count)
    t.start()
    time.sleep(0.01)
    before = counted[0]
    time.sleep(0.05)  # this thread holds no GIL: the counter's rate alone
    alone = counted[0] - before
    before = counted[0]
    assert poller.poll([PENDING], timeout=0.2) == -2
    during = counted[0] - before
    stop.set()
    t.join()
    # four times as long as the sleep: about four times the count (a held GIL gives the counter
    # the moments around the call only, under a tenth of that)
    assert during > 1.5 * alone


def test_where_the_poll_cannot_be_had_the_device_polls_in_python(monkeypatch, caplog):
    monkeypatch.setattr(event_poll, "_loaded", None)
    monkeypatch.setenv("RINGFLOW_NATIVE_POLL", "0")
    with caplog.at_level("INFO", logger="ringflow._device.cuda.event_poll"):
        assert event_poll.poller() is None
    assert "native event polls off" in caplog.text
