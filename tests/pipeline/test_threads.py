"""Many threads on one pipeline (all on the chaotic simulated GPU, hazard checker on).

A :class:`ringflow.Pipeline` advances on a progress thread of its own and every method may be
called from any thread. These tests call ``submit``, ``map``, ``cancel``, ``close``, ``stats``
and ``report`` from several threads at once and check what the single-threaded suite checks:
each delivered payload is f(its own input) bit for bit, stats balance, no HazardError, every
slot FREE and nothing live on the device after close. Every join is bounded in real seconds
(tests/helpers/threads), so a deadlock fails instead of hanging.

A hypothesis test passes pool arrays and results between the caller's threads (each step on a
thread of its own, joined: an ordering the checker cannot see) through every way in.

The state machine at the end mixes submitter threads (some items failing, some raising
KeyboardInterrupt in prepare, compute or consume), a canceller, per-future cancels and a
closer, checking the harness's invariants under the pipeline's lock after every step.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import ringflow as rf
from ringflow import _testing
from ringflow._errors import StageError
from ringflow._pipeline.states import ChunkState
from tests.helpers.hooks import pipeline_of
from tests.helpers.pipeline_checks import (
    FAULTS,
    INTERRUPTS,
    REENTRIES,
    Harness,
    check_chunk_error,
    check_result,
    future_outcome,
)
from tests.helpers.sim import Timeline
from tests.helpers.stateful import machine_settings
from tests.helpers.threads import JOIN_S, CancelAfter, bounded, join, run_all, start

ELEMS = 64  # int64 elements per item at most: 512-byte slots


def sizes(seed: int, n: int) -> list[int]:
    rng = np.random.default_rng(seed)
    out = rng.integers(1, ELEMS + 1, n)
    out[rng.random(n) < 0.1] = 0
    return [int(x) for x in out]


def f_affine(x, y):
    y[...] = x * 3 + 1


# -- submit from many threads ---------------------------------------------------------------------
@pytest.mark.parametrize("seed,threads", [(0, 4), (1, 8), (2, 6), (3, 5)])
def test_concurrent_submitters_get_their_own_results(seed, threads):
    h = Harness(seed=seed, chaos=True, checked=True, slots=2, max_in_flight=5, workers=2, chunk_bytes=512)
    per = 16
    batches = [[h.item(1000 * (k + 1) + i, n) for i, n in enumerate(sizes(seed * 100 + k, per))]
               for k in range(threads)]
    go = threading.Barrier(threads)

    def submitter(items):
        go.wait(JOIN_S)
        futs = [h.pipe.submit(it) for it in items]
        for fut, it in zip(futs, items):
            check_result(fut.result(), it, fut.index)
        return [fut.index for fut in futs]

    indices = run_all([lambda b=b: submitter(b) for b in batches])
    flat = [i for got in indices for i in got]
    assert sorted(flat) == list(range(threads * per)), "chunk indices lost or handed out twice"
    # the submissions really interleaved: no thread got one contiguous block of indices
    assert any(got != list(range(got[0], got[0] + per)) for got in indices)
    h.check()
    s = h.pipe.stats()
    assert (s.accepted, s.delivered, s.failed, s.cancelled, s.in_flight) == (threads * per, threads * per, 0, 0, 0)
    h.close()  # every slot FREE, dev.live().total == 0, no hazard hidden in a warning


@pytest.mark.parametrize("seed", [4, 5])
def test_submitters_with_faults_on_error_continue(seed):
    """Failing items from several threads fail alone: each thread sees its own StageErrors (stage,
    index and cause right) and its good items' results."""
    h = Harness(seed=seed, chaos=True, checked=True, slots=2, max_in_flight=4, workers=3, chunk_bytes=512,
                on_error="continue")
    rng = np.random.default_rng(seed)
    batches = [[h.item(1000 * (k + 1) + i, n, fault=(str(rng.choice(FAULTS)) if rng.random() < 0.25 else None))
                for i, n in enumerate(sizes(seed * 10 + k, 12))] for k in range(4)]

    def submitter(items):
        futs = [h.pipe.submit(it) for it in items]
        for fut, it in zip(futs, items):
            kind, value = future_outcome(_settled(fut))
            if it.fault is None:
                assert kind == "value", (it.tag, kind, value)
                check_result(value, it, fut.index)
            else:
                assert kind == "error", (it.tag, it.fault, kind)
                check_chunk_error(value, it, fut.index)

    run_all([lambda b=b: submitter(b) for b in batches])
    h.check()
    s = h.pipe.stats()
    faulty = sum(it.fault is not None for b in batches for it in b)
    assert faulty > 0 and (s.failed, s.delivered) == (faulty, 48 - faulty)
    h.close()


