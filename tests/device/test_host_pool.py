"""The caching pinned host allocator (``ringflow._device.host_pool``) on the simulated GPU, whose
happens-before checker sees every hand-out of a block (a checked host view) and every free."""

from __future__ import annotations

import gc
import os
import logging
import threading
import weakref

import numpy as np
import pytest

import ringflow as rf
from ringflow._device import host_pool
from ringflow._device.host_pool import HostPool, pool_for, size_class
from ringflow._errors import DeviceError
from tests.helpers.interrupts import call_interrupted_at
from tests.helpers.threads import JOIN_S, bounded, join, start

POOL_FILE = ("/ringflow/_device/host_pool.py",)  # where the interrupt sweeps raise

N = 1 << 20  # bytes of the arrays the ordering tests copy into and out of


def slow_fill(dev, stream, dbuf, value, seconds=1.0):
    """A kernel of ``seconds`` of virtual time writing ``value`` into ``dbuf``: the copy enqueued
    after it is still pending for that long, whatever the host does meanwhile."""

    def kernel(a):
        a[:] = value

    stream.launch(kernel, dbuf.array(np.uint8, dbuf.nbytes), sim_seconds=seconds)


def pending_copy(dev, pool, direction):
    """A pooled array with a copy into it (``"d2h"``) or out of it (``"h2d"``) pending behind a
    one-second kernel, recorded with ``record_use``; returns (array, its buffer, the event)."""
    stream = dev.create_stream()
    dbuf = dev.allocate(N)
    a = pool.empty(N, np.uint8)
    a[:] = 3
    buf = pool.buffer_of(a)
    slow_fill(dev, stream, dbuf, 7)
    if direction == "d2h":
        stream.copy(buf, dbuf)
    else:
        stream.copy(dbuf, buf)
    ev = stream.record()
    assert pool.record_use(a, ev) is True
    return a, buf, ev, (stream, dbuf)


