"""Items sharing a chunk (``coalesce=True``, the default for ``submit`` of plain arrays): items
submitted while the pipeline is busy are copied into one pinned chunk and go through the
scheduler as one (one set of slots, events and stage changes, one copy in), each computed by a
launch of its own on its part of the slots, and copied back, with one copy a chunk, over its
input in the chunk's pinned block, whose bytes are then its result.
Every test checks results bit for bit; the hazard checker runs in checked mode."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import threading

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import ringflow as rf
from ringflow._device import host_pool
from ringflow._pipeline.chunk import NO_ROOM
from ringflow._pipeline.states import ChunkState
from tests.helpers.gpu_like import launch_raises_as_on_a_gpu
from tests.helpers.interrupts import InterruptAt
from tests.helpers.sim import hold_copy
from tests.helpers.stateful import machine_settings

FAIL = np.float32(-7777.0)  # an item whose first element is this makes the compute raise
INTERRUPT = np.float32(-8888.0)  # ... or raise KeyboardInterrupt


def f(x, y):
    if x.size and x.reshape(-1)[0] == FAIL:
        raise ValueError("marked item")
    if x.size and x.reshape(-1)[0] == INTERRUPT:
        raise KeyboardInterrupt
    y[...] = x * 2 + 1


def f_pointwise(x, y):
    """``f`` made pointwise: a marked element anywhere in what it is given raises (in a span
    launch, for every item of the span)."""
    if np.any(x == FAIL):
        raise ValueError("marked item")
    if np.any(x == INTERRUPT):
        raise KeyboardInterrupt
    y[...] = x * 2 + 1


f_pointwise.pointwise = True


def expected(a: np.ndarray) -> np.ndarray:
    return a * np.float32(2) + np.float32(1)


def items(n: int, seed: int = 0, max_elems: int = 40_000) -> list:
    rng = np.random.default_rng(seed)
    return [rng.random(int(k)).astype(np.float32) for k in rng.integers(1, max_elems, n)]


def test_items_submitted_while_busy_share_chunks_and_each_gets_its_own_result():
    xs = items(200)
    with rf.Pipeline(f, device=rf.device("sim", seed=1), chunk_bytes=1 << 20, checked=True) as pipe:
        futs = [pipe.submit(x) for x in xs]
        results = [fu.result() for fu in futs]
        stats = pipe.stats()
    assert all(np.array_equal(r, expected(x)) and r.shape == x.shape for r, x in zip(results, xs))
    assert pipe.scheduler.chunks_admitted < len(xs) // 4  # shared: far fewer chunks than items
    # each result its own bytes of a few pinned slabs, written back over its chunk's inputs
    spans = sorted((id(w.buffer), w.offset, w.offset + w.nbytes) for w in map(host_pool.slice_behind, results))
    assert all(a[0] != b[0] or a[2] <= b[1] for a, b in zip(spans, spans[1:]))
    assert len({span[0] for span in spans}) <= pipe.scheduler.chunks_admitted // 4 + 1
    assert (stats.accepted, stats.delivered, stats.in_flight) == (200, 200, 0)


@pytest.mark.parametrize("seed", range(3))
def test_items_staged_by_native_copy_threads_arrive_whole(monkeypatch, seed):
    """Staging split over native copy threads (as on a many-core host: here forced to three at
    any size above 12 KiB), with sizes whose three parts do not divide them (192 m + 1 bytes: a
    third of them a multiple of 64, one byte over): every byte of every item arrives, on a
    checked, chaotic simulated GPU."""
    from ringflow._device import native_copy, protocol

    if native_copy.copier() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setattr(protocol, "NATIVE_MAX_THREADS", 3)
    monkeypatch.setattr(protocol, "NATIVE_SPLIT_BYTES", 4096)
    rng = np.random.default_rng(seed)
    xs = [rng.integers(0, 256, 192 * int(m) + 1, dtype=np.uint8) for m in rng.integers(64, 5000, 120)]
    with rf.Pipeline(f, device=rf.device("sim", seed=seed, chaos=True), chunk_bytes=1 << 20, checked=True) as pipe:
        results = [fu.result() for fu in [pipe.submit(x) for x in xs]]
    assert all(np.array_equal(r, x * 2 + 1) for r, x in zip(results, xs))  # uint8: wraps alike


def test_coalesce_false_gives_each_item_a_chunk_of_its_own():
    xs = items(20)
    with rf.Pipeline(f, device=rf.device("sim"), chunk_bytes=1 << 20, coalesce=False) as pipe:
        results = [fu.result() for fu in [pipe.submit(x) for x in xs]]
    assert all(np.array_equal(r, expected(x)) for r, x in zip(results, xs))
    assert pipe.scheduler.chunks_admitted == len(xs)


@pytest.mark.parametrize("how", ["submit", "map"])
@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("room", [True, False])
def test_a_plain_array_may_be_changed_once_submit_returns_whatever_its_size_or_the_pool(monkeypatch, how, native,
                                                                                        room):
    """The accepting thread copies every plain array before ``submit`` returns (or ``map`` pulls
    the next item), so the caller may overwrite it at once: one over 4 MiB in a chunk of its own
    (it once went to a CPU worker, which copied it later), with native copy threads or without,
    and, where the pool has no room, into ordinary memory that a worker then copies into a
    slot."""
    from ringflow._device import native_copy

    if native and native_copy.copier() is None:
        pytest.skip("no C compiler here")
    if not native:
        monkeypatch.setattr(native_copy, "_loaded", False)  # as where no compiler works
    dev = rf.device("sim", seed=4)
    if not room:
        rf.host.set_budget(1, device=dev)
    rng = np.random.default_rng(4)
    xs = [rng.random((5 << 20) // 4).astype(np.float32) for _ in range(2)] + items(3, seed=4)
    xs.append((rng.random(1000).astype(np.float32), np.arange(7)))  # a tuple of arrays too
    originals = [tuple(a.copy() for a in x) if isinstance(x, tuple) else x.copy() for x in xs]

    def overwritten_after_use():  # each item overwritten as soon as the next is asked for
        for x in xs:
            yield x
            for a in (x if isinstance(x, tuple) else (x,)):
                a[...] = -1

    def double_leaves(x, y):
        if isinstance(x, tuple):
            for a, b in zip(x, y):
                b[...] = a * 2 + 1
        else:
            f(x, y)

    with rf.Pipeline(double_leaves, device=dev, chunk_bytes=16 << 20, checked=True) as pipe:
        if how == "submit":
            futs = []
            for x in overwritten_after_use():
                futs.append(pipe.submit(x))
            results = [fu.result() for fu in futs]
        else:
            results = list(pipe.map(overwritten_after_use()))
        chunks = pipe.scheduler.chunks_admitted
    for r, x in zip(results, originals, strict=True):
        for got, want in zip(r if isinstance(x, tuple) else (r,), x if isinstance(x, tuple) else (x,)):
            assert np.array_equal(got, expected(want)) and got.shape == want.shape
    if room:
        assert chunks == 4  # each large item alone, the small ones sharing a chunk, the tuple alone


def test_a_pool_array_over_4_mib_given_to_submit_is_read_in_place_not_copied_into_a_shared_chunk():
    """A pool array of up to 4 MiB shares a chunk (its copy costs less than a chunk of its own);
    a larger one is read in place, in a chunk of its own, whatever the accepting thread would
    stage of a plain array of its size."""
    dev = rf.device("sim", seed=6)
    big = rf.host.empty(((6 << 20) // 4,), np.float32, device=dev)
    big[...] = np.random.default_rng(6).random(big.size)
    small = rf.host.empty((1000,), np.float32, device=dev)
    small[...] = 1.5
    xs = [big, *items(2, seed=6), small]
    with rf.Pipeline(f, device=dev, chunk_bytes=16 << 20, checked=True) as pipe:
        results = [fu.result() for fu in [pipe.submit(x) for x in xs]]
        chunks = pipe.scheduler.chunks_admitted
    assert all(np.array_equal(r, expected(x)) for r, x in zip(results, xs))
    assert chunks == 2  # the large pool array alone; the plain arrays and the small pool array share


@pytest.mark.parametrize("how", ["submit", "submit_if_room"])
def test_a_small_pool_array_given_to_submit_is_copied_where_the_pool_has_no_room_for_shared_chunks(how):
    """A pool array of up to 4 MiB given to ``submit`` is copied before ``submit`` returns (into
    a shared chunk), so the caller may change it at once. Where the pool has no room for a slab of
    shared chunks the item goes alone, and it was then read in place: a change made once
    ``submit`` returned, before the chunk's h2d, reached the item's result. It is copied there too.
    The driver's lock is held across the submit and the change, so no h2d runs between them."""
    dev = rf.device("sim", seed=9)
    rf.host.set_budget(1 << 20, device=dev)  # room for the item, its copy and its result; none for a 4 MiB slab
    x = rf.host.empty((1000,), np.float32, device=dev)
    x[...] = np.random.default_rng(9).random(1000)
    want = expected(x)
    with rf.Pipeline(f, device=dev, chunk_bytes=1 << 20, checked=True) as pipe:
        pipe.submit(np.zeros(4, np.float32)).result()  # warm: no chunk is open

        def submit_then_change():
            fut = pipe.submit(x) if how == "submit" else pipe._submit_if_room(x)
            x[...] = -1  # the caller may reuse its array once submit returned
            return fut

        came_back, fx = _run_while_the_driver_s_lock_is_held(pipe, submit_then_change)
        assert came_back, "submit waited for the driver's lock though the pipeline had room"
        assert np.array_equal(fx.result(timeout=60), want)
    assert rf.host.stats(device=dev).in_use_bytes < 4 << 20  # no slab was taken: the item went alone