def _settled(fut):
    """Wait for ``fut`` (raising nothing) and return it."""
    fut.exception()
    return fut


# -- map from two threads ---------------------------------------------------------------------------
@pytest.mark.parametrize("seed,ordered", [(6, True), (7, False), (8, True)])
def test_two_maps_at_once(seed, ordered):
    h = Harness(seed=seed, chaos=True, checked=True, slots=2, max_in_flight=4, workers=2, chunk_bytes=512,
                ordered=ordered)
    batches = [[h.item(1000 * (k + 1) + i, n, consume_cost=float(c))
                for i, (n, c) in enumerate(zip(sizes(seed + k, 20), np.random.default_rng(k).choice([0, 4e-5], 20)))]
               for k in range(2)]

    def mapper(items):
        got = list(h.pipe.map(items))
        tags = [r.tag for r in got]
        if ordered:
            assert tags == [it.tag for it in items], "a map got results out of order or not its own"
        else:
            assert sorted(tags) == sorted(it.tag for it in items), "a map got results that are not its own"
        for r in got:
            check_result(r, h.items[r.tag])
        return len(got)

    assert run_all([lambda b=b: mapper(b) for b in batches]) == [20, 20]
    h.check()
    assert h.pipe.stats().delivered == 40
    h.close()


def test_maps_and_submitters_together():
    h = Harness(seed=9, chaos=True, checked=True, slots=rf.SlotCounts(2, 1, 2, 1), max_in_flight=5, workers=2,
                chunk_bytes=512)
    batches = [[h.item(1000 * (k + 1) + i, n) for i, n in enumerate(sizes(90 + k, 15))] for k in range(4)]

    def mapper(items):
        got = list(h.pipe.map(items))
        assert [r.tag for r in got] == [it.tag for it in items]
        for r in got:
            check_result(r, h.items[r.tag])

    def submitter(items):
        futs = [h.pipe.submit(it) for it in items]
        for fut, it in zip(futs, items):
            check_result(fut.result(), it, fut.index)

    run_all([lambda: mapper(batches[0]), lambda: submitter(batches[1]), lambda: mapper(batches[2]),
             lambda: submitter(batches[3])])
    h.check()
    assert h.pipe.stats().delivered == 60
    h.close()


# -- cancel and close from another thread ----------------------------------------------------------------
def _endless_submitter(h: Harness, k: int, started: threading.Event, limit: int = 400):
    """Submit until the pipeline refuses; returns [(future, item)] and the refusal."""
    futs = []
    for i in range(limit):
        it = h.item(10_000 * (k + 1) + i, (i * 7 + k) % (ELEMS + 1))
        try:
            fut = h.pipe.submit(it)
        except RuntimeError as exc:
            return futs, exc
        futs.append((fut, it))
        if len(futs) == 3:
            started.set()
    return futs, None


def _submitters_stopped_by(h: Harness, stop) -> list:
    """Four :func:`_endless_submitter` threads, and ``stop()`` called on another once one of them
    has three futures; returns each submitter's ``(futures, refusal)`` once all have finished."""
    started = threading.Event()
    subs = [start(_endless_submitter, h, k, started) for k in range(4)]

    def stopper():
        assert started.wait(JOIN_S)
        stop()

    join([start(stopper)] + subs)
    return [sub.result() for sub in subs]


