"""How far a map pulls its input ahead of its consumer: a map stopped early (a break, a close of
its iterator, a failure raised with ``on_error="raise"``) has asked its input for no item beyond
what its window held when it stopped. Each input counts its pulls and raises at the first pull
past that window, so a map that asked for one more item raises that error instead of ending."""

from __future__ import annotations

import asyncio
import concurrent.futures

import numpy as np
import pytest

import ringflow as rf
from tests.helpers.maps import take_each

FAIL = -5.0  # an item whose first element is this makes the compute raise


def f(x, y):
    if x.reshape(-1)[0] == FAIL:
        raise ValueError("marked item")
    y[...] = x * 2 + 1


class PulledTooFar(Exception):
    """The input was asked for an item past the map's window."""


class Counted:
    """An endless input of float32 arrays of ``elems`` elements (item ``fail``, if any, marked to
    fail): :attr:`pulled` counts the items it gave; asked for item ``limit`` (counted from 0) it
    raises :class:`PulledTooFar`. Iterated sync or async (``__aiter__``, a pull in a task of its
    own while the map hands a result out)."""

    def __init__(self, limit: int, elems: int = 16, fail: "int | None" = None):
        self.limit, self.elems, self.fail = limit, elems, fail
        self.pulled = 0

    def _next(self) -> np.ndarray:
        i = self.pulled
        if i == self.limit:
            raise PulledTooFar(f"item {i} asked for: the window held {self.limit}")
        self.pulled += 1
        return np.full(self.elems, FAIL if i == self.fail else float(i), np.float32)

    def __iter__(self):
        while True:
            yield self._next()

    async def _items(self):
        while True:
            await asyncio.sleep(0)
            yield self._next()

    def __aiter__(self):
        return self._items()


def _take(pipe, face: str, source: Counted, k: int, how: str) -> list:
    """``k`` results of ``pipe``'s ``face`` ("map", "amap", or "amap-async": of an async input)
    over ``source``, then the map stopped as ``how`` says: "break" (out of the loop, the map
    dropped), "close" (its iterator closed), or "raise" (the next result is a failure, raised)."""
    got: list = []
    if face == "map":
        results = pipe.map(source)
        for r in results:
            got.append(r)
            if len(got) == k and how != "raise":
                break
        if how == "close":
            results.close()
        return got

    async def main():
        results = pipe.amap(source if face == "amap-async" else iter(source))
        async for r in results:
            got.append(r)
            if len(got) == k and how != "raise":
                break
        if how == "close":
            await results.aclose()
        return got

    return asyncio.run(main())


@pytest.mark.parametrize(("k", "how"), [(1, "break"), (4, "break"), (1, "close"), (4, "close"),
                                        (0, "raise"), (1, "raise"), (4, "raise")])
@pytest.mark.parametrize("face", ["map", "amap", "amap-async"])
@pytest.mark.parametrize("max_in_flight", [1, 3])
def test_a_map_stopped_early_pulled_no_item_past_its_window(max_in_flight, face, k, how):
    """Items of chunks of their own: a map holds at most ``max_in_flight`` items accepted and not
    handed out, the one it hands out among them. Stopped after ``k`` results it has pulled
    ``k + max_in_flight - 1`` items, exactly for ``map`` (it pulls as capacity frees up, before
    each result), at most for ``amap`` (which hands a result that is ready out before it pulls,
    so its window may not be full); a failure raised as the result after ``k`` is the map's
    ``k + 1``-th outcome, so ``k + max_in_flight`` then. No further item is ever asked for."""
    window = k + max_in_flight - (0 if how == "raise" else 1)
    source = Counted(limit=window, fail=k if how == "raise" else None)
    with rf.Pipeline(f, device=rf.device("sim", seed=k), chunk_bytes=1 << 12, max_in_flight=max_in_flight,
                     coalesce=False, on_error="raise", checked=True) as pipe:
        if how == "raise":
            with pytest.raises(rf.StageError, match="marked item"):
                _take(pipe, face, source, k, how)
        else:
            got = _take(pipe, face, source, k, how)
            assert [r[0] for r in got] == [2 * i + 1 for i in range(k)]
    if face == "map":
        assert source.pulled == window
    else:
        assert k <= source.pulled <= window


@pytest.mark.parametrize("how", ["break", "close"])
@pytest.mark.parametrize("max_in_flight", [1, 2])
@pytest.mark.parametrize("k", [1, 2, 5])
def test_a_map_of_items_sharing_chunks_stopped_early_pulled_no_item_past_its_bytes(k, max_in_flight, how):
    """Items sharing chunks hold no capacity once their chunk ended, so ``map`` bounds their bytes
    held (accepted, not handed out) by ``max_in_flight * chunk_bytes``: items of 1 KiB and chunks
    of 4 KiB, ``4 * max_in_flight`` of them. With that many held it pulled one more item, which
    could not be taken, before it handed a result out: stopped after ``k`` results it had asked
    its input for an item past its window (this input raised then). It pulls no item while the
    bytes held are at their bound, so it has pulled ``k + 4 * max_in_flight - 1``."""
    window = k + 4 * max_in_flight - 1
    source = Counted(limit=window, elems=256)
    with rf.Pipeline(f, device=rf.device("sim", seed=k), chunk_bytes=1 << 12, max_in_flight=max_in_flight,
                     checked=True) as pipe:
        got = _take(pipe, "map", source, k, how)
        assert pipe.scheduler.chunks_admitted < window  # the items shared chunks
    assert [r[0] for r in got] == [2 * i + 1 for i in range(k)]
    assert source.pulled == window