@pytest.mark.parametrize("how", ["asubmit", "amap"])
@pytest.mark.parametrize("room", [True, False])
def test_a_small_pool_array_given_to_asubmit_is_copied_as_submit_copies_it(room, how):
    """``asubmit`` (and ``amap``, through it) accepts a pool array of up to 4 MiB as ``submit``
    does: copied before it is accepted (into a shared chunk, or into a chunk of its own where the
    pool has no room for a slab of shared chunks), so a change made to it once it was accepted
    does not reach its result. It was read in place: such a change, made before the chunk's h2d,
    came back in the result. The item is accepted in the task's first step, on the loop's thread,
    while another thread keeps the driver's lock, so no h2d runs before the change."""
    dev = rf.device("sim", seed=9)
    if not room:
        rf.host.set_budget(1 << 20, device=dev)  # room for the item, its copy and its result; none for a 4 MiB slab
    x = rf.host.empty((1000,), np.float32, device=dev)
    x[...] = np.random.default_rng(9).random(1000)
    want = expected(x)
    changed = threading.Event()
    with rf.Pipeline(f, device=dev, chunk_bytes=1 << 20, checked=True) as pipe:
        pipe.submit(np.zeros(4, np.float32)).result()  # warm: no chunk is open

        async def start_then_change():
            before = pipe.scheduler.inbox_news
            if how == "asubmit":
                task = asyncio.ensure_future(pipe.asubmit(x))
            else:
                results = pipe.amap([x])
                task = asyncio.ensure_future(results.__anext__())
            await asyncio.sleep(0)  # the task's first step: the item accepted (the pipeline has room)
            assert pipe.scheduler.inbox_news > before and not task.done()
            x[...] = -1  # changed once accepted, before its chunk's h2d (the driver's lock is kept)
            changed.set()
            got = await task
            if how == "amap":
                await results.aclose()
            return got

        came_back, got = _run_while_the_driver_s_lock_is_held(pipe, lambda: asyncio.run(start_then_change()),
                                                              reached=changed.is_set)
        assert came_back, f"{how} waited for the driver's lock though the pipeline had room"
        assert np.array_equal(got, want)
    if not room:
        assert rf.host.stats(device=dev).in_use_bytes < 4 << 20  # no slab was taken: the item went alone


def test_shapes_dtypes_and_odd_strides_keep_their_own_layout():
    rng = np.random.default_rng(3)
    xs = [rng.random((3, 5)).astype(np.float32), rng.random(7).astype(np.float64),
          rng.random((4, 6)).astype(np.float32)[:, ::2], np.arange(11, dtype=np.int32)]
    with rf.Pipeline(f, device=rf.device("sim"), chunk_bytes=1 << 16, checked=True) as pipe:
        results = [fu.result() for fu in [pipe.submit(x) for x in xs]]
    assert pipe.scheduler.chunks_admitted == 1
    for r, x in zip(results, xs):
        assert r.shape == x.shape and r.dtype == x.dtype
        assert np.array_equal(r, x * x.dtype.type(2) + x.dtype.type(1))


def test_a_compute_that_fails_for_one_item_fails_that_item_alone():
    xs = items(30, seed=4)
    xs[7][0] = FAIL
    with rf.Pipeline(f, device=rf.device("sim"), chunk_bytes=1 << 20, on_error="continue") as pipe:
        futs = [pipe.submit(x) for x in xs]
        outcomes = [fu.exception() for fu in futs]
        stats = pipe.stats()
    assert isinstance(outcomes[7], rf.StageError) and "marked item" in str(outcomes[7].__cause__)
    assert all(e is None for i, e in enumerate(outcomes) if i != 7)
    assert all(np.array_equal(futs[i].result(), expected(x)) for i, x in enumerate(xs) if i != 7)
    assert (stats.delivered, stats.failed, stats.in_flight) == (29, 1, 0)


def test_with_on_error_raise_a_failing_item_cancels_the_rest_and_every_future_settles():
    xs = items(30, seed=5)
    xs[3][0] = FAIL
    with rf.Pipeline(f, device=rf.device("sim"), chunk_bytes=1 << 20) as pipe:
        futs = [pipe.submit(x) for x in xs]
        done, not_done = concurrent.futures.wait(futs, timeout=60)
        stats = pipe.stats()
    assert not not_done
    assert isinstance(futs[3].exception(), rf.StageError)
    for i, fu in enumerate(futs):
        assert fu.done()
        if not fu.cancelled() and fu.exception() is None:
            assert np.array_equal(fu.result(), expected(xs[i]))
    assert stats.accepted == stats.delivered + stats.failed + stats.cancelled and stats.in_flight == 0


@pytest.mark.parametrize("compute", ["f", "f_pointwise"])
def test_cancelling_one_item_of_a_shared_chunk_leaves_the_others(compute):
    """Also with a pointwise compute, whose one launch covers the cancelled items' bytes."""
    xs = items(40, seed=6)
    with rf.Pipeline(globals()[compute], device=rf.device("sim"), chunk_bytes=1 << 20, checked=True) as pipe:
        futs = [pipe.submit(x) for x in xs]
        assert futs[5].cancel() and futs[6].cancel()
        results = {i: fu.result() for i, fu in enumerate(futs) if i not in (5, 6)}
        stats = pipe.stats()
    assert futs[5].cancelled() and futs[6].cancelled()
    assert all(np.array_equal(r, expected(xs[i])) for i, r in results.items())
    assert (stats.delivered, stats.cancelled, stats.in_flight) == (38, 2, 0)


def f_first_marked_pointwise(x, y):
    """``f`` (which raises where the first element it is given is marked) with a pointwise promise:
    a launch over several items runs, while checked mode's run over a marked item alone raises."""
    f(x, y)


f_first_marked_pointwise.pointwise = True


