"""KeyboardInterrupt and SystemExit, one case per test (all on the chaotic simulated GPU).

Two kinds of interrupt reach a pipeline:

* raised by the user's own prepare, compute or consume (Ctrl-C landing in a callable, or a
  ``sys.exit()`` there): that chunk fails and its future raises the very exception object, not
  a StageError; with ``on_error="raise"`` the rest are cancelled, with ``"continue"`` they
  deliver; no future ever holds another chunk's data;
* raised in the user's thread while it waits (in ``result()``, inside ``map()``) or by the
  iterable feeding ``map()``: the pipeline is left consistent, and ``close()`` finishes it and
  releases everything.

Every close is bounded in real seconds (tests/helpers/threads), so a hang fails the test.
"""

from __future__ import annotations

import _thread
import concurrent.futures
import contextlib
import gc
import signal
import threading
import traceback
import warnings

import numpy as np
import pytest

import ringflow as rf
from ringflow._device.sim import charge
from ringflow._errors import StageError
from tests.helpers.pipeline_checks import Harness, check_chunk_error, check_result, future_outcome
from tests.helpers.gpu_like import launch_raises_as_on_a_gpu
from tests.helpers.sim import hold_copy
from tests.helpers.interrupts import STALL_S, CtrlCWhileStalled, once_inside
from tests.helpers.threads import JOIN_S, bounded, interrupt_main, join, stack_names, start

STAGES = ("prepare", "compute", "consume")


def _settle(futs) -> None:
    done, pending = concurrent.futures.wait(futs, timeout=JOIN_S)
    assert not pending, f"{len(pending)} futures never ended"


def _check_and_close(h: Harness) -> None:
    """``h``'s invariants checked, then its pipeline closed (bounded in real seconds) and found
    closed clean."""
    h.check()
    bounded(h.pipe.close)
    h.close()


def _need_sigint():
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("delivers SIGINT to the main thread: the test must run there")
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is not Python's default KeyboardInterrupt handler here")


# -- an interrupt raised by the user's prepare, compute or consume -----------------------------------------
@pytest.mark.parametrize("stage", STAGES)
def test_interrupt_in_a_stage_fails_its_chunk_and_cancels_the_rest(stage):
    h = Harness(seed=1, chaos=True, checked=True, slots=2, max_in_flight=12, chunk_bytes=512, on_error="raise")
    items = [h.item(i + 1, 8 + i, fault=f"interrupt-{stage}" if i == 3 else None) for i in range(12)]
    futs = [h.pipe.submit(it) for it in items]
    _settle(futs)
    kinds = []
    for fut, it in zip(futs, items):
        kind, value = future_outcome(fut)
        kinds.append(kind)
        if it.fault is not None:
            assert kind == "error"
            check_chunk_error(value, it, fut.index)  # the KeyboardInterrupt its own callable raised
            with pytest.raises(KeyboardInterrupt, match=f"tag {it.tag}$"):
                fut.result()
        elif kind == "value":
            check_result(value, it, fut.index)
        else:
            assert kind == "cancelled", (fut.index, kind, value)
    assert kinds.count("error") == 1 and "cancelled" in kinds
    with pytest.raises(RuntimeError, match="no longer accepts work"):
        h.pipe.submit(h.item(99, 4))
    [err] = h.pipe.failures
    assert err.stage == stage and err.index == 3 and isinstance(err.__cause__, KeyboardInterrupt)
    _check_and_close(h)


