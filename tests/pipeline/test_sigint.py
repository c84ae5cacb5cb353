"""Ctrl-C (a real SIGINT) during a whole-array call: taken between steps, never half way through
a stage change, a clean-up or the engine's parking (src/ringflow/_pipeline/sigint.py).

Each case sends SIGINT at one instruction of the library's whole-array path (tests/helpers/
interrupts.py, spread over the call) and checks what a user would: the call raises
KeyboardInterrupt itself (not a StageError an ``except Exception`` would swallow), nothing
warns (a hazard as buffers are freed, a clean-up that failed), nothing is left live, and the
device serves the next call correctly."""

from __future__ import annotations

import gc
import signal
import threading
import warnings

import numpy as np
import pytest

import ringflow as rf
from ringflow._pipeline import sigint, warm
from ringflow._testing import inject
from tests.helpers.interrupts import InterruptAt
from tests.helpers.threads import bounded

# the functions a whole-array call runs through, from the call down to the scheduler's steps
# run_prepared, _stream_map, _memo_key and prepared: a stream_map call served by its remembered plan
NAMES = ("run_whole", "run_prepared", "_stream_map", "_memo_key", "prepared", "run_call", "take", "park", "_close",
         "close", "fail", "__call__", "__exit__", "run", "_enqueue", "_failure", "settle", "wait_for", "drive_here", "_drive", "run_commands",
         "step", "_admit", "_observe", "_on_fence_done", "_start_prepares", "_enqueue_h2d", "_enqueue_compute",
         "_enqueue_d2h", "_start_consume", "_on_consumed", "_end", "cancel_pending", "_shut")
POINTS = 36  # instructions a door is interrupted at, spread evenly over one call


def f(x, y):
    y[...] = x * 2 + 1


f.sim_seconds = 20e-6


def _need_sigint():
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("sends SIGINT to the main thread: the test must run there")
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is not Python's default KeyboardInterrupt handler here")


def _stream_map(dev, x, host):
    return lambda: rf.stream_map(f, x, device=dev, chunk_bytes=16384, host=host)


def _map_job(dev, x):
    def call():
        with rf.MapJob(f, x, device=dev, chunk_bytes=16384) as job:
            return job()
    return call


DOORS = {
    "stream_map staged (the scheduler)": lambda dev, x: _stream_map(dev, x, "stage"),
    "stream_map registered (the direct engine)": lambda dev, x: _stream_map(dev, x, "register"),
    "MapJob": _map_job,
}


@pytest.mark.parametrize("door", DOORS)
def test_ctrl_c_anywhere_in_a_whole_array_call_stops_it_cleanly(door):
    _need_sigint()
    dev = rf.device("sim", seed=5, chaos=True, checked=True)
    x = np.random.default_rng(5).random(1 << 15).astype(np.float32)
    call = DOORS[door](dev, x)
    call()  # the calls interrupted below find the engine this one kept warm (stream_map)
    with InterruptAt(10 ** 9, NAMES, sigint=True) as counting:
        np.testing.assert_array_equal(call(), x * 2 + 1)
    total = counting.seen
    assert total > 4 * POINTS, total
    interrupted = 0
    for n in np.linspace(0, total - 1, POINTS).astype(int):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            raised = False
            with InterruptAt(int(n), NAMES, sigint=True) as at:
                try:
                    call()
                except KeyboardInterrupt:
                    raised = True
            assert raised == (at.fired == 1), n  # every Ctrl-C sent is raised, as itself
            interrupted += raised
            rf.drop_warm_pipelines(dev)
            gc.collect()
        assert not [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)], n
        assert dev.live().total == 0, (n, dev.live())
        assert not any(dev.collected_unclosed().values()), (n, dev.collected_unclosed())  # none left to the collector
        np.testing.assert_array_equal(bounded(call), x * 2 + 1)  # the device serves the next call
    assert interrupted >= POINTS - 2, interrupted
    rf.drop_warm_pipelines(dev)