@pytest.mark.parametrize("compute", [f, f_first_marked_pointwise])
def test_an_item_cancelled_after_its_compute_was_launched_does_not_fail_or_stop_the_others(compute):
    """An item of a shared chunk cancelled by its caller once the chunk's compute is enqueued,
    whose compute then raises (its own launch, or checked mode's run of it alone): it ends
    CANCELLED, as a chunk of its own does; its error is no failure, so with on_error="raise"
    its neighbours still get their results and the pipeline still takes work."""
    xs = [np.arange(100, dtype=np.float32) + 1000 * i for i in range(4)]
    xs[2][0] = FAIL
    with rf.Pipeline(compute, device=rf.device("sim", seed=3), chunk_bytes=1 << 16,
                     checked=True) as pipe:
        futs = [pipe.submit(x) for x in xs]
        s = pipe.scheduler
        while not any(c.state is ChunkState.ON_DEVICE for c in s.chunks.values()):
            pipe._step()
        (chunk,) = s.chunks.values()
        assert len(chunk.members) == 4  # one shared chunk, its compute enqueued
        assert futs[2].cancel() and futs[2].cancelled()
        results = {i: futs[i].result() for i in (0, 1, 3)}
        assert pipe.failures == []
        again = pipe.submit(xs[0]).result()
        stats = pipe.stats()
    assert all(np.array_equal(r, expected(xs[i])) for i, r in results.items())
    assert np.array_equal(again, expected(xs[0]))
    assert (stats.delivered, stats.failed, stats.cancelled, stats.in_flight) == (4, 0, 1, 0)


def test_an_item_whose_compute_failed_is_no_longer_cancelled_while_its_chunk_goes_on(monkeypatch):
    """An item of a shared chunk whose compute raised as it was launched (as on a GPU) has failed:
    its caller's cancel, while the chunk still runs for the others, returns False and its future
    raises its error; it is counted failed once, and the pipeline's failures and counts agree.
    (Cancelled, it would count as cancelled while ``failures`` listed its error.)"""
    xs = [np.arange(100, dtype=np.float32) + 1000 * i for i in range(4)]
    launch_raises_as_on_a_gpu(monkeypatch, ValueError("item 2's compute"), at=3)  # item i is launch i + 1
    with rf.Pipeline(f, device=rf.device("sim", seed=3), chunk_bytes=1 << 16, on_error="continue") as pipe:
        futs = [pipe.submit(x) for x in xs]
        s = pipe.scheduler
        while not any(c.state is ChunkState.ON_DEVICE for c in s.chunks.values()):
            pipe._step()
        (chunk,) = s.chunks.values()
        assert [m.error is not None for m in chunk.members] == [False, False, True, False]
        assert not futs[2].cancel() and not futs[2].cancelled()
        assert futs[1].cancel()  # an item that has not failed still can be
        err = futs[2].exception()
        results = {i: futs[i].result() for i in (0, 3)}
        stats = pipe.stats()
        failures = list(pipe.failures)
    assert isinstance(err, rf.StageError) and err.index == 2 and "item 2's compute" in str(err.__cause__)
    assert failures == [err]
    assert all(np.array_equal(r, expected(xs[i])) for i, r in results.items())
    assert (stats.delivered, stats.failed, stats.cancelled, stats.in_flight) == (2, 1, 1, 0)


def test_a_chunk_waits_for_every_copy_into_it_before_it_moves():
    """Two items share a chunk; the first one's copy is held. The chunk must not go to the device
    until that copy is made (without the wait, its h2d reads half-written bytes)."""
    dev = rf.device("sim", seed=2)
    a, b = np.full(1000, 3, np.float32), np.full(1000, 5, np.float32)
    started, release = hold_copy(dev, a)
    with rf.Pipeline(f, device=dev, chunk_bytes=1 << 16) as pipe:
        pipe.submit(np.zeros(4, np.float32)).result()  # warm: the next chunk is a new one
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("a", pipe.submit(a)))
        t.start()
        assert started.wait(30)
        fb = pipe.submit(b)  # joins the chunk a's copy is being made into
        sched, driver = pipe.scheduler, pipe._driver
        (shared,) = sched.inbox
        steps = sched.steps
        with driver.cv:  # twenty steps of the scheduler on this thread: the chunk must stay put
            driver.drive_here(lambda: sched.steps >= steps + 20, None, "twenty steps")
        assert list(sched.inbox) == [shared] and not fb.done()
        release.set()
        t.join(30)
        assert np.array_equal(out["a"].result(), expected(a)) and np.array_equal(fb.result(), expected(b))
        assert pipe.scheduler.chunks_admitted == 2  # the warm-up's and the one a and b share


def _run_while_the_driver_s_lock_is_held(pipe, call, reached=None) -> tuple:
    """Run ``call`` on a thread of its own while another thread keeps ``pipe``'s driver's lock (as
    a long scheduler step does), then let the lock go. Returns whether ``reached()`` (default:
    ``call`` returned) held before the lock was let go, looked at for up to 10 real seconds (a
    call that needs the lock stays short of it for as long as the lock is kept), and what
    ``call`` returned."""
    driver, holding, release = pipe._driver, threading.Event(), threading.Event()

    def hold():
        with driver.cv:
            holding.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(30)
    out: list = []
    caller = threading.Thread(target=lambda: out.append(call()))
    caller.start()
    done = reached or (lambda: not caller.is_alive())
    seen = done()
    for _ in range(1000):
        if seen:
            break
        threading.Event().wait(0.01)
        seen = done()
    release.set()
    holder.join(30)
    caller.join(60)
    assert out, "the call raised (its thread's error is in the captured output)"
    return seen, out[0]


def test_joining_a_shared_chunk_and_ending_its_copy_need_not_wait_for_a_step():
    """The driver's lock is held (as by a long scheduler step) while an item joins the open chunk:
    its submit must come back without that lock (taking it would stall every request behind
    each step of the progress thread)."""
    dev = rf.device("sim", seed=5)
    a, b = np.full(1000, 3, np.float32), np.full(500, 5, np.float32)
    with rf.Pipeline(f, device=dev, chunk_bytes=1 << 16, checked=True) as pipe:
        pipe.submit(np.zeros(4, np.float32)).result()  # warm: the next chunk is a new one
        fa = pipe.submit(a)  # opens a chunk; nobody waits, so the simulated driver leaves it open
        came_back, fb = _run_while_the_driver_s_lock_is_held(pipe, lambda: pipe.submit(b))
        assert came_back, "submit waited for the driver's lock to join an open chunk"
        assert np.array_equal(fa.result(), expected(a)) and np.array_equal(fb.result(), expected(b))
        assert pipe.scheduler.chunks_admitted == 2  # the warm-up's and the one a and b share


@pytest.mark.parametrize("kind", ["opens a shared chunk", "goes alone", "goes alone, no room to stage"])
def test_a_submit_with_room_need_not_wait_for_a_step(kind):
    """The driver's lock is held (as by a long scheduler step) while a submit opens a new shared
    chunk or accepts an item over 4 MiB in a chunk of its own: where the pipeline has room the
    submit must come back without that lock (a request waited for each step of the progress
    thread), and the item's result must be right once the lock is free."""
    dev = rf.device("sim", seed=6)
    if kind.endswith("no room to stage"):
        rf.host.set_budget(1, device=dev)
    n = 1000 if kind.startswith("opens") else (5 << 20) // 4
    x = np.random.default_rng(6).random(n).astype(np.float32)
    want = expected(x)
    with rf.Pipeline(f, device=dev, chunk_bytes=8 << 20, checked=True) as pipe:
        pipe.submit(np.zeros(4, np.float32)).result()  # warm: no chunk is open
        came_back, fx = _run_while_the_driver_s_lock_is_held(pipe, lambda: pipe.submit(x))
        x[...] = -1  # the caller may reuse its array once submit returned
        assert came_back, "submit waited for the driver's lock though the pipeline had room"
        assert np.array_equal(fx.result(timeout=60), want)
        assert pipe.scheduler.chunks_admitted == 2


