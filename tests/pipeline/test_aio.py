"""The asyncio future that follows a chunk's (``aio.follow``), and the awaited clean-up of a map."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import logging
import sys
import threading
import time

import numpy as np
import pytest

import ringflow as rf
from ringflow._pipeline import aio
from tests.helpers.threads import JOIN_S, bounded, hold_progress_thread, tick_then_release


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
        # the head's done-callbacks run at the loop's next turn: that posts the chunk's cancel,
        # which must come before the gate lets the chunk (shared with the first item) finish
        await asyncio.sleep(0)
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
    that its undelivered results hold, and ``close()`` waited for them for ever. The progress
    thread is held (in a done-callback) until the map has taken its whole window, so that no
    result is ready before (a map hands a ready result out before taking more)."""
    from tests.helpers.threads import bounded

    dev = rf.device("sim", seed=31, chaos=True)
    pipe = rf.Pipeline(lambda x, y: np.multiply(x, 3, out=y), device=dev, deliver="device", chunk_bytes=512,
                       slots=2, max_in_flight=6, checked=True)
    x = [np.arange(16.0) + 100 * k for k in range(20)]
    blocker = pipe.submit(np.zeros(16))
    release = hold_progress_thread(blocker)
    blocker.result().release()

    async def releaser():
        while pipe.stats().accepted < 1 + 3:  # the blocker, and three items of the map
            await asyncio.sleep(0)
        release.set()

    async def first():
        task = asyncio.create_task(releaser())
        agen = pipe.amap(x)
        (await agen.__anext__()).release()
        await task
        return agen

    loop = asyncio.new_event_loop()
    try:
        agen = loop.run_until_complete(first())
    finally:
        release.set()
    loop.close()
    del agen
    gc.collect()
    bounded(pipe.close, timeout=20.0)
    s = pipe.stats()
    assert s.cancelled >= 1 and s.in_flight == 0 and s.balanced(), s
    gc.collect()
    assert dev.live().total == 0, dev.live()


def test_an_amap_dropped_on_a_closed_loop_while_its_async_source_is_pulled_ends_quietly(monkeypatch, caplog):
    """The amap handed a result out while its async source's next item was being pulled (a task
    of its own), then its loop closed without ``shutdown_asyncgens``: collected, its clean-up runs
    outside any loop, and neither raises (an "exception ignored" of the generator) nor logs the
    pull as a task destroyed pending."""
    from tests.helpers.threads import bounded

    dev = rf.device("sim", seed=32, chaos=True)
    pipe = rf.Pipeline(lambda x, y: np.multiply(x, 3, out=y), device=dev, chunk_bytes=512, slots=2, checked=True)
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)

    async def source():
        yield np.arange(16.0)
        await asyncio.Event().wait()  # never a second item

    async def first():
        agen = pipe.amap(source())
        return agen, await agen.__anext__()

    loop = asyncio.new_event_loop()
    agen, got = loop.run_until_complete(first())
    loop.close()
    assert np.array_equal(got, np.arange(16.0) * 3)
    with caplog.at_level(logging.DEBUG, logger="asyncio"):
        del agen
        gc.collect()
    assert not unraisable, [u.exc_value for u in unraisable]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records
    bounded(pipe.close)
    s = pipe.stats()
    assert (s.accepted, s.delivered, s.in_flight) == (1, 1, 0), s


# -- an amap its event loop can no longer run: close() gives its window up ----------------------------------------
def _held_slots_pipe(devices):
    """Results left on the device and one slot a ring: a result not released holds its device's
    only slot, and every chunk after it on that device waits for it."""
    return rf.Pipeline(lambda x, y: np.multiply(x, 3, out=y), device=devices, deliver="device", chunk_bytes=512,
                       slots=1, max_in_flight=6, checked=True)


def _take_one_and_stop(pipe, items):
    """A coroutine taking an amap's first result, then returning with the generator unfinished
    (neither closed nor run to its end) and still referenced by the caller. The map's window is
    full when it stops: each device's slot is held by a result until the map has taken all it
    may, so its first result cannot come sooner; after it, the window holds a result on each
    device and the chunks that wait for those slots."""
    parts = getattr(pipe, "parts", [pipe])

    async def first():
        held = [part.submit(items[0]).result(timeout=JOIN_S) for part in parts]
        agen = pipe.amap(items)
        head = asyncio.ensure_future(agen.__anext__())
        want = len(held) + sum(part.config.max_in_flight for part in parts)
        deadline = time.monotonic() + JOIN_S
        while pipe.stats().accepted < want:  # (the map takes its items on this loop)
            assert time.monotonic() < deadline, pipe.stats()
            await asyncio.sleep(0.001)
        for result in held:
            result.release()
        (await head).release()
        return agen

    return first()


