"""The progress thread: its command queue (commands posted without the pipeline's lock), its end
at interpreter exit, and what its death leaves behind."""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

import ringflow as rf
from ringflow._device import host_pool
from ringflow._pipeline import sigint
from ringflow._pipeline.states import ChunkState
from tests.helpers.pipeline_checks import drop_tracebacks
from tests.helpers.sim import Timeline
from tests.helpers.threads import JOIN_S, bounded, interrupt_main, join, pause_first_shared_copy, start


def _pipe():
    dev = rf.device("sim", seed=3, chaos=True)
    return rf.Pipeline(lambda x, y: np.multiply(x, 2, out=y), device=dev, chunk_bytes=512, checked=True)


def test_a_posted_command_runs_on_the_progress_thread_and_the_poster_never_waits_for_the_lock():
    pipe = _pipe()
    driver = pipe._driver
    ran_on, handed = [], threading.Event()
    outcome: dict = {}
    holding, release = threading.Event(), threading.Event()

    def hold():
        with driver.lock:
            holding.set()
            release.wait(JOIN_S)

    holder = start(hold)
    assert holding.wait(JOIN_S)
    # posted while another thread holds the lock: returns at once (this thread would otherwise
    # wait for the holder, which waits for it)
    driver.post(lambda: ran_on.append(threading.current_thread()) or 42,
                lambda cmd: (outcome.update(value=cmd.value, error=cmd.error), handed.set()))
    assert not handed.is_set()
    release.set()
    join([holder])
    assert handed.wait(JOIN_S)
    assert ran_on == [driver.thread] and outcome == {"value": 42, "error": None}
    pipe.close()


@pytest.mark.parametrize("where", ["taking the lock", "taking it back after a wait"])
def test_a_hold_on_the_main_thread_gives_the_lock_up_to_ctrl_c_while_another_thread_keeps_it(where):
    """A call holding the pipeline's lock as a Hold (close, cancel, leaving a with block), shielded
    on the main thread: a Ctrl-C that comes while another thread keeps the lock (on the simulated
    GPU, the progress thread running a stage inside a step) is raised without the lock, which
    stays that thread's and is free once it lets go. Condition.wait took it back in a wait that no
    signal ends."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("delivers SIGINT to the main thread: the test must run there")
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is not Python's default KeyboardInterrupt handler here")
    pipe = _pipe()
    driver = pipe._driver
    holding, release, raised = threading.Event(), threading.Event(), threading.Event()
    found: dict = {}

    def keep():
        with driver.lock:
            holding.set()
            release.wait(JOIN_S)

    def ctrl_c_once_kept():
        if holding.wait(JOIN_S):
            interrupt_main()
            found["raised"] = raised.wait(JOIN_S)
        release.set()

    holds = []
    keeper = sender = None
    with pytest.raises(KeyboardInterrupt):
        with sigint.shielded():
            try:
                if where == "taking the lock":
                    keeper = start(keep)
                    assert holding.wait(JOIN_S)
                    sender = start(ctrl_c_once_kept)
                    with driver.hold() as hold:  # never got: the Ctrl-C comes out first
                        holds.append(hold)
                else:
                    sender = start(ctrl_c_once_kept)
                    with driver.hold() as hold:
                        holds.append(hold)
                        keeper = start(keep)  # takes the lock as soon as the wait lets go of it
                        driver.wait_for(lambda: False, None, hold=hold)
            except KeyboardInterrupt:
                raised.set()
                assert not driver.lock.acquire(blocking=False)  # still the keeper's
                raise
    join([sender, keeper])
    assert found["raised"] and all(not hold.held for hold in holds)
    # free again, nothing left taken (the pipeline's progress thread may hold it for a moment: a
    # look without waiting failed once under a loaded machine)
    assert driver.lock.acquire(timeout=JOIN_S)
    driver.lock.release()
    bounded(pipe.close)


def test_a_command_posted_after_the_progress_thread_ended_is_handed_back_unrun():
    pipe = _pipe()
    driver = pipe._driver
    pipe.close()
    assert driver.ended and not driver.thread.is_alive()
    ran, handed = [], []
    driver.post(lambda: ran.append(1), handed.append)  # would otherwise wait for ever
    assert ran == [] and len(handed) == 1 and not driver.commands
    assert isinstance(handed[0].error, RuntimeError) and "ended" in str(handed[0].error)


EXIT_SCRIPT = r"""
import atexit, threading

def progress_threads_at_exit():  # registered first, so it runs after ringflow's own exit hook
    alive = [t.name for t in threading.enumerate() if t.name.startswith("ringflow-progress") and t.is_alive()]
    print("alive at exit:", alive, flush=True)

atexit.register(progress_threads_at_exit)

import numpy as np
import ringflow as rf

pipe = rf.Pipeline(lambda x, y: np.multiply(x, 2, out=y), device=rf.device("sim", seed=1), chunk_bytes=1024,
                   deliver="device", slots=rf.SlotCounts(host_in=1, device_in=1, device_out=1, host_out=1))