@pytest.mark.parametrize("seed", [10, 11, 12])
def test_cancel_from_another_thread_while_submitters_run(seed):
    h = Harness(seed=seed, chaos=True, checked=True, slots=2, max_in_flight=4, workers=2, chunk_bytes=512)

    def cancel():
        h.pipe.cancel()
        s = h.pipe.stats()
        assert s.in_flight == 0 and s.balanced(), s

    outcomes = {"value": 0, "cancelled": 0}
    for futs, refusal in _submitters_stopped_by(h, cancel):
        assert refusal is not None and "no longer accepts work" in str(refusal), refusal
        done, pending = concurrent.futures.wait([f for f, _ in futs], timeout=JOIN_S)
        assert not pending, f"{len(pending)} futures never ended after cancel"
        for fut, it in futs:
            kind, value = future_outcome(fut)
            assert kind in outcomes, (fut.index, kind, value)
            outcomes[kind] += 1
            if kind == "value":
                check_result(value, it, fut.index)
    assert outcomes["cancelled"] > 0
    h.check()
    s = h.pipe.stats()
    assert (s.delivered, s.cancelled, s.failed, s.in_flight) == (outcomes["value"], outcomes["cancelled"], 0, 0)
    bounded(h.close)


@pytest.mark.parametrize("seed", [13, 14, 15])
def test_close_from_another_thread_while_submitters_run(seed):
    """close() finishes what was accepted: every accepted future is delivered, the others refused."""
    h = Harness(seed=seed, chaos=True, checked=True, slots=2, max_in_flight=4, workers=2, chunk_bytes=512)

    def close():
        h.pipe.close()
        assert h.pipe.stats().in_flight == 0

    delivered = 0
    for futs, refusal in _submitters_stopped_by(h, close):
        assert refusal is not None and ("closed" in str(refusal) or "no longer accepts work" in str(refusal)), refusal
        for fut, it in futs:
            assert fut.done(), f"chunk {fut.index} pending after close"
            check_result(fut.result(timeout=0), it, fut.index)
            delivered += 1
    s = h.pipe.stats()
    assert (s.accepted, s.delivered) == (delivered, delivered)
    bounded(h.close)


def test_cancel_while_a_map_runs_in_another_thread():
    h = Harness(seed=16, chaos=True, checked=True, slots=2, max_in_flight=3, workers=2, chunk_bytes=512)
    items = [h.item(i + 1, (i * 5) % (ELEMS + 1)) for i in range(500)]
    canceller = CancelAfter(h.pipe, 2)

    got: list = []

    def mapper():
        with pytest.raises(concurrent.futures.CancelledError, match="map.. was cut short after handing out") as info:
            for r in h.pipe.map(items):
                got.append(canceller.count(r))
        assert f"handing out {len(got)} result" in str(info.value)

    join([start(mapper), canceller.thread])
    assert 2 <= len(got) < len(items), "the map neither stopped at the cancel nor ran"
    assert [r.tag for r in got] == [it.tag for it in items[:len(got)]], "a cancelled map returned a non-prefix"
    for r in got:
        check_result(r, h.items[r.tag])
    h.check()
    bounded(h.close)


def test_close_and_cancel_race_from_many_threads():
    """close() and cancel() from several threads at once all return (one closes, the others see it
    closed) and leave nothing behind."""
    h = Harness(seed=17, chaos=True, checked=True, slots=2, max_in_flight=6, chunk_bytes=512)
    futs = [h.pipe.submit(h.item(i + 1, 8)) for i in range(6)]
    go = threading.Barrier(6)

    def call(fn):
        go.wait(JOIN_S)
        fn()

    run_all([lambda fn=fn: call(fn) for fn in (h.pipe.close, h.pipe.cancel, h.pipe.close, h.pipe.cancel,
                                               h.pipe.close, h.pipe.close)])
    assert all(f.done() for f in futs)
    for fut in futs:
        kind, value = future_outcome(fut)
        assert kind in ("value", "cancelled")
        if kind == "value":
            check_result(value, h.chunks[fut.index].item, fut.index)
    bounded(h.close)