def _all_ended_and_nothing_live(pipe, devices) -> None:
    s = pipe.stats()
    assert s.in_flight == 0 and s.balanced() and s.cancelled >= 1, s
    assert s.accepted == s.delivered + s.failed + s.cancelled, s
    for dev in devices:
        assert dev.live().total == 0, dev.live()


@pytest.mark.parametrize("n_devices", [1, 2])
def test_close_gives_up_an_amap_whose_loop_closed_while_it_is_still_referenced(n_devices):
    """A loop closed without ``shutdown_asyncgens`` never runs an unfinished amap again, and while
    the generator is referenced it is not collected either: its window's chunks waited for slots
    the results delivered into it held, and ``close()`` waited for them for ever. Now close()
    cancels what the window holds and releases the results delivered into it."""
    from tests.helpers.threads import bounded

    devices = [rf.device("sim", seed=41 + k, chaos=True) for k in range(n_devices)]
    pipe = _held_slots_pipe(devices if n_devices > 1 else devices[0])
    x = [np.arange(16.0) + 100 * k for k in range(40)]
    loop = asyncio.new_event_loop()
    agen = loop.run_until_complete(_take_one_and_stop(pipe, x))
    loop.close()
    bounded(pipe.close, timeout=20.0)
    _all_ended_and_nothing_live(pipe, devices)
    del agen  # collected after close: nothing is left to cancel or release, and nothing is raised
    gc.collect()
    for dev in devices:
        assert dev.live().total == 0, dev.live()


def test_close_on_the_thread_of_a_loop_left_open_gives_up_its_amap():
    """The loop is left open but not run again, and close() is called on its thread: the loop
    cannot run while close() waits, so close() gives the amap's window up as for a closed loop.
    Run again afterwards, the amap hands out nothing more and, its input not used up, is cut
    short: it raises concurrent.futures.CancelledError rather than end as if it were."""
    from tests.helpers.threads import bounded

    dev = rf.device("sim", seed=43, chaos=True)
    pipe = _held_slots_pipe(dev)
    x = [np.arange(16.0) + 100 * k for k in range(20)]

    async def rest(agen, got):
        async for r in agen:
            got.append(r)

    def on_one_thread():
        loop = asyncio.new_event_loop()
        try:
            agen = loop.run_until_complete(_take_one_and_stop(pipe, x))
            pipe.close()
            _all_ended_and_nothing_live(pipe, [dev])
            got: list = []
            with pytest.raises(concurrent.futures.CancelledError,
                               match="after handing out 1 result: the pipeline was closed"):
                loop.run_until_complete(rest(agen, got))
            return got
        finally:
            loop.close()

    assert bounded(on_one_thread, timeout=20.0) == []
    gc.collect()
    assert dev.live().total == 0, dev.live()


class _WatchedExecutor(concurrent.futures.ThreadPoolExecutor):
    """A loop's default executor that keeps the future of every call handed to it."""

    def __init__(self):
        super().__init__(max_workers=1)
        self.calls: list = []

    def submit(self, fn, /, *args, **kwargs):
        fut = super().submit(fn, *args, **kwargs)
        self.calls.append(fut)
        return fut


async def _first_step_on_the_executor(agen, executor: _WatchedExecutor):
    """Start an amap's first step, and return it (a task) once the map's first item waits for
    capacity on the loop's executor."""
    step = asyncio.ensure_future(agen.__anext__())
    deadline = time.monotonic() + JOIN_S
    while not executor.calls:
        assert time.monotonic() < deadline
        await asyncio.sleep(0)
    return step


@pytest.mark.parametrize("n_devices", [1, 2])
def test_close_gives_up_a_chunk_accepted_for_an_amap_before_its_window_holds_it(n_devices):
    """The amap's item waits for capacity on the loop's executor; the loop stops, and the item
    is accepted meanwhile: the map has not put it in its window yet. close() on the loop's thread
    gives the window up, and the chunk accepted for it with it (its result released), rather than
    leave it DELIVERED into a result nobody takes. Run again, the amap hands out nothing more and,
    its item taken and its input not used up, raises concurrent.futures.CancelledError."""
    from tests.helpers.threads import bounded

    devices = [rf.device("sim", seed=47 + k, chaos=True) for k in range(n_devices)]
    pipe = rf.Pipeline(lambda x, y: np.multiply(x, 3, out=y), device=devices if n_devices > 1 else devices[0],
                       deliver="device", chunk_bytes=512, slots=1, max_in_flight=1, checked=True)
    parts = getattr(pipe, "parts", [pipe])
    x = [np.arange(16.0) + 100 * k for k in range(4)]
    executor = _WatchedExecutor()

    def on_one_thread():
        loop = asyncio.new_event_loop()
        loop.set_default_executor(executor)
        try:
            held = [part.submit(x[0]).result(timeout=JOIN_S) for part in parts]  # each device's only slot
            others = [part.submit(x[0]) for part in parts]  # each waits for it, in its device's only place in flight
            agen = pipe.amap(x)
            step = loop.run_until_complete(_first_step_on_the_executor(agen, executor))
            for result in held:
                result.release()  # the others are delivered into the slots, and the map's item is accepted
            taken = executor.calls[0].result(timeout=JOIN_S)
            for other in others:
                other.result(timeout=JOIN_S).release()
            pipe.close()
            s = pipe.stats()
            assert s.in_flight == 0 and s.balanced() and s.accepted == 2 * len(parts) + 1, s
            assert taken.done()
            for dev in devices:
                assert dev.live().total == 0, dev.live()
            with pytest.raises(concurrent.futures.CancelledError,
                               match="after handing out 0 results: the pipeline was closed"):
                loop.run_until_complete(step)
        finally:
            loop.close()

    bounded(on_one_thread, timeout=20.0)
    gc.collect()
    for dev in devices:
        assert dev.live().total == 0, dev.live()