@pytest.mark.parametrize("stage", STAGES)
def test_interrupt_in_a_stage_with_continue_lets_the_others_deliver(stage):
    h = Harness(seed=2, chaos=True, checked=True, slots=2, max_in_flight=12, chunk_bytes=512, on_error="continue")
    items = [h.item(i + 1, 8 + i, fault=f"interrupt-{stage}" if i in (2, 7) else None) for i in range(12)]
    futs = [h.pipe.submit(it) for it in items]
    _settle(futs)
    for fut, it in zip(futs, items):
        kind, value = future_outcome(fut)
        if it.fault is not None:
            assert kind == "error"
            check_chunk_error(value, it, fut.index)
        else:
            assert kind == "value", (fut.index, kind, value)
            check_result(value, it, fut.index)
    assert sorted(e.index for e in h.pipe.failures) == [2, 7]
    h.pipe.submit(h.item(99, 4)).result()  # the pipeline still takes work
    _check_and_close(h)


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("stage", STAGES)
def test_the_future_raises_the_original_exception_object(exc_type, stage):
    dev = rf.device("sim", seed=3, chaos=True)
    boom = exc_type(f"stop in {stage}")
    bad = 5.0  # the item whose first element is 5 fails

    def prepare(item):
        if stage == "prepare" and item[0] == bad:
            raise boom
        return item

    def compute(x, y):
        if stage == "compute" and x[0] == bad:
            raise boom
        y[...] = x * 3 + 1

    def consume(index, item, view):
        if stage == "consume" and item[0] == bad:
            raise boom
        return np.array(view)

    pipe = rf.Pipeline(compute, device=dev, prepare=prepare, consume=consume, chunk_bytes=512, slots=2,
                       max_in_flight=8, on_error="continue", checked=True)
    items = [np.arange(16.0) + k for k in range(8)]
    futs = [pipe.submit(it) for it in items]
    _settle(futs)
    with pytest.raises(exc_type) as caught:
        futs[5].result()
    assert caught.value is boom and futs[5].exception() is boom
    for k, fut in enumerate(futs):
        if k != 5:
            assert np.array_equal(fut.result(), items[k] * 3 + 1)
    [err] = pipe.failures
    assert isinstance(err, StageError) and err.stage == stage and err.__cause__ is boom
    bounded(pipe.close)
    del caught, err
    boom.__traceback__ = None
    gc.collect()
    assert dev.live().total == 0


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("share", [False, True], ids=["one item a chunk", "items sharing chunks"])
def test_an_interrupt_a_compute_raises_as_it_is_launched_fails_its_item_alone(monkeypatch, exc_type, share):
    """On a GPU a compute runs as it is launched (it enqueues its kernels then), on the progress
    thread: an interrupt it raises comes out of the launch itself rather than, as on the
    simulated GPU, out of the kernel's completion. It must fail its item, the future raising
    the very object, as there; not end the pipeline. Emulated here: the fourth launch raises."""
    boom = exc_type("stop in the compute's launch")
    launch_raises_as_on_a_gpu(monkeypatch, boom, at=4)
    dev = rf.device("sim", seed=4, chaos=True, checked=True)

    def compute(x, y):
        y[...] = x * 3 + 1

    pipe = rf.Pipeline(compute, device=dev, chunk_bytes=512 if not share else 4096, slots=2, max_in_flight=8,
                       on_error="continue", checked=True)
    items = [np.arange(16.0) + k for k in range(12)]
    futs = [pipe.submit(it) for it in items]
    _settle(futs)
    failed = [k for k, fut in enumerate(futs) if fut.exception() is not None]
    assert failed and all(futs[k].exception() is boom for k in failed), [futs[k].exception() for k in failed]
    for k, fut in enumerate(futs):
        if k not in failed:
            assert np.array_equal(fut.result(), items[k] * 3 + 1)
    assert all(isinstance(err, StageError) and err.stage == "compute" and err.__cause__ is boom
               for err in pipe.failures)
    assert np.array_equal(pipe.submit(items[0]).result(), items[0] * 3 + 1)  # the pipeline goes on
    bounded(pipe.close)
    assert pipe.stats().balanced()
    boom.__traceback__ = None
    del futs
    gc.collect()
    assert dev.live().total == 0


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("host", ["register", "stage"], ids=["direct engine", "scheduler"])
def test_an_interrupt_a_compute_raises_as_it_is_launched_is_raised_itself_by_stream_map(monkeypatch, exc_type, host):
    """The whole-array face of the case above: the call raises the very interrupt (never a
    StageError, which ``except Exception`` would swallow), leaves nothing live, and the device
    serves the next call."""
    boom = exc_type("stop in the compute's launch")

    def compute(x, y):
        y[...] = x * 3 + 1

    dev = rf.device("sim", seed=4, chaos=True, checked=True)
    x = np.arange(4096, dtype=np.float32)
    with monkeypatch.context() as patched:
        launch_raises_as_on_a_gpu(patched, boom, at=3)
        with pytest.raises(exc_type) as caught:
            rf.stream_map(compute, x, device=dev, chunk_bytes=2048, host=host)
    assert caught.value is boom
    np.testing.assert_array_equal(rf.stream_map(compute, x, device=dev, chunk_bytes=2048, host=host), x * 3 + 1)
    del caught
    boom.__traceback__ = None
    rf.drop_warm_pipelines(dev)
    gc.collect()
    assert dev.live().total == 0 and not any(dev.collected_unclosed().values()), dev.collected_unclosed()


@pytest.mark.gpu
@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_a_compute_raises_on_a_gpu_fails_its_item_alone(cuda_device, exc_type):
    """The two cases above on a GPU, where the compute runs as it is launched: a Pipeline fails
    the item (the future raising the very object) and goes on; stream_map raises it itself on
    either engine; nothing is live afterwards."""
    boom = exc_type("stop in the compute")
    calls = []

    def compute(x, y):
        calls.append(None)
        if len(calls) == 4:
            raise boom
        y[...] = x * 3 + 1

    pipe = rf.Pipeline(compute, device=cuda_device, chunk_bytes=4096, on_error="continue")
    items = [np.arange(16.0) + k for k in range(12)]
    futs = [pipe.submit(it) for it in items]
    _settle(futs)
    failed = [k for k, fut in enumerate(futs) if fut.exception() is not None]
    assert len(failed) >= 1 and all(futs[k].exception() is boom for k in failed)
    for k, fut in enumerate(futs):
        if k not in failed:
            assert np.array_equal(fut.result(), items[k] * 3 + 1)
    assert np.array_equal(pipe.submit(items[0]).result(), items[0] * 3 + 1)
    bounded(pipe.close)
    x = np.arange(1 << 16, dtype=np.float32)
    for host in ("register", "stage"):
        calls.clear()
        with pytest.raises(exc_type) as caught:
            rf.stream_map(compute, x, device=cuda_device, chunk_bytes=16384, host=host)
        assert caught.value is boom
        calls.clear()
        calls.extend([None] * 8)  # past the fourth: the next call is whole
        np.testing.assert_array_equal(rf.stream_map(compute, x, device=cuda_device, chunk_bytes=16384, host=host),
                                      x * 3 + 1)
    del futs, caught
    boom.__traceback__ = None
    rf.drop_warm_pipelines(cuda_device)
    gc.collect()
    assert cuda_device.live().total == 0, cuda_device.live()


