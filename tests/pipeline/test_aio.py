"""The asyncio future that follows a chunk's (``aio.follow``), and the awaited clean-up of a map."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading

import numpy as np

import ringflow as rf
from ringflow._pipeline import aio
from tests.helpers.threads import JOIN_S


def _gated_pipe(gate: threading.Event):
    def f(x, y):
        gate.wait(JOIN_S)
        np.multiply(x, 2, out=y)

    dev = rf.device("sim", seed=5, chaos=True)
    return rf.Pipeline(f, device=dev, chunk_bytes=512, checked=True)


def test_a_chunk_ending_after_its_loop_closed_is_no_error(caplog):
    """The loop that awaited a chunk is gone when the chunk ends: nothing awaits it any more,
    and its end is not an error of a done-callback (which the pipeline would log)."""
    gate = threading.Event()
    pipe = _gated_pipe(gate)
    fut = pipe.submit(np.arange(8.0))

    async def main():
        return aio.follow(fut)

    loop = asyncio.new_event_loop()
    loop.run_until_complete(main())
    loop.close()
    with caplog.at_level(logging.DEBUG, logger="ringflow"):
        gate.set()
        assert np.array_equal(fut.result(timeout=JOIN_S), np.arange(8.0) * 2)
        pipe.close()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records


def test_cancelling_the_follower_cancels_the_chunk_and_a_done_one_is_left_alone():
    gate = threading.Event()
    pipe = _gated_pipe(gate)
    first = pipe.submit(np.arange(8.0))  # its compute holds the progress thread until the gate opens
    second = pipe.submit(np.arange(8.0) + 1)

    async def main():
        head = aio.follow(second)
        head.cancel()
        gate.set()
        value = await aio.follow(first)
        return value

    got = asyncio.run(main())
    assert np.array_equal(got, np.arange(8.0) * 2)
    pipe.close()
    assert second.cancelled() and pipe.stats().cancelled == 1


def test_cancel_unwanted_soon_with_no_loop_running_cancels_at_once():
    """An async generator finalised outside a running loop runs its clean-up synchronously."""
    dev = rf.device("sim", seed=6, chaos=True)
    pipe = rf.Pipeline(lambda x, y: np.multiply(x, 2, out=y), device=dev, deliver="device", chunk_bytes=512,
                       checked=True, slots=rf.SlotCounts(host_in=1, device_in=1, device_out=1, host_out=1))
    held = pipe.submit(np.arange(8.0)).result(timeout=JOIN_S)  # its slot taken: the next cannot compute
    futs = [pipe.submit(np.arange(8.0) + k) for k in range(1, 3)]
    coro = aio.cancel_unwanted_soon(futs)
    try:
        coro.send(None)
    except StopIteration:
        pass
    else:
        raise AssertionError("awaited with no loop running")
    assert all(f.cancelled() for f in futs)
    held.release()
    pipe.close()
    assert pipe.stats().cancelled == 2 and pipe.stats().balanced()


def test_an_amap_dropped_unfinished_on_a_closed_loop_cancels_its_window():
    """A loop closed without ``shutdown_asyncgens`` never runs an unfinished amap's clean-up: the
    chunks it took are cancelled when it is collected instead. Here they wait for device slots
    that its undelivered results hold, and ``close()`` waited for them for ever."""
    from tests.helpers.threads import bounded

    dev = rf.device("sim", seed=31, chaos=True)
    pipe = rf.Pipeline(lambda x, y: np.multiply(x, 3, out=y), device=dev, deliver="device", chunk_bytes=512,
                       slots=2, max_in_flight=6, checked=True)
    x = [np.arange(16.0) + 100 * k for k in range(20)]

    async def first():
        agen = pipe.amap(x)
        (await agen.__anext__()).release()
        return agen

    loop = asyncio.new_event_loop()
    agen = loop.run_until_complete(first())
    loop.close()
    del agen
    gc.collect()
    bounded(pipe.close, timeout=20.0)
    s = pipe.stats()
    assert s.cancelled >= 1 and s.in_flight == 0 and s.balanced(), s
    gc.collect()
    assert dev.live().total == 0, dev.live()