def test_close_gives_up_a_chunk_of_an_amap_accepted_as_close_gives_its_window_up(monkeypatch):
    """The chunk is accepted off the loop before close() runs, and the accepting thread tells the
    map only after close() gave the window up (and returned, the chunk having ended): it is given
    up there, its result released. Run again, the amap raises concurrent.futures.CancelledError
    (its item taken, its input not used up)."""
    dev = rf.device("sim", seed=49, chaos=True)
    pipe = rf.Pipeline(lambda x, y: np.multiply(x, 3, out=y), device=dev, deliver="device", chunk_bytes=512,
                       slots=1, max_in_flight=1, checked=True)
    x = [np.arange(16.0) + 100 * k for k in range(4)]
    executor = _WatchedExecutor()
    reached, closed = threading.Event(), threading.Event()
    told = aio.CancelIfDropped.accepted

    def late(ending, fut):
        reached.set()
        assert closed.wait(JOIN_S)
        told(ending, fut)

    monkeypatch.setattr(aio.CancelIfDropped, "accepted", late)

    def on_one_thread():
        loop = asyncio.new_event_loop()
        loop.set_default_executor(executor)
        try:
            held = pipe.submit(x[0]).result(timeout=JOIN_S)
            other = pipe.submit(x[0])
            agen = pipe.amap(x)
            step = loop.run_until_complete(_first_step_on_the_executor(agen, executor))
            held.release()
            assert reached.wait(JOIN_S)  # accepted, and the map not told yet
            other.result(timeout=JOIN_S).release()
            pipe.close()
            closed.set()
            taken = executor.calls[0].result(timeout=JOIN_S)
            assert taken.done() and pipe.stats().balanced(), pipe.stats()
            assert dev.live().total == 0, dev.live()
            with pytest.raises(concurrent.futures.CancelledError,
                               match="after handing out 0 results: the pipeline was closed"):
                loop.run_until_complete(step)
        finally:
            closed.set()
            loop.close()

    from tests.helpers.threads import bounded

    bounded(on_one_thread, timeout=20.0)


# -- an amap its event loop can still run, on another thread: close() waits for it -------------------------------
class _LoopThread:
    """An event loop running on a thread of its own until :meth:`stop`."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-loop", daemon=True)
        self.thread.start()

    def run(self, coro):
        """``coro`` on the loop; its value, waited for at most JOIN_S real seconds."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=JOIN_S)

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(JOIN_S)
        assert not self.thread.is_alive()
        self.loop.close()


async def _release_the_rest(agen, cut_by: "str | None" = None) -> int:
    """Take what is left of an amap of device results, releasing each; returns how many. With
    ``cut_by`` ("cancelled" or "closed"), the amap must then be cut short by that, saying it had
    handed out one result more than this took (the one taken before)."""
    n = 0
    try:
        async for result in agen:
            result.release()
            n += 1
    except concurrent.futures.CancelledError as err:
        message = str(err)
        assert cut_by is not None, message
        assert f"cut short after handing out {n + 1} result" in message and f"the pipeline was {cut_by}" in message, message
        return n
    assert cut_by is None, "the amap ended as if its input were used up"
    return n