@pytest.mark.parametrize("stage", STAGES)
def test_map_raises_the_interrupt_itself(stage):
    h = Harness(seed=4, chaos=True, checked=True, slots=2, max_in_flight=4, chunk_bytes=512, on_error="raise")
    items = [h.item(i + 1, 8, fault=f"interrupt-{stage}" if i == 5 else None) for i in range(10)]
    got = []
    with pytest.raises(KeyboardInterrupt, match=f"interrupt in {stage} for tag 6$"):
        for r in h.pipe.map(items):
            got.append(r)
    # an ordered prefix: chunks before the interrupted one may have been cancelled by its failure
    assert [r.tag for r in got] == [1, 2, 3, 4, 5][:len(got)]
    for r in got:
        check_result(r, h.items[r.tag])
    _check_and_close(h)


@pytest.mark.parametrize("stage", STAGES)
def test_map_with_continue_skips_the_interrupted_item(stage):
    h = Harness(seed=5, chaos=True, checked=True, slots=2, max_in_flight=4, chunk_bytes=512, on_error="continue")
    items = [h.item(i + 1, 8, fault=f"interrupt-{stage}" if i == 5 else None) for i in range(10)]
    got = list(h.pipe.map(items))
    assert [r.tag for r in got] == [1, 2, 3, 4, 5, 7, 8, 9, 10]
    for r in got:
        check_result(r, h.items[r.tag])
    _check_and_close(h)


# -- Ctrl-C in the user's thread ----------------------------------------------------------------------------
def test_ctrl_c_while_waiting_in_result_leaves_a_pipeline_close_finishes():
    _need_sigint()
    h = Harness(seed=6, chaos=True, checked=True, slots=1, max_in_flight=12, chunk_bytes=512)
    items = [h.item(i + 1, 16) for i in range(12)]
    futs = [h.pipe.submit(it) for it in items]
    waiting, caught = threading.Event(), threading.Event()

    def on_first_done(_fut):
        # runs on the progress thread: it holds the pipeline still until Ctrl-C has landed
        if waiting.wait(JOIN_S):
            interrupt_main()
            caught.wait(JOIN_S)

    futs[0].add_done_callback(on_first_done)
    landed_while_pending = None
    try:
        waiting.set()
        futs[-1].result()
    except KeyboardInterrupt:
        landed_while_pending = not futs[-1].done()
        caught.set()
    assert landed_while_pending, "Ctrl-C did not interrupt the wait"
    h.check()
    bounded(h.pipe.close)
    for fut, it in zip(futs, items):  # close finished what was accepted
        check_result(fut.result(timeout=0), it, fut.index)
    h.close()


def test_ctrl_c_inside_map_leaves_a_pipeline_close_finishes():
    _need_sigint()
    dev = rf.device("sim", seed=7, chaos=True)
    caught = threading.Event()
    consumed = []

    def consume(index, item, view):
        consumed.append(index)
        if len(consumed) == 3:
            # Ctrl-C lands before this consumer returns: the map waits for this chunk, and its
            # wait ends with the KeyboardInterrupt (a consumer must not block on the main
            # thread: it may run while the pipeline's lock is held)
            interrupt_main()
        return np.array(view)

    pipe = rf.Pipeline(lambda x, y: np.copyto(y, x * 3 + 1), device=dev, consume=consume, chunk_bytes=512, slots=1,
                       max_in_flight=4, checked=True)
    items = [np.arange(16.0) + k for k in range(30)]
    got = []
    with contextlib.closing(pipe.map(items)) as gen:
        try:
            for r in gen:
                got.append(r)
        except KeyboardInterrupt as exc:
            caught.set()
            inside = any(frame.f_code.co_name == "_map" for frame, _ in traceback.walk_tb(exc.__traceback__))
    assert caught.is_set() and len(got) == 2, len(got)
    assert inside, "Ctrl-C landed outside the map's wait"
    for k, r in enumerate(got):
        assert np.array_equal(r, items[k] * 3 + 1)
    bounded(pipe.close)
    s = pipe.stats()
    # the interrupted map cancelled what it had taken and not handed out (as Executor.map does)
    assert s.in_flight == 0 and s.balanced() and s.failed == 0 and s.delivered + s.cancelled == s.accepted
    gc.collect()
    assert dev.live().total == 0


def test_iterable_feeding_map_raises_keyboard_interrupt():
    h = Harness(seed=8, chaos=True, checked=True, slots=2, max_in_flight=8, chunk_bytes=512)
    boom = KeyboardInterrupt("from the feeding iterable")

    def feed():
        for i in range(10):
            if i == 6:
                raise boom
            yield h.item(i + 1, 8)

    with pytest.raises(KeyboardInterrupt) as caught:
        list(h.pipe.map(feed()))
    assert caught.value is boom
    del caught
    boom.__traceback__ = None
    h.check()
    bounded(h.pipe.close)
    s = h.pipe.stats()
    # the map ends with the iterable's error, so no one can take what it accepted: it cancelled
    # that (what had ended already stays delivered)
    assert s.accepted == 6 and s.delivered + s.cancelled == 6 and s.failed == 0
    h.close()