# -- stats() and report() from another thread ------------------------------------------------------------
def test_stats_and_report_while_submitters_run():
    dev = rf.device("sim", seed=18, chaos=True)
    pipe = rf.Pipeline(f_affine, device=dev, chunk_bytes=512, slots=2, max_in_flight=4, profile=True, checked=True)
    done = threading.Event()
    n_threads, per = 3, 40

    def submitter(k):
        futs = [pipe.submit(np.arange(ELEMS, dtype=np.int64) + 1000 * k + i) for i in range(per)]
        for i, fut in enumerate(futs):
            assert np.array_equal(fut.result(), (np.arange(ELEMS) + 1000 * k + i) * 3 + 1)

    def watcher():
        last_accepted = last_chunks = looks = 0
        earlier = []
        while not done.is_set() or looks < 3:
            looks += 1
            s = pipe.stats()
            assert s.balanced(), s
            assert s.accepted >= last_accepted and s.in_flight <= 4, s
            last_accepted = s.accepted
            r = pipe.report()
            assert r.chunks >= last_chunks
            last_chunks = r.chunks
            # a report is a snapshot: the chunks it counts are the ones its timeline holds
            delivered = [x for x in r.timeline.records if x.final == "delivered"]
            assert len(delivered) == r.chunks, (len(delivered), r.chunks)
            earlier.append((r, len(r.timeline.records), len(r.timeline.stalls)))
        return earlier

    watch = start(watcher)
    try:
        run_all([lambda k=k: submitter(k) for k in range(n_threads)])
    finally:
        done.set()
    earlier = join([watch])[0]
    final = pipe.report()
    assert final.chunks == n_threads * per and pipe.stats().delivered == n_threads * per
    # reports taken along the way did not change as the run went on
    for r, records, stalls in earlier:
        assert (len(r.timeline.records), len(r.timeline.stalls)) == (records, stalls)
    bounded(pipe.close)
    del earlier, final
    assert dev.live().total == 0


# -- whole-array calls from many threads on one device ----------------------------------------------------
def _whole_array_worker(dev, k: int, calls: int, seen: list):
    # one shared module-level f: the warm cache keys engines by f, so they move between threads
    with _testing.inject(on_engine=lambda eng: seen.append((id(pipeline_of(eng)), k))):
        for i in range(calls):
            x = np.arange(4096, dtype=np.float32) + 1000 * k + i
            host = ("stage", "register", "auto")[(k + i) % 3]
            on_error = ("raise", "continue")[(k * 7 + i) % 2]
            if i % 2:
                with rf.MapJob(_double, x, device=dev, chunk_bytes=2048, host=host, on_error=on_error) as job:
                    assert np.array_equal(job(), x * 2 + 1)
                    x[:] += 1
                    assert np.array_equal(job(), x * 2 + 1)
            else:
                y = rf.stream_map(_double, x, device=dev, chunk_bytes=2048, host=host, on_error=on_error)
                assert np.array_equal(y, x * 2 + 1)


def _double(x, y):  # with out= and in place: a temporary (x * 2) would refuse a graph's capture
    np.multiply(x, 2, out=y)
    y += 1


@pytest.mark.parametrize("seed", range(6))
def test_stream_map_and_mapjob_from_four_threads(seed):
    """Warm engines move between threads (the warm cache hands a pipeline parked by one thread to
    the next call of any thread): no spurious HazardError, every result right, nothing left."""
    dev = rf.device("sim", seed=seed, chaos=True)
    seen: list = []
    try:
        # one thread after another first, so that a hand-over happens whatever the scheduler does:
        # workers 0 and 6 make the same first call (same key), so the second takes the first's engine
        for k in (0, 6):
            run_all([lambda k=k: _whole_array_worker(dev, k, 1, seen)])
        assert len({engine for engine, _ in seen}) == 1 and [k for _, k in seen] == [0, 6], seen
        run_all([lambda k=k: _whole_array_worker(dev, k, 8, seen) for k in range(4)])
    finally:
        rf.drop_warm_pipelines(dev)
    assert dev.live().total == 0