def test_ctrl_c_at_every_line_between_taking_a_warm_engine_and_parking_it():
    """The window a spread of points rarely hits: a Ctrl-C at each instruction of the call's own
    frame (take, run, park) leaves its engine parked or closed (closed where the Ctrl-C stopped
    the run), never dropped unclosed: nothing is live once the warm engines are dropped, with
    no collection in between, and the next call runs."""
    _need_sigint()
    rf.drop_warm_pipelines()  # counted below: none but this call's
    dev = rf.device("sim", seed=8, checked=True)
    x = np.random.default_rng(8).random(1 << 13).astype(np.float32)
    call = _stream_map(dev, x, "register")
    call()
    with InterruptAt(10 ** 9, ("run_prepared",), sigint=True) as counting:
        call()
    assert counting.seen > 10, counting.seen
    for n in range(counting.seen):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with InterruptAt(n, ("run_prepared",), sigint=True) as at:
                with pytest.raises(KeyboardInterrupt):
                    call()
            assert at.fired == 1, n
            assert len(warm.WARM) <= 1, n
            rf.drop_warm_pipelines(dev)
            assert dev.live().total == 0, (n, dev.live())
            gc.collect()
            assert not any(dev.collected_unclosed().values()), (n, dev.collected_unclosed())
        assert not [str(w.message) for w in seen], n
        np.testing.assert_array_equal(call(), x * 2 + 1)
    rf.drop_warm_pipelines(dev)


def test_a_compute_raising_keyboard_interrupt_on_the_direct_engine_raises_it_itself():
    """Not a StageError: an ``except Exception`` around the call must not swallow Ctrl-C (the
    scheduler already raised the interrupt itself)."""
    dev = rf.device("sim", seed=6, chaos=True, checked=True)
    x = np.arange(4096, dtype=np.float32)

    def interrupted(x, y):
        raise KeyboardInterrupt("pressed in the compute")

    for host in ("register", "stage"):
        with pytest.raises(KeyboardInterrupt, match="pressed in the compute"):
            rf.stream_map(interrupted, x, device=dev, chunk_bytes=4096, host=host)
    rf.drop_warm_pipelines(dev)
    gc.collect()
    assert dev.live().total == 0


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit])
def test_a_compute_raising_an_interrupt_with_on_error_continue_raises_it_itself(exc_type):
    """on_error="continue" runs the other chunks first, then raises the interrupt itself, not
    the StageError around it (an ``except Exception`` must not swallow it)."""
    dev = rf.device("sim", seed=7, chaos=True, checked=True)
    x = np.arange(4096, dtype=np.float32)
    boom = exc_type("raised in the compute")

    def interrupted(x, y):
        if x[0] == 2048:
            raise boom
        y[...] = x * 2 + 1

    for host in ("register", "stage"):
        with pytest.raises(exc_type) as caught:
            rf.stream_map(interrupted, x, device=dev, chunk_bytes=4096, host=host, on_error="continue")
        assert caught.value is boom
        del caught
    rf.drop_warm_pipelines(dev)
    gc.collect()
    assert dev.live().total == 0


@pytest.mark.parametrize("door", ["stream_map", "MapJob"])
def test_a_failed_call_settles_with_checkpoints_quiet(door):
    """A compute that fails on the direct engine: the engine is settled with the call's shield
    settling, so a Ctrl-C recorded before the failure waits until everything is settled and is
    raised as the call returns, the failure as its context."""
    _need_sigint()
    dev = rf.device("sim", seed=8, chaos=True, checked=True)
    x = np.arange(4096, dtype=np.float32)
    settling = []

    def failing(x, y):
        if x[0] == 2048:
            signal.raise_signal(signal.SIGINT)  # recorded by the shield: the call is between checkpoints
            raise ValueError("the compute failed")
        y[...] = x * 2 + 1

    def watch(engine):
        fail = engine.fail

        def watched(exc):
            settling.append(sigint._active is not None and sigint._active.settling)
            return fail(exc)

        engine.fail = watched

    with inject(on_engine=watch), pytest.raises(KeyboardInterrupt) as caught:
        if door == "stream_map":
            rf.stream_map(failing, x, device=dev, chunk_bytes=4096, host="register", keep_warm=False)
        else:
            with rf.MapJob(failing, x, device=dev, chunk_bytes=4096, host="register") as job:
                job()
    assert settling == [True]
    assert isinstance(caught.value.__context__, rf.StageError)
    del caught
    gc.collect()
    assert dev.live().total == 0