def test_with_block_left_by_ctrl_c_cancels_and_releases():
    dev = rf.device("sim", seed=9, chaos=True)
    futs = []
    with pytest.raises(KeyboardInterrupt):
        with rf.Pipeline(lambda x, y: np.copyto(y, x + 1), device=dev, chunk_bytes=512, slots=1,
                         max_in_flight=6, checked=True) as pipe:
            futs = [pipe.submit(np.arange(8.0) + k) for k in range(6)]
            raise KeyboardInterrupt
    assert all(f.done() for f in futs)
    assert any(f.cancelled() for f in futs)
    s = pipe.stats()
    assert s.in_flight == 0 and s.balanced()
    with pytest.raises(RuntimeError, match="closed"):
        pipe.submit(np.arange(8.0))
    del futs
    gc.collect()
    assert dev.live().total == 0


# -- Ctrl-C while an ending waits for a prepare that does not return -------------------------------------------


def _deliver_ctrl_c(how: str) -> None:
    if how == "signal":
        interrupt_main()  # a real SIGINT: wakes a main thread blocked in a lock or condition wait
    else:
        _thread.interrupt_main()  # the signal's handler is only flagged: a blocked main thread is not woken


class _LeftByError(Exception):
    pass


def _end(pipe, ending: str) -> None:
    if ending == "close":
        pipe.close()
    elif ending == "with":
        with pipe:
            pass
    else:
        with pipe:
            raise _LeftByError


# (ending, when the prepare began to stall, where it stalls, how Ctrl-C comes). On the simulated GPU
# a prepare runs on the progress thread: "in a step" it began inside a scheduler step (the progress
# thread holds the pipeline's lock), "in a device wait" inside the device wait between two steps
# (it holds only the device's lock). Leaving a with block by an error cancels before it waits, so
# there the prepare must already be stalled as the block is left.
STALLED_ENDINGS = [(ending, begun, where, "signal") for ending, begun in
                   [("close", "by the ending"), ("close", "before the ending"), ("with", "by the ending"),
                    ("with-error", "before the ending")]
                   for where in ("in a step", "in a device wait")]
STALLED_ENDINGS += [("close", "by the ending", where, "interrupt_main") for where in ("in a step", "in a device wait")]


@pytest.mark.parametrize("ending, begun, where, how", STALLED_ENDINGS)
def test_ctrl_c_gets_out_of_an_ending_waiting_for_a_prepare_that_does_not_return(ending, begun, where, how):
    """Ctrl-C while close() (or the end of a with block) waits for a prepare blocked in user code:
    the KeyboardInterrupt comes out while the prepare still blocks, and once the prepare returns
    a second close() completes, every chunk ends, and nothing is left live. On the simulated GPU
    the prepare runs on the progress thread, holding the pipeline's lock or the device's, and the
    ending used to wait for that lock and that thread with Ctrl-C held back until it got them."""
    _need_sigint()
    dev = rf.device("sim", seed=12, chaos=True)
    started, release, entered = (threading.Event() for _ in range(3))
    blocked = 0 if where == "in a step" else 1  # the item whose prepare stalls

    def prepare(item):
        if int(item[0]) == blocked:
            started.set()
            release.wait(JOIN_S)  # user code that does not return until the test lets it
        else:
            # a second of virtual CPU time: with one worker, the next prepare starts as this one
            # ends, which only a device wait reaches
            charge(1.0)
        return item

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        pipe = rf.Pipeline(lambda x, y: np.copyto(y, x + 1), device=dev, prepare=prepare, chunk_bytes=512, slots=2,
                           workers=1, max_in_flight=4, checked=True)
        forget = pipe._forget_if_forked  # the first thing either ending does, inside its call

        def entering():
            entered.set()
            return forget()

        pipe._forget_if_forked = entering
        futs = [pipe.submit(np.full(8, float(k))) for k in range(3)]
        waiter = None
        if begun == "before the ending":  # someone waits, so the progress thread runs the prepares
            waiter = start(concurrent.futures.wait, futs, JOIN_S)
            assert started.wait(JOIN_S)
        names: set = set()

        def once_stalled():
            if entered.wait(JOIN_S) and started.wait(JOIN_S):
                names.update(stack_names(pipe._driver.thread))
                return True
            return False

        CtrlCWhileStalled(release, ready=once_stalled, deliver=lambda: _deliver_ctrl_c(how)).run(
            lambda: _end(pipe, ending), "the ending")
        # the stall is where the case says
        assert ("step" in names) == (where == "in a step") and "_run_prepare" in names, sorted(names)
        bounded(pipe.close)  # a second close completes
        if waiter is not None:
            join([waiter])
        assert all(f.done() for f in futs)
        s = pipe.stats()
        assert s.in_flight == 0 and s.balanced() and s.accepted == len(futs), s
        for f, k in zip(futs, range(3)):  # what was delivered is right
            if not f.cancelled() and f.exception() is None:
                np.testing.assert_array_equal(f.result(), np.full(8, k + 1.0))
        with pytest.raises(RuntimeError, match="closed"):
            pipe.submit(np.zeros(8))
        del futs, waiter
        gc.collect()
        assert dev.live().total == 0, dev.live()
    assert not [str(w.message) for w in seen if issubclass(w.category, (RuntimeWarning, ResourceWarning))]