# -- arrays handed between the caller's threads ---------------------------------------------------------------
HAND_OFF_OPS = ("make", "submit", "map", "stream_map", "stream_map_out", "job", "drop")


def _double_plus_one(x, y):
    y[...] = x * 2 + 1


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 16),
       ops=st.lists(st.tuples(st.sampled_from(HAND_OFF_OPS), st.integers(0, 2 ** 16)), min_size=1, max_size=14))
def test_pool_arrays_and_results_handed_between_threads_stay_ordered(seed, ops):
    """Every step runs on a thread of its own, and arrays pass between them by joins, which the
    checker cannot see: pool arrays made on one thread and sent in (``submit``, ``map``,
    ``stream_map`` as ``x`` or ``out``, ``MapJob``) on another, results sent in again from a
    third, arrays dropped on a fourth. No step may raise a HazardError, every result is right,
    and nothing is left after close."""
    dev = rf.device("sim", seed=seed, chaos=True)
    rng = np.random.default_rng(seed)
    live: list = []  # (array, its expected contents)
    with rf.Pipeline(_double_plus_one, device=dev, chunk_bytes=1024) as pipe:
        for op, k in ops:
            if op == "make" or not live:
                n = int(rng.integers(1, 200))
                want = rng.standard_normal(n).astype(np.float32)

                def make(want=want):
                    a = rf.host.empty(want.shape, want.dtype, device=dev)
                    a[...] = want
                    return a

                live.append((bounded(make), want))
                continue
            a, want = live[k % len(live)]
            if op == "drop":
                box = [live.pop(k % len(live))]
                bounded(lambda: box.clear())  # the last reference goes on another thread
                continue
            if op == "submit":
                got = bounded(lambda: pipe.submit(a).result())
            elif op == "map":
                got = bounded(lambda: next(iter(pipe.map([a]))))
            elif op == "stream_map":
                got = bounded(lambda: rf.stream_map(_double_plus_one, a, device=dev, chunk_bytes=256))
            elif op == "stream_map_out":
                out = bounded(lambda: rf.host.empty(a.shape, a.dtype, device=dev))
                got = bounded(lambda: rf.stream_map(_double_plus_one, a, out, device=dev, chunk_bytes=256))
                assert got is out
            else:  # made, called and closed on three threads
                j = bounded(lambda: rf.MapJob(_double_plus_one, a, device=dev, chunk_bytes=256))
                got = bounded(lambda: j().copy())
                bounded(j.close)
            np.testing.assert_array_equal(got, want * np.float32(2) + np.float32(1))
            live.append((got, want * np.float32(2) + np.float32(1)))
    live.clear()
    rf.drop_warm_pipelines(dev)
    assert dev.live().total == 0


# -- determinism ---------------------------------------------------------------------------------------------
def _timeline_of_one_submitter(seed: int):
    h = Harness(seed=seed, chaos=True, checked=True, slots=2, max_in_flight=4, workers=2, chunk_bytes=512)
    ops = Timeline(h.dev)
    items = [h.item(i + 1, n, consume_cost=(3e-5 if i % 3 == 0 else 0.0)) for i, n in enumerate(sizes(seed, 30))]
    futs = [h.pipe.submit(it) for it in items]
    for k, fut in enumerate(futs):
        if k % 7 == 3:
            fut.cancel()
    ends = []
    for fut, it in zip(futs, items):
        kind, value = future_outcome(_settled(fut)) if not fut.cancelled() else ("cancelled", None)
        ends.append((fut.index, kind, h.dev.now))
    h.close()
    return ends, ops.rows(), h.dev.now


