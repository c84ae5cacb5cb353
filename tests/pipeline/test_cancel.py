"""Cancellation at every scheduling point, and the pipeline's lifecycle (close, cancel twice,
submit after close, garbage collection while running)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import threading
import time
import warnings

import numpy as np
import pytest

import ringflow as rf
from ringflow._errors import DeviceError, StageError
from ringflow._pipeline.states import ChunkState, SlotState
from tests.helpers.maps import take_each
from tests.helpers.pipeline_checks import Harness, check_result, future_outcome
from tests.helpers.threads import (JOIN_S, LogRecords, bounded, hold_progress_thread, join, pause_first_shared_copy,
                                   start)

SIZES = [40, 0, 64, 1, 17, 64, 33, 50]  # 8 chunks of int64 (a 64-element chunk fills a 512-byte slot)

CONFIGS = {
    "tight": dict(slots=rf.SlotCounts(1, 1, 1, 1), seed=0),
    "two": dict(slots=2, seed=1),
    "inplace": dict(slots=rf.SlotCounts(1, 1, 0, 1), inplace=True, seed=2),
    "one-in-flight": dict(slots=rf.SlotCounts(1, 1, 1, 1), max_in_flight=1, seed=3),
    "fault": dict(slots=rf.SlotCounts(1, 2, 1, 1), on_error="continue", seed=4, faults={2: "compute", 5: "consume"}),
    "slow-consumer": dict(slots=2, seed=5, consume_cost=30e-6, workers=1),
}


class CancelRun:
    """Submit 8 items as capacity allows, driving the scheduler one step at a time; with
    ``cancel_after`` = k, cancel at the first step boundary after slot transition k."""

    def __init__(self, cfg: dict, cancel_after: int | None):
        cfg = dict(cfg)
        faults = cfg.pop("faults", {})
        cost = cfg.pop("consume_cost", 0.0)
        self.count = 0
        self.hit = False

        def on_transition(kind, slot, old, new):
            if cancel_after is not None and self.count == cancel_after:
                self.hit = True  # cancelling here would re-enter the scheduler: flag it instead
            self.count += 1

        h = self.h = Harness(chunk_bytes=512, checked=True, on_transition=on_transition, **cfg)
        self.items = [h.item(k + 1, n, faults.get(k), consume_cost=cost) for k, n in enumerate(SIZES)]
        self.futs: list = []
        pending = list(self.items)
        sched = h.sched

        def boundary():
            return self.hit or (pending and sched.has_capacity()) or (not pending and all(f.done() for f in self.futs))

        while True:
            while pending and not self.hit and sched.has_capacity():
                self.futs.append(h.pipe.submit(pending.pop(0)))
                h.check()
            if self.hit or (not pending and all(f.done() for f in self.futs)):
                break
            h.pipe._drive_until(boundary)
            h.check()
        self.submitted = len(self.futs)
        self.at_cancel = {i: c.state for i, c in h.chunks.items()}
        self.ending = {i: c.ending for i, c in h.chunks.items()}  # decided already if DRAINING


def full_run_transitions(cfg) -> int:
    run = CancelRun(cfg, None)
    for fut, item in zip(run.futs, run.items):
        if item.fault is None:
            check_result(fut.result(), item, fut.index)
    total = run.count
    run.h.close()
    return total


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cancel_at_every_point(name):
    cfg = CONFIGS[name]
    total = full_run_transitions(cfg)
    assert total >= 8 * 9  # every chunk went through every ring
    for k in range(total):
        run = CancelRun(cfg, k)
        h = run.h
        assert run.hit, f"transition {k} of {total} never happened"
        h.pipe.cancel()
        where = f"{name}: cancel after transition {k}/{total}"
        s = h.pipe.stats()
        assert s.in_flight == 0 and s.balanced() and s.accepted == run.submitted, (where, s)
        for ring in h.sched.rings:
            assert all(slot.state is SlotState.FREE for slot in ring.slots), (where, ring.slots)
        for fut, item in zip(run.futs, run.items):
            before = run.at_cancel[fut.index]
            kind, value = future_outcome(fut)
            if before.final:
                pass  # ended before the cancel: untouched (checked by h.check below)
            elif before is ChunkState.DRAINING and run.ending[fut.index] is ChunkState.FAILED:
                assert kind == "error", (where, fut.index, kind)  # it had failed before the cancel
            elif before is ChunkState.CONSUMING:
                # the consumer was already running: it finishes (its slot is released only then)
                assert kind in ("value", "error"), (where, fut.index, kind)
            else:
                assert kind == "cancelled", (where, fut.index, before, kind)
                with pytest.raises(concurrent.futures.CancelledError):
                    fut.result()
            if kind == "value":
                check_result(value, item, fut.index)
        h.check()  # every final chunk verified: payloads, errors, futures
        stats = h.pipe.stats()
        h.pipe.cancel()  # twice: harmless
        assert h.pipe.stats() == stats
        with pytest.raises(RuntimeError, match="no longer accepts work"):
            h.pipe.submit(h.item(100, 3))
        h.close()


# -- lifecycle -------------------------------------------------------------------------------
def f_affine(x, y):
    y[...] = x * 3 + 1


def test_cancel_and_close_are_idempotent():
    h = Harness(seed=1, slots=1, chunk_bytes=512)
    futs = [h.pipe.submit(h.item(k + 1, 20)) for k in range(4)]
    h.pipe.cancel()
    h.pipe.cancel()
    assert all(f.done() for f in futs)
    h.close()
    h.pipe.close()  # close twice
    h.pipe.cancel()  # cancel after close
    with pytest.raises(RuntimeError, match="closed"):
        h.pipe.submit(h.item(9, 3))
    with pytest.raises(RuntimeError, match="closed"):  # map is a generator: it raises when iterated
        list(h.pipe.map([h.item(10, 3)]))
    assert h.pipe.stats().in_flight == 0



def test_a_cancel_that_another_threads_close_overtakes_returns_quietly():
    """A cancel() found the pipeline open, then a close() on another thread ended it (its
    progress thread too) before the cancel was handed over: the cancel raised "the pipeline's
    progress thread has ended" (found by the threaded state machine), where cancelling a closed
    pipeline is harmless. The close finished everything first: nothing is left to cancel."""
    h = Harness(seed=2, slots=1, chunk_bytes=512)
    futs = [h.pipe.submit(h.item(k + 1, 20)) for k in range(3)]
    stop_prepares = h.pipe._stop_prepares

    def closed_meanwhile():
        stop_prepares()
        join([start(h.pipe.close)])

    h.pipe._stop_prepares = closed_meanwhile
    h.pipe.cancel()
    assert all(f.done() for f in futs)
    assert h.pipe.stats().in_flight == 0

def test_cancel_with_nothing_in_flight_then_close():
    h = Harness(seed=2, slots=2, chunk_bytes=512)
    h.pipe.cancel()
    with pytest.raises(RuntimeError, match="no longer accepts work"):
        h.pipe.submit(h.item(1, 3))
    with pytest.raises(RuntimeError, match="no longer accepts work"):
        list(h.pipe.map([h.item(2, 3)]))
    assert h.pipe.stats() == rf.PipelineStats(0, 0, 0, 0, 0)
    h.close()


def test_close_finishes_accepted_work():
    h = Harness(seed=3, slots=1, chunk_bytes=512)
    futs = [h.pipe.submit(h.item(k + 1, 30)) for k in range(6)]
    h.close()
    for fut in futs:
        check_result(fut.result(), h.items[fut.index + 1], fut.index)
    assert h.final_states() == {i: ChunkState.DELIVERED for i in range(6)}


@pytest.mark.parametrize("taken", [0, 1, 3, 6])
def test_cancel_under_a_suspended_map(taken):
    h = Harness(seed=taken, slots=2, chunk_bytes=512)
    items = [h.item(k + 1, 30) for k in range(12)]
    gen = h.pipe.map(items)
    got = [next(gen) for _ in range(taken)]
    h.pipe.cancel()
    s = h.pipe.stats()
    assert s.in_flight == 0 and s.balanced()
    if taken == 0:  # the generator had not started: like a submit after cancel
        with pytest.raises(RuntimeError, match="no longer accepts work"):
            next(gen)
        h.close()
        return
    rest = []  # finished results already accepted may still come out, then the map is cut short
    with pytest.raises(concurrent.futures.CancelledError, match="cut short"):
        for value in gen:
            rest.append(value)
    for value, item in zip(got + rest, items):
        check_result(value, item)
    assert len(got + rest) <= s.delivered
    h.close()


def test_map_resumed_after_cancel_with_nothing_pending_is_cut_short():
    # every accepted chunk was handed out, input remains, and the pipeline was cancelled: the
    # map used to wait for a result that could never come ("this is a ringflow bug"), and then
    # to end as if its input were used up
    h = Harness(seed=7, slots=1, chunk_bytes=512, max_in_flight=1)
    items = [h.item(k + 1, 30) for k in range(5)]
    gen = h.pipe.map(items)
    check_result(next(gen), items[0])
    h.pipe.cancel()
    with pytest.raises(concurrent.futures.CancelledError, match="after handing out 1 result: the pipeline was cancelled"):
        next(gen)
    h.close()


@pytest.mark.parametrize("how", ["raise", "sticky"])
def test_map_on_a_stopped_pipeline_says_why(how):
    h = Harness(seed=8, slots=1, chunk_bytes=512)
    if how == "raise":
        with pytest.raises(StageError):
            h.pipe.submit(h.item(1, 5, "prepare")).result()
        with pytest.raises(RuntimeError, match="no longer accepts work"):
            list(h.pipe.map([h.item(2, 5)]))
    else:
        h.dev.inject_sticky_error()
        with pytest.raises(DeviceError, match="sticky"):
            h.pipe.submit(h.item(1, 5)).result()
        with pytest.raises(DeviceError, match="sticky"):
            list(h.pipe.map([h.item(2, 5)]))
    assert h.pipe.stats().in_flight == 0
    h.close()


@pytest.mark.parametrize("how", ["raise", "sticky"])
def test_map_waiting_for_capacity_when_the_pipeline_stops(how):
    # the map has nothing pending and waits for capacity held by a submitted chunk; that chunk
    # fails (on_error="raise") or the device breaks, so the pipeline stops taking work while
    # the map waits: it used to wait on ("the pipeline is idle ... this is a ringflow bug")
    h = Harness(seed=9, slots=1, chunk_bytes=512, max_in_flight=1)
    fut = h.pipe.submit(h.item(1, 5, "prepare" if how == "raise" else None))
    if how == "sticky":
        h.dev.inject_sticky_error()
    items = [h.item(k + 2, 5) for k in range(3)]
    if how == "raise":
        with pytest.raises(RuntimeError, match="no longer accepts work"):
            list(h.pipe.map(items))
        assert isinstance(fut.exception(), StageError)
    else:
        with pytest.raises(DeviceError, match="sticky"):
            list(h.pipe.map(items))
        assert fut.exception() is h.sched.broken
    assert h.pipe.stats().in_flight == 0 and h.pipe.stats().accepted == 1
    del fut
    h.close()


def _running_pipeline(dev):
    """A pipeline on ``dev`` with four items in flight, and its progress thread."""
    pipe = rf.Pipeline(f_affine, device=dev, chunk_bytes=1024, slots=1, checked=True)
    for i in range(4):
        pipe.submit(np.arange(50.0) + i)
    return pipe, pipe._driver.thread


def _ends_leaving_nothing(thread, dev) -> None:
    """The progress thread of a collected pipeline ends (it cleans up after the finaliser asks
    it to), and nothing of the pipeline is left live on ``dev``."""
    thread.join(timeout=10)
    assert not thread.is_alive()
    gc.collect()
    assert dev.live().total == 0


def test_gc_while_running_cancels_with_resource_warning():
    dev = rf.device("sim", seed=4, chaos=True)
    pipe, thread = _running_pipeline(dev)
    assert pipe.stats().in_flight == 4
    with pytest.warns(ResourceWarning, match="garbage-collected; cancelling it"):
        del pipe
        gc.collect()
    _ends_leaving_nothing(thread, dev)


def test_gc_while_running_where_warnings_are_errors_still_cancels():
    """The finaliser of a pipeline dropped with work in flight warns, then cancels. Where
    warnings are errors (``-W error``) the raised warning was swallowed with the cancel: the
    progress thread ran on, holding the pipeline's streams, rings and chunks for good."""
    dev = rf.device("sim", seed=4, chaos=True)
    pipe, thread = _running_pipeline(dev)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        del pipe
        gc.collect()
    _ends_leaving_nothing(thread, dev)