held = pipe.submit(np.ones(4, np.float32)).result(timeout=10)
futs = [pipe.submit(np.ones(4, np.float32)) for _ in range(3)]  # waiting for the slot held
print("left open", flush=True)
"""


def test_interpreter_exit_ends_the_progress_thread_of_a_pipeline_left_open():
    # a daemon thread still running when the interpreter finalises is frozen holding whatever lock
    # it held: the collector's finalisers, on the main thread afterwards, then waited for ever
    proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=JOIN_S)
    assert proc.returncode == 0, proc.stderr
    assert "left open" in proc.stdout and "alive at exit: []" in proc.stdout, proc.stdout + proc.stderr


def test_the_wake_flag_is_an_event_whose_set_takes_no_python_lock():
    from ringflow._pipeline.driver import WakeFlag

    flag = WakeFlag()
    assert not flag.is_set() and flag.wait(0.01) is False  # times out unset
    flag.set()
    flag.set()  # twice: still one pending wake, no error
    assert flag.is_set() and flag.wait(0) and flag.wait(None)  # stays set until cleared
    flag.clear()
    assert not flag.is_set() and flag.wait(0.01) is False
    waiter = start(flag.wait, None)
    flag.set()  # from another thread: the waiter wakes
    assert join([waiter]) == [True]
    flag.clear()
    flag.clear()
    assert not flag.is_set()


def _affine(x, y):
    y[...] = x * 3 + 1


def _dies_with_a_d2h_in_flight(sched) -> None:
    """Make the scheduler's step raise (a ringflow bug, injected) at the first step after which
    a chunk not yet ended has its d2h enqueued: a copy into the chunk's pooled block (its staged
    item, or its part of a slab) is then pending, and nothing has seen it complete."""
    real_step = sched.step

    def step():
        progressed = real_step()
        if any(c.d2h_event is not None for c in sched.chunks.values()):
            raise AssertionError("injected: a scheduler step failed with a d2h into a pooled block in flight")
        return progressed

    sched.step = step


def _nothing_left(dev) -> None:
    """Once the warm pipelines are dropped, nothing is live on ``dev`` and its pool lends nothing."""
    rf.drop_warm_pipelines(dev)
    gc.collect()
    assert dev.live().total == 0, dev.live()
    assert host_pool.pool_for(dev).stats().in_use_bytes == 0


def _next_pipeline_runs_clean(dev, items: list, coalesce: bool) -> None:
    """A new pipeline on ``dev`` (checked) maps ``items`` right and closes; the blocks it took
    from the device's pool went back (the dead pipeline's blocks among them)."""
    second = rf.Pipeline(_affine, device=dev, chunk_bytes=4096, slots=2, checked=True, coalesce=coalesce)
    got = list(second.map(items))
    assert all(np.array_equal(r, a * 3 + 1) for r, a in zip(got, items, strict=True))
    bounded(second.close)
    del got
    gc.collect()


def _run_to_death(dev, coalesce: bool, items: list, compute=_affine):
    """A pipeline on ``dev`` whose progress thread dies with copies into pooled blocks in flight;
    checks that every future and close() raise what killed it, in bounded time. Returns its
    stats after close (the futures' tracebacks dropped, so that what they held can go)."""
    pipe = rf.Pipeline(compute, device=dev, chunk_bytes=4096, slots=2, checked=True, max_in_flight=8,
                       coalesce=coalesce)
    _dies_with_a_d2h_in_flight(pipe.scheduler)
    futs = [pipe.submit(a) for a in items]
    done, not_done = concurrent.futures.wait(futs, timeout=JOIN_S)
    assert not not_done
    errors = [f.exception(timeout=0) for f in futs]
    assert all(isinstance(e, RuntimeError) and "progress thread died" in str(e) for e in errors), errors
    with pytest.raises(RuntimeError, match="progress thread died"):
        bounded(pipe.close)
    drop_tracebacks(errors)
    return pipe.stats()


@pytest.mark.parametrize("coalesce", [False, True])
def test_a_dead_progress_thread_hands_no_pooled_block_back_before_its_copies_complete(coalesce):
    """The progress thread dies (a ringflow bug) while d2h copies into pooled blocks are pending:
    its chunks fail, close() ends, and the pipeline's blocks go back to the device's pool only
    once those copies are known complete. They used to go back as the dead pipeline was dropped,
    unordered after the copies, and the next pipeline on the device to take them got a
    HazardError (on a GPU: its data overwritten by the dead pipeline's copy)."""
    dev = rf.device("sim", seed=5, chaos=True)
    items = [np.arange(512.0 if not coalesce else 256.0) + 1000 * k for k in range(6)]
    stats = _run_to_death(dev, coalesce, items)
    gc.collect()  # the dead pipeline, its chunks and their pooled arrays: the blocks go back to the pool
    # the next pipeline on the device takes those blocks (it raised HazardError here: the copy
    # into a block was not ordered before the pool's poison fill as it took the block back)
    _next_pipeline_runs_clean(dev, items, coalesce)
    assert dev.live().total == 0, dev.live()
    assert host_pool.pool_for(dev).stats().in_use_bytes == 0
    # every accepted item of the dead pipeline ended (failed), none left in flight
    assert stats.accepted == len(items) and stats.failed == len(items) and stats.balanced(), stats


def test_a_dead_progress_thread_keeps_the_blocks_of_copies_it_cannot_see_complete(caplog):
    """When the work its pipeline enqueued does not complete within the bound (here a kernel that
    runs for virtual hours), the dead thread never gives the blocks that work may still write
    back to the pool: they are kept for good, and a warning says so. The next pipeline on the
    device gets other blocks and runs clean."""
    dev = rf.device("sim", seed=5, chaos=True)
    items = [np.arange(512.0) + 1000 * k for k in range(4)]

    def slow(x, y):
        y[...] = x * 3 + 1

    slow.sim_seconds = 3600.0
    with caplog.at_level(logging.WARNING, logger="ringflow"):
        stats = _run_to_death(dev, False, items, compute=slow)
    assert stats.failed == len(items) and stats.balanced(), stats
    assert any("never" in r.getMessage() and "pool" in r.getMessage() for r in caplog.records), caplog.text
    gc.collect()
    pool = host_pool.pool_for(dev)
    kept = pool.stats().in_use_bytes
    assert kept > 0  # the blocks of the copies still pending are nobody's to hand out
    _next_pipeline_runs_clean(dev, items, False)
    assert pool.stats().in_use_bytes == kept


def test_a_pipeline_whose_progress_thread_died_refuses_more_work_saying_why():
    """An item offered after the progress thread died is refused at once with what killed it;
    it used to be accepted into an inbox nobody admits, its future pending for ever for a waiter
    outside the pipeline (``concurrent.futures.wait``)."""
    dev = rf.device("sim", seed=5, chaos=True)
    pipe = rf.Pipeline(_affine, device=dev, chunk_bytes=4096, slots=2, checked=True, max_in_flight=8)
    _dies_with_a_d2h_in_flight(pipe.scheduler)
    futs = [pipe.submit(np.arange(512.0) + k) for k in range(2)]
    done, not_done = concurrent.futures.wait(futs, timeout=JOIN_S)
    assert not not_done
    with pytest.raises(RuntimeError, match="no longer accepts work: the pipeline's progress thread died"):
        pipe.submit(np.arange(512.0))
    with pytest.raises(RuntimeError, match="progress thread died"):
        bounded(pipe.close)
    drop_tracebacks([f.exception(timeout=0) for f in futs])


def test_a_step_that_dies_inside_a_done_callback_ends_the_pipeline_as_the_thread_s_death(caplog):
    """A done-callback runs on the progress thread, and one that waits on the pipeline
    (``submit(...).result()``) drives the scheduler there. A step that raised in that drive (a
    ringflow bug) went up through the callback, where the error was logged as the callback's
    own, and the thread carried on with whatever the step had left: now the pipeline dies of it
    as if the thread's own step had raised (every future fails, naming the bug; close() ends)."""
    dev = rf.device("sim", seed=5, chaos=True)
    pipe = rf.Pipeline(_affine, device=dev, chunk_bytes=4096, slots=2, checked=True, max_in_flight=8)
    sched, real_step = pipe.scheduler, pipe.scheduler.step
    in_callback = threading.local()

    def step():
        if getattr(in_callback, "on", False):
            raise AssertionError("injected: a scheduler step failed in a done-callback's wait")
        return real_step()

    sched.step = step
    inner = []

    def callback(_fut):
        in_callback.on = True
        try:
            inner.append(pipe.submit(np.arange(512.0) + 7))
            inner[-1].result()
        finally:
            in_callback.on = False

    first = pipe.submit(np.arange(512.0))
    later = [pipe.submit(np.arange(512.0) + k) for k in range(1, 4)]
    first.add_done_callback(callback)  # (after every submit: once it runs, the pipeline takes no more)
    done, not_done = concurrent.futures.wait([first, *later], timeout=JOIN_S)
    assert not not_done and inner
    done, not_done = concurrent.futures.wait(inner, timeout=JOIN_S)
    assert not not_done
    errors = [f.exception(timeout=0) for f in [*later, *inner]]
    assert all(isinstance(e, RuntimeError) and "progress thread died" in str(e) for e in errors), errors
    assert all("injected" in repr(e.__cause__) for e in errors)
    with pytest.raises(RuntimeError, match="progress thread died"):
        bounded(pipe.close)
    stats = pipe.stats()
    assert stats.balanced() and stats.in_flight == 0, stats
    drop_tracebacks(errors)


def test_on_the_simulated_gpu_a_thread_nobody_waits_on_does_not_spin(monkeypatch):
    """On the simulated GPU the progress thread steps only while someone waits. A turn that did
    not step still found the copies into shared chunks it had not taken (nobody had stepped to
    take them) and turned again at once: a busy loop holding the GIL until someone waited,
    hundreds of thousands of turns for a 100-item map over four devices. Now such a turn idles
    until a wait (or a command) wakes it."""
    from ringflow._pipeline import driver

    turns = [0]
    real = driver.ProgressThread.step_once

    def step_once(self):
        turns[0] += 1
        return real(self)

    monkeypatch.setattr(driver.ProgressThread, "step_once", step_once)
    items = [np.full(100, k, np.float32) for k in range(100)]
    devices = [rf.device("sim", seed=k) for k in range(4)]
    with rf.Pipeline(_affine, device=devices, chunk_bytes=1 << 16) as pipe:
        got = list(pipe.map(items))
    assert all(np.array_equal(r, a * 3 + 1) for r, a in zip(got, items, strict=True))
    assert turns[0] < 20 * len(items), turns[0]


# -- a whole-array call: the calling thread drives, and its step dies ------------------------------

def _arrays(dev, pooled: bool, n: int = 4096):
    """``x`` (and an ``out`` for it) of ``n`` float64: arrays from ``dev``'s host pool (the copy
    engines use them in place) or plain ones (staged through pinned rings)."""
    if pooled:
        x = rf.host.empty((n,), np.float64, device=dev)
        x[...] = np.arange(n)
        return x, rf.host.empty_like(x, device=dev)
    return np.arange(float(n)), np.empty(n)


@pytest.mark.parametrize("pooled", [True, False])
def test_a_whole_array_call_whose_scheduler_step_dies_fails_clearly_and_hands_no_memory_back_early(pooled, recwarn):
    """The scheduler's step raises (a ringflow bug, injected) in a ``stream_map`` on the
    scheduled engine while d2h copies into the caller's pool array ``out`` (or into the
    pipeline's pinned ring, staged) are pending: the call raises that error, every chunk has
    ended, and the memory those copies write goes back to the pool only once they are seen
    complete: a following call on the device that takes the same blocks runs clean."""
    from ringflow import _testing
    from ringflow._pipeline import warm

    dev = rf.device("sim", seed=5, chaos=True)
    x, out = _arrays(dev, pooled)
    seen = []

    def hook(engine):
        seen.append(engine.pipe)
        _dies_with_a_d2h_in_flight(engine.pipe.scheduler)

    def call():
        with _testing.inject(on_engine=hook):  # (the hooks are the calling thread's)
            rf.stream_map(_affine, x, out, device=dev, chunk_bytes=4096, engine="pipeline", checked=True,
                          host="auto" if pooled else "stage")

    with pytest.raises(AssertionError, match="injected") as info:
        bounded(call)
    drop_tracebacks([info.value])
    del info
    (pipe,) = seen
    stats = pipe.stats()
    assert stats.in_flight == 0 and stats.failed == stats.accepted > 0 and stats.balanced(), stats
    assert len(warm.WARM) == 0 or all(p is not pipe for p, *_ in warm.WARM._parked.values())
    seen.clear()
    pipe = x = out = None  # (the closures above read these names)
    gc.collect()
    # the same calls again, on the blocks the dead call's copies wrote (the pool's poison fill,
    # or this call's copies, raised HazardError where those were not ordered after them)
    x, out = _arrays(dev, pooled)
    got = rf.stream_map(_affine, x, out, device=dev, chunk_bytes=4096, engine="pipeline", checked=True,
                        host="auto" if pooled else "stage")
    assert np.array_equal(got, np.arange(4096.0) * 3 + 1)
    got = x = out = None
    _nothing_left(dev)
    # nothing of the dead call was released unordered after its copies (a ring's close said so
    # in a warning, the call going on)
    assert not [str(w.message) for w in recwarn if issubclass(w.category, RuntimeWarning)]


def _whole_array_call(call, on_engine):
    """``call()`` on another thread (bounded), ``on_engine`` given the engine of every
    whole-array call it makes (the hooks are the calling thread's); returns what it returned."""
    from ringflow import _testing

    def body():
        with _testing.inject(on_engine=on_engine):
            return call()

    return bounded(body)


def test_a_warm_pipeline_whose_step_died_is_not_kept_for_the_next_call():
    """``stream_map`` takes the pipeline its last call left warm, and a step of it dies (a
    ringflow bug, injected into that pipeline's scheduler): the call fails, and the pipeline is
    closed, not parked again: the next call of the same shape runs on a new one, clean."""
    from ringflow._pipeline import warm

    rf.drop_warm_pipelines()  # the counts below are this test's own (an earlier test may leave one warm)
    dev = rf.device("sim", seed=7, chaos=True)
    x = np.arange(4096.0)
    seen = []

    def run():
        return rf.stream_map(_affine, x, device=dev, chunk_bytes=4096, engine="pipeline", host="stage")

    def kill(engine):
        seen.append(engine.pipe)
        if len(seen) == 2:  # the warm one, taken again
            _dies_with_a_d2h_in_flight(engine.pipe.scheduler)

    assert np.array_equal(_whole_array_call(run, kill), x * 3 + 1)
    assert len(warm.WARM) == 1
    with pytest.raises(AssertionError, match="injected"):
        _whole_array_call(run, kill)
    assert seen[1] is seen[0]
    assert len(warm.WARM) == 0
    assert np.array_equal(_whole_array_call(run, kill), x * 3 + 1)
    assert seen[2] is not seen[0]
    seen.clear()
    rf.drop_warm_pipelines(dev)
    gc.collect()
    assert dev.live().total == 0, dev.live()


def test_a_map_job_whose_step_dies_fails_clearly_and_closes():
    """A ``MapJob`` call on the scheduled engine whose step dies (injected) with copies into the
    caller's pool arrays pending raises its error; the job is closed and holds nothing, and a
    new job over the same pool arrays runs clean."""
    dev = rf.device("sim", seed=9, chaos=True)
    x, out = _arrays(dev, pooled=True)
    job = rf.MapJob(_affine, x, out, device=dev, chunk_bytes=4096, engine="pipeline", checked=True)

    def kill(engine):
        _dies_with_a_d2h_in_flight(engine.pipe.scheduler)

    with pytest.raises(AssertionError, match="injected") as info:
        _whole_array_call(job, kill)
    drop_tracebacks([info.value])
    del info
    assert job.closed
    with rf.MapJob(_affine, x, out, device=dev, chunk_bytes=4096, engine="pipeline", checked=True) as again:
        assert np.array_equal(again(), np.arange(4096.0) * 3 + 1)
    job.close()
    del job, again, x, out
    gc.collect()
    assert dev.live().total == 0, dev.live()
    assert host_pool.pool_for(dev).stats().in_use_bytes == 0


def test_a_direct_call_whose_enqueue_pass_dies_fails_clearly_after_its_copies():
    """The direct engine's enqueue loop raises (a ringflow bug, injected) once d2h copies into
    the caller's pool array ``out`` are enqueued: the call raises that error only once nothing
    enqueued still touches ``x`` or ``out``, so their blocks go back to the
    pool ordered after those copies (a following call on them runs clean)."""
    dev = rf.device("sim", seed=11, chaos=True)
    x, out = _arrays(dev, pooled=True)

    def kill(engine):
        real = engine._enqueue
        calls = []

        def enqueue(*args, **kwargs):
            computes = real(*args, **kwargs)
            calls.append(1)
            if len(calls) == 2:
                raise AssertionError("injected: the enqueue pass failed with copies in flight")
            return computes

        engine._enqueue = enqueue

    with pytest.raises(AssertionError, match="injected") as info:
        _whole_array_call(lambda: rf.stream_map(_affine, x, out, device=dev, chunk_bytes=4096, engine="direct",
                                                checked=True), kill)
    drop_tracebacks([info.value])
    del info
    x = out = None  # (the call above reads these names)
    gc.collect()
    x, out = _arrays(dev, pooled=True)
    got = rf.stream_map(_affine, x, out, device=dev, chunk_bytes=4096, engine="direct", checked=True)
    assert np.array_equal(got, np.arange(4096.0) * 3 + 1)
    got = x = out = None
    _nothing_left(dev)


@pytest.mark.parametrize("engine", ["pipeline", "direct"])
def test_a_whole_array_call_on_a_device_closed_under_it_raises_the_devices_own_error(engine):
    """A step that raises is cleaned up after as a driver's death, but the call raises the
    step's own error: a device closed between two calls is the caller's doing, not a ringflow
    bug (the call said "this is a ringflow bug" when it wrapped every such error)."""
    dev = rf.device("sim", seed=3)
    x, out = _arrays(dev, pooled=engine == "direct")
    job = rf.MapJob(_affine, x, out, device=dev, chunk_bytes=4096, engine=engine,
                    host="auto" if engine == "direct" else "stage")
    job()
    dev.close()
    with pytest.raises(RuntimeError, match="this simulated device is closed") as info:
        job()
    assert "ringflow bug" not in str(info.value)
    assert job.closed


# -- an item still being copied into a shared chunk as the progress thread dies -------------------

def _die_at_the_next_step(pipe) -> threading.Event:
    """Make every scheduler step of ``pipe`` raise (a ringflow bug, injected) once the returned
    event is set."""
    die, real_step = threading.Event(), pipe.scheduler.step

    def step():
        if die.is_set():
            raise AssertionError("injected: a scheduler step failed while an item was copied into a shared chunk")
        return real_step()

    pipe.scheduler.step = step
    return die


def test_an_item_copied_into_a_shared_chunk_as_the_progress_thread_dies_ends_failed():
    """A thread is copying a small item into the chunk that small items share (between joining
    it and its copy's end) when the progress thread dies (a ringflow bug, injected): that chunk,
    and the chunk accepted behind it, cannot be admitted by the dying thread. Once the copy ends,
    both end FAILED: the submit returns a failed future, the counts balance with nothing in
    flight, and the shared chunk's pinned block goes back to the pool, so the next pipeline on
    the device runs clean. Both used to stay in the inbox for good, counted in flight."""
    dev = rf.device("sim", seed=13, chaos=True)
    pipe = rf.Pipeline(_affine, device=dev, chunk_bytes=4096, slots=2, checked=True, max_in_flight=8,
                       coalesce=True)
    die = _die_at_the_next_step(pipe)
    go, small = pause_first_shared_copy(pipe, np.arange(64.0))
    die.set()
    behind = pipe.submit(np.arange(512.0))  # too large for the room left: a new chunk, behind the first
    done, not_done = concurrent.futures.wait([behind], timeout=JOIN_S)  # (a waiter: the thread steps, and dies)
    assert not not_done
    go.set()
    (fut,) = join([small])
    errors = [f.exception(timeout=JOIN_S) for f in (fut, behind)]
    assert all(isinstance(e, RuntimeError) and "progress thread died" in str(e) for e in errors), errors
    with pytest.raises(RuntimeError, match="progress thread died"):
        bounded(pipe.close)
    stats = pipe.stats()
    assert stats.accepted == 2 and stats.failed == 2 and stats.in_flight == 0 and stats.balanced(), stats
    drop_tracebacks(errors)
    del errors, fut, behind, small, done
    pipe = None
    gc.collect()
    _next_pipeline_runs_clean(dev, [np.arange(64.0) + k for k in range(4)], True)
    assert dev.live().total == 0, dev.live()
    assert host_pool.pool_for(dev).stats().in_use_bytes == 0


# -- accepting without the driver's lock: the progress thread's wake-up, death and end ---------


def _five_seconds(x, y):
    y[...] = x * 2 + 1


_five_seconds.sim_seconds = 5.0  # each compute: 5 virtual seconds


def _twice_plus_one(a: np.ndarray) -> np.ndarray:
    return a * np.float32(2) + np.float32(1)


def _accept_inside_a_step_that_found_nothing(pipe, submit_b, when):
    """Wrap the scheduler's step so that, the first time a step of the progress thread finds
    nothing to do while ``when()`` holds, another thread's submit (``submit_b``, with room:
    accepted without the driver's lock) runs to its end before the step returns, i.e. after the
    step's admission looked at an empty inbox and before the progress thread clears its wake
    flag and sleeps. Returns a dict that gets the submit's future ("fb") and whether the driver
    later went to sleep on the device with a chunk in the inbox and no wake pending ("slept")."""
    s, d, dev = pipe.scheduler, pipe._driver, pipe.device
    real_step, real_wait_any = s.step, dev.wait_any
    out: dict = {"slept": []}
    fired = threading.Event()

    def step():
        progressed = real_step()
        if (not progressed and not fired.is_set() and threading.current_thread() is d.thread and when()):
            fired.set()
            t = threading.Thread(target=lambda: out.setdefault("fb", submit_b()))
            t.start()
            t.join(30)
            assert not t.is_alive(), "the submit needed the driver's lock"
            assert len(s.inbox) == 1 and d.wake.is_set()  # accepted, and the driver was woken
        return progressed

    def wait_any(waitables, timeout=None, wake=None):
        if threading.current_thread() is d.thread and s.inbox and wake is not None and not wake.is_set():
            out["slept"].append((len(s.inbox), dev.now))
        return real_wait_any(waitables, timeout=timeout, wake=wake)

    s.step = step
    dev.wait_any = wait_any
    return out


def _only_the_copy_out_of(s, index) -> bool:
    """Chunk ``index`` is on the device and the only fence left to wait on is its copy out (which
    comes after its 5-second compute)."""
    c = s.chunks.get(index)
    fences = s.pending_fences()
    return (c is not None and c.state is ChunkState.ON_DEVICE and c.d2h_event is not None and bool(fences)
            and all(f is c.d2h_event for f in fences))


def test_a_chunk_accepted_without_the_lock_during_a_step_that_found_the_inbox_empty_wakes_the_driver():
    """Chunk A computes for 5 virtual seconds. While a step of the progress thread finds nothing to
    do (A's compute pending), thread T submits B with room: B enters the inbox and the wake flag
    is set, without the driver's lock, after that step's admission looked at the inbox. The
    driver clears the wake flag before it sleeps (step_once), so it must look once more for
    chunks accepted since, or it sleeps on A's compute with B in the inbox and B's copy in
    starts only once A's compute ends (5 s later), though a slot was free all along."""
    dev = rf.device("sim", seed=1)
    tl = Timeline(dev)
    a, b = np.full(1000, 1, np.float32), np.full(1000, 2, np.float32)
    with rf.Pipeline(_five_seconds, device=dev, chunk_bytes=1 << 16, coalesce=False, max_in_flight=4) as pipe:
        s = pipe.scheduler
        out = _accept_inside_a_step_that_found_nothing(
            pipe, lambda: pipe.submit(b),
            when=lambda: _only_the_copy_out_of(s, 0))
        fa = pipe.submit(a)
        ra = fa.result(timeout=60)
        rb = out["fb"].result(timeout=60)
    assert np.array_equal(ra, _twice_plus_one(a)) and np.array_equal(rb, _twice_plus_one(b))
    h2d = [op for op in tl.ops if op.label.startswith("copy h2d")]
    computes = [op for op in tl.ops if op.label.startswith("launch")]
    assert len(h2d) == 2 and len(computes) == 2
    assert h2d[1].started_at < computes[0].done_at, (
        f"B's copy in started at {h2d[1].started_at:.6f} s, after A's compute ended "
        f"({computes[0].done_at:.6f} s): the wake-up for B was lost")
    assert not out["slept"], f"the progress thread slept on the device with B in the inbox: {out['slept']}"


def test_a_lone_chunk_behind_a_shared_chunk_being_copied_into_as_the_driver_dies_is_counted_failed():
    """As test_an_item_copied_into_a_shared_chunk_as_the_progress_thread_dies_ends_failed, but
    the chunk behind the shared one goes alone (an item over 4 MiB). The dying thread cannot
    admit it (it is behind a chunk still being copied into), so die() fails its future directly
    (fail_orphans); when the copy ends, admit_after_death admits it with its future already
    done: it ends FAILED and is counted failed, not cancelled (its caller did not cancel it)."""
    dev = rf.device("sim", seed=13)
    pipe = rf.Pipeline(_affine, device=dev, chunk_bytes=8 << 20, checked=True, max_in_flight=8, coalesce=True)
    die = _die_at_the_next_step(pipe)
    go, small = pause_first_shared_copy(pipe, np.arange(64.0))
    die.set()
    behind = pipe.submit(np.arange((5 << 20) // 8, dtype=np.float64))  # over 4 MiB: a chunk of its own
    assert behind.exception(timeout=JOIN_S) is not None  # (a waiter: the thread steps, and dies)
    go.set()
    (fut,) = join([small])
    errors = [f.exception(timeout=JOIN_S) for f in (fut, behind)]
    assert all(isinstance(e, RuntimeError) and "progress thread died" in str(e) for e in errors), errors
    try:
        bounded(pipe.close)
    except RuntimeError:
        pass
    stats = pipe.stats()
    assert stats.accepted == 2 and stats.in_flight == 0 and stats.balanced(), stats
    assert (stats.failed, stats.cancelled) == (2, 0), f"a chunk whose future failed is counted cancelled: {stats}"


def test_an_end_handed_over_between_two_looks_of_the_progress_thread_still_stops_admission():
    """hand_over() (no lock: an ending that Ctrl-C stopped, Pipeline._end_interrupted) sets
    ``cancel_handed_over`` then ``stopping``. A turn of the progress thread that lands between
    the two and reads them in the same order sees ``stopping`` but not the cancel: it closes the
    scheduler and ends with ``accepting`` still True, and a submit on another thread that passed
    its ``_closed`` check before the hand-over accepts, without the driver's lock, into the inbox
    of a scheduler nobody drives: its future never resolves. The turn reads ``stopping`` first.
    Forced with a line trace on the progress thread, and an event to pause the submit after its
    checks."""
    import concurrent.futures
    import sys

    from ringflow._pipeline import driver as driver_mod

    dev = rf.device("sim", seed=3)
    pipe = rf.Pipeline(_affine, device=dev, chunk_bytes=1 << 16, coalesce=False)
    d, s = pipe._driver, pipe.scheduler
    assert np.array_equal(pipe.submit(np.ones(8)).result(timeout=60), np.full(8, 4.0))
    line = next(i for i, text in enumerate(open(driver_mod.__file__).read().splitlines(), 1)
                if "and sched.finished() and not sched.resolved:" in text)
    at_line, go, handed, checked, resume = (threading.Event() for _ in range(5))

    def tracer(frame, event, arg):
        if event == "line" and frame.f_code.co_name == "_plan_turn" and frame.f_lineno == line \
                and not at_line.is_set():
            at_line.set()
            assert go.wait(30)
            frame.f_trace = None
            sys.settrace(None)
        return tracer

    def install():  # a posted command: runs on the progress thread, inside _plan_turn
        f = sys._getframe()
        while f is not None and f.f_code.co_name != "_plan_turn":
            f = f.f_back
        f.f_trace = tracer
        sys.settrace(tracer)

    real_check = pipe._check_item

    def check_item(item):  # the submit has passed _check_caller (the pipeline was open)
        out = real_check(item)
        checked.set()
        assert resume.wait(30)
        return out

    pipe._check_item = check_item
    late: dict = {}
    def late_submit():
        try:
            late["fut"] = pipe.submit(np.full(8, 2.0))
        except RuntimeError as err:  # refused: what should happen once the end was handed over
            late["refused"] = err

    t = threading.Thread(target=late_submit)
    t.start()
    assert checked.wait(30)
    d.post(install, lambda cmd: None)
    assert at_line.wait(30)  # the turn has looked at cancel_handed_over (False), not yet at stopping
    real_hand_over = d.hand_over

    def hand_over():
        real_hand_over()
        handed.set()

    d.hand_over = hand_over
    ender = threading.Thread(target=pipe._end_interrupted)  # as a close() that Ctrl-C stopped
    ender.start()
    assert handed.wait(30)
    go.set()
    ender.join(30)
    assert not d.thread.is_alive()
    resume.set()
    t.join(30)
    assert late, "the late submit neither returned nor was refused"
    if "refused" in late:
        return  # admission had stopped: correct
    done, _ = concurrent.futures.wait([late["fut"]], timeout=3)  # real seconds: nothing drives the pipeline
    assert done, (f"a future accepted after the end was handed over never resolves: accepting={s.accepting}, "
                  f"inbox={len(s.inbox)}, progress thread alive={d.thread.is_alive()}")


def _fails_on_2(x, y):
    if x[0] == 2:
        raise ValueError("bad item")
    y[...] = x * 2 + 1


def test_a_map_resumed_after_close_raises_its_item_s_failure_instead_of_waiting_for_an_ended_thread():
    """A map whose item failed (on_error="raise"), iterated on after close(): it settles the
    pipeline before it raises, by a command to the progress thread, which has ended. The command
    waited for ever; now the map raises the item's StageError."""
    dev = rf.device("sim", seed=5)
    pipe = rf.Pipeline(_fails_on_2, device=dev, chunk_bytes=1 << 16, on_error="raise", coalesce=False,
                       max_in_flight=3)
    items = [np.full(16, i, np.float32) for i in range(6)]
    gen = pipe.map(items)
    assert np.array_equal(next(gen), items[0] * 2 + 1)
    pipe.close()
    out: dict = {}

    def rest():
        try:
            out["values"] = list(gen)
        except BaseException as exc:  # noqa: BLE001 - looked at below
            out["error"] = exc

    t = threading.Thread(target=rest, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "iterating a map after close waited for a progress thread that had ended"
    assert isinstance(out.get("error"), rf.StageError) and out["error"].index == 2, out


def test_a_command_handed_to_an_ended_progress_thread_is_refused_not_waited_for():
    """Once the progress thread has run its last turn nothing runs a command handed to it: the
    wait for it ends with ThreadEnded instead of lasting for ever."""
    from ringflow._pipeline.driver import ThreadEnded

    pipe = rf.Pipeline(_affine, device=rf.device("sim", seed=2), chunk_bytes=1 << 16)
    assert np.array_equal(pipe.submit(np.ones(8)).result(timeout=60), np.full(8, 4.0))
    pipe.close()
    d = pipe._driver
    assert d.ended

    def command():
        with d.hold() as hold:
            try:
                d.command(lambda: 1, hold=hold)
            except ThreadEnded as err:
                return err
        return None

    assert isinstance(bounded(command), ThreadEnded)


def test_a_waiter_that_arrives_as_an_idle_turn_on_the_simulated_gpu_ends_is_not_missed():
    """On the simulated GPU the progress thread steps only while someone waits. A waiter that
    registers (a done-callback: interest and the wake flag, no lock) after a turn found nobody
    waiting, but before the thread cleared its wake flag, must not be left to the next idle
    poll: the thread looks once more after the clear, as for accepts and releases."""
    from ringflow._pipeline.driver import WakeFlag

    dev = rf.device("sim", seed=8)
    pipe = rf.Pipeline(_affine, device=dev, chunk_bytes=1 << 16, coalesce=False)
    d = pipe._driver
    fut = pipe.submit(np.ones(8))  # nobody waits on it yet: the thread idles
    armed, slept = threading.Event(), []
    real_waits = d.someone_waits
    called_back = threading.Event()

    def someone_waits():
        waits = real_waits()
        if not waits and armed.is_set() and threading.current_thread() is d.thread:
            armed.clear()
            join([start(fut.add_done_callback, lambda f: called_back.set())])  # registered, wake flag set
        return waits

    class Flag(WakeFlag):
        def wait(self, timeout=None):
            if threading.current_thread() is d.thread and real_waits() and not self.is_set():
                slept.append(timeout)
            return super().wait(timeout)

    old, d.wake = d.wake, Flag()
    pipe.scheduler.wake_driver = d.wake.set
    d.someone_waits = someone_waits
    armed.set()
    old.set()  # a turn now: it finds nobody waiting, and the callback registers inside it
    assert called_back.wait(JOIN_S) and np.array_equal(fut.result(timeout=JOIN_S), np.full(8, 4.0))
    pipe.close()
    assert not slept, f"the progress thread idled with a waiter registered and its wake-up cleared: {slept}"