# -- the shield itself ------------------------------------------------------------------------------------
def test_a_ctrl_c_waits_for_a_checkpoint_and_is_raised_once():
    _need_sigint()
    with pytest.raises(KeyboardInterrupt):
        with sigint.shielded() as shield:
            assert shield is not None and signal.getsignal(signal.SIGINT) == shield.handle
            signal.raise_signal(signal.SIGINT)  # recorded, not raised
            assert shield.pending
            sigint.checkpoint()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    sigint.checkpoint()  # outside any call: nothing pending, nothing raised


def test_a_ctrl_c_after_the_last_checkpoint_is_raised_when_the_call_returns():
    _need_sigint()
    done = []
    with pytest.raises(KeyboardInterrupt):
        with sigint.shielded():
            signal.raise_signal(signal.SIGINT)
            done.append("the rest of the call ran")
    assert done and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_raises_at_once():
    _need_sigint()
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with sigint.shielded():
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)  # pressed again before the first was taken
            reached.append(True)
    assert not reached


def test_while_settling_checkpoints_do_not_raise_and_a_second_ctrl_c_does():
    _need_sigint()
    with pytest.raises(KeyboardInterrupt):
        with sigint.shielded() as shield:
            signal.raise_signal(signal.SIGINT)
            try:
                sigint.checkpoint()
            except KeyboardInterrupt:
                shield.settle()
                sigint.checkpoint()  # the clean-up's own waits go on
                signal.raise_signal(signal.SIGINT)  # a clean-up that does not end: Ctrl-C again
                pytest.fail("the second Ctrl-C was not raised at once")


def test_nested_blocks_share_one_shield():
    _need_sigint()
    with sigint.shielded() as outer:
        with sigint.shielded() as inner:
            assert inner is outer
        assert signal.getsignal(signal.SIGINT) == outer.handle
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_other_threads_and_other_handlers_are_left_alone():
    got = []
    thread = threading.Thread(target=lambda: got.append(sigint.shielded().__enter__()))
    thread.start()
    thread.join()
    assert got == [None]
    if threading.current_thread() is not threading.main_thread():
        return
    mine = signal.signal(signal.SIGINT, lambda *a: None)
    try:
        own = signal.getsignal(signal.SIGINT)
        with sigint.shielded() as shield:
            assert shield is None and signal.getsignal(signal.SIGINT) is own
    finally:
        signal.signal(signal.SIGINT, mine)