@pytest.mark.parametrize("max_in_flight", [1, 2])
@pytest.mark.parametrize("k", [1, 5])
def test_a_map_of_items_sharing_chunks_pulls_the_item_whose_bytes_would_pass_the_bound(k, max_in_flight):
    """Where the bytes held are under their bound but the next item's would pass it, ``map`` learns
    so only once it has that item: it pulls it and holds it back until a result is handed out. So
    with items of 1000 bytes (``4096 * max_in_flight // 1000`` of them fit) a map stopped after
    ``k`` results has pulled one item more than it accepted, and no other."""
    fit = (4096 * max_in_flight) // 1000
    window = k + fit - 1
    source = Counted(limit=window + 2, elems=250)  # (one more is pulled; two more is a fault)
    with rf.Pipeline(f, device=rf.device("sim", seed=k), chunk_bytes=1 << 12, max_in_flight=max_in_flight,
                     checked=True) as pipe:
        got = _take(pipe, "map", source, k, "break")
        stats = pipe.stats()
    assert [r[0] for r in got] == [2 * i + 1 for i in range(k)]
    assert source.pulled == window + 1
    assert stats.accepted == window  # the item pulled last was not run


@pytest.mark.parametrize("face", ["map", "amap", "amap-async"])
@pytest.mark.parametrize("k", [1, 3])
def test_a_map_cut_short_with_nothing_pending_asks_its_input_for_one_more_item(k, face):
    """A map whose pipeline was cancelled under it, with nothing of its own pending (here
    ``max_in_flight=1``: the cancel comes after its ``k``-th result), ends as its input does where
    that is used up and is cut short otherwise: to tell, it asks its input for one more item,
    which it does not run. That one pull, and no other, comes after the cancel."""
    source = Counted(limit=k + 1)
    with rf.Pipeline(f, device=rf.device("sim", seed=k), chunk_bytes=1 << 12, max_in_flight=1, coalesce=False,
                     checked=True) as pipe:
        got: list = []

        def take(r):
            got.append(r)
            if len(got) == k:
                pipe.cancel()

        with pytest.raises(concurrent.futures.CancelledError, match="cut short"):
            if face == "map":
                for r in pipe.map(source):
                    take(r)
            else:
                async def main():
                    async for r in pipe.amap(source if face == "amap-async" else iter(source)):
                        take(r)

                asyncio.run(main())
        stats = pipe.stats()
    assert [r[0] for r in got] == [2 * i + 1 for i in range(k)]
    assert source.pulled == k + 1
    assert stats.accepted == k


@pytest.mark.parametrize("how", ["break", "close"])
@pytest.mark.parametrize("max_in_flight", [1, 2])
@pytest.mark.parametrize("k", [1, 2, 5])
@pytest.mark.parametrize("face", ["amap", "amap-async"])
def test_an_amap_of_items_sharing_chunks_stopped_early_pulled_no_item_past_its_bytes(face, k, max_in_flight, how):
    """``amap`` bounds items sharing chunks as ``map`` does, by their bytes held (accepted, not
    handed out): ``max_in_flight * chunk_bytes``, here ``4 * max_in_flight`` items of 1 KiB. It
    hands a ready result out before it pulls, so stopped after ``k`` results it has pulled at
    most ``k + 4 * max_in_flight - 1``, and never an item past that."""
    window = k + 4 * max_in_flight - 1
    source = Counted(limit=window, elems=256)
    with rf.Pipeline(f, device=rf.device("sim", seed=k), chunk_bytes=1 << 12, max_in_flight=max_in_flight,
                     checked=True) as pipe:
        got = _take(pipe, face, source, k, how)
    assert [r[0] for r in got] == [2 * i + 1 for i in range(k)]
    assert k <= source.pulled <= window


@pytest.mark.parametrize("ordered", [True, False])
def test_an_amap_of_small_items_runs_as_far_ahead_as_map(ordered):
    """Items sharing chunks hold no capacity once their chunk ended: a window of ``max_in_flight``
    items (not bytes) kept a few small items in flight, each chunk shared by few of them, so an
    ``amap`` of many small items ran in many more chunks, and slower, than ``map`` of the same.
    Both bound such items by their bytes: about the same chunks, near the same simulated time."""
    def g(x, y):
        y[...] = x * 2

    g.sim_seconds = 5e-6
    items = [np.full(1024, i, np.float32) for i in range(1500)]
    runs = {}
    for face in ("map", "amap"):
        dev = rf.device("sim", seed=1)
        with rf.Pipeline(g, device=dev, chunk_bytes=1 << 18, ordered=ordered, checked=True) as pipe:
            start, out = dev.now, []
            take_each(pipe, face, items, out.append)
            runs[face] = (dev.now - start, pipe.scheduler.chunks_admitted)
        assert sorted(r[0] for r in out) == [2 * i for i in range(len(items))]
    (map_s, map_chunks), (amap_s, amap_chunks) = runs["map"], runs["amap"]
    # (how many items join a chunk while it is open depends on when the loop's thread runs
    # against the progress thread's: bounded by count, 4.8x the chunks and 1.22x the time)
    assert amap_chunks <= 2 * map_chunks, runs
    assert amap_s <= 1.1 * map_s, runs