def test_gc_while_a_map_is_suspended():
    dev = rf.device("sim", seed=5, chaos=True)
    pipe = rf.Pipeline(f_affine, device=dev, chunk_bytes=1024, slots=2, checked=True)
    gen = pipe.map(np.arange(50.0) + i for i in range(20))
    assert np.array_equal(next(gen), np.arange(50.0) * 3 + 1)
    thread = pipe._driver.thread
    # the generator goes first (it holds the pipeline) and cancels what it took; a pipeline
    # collected with chunks still draining then warns that it cancels them, an idle one does not
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del pipe, gen
        gc.collect()
    assert all(w.category is ResourceWarning for w in caught), [str(w.message) for w in caught]
    _ends_leaving_nothing(thread, dev)


def test_gc_of_an_idle_unclosed_pipeline_is_quiet_and_clean():
    dev = rf.device("sim", seed=6)
    pipe = rf.Pipeline(f_affine, device=dev, chunk_bytes=1024, slots=1)
    assert np.array_equal(pipe.submit(np.arange(3.0)).result(), np.arange(3.0) * 3 + 1)
    thread = pipe._driver.thread
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del pipe
        gc.collect()
        _ends_leaving_nothing(thread, dev)


# -- one future cancelled by its caller --------------------------------------------------------
def _one(i):
    return np.arange(64, dtype=np.int64) + 1000 * i