@pytest.mark.gpu
@pytest.mark.parametrize("host", ["stage", "register"])
def test_ctrl_c_at_any_moment_of_a_call_on_a_gpu_leaves_nothing_behind(cuda_device, host):
    """Real SIGINTs at moments spread over real calls (staged: the scheduler; registered: the
    direct engine): each call either returns the right result or raises KeyboardInterrupt, and
    afterwards nothing is live and the next call is right."""
    _need_sigint()
    import time

    dev = cuda_device
    x = np.random.default_rng(9).random(16 << 20, dtype=np.float32)  # 64 MiB in 4 MiB chunks

    def call():
        return rf.stream_map(f, x, device=dev, chunk_bytes=4 << 20, host=host, keep_warm=False)

    np.testing.assert_array_equal(call(), x * 2 + 1)
    t0 = time.perf_counter()
    call()
    seconds = time.perf_counter() - t0
    main = threading.main_thread().ident
    outcomes = []
    for delay in np.linspace(0, seconds, 12):
        timer = threading.Timer(delay, signal.pthread_kill, (main, signal.SIGINT))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                timer.start()
                try:
                    got = call()
                    outcomes.append("returned")
                    np.testing.assert_array_equal(got, x * 2 + 1)
                finally:
                    timer.join()  # a signal after the call lands in here, or in the sleep below
                    time.sleep(0.01)
            except KeyboardInterrupt:
                outcomes.append("interrupted")
        assert not [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
        gc.collect()
        assert dev.live().total == 0, dev.live()
        np.testing.assert_array_equal(call(), x * 2 + 1)
    assert "interrupted" in outcomes, outcomes


# -- a Pipeline's calls on the main thread ------------------------------------------------------------------
PIPELINE_SWEEP = r"""
import gc, sys, warnings
import numpy as np
import ringflow as rf
from tests.helpers.interrupts import InterruptAt

# the lock and event code a user thread runs inside submit, map and result: a KeyboardInterrupt
# raised there can leave a lock taken (after Condition.__enter__ acquired it, before it returned)
NAMES = ("__enter__", "__exit__", "set", "clear", "wait", "notify", "notify_all", "_release_save",
         "_acquire_restore", "_is_owned")
dev = rf.device("sim", seed=7, chaos=True, checked=True)
rng = np.random.default_rng(7)
items = [rng.random(int(n)).astype(np.float32) for n in rng.integers(100, 200_000, 24)]

def f(x, y):
    y[...] = x * 2 + 1

def run(n):
    with InterruptAt(n, NAMES, files=("threading.py",), sigint=True) as at:
        try:
            with rf.Pipeline(f, device=dev, chunk_bytes=1 << 20, max_in_flight=4) as pipe:
                for x, y in zip(items, pipe.map(items)):
                    assert np.array_equal(y, x * 2 + 1)
                fut = pipe.submit(items[0])
                assert np.array_equal(fut.result(), items[0] * 2 + 1)
            return "returned", at.seen
        except KeyboardInterrupt:
            return "interrupted", at.seen

outcome, total = run(10 ** 9)
assert outcome == "returned"
counts = {"returned": 0, "interrupted": 0}
for n in np.linspace(0, total - 1, int(sys.argv[1])).astype(int):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        outcome, _ = run(int(n))
        gc.collect()
    counts[outcome] += 1
    bad = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    assert not bad, (n, bad)
    assert dev.live().total == 0, (n, dev.live())
print(counts)
"""


def test_ctrl_c_anywhere_in_a_pipelines_locks_on_the_main_thread_never_hangs_it():
    """A real SIGINT at instructions spread over the threading code (Condition, Event) that
    ``map``, ``submit`` and ``result`` run on the main thread: each run returns or raises
    KeyboardInterrupt, closes, and leaves nothing live. In a subprocess, bounded in time: one
    landing after a lock was taken and before its ``with`` block began used to leave the lock
    taken and the pipeline's progress thread waiting for it for ever."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", PIPELINE_SWEEP, "40"], capture_output=True, text=True,
                          timeout=240, cwd=root, env={**os.environ, "PYTHONPATH": root})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "'interrupted': 0" not in done.stdout, done.stdout


def test_a_shielded_condition_held_by_the_main_thread_defers_ctrl_c_until_let_go():
    """Taken twice (as ``concurrent.futures.wait`` takes it once a future), a SIGINT meanwhile is
    raised at the outermost release, with the lock already free; another thread takes it as a
    plain lock."""
    assert threading.current_thread() is threading.main_thread()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    cond = sigint.ShieldedCondition()
    cond.acquire()
    with cond:
        signal.raise_signal(signal.SIGINT)  # recorded, not raised
        assert cond._is_owned()
    assert cond._is_owned()  # still held once
    with pytest.raises(KeyboardInterrupt):
        cond.release()
    assert not cond._is_owned() and cond._lock.acquire(blocking=False)
    cond._lock.release()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    taken = bounded(lambda: (cond.acquire(), cond._is_owned(), cond.release())[1])
    assert taken is True
    assert cond.acquire(blocking=False) is True  # a try that succeeds is shielded too
    cond.release()


_real_signal = sigint._signal


class _CtrlCAfter:
    """sigint's ``_signal``, but ``times`` Ctrl-Cs arrive as the call ``name`` returns, where
    Python runs a signal handler in real code (right after a call into C), each handled there."""

    def __init__(self, name: str, times: int):
        self.name, self.times = name, times

    def __getattr__(self, attr):
        real = getattr(_real_signal, attr)
        if attr != self.name:
            return real

        def call(*args):
            value = real(*args)
            times, self.times = self.times, 0
            for _ in range(times):
                signal.raise_signal(signal.SIGINT)  # handled as raise_signal returns: inside this call
            return value

        return call


@pytest.mark.parametrize("where", ["entering", "leaving"])
def test_a_second_ctrl_c_as_a_shield_is_set_up_or_taken_down_leaves_none_to_nest_into(where, monkeypatch):
    """A second Ctrl-C raises at once, and can be handled just as a shield installs its handler
    (entering: both arrive then, the first recorded by the new shield) or as the outermost block
    looks at the handler to put Python's back (leaving: the first was recorded during the call).
    What it leaves must not be a shield a later call nests into: leaving, the shield stayed
    active with its handler installed, and the next call shared it; having raised already, it
    raised that call's first Ctrl-C at once, wherever it landed, instead of at a checkpoint."""
    _need_sigint()
    with pytest.raises(KeyboardInterrupt):
        if where == "entering":
            monkeypatch.setattr(sigint, "_signal", _CtrlCAfter("signal", 2))
            with sigint.shielded():
                pytest.fail("the block was entered")
        else:
            with sigint.shielded():
                signal.raise_signal(signal.SIGINT)  # the first Ctrl-C: recorded
                monkeypatch.setattr(sigint, "_signal", _CtrlCAfter("getsignal", 1))
    monkeypatch.setattr(sigint, "_signal", _real_signal)
    recorded = []
    try:
        with pytest.raises(KeyboardInterrupt):
            with sigint.shielded() as shield:
                signal.raise_signal(signal.SIGINT)  # the next call's first Ctrl-C: recorded, not raised
                recorded.append(shield.pending)
                sigint.checkpoint()
                pytest.fail("the recorded Ctrl-C was not raised at the checkpoint")
    finally:
        handler = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        monkeypatch.setattr(sigint, "_active", None)
    assert recorded == [True], "the next call's first Ctrl-C was raised at once, not at its checkpoint"
    assert handler is signal.default_int_handler


@pytest.mark.parametrize("left", ["a shield without its handler", "a handler without its shield"])
def test_a_shield_left_half_set_up_by_a_second_ctrl_c_is_replaced_by_the_next_call(left, monkeypatch):
    """A second Ctrl-C raises at once, and so can land inside a shield's own setting up or taking
    down. The next outermost shielded block sees what was left as stale and starts afresh; once
    it ends, Python's handler is back and a Ctrl-C raises again."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    stale = sigint.Shield()
    stale.depth = 1
    if left == "a shield without its handler":
        monkeypatch.setattr(sigint, "_active", stale)
    else:
        signal.signal(signal.SIGINT, stale.handle)
    recorded = []
    try:
        with sigint.shielded() as shield:
            assert shield is not None and shield is not stale and sigint._active is shield
            signal.raise_signal(signal.SIGINT)  # recorded by the new shield
            assert shield.pending and not stale.pending
            recorded.append(True)
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the Ctrl-C recorded in the block was not raised as it ended")
    finally:
        handler = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # a KeyboardInterrupt raised at once inside the block (no handler of the new shield to record
    # it) skipped the block's checks and was taken above for the one raised as the block ended
    assert recorded == [True], "the Ctrl-C in the block was raised at once, not recorded by the new shield"
    assert handler is signal.default_int_handler and sigint._active is None