@pytest.mark.parametrize("seed", [20, 21])
def test_one_submitter_gives_the_same_timeline_every_run(seed):
    first = _timeline_of_one_submitter(seed)
    second = _timeline_of_one_submitter(seed)
    assert first[0] == second[0]
    assert first[1] == second[1]
    assert first[2] == second[2]
    assert len(first[1]) > 60  # the timeline holds the run's copies and kernels


# -- a state machine with threads ---------------------------------------------------------------------------
SM_SIZES = st.integers(0, 32)  # int64 elements: 256-byte slots
SM_BATCHES = st.lists(st.lists(SM_SIZES, min_size=1, max_size=6), min_size=1, max_size=4)


class ThreadedPipelineMachine(RuleBasedStateMachine):
    """Rules start threads that act on one pipeline while earlier ones still run: submitters (some
    of their items failing), an item raising KeyboardInterrupt in prepare, compute or consume,
    per-future cancels, a canceller, a closer. Each submitter waits for its own futures and checks
    them (its payloads, its errors). After every step the harness's invariants hold under the
    pipeline's lock; at the end every future has ended and nothing is left on the device."""

    @initialize(seed=st.integers(0, 2 ** 16), slots=st.integers(1, 3), on_error=st.sampled_from(["raise", "continue"]),
                max_in_flight=st.one_of(st.none(), st.integers(1, 6)), workers=st.integers(1, 3),
                ordered=st.booleans(), first=SM_BATCHES, interrupt=st.sampled_from((None,) + INTERRUPTS))
    def setup(self, seed, slots, on_error, max_in_flight, workers, ordered, first, interrupt):
        self.h = Harness(seed=seed, chaos=True, checked=True, slots=slots, on_error=on_error, chunk_bytes=256,
                         max_in_flight=max_in_flight, workers=workers, ordered=ordered)
        self.on_error = on_error
        self.tag = 0
        self.lock = threading.Lock()
        self.futs: dict = {}  # chunk index -> (future, item), filled by the submitter threads
        self.threads: list = []
        self.cancelled = self.closing = False
        self.user_cancelled: set = set()
        self.start_submitters(first)  # work from the first step on, an interrupt among it mostly
        if interrupt is not None:
            self.interrupt_next_item(interrupt, 1 + seed % 32)

    # -- helpers, some run on the threads ----------------------------------------------------------
    def new_item(self, n, fault=None):
        self.tag += 1
        return self.h.item(self.tag, n, fault)

    def stopped_by_error(self) -> bool:
        return self.on_error == "raise" and self.h.sched.first_error is not None

    def check_outcome(self, index, item, kind, value):
        if kind == "value":
            check_result(value, item, index)
        elif kind == "error":
            check_chunk_error(value, item, index)
        else:
            assert self.cancelled or self.stopped_by_error() or index in self.user_cancelled, \
                f"chunk {index} cancelled for no reason"

    def _submitter(self, items):
        mine = []
        for it in items:
            try:
                fut = self.h.pipe.submit(it)
            except RuntimeError as exc:
                assert "closed" in str(exc) or "no longer accepts work" in str(exc), exc
                assert self.closing or self.cancelled or self.stopped_by_error(), f"refused for no reason: {exc}"
                break
            with self.lock:
                self.futs[fut.index] = (fut, it)
            mine.append((fut, it))
        for fut, it in mine:
            try:
                fut.result()
            except (StageError, KeyboardInterrupt, concurrent.futures.CancelledError):
                pass
            self.check_outcome(fut.index, it, *future_outcome(fut))
        return len(mine)

    def _spawn(self, fn, *args):
        if len(self.threads) >= 8:
            self.join_threads()
        self.threads.append(start(fn, *args, name="test-sm"))

    # -- rules -------------------------------------------------------------------------------------
    @rule(batches=SM_BATCHES)
    def start_submitters(self, batches):
        for batch in batches:
            self._spawn(self._submitter, [self.new_item(n) for n in batch])

    @rule(sizes=st.lists(SM_SIZES, min_size=1, max_size=4), fault=st.sampled_from(FAULTS + REENTRIES),
          roll=st.integers(0, 2))
    def submit_faulty(self, sizes, fault, roll):
        """A submitter whose items fail in prepare, compute or consume (or overflow a slot, or make
        f write the wrong shape); a third of the time, as for interrupts."""
        if roll == 1:
            self._spawn(self._submitter, [self.new_item(max(n, 1), fault) for n in sizes])

    @rule(stage=st.sampled_from(INTERRUPTS), n=st.integers(1, 32))
    def interrupt_next_item(self, stage, n):
        """The next item raises KeyboardInterrupt in prepare, compute or consume: its future
        raises that very interrupt, the pipeline goes on (or, with on_error="raise", cancels the
        rest)."""
        self._spawn(self._submitter, [self.new_item(n, stage)])

    @rule(k=st.integers(0, 1 << 16))
    def cancel_a_future(self, k):
        # which futures are pending depends on the threads' timing: pick among them without
        # making what hypothesis draws depend on it (that would make its replays inconsistent)
        with self.lock:
            pending = sorted(i for i, (f, _) in self.futs.items() if not f.done())
        if not pending:
            return
        index = pending[k % len(pending)]
        fut = self.futs[index][0]
        self.user_cancelled.add(index)  # before the cancel: a submitter may see it at once
        self._spawn(fut.cancel)

    @rule(roll=st.integers(0, 3))
    def canceller(self, roll):
        if roll == 1:
            self.cancelled = True
            self._spawn(self.h.pipe.cancel)

    @rule(roll=st.integers(0, 3))
    def closer(self, roll):
        if roll == 1:
            self.closing = True
            self._spawn(self.h.pipe.close)

    @rule()
    def join_threads(self):
        threads, self.threads = self.threads, []
        join(threads)

    # -- invariants --------------------------------------------------------------------------------
    @invariant()
    def harness_invariants(self):
        if not hasattr(self, "h") or self.h.final is not None:
            return
        self.h.check()
        with self.h.pipe._driver.cv:
            failed = {c.index for c in list(self.h.chunks.values()) if c.error is not None and
                      (c.state is ChunkState.FAILED or c.ending is ChunkState.FAILED)}
            reported = [e.index for e in self.h.pipe.failures]
        assert len(reported) == len(set(reported)), "a failure was reported twice"
        assert set(reported) == failed, (reported, failed)

    def teardown(self):
        if not hasattr(self, "h"):
            return
        self.join_threads()
        bounded(self.h.pipe.close)
        stats = self.h.pipe.stats()
        for name, n in (("accepted", stats.accepted), ("delivered", stats.delivered), ("failed", stats.failed),
                        ("cancelled", stats.cancelled)):
            event(f"{name}: {'0' if n == 0 else '1-9' if n < 10 else '10+'}")
        interrupted = sum(isinstance(value, KeyboardInterrupt) for fut, _ in self.futs.values()
                          for kind, value in [future_outcome(fut)])
        event(f"futures raising KeyboardInterrupt: {min(interrupted, 2)}")
        for index, (fut, item) in self.futs.items():
            assert fut.done(), f"chunk {index} pending after close"
            self.check_outcome(index, item, *future_outcome(fut))
        self.futs = {}
        self.h.close()