def test_cancelling_a_queued_future_cancels_its_chunk_only():
    dev = rf.device("sim", seed=11, chaos=True)
    with rf.Pipeline(lambda x, y: np.multiply(x, 2, out=y), device=dev, chunk_bytes=512, slots=1,
                     checked=True) as pipe:
        futs = [pipe.submit(_one(i)) for i in range(3)]
        assert futs[2].cancel() and futs[2].cancelled()  # still accepted only: ends at once
        assert pipe.scheduler.chunks.get(2) is None
        assert [f.result().tolist() for f in futs[:2]] == [(_one(i) * 2).tolist() for i in range(2)]
        with pytest.raises(concurrent.futures.CancelledError):
            futs[2].result()
        assert not futs[0].cancel()  # delivered: too late
        s = pipe.stats()
        assert (s.delivered, s.cancelled, s.in_flight) == (2, 1, 0) and s.balanced()


def test_cancelling_an_enqueued_chunk_stops_it_and_frees_its_slots_after_its_work():
    """Its copies and kernel are on the streams: the future is cancelled at once, the chunk ends
    CANCELLED once that work completes (never delivered), and the checker sees no reuse of its
    slots before then."""
    dev = rf.device("sim", seed=12, chaos=True)
    with rf.Pipeline(lambda x, y: np.multiply(x, 2, out=y), device=dev, chunk_bytes=512, slots=2,
                     checked=True) as pipe:
        futs = [pipe.submit(_one(i)) for i in range(4)]
        s = pipe.scheduler
        while 1 not in s.chunks or s.chunks[1].state is not ChunkState.ON_DEVICE:
            pipe._step()
        chunk = s.chunks[1]
        assert futs[1].cancel() and futs[1].cancelled() and futs[1].done()
        assert chunk.state is ChunkState.DRAINING
        for i in (0, 2, 3):
            assert futs[i].result().tolist() == (_one(i) * 2).tolist()
        pipe.cancel()  # settle
        assert chunk.state is ChunkState.CANCELLED
        st = pipe.stats()
        assert (st.delivered, st.cancelled, st.in_flight) == (3, 1, 0) and st.balanced()
        assert all(slot.state is SlotState.FREE for ring in s.rings for slot in ring.slots)