def test_a_map_accepts_while_a_step_holds_the_driver_s_lock():
    """A map pulls and accepts items over 4 MiB (a chunk each) while the driver's lock is held (as
    by a long step): with room for them all, every one is in the inbox before the map needs the
    lock to wait for a result; its results are right and in order once the lock is free."""
    dev = rf.device("sim", seed=8)
    xs = [np.random.default_rng(k).random((5 << 20) // 4).astype(np.float32) for k in range(3)]
    with rf.Pipeline(f, device=dev, chunk_bytes=8 << 20, max_in_flight=4, checked=True) as pipe:
        pipe.submit(np.zeros(4, np.float32)).result()  # warm
        accepted_all, out = _run_while_the_driver_s_lock_is_held(
            pipe, lambda: list(pipe.map(xs)), reached=lambda: len(pipe.scheduler.inbox) == 3)
        assert accepted_all, "the map waited for the driver's lock to accept an item though it had room"
        assert len(out) == 3 and all(np.array_equal(r, expected(x)) for r, x in zip(out, xs))


@pytest.mark.parametrize("kind", ["opens a shared chunk", "goes alone"])
def test_a_submit_whose_room_another_thread_took_after_its_wait_waits_again(kind):
    """A full pipeline: a submit waits for room under the driver's lock; the moment room comes,
    another thread, accepting without that lock, takes it first (done here inside the wait, as
    another thread's accept would land there). The submit must wait again and be accepted once
    room comes back, not fail with "admission is full"; every result is right."""
    dev = rf.device("sim", seed=9)
    n = 1000 if kind.startswith("opens") else (5 << 20) // 4
    # the first goes alone, so that no shared chunk is open for the second to join
    xs = [np.random.default_rng(k).random(m).astype(np.float32) for k, m in enumerate(((5 << 20) // 4, n, n))]
    with rf.Pipeline(f, device=dev, chunk_bytes=8 << 20, max_in_flight=1, checked=True) as pipe:
        fut0 = pipe.submit(xs[0])  # takes the only place
        wait, taken = pipe._wait_for_capacity, []

        def wait_then_lose_the_room(*args, **kwargs):
            wait(*args, **kwargs)
            if not taken:  # the first time room comes: another accept takes it
                chunk = pipe._sched.accept(driver=pipe._driver, if_room=True, **pipe._accepting(xs[2]))
                assert chunk is not NO_ROOM
                taken.append(chunk.future)
                pipe._driver.wake.set()

        pipe._wait_for_capacity = wait_then_lose_the_room
        fut1 = pipe.submit(xs[1])  # raised "admission is full" when the room it waited for was gone
        assert taken, "the submit never waited for room"
        for fut, x in ((fut0, xs[0]), (fut1, xs[1]), (taken[0], xs[2])):
            assert np.array_equal(fut.result(timeout=60), expected(x))


@pytest.mark.parametrize("coalesce", [True, False], ids=["shared", "alone"])
def test_openers_on_many_threads_never_take_more_than_max_in_flight_chunks(coalesce):
    """Threads opening shared chunks (or accepting chunks of one item each), neither with the
    driver's lock, while the driver admits and ends chunks: the chunks accepted and unfinished
    never exceed ``max_in_flight`` as an opener registers its chunk (an opener that did not
    wait for capacity, or two that took one place, let more in)."""
    dev = rf.device("sim", seed=12, chaos=True)
    xs = items(240, seed=12, max_elems=3000)
    peak = [0]
    with rf.Pipeline(f, device=dev, chunk_bytes=1 << 14, max_in_flight=3, checked=True, coalesce=coalesce) as pipe:
        s = pipe.scheduler
        name = "open_new_batch" if coalesce else "accept"
        real = getattr(s, name)

        def watched(*args, **kwargs):
            place = real(*args, **kwargs)
            with s.batch_lock:
                # distinct chunks: the driver puts a chunk among the admitted before it takes it
                # out of the inbox, so for a moment it is in both
                unfinished = {id(c) for c in list(s.chunks.values())} | {id(c) for c in list(s.inbox)}
                peak[0] = max(peak[0], len(unfinished) + s.unclaimed)
            return place

        setattr(s, name, watched)
        out: dict = {}

        def submitter(k):
            out[k] = [(pipe.submit(x), x) for x in xs[k::6]]

        threads = [threading.Thread(target=submitter, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        results = [(fu.result(), x) for k in range(6) for fu, x in out[k]]
    assert len(results) == len(xs) and all(np.array_equal(r, expected(x)) for r, x in results)
    assert 0 < peak[0] <= 3


def test_an_interrupt_while_an_item_is_copied_into_a_shared_chunk_accepts_nothing():
    dev = rf.device("sim", seed=3)
    x0 = np.ones(100, np.float32)
    calls = [0]
    real = dev.host_copy

    def second_interrupted(dst, src):
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        real(dst, src)

    dev.host_copy = second_interrupted
    with rf.Pipeline(f, device=dev, chunk_bytes=1 << 16, checked=True) as pipe:
        first = pipe.submit(x0)
        with pytest.raises(KeyboardInterrupt):
            pipe.submit(np.ones(50, np.float32))
        third = pipe.submit(np.full(10, 2, np.float32))
        assert np.array_equal(first.result(), expected(x0))
        assert np.array_equal(third.result(), np.full(10, 5, np.float32))
        stats = pipe.stats()
        assert (stats.accepted, stats.delivered, stats.in_flight) == (2, 2, 0)
        del first, third
    gc.collect()
    assert rf.host.stats(device=dev).in_use_bytes == 0


def test_an_item_taken_back_after_part_of_its_copy_hands_its_slab_on_after_that_write():
    """A copy into a shared chunk writes part of the item, then Ctrl-C: the item (the chunk's
    only one) is taken back on its thread, which then ends. The slab lives on (the space holds
    it) and goes back to the pool later, on another thread; the next taker poisons it, which
    must come after the interrupted write: the take-back leaves that thread's token on the slab
    (without it the checker reports the poisoning write)."""
    dev = rf.device("sim", seed=4, checked=True)
    real = dev.host_copy

    def half_then_interrupted(dst, src):
        real(dst.reshape(-1)[:8], src.reshape(-1)[:8])
        raise KeyboardInterrupt

    pipe = rf.Pipeline(f, device=dev, chunk_bytes=1 << 12, checked=True)
    raised = []

    def submitter():
        dev.host_copy = half_then_interrupted
        try:
            pipe.submit(np.ones(100, np.float32))
        except KeyboardInterrupt:
            raised.append(True)
        finally:
            dev.host_copy = real

    t = threading.Thread(target=submitter)
    t.start()
    t.join(30)
    assert raised and pipe.stats().accepted == 0
    pipe.close()
    gc.collect()
    hits = rf.host.stats(device=dev).hits
    again = rf.host.empty(4 << 12, np.uint8, device=dev)  # the slab, poisoned first
    assert rf.host.stats(device=dev).hits == hits + 1
    again[...] = 0


def test_a_shared_chunk_cancelled_before_admission_hands_its_slab_on_after_the_copies_into_it():
    """Thread T copies an item into a new chunk of the slab that holds a result thread U keeps;
    the pipeline is cancelled before that chunk is admitted, so it ends at admission. U, which saw
    only its own result's chunk end, drops that result last and takes the slab again: the
    pool's poisoning write must come after T's copy. The admission's end leaves the progress
    thread's token on the slab (without it the checker reports the poisoning write)."""
    dev = rf.device("sim", seed=5, checked=True)
    pipe = rf.Pipeline(f, device=dev, chunk_bytes=1 << 12, checked=True)
    kept, second, taken = {}, {}, []
    first_done, closed = threading.Event(), threading.Event()

    def u():
        kept["r"] = pipe.submit(np.full(10, 1, np.float32)).result()
        first_done.set()
        assert closed.wait(30)
        assert np.array_equal(kept.pop("r"), np.full(10, 3, np.float32))  # the last view of the slab goes
        gc.collect()
        taken.append(rf.host.empty(4 << 12, np.uint8, device=dev))  # the slab, poisoned first

    tu = threading.Thread(target=u)
    tu.start()
    assert first_done.wait(30)
    tt = threading.Thread(target=lambda: second.setdefault("f", pipe.submit(np.full(20, 2, np.float32))))
    tt.start()
    tt.join(30)
    pipe.cancel()  # nobody waited, so its chunk is still in the inbox: it ends at admission
    assert second["f"].cancelled()
    pipe.close()
    del second["f"]
    gc.collect()
    closed.set()
    tu.join(30)
    assert len(taken) == 1 and pipe.stats().cancelled == 1


SHARED_SUBMIT = ("submit", "_submit_shared", "join_open_batch", "open_new_batch", "_finds_no_room", "_add_member", "member_written",
                 "_take_back", "reserve", "claimed", "_trim_last", "add_slab", "install")


def _submit_interrupted_at(n, joins: bool) -> tuple:
    """On a checked simulated GPU, an item joins the open chunk (``joins``) or opens a new one,
    with Ctrl-C at its submit's ``n``-th instruction (``n`` a set: at each). Returns how many
    instructions ran, how many interrupts fired, and what went wrong afterwards (None: nothing)."""
    a, b = np.full(1000, 3, np.float32), np.full(500, 5, np.float32)
    pipe = rf.Pipeline(f, device=rf.device("sim", seed=1), chunk_bytes=1 << 16, checked=True)
    pipe.submit(np.zeros(4, np.float32)).result()
    first = pipe.submit(a) if joins else None  # nobody waits, so the simulated driver leaves its chunk open
    with InterruptAt(n, SHARED_SUBMIT) as at:
        try:
            fb = pipe.submit(b)
        except KeyboardInterrupt:
            fb = None
    problems: list = []

    def settle():
        try:
            if first is not None and not np.array_equal(first.result(), expected(a)):
                problems.append("the other item's result is wrong")
            if fb is not None and not np.array_equal(fb.result(), expected(b)):
                problems.append("the item's result is wrong")
            pipe.close()
            stats, returned = pipe.stats(), (first is not None) + (fb is not None) + 1
            # an interrupt after the copy ended: submit raised, but the item is accepted whole
            whole = fb is None and stats.accepted == returned + 1
            if (stats.accepted != returned and not whole) or stats.delivered != stats.accepted or stats.in_flight:
                problems.append(f"counts do not add up: {stats}")
        except BaseException as exc:  # noqa: BLE001 - reported below
            problems.append(repr(exc)[:300])

    t = threading.Thread(target=settle, daemon=True)
    t.start()
    t.join(20)
    if t.is_alive():
        problems.append("the pipeline never settled (an item left half registered)")
    return at.seen, at.fired, problems or None


@pytest.mark.parametrize("joins", [True, False], ids=["joining", "opening"])
def test_ctrl_c_at_any_instruction_of_a_shared_submit_accepts_the_item_whole_or_not_at_all(joins):
    """Ctrl-C may land between any two instructions of a shared submit. Before the item's copy
    ends, submit raises and nothing of the item stays (a half-registered item would be sent
    with bytes never copied, into a result block already back in the pool: the checker sees
    that d2h race the next holder's write); after it, the item is accepted whole. Either way
    the pipeline settles, the other item's result is right and the counts add up."""
    seen, fired, problems = _submit_interrupted_at(10 ** 9, joins)
    assert not fired and problems is None and seen > 20
    for n in range(seen):
        _, fired, problems = _submit_interrupted_at(n, joins)
        assert fired and problems is None, f"Ctrl-C at instruction {n} of {seen}: {problems}"


@pytest.mark.parametrize("joins", [True, False], ids=["joining", "opening"])
def test_ctrl_c_pressed_again_while_a_shared_submit_cleans_up_still_takes_the_item_back(joins):
    """A second Ctrl-C may land anywhere in the clean-up the first one started (taking the item
    back needs the driver's lock, which a step of the progress thread may hold): the clean-up
    starts again and completes, so the item is never left half taken back (its chunk would never
    be admitted and the pipeline never settle). The clean-up takes the item back under the lock
    where it is free this instant, else hands it to the progress thread: which of the two, and so
    how many instructions it runs, depends on that thread, so a run may end before the second
    instruction asked for (every run that reaches it raises the second interrupt)."""
    seen, _, _ = _submit_interrupted_at(10 ** 9, joins)
    second = 0
    for first in range(seen):
        ran, _, _ = _submit_interrupted_at({first, 10 ** 9}, joins)
        for again in range(first + 1, ran):  # each instruction of the clean-up the first started
            reached, fired, problems = _submit_interrupted_at({first, again}, joins)
            assert problems is None, f"Ctrl-C at {first}, again at {again}: {problems}"
            assert fired == 2 or reached <= again, f"Ctrl-C at {first}, again at {again} ({reached} run): {fired} raised"
            second += fired == 2
    assert second > 50  # the clean-ups ran that many instructions in all, each interrupted again


LONE_SUBMIT = ("submit", "_accepting", "_staged_copy", "_read_in_place", "_private_copy", "_output_spec",
               "_accept_staged", "_accept_if_room", "_wait_for_capacity", "accept", "_finds_no_room",
               "_check_accepting", "has_capacity")


def _lone_submit_interrupted_at(n: int, room: bool) -> tuple:
    """On a checked simulated GPU, an item over 4 MiB (a chunk of its own) submitted with Ctrl-C at
    its submit's ``n``-th instruction, the pool with room to stage it (``room``) or none (the
    item copied into ordinary memory). Returns how many instructions ran, how many interrupts
    fired, and what went wrong afterwards (None: nothing)."""
    dev = rf.device("sim", seed=2)
    if not room:
        rf.host.set_budget(1, device=dev)
    x = np.random.default_rng(2).random((5 << 20) // 4).astype(np.float32)
    want = expected(x)
    pipe = rf.Pipeline(f, device=dev, chunk_bytes=8 << 20, checked=True)
    with InterruptAt(n, LONE_SUBMIT) as at:
        try:
            fut = pipe.submit(x)
        except KeyboardInterrupt:
            fut = None
    x[...] = -1  # the caller reuses its array at once, interrupted or not
    problems: list = []
    try:
        if fut is not None and not np.array_equal(fut.result(timeout=60), want):
            problems.append("the item's result is wrong")
        fut = None
        pipe.close()
        stats = pipe.stats()
        if stats.accepted > 1 or stats.delivered != stats.accepted or stats.in_flight:
            problems.append(f"counts do not add up: {stats}")
        gc.collect()
        if rf.host.stats(device=dev).in_use_bytes:
            problems.append(f"pool memory still held: {rf.host.stats(device=dev)}")
    except BaseException as exc:  # noqa: BLE001 - reported below
        problems.append(repr(exc)[:300])
    return at.seen, at.fired, problems or None


@pytest.mark.parametrize("room", [True, False], ids=["staged", "no-room"])
def test_ctrl_c_at_any_instruction_of_a_lone_submit_accepts_the_item_whole_or_not_at_all(room):
    """Ctrl-C between any two instructions of the submit of an item that goes alone (staged into
    a pool array of its own, or copied into ordinary memory where the pool has no room): submit
    raises and nothing is accepted or held, or the item is accepted whole, and its result is
    its bytes as they were when submit was called, though the caller overwrote them at once."""
    seen, fired, problems = _lone_submit_interrupted_at(10 ** 9, room)
    assert not fired and problems is None and seen > 10
    for n in range(seen):
        _, fired, problems = _lone_submit_interrupted_at(n, room)
        assert fired and problems is None, f"Ctrl-C at instruction {n} of {seen}: {problems}"


def test_submitting_threads_share_chunks_with_the_checker_on():
    xs = items(400, seed=7, max_elems=20_000)
    out: dict = {}
    with rf.Pipeline(f, device=rf.device("sim", seed=4), chunk_bytes=1 << 19, checked=True) as pipe:
        def submitter(k):
            for i in range(k, len(xs), 4):
                out[i] = pipe.submit(xs[i])

        threads = [threading.Thread(target=submitter, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results = {i: fu.result() for i, fu in out.items()}
        stats = pipe.stats()
    assert all(np.array_equal(results[i], expected(x)) for i, x in enumerate(xs))
    assert (stats.accepted, stats.delivered, stats.in_flight) == (400, 400, 0)


class CoalescingMachine(RuleBasedStateMachine):
    """Submits (from this thread and from bursts of other threads; plain arrays and pool arrays,
    which share chunks too, made on this thread and sent in from others; results sent in again
    from another thread), maps on another thread beside submits, failing items, cancels, waits
    and a close, on a checked pipeline whose
    items share chunks; after every step the counts add up, and every settled future holds its
    own item's result or error. The simulated GPU checks every host copy into or out of pool
    memory, so a hand-off between threads the pipeline does not order is a HazardError."""

    def __init__(self):
        super().__init__()
        self.dev = rf.device("sim", seed=5)
        self.pipe = rf.Pipeline(f, device=self.dev, chunk_bytes=1 << 15, checked=True,
                                on_error="continue", max_in_flight=6)
        self.sticky = False
        self.futs: list = []  # (future, item, marked to fail, cancelled by us)
        self.mapped = 0  # items accepted by maps (their results checked where the map ran)
        self.closed = False
        self.lock = threading.Lock()

    def _item(self, n, fail, pooled=False):
        x = np.random.default_rng(len(self.futs)).random(n).astype(np.float32)
        if fail:
            x[0] = FAIL if fail == "error" else INTERRUPT
        if pooled and not self.sticky:  # an rf.host array: it shares a chunk like any other of its size
            a = rf.host.empty(n, np.float32, device=self.dev)
            a[:] = x
            return a
        return x

    def _send(self, x, fail=None) -> bool:
        """Submit ``x`` (from any thread) and track its future; False once the device broke."""
        try:
            fut = self.pipe.submit(x)
        except rf.DeviceError:
            assert self.sticky  # the device broke: submit says so
            return False
        with self.lock:
            self.futs.append([fut, x, fail, False])
        return True

    @precondition(lambda self: not self.closed)
    @rule(n=st.integers(1, 2000), fail=st.sampled_from([None, None, "error", "interrupt"]), pooled=st.booleans())
    def submit(self, n, fail, pooled):
        self._send(self._item(n, fail, pooled), fail)

    @precondition(lambda self: not self.closed)
    @rule(sizes=st.lists(st.integers(1, 1500), min_size=1, max_size=12), threads=st.integers(2, 4),
          pooled=st.booleans())
    def burst(self, sizes, threads, pooled):
        made = [self._item(n, None, pooled and i % 2 == 0) for i, n in enumerate(sizes)]  # made here, sent from others

        def go(k):
            for x in made[k::threads]:
                if not self._send(x):
                    return

        ts = [threading.Thread(target=go, args=(k,)) for k in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    @precondition(lambda self: not self.closed)
    @rule(sizes=st.lists(st.integers(1, 1500), min_size=1, max_size=16),
          fails=st.lists(st.sampled_from([None, None, None, "error", "interrupt"]), min_size=16, max_size=16),
          beside=st.lists(st.integers(1, 1500), max_size=6))
    def map_on_a_thread(self, sizes, fails, beside):
        """A map (its items sharing chunks) on another thread while this one submits: its failed
        items skipped (``on_error="continue"``), every other result its own item's, in order."""
        made = [self._item(n, fail) for n, fail in zip(sizes, fails)]
        got, box = self._map_beside(made, beside)
        want = [expected(x) for x, fail in zip(made, fails) if fail is None]
        if "error" in box:
            assert self.sticky
            want = want[:len(got)]
        assert len(got) == len(want) and all(np.array_equal(r, w) for r, w in zip(got, want))

    def _map_beside(self, made, beside) -> tuple[list, dict]:
        """``made`` through a map on another thread while this one submits items of ``beside``
        sizes; returns the map's results and ``{"error": DeviceError}`` if it raised one."""
        got, box = [], {}
        before = self.pipe.stats().accepted

        def go():
            try:
                got.extend(self.pipe.map(made))
            except rf.DeviceError as exc:
                box["error"] = exc

        t = threading.Thread(target=go)
        t.start()
        submitted = 0
        for n in beside:
            if not self._send(self._item(n, None)):
                break
            submitted += 1
        t.join()
        self.mapped += self.pipe.stats().accepted - before - submitted
        return got, box

    @precondition(lambda self: not self.closed and self.futs)
    @rule(data=st.data())
    def resubmit_a_result(self, data):
        """A result (a pool array a d2h wrote) sent in again from another thread, and dropped there.
        (Drawn among all the futures, then waited for: which have ended by now depends on the
        threads' timing, and a draw that depended on it would make hypothesis's replays differ.)"""
        fut, item, fail, _ = data.draw(st.sampled_from(self.futs))
        concurrent.futures.wait([fut], timeout=60)
        if fail:
            return
        # where the item ended without a result (a cancel that won its race, a neighbour's failure
        # in a span launch: both a matter of timing), its input goes instead, so that the number
        # of futures, which later draws depend on, does not
        x = fut.result() if not fut.cancelled() and fut.exception() is None else item
        box = {}

        def go():
            try:
                box["fut"] = self.pipe.submit(x)
            except rf.DeviceError:
                pass

        t = threading.Thread(target=go)
        t.start()
        t.join()
        if "fut" in box:
            with self.lock:
                self.futs.append([box["fut"], np.array(x), None, False])

    @precondition(lambda self: not self.closed and not self.sticky)
    @rule(roll=st.integers(0, 7))
    def break_device(self, roll):
        if roll == 7:  # rarely: a sticky error ends the device's useful life; every future still ends
            self.dev.inject_sticky_error()
            self.sticky = True

    @precondition(lambda self: self.futs)
    @rule(data=st.data())
    def cancel(self, data):
        entry = data.draw(st.sampled_from(self.futs))
        if entry[0].cancel():
            entry[3] = True

    @precondition(lambda self: self.futs)
    @rule(data=st.data())
    def wait(self, data):
        entry = data.draw(st.sampled_from(self.futs))
        concurrent.futures.wait([entry[0]], timeout=60)
        assert entry[0].done()

    @precondition(lambda self: self.closed)
    @rule(n=st.integers(1, 100))
    def submit_after_close(self, n):
        with pytest.raises(RuntimeError, match="closed"):
            self.pipe.submit(self._item(n, None))

    @precondition(lambda self: not self.closed)
    @rule()
    def close(self):
        self.pipe.close()
        self.closed = True

    @invariant()
    def counts_add_up_and_results_are_their_own(self):
        s = self.pipe.stats()
        assert s.accepted == len(self.futs) + self.mapped, (s, len(self.futs), self.mapped)
        assert s.accepted == s.delivered + s.failed + s.cancelled + s.in_flight
        for fut, x, fail, cancelled in self.futs:
            if fut.done():
                self._check_ended(fut, x, fail, cancelled)

    def _check_ended(self, fut, x, fail, cancelled) -> None:
        """An ended future holds its own item's result, or the error its item was marked for."""
        if self.sticky and not fut.cancelled() and isinstance(fut.exception(), rf.DeviceError):
            return  # ended by the broken device
        if cancelled:
            assert fut.cancelled()
        elif fail == "error":
            assert isinstance(fut.exception(), rf.StageError)
        elif fail == "interrupt":  # the interrupt itself, as for a chunk of its own
            assert isinstance(fut.exception(), KeyboardInterrupt)
        else:
            assert not fut.cancelled() and fut.exception() is None
            assert np.array_equal(fut.result(), expected(x))

    def teardown(self):
        self.pipe.close()
        assert all(fut.done() for fut, *_ in self.futs)
        s = self.pipe.stats()
        assert s.in_flight == 0 and s.accepted == s.delivered + s.failed + s.cancelled


CoalescingMachine.TestCase.settings = machine_settings(50, 25)
TestCoalescingMachine = CoalescingMachine.TestCase


def test_a_result_dropped_unread_hands_its_block_on_after_the_copy_into_it():
    """Futures waited on with ``concurrent.futures.wait`` (which reads no result) and dropped: the
    next thread to take those pinned blocks must come after the d2h that wrote them. The chunk's
    end leaves that order on each item's block (without it the checker reports the take)."""
    dev = rf.device("sim", seed=6, checked=True)
    xs = items(24, seed=8, max_elems=2000)
    with rf.Pipeline(f, device=dev, chunk_bytes=1 << 16, checked=True) as pipe:
        futs = [pipe.submit(x) for x in xs]
        concurrent.futures.wait(futs, timeout=60)
        assert pipe.scheduler.chunks_admitted < len(xs)
        del futs
        gc.collect()
        taken = []
        t = threading.Thread(target=lambda: taken.extend(rf.host.empty(x.shape, x.dtype, device=dev) for x in xs))
        t.start()
        t.join(60)
        assert len(taken) == len(xs)
        for a in taken:
            a[...] = 0


def test_many_items_through_shared_chunks_leave_nothing_behind():
    """10,000 items of varied sizes with 1% failing, sharing chunks: every result right, the
    counts balanced, and after close no event, buffer or pinned block is left."""
    dev = rf.device("sim", seed=9)
    rng = np.random.default_rng(9)
    with rf.Pipeline(f, device=dev, chunk_bytes=1 << 15, on_error="continue") as pipe:
        window = []
        wrong = failed = 0
        for i in range(10_000):
            x = rng.random(int(rng.integers(1, 1500))).astype(np.float32)
            if i % 100 == 7:
                x[0] = FAIL
            window.append((pipe.submit(x), x))
            if len(window) >= 64:  # a server hands results on: hold a bounded window
                for fut, xi in window:
                    if fut.exception() is not None:
                        failed += 1
                    elif not np.array_equal(fut.result(), expected(xi)):
                        wrong += 1
                window.clear()
        for fut, xi in window:
            failed += fut.exception() is not None
        window.clear()
        stats = pipe.stats()
        assert pipe.scheduler.chunks_admitted < 10_000
    assert wrong == 0 and failed == 100 and stats.failed == 100 and stats.delivered == 9_900
    del fut
    gc.collect()
    assert rf.host.stats(device=dev).in_use_bytes == 0 and dev.live().total == 0


def test_at_most_sixty_four_items_share_a_chunk_and_a_profile_reports_chunks():
    xs = [np.full(3, i, np.float32) for i in range(300)]
    with rf.Pipeline(f, device=rf.device("sim"), chunk_bytes=1 << 20, profile=True) as pipe:
        results = [fu.result() for fu in [pipe.submit(x) for x in xs]]
        chunks = pipe.scheduler.chunks_admitted
    assert all(np.array_equal(r, expected(x)) for r, x in zip(results, xs))
    assert 300 / 64 <= chunks < 300
    rep = pipe.report()
    assert rep.chunks == chunks


# -- map -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ordered", [True, False])
def test_map_puts_small_items_in_shared_chunks_and_hands_each_its_own_result(ordered):
    xs = items(300, seed=11)
    with rf.Pipeline(f, device=rf.device("sim", seed=2, chaos=True), chunk_bytes=1 << 20, checked=True,
                     ordered=ordered) as pipe:
        results = list(pipe.map(xs))
        chunks, stats = pipe.scheduler.chunks_admitted, pipe.stats()
    if ordered:
        assert all(np.array_equal(r, expected(x)) and r.shape == x.shape for r, x in zip(results, xs, strict=True))
    else:  # each result exactly once, in any order
        assert sorted(r.tobytes() for r in results) == sorted(expected(x).tobytes() for x in xs)
    assert chunks < len(xs) // 4
    assert (stats.accepted, stats.delivered, stats.in_flight) == (300, 300, 0)


def test_map_keeps_input_order_across_items_that_share_chunks_and_items_that_go_alone():
    """Small plain arrays share; an item of more than 4 MiB, a pool array (read in place) and an
    empty array each go alone, and an item that goes alone closes the shared chunk before it:
    the results still come in input order."""
    dev = rf.device("sim", seed=5)
    rng = np.random.default_rng(5)
    xs: list = []
    for i in range(60):
        k = i % 10  # runs of two or three small items between those that go alone
        if k == 3:
            xs.append(rng.random((5 << 20) // 4).astype(np.float32))  # over 4 MiB
        elif k == 6:
            a = rf.host.empty((777,), np.float32, device=dev)
            a[...] = rng.random(777)
            xs.append(a)
        elif k == 9:
            xs.append(np.zeros(0, np.float32))
        else:
            xs.append(rng.random(int(rng.integers(1, 5000))).astype(np.float32))
    with rf.Pipeline(f, device=dev, chunk_bytes=8 << 20, checked=True) as pipe:
        results = list(pipe.map(xs))
        chunks = pipe.scheduler.chunks_admitted
    assert len(results) == len(xs)
    assert all(np.array_equal(r, expected(x)) and r.shape == x.shape for r, x in zip(results, xs))
    assert chunks < len(xs)


def test_a_map_holds_at_most_max_in_flight_chunks_worth_of_results_ahead_of_its_caller():
    """A caller slow to take results while the pipeline runs ahead: items that share chunks
    hold no capacity once their chunk ended, so the map bounds the bytes of the results it has
    accepted and not handed out by what ``max_in_flight`` chunks hold (without that bound it
    pulls ``max_in_flight`` further chunks of items at every result)."""
    item_bytes, chunk_bytes, max_in_flight = 4096, 1 << 16, 3
    pulled = [0]

    def feed():
        for i in range(2000):
            pulled[0] += 1
            yield np.full(item_bytes // 4, i, np.float32)

    with rf.Pipeline(f, device=rf.device("sim", seed=3), chunk_bytes=chunk_bytes, max_in_flight=max_in_flight,
                     checked=True) as pipe:
        ahead = []
        for n, r in enumerate(pipe.map(feed()), 1):
            assert r[0] == 2 * (n - 1) + 1
            ahead.append(pulled[0] - n)
            pipe._drive_until(lambda: pipe.stats().in_flight == 0)  # everything accepted ends meanwhile
            if n == 300:
                break
    assert max(ahead) <= max_in_flight * chunk_bytes // item_bytes
    assert max(ahead) > 2 * chunk_bytes // item_bytes  # it does run ahead, by more than a chunk


@pytest.mark.parametrize("on_error", ["raise", "continue"])
def test_a_map_item_that_fails_in_a_shared_chunk_fails_alone_or_stops_the_map(on_error):
    xs = items(120, seed=13, max_elems=3000)
    xs[37][0] = FAIL
    with rf.Pipeline(f, device=rf.device("sim", seed=4, chaos=True), chunk_bytes=1 << 18, checked=True,
                     on_error=on_error) as pipe:
        got = []
        if on_error == "raise":
            with pytest.raises(rf.StageError, match="marked item"):
                for r in pipe.map(xs):
                    got.append(r)
            assert len(got) <= 37
        else:
            got = list(pipe.map(xs))
            assert len(got) == 119
        chunks = pipe.scheduler.chunks_admitted
    kept = [x for i, x in enumerate(xs) if i != 37]
    assert all(np.array_equal(r, expected(x)) for r, x in zip(got, kept))
    assert chunks < len(xs)
    stats = pipe.stats()
    assert stats.balanced() and stats.in_flight == 0 and stats.failed == 1


def test_a_map_item_whose_compute_raises_keyboard_interrupt_raises_it_from_the_map():
    xs = items(80, seed=14, max_elems=3000)
    xs[20][0] = INTERRUPT
    dev = rf.device("sim", seed=5, chaos=True)
    with rf.Pipeline(f, device=dev, chunk_bytes=1 << 18, checked=True) as pipe:
        got = []
        with pytest.raises(KeyboardInterrupt):
            for r in pipe.map(xs):
                got.append(r)
        assert pipe.scheduler.chunks_admitted < len(xs)
    assert len(got) <= 20 and all(np.array_equal(r, expected(x)) for r, x in zip(got, xs))
    stats = pipe.stats()
    assert stats.balanced() and stats.in_flight == 0
    got.clear()
    gc.collect()
    assert rf.host.stats(device=dev).in_use_bytes == 0 and dev.live().total == 0


def test_a_map_stopped_early_and_maps_from_several_threads_share_chunks_and_leave_nothing():
    dev = rf.device("sim", seed=6)
    xs = items(400, seed=15, max_elems=5000)
    out: dict = {}
    with rf.Pipeline(f, device=dev, chunk_bytes=1 << 17, checked=True) as pipe:
        def mapper(k):
            out[k] = list(pipe.map(xs[k::4]))

        threads = [threading.Thread(target=mapper, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for k in range(4):
            assert all(np.array_equal(r, expected(x)) for r, x in zip(out[k], xs[k::4]))
            assert len(out[k]) == 100
        gen = pipe.map(xs)
        first = [next(gen) for _ in range(5)]
        gen.close()  # stopped early: what it accepted still ends
        assert pipe.scheduler.chunks_admitted < 400
    assert all(np.array_equal(r, expected(x)) for r, x in zip(first, xs))
    stats = pipe.stats()
    assert stats.balanced() and stats.in_flight == 0 and stats.failed == 0
    out.clear()
    first.clear()
    gc.collect()
    assert rf.host.stats(device=dev).in_use_bytes == 0 and dev.live().total == 0


@pytest.mark.parametrize("how", ["submit", "map"])
def test_chunks_of_one_item_each_lie_packed_in_their_slab(how):
    """Items of more than half a chunk (no two fit one) each get a chunk of their own, and each
    chunk's part of the slab shrinks to its item once the next chunk opens: six 2560-byte parts
    lie in a 16 KiB slab (four chunks' room), so ten kept results hold two slabs, not three."""
    dev = rf.device("sim", seed=8)
    xs = [np.full(600, i, np.float32) for i in range(10)]  # 2400 bytes of a 4096-byte chunk
    with rf.Pipeline(f, device=dev, chunk_bytes=4096, checked=True) as pipe:
        results = [fu.result() for fu in [pipe.submit(x) for x in xs]] if how == "submit" else list(pipe.map(xs))
        assert pipe.scheduler.chunks_admitted == len(xs)
        assert pipe.scheduler.space.slab_bytes == 4 * 4096
    assert all(np.array_equal(r, expected(x)) for r, x in zip(results, xs, strict=True))
    assert rf.host.stats(device=dev).allocations == 2


class PointwiseCoalescingMachine(CoalescingMachine):
    """The same steps with a pointwise compute, run once over a shared chunk's items: an item that
    shares its chunk with a marked one may fail with that item's error, but never holds another
    item's result or a wrong one, and the counts still add up after every step."""

    def __init__(self):
        super().__init__()
        self.pipe.close()
        self.pipe = rf.Pipeline(f_pointwise, device=self.dev, chunk_bytes=1 << 15, checked=True,
                                on_error="continue", max_in_flight=6)

    def map_on_a_thread(self, sizes, fails, beside):
        # a map stops at no failure here either; with span launches a failed neighbour fails
        # unmarked items too, so this machine checks map results by what each item became
        made = [self._item(n, fail) for n, fail in zip(sizes, fails)]
        got, _ = self._map_beside(made, beside)
        # every result handed out is some unmarked item's own, in input order
        want = iter([expected(x) for x, fail in zip(made, fails) if fail is None])
        assert all(any(np.array_equal(r, w) for w in want) for r in got)

    def _check_ended(self, fut, x, fail, cancelled) -> None:
        """An ended future holds its own item's result, or an error: its own mark's, a marked
        neighbour's in its span, or the broken device's."""
        if fut.cancelled():
            return
        assert not cancelled
        err = fut.exception()
        if err is None:
            assert fail is None and np.array_equal(fut.result(), expected(x))
        else:
            assert isinstance(err, (rf.StageError, KeyboardInterrupt, rf.DeviceError))
            assert fail is not None or isinstance(err, rf.DeviceError) or self._marked_neighbour(err)

    @staticmethod
    def _marked_neighbour(err) -> bool:
        cause = err if isinstance(err, KeyboardInterrupt) else err.__cause__
        return isinstance(cause, KeyboardInterrupt) or "marked item" in str(cause)


PointwiseCoalescingMachine.map_on_a_thread = precondition(lambda self: not self.closed)(
    rule(sizes=st.lists(st.integers(1, 1500), min_size=1, max_size=16),
         fails=st.lists(st.sampled_from([None, None, None, "error", "interrupt"]), min_size=16, max_size=16),
         beside=st.lists(st.integers(1, 1500), max_size=6))(PointwiseCoalescingMachine.map_on_a_thread))
PointwiseCoalescingMachine.TestCase.settings = machine_settings(30, 25)
TestPointwiseCoalescingMachine = PointwiseCoalescingMachine.TestCase


def test_a_shared_submit_that_raised_is_not_counted_while_its_take_back_waits_for_the_progress_thread():
    """A shared submit whose copy fails while another thread keeps the pipeline's lock hands its
    take-back to the progress thread, to be carried out at its next turn; until then ``stats()``
    must not count the item: the caller got an error, not a future, and the item never runs."""
    dev = rf.device("sim", seed=2)
    with rf.Pipeline(f, device=dev, chunk_bytes=1 << 15, checked=True) as pipe:
        kept = pipe.submit(np.ones(100, np.float32))  # opens a shared chunk the next item joins
        real_copy = dev.host_copy

        def failing_copy(dst, src):
            raise RuntimeError("copy failed")

        held, let_go = threading.Event(), threading.Event()

        def keep_the_lock():
            with pipe._driver.lock:
                held.set()
                let_go.wait(30)

        keeper = threading.Thread(target=keep_the_lock)
        keeper.start()
        held.wait(30)
        dev.host_copy = failing_copy
        try:
            with pytest.raises(RuntimeError, match="copy failed"):
                pipe.submit(np.ones(50, np.float32))
        finally:
            dev.host_copy = real_copy
            let_go.set()
            keeper.join()
        s = pipe.stats()
        assert s.accepted == 1 and s.in_flight + s.delivered == 1, s
        assert np.array_equal(kept.result(timeout=30), expected(np.ones(100, np.float32)))
    s = pipe.stats()
    assert s.accepted == s.delivered == 1 and s.in_flight == 0, s