def _stalling_prepare(started: "dict[float, threading.Event]", release: threading.Event):
    """A prepare that blocks in user code, until ``release`` is set, for each item whose first
    element is a key of ``started`` (setting that key's event as it begins to); the others take a
    second of virtual CPU time (with one worker, the next prepare starts as one ends, which only a
    device wait reaches)."""

    def prepare(item):
        if float(item[0]) in started:
            started[float(item[0])].set()
            release.wait(JOIN_S)
        else:
            charge(1.0)
        return item

    return prepare


@pytest.mark.parametrize("stalled_parts", [1, 2])
@pytest.mark.parametrize("ending", ["close", "with-error"])
def test_a_second_close_of_a_spread_pipeline_waits_for_the_part_whose_end_ctrl_c_handed_over(ending, stalled_parts):
    """Over two devices, Ctrl-C while the ending waits for a prepare that does not return: the
    stalled part's end is handed to its progress thread and the ending raises KeyboardInterrupt,
    without waiting for the other part either (its end is handed over too, its work cancelled:
    one Ctrl-C gets out however many parts have a stalled prepare). A second close() then waits
    for the parts' progress threads to end, as a second close() of a single-device pipeline does."""
    _need_sigint()
    devs = [rf.device("sim", seed=40 + k, chaos=True) for k in range(2)]
    release, entered, joining = (threading.Event() for _ in range(3))
    # items 0 and 1 go to the two parts (the first to the first part, then the least loaded)
    started = {float(k): threading.Event() for k in range(stalled_parts)}
    pipe = rf.Pipeline(lambda x, y: np.copyto(y, x + 1), device=devs, prepare=_stalling_prepare(started, release),
                       chunk_bytes=512, slots=2, workers=1, max_in_flight=4, checked=True)
    futs = [pipe.submit(np.full(8, float(k))) for k in range(4)]
    assert futs[0]._driver is pipe.parts[0]._driver and futs[1]._driver is pipe.parts[1]._driver
    driver = pipe.parts[0]._driver
    hold, join_handed_over = driver.hold, driver.join_handed_over

    def holding():  # the stalled part's ending takes its lock (inside its shielded call)
        entered.set()
        return hold()

    def joined():
        joining.set()
        return join_handed_over()

    driver.hold, driver.join_handed_over = holding, joined
    waiter = start(concurrent.futures.wait, futs, JOIN_S)  # someone waits: the progress threads run
    assert all(event.wait(JOIN_S) for event in started.values())
    # the prepare returns only once a second close waits for its part's thread
    stall = CtrlCWhileStalled(release, ready=lambda: entered.wait(JOIN_S), hold=lambda: joining.wait(JOIN_S))
    stall.call(lambda: _end(pipe, ending))
    try:
        stall.check("the ending")
        # a second close waits for the part whose end was handed over, however long its prepare runs
        alive = bounded(lambda: (pipe.close(), [p._driver.thread.is_alive() for p in pipe.parts])[1])
        assert joining.is_set() and alive == [False, False], alive
    finally:
        joining.set()
        stall.finish()
        join([waiter])
    assert all(p._sched.closed for p in pipe.parts)
    assert all(f.done() for f in futs)
    s = pipe.stats()
    assert s.in_flight == 0 and s.balanced() and s.accepted == len(futs), s
    with pytest.raises(RuntimeError, match="closed"):
        pipe.submit(np.zeros(8))
    del futs, waiter
    gc.collect()
    assert all(d.live().total == 0 for d in devs), [d.live() for d in devs]


# (call, when the prepare began to stall: before the call, with another thread waiting, or by the
# call, whose own wait runs the progress thread)
STALLED_CALLS = [("submit", "before the call"), ("submit", "by the call"), ("result", "before the call"),
                 ("result", "by the call"), ("map", "before the call"), ("map", "by the call"),
                 ("stats", "before the call"), ("failures", "before the call")]