def test_map_on_a_closed_pipeline_refuses_when_called():
    pipe = rf.Pipeline(lambda x, y: None, device=rf.device("sim"), chunk_bytes=64)
    gen = pipe.map([np.zeros(2)])  # made while open, iterated after close: refused then
    pipe.close()
    with pytest.raises(RuntimeError, match="closed"):
        pipe.map([np.zeros(2)])
    with pytest.raises(RuntimeError, match="closed"):
        next(gen)


# -- a map that stops early; many futures cancelled at once -------------------------------------
def _counting_commands(pipe) -> list:
    """Count the hand-overs to ``pipe``'s progress thread (each a round trip for the caller)."""
    calls: list = []
    real = pipe._driver.command

    def command(fn, **kw):
        calls.append(fn)
        return real(fn, **kw)

    pipe._driver.command = command
    return calls


def test_cancel_chunks_cancels_many_futures_with_one_hand_over():
    from ringflow._pipeline.chunk import cancel_chunks

    dev = rf.device("sim", seed=13, chaos=True)
    with rf.Pipeline(lambda x, y: np.multiply(x, 2, out=y), device=dev, chunk_bytes=512, slots=1,
                     checked=True) as pipe:
        futs = [pipe.submit(_one(i)) for i in range(8)]
        pending = [f for f in futs if not f.done()]  # a full submit waits: the sim ran the first few
        done = len(futs) - len(pending)
        assert len(pending) >= 4
        calls = _counting_commands(pipe)
        assert cancel_chunks(futs + pending[:1]) == [False] * done + [True] * len(pending) + [True]
        assert len(calls) == 1
        assert all(f.cancelled() for f in pending)
        assert cancel_chunks(futs) == [False] * 8 and len(calls) == 1  # all done: no hand-over
        pipe.cancel()
        s = pipe.stats()
        assert (s.delivered, s.cancelled, s.in_flight) == (done, len(pending), 0) and s.balanced()