@pytest.mark.parametrize("n_devices", [1, 2])
def test_cancel_then_close_ends_an_amap_its_consumer_stopped_pulling_on_a_live_loop(n_devices):
    """The amap's loop runs on another thread, but its consumer stopped pulling: the results in
    its window hold the slots its other chunks wait for. close() waits for those (as for a map
    held unconsumed on another thread: the consumer may still take them); cancel() first ends
    them without the consumer. The map, pulled again, hands out what was delivered and is cut short
    (its input is not used up)."""
    from tests.helpers.threads import bounded

    devices = [rf.device("sim", seed=51 + k, chaos=True) for k in range(n_devices)]
    pipe = _held_slots_pipe(devices if n_devices > 1 else devices[0])
    x = [np.arange(16.0) + 100 * k for k in range(40)]
    loop = _LoopThread()
    try:
        agen = loop.run(_take_one_and_stop(pipe, x))

        def cancel_then_close():
            pipe.cancel()
            pipe.close()

        bounded(cancel_then_close, timeout=20.0)  # (a watchdog: fails, with every stack, should it hang)
        handed_out = loop.run(_release_the_rest(agen, cut_by="cancelled"))
    finally:
        loop.stop()
    assert handed_out <= n_devices  # at most a delivered result a device: the rest were cancelled
    _all_ended_and_nothing_live(pipe, devices)


def test_close_from_another_thread_waits_for_a_live_loops_amap_and_gives_nothing_up():
    """close() on another thread while the amap's consumer has stopped pulling: the amap's loop can
    still run it, so its window is not given up. Once the consumer pulls again close() returns,
    and the amap has handed out every item it took, then is cut short (its input is not used up)."""
    from tests.helpers.threads import start, join

    dev = rf.device("sim", seed=53, chaos=True)
    pipe = _held_slots_pipe(dev)
    x = [np.arange(16.0) + 100 * k for k in range(40)]
    loop = _LoopThread()
    try:
        agen = loop.run(_take_one_and_stop(pipe, x))
        closing = start(pipe.close)
        handed_out = loop.run(_release_the_rest(agen, cut_by="closed"))
        join([closing], timeout=20.0)
    finally:
        loop.stop()
    s = pipe.stats()
    assert s.cancelled == 0 and s.failed == 0 and s.in_flight == 0 and s.balanced(), s
    assert handed_out == s.delivered - 2  # all but the first result and the one taken before the map
    assert dev.live().total == 0, dev.live()


@pytest.mark.parametrize("on_error", ["raise", "continue"])
@pytest.mark.parametrize("n_devices", [1, 2])
def test_a_task_cancelled_as_the_pipeline_cancels_its_amaps_head_ends_cancelled(n_devices, on_error):
    """The consumer task of an amap is cancelled right after ``cancel()`` of the pipeline, on the
    loop's thread, cancelled the chunk the map waits for: the task is woken by both in one turn.
    The map took the task's CancelledError for its chunk's cancellation and ended quietly (or,
    with ``on_error="continue"`` over two devices, went on), so the cancelled task returned as if
    nobody had cancelled it. The results held (each device's only slot) keep every chunk in the
    window from its compute, so the head is still running when the pipeline is cancelled."""
    devices = [rf.device("sim", seed=61 + k, chaos=True) for k in range(n_devices)]
    pipe = rf.Pipeline(lambda x, y: np.multiply(x, 3, out=y), device=devices if n_devices > 1 else devices[0],
                       deliver="device", chunk_bytes=512, slots=1, max_in_flight=3, on_error=on_error,
                       checked=True)
    x = [np.arange(16.0) + 100 * k for k in range(40)]
    held: list = []

    async def consume():
        async for result in pipe.amap(x):
            held.append(result)  # not released: its device's one slot stays taken
        return "ended"

    async def main():
        task = asyncio.create_task(consume())
        # a result held on each device, and the window full behind them: the map has nothing to
        # do but wait for its head, which cannot compute
        want = n_devices + 3 * n_devices
        deadline = time.monotonic() + JOIN_S
        while len(held) < n_devices or pipe.stats().accepted < want:
            assert time.monotonic() < deadline and not task.done(), (pipe.stats(), task)
            await asyncio.sleep(0.001)
        pipe.cancel()  # (returns once every chunk ended: the head is cancelled)
        task.cancel()
        try:
            outcome = await task
        except asyncio.CancelledError:
            outcome = "cancelled"
        return outcome

    try:
        outcome = bounded(lambda: asyncio.run(main()))
    finally:
        for result in held:
            result.release()
        bounded(pipe.close, timeout=20.0)
    assert outcome == "cancelled"
    s = pipe.stats()
    assert s.in_flight == 0 and s.balanced() and s.delivered == n_devices, s
    gc.collect()
    for dev in devices:
        assert dev.live().total == 0, dev.live()


# -- an event loop on the pipeline's own progress thread ---------------------------------------------
def _check_cancelled_and_released(pipe, behind: list, held: list, devices: list) -> None:
    """After an ``async with`` left by an error or a cancellation: ``pipe`` is closed, every
    future of ``behind`` cancelled and counted so; once the ``held`` device results are released
    (and the list emptied), nothing is left live on ``devices``."""
    assert _closed(pipe)
    assert all(fut.cancelled() for fut in behind), [fut for fut in behind if not fut.cancelled()]
    for result in held:
        result.release()
    held.clear()
    s = pipe.stats()
    assert s.in_flight == 0 and s.cancelled == len(behind) and s.balanced(), s
    gc.collect()
    for dev in devices:
        assert dev.live().total == 0, dev.live()