def test_size_classes_round_up_by_at_most_a_quarter():
    assert [size_class(n) for n in (1, 512, 513, 64 << 10)] == [512, 512, 1024, 64 << 10]
    assert size_class((64 << 10) + 1) == 80 << 10  # 1.25 x 64 KiB
    assert [size_class(n) for n in (1 << 20, (1 << 20) + 1, 1_400_000, 1 << 30)] == \
        [1 << 20, 1_310_720, 1_572_864, 1 << 30]
    rng = np.random.default_rng(0)
    for n in rng.integers(1, 1 << 34, 2000):
        n = int(n)
        c = size_class(n)
        assert n <= c and (c - n) <= max(511, n // 4)
        assert size_class(c) == c  # a class serves itself


def test_empty_is_a_plain_pinned_array_of_the_asked_shape():
    dev = rf.device("sim")
    pool = pool_for(dev)
    a = pool.empty((3, 5), np.float32)
    assert type(a) is np.ndarray and a.shape == (3, 5) and a.dtype == np.float32
    assert a.flags.c_contiguous and a.flags.writeable
    buf = pool.buffer_of(a)
    assert buf is not None and buf.holds(a) and buf.nbytes == 512
    a[:] = 2.5
    assert float(a.sum()) == 37.5
    sub = pool.empty(4, np.dtype((np.int16, 3)))  # a subarray dtype adds its shape, as np.empty does
    assert sub.shape == (4, 3) and sub.dtype == np.int16
    z = pool.empty((0, 7), np.float64)
    assert z.shape == (0, 7) and pool.buffer_of(z) is None  # nothing to pin
    assert pool.buffer_of(np.zeros(3)) is None
    assert host_pool.device_of(a) is dev and host_pool.device_of(np.zeros(3)) is None


@pytest.mark.parametrize("dtype, made", [("S", "S1"), ("U", "U1"), ("S0", "S1"), ("U0", "U1"), (np.bytes_, "S1")])
def test_a_string_dtype_without_a_length_is_one_character_long_and_pinned_as_numpy_makes_it(dtype, made):
    """np.empty makes such a dtype one character long; the pool took it for 0 bytes and handed
    out a pageable array that neither it nor its counters knew of."""
    pool = pool_for(rf.device("sim"))
    a = pool.empty(3, dtype)
    assert a.dtype == np.dtype(made) == np.empty(3, dtype).dtype and a.shape == (3,)
    assert pool.buffer_of(a) is not None and pool.buffer_of(a).holds(a)
    assert pool.stats().in_use_bytes == 512 and pool.stats().fallbacks == 0


@pytest.mark.parametrize("shape, dtype, error, match", [
    (-1, np.float32, ValueError, "negative"),
    ((2, -3), np.float32, ValueError, "negative"),
    ("10", np.float32, TypeError, "shape"),
    (2.5, np.float32, TypeError, "shape"),
    ((2, 1.5), np.float32, TypeError, "shape"),
    (True, np.float32, TypeError, "shape"),
    (None, np.float32, TypeError, "shape"),
    # not sequences, as numpy.empty refuses them too: a set's order is its hashes', not the one
    # written ({3, 2} made a (2, 3) array), a dict's dimensions would be its keys
    ({3, 2}, np.float32, TypeError, "shape"),
    ({2: 3}, np.float32, TypeError, "shape"),
    (iter((2, 3)), np.float32, TypeError, "shape"),
    (4, object, TypeError, "Python objects"),
    (4, "not a dtype", TypeError, "dtype"),
    ((1,) * 65, np.float32, ValueError, r"shape \(1, 1, .*\) has 65 dimensions; numpy arrays have at most 64"),
    ((2 ** 32, 2 ** 32, 2 ** 32, 0), np.uint8, ValueError, "more elements than numpy can index"),
    ((0, 2 ** 62), np.float32, ValueError, "more elements than numpy can index"),
    ((0, 2 ** 63), np.uint8, ValueError, "more elements than numpy can index"),
])
def test_empty_refuses_bad_requests_by_name(shape, dtype, error, match):
    pool = pool_for(rf.device("sim"))
    with pytest.raises(error, match=match):
        pool.empty(shape, dtype)
    assert pool.stats().in_use_bytes == 0


def test_a_dropped_array_returns_its_block_only_once_every_view_is_gone():
    dev = rf.device("sim")
    pool = pool_for(dev)
    a = pool.empty(1000, np.float64)
    buf = pool.buffer_of(a)
    view = a[10:20].reshape(2, 5).T
    del a
    assert pool.stats().in_use_bytes == size_class(8000)  # the view still holds it
    assert pool.buffer_of(view) is buf and not buf.holds(view)
    b = pool.empty(1000, np.float64)
    assert pool.buffer_of(b) is not buf
    del view
    s = pool.stats()
    assert (s.cached_bytes, s.in_use_bytes, s.allocations, s.hits) == (8192, 8192, 2, 0)
    c = pool.empty(990, np.float64)  # another size of the same class
    assert pool.buffer_of(c) is buf and pool.stats().hits == 1
    assert dev.live().pooled_host_buffers == 2 and dev.live().host_buffers == 0


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_a_block_is_not_handed_out_while_a_recorded_copy_is_pending(direction):
    dev = rf.device("sim")
    pool = pool_for(dev)
    a, buf, ev, keep = pending_copy(dev, pool, direction)
    del a
    b = pool.empty(N, np.uint8)  # same size class: not the pending block
    assert pool.buffer_of(b) is not buf
    s = pool.stats()
    assert s.pending_bytes == N and s.in_use_bytes == N and s.cached_bytes == 0
    assert pool.collect() == 0 and not ev.is_done
    ev.sync()
    assert pool.collect() == N
    c = pool.empty(N, np.uint8)
    assert pool.buffer_of(c) is buf  # now it may, and the checked view of it is ordered
    assert (c == host_pool.POISON).all()  # returned blocks are poisoned on a checked device


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_without_the_hold_rule_the_checker_catches_the_reuse(monkeypatch, direction):
    dev = rf.device("sim")
    pool = pool_for(dev)
    a, buf, ev, keep = pending_copy(dev, pool, direction)
    del a
    monkeypatch.setattr(host_pool, "_HOLD_UNTIL_DONE", False)
    with pytest.raises(rf.HazardError, match="pinned host buffer"):
        pool.empty(N, np.uint8)
    monkeypatch.setattr(host_pool, "_HOLD_UNTIL_DONE", True)
    ev.sync()
    assert pool.collect() == N  # after the refused reuse the block is still accounted for


def test_without_record_use_the_checker_catches_the_reuse():
    dev = rf.device("sim")
    pool = pool_for(dev)
    stream = dev.create_stream()
    dbuf = dev.allocate(N)
    a = pool.empty(N, np.uint8)
    slow_fill(dev, stream, dbuf, 7)
    stream.copy(pool.buffer_of(a), dbuf)
    ev = stream.record()  # not recorded with the pool
    del a
    with pytest.raises(rf.HazardError):
        pool.empty(N, np.uint8)
    ev.sync()


@pytest.mark.parametrize("hold", [True, False])
def test_without_the_hold_rule_a_late_copy_overwrites_the_next_owner(monkeypatch, hold):
    dev = rf.device("sim", checked=False)  # no checker: only the values tell
    monkeypatch.setattr(host_pool, "_HOLD_UNTIL_DONE", hold)
    pool = pool_for(dev)
    a, buf, ev, keep = pending_copy(dev, pool, "d2h")
    del a
    b = pool.empty(N, np.uint8)
    assert (pool.buffer_of(b) is buf) is not hold
    b[:] = 1
    ev.sync()  # the copy of 7s lands now
    assert bool((b == 1).all()) is hold
    if not hold:
        assert (b == 7).all()  # the next owner's data was overwritten


def test_a_dropped_result_with_its_copy_in_flight_is_held_then_waited_for():
    dev = rf.device("sim")
    pool = pool_for(dev)
    result, buf, ev, keep = pending_copy(dev, pool, "d2h")
    del result  # dropped before anyone waited for it
    assert pool.release_cached() == 0  # a pending block is never freed (the free would be checked)
    assert not buf.closed and pool.stats().pending_bytes == N
    others = [pool.empty(N, np.uint8) for _ in range(3)]
    assert all(pool.buffer_of(o) is not buf for o in others)
    assert pool.collect(wait=True) == N and ev.is_done
    s = pool.stats()
    assert (s.pending_bytes, s.cached_bytes) == (0, N)
    assert pool.release_cached() == N and buf.closed  # its free is ordered after the copy
    assert dev.live().pooled_host_buffers == 3


def test_record_use_refuses_what_it_cannot_record():
    dev = rf.device("sim")
    pool = pool_for(dev)
    ev = dev.create_stream().record()
    assert pool.record_use(np.zeros(4), ev) is False  # not pooled: nothing to hold
    a = pool.empty(4, np.float32)
    with pytest.raises(TypeError, match="is_done"):
        pool.record_use(a, object())
    with pytest.raises(TypeError, match="numpy array"):
        pool.record_use([1, 2], ev)
    buf = pool.buffer_of(a)
    assert pool.record_use(buf, ev) is True
    del a
    ev.sync()
    pool.collect()
    with pytest.raises(ValueError, match="not behind a live array"):
        pool.record_use(buf, ev)
    other = pool_for(rf.device("sim"))
    b = pool.empty(4, np.float32)
    assert other.record_use(b, ev) is False  # another pool's array


def test_many_recorded_uses_are_pruned_and_stay_ordered():
    dev = rf.device("sim")
    pool = pool_for(dev)
    stream = dev.create_stream()
    dbuf = dev.allocate(4096)
    a = pool.empty(4096, np.uint8)
    buf = pool.buffer_of(a)
    for _ in range(40):
        stream.copy(dbuf, buf)
        ev = stream.record()
        ev.sync()
        pool.record_use(a, ev)
    assert len(pool._block_of(a).events) <= host_pool._PRUNE_AT + 1
    del a
    assert pool.buffer_of(pool.empty(4096, np.uint8)) is buf


# -- budget ----------------------------------------------------------------------------------------

def test_over_budget_requests_fall_back_to_pageable_memory_noted_once(caplog):
    dev = rf.device("sim")
    pool = HostPool(dev, budget=3 << 20)
    a = pool.empty(2 << 20, np.uint8)
    with caplog.at_level(logging.WARNING, logger="ringflow"):
        b = pool.empty(2 << 20, np.uint8)
        c = pool.empty(2 << 20, np.uint8)
    assert pool.buffer_of(a) is not None
    assert pool.buffer_of(b) is None and pool.buffer_of(c) is None
    assert type(b) is np.ndarray and b.shape == (2 << 20,)
    b[:] = 1
    notes = [r for r in caplog.records if "budget" in r.getMessage()]
    assert len(notes) == 1 and "set_budget" in notes[0].getMessage()
    s = pool.stats()
    assert (s.fallbacks, s.allocations, s.in_use_bytes, s.budget) == (2, 1, 2 << 20, 3 << 20)


def test_a_request_no_memory_holds_is_no_fallback_and_leaves_the_note_for_a_real_one(caplog):
    """A request that raises MemoryError got no pageable memory: it is not counted as a fallback,
    and the one note per pool still goes to the first request that does get pageable memory."""
    pool = HostPool(rf.device("sim"), budget=1 << 20)
    with caplog.at_level(logging.WARNING, logger="ringflow"):
        for shape in [(2**40, 2**40), (1 << 62,)]:
            with pytest.raises(MemoryError, match="smaller shape"):
                pool.empty(shape, np.uint8)
        assert pool.stats().fallbacks == 0
        assert not [r for r in caplog.records if "pageable" in r.getMessage()]
        b = pool.empty(2 << 20, np.uint8)
    assert pool.buffer_of(b) is None and pool.stats().fallbacks == 1
    notes = [r for r in caplog.records if "pageable" in r.getMessage()]
    assert len(notes) == 1 and str(2 << 20) in notes[0].getMessage()


def test_cached_blocks_are_freed_to_make_room_and_when_the_budget_shrinks():
    dev = rf.device("sim")
    pool = HostPool(dev, budget=4 << 20)
    a, b = pool.empty(2 << 20, np.uint8), pool.empty(1 << 20, np.uint8)
    del a, b
    assert pool.stats().cached_bytes == 3 << 20
    c = pool.empty(3 << 20, np.uint8)  # another class: the largest cached block goes
    s = pool.stats()
    assert (s.releases, s.cached_bytes, s.in_use_bytes, s.fallbacks) == (1, 1 << 20, 3 << 20, 0)
    pool.set_budget(3 << 20)
    assert pool.stats().cached_bytes == 0 and pool.stats().releases == 2
    assert dev.live().pooled_host_buffers == 1
    with pytest.raises(ValueError, match="positive"):
        pool.set_budget(0)
    with pytest.raises(TypeError, match="int"):
        pool.set_budget("1GiB")
    del c


@pytest.mark.parametrize("request_bytes", [8 << 20, 3 << 20], ids=["over-the-budget", "over-what-the-cache-frees"])
def test_a_request_that_cannot_fit_even_with_the_cache_freed_keeps_the_cache(request_bytes):
    dev = rf.device("sim")
    pool = HostPool(dev, budget=4 << 20)
    held = pool.empty(2 << 20, np.uint8)  # in use: freeing the cache makes at most 2 MiB of room
    a, b = pool.empty(1 << 20, np.uint8), pool.empty(512 << 10, np.uint8)
    bufs = {pool.buffer_of(a), pool.buffer_of(b)}
    del a, b
    assert pool.stats().cached_bytes == (1 << 20) + (512 << 10)
    big = pool.empty(request_bytes, np.uint8)
    assert pool.buffer_of(big) is None  # pageable: freeing every cached block would not make it fit
    s = pool.stats()
    assert (s.fallbacks, s.releases, s.cached_bytes) == (1, 0, (1 << 20) + (512 << 10))
    again = pool.empty(1 << 20, np.uint8), pool.empty(512 << 10, np.uint8)  # the cache still serves its classes
    assert {pool.buffer_of(x) for x in again} == bufs and pool.stats().hits == 2
    del again
    pool.set_budget(1 << 20)  # below the memory in use: the cache is freed all the same
    assert pool.stats().cached_bytes == 0 and pool.stats().releases == 2
    del held


def test_refused_pinning_frees_the_cache_then_falls_back(monkeypatch, caplog):
    dev = rf.device("sim")
    pool = HostPool(dev)
    pool.empty(1 << 20, np.uint8)  # dropped at once
    assert pool.stats().cached_bytes == 1 << 20
    real = dev.allocate_host
    calls = []

    def refuse(nbytes):
        calls.append(nbytes)
        raise MemoryError("no pinned memory left")

    monkeypatch.setattr(dev, "allocate_host", refuse)
    with caplog.at_level(logging.WARNING, logger="ringflow"):
        x = pool.empty(2 << 20, np.uint8)
    assert pool.buffer_of(x) is None and calls == [2 << 20, 2 << 20]
    s = pool.stats()
    assert (s.cached_bytes, s.releases, s.fallbacks) == (0, 1, 1)
    assert "refused to pin" in caplog.text
    monkeypatch.setattr(dev, "allocate_host", lambda n: (_ for _ in ()).throw(DeviceError("broken", sticky=True)))
    with pytest.raises(DeviceError, match="broken"):
        pool.empty(1 << 20, np.uint8)  # a broken device is not a shortage
    monkeypatch.setattr(dev, "allocate_host", real)
    assert pool.buffer_of(pool.empty(1 << 20, np.uint8)) is not None
    assert pool.stats().in_use_bytes == 0  # nothing leaked in the accounting



@pytest.mark.parametrize("poison", [False, True])
def test_a_broken_context_leaves_the_pool_readable_and_its_cached_blocks_usable(poison):
    """After a sticky error nothing runs on the device again, and pinned host memory is still
    host memory (a real GPU's pinned buffer is a numpy view, no CUDA call): the pool's counters
    stay readable and a dropped block goes back to the cache; only a new pinned allocation fails."""
    dev = rf.device("sim", checked=poison)
    pool = pool_for(dev)
    x, _, _, _ = pending_copy(dev, pool, "d2h")
    cached = pool.empty(N, np.uint8)
    del cached
    gc.collect()
    dev.inject_sticky_error()
    del x
    gc.collect()
    s = pool.stats()  # takes the dropped block back: its copy will never run
    assert (s.pending_bytes, s.in_use_bytes) == (0, 0) and s.cached_bytes >= 2 * N
    y = pool.empty(N, np.uint8)  # a cached block: host memory, no device call
    assert pool.buffer_of(y) is not None
    y[:] = 7
    with pytest.raises(DeviceError, match="sticky"):
        pool.empty(4 * N, np.uint8)  # a new pinned allocation is a device call


# -- devices and threads ---------------------------------------------------------------------------

def test_each_device_has_its_own_pool_collected_with_it():
    d1, d2 = rf.device("sim"), rf.device("sim")
    p1, p2 = pool_for(d1), pool_for(d2)
    assert p1 is not p2 and pool_for(d1) is p1 and pool_for(d2, create=False) is p2
    assert pool_for(rf.device("sim"), create=False) is None
    a = p1.empty(4096, np.uint8)
    buf = p1.buffer_of(a)
    del a
    b = p2.empty(4096, np.uint8)  # d1's cached block is not d2's
    assert p2.buffer_of(b) is not buf and p2.buffer_of(b)._dev is d2
    assert host_pool.buffer_behind(b, d2) is not None and host_pool.buffer_behind(b, d1) is None
    assert (p1.stats().cached_bytes, p2.stats().in_use_bytes) == (4096, 4096)
    gone = weakref.ref(d1)
    del d1, p1, buf
    gc.collect()
    assert gone() is None


def test_threads_allocating_and_dropping_at_once_never_share_a_block():
    dev = rf.device("sim")
    pool = HostPool(dev, budget=64 << 20)
    sizes = [1000, 5000, 70_000, 300_000]
    workers, rounds = 6, 60
    start = threading.Barrier(workers)
    errors: list = []

    def work(k):
        rng = np.random.default_rng(k)
        held = []
        try:
            start.wait()
            for i in range(rounds):
                a = pool.empty(int(rng.choice(sizes)), np.uint8)
                a[:] = k
                held.append(a)
                if len(held) > 3 or rng.random() < 0.5:
                    victim = held.pop(int(rng.integers(len(held))))
                    assert (victim == k).all(), "another thread wrote into this thread's block"
                    del victim
            assert all((h == k).all() for h in held)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(1, workers + 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    gc.collect()
    s = pool.stats()
    assert s.in_use_bytes == 0 and s.pending_bytes == 0 and s.fallbacks == 0
    assert s.hits > 0 and s.hits + s.allocations == workers * rounds
    assert s.cached_bytes == sum(b.size for bucket in pool._free.values() for b in bucket)
    assert dev.live().pooled_host_buffers == s.allocations - s.releases


@pytest.mark.parametrize("poison", [True, False])
def test_an_array_made_on_one_thread_and_dropped_on_another_goes_back_in_order(poison):
    """The caller passes arrays between its threads by means the checker cannot see: the hand-out
    leaves a token on the block, so the block's next hand-out (and its poisoning, on a checked
    device) is ordered after it, whichever thread dropped the array."""
    dev = rf.device("sim", seed=1, chaos=True, checked=poison)
    pool = HostPool(dev, budget=64 << 20)
    for k in range(4):
        a = bounded(lambda: pool.empty(1000, np.float32))
        del a  # dropped here, made on another thread
        gc.collect()
        b = bounded(lambda: pool.empty(1000, np.float32)) if k % 2 else pool.empty(1000, np.float32)
        del b
        gc.collect()
    s = pool.stats()
    assert s.allocations == 1 and s.hits == 7


@pytest.mark.parametrize("how", ["submit", "MapJob", "stream_map"])
def test_a_pool_array_used_again_and_again_keeps_few_tokens(how):
    """Every use of a pool array leaves a hand-off token on its block, and every take-in reads
    them all: a token that a later one of the block's subsumes is dropped, so a pinned input
    used many times neither grows its block's list nor makes each use slower."""
    dev = rf.device("sim", seed=2)
    x = rf.host.empty((1000,), np.float32, device=dev)
    x[:] = 1
    block = host_pool.owner_of(x).block
    f = lambda a, y: np.copyto(y, a * 2 + 1)  # noqa: E731
    if how == "submit":
        with rf.Pipeline(f, device=dev, chunk_bytes=8192) as pipe:
            for _ in range(60):
                np.testing.assert_array_equal(pipe.submit(x).result(), x * 2 + 1)
    elif how == "MapJob":
        with rf.MapJob(f, x, device=dev, chunk_bytes=1024) as job:
            for _ in range(60):
                np.testing.assert_array_equal(job(), x * 2 + 1)
    else:
        for _ in range(60):
            np.testing.assert_array_equal(rf.stream_map(f, x, device=dev, chunk_bytes=1024), x * 2 + 1)
        rf.drop_warm_pipelines(dev)
    assert len(block.tokens) <= 4, len(block.tokens)


def test_tokens_a_real_gpu_publishes_are_not_kept():
    """A real GPU's publish gives None (its locks order the threads): nothing to keep."""
    dev = rf.device("sim", seed=2)
    assert rf.Device.fold_tokens(dev, [None, None]) == []


def test_ctrl_c_anywhere_in_a_hand_out_leaves_the_block_back_once():
    """A KeyboardInterrupt at any instruction of a hand-out (a cached block or a new one):
    either the caller got the array, or the block is free again, and never neither (a leak)."""
    dev = rf.device("sim")
    pool = HostPool(dev)
    size = size_class(4096)
    for cached in (True, False):
        n, finished = 0, False
        while not finished:
            pool.release_cached()
            if cached:
                keep = pool.empty(4096, np.uint8)  # one cached block for the hand-out
                del keep
                pool.collect()
            hook, got = call_interrupted_at(n, lambda: pool.empty(4096, np.uint8),
                                            {"take", "_take", "_allocate", "_hand_out"}, POOL_FILE)
            finished = hook.fired == 0
            gc.collect()
            pool.collect()
            st = pool.stats()
            if got is not None:
                assert st.in_use_bytes == size, (cached, n, st)
                del got
                gc.collect()
                pool.collect()
                st = pool.stats()
            assert st.in_use_bytes == 0 and st.pending_bytes == 0, (cached, n, st)
            assert st.cached_bytes in ((size,) if cached else (0, size)), (cached, n, st)
            # every pinned buffer open is in the pool's books: none pinned and then dropped
            assert dev.live().host_buffers == 0, (cached, n, hook.functions[n:n + 1])
            n += 1
        assert n > 10  # the hook reached into the hand-out


def test_ctrl_c_twice_in_a_hand_out_leaves_the_block_back_once():
    """Ctrl-C pressed again while an interrupted hand-out puts its block back: a second
    KeyboardInterrupt at any instruction after the first leaves the same books as one (the block
    free again, counted once, in the cache it is counted in, no pinned buffer dropped)."""
    dev = rf.device("sim")
    pool = HostPool(dev)
    size = size_class(4096)
    names = {"take", "_take", "_allocate", "_hand_out", "_put_back", "_book", "_move"}
    reached = set()  # the cases in which a second interrupt fell inside the putting back
    for cached in (True, False):
        first, first_done = 0, False
        while not first_done:
            second, second_done = first + 1, False
            while not second_done:
                pool.release_cached()
                if cached:
                    keep = pool.empty(4096, np.uint8)
                    del keep
                    pool.collect()
                hook, got = call_interrupted_at({first, second}, lambda: pool.empty(4096, np.uint8), names, POOL_FILE)
                first_done = hook.fired == 0
                second_done = hook.fired < 2
                if hook.fired == 2 and hook.functions[second:second + 1] == ["_put_back"]:
                    reached.add(cached)
                where = (cached, first, second, hook.functions[first:first + 1], hook.functions[second:second + 1])
                del got
                gc.collect()
                pool.collect()
                st = pool.stats()
                assert st.in_use_bytes == 0 and st.pending_bytes == 0, (where, st)
                assert st.cached_bytes == sum(b.size for bucket in pool._free.values() for b in bucket), (where, st)
                assert st.cached_bytes in ((size,) if cached else (0, size)), (where, st)
                assert st.held_bytes == sum(b.size for b in pool._blocks.values()), (where, st)
                live = dev.live()
                assert live.host_buffers == 0 and live.pooled_host_buffers == len(pool._blocks), where
                second += 1
            first += 1
    assert reached == {True, False}


def test_a_hand_out_interrupted_after_its_owner_exists_is_not_freed_twice(monkeypatch):
    """The block of a hand-out interrupted once its owner exists is free again at once; the owner,
    kept alive for a while (by the exception's frames, say), is dropped only after the block went
    to a new array: its late return must not free the block under that array."""
    dev = rf.device("sim")
    pool = HostPool(dev)
    warm = pool.empty(4096, np.uint8)
    del warm
    pool.collect()
    owners = []
    real_asarray = np.asarray

    fired = []

    def interrupted(obj, *args, **kwargs):
        if isinstance(obj, host_pool._Owner) and not fired:
            fired.append(True)
            owners.append(obj)  # alive past the interrupt
            raise KeyboardInterrupt
        return real_asarray(obj, *args, **kwargs)

    monkeypatch.setattr(host_pool.np, "asarray", interrupted)
    try:
        pool.empty(4096, np.uint8)
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the hand-out was not interrupted")
    again = pool.empty(4096, np.uint8)  # the same block, free again
    owners.clear()  # the interrupted hand-out's owner goes now
    gc.collect()
    pool.collect()
    assert pool.stats().in_use_bytes == size_class(4096)  # still the new array's
    other = pool.empty(4096, np.uint8)
    assert pool.buffer_of(other) is not pool.buffer_of(again)


@pytest.mark.parametrize("wait", [True, False])
def test_ctrl_c_anywhere_in_taking_back_a_dropped_block_leaves_it_pending_or_free(wait):
    """A KeyboardInterrupt at any instruction of taking back a dropped array's block (Ctrl-C while
    ``collect(wait=True)`` waits for its copy, or during the take-back every ``empty`` does): the
    block is returned once its copy is done, counted once and listed once, never stranded."""
    n, finished = 0, False
    while not finished:
        dev = rf.device("sim")
        pool = HostPool(dev)
        a, buf, ev, keep = pending_copy(dev, pool, "d2h")
        del a
        hook, _ = call_interrupted_at(n, lambda: pool.collect(wait=wait),
                                      {"collect", "_process", "_settled", "_wait", "_is_done", "_move", "_add_token",
                                       "_observe"}, POOL_FILE)
        finished = hook.fired == 0
        ev.sync()
        pool.collect()
        st = pool.stats()
        where = (wait, n, hook.functions[n:n + 1])
        assert (st.cached_bytes, st.pending_bytes, st.in_use_bytes) == (N, 0, 0), (where, st)
        again = pool.empty(N, np.uint8)
        assert pool.buffer_of(again) is buf, where
        other = pool.empty(N, np.uint8)
        assert pool.buffer_of(other) is not buf, where  # listed in the cache once
        n += 1
    assert n > 10  # the hook reached into the take-back


@pytest.mark.parametrize("wait", [True, False])
def test_ctrl_c_anywhere_in_taking_back_a_block_over_the_budget_leaves_it_pending_freed_or_cached(wait):
    """A KeyboardInterrupt at any instruction of taking back a dropped block while the pool is
    over its budget (which frees it instead of caching it): the block is left pending, freed and
    out of the books, or back in the cache for a later release; counted once, never open but
    uncounted, and never freed before its copy is done."""
    n, finished = 0, False
    while not finished:
        dev = rf.device("sim")
        pool = HostPool(dev)
        a, buf, ev, keep = pending_copy(dev, pool, "d2h")
        pool.set_budget(4096)
        del a
        hook, _ = call_interrupted_at(n, lambda: pool.collect(wait=wait),
                                      {"collect", "_process", "_settled", "_over_budget", "_wait", "_is_done",
                                       "_release_blocks", "_restore", "_observe"}, POOL_FILE)
        finished = hook.fired == 0
        where = (wait, n, hook.functions[n:n + 1])
        assert buf.closed is (pool._blocks.get(id(buf)) is None), where
        if not ev.is_done:
            assert not buf.closed, where
        ev.sync()
        pool.collect()
        st = pool.stats()
        assert (st.pending_bytes, st.in_use_bytes) == (0, 0), (where, st)
        assert st.held_bytes == sum(b.size for b in pool._blocks.values()), (where, st)
        pool.release_cached()
        assert buf.closed and pool.stats().held_bytes == 0 and dev.live().host_buffers == 0, where
        n += 1
    assert n > 10  # the hook reached into the take-back


FREEING_SIZES = [size_class(4096 * (i + 1)) for i in range(3)]


def _pool_freeing(how: str) -> tuple:
    """``(dev, pool, buffers, call)``: a pool holding three cached blocks (``buffers``) and the
    call that frees them ``how``: releasing the cache, shrinking the budget, or making room for
    a new block (which fits once two are freed)."""
    dev = rf.device("sim")
    pool = HostPool(dev, budget=sum(FREEING_SIZES) + 4096)
    arrays = [pool.empty(size, np.uint8) for size in FREEING_SIZES]
    buffers = [pool.buffer_of(a) for a in arrays]
    del arrays
    pool.collect()
    call = {"release_cached": pool.release_cached, "set_budget": lambda: pool.set_budget(4096),
            "empty making room": lambda: pool.empty(size_class(4096 * 4), np.uint8)}[how]
    return dev, pool, buffers, call


def _check_freeing_left_the_books_right(dev, pool, buffers, where) -> None:
    """Every open pinned buffer in the pool's books, every booked one open, the bytes counted the
    bytes held (cached: those in the cache's lists), no reservation left; a release frees all."""
    st = pool.stats()
    assert dev.live().host_buffers == 0, where
    booked = list(pool._blocks.values())
    assert not any(b.buffer.closed for b in booked), where
    assert st.held_bytes == sum(b.size for b in booked), (where, st)
    assert st.cached_bytes == sum(b.size for bucket in pool._free.values() for b in bucket), where
    assert pool._reserved == 0, where
    pool.collect()
    pool.release_cached()
    assert pool.stats().held_bytes == 0 and all(b.closed for b in buffers), where


@pytest.mark.parametrize("how", ["release_cached", "set_budget", "empty making room"])
def test_ctrl_c_anywhere_in_freeing_cached_blocks_keeps_the_bytes_counted_the_bytes_held(how):
    """A KeyboardInterrupt at any instruction while cached blocks are freed (to release the cache,
    to shrink the budget, or to make room for a new block): each block is either freed and out of
    the books, or still counted; none is left open but uncounted, and a later release frees all."""
    n, finished = 0, False
    while not finished:
        dev, pool, buffers, call = _pool_freeing(how)
        hook, new = call_interrupted_at(n, call, {"release_cached", "set_budget", "empty", "take", "_allocate",
                                                  "_make_room", "_uncache_last", "_release_blocks", "_observe"},
                                        POOL_FILE)
        finished = hook.fired == 0
        del new
        _check_freeing_left_the_books_right(dev, pool, buffers, (how, n, hook.functions[n:n + 1]))
        n += 1
    assert n > 10  # the hook reached into the freeing


@pytest.mark.parametrize("how", ["release_cached", "set_budget", "empty making room"])
def test_ctrl_c_twice_in_freeing_cached_blocks_keeps_the_bytes_counted_the_bytes_held(how):
    """Ctrl-C pressed again while blocks an interrupted freeing left open go back to the cache:
    the second KeyboardInterrupt at any instruction after the first leaves the books as one does
    (every block freed and out of the books, or counted in the cache; a later release frees
    all; the pool's budget not held by a reservation that was never taken back)."""
    names = {"release_cached", "set_budget", "empty", "take", "_allocate", "_make_room", "_uncache_last",
             "_release_blocks", "_observe", "_restore", "_book", "_move", "_hand_out", "_put_back"}
    reached = False
    first, first_done = 0, False
    while not first_done:
        second, second_done = first + 1, False
        while not second_done:
            dev, pool, buffers, call = _pool_freeing(how)
            hook, new = call_interrupted_at({first, second}, call, names, POOL_FILE)
            first_done, second_done = hook.fired == 0, hook.fired < 2
            reached = reached or hook.functions[second:second + 1] == ["_restore"]
            del new
            _check_freeing_left_the_books_right(
                dev, pool, buffers, (how, first, second, hook.functions[first:first + 1],
                                     hook.functions[second:second + 1]))
            second += 1
        first += 1
    assert reached  # second interrupts fell inside the restoring


class _Gate:
    """A recorded use (anything with ``is_done``) whose first query once :attr:`armed` tells
    ``reached`` and waits for ``go`` (bounded in real time), then says not done; later queries say
    done (before it is armed, not done: record_use looks for the attribute)."""

    def __init__(self):
        self.reached, self.go, self.asked, self.armed = threading.Event(), threading.Event(), 0, False

    @property
    def is_done(self) -> bool:
        if not self.armed:
            return False
        self.asked += 1
        if self.asked > 1:
            return True
        self.reached.set()
        assert self.go.wait(JOIN_S)
        return False


def test_a_take_back_marks_pending_again_only_the_blocks_it_still_claims():
    """One thread's take-back frees a block, then waits on another block's use; meanwhile the freed
    block is handed out, dropped and claimed by a second thread's take-back. The first must leave
    that block to the second when it ends: marked pending again, a third take-back would free it
    too (checked twice at once, listed twice in the cache, handed out twice)."""
    dev = rf.device("sim")
    pool = HostPool(dev)
    first, second = pool.empty(4096, np.uint8), pool.empty(8192, np.uint8)
    slow = _Gate()
    pool.record_use(second, slow)
    slow.armed = True
    buf = pool.buffer_of(first)
    del first, second  # first is dropped first: claimed, and freed, before second's use is asked about
    a = start(pool.collect)
    assert slow.reached.wait(JOIN_S)
    again = pool.empty(4096, np.uint8)
    assert pool.buffer_of(again) is buf  # freed by the first take-back
    held = _Gate()
    pool.record_use(again, held)
    held.armed = True
    del again
    b = start(pool.collect)
    assert held.reached.wait(JOIN_S)  # the second take-back checks it now
    slow.go.set()
    assert join([a]) == [4096]
    assert pool.collect() == 8192  # only second's block: the other is the second take-back's
    held.go.set()
    assert join([b]) == [0]
    assert pool.collect() == 4096
    st = pool.stats()
    assert (st.cached_bytes, st.pending_bytes, st.in_use_bytes) == (4096 + 8192, 0, 0)
    assert [len(bucket) for bucket in pool._free.values() if bucket] == [1, 1]


def test_record_use_refuses_an_event_of_another_device():
    """An event of another device cannot tell when this device's copy of the array is done: it
    was taken, and the block could be handed out again under a copy still running."""
    dev, other = rf.device("sim"), rf.device("sim")
    pool = pool_for(dev)
    a = pool.empty(4, np.float32)
    theirs = other.create_stream().record()
    assert theirs.owner is other
    for record in (pool.record_use, rf.host.record_use):
        with pytest.raises(ValueError, match=r"record_use\(event=\.\.\.\): <SimEvent .*> was recorded on another "
                                             r"device object .*; record the event on a stream of .*after the copy"):
            record(a, theirs)
    with pytest.raises(ValueError, match=r"record_use\(event=\.\.\.\)"):
        pool.record_use(pool.buffer_of(a), theirs)
    assert pool._block_of(a).events == []  # nothing recorded
    assert pool.record_use(a, dev.create_stream().record()) is True  # its own device's event is taken


def test_a_closed_devices_pool_counts_nothing_once_its_arrays_are_dropped():
    """The device's close took the pool's memory with it. Its arrays' returns were left queued,
    so ``stats()`` counted their bytes in use, and ``live()`` their blocks, for good; the pool's
    books now let go of a dropped array's block and of the cache, touching no device."""
    dev = rf.device("sim")
    pool = pool_for(dev)
    kept, cached = pool.empty(1000, np.float32), pool.empty(5000, np.float32)
    kept[:] = 1
    del cached
    pool.collect()
    dev.close()
    assert pool.stats().in_use_bytes == 4096  # an array still alive
    kept[:] = 2  # still host memory on the simulated GPU
    del kept
    gc.collect()
    s = pool.stats()
    assert (s.held_bytes, s.cached_bytes, s.in_use_bytes, s.pending_bytes) == (0, 0, 0, 0), s
    assert dev.live().pooled_host_buffers == 0 and not pool._returned


def test_budgets_set_for_every_pool_from_two_threads_at_once_leave_every_pool_at_the_last_one(monkeypatch):
    """``rf.host.set_budget(n)`` without a device from two threads: the first set the default,
    then (held here as it applied it to the pools) the second set and applied its own, and the
    first then applied its older one over it: the pools kept one budget, pools made later got
    the other. Now the calls go one at a time."""
    import linecache
    import sys

    dev = rf.device("sim")
    pool = pool_for(dev)
    saved = host_pool._default_budget  # restored after, with every pool's budget
    before = saved or host_pool.default_budget()
    entered, release = threading.Event(), threading.Event()
    original = HostPool.set_budget

    def held_once(self, nbytes):
        if threading.current_thread().name == "first" and not entered.is_set():
            entered.set()
            release.wait(JOIN_S)
        return original(self, nbytes)

    monkeypatch.setattr(HostPool, "set_budget", held_once)
    try:
        first = start(rf.host.set_budget, 1 << 20, name="first")
        assert entered.wait(JOIN_S)
        second = start(rf.host.set_budget, 16 << 20, name="second")

        def waiting_its_turn():  # blocked on a lock in set_default_budget (a place, not a time)
            frame = sys._current_frames().get(second.thread.ident)
            return frame is not None and frame.f_code.co_name == "set_default_budget" and \
                "lock" in linecache.getline(frame.f_code.co_filename, frame.f_lineno)

        tick = threading.Event()
        for _ in range(int(JOIN_S / 0.001)):
            if second.done() or waiting_its_turn():
                break
            tick.wait(0.001)
        release.set()
        join([first, second])
        assert pool.stats().budget == host_pool._default_budget
        assert pool_for(rf.device("sim")).stats().budget == host_pool._default_budget
    finally:
        release.set()
        monkeypatch.undo()
        host_pool.set_default_budget(before)
        host_pool._default_budget = saved


def test_physical_memory_and_the_default_budget_where_the_system_does_not_say(monkeypatch):
    """physical_memory() is the host's bytes (a page size times the pages); where sysconf raises
    or reports nothing it is None, and the pool's default budget is then 4 GiB."""
    ram = host_pool.physical_memory()
    assert isinstance(ram, int) and ram > 0 and ram % os.sysconf("SC_PAGE_SIZE") == 0
    assert host_pool.default_budget() == min(4 << 30, ram // 4)
    for broken in (lambda name: (_ for _ in ()).throw(ValueError(name)), lambda name: -1):
        monkeypatch.setattr(os, "sysconf", broken)
        assert host_pool.physical_memory() is None
        assert host_pool.default_budget() == 4 << 30