@pytest.mark.parametrize("where", ["in a step", "in a device wait"])
@pytest.mark.parametrize("call, begun", STALLED_CALLS)
def test_ctrl_c_gets_out_of_a_call_waiting_on_a_pipeline_a_stalled_prepare_keeps(call, begun, where):
    """Ctrl-C on the main thread while submit (with room, or waiting for it), a future's result(),
    map or stats waits on a pipeline whose progress thread runs a prepare that does not return:
    the KeyboardInterrupt comes out while the prepare still blocks, and the pipeline is left as
    a close() ends once the prepare returns. On the simulated GPU the prepare runs on the progress
    thread, inside a step holding the pipeline's lock (or inside a device wait, holding the
    device's); these calls took that lock in a wait no Ctrl-C ends. A call that needs neither the
    lock nor the stalled item (submit with room, which takes the lock only to wait for room;
    stats and failures while the stall is in a device wait) returns without waiting."""
    _need_sigint()
    dev = rf.device("sim", seed=13, chaos=True)
    blocked = 0.0 if where == "in a step" else 1.0  # the item whose prepare stalls
    started, release = {blocked: threading.Event()}, threading.Event()
    entered = threading.Event()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        # with room for one more chunk, but none when submit waits for room
        room = 3 if call == "submit" and begun == "by the call" else 4
        pipe = rf.Pipeline(lambda x, y: np.copyto(y, x + 1), device=dev, prepare=_stalling_prepare(started, release),
                           chunk_bytes=512, slots=2, workers=1, max_in_flight=room, checked=True)
        sent = [] if call == "map" and begun == "by the call" else [np.full(8, float(k)) for k in range(3)]
        futs = [pipe.submit(item) for item in sent]
        waiter = None
        if begun == "before the call":
            waiter = start(concurrent.futures.wait, futs, JOIN_S)
            assert started[blocked].wait(JOIN_S)
        # a call that needs neither the lock nor the stalled item (submit with room; stats and
        # failures while the stall is in a device wait) returns without waiting for it: no Ctrl-C
        # is sent then
        waits = not (begun == "before the call" and (call == "submit" or (
            call in ("stats", "failures") and where == "in a device wait")))
        got = []

        def the_call(futs=futs):  # (the same list: the test deletes its name before it ends)
            entered.set()
            if call == "submit":
                sent.append(np.full(8, 10.0))
                futs.append(pipe.submit(sent[-1]))
            elif call == "result":
                got.append(futs[0].result())
            elif call == "map":
                got.extend(pipe.map([np.full(8, 10.0 + k) for k in range(6)] if futs else
                                    [np.full(8, float(k)) for k in range(6)]))
            elif call == "failures":
                got.append(pipe.failures)
            else:
                got.append(pipe.stats())

        CtrlCWhileStalled(release, ready=lambda: waits and entered.wait(JOIN_S) and started[blocked].wait(JOIN_S)
                          ).run(the_call, f"{call}()", raises=waits)
        if call == "map":  # results handed out before the stall are right, in order
            for k, r in enumerate(got):
                np.testing.assert_array_equal(r, np.full(8, (10.0 if futs else 0.0) + k + 1))
        bounded(pipe.close)  # the prepare returned: close finishes the rest
        if waiter is not None:
            join([waiter])
        assert all(f.done() for f in futs)
        s = pipe.stats()
        assert s.in_flight == 0 and s.balanced() and s.failed == 0, s
        for f, item in zip(futs, sent):  # what was delivered is right
            np.testing.assert_array_equal(f.result(), item + 1)
        del futs, waiter
        gc.collect()
        assert dev.live().total == 0, dev.live()
    assert not [str(w.message) for w in seen if issubclass(w.category, (RuntimeWarning, ResourceWarning))]


@pytest.mark.parametrize("call", ["failures", "stats"])
def test_a_ctrl_c_that_wakes_nothing_gets_out_of_a_look_at_a_pipeline_a_stalled_prepare_keeps(call):
    """As above, for the calls that only look at the pipeline (its failures, its stats), with the
    Ctrl-C only flagged (``_thread.interrupt_main``: a SIGINT the kernel handed to another thread
    wakes no lock wait of the main thread): the KeyboardInterrupt comes out while the prepare,
    run inside a step, still blocks. ``failures`` took the pipeline's lock in a plain wait, which
    only the lock's release ended."""
    _need_sigint()
    dev = rf.device("sim", seed=13, chaos=True)
    started, release = {0.0: threading.Event()}, threading.Event()
    pipe = rf.Pipeline(lambda x, y: np.copyto(y, x + 1), device=dev, prepare=_stalling_prepare(started, release),
                       chunk_bytes=512, slots=2, workers=1, max_in_flight=4, checked=True)
    sent = [np.full(8, float(k)) for k in range(3)]
    futs = [pipe.submit(item) for item in sent]
    waiter = start(concurrent.futures.wait, futs, JOIN_S)
    assert started[0.0].wait(JOIN_S)
    assert "step" in stack_names(pipe._driver.thread)  # the prepare stalls where the lock is held
    # Ctrl-C once the main thread is inside the call (the look takes the lock first thing)
    CtrlCWhileStalled(release, ready=once_inside(call), deliver=lambda: _deliver_ctrl_c("interrupt_main")).run(
        lambda: pipe.failures if call == "failures" else pipe.stats(), call)
    bounded(pipe.close)
    join([waiter])
    for f, item in zip(futs, sent):
        np.testing.assert_array_equal(f.result(), item + 1)
    assert pipe.failures == [] and pipe.stats().balanced()
    del futs, waiter
    gc.collect()
    assert dev.live().total == 0, dev.live()


@pytest.mark.parametrize("shares", [False, True])
def test_ctrl_c_gets_out_of_a_submit_whose_staging_copy_waits_for_a_device_a_stalled_compute_keeps(shares):
    """No prepare: a plain array item is copied on the submitting thread (into a pinned staging
    block, or into a chunk small items share), and on the simulated GPU that copy is a call of
    the device, which takes the device's lock. A compute that does not return, run by the
    progress thread inside a device wait, keeps that lock: Ctrl-C (a real SIGINT) on the main
    thread while its submit's copy waits for it must come out while the compute still blocks."""
    _need_sigint()
    dev = rf.device("sim", profile="unit", seed=14)  # no host overheads: kernels run in device waits only
    started, release = threading.Event(), threading.Event()

    def compute(x, y):
        if x[0] == 0.0:
            started.set()
            release.wait(JOIN_S)
        np.copyto(y, x + 1)

    pipe = rf.Pipeline(compute, device=dev, chunk_bytes=512, slots=2, max_in_flight=4, coalesce=shares)
    first = pipe.submit(np.zeros(8))
    waiter = start(concurrent.futures.wait, [first], JOIN_S)
    assert started.wait(JOIN_S)
    assert "wait_any" in stack_names(pipe._driver.thread)  # the compute stalls in a device wait
    # Ctrl-C once the main thread is inside the submit
    CtrlCWhileStalled(release, ready=once_inside("submit")).run(lambda: pipe.submit(np.ones(8)), "submit")
    join([waiter])
    np.testing.assert_array_equal(first.result(), np.ones(8))
    bounded(pipe.close)
    s = pipe.stats()
    assert s.accepted == 1 and s.delivered == 1 and s.balanced(), s
    del first, waiter
    gc.collect()
    assert dev.live().total == 0, dev.live()