def _run_in_a_done_callback(futs: list, coroutine) -> list:
    """``asyncio.run(coroutine())`` in a done-callback (on the pipeline's progress thread) of the
    first of ``futs`` not done yet; returns ``[what it returned or raised]`` once it ended."""
    outcome: list = []
    finished = threading.Event()

    def callback(_fut):
        try:
            outcome.append(asyncio.run(coroutine()))
        except BaseException as exc:  # noqa: BLE001 - the test's to see
            outcome.append(exc)
        finally:
            finished.set()

    for fut in futs:
        if not fut.done():
            fut.add_done_callback(callback)
            break
    else:
        pytest.skip("every chunk ended before a callback could be added")
    assert finished.wait(JOIN_S)
    return outcome


@pytest.mark.parametrize("how", ["asubmit", "amap"])
@pytest.mark.parametrize("n_devices", [1, 2])
def test_an_await_on_the_pipeline_from_a_loop_in_its_own_done_callback_is_refused(how, n_devices):
    """A done-callback runs on the pipeline's progress thread; an event loop run there (``asyncio.run``
    in the callback) that awaits the same pipeline waited for ever: the await ends only once the
    progress thread sets the chunk's future, and that thread was running the loop. It is refused,
    saying what to do instead, and the pipeline goes on."""
    devices = [rf.device("sim", seed=61 + k, chaos=True) for k in range(n_devices)]
    pipe = rf.Pipeline(lambda x, y: np.multiply(x, 2, out=y), device=devices if n_devices > 1 else devices[0],
                       chunk_bytes=512, checked=True)

    async def await_the_pipeline():
        if how == "asubmit":
            return await pipe.asubmit(np.arange(8.0))
        return [r async for r in pipe.amap([np.arange(8.0)])]

    futs = [pipe.submit(np.arange(8.0) + k) for k in range(2 * n_devices)]
    # bounded: without the refusal this waits for ever (the test's watchdog, not a proof)
    (err,) = _run_in_a_done_callback(futs, lambda: asyncio.wait_for(await_the_pipeline(), 5.0))
    assert isinstance(err, RuntimeError), repr(err)
    assert "progress thread" in str(err) and "submit(" in str(err) and "run_coroutine_threadsafe" in str(err)
    assert [f.result(timeout=JOIN_S)[1] for f in futs] == [2.0 * (k + 1) for k in range(2 * n_devices)]
    pipe.close()
    s = pipe.stats()
    assert s.in_flight == 0 and s.accepted == len(futs) == s.delivered, s


@pytest.mark.parametrize("deliver", ["host", "device"])
def test_a_ctrl_c_raised_in_an_amap_loop_leaves_no_error_from_its_clean_up(deliver, monkeypatch, caplog):
    """A KeyboardInterrupt raised inside ``async for r in pipe.amap(...)`` ends ``asyncio.run``,
    which closes the loop while the map's clean-up (run by the loop's async generator finaliser)
    still awaited its cancels: asyncio destroyed that task pending (an error it logs), and the
    clean-up then met the closed loop and raised RuntimeError ("Event loop is closed") from a
    finaliser. The chunks are still cancelled and close() ends with nothing live."""
    caplog.set_level(logging.ERROR, logger="asyncio")
    unraisable: list = []
    monkeypatch.setattr("sys.unraisablehook", unraisable.append)
    for seed in range(3):
        dev = rf.device("sim", seed=70 + seed, chaos=True)
        pipe = rf.Pipeline(lambda x, y: np.multiply(x, 2, out=y), device=dev, chunk_bytes=512, deliver=deliver,
                           checked=True)

        async def main():
            async for _ in pipe.amap([np.arange(8.0) + k for k in range(20)]):
                raise KeyboardInterrupt  # as Ctrl-C raises it in the loop body

        with pytest.raises(KeyboardInterrupt):
            asyncio.run(main())
        gc.collect()
        from tests.helpers.threads import bounded

        bounded(pipe.close, timeout=20.0)
        s = pipe.stats()
        assert s.in_flight == 0 and s.balanced(), s
        gc.collect()
        assert dev.live().total == 0, dev.live()
    assert [u.exc_value for u in unraisable] == []
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []


@pytest.mark.parametrize("raised", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("n_devices", [1, 2])
def test_a_keyboard_interrupt_from_an_async_source_is_raised_where_the_amap_is_iterated(raised, n_devices):
    """A KeyboardInterrupt or SystemExit raised by an async source comes out of ``async for r in
    pipe.amap(...)`` in the iterating task, as an async generator iterated directly raises it
    there. The source is pulled in a task of its own, which asyncio lets such an error leave at
    once: it stopped the loop, and the iterating task saw only the CancelledError that
    ``asyncio.run`` then cancelled it with (its ``except KeyboardInterrupt`` never ran). The map's
    chunks still end, and close() leaves nothing live."""
    devices, device = _each_device(n_devices, 90)
    pipe = rf.Pipeline(lambda x, y: np.multiply(x, 2, out=y), device=device, chunk_bytes=512, checked=True)
    seen: list = []

    async def source():
        yield np.arange(8.0)
        yield np.arange(8.0) + 1
        raise raised("from the source")

    async def main():
        try:
            async for r in pipe.amap(source()):
                seen.append(float(r[1]))
        except BaseException as exc:
            seen.append(type(exc))
            raise

    with pytest.raises(raised, match="from the source"):
        bounded(lambda: asyncio.run(main()))
    assert seen[-1] is raised, seen
    bounded(pipe.close, timeout=20.0)
    s = pipe.stats()
    assert s.in_flight == 0 and s.balanced(), s
    gc.collect()
    assert all(dev.live().total == 0 for dev in devices)


@pytest.mark.parametrize("n_devices", [1, 2])
def test_a_keyboard_interrupt_an_async_source_raises_as_its_pull_is_stopped_is_not_lost(n_devices):
    """The map's consumer stops (breaks out of ``async for``) while the source's next item is
    pulled, and the source raises KeyboardInterrupt as that pull is cancelled (a Ctrl-C landing
    in its code): it comes out of the map's clean-up, never dropped with the pull it ended."""
    devices, device = _each_device(n_devices, 94)
    pipe = rf.Pipeline(lambda x, y: np.multiply(x, 2, out=y), device=device, chunk_bytes=512, checked=True)

    async def source():
        yield np.arange(8.0)
        try:
            await asyncio.Event().wait()  # the next item never comes: the pull is cancelled
        except asyncio.CancelledError:
            raise KeyboardInterrupt("as the pull was stopped") from None
        yield np.arange(8.0)

    async def main():
        async with contextlib.aclosing(pipe.amap(source())) as results:
            async for _ in results:
                await asyncio.sleep(0)  # the second pull starts
                break

    with pytest.raises(KeyboardInterrupt, match="as the pull was stopped"):
        bounded(lambda: asyncio.run(main()))
    bounded(pipe.close, timeout=20.0)
    s = pipe.stats()
    assert s.in_flight == 0 and s.balanced(), s
    gc.collect()
    assert all(dev.live().total == 0 for dev in devices)


# -- async with: __aexit__ closes (or, after an error, cancels) without blocking the loop --------------------------
def _parts(pipe) -> list:
    return getattr(pipe, "parts", [pipe])


def _each_device(n_devices: int, seed: int) -> tuple:
    devices = [rf.device("sim", seed=seed + k, chaos=True) for k in range(n_devices)]
    return devices, (devices if n_devices > 1 else devices[0])


def _closed(pipe) -> bool:
    return all(part._closed for part in _parts(pipe)) and pipe._closed


@pytest.mark.parametrize("n_devices", [1, 2])
def test_async_with_closes_on_success_without_blocking_the_loop(n_devices):
    """Leaving ``async with`` without an error finishes every accepted item and closes, as ``with``
    does, while the loop runs on: here the pipeline moves again only once a task on the loop has
    ticked after the exit began, so an exit that waited on the loop's thread would wait for ever."""
    devices, device = _each_device(n_devices, 81)
    pipe = rf.Pipeline(lambda x, y: np.multiply(x, 3, out=y), device=device, chunk_bytes=512, checked=True)
    holding, release = threading.Event(), threading.Event()
    outcome: dict = {}

    def hold(_fut):  # on a progress thread, outside the lock: its pipeline stands still meanwhile
        holding.set()
        outcome["released_by_the_loop"] = release.wait(10.0)

    x = [np.arange(16.0) + 100 * k for k in range(6)]
    futs = [part.submit(x[0]) for part in _parts(pipe)]
    futs[0].add_done_callback(hold)
    assert holding.wait(JOIN_S)
    ticks: list = []

    async def main():
        async with pipe as entered:
            assert entered is pipe
            futs.extend(pipe.submit(a) for a in x[1:])
            tick = asyncio.create_task(tick_then_release(ticks, release))  # it first runs once the exit awaits
        assert _closed(pipe)
        await tick

    try:
        bounded(lambda: asyncio.run(main()), timeout=30.0)
    finally:
        release.set()
    assert outcome["released_by_the_loop"] and ticks == list(range(5))
    for fut, a in zip(futs, [x[0]] * len(_parts(pipe)) + x[1:]):
        assert np.array_equal(fut.result(timeout=0), a * 3)
    s = pipe.stats()
    assert (s.accepted, s.delivered, s.in_flight) == (len(futs), len(futs), 0), s
    gc.collect()
    for dev in devices:
        assert dev.live().total == 0, dev.live()


@pytest.mark.parametrize("n_devices", [1, 2])
def test_an_async_with_whose_body_raises_cancels_the_work_and_reraises(n_devices):
    """The body raises: the exit cancels what is left (items that could only finish once a result
    held elsewhere is released) and the body's error comes out, the very object, unmasked."""
    devices, device = _each_device(n_devices, 83)
    pipe = _held_slots_pipe(device)
    x = [np.arange(16.0) + 100 * k for k in range(4)]
    held = [part.submit(x[0]).result(timeout=JOIN_S) for part in _parts(pipe)]  # each device's only slot
    behind: list = []
    raised = ValueError("the body's own error")

    async def main():
        async with pipe:
            behind.extend(part.submit(a) for part in _parts(pipe) for a in x[1:])
            raise raised

    with pytest.raises(ValueError) as caught:
        bounded(lambda: asyncio.run(main()), timeout=20.0)
    assert caught.value is raised
    _check_cancelled_and_released(pipe, behind, held, devices)


@pytest.mark.parametrize("deliver", ["host", "device"])
@pytest.mark.parametrize("n_devices", [1, 2])
def test_ctrl_c_in_an_async_with_body_under_asyncio_run_ends_cleanly(n_devices, deliver, monkeypatch, caplog):
    """A KeyboardInterrupt raised inside ``async with pipe:`` (inside an ``async for`` over its amap,
    with an asubmit pending) under ``asyncio.run``: it comes out of ``asyncio.run``, the pipeline is
    closed with its work cancelled, asyncio logs no task destroyed pending, nothing is raised from
    a finaliser, and nothing is left live on the device."""
    caplog.set_level(logging.ERROR, logger="asyncio")
    unraisable: list = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    devices, device = _each_device(n_devices, 85)
    pipe = rf.Pipeline(lambda x, y: np.multiply(x, 2, out=y), device=device, chunk_bytes=512, deliver=deliver,
                       checked=True)
    x = [np.arange(8.0) + k for k in range(20)]

    async def main():
        async with pipe:
            pending = asyncio.ensure_future(pipe.asubmit(x[0]))
            # the asubmit starts before the body can raise: an amap whose first result is ready
            # at once never yields to the loop, and the task would first run only once the exit
            # had closed the pipeline, ending with the closed pipeline's RuntimeError that nobody
            # retrieves (asyncio logs it), which is the test's race, not the pipeline's
            await asyncio.sleep(0)
            async for _ in pipe.amap(x):
                raise KeyboardInterrupt  # as Ctrl-C raises it in the body
            await pending

    with pytest.raises(KeyboardInterrupt):
        bounded(lambda: asyncio.run(main()), timeout=20.0)
    assert _closed(pipe)
    s = pipe.stats()
    assert s.in_flight == 0 and s.balanced(), s
    gc.collect()
    for dev in devices:
        assert dev.live().total == 0, dev.live()
    assert [u.exc_value for u in unraisable] == []
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []


async def _until(pred) -> None:
    """Let the loop run until ``pred()`` holds (at most JOIN_S real seconds)."""
    deadline = time.monotonic() + JOIN_S
    while not pred():
        assert time.monotonic() < deadline
        await asyncio.sleep(0)


@pytest.mark.parametrize("how", ["task.cancel", "asyncio.run ends"])
@pytest.mark.parametrize("n_devices", [1, 2])
def test_a_cancelled_async_with_exit_cancels_the_work_and_leaves_the_pipeline_closed(n_devices, how):
    """The task awaiting the exit's close is cancelled (``task.cancel()``, or ``asyncio.run`` ending
    with it still waiting): the pipeline's work is cancelled, so the close it had begun ends,
    and the pipeline is closed, not left half-closed. Here the close could only end once a result
    held by the caller is released, which it never is before the end."""
    devices, device = _each_device(n_devices, 87)
    pipe = _held_slots_pipe(device)
    x = [np.arange(16.0) + 100 * k for k in range(4)]
    held = [part.submit(x[0]).result(timeout=JOIN_S) for part in _parts(pipe)]
    behind: list = []

    async def body():
        async with pipe:
            behind.extend(part.submit(a) for part in _parts(pipe) for a in x[1:])

    async def main():
        task = asyncio.ensure_future(body())
        await _until(lambda: not all(part._sched.accepting for part in _parts(pipe)))  # the exit's close began
        if how == "asyncio.run ends":
            return  # asyncio.run cancels the task, then joins its executor's threads
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    bounded(lambda: asyncio.run(main()), timeout=20.0)
    _check_cancelled_and_released(pipe, behind, held, devices)


@pytest.mark.parametrize("n_devices", [1, 2])
def test_an_async_with_exit_gives_up_an_amap_its_own_task_left_unfinished(n_devices):
    """The body stops pulling an amap it keeps (deliver="device": the results in its window hold
    the slots its other chunks wait for) and leaves the block: the task awaiting the exit is the
    amap's consumer, so nobody can pull it while the close waits. The exit gives its window up,
    as close() on the loop's thread does, instead of waiting for it for ever. Pulled again, the
    amap hands out nothing more and, its input not used up, raises
    concurrent.futures.CancelledError, whose message does not say that another caller closed
    the pipeline: the amap's own task did."""
    devices, device = _each_device(n_devices, 89)
    pipe = _held_slots_pipe(device)
    x = [np.arange(16.0) + 100 * k for k in range(40)]

    async def main():
        async with pipe:
            # its first result taken once its window is full, as a body breaking out of an
            # `async for` leaves it: taken sooner, on a busy machine, the window could hold no
            # chunk waiting for a slot, and the exit had nothing to give up
            agen = await _take_one_and_stop(pipe, x)
        rest: list = []
        with pytest.raises(concurrent.futures.CancelledError,
                           match="after handing out 1 result: the pipeline was closed") as cut:
            async for r in agen:  # the map ends at its next step with nothing more, cut short
                rest.append(r)
        # closed by the task that pulls the amap (on the executor's thread): not another caller
        assert "another caller" not in str(cut.value), cut.value
        return rest

    assert bounded(lambda: asyncio.run(main()), timeout=20.0) == []
    assert _closed(pipe)
    _all_ended_and_nothing_live(pipe, devices)


@pytest.mark.parametrize("n_devices", [1, 2])
def test_an_async_with_exit_waits_for_an_amap_another_task_still_pulls(n_devices):
    """Another task on the same loop pulls an amap of the pipeline while the block is left: the exit
    does not block the loop, so that task goes on taking its results, and the close waits for
    what the amap took (nothing is cancelled); the amap, its input not used up, is then cut short."""
    devices, device = _each_device(n_devices, 91)
    pipe = _held_slots_pipe(device)
    x = [np.arange(16.0) + 100 * k for k in range(12)]

    async def consumer(agen, got):
        try:
            async for result in agen:
                got.append(result.index)
                result.release()
                await asyncio.sleep(0)
        except concurrent.futures.CancelledError as err:
            return err
        return None

    async def main():
        got: list = []
        async with pipe:
            agen = pipe.amap(x)
            task = asyncio.create_task(consumer(agen, got))
            await _until(lambda: len(got) >= 1)
        return got, await task

    got, cut = bounded(lambda: asyncio.run(main()), timeout=20.0)
    s = pipe.stats()
    assert s.cancelled == 0 and s.failed == 0 and s.in_flight == 0 and s.balanced(), s
    assert got == list(range(s.delivered)), (got, s)  # every item the amap took was handed out
    if s.delivered < len(x):  # its input not used up: cut short by the close, saying so
        assert cut is not None and f"after handing out {len(got)} result" in str(cut) \
            and "the pipeline was closed by another caller" in str(cut), (cut, s)
    else:
        assert cut is None, cut
    for dev in devices:
        assert dev.live().total == 0, dev.live()


@pytest.mark.parametrize("n_devices", [1, 2])
def test_an_async_with_on_a_loop_in_the_pipelines_own_done_callback_closes_there(n_devices):
    """An event loop run in a done-callback runs on the pipeline's progress thread, which an awaited
    close could not wait on (asubmit refuses there). The exit is not refused (that would leave the
    pipeline open and mask the body's error): it closes on that thread, as close() called in the
    callback does, driving the pipeline there."""
    devices, device = _each_device(n_devices, 93)
    pipe = rf.Pipeline(lambda x, y: np.multiply(x, 2, out=y), device=device, chunk_bytes=512, checked=True)
    futs: list = []

    async def leave_the_block():
        async with pipe:
            futs.extend(pipe.submit(np.arange(8.0) + 10 + k) for k in range(3))

    first = [pipe.submit(np.arange(8.0) + k) for k in range(2 * n_devices)]
    outcome = _run_in_a_done_callback(first, leave_the_block)
    assert outcome == [None], outcome
    assert _closed(pipe)
    for k, fut in enumerate(futs):
        assert np.array_equal(fut.result(timeout=0), (np.arange(8.0) + 10 + k) * 2)
    s = pipe.stats()
    assert s.in_flight == 0 and s.accepted == s.delivered == len(first) + len(futs), s