@pytest.mark.parametrize("size", [64, 8], ids=["own-chunks", "shared-chunks"])
@pytest.mark.parametrize("how", ["close", "break", "error-in-loop"])
def test_a_map_stopped_early_cancels_what_it_took_in_one_hand_over(size, how):
    """As ``Executor.map``: what the map took and had not handed out is not wanted once its
    caller stops; it is cancelled (with one round trip to the progress thread), not computed."""
    dev = rf.device("sim", seed=14, chaos=True)
    with rf.Pipeline(lambda x, y: np.multiply(x, 2, out=y), device=dev, chunk_bytes=512, slots=2,
                     max_in_flight=6, checked=True) as pipe:
        items = [np.arange(size, dtype=np.int64) + 1000 * i for i in range(20)]
        gen = pipe.map(items)
        assert next(gen).tolist() == (items[0] * 2).tolist()
        calls = _counting_commands(pipe)
        if how == "close":
            gen.close()
        elif how == "break":
            for _ in gen:
                break
            del gen
        else:
            with pytest.raises(ZeroDivisionError):
                for _ in gen:
                    raise ZeroDivisionError("the loop body failed")
            del gen
        assert pipe.stats().cancelled >= 1 and len(calls) == 1
    s = pipe.stats()  # (a cancelled chunk whose copies were enqueued ends once they complete)
    assert s.in_flight == 0 and s.balanced() and s.cancelled >= 1
    assert s.delivered + s.cancelled == s.accepted < len(items)
    gc.collect()
    assert dev.live().total == 0


def test_an_amap_stopped_early_cancels_its_window_in_one_call(monkeypatch):
    """One hand-over to the progress thread (if any is still live), and the amap ends once it was
    carried out."""
    import asyncio

    from ringflow._pipeline import aio

    handed, posted = [], []
    real, real_post = aio.cancel_unwanted_soon, aio.post_cancel
    monkeypatch.setattr(aio, "cancel_unwanted_soon", lambda futs: (handed.append(list(futs)), real(futs))[1])
    monkeypatch.setattr(aio, "post_cancel", lambda futs, then=None: (posted.append(futs), real_post(futs, then))[1])
    dev = rf.device("sim", seed=15)
    items = [_one(i) for i in range(20)]

    async def releaser(pipe, release):
        while pipe.stats().accepted < 1 + 5:  # the blocker, and the map's whole window
            await asyncio.sleep(0)
        release.set()

    async def main(pipe, release):
        task = asyncio.create_task(releaser(pipe, release))
        async for _ in pipe.amap(items):
            break
        await task

    with rf.Pipeline(lambda x, y: np.multiply(x, 2, out=y), device=dev, chunk_bytes=512, slots=2,
                     max_in_flight=5) as pipe:
        # the progress thread is held until the map has taken its whole window, so that no result
        # is ready before (a map hands a ready result out before taking more)
        release = hold_progress_thread(pipe.submit(_one(99)))
        try:
            asyncio.run(main(pipe, release))
        finally:
            release.set()
        assert len(handed) == 1 and len(handed[0]) == 4  # the window after the first result
        assert len(posted) <= 1 and all(f.done() for f in handed[0])
    assert pipe.stats().balanced()