ThreadedPipelineMachine.TestCase.settings = machine_settings(25, 15, derandomize=True)
test_threaded_pipeline_state_machine = ThreadedPipelineMachine.TestCase


@pytest.mark.parametrize("seed", [20, 21, 22])
def test_plain_arrays_staged_by_many_threads_with_cancels_and_a_close(seed):
    """The default path for plain arrays (each copied into pinned memory by the submitting thread,
    its result back in that block), from six threads at once, with futures cancelled from
    another thread and the pipeline closed under them: every future ends, every delivered result
    is right, the counts balance, and every pinned block goes back to the pool."""
    import gc

    dev = rf.device("sim", chaos=True, seed=seed, checked=True)
    pipe = rf.Pipeline(f_affine, device=dev, chunk_bytes=4096, max_in_flight=6, checked=True)
    futs: list = []
    lock = threading.Lock()
    go = threading.Barrier(7)

    def submitter(k):
        mine = np.random.default_rng(seed * 100 + k)  # a Generator is not for sharing between threads
        go.wait(JOIN_S)
        for i in range(40):
            a = np.full(int(mine.integers(1, 400)), 1000 * k + i, np.int64)
            if i % 5 == 0:  # some items are pool arrays, read in place
                p = rf.host.empty(a.shape, a.dtype, device=dev)
                p[:] = a
                a = p
            try:
                fut = pipe.submit(a)
            except RuntimeError:
                return  # closed under it: as documented
            with lock:
                futs.append((fut, int(a[0]), a.shape))

    def canceller():
        mine = np.random.default_rng(seed)
        go.wait(JOIN_S)
        for _ in range(60):
            with lock:
                pick = futs[int(mine.integers(len(futs)))][0] if futs else None
            if pick is not None:
                pick.cancel()

    threads = [start(submitter, k) for k in range(6)] + [start(canceller)]
    join(threads)
    bounded(pipe.close)
    kinds = collections.Counter()
    value = None
    for fut, tag, shape in futs:
        if fut.cancelled():
            kinds["cancelled"] += 1
            continue
        value = fut.result(timeout=0)  # the future's own result(): this thread is ordered after the chunk
        kinds["value"] += 1
        assert value.shape == shape and (value == tag * 3 + 1).all(), (fut.index, tag)
    s = pipe.stats()
    assert s.in_flight == 0 and s.accepted == len(futs) == s.delivered + s.cancelled + s.failed
    assert kinds["value"] == s.delivered and kinds["cancelled"] == s.cancelled and s.failed == 0
    futs.clear()
    value = fut = None  # the last future holds its result
    gc.collect()
    assert rf.host.stats(device=dev).in_use_bytes == 0 and dev.live().total == 0


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_one_mapjob_called_from_four_threads_and_closed_from_a_fifth(seed, graph):
    """Calls of one job from several threads run one after another (they share its slots and
    ``out``); a close from another thread waits for the call in progress and the calls after it
    are refused. Each caller calls until it is refused (a few calls each could all end before
    the closer runs)."""
    dev = rf.device("sim", seed=seed, chaos=True)
    x = np.random.default_rng(seed).uniform(size=1 << 14).astype(np.float32)
    expected = x * 2 + 1
    job = rf.MapJob(_double, x, device=dev, chunk_bytes=4096, host="register", graph=graph, checked=True)
    done = threading.Semaphore(0)
    refused = []

    def caller():
        for _ in range(10_000):
            try:
                y = job()
            except RuntimeError as exc:
                assert "closed" in str(exc)
                refused.append(1)
                return
            assert np.array_equal(y, expected)  # every call writes the same values into out
            done.release()

    def closer():
        for _ in range(6):
            done.acquire()
        job.close()

    run_all([caller] * 4 + [closer])
    assert job.closed and len(refused) == 4
    assert dev.live().total == 0


def test_a_compute_that_closes_its_own_job_closes_it_when_the_call_ends():
    dev = rf.device("sim", seed=1, chaos=True)
    x = np.random.default_rng(1).uniform(size=1 << 14).astype(np.float32)
    calls, jobs = [], []

    def f(x, y):
        calls.append(1)
        if len(calls) == 3:
            jobs[0].close()  # nothing the call still uses may go before it ends
        y[...] = x * 2 + 1

    jobs.append(rf.MapJob(f, x, device=dev, chunk_bytes=4096, host="register"))
    assert np.array_equal(bounded(jobs[0]), x * 2 + 1)
    assert jobs[0].closed
    with pytest.raises(RuntimeError, match="closed"):
        jobs[0]()
    assert dev.live().total == 0