def test_ctrl_c_gets_out_of_a_shared_submit_whose_take_back_waits_for_a_step_a_stalled_compute_keeps():
    """Small items share chunks. A compute that does not return runs inside a step (on this
    profile a step's host calls advance the simulated GPU), so the progress thread keeps both the
    pipeline's lock and the device's. The main thread's item joins a chunk still taking items (kept
    open by another thread whose copy into it has not ended), and its own copy waits for the
    device's lock: Ctrl-C (a real SIGINT) there must come out while the compute still blocks.
    The interrupted item is taken back, and taking it back needs the pipeline's lock: it waited
    for it (a second Ctrl-C only started the wait again), and is now handed to the progress
    thread, which carries it out before its next step once the compute returns."""
    _need_sigint()
    dev = rf.device("sim", seed=15)
    started, release = threading.Event(), threading.Event()
    pipe = None

    def compute(x, y):
        if x[0] == 7.0 and threading.current_thread() is pipe._driver.thread:
            started.set()
            release.wait(JOIN_S)
        np.copyto(y, x + 1)

    pipe = rf.Pipeline(compute, device=dev, chunk_bytes=512, slots=2, max_in_flight=4)
    first = pipe.submit(np.full(8, 7.0, np.float32))
    pipe._step()  # its chunk admitted (no chunk takes items now)
    other = np.full(8, 1.0, np.float32)
    copying, let_copy = hold_copy(dev, other)
    opener = start(pipe.submit, other)  # a new chunk, taking items while this copy into it lasts
    assert copying.wait(JOIN_S)
    waiter = start(first.exception, JOIN_S)  # someone waits: the progress thread runs the compute
    assert started.wait(JOIN_S)
    assert "step" in stack_names(pipe._driver.thread) and pipe._sched.open_batch is not None

    def second_ctrl_c(stall):  # where the first did not get out, a second Ctrl-C, waited for a while
        interrupt_main()
        stall.raised.wait(STALL_S / 3)

    # Ctrl-C once the main thread's copy waits for the device
    mine = np.full(8, 2.0, np.float32)
    CtrlCWhileStalled(release, ready=once_inside("host_copy"), on_hang=second_ctrl_c).run(
        lambda: pipe.submit(mine), "submit")
    let_copy.set()
    theirs = join([opener])[0]
    join([waiter])
    np.testing.assert_array_equal(first.result(), np.full(8, 8.0, np.float32))
    np.testing.assert_array_equal(theirs.result(timeout=JOIN_S), other + 1)
    bounded(pipe.close)
    s = pipe.stats()
    assert s.accepted == 2 and s.delivered == 2 and s.balanced(), s  # the interrupted item was taken back
    del first, theirs, waiter, opener
    gc.collect()
    assert dev.live().total == 0, dev.live()


@pytest.mark.parametrize("ending", ["close", "with", "with-error"])
def test_ctrl_c_gets_out_of_an_ending_waiting_for_a_done_callback_that_does_not_return(ending):
    """A future's done-callback runs on the progress thread, outside the pipeline's lock: one that
    does not return keeps the thread from every later turn, so close() (or the end of a with
    block) waits for it. Ctrl-C there gets out as it does of a stalled prepare: the
    KeyboardInterrupt comes out while the callback still blocks, the end is handed to the
    progress thread, and once the callback returns a second close() completes and nothing is
    left live."""
    _need_sigint()
    dev = rf.device("sim", seed=14, chaos=True)
    in_callback, release, entered = (threading.Event() for _ in range(3))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        pipe = rf.Pipeline(lambda x, y: np.copyto(y, x + 1), device=dev, chunk_bytes=512, slots=2,
                           max_in_flight=4, checked=True)
        forget = pipe._forget_if_forked  # the first thing either ending does, inside its call

        def entering():
            entered.set()
            return forget()

        pipe._forget_if_forked = entering
        sent = [np.full(8, float(k)) for k in range(4)]
        futs = [pipe.submit(item) for item in sent]

        def stuck(_fut):  # user code that does not return until the test lets it
            in_callback.set()
            release.wait(JOIN_S)

        futs[0].add_done_callback(stuck)  # (someone waits now: the progress thread runs)
        assert in_callback.wait(JOIN_S)
        CtrlCWhileStalled(release, ready=lambda: entered.wait(JOIN_S)).run(lambda: _end(pipe, ending), "the ending")
        bounded(pipe.close)  # a second close completes
        assert not pipe._driver.thread.is_alive() and pipe._sched.closed
        assert all(f.done() for f in futs)
        s = pipe.stats()
        assert s.in_flight == 0 and s.balanced() and s.accepted == len(futs) and s.failed == 0, s
        for f, item in zip(futs, sent):  # what was delivered is right
            if not f.cancelled():
                np.testing.assert_array_equal(f.result(), item + 1)
        with pytest.raises(RuntimeError, match="closed"):
            pipe.submit(np.zeros(8))
        del futs
        gc.collect()
        assert dev.live().total == 0, dev.live()
    assert not [str(w.message) for w in seen if issubclass(w.category, (RuntimeWarning, ResourceWarning))]