def test_cancelling_a_chunk_that_waits_in_the_inbox_behind_a_shared_chunk_being_copied_into():
    """A chunk of its own accepted behind a shared chunk whose item is still being copied in
    cannot be admitted yet; its future's cancel() still cancels it (True), and admission then
    ends it CANCELLED, nothing of it run, while the shared item is delivered."""
    pipe = rf.Pipeline(lambda x, y: np.multiply(x, 3, out=y), device=rf.device("sim", seed=4), chunk_bytes=8 << 20,
                       max_in_flight=8)
    go, small = pause_first_shared_copy(pipe, np.arange(64.0))
    behind = pipe.submit(np.ones((5 << 20) // 8))  # over 4 MiB: a chunk of its own, behind the shared one
    assert behind.cancel() and behind.cancelled()
    go.set()
    (fut,) = join([small])
    assert np.array_equal(fut.result(timeout=JOIN_S), np.arange(64.0) * 3)
    pipe.close()
    stats = pipe.stats()
    assert (stats.accepted, stats.delivered, stats.cancelled, stats.in_flight) == (2, 1, 1, 0), stats


def test_a_map_s_chunk_cancelled_at_admission_is_counted_once_as_the_map_s():
    """A map's chunk of its own waits in the inbox behind a shared chunk being copied into when
    the pipeline is cancelled; admission then ends it CANCELLED without running it. The map
    hands that outcome out like any other, so the count of results held for maps
    (``Scheduler.unclaimed``) must have counted it: it ends at 0, never below."""
    pipe = rf.Pipeline(lambda x, y: np.multiply(x, 3, out=y), device=rf.device("sim", seed=6), chunk_bytes=8 << 20,
                       max_in_flight=8)
    sched = pipe.scheduler
    go, small = pause_first_shared_copy(pipe, np.arange(64.0))
    in_inbox, real_accept = threading.Event(), sched.accept

    def accept(*args, **kwargs):
        chunk = real_accept(*args, **kwargs)
        in_inbox.set()
        return chunk

    sched.accept = accept

    def run_map():
        try:
            return list(pipe.map([np.ones((5 << 20) // 8)]))  # over 4 MiB: a chunk of its own
        except Exception as exc:  # noqa: BLE001 - the cancel's outcome, looked at below
            return exc

    mapped = start(run_map)
    assert in_inbox.wait(JOIN_S)
    cancelled = threading.Event()
    real_cancel_pending = sched.cancel_pending

    def cancel_pending():
        real_cancel_pending()
        cancelled.set()

    sched.cancel_pending = cancel_pending
    cancelling = start(pipe.cancel)  # (it returns once the copy in progress has ended)
    assert cancelled.wait(JOIN_S)  # admission stopped, the map's chunk still in the inbox
    go.set()
    join([small, cancelling])
    (outcome,) = join([mapped])
    assert outcome == [] or isinstance(outcome, Exception), outcome
    pipe.close()
    assert sched.unclaimed == 0, sched.unclaimed
    stats = pipe.stats()
    assert stats.in_flight == 0 and stats.balanced(), stats




def _end(pipe, ending: str) -> None:
    if ending == "close":
        pipe.close()
    elif ending == "cancel":
        pipe.cancel()
    else:
        with pytest.raises(ValueError, match="left by an error"):
            with pipe:
                raise ValueError("left by an error")


@pytest.mark.parametrize("stage", ["prepare", "consume"])
@pytest.mark.parametrize("ending", ["close", "cancel", "with-error"])
def test_an_ending_waiting_for_a_stage_that_does_not_return_says_so_once(monkeypatch, ending, stage):
    """close(), cancel() or leaving a with block waits for a stage call that never returns (the
    user's code blocked on a lock or a socket): that wait cannot be stopped from the pipeline, and
    it used to go on for ever without a word. Once it has lasted the threshold, one warning on the
    "ringflow" logger names the ending, the stage, the item and how long, and says what ends it."""
    from ringflow._pipeline import driver

    monkeypatch.setattr(driver, "_STALLED_WARN_S", 0.05)  # the test's pace, not a real 10 s
    looks, looked_again = [], threading.Event()
    look = driver._look_for_stalled

    def counted_look(*args):
        look(*args)
        looks.append(len(records.records))
        if len([n for n in looks if n]) >= 4:  # looked three more times after the warning
            looked_again.set()

    monkeypatch.setattr(driver, "_look_for_stalled", counted_look)
    records = LogRecords()
    logger = logging.getLogger("ringflow")
    logger.addHandler(records)
    started, release = threading.Event(), threading.Event()

    def block(k):
        if k == 1:
            started.set()
            release.wait(JOIN_S)  # user code that does not return until the test lets it

    kwargs = {"prepare": lambda item: block(int(item[0])) or item} if stage == "prepare" else \
        {"consume": lambda index, item, result: block(index)}
    try:
        pipe = rf.Pipeline(f_affine, device=rf.device("sim", checked=True), chunk_bytes=512, **kwargs)
        futs = [pipe.submit(np.full(8, float(k))) for k in range(3)]
        waiter = start(concurrent.futures.wait, futs, JOIN_S)  # someone waits: the stages run
        assert started.wait(JOIN_S)
        ender = start(_end, pipe, ending)
        assert records.arrived.wait(JOIN_S), "no warning while the ending waited for a stage that did not return"
        assert looked_again.wait(JOIN_S)
        assert not ender.done()
        release.set()
        join([ender, waiter])
    finally:
        release.set()
        logger.removeHandler(records)
    messages = [r.getMessage() for r in records.records]
    # once for that call; another stage call that ran past the test's short threshold on a loaded
    # host is named in a warning of its own, never again
    named = [r for r in records.records if f"{stage} of item 1 (running for " in r.getMessage()]
    assert len(named) == 1 and len(set(messages)) == len(messages), messages
    record = named[0]
    message = record.getMessage()
    call = {"close": "close()", "cancel": "cancel()", "with-error": "leaving the with block"}[ending]
    assert record.levelno == logging.WARNING and record.name.startswith("ringflow"), record
    assert message.startswith(call) and f"{stage} of item 1 (running for " in message, message
    assert "cannot be stopped" in message and "make the stage return" in message, message
    pipe.close()
    assert all(f.done() for f in futs) and pipe.stats().in_flight == 0


# -- a map cut short by a cancel or a close raises; it never ends as if its input were used up ------
def _double(x, y):
    y[...] = x * 2 + 1


CUT_BY = ["cancel on another thread", "cancel in the loop over the map", "close on another thread",
          "close in the loop over the map"]


def _cut_pipe(n_devices: int, seed: int, max_in_flight: int = 2):
    devs = [rf.device("sim", chaos=True, seed=seed + k, checked=True) for k in range(n_devices)]
    return rf.Pipeline(_double, device=devs[0] if n_devices == 1 else devs, chunk_bytes=512,
                       max_in_flight=max_in_flight, checked=True)


def _inputs(n: int) -> list:
    return [np.arange(8, dtype=np.float32) + 10 * k for k in range(n)]


def _takes_no_more(pipe) -> bool:
    """Whether ``pipe`` takes no more work (over several devices, a close begun is enough)."""
    return getattr(pipe, "parts", None) is not None and pipe._closed or \
        all(not part._sched.accepting for part in pipe._each())


class _Stopper:
    """Stops ``pipe`` as ``how`` says (one of CUT_BY) when called, on the consumer's thread; a
    close on another thread is waited for only until the pipeline takes no more work (it then
    waits for the map, which is still to hand out its results): :meth:`join` waits for its end."""

    def __init__(self, pipe, how: str):
        self.pipe, self.how, self.closing = pipe, how, None

    def __call__(self) -> None:
        if self.how == "cancel on another thread":
            join([start(self.pipe.cancel)])
        elif self.how == "cancel in the loop over the map":
            self.pipe.cancel()
        elif self.how == "close in the loop over the map":
            # on an amap's own loop: close() cannot wait for the amap, and takes what it holds
            self.pipe.close()
        else:
            self.closing = start(self.pipe.close)
            deadline = time.monotonic() + JOIN_S
            while not _takes_no_more(self.pipe):
                assert time.monotonic() < deadline, "close() never stopped admission"
                time.sleep(0.001)

    def join(self) -> None:
        if self.closing is not None:
            join([self.closing])
        self.pipe.close()


def _run_cut(pipe, face: str, items: list, taken: int, stop) -> tuple:
    """Take ``taken`` results of ``pipe``'s ``face`` ("map" or "amap") over ``items``, call ``stop``,
    then take the rest; returns (every result taken, what ended the map: None where it ended)."""
    got: list = []

    def take(result) -> None:
        got.append(result)
        if len(got) == taken:
            stop()

    try:
        take_each(pipe, face, items, take)
    except BaseException as exc:  # noqa: BLE001 - returned for the test to judge
        return got, exc
    return got, None


@pytest.mark.parametrize("how", CUT_BY)
@pytest.mark.parametrize("face", ["map", "amap"])
@pytest.mark.parametrize("n_devices", [1, 2])
def test_a_map_cut_short_by_a_cancel_or_a_close_raises_after_the_results_that_had_ended(n_devices, face, how):
    """``list(pipe.map(items))`` must never be short without a word: a map (or amap, on one device
    or over two) still holding input when the pipeline is cancelled or closed under it hands out
    the results that had ended, in order, then raises concurrent.futures.CancelledError saying
    why, how many results it handed out, and what to do. An amap closed on its own loop (close()
    takes the items it holds, as it cannot wait for it) is cut short too, not ended as if its
    input were used up. The message says the pipeline was closed "by another caller" only where
    another thread closed it: not where the map's own consumer did, in the loop over it."""
    pipe = _cut_pipe(n_devices, seed=31)
    items = _inputs(40)
    stopper = _Stopper(pipe, how)
    got, err = bounded(lambda: _run_cut(pipe, face, items, 3, stopper))
    stopper.join()
    assert type(err) is concurrent.futures.CancelledError, repr(err)
    assert not isinstance(err, asyncio.CancelledError)
    message = str(err)
    assert f"{face}() was cut short after handing out {len(got)} result" in message, message
    assert ("closed" if how.startswith("close") else "cancelled") in message, message
    if how.startswith("close"):
        # "by another caller" only where another thread closed it, not the map's own consumer
        assert "the pipeline was closed" in message, message
        assert ("by another caller" in message) == (how == "close on another thread"), message
    assert "were not run: submit them to a new Pipeline" in message and "break out of its loop" in message, message
    assert 3 <= len(got) < len(items)
    for value, item in zip(got, items):
        np.testing.assert_array_equal(value, item * 2 + 1)
    s = pipe.stats()
    assert s.in_flight == 0 and s.balanced() and len(got) <= s.delivered, s


@pytest.mark.parametrize("how", CUT_BY)
@pytest.mark.parametrize("face", ["map", "amap"])
@pytest.mark.parametrize("n_devices", [1, 2])
def test_a_map_whose_input_was_all_handed_out_ends_normally_after_a_cancel_or_a_close(n_devices, face, how):
    """Every item's result handed out, then the pipeline is cancelled or closed before the map
    is asked for more: it ends as its input did, raising nothing, whether or not it had seen the
    end of its input before (here: not, with room for one item at a time)."""
    for max_in_flight in (8, 1):
        pipe = _cut_pipe(n_devices, seed=41, max_in_flight=max_in_flight)
        items = _inputs(3)
        stopper = _Stopper(pipe, how)
        got, err = bounded(lambda: _run_cut(pipe, face, items, len(items), stopper))
        stopper.join()
        assert err is None, repr(err)
        assert len(got) == len(items)
        for value, item in zip(got, items):
            np.testing.assert_array_equal(value, item * 2 + 1)
        s = pipe.stats()
        assert s.in_flight == 0 and s.balanced() and s.delivered == len(items), s