# -- dropped without close ------------------------------------------------------------------------------------
def test_dropped_after_ctrl_c_without_close_warns_and_releases():
    dev = rf.device("sim", seed=10, chaos=True)
    pipe, thread = _new_pipeline(device=dev, slots=1, max_in_flight=6)

    def feed():
        for k in range(20):
            if k == 5:
                raise KeyboardInterrupt
            yield np.arange(8.0) + k

    futs = [pipe.submit(np.arange(8.0) - k) for k in range(3)]  # not waited for: still in flight
    with pytest.raises(KeyboardInterrupt):
        list(pipe.map(feed()))  # (cancels what it took)
    assert pipe.stats().in_flight > 0  # work still in flight when it is dropped
    del futs
    with pytest.warns(ResourceWarning, match="garbage-collected; cancelling it"):
        del pipe
        gc.collect()
    assert _released(dev, thread), dev.live()


def test_dropped_while_another_thread_waits_on_a_future():
    """The waiter holds a future, not the pipeline: the pipeline is collected, its chunks are
    cancelled, and the waiter gets CancelledError instead of waiting for ever."""
    dev = rf.device("sim", seed=11, chaos=True)
    pipe, thread = _new_pipeline(device=dev, slots=1, max_in_flight=8)
    futs = [pipe.submit(np.arange(8.0) + k) for k in range(8)]
    last = futs[-1]
    del futs
    release = threading.Event()

    def waiter(fut):
        release.wait(JOIN_S)
        try:
            return "value", fut.result()
        except concurrent.futures.CancelledError:
            return "cancelled", None

    w = start(waiter, last)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del pipe
        gc.collect()
        release.set()
        kind, _ = join([w])[0]
    assert any(issubclass(x.category, ResourceWarning) for x in caught)
    assert kind == "cancelled"
    del last, w
    assert _released(dev, thread), dev.live()


def _new_pipeline(**options):
    """A pipeline and its progress thread (the thread it started, found by name), so a test can
    join that thread after dropping the pipeline."""
    before = set(threading.enumerate())
    pipe = rf.Pipeline(lambda x, y: np.copyto(y, x + 1), chunk_bytes=512, checked=True, **options)
    [thread] = [t for t in set(threading.enumerate()) - before if t.name.startswith("ringflow-progress")]
    return pipe, thread


def _released(dev, thread) -> bool:
    """Whether the dropped pipeline's progress thread ended (it cancels, drains and releases on its
    own once the pipeline is collected) within the real-time bound and left nothing live."""
    thread.join(JOIN_S)
    gc.collect()
    return not thread.is_alive() and dev.live().total == 0


def test_ctrl_c_as_close_waits_for_the_progress_thread_leaves_the_thread_to_release_what_it_used():
    """A KeyboardInterrupt raised as close() waits for the progress thread to end (a second Ctrl-C,
    or, as here, a SIGINT handler of the user's that raises at once) while that thread still runs:
    close() raises it, the thread ends the pipeline, and nothing it used is freed under it. The
    rings used to be freed at once: on CPython 3.11 an interrupted ``Thread.join`` marks the
    running thread stopped, and the checker saw the buffers freed unordered with its writes."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("installs a SIGINT handler: the test must run on the main thread")
    dev = rf.device("sim", seed=13, chaos=True)
    in_last_turn, release = threading.Event(), threading.Event()

    def raise_at_once(signum, frame):
        raise KeyboardInterrupt("the user's handler")

    previous = signal.signal(signal.SIGINT, raise_at_once)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            pipe = rf.Pipeline(lambda x, y: np.copyto(y, x + 1), device=dev, chunk_bytes=512, checked=True)
            futs = [pipe.submit(np.full(8, float(k))) for k in range(3)]
            driver = pipe._driver
            turn = driver.step_once

            def last_turn_held():
                # the thread's last turn, which close() waits for, lasts until the test lets it
                # end (as a done-callback of the last chunk still running would)
                going_on = turn()
                if not going_on:
                    in_last_turn.set()
                    release.wait(JOIN_S)
                return going_on

            driver.step_once = last_turn_held

            def ctrl_c_in_the_last_turn():
                if in_last_turn.wait(JOIN_S):
                    interrupt_main()
                release.set()  # (the interrupt is on its way as the thread is let go)

            kicker = start(ctrl_c_in_the_last_turn)
            with pytest.raises(KeyboardInterrupt, match="the user's handler"):
                pipe.close()
            join([kicker])
            bounded(pipe.close)  # harmless: the end was waited for, or is now
            assert not driver.thread.is_alive() and pipe._sched.closed
            for k, fut in enumerate(futs):
                np.testing.assert_array_equal(fut.result(), np.full(8, k + 1.0))
            del futs
            gc.collect()
            assert dev.live().total == 0, dev.live()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert not [str(w.message) for w in seen if issubclass(w.category, (RuntimeWarning, ResourceWarning))]
