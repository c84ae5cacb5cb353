"""``Pipeline(device=[...])``: one pipeline per device behind one face, items spread by load."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import signal
import threading
import time

import numpy as np
import pytest

import ringflow as rf
from ringflow._pipeline.spread import SpreadPipeline
from tests.helpers.maps import take_each
from tests.helpers.pipeline_checks import check_map_refuses_not_iterable, take_all
from tests.helpers.interrupts import CtrlCWhileStalled
from tests.helpers.threads import JOIN_S, hold_progress_thread, join, stack_names, start


def f(x, y):
    y[...] = x * 2 + 1


f.sim_seconds = 50e-6


def items_of(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(int(rng.integers(1, 500))).astype(np.float32) for _ in range(n)]


def sims(n, seed=0):
    return [rf.device("sim", chaos=True, seed=seed + k, checked=True) for k in range(n)]


@pytest.mark.parametrize("n_devices", [1, 2, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_one_two_and_four_devices_give_the_same_results_under_chaos(n_devices, seed):
    items = items_of(80, seed)
    with rf.Pipeline(f, device=sims(n_devices, seed), chunk_bytes=4096, checked=True) as pipe:
        assert isinstance(pipe, SpreadPipeline) == (n_devices > 1) and isinstance(pipe, rf.Pipeline)
        out = list(pipe.map(items))
        futs = [pipe.submit(a) for a in items[:20]]
        from_futures = [fu.result() for fu in futs]
    for a, r in zip(items + items[:20], out + from_futures):
        np.testing.assert_array_equal(r, a * 2 + 1)
    if n_devices > 1:
        used = [p.stats().delivered for p in pipe.parts]
        assert all(u > 0 for u in used) and sum(used) == 100
    s = pipe.stats()
    assert (s.accepted, s.delivered, s.in_flight) == (100, 100, 0)


def test_unordered_map_and_asyncio_over_two_devices():
    items = items_of(40, 3)
    with rf.Pipeline(f, device=sims(2, 3), chunk_bytes=4096, ordered=False) as pipe:
        out = list(pipe.map(items))
        got = sorted(tuple(r) for r in out)
        assert got == sorted(tuple(a * 2 + 1) for a in items)

        async def go():
            return [r async for r in pipe.amap(items[:10])] + [await pipe.asubmit(items[0])]

        res = asyncio.run(go())
    # (as they end: in any order)
    assert sorted(tuple(r) for r in res[:10]) == sorted(tuple(a * 2 + 1) for a in items[:10])
    np.testing.assert_array_equal(res[10], items[0] * 2 + 1)


def test_an_unordered_spread_amap_hands_a_result_out_while_an_earlier_item_still_runs():
    """With ``ordered=False`` the amap over two devices hands out the second item's result (on the
    other device) while the first item's compute still runs: that compute waits for the consumer
    to have taken a result. Ordered, it would hand the first item's result out first, once the
    compute gave up waiting."""
    gate = threading.Event()
    waited: list = []

    def gated(x, y):
        if x[0] == 0.0:
            waited.append(gate.wait(10.0))
        y[...] = x * 2 + 1

    pipe = rf.Pipeline(gated, device=sims(2, 7), chunk_bytes=4096, max_in_flight=1, ordered=False)
    items = [np.arange(16, dtype=np.float32) + 100 * k for k in range(6)]

    async def main():
        got = []
        async for r in pipe.amap(items):
            got.append(r)
            gate.set()
        return got

    try:
        got = asyncio.run(main())
    finally:
        gate.set()
        pipe.close()
    assert waited == [True]  # the first item's compute was let go by the consumer, not by its time limit
    assert got[0][0] != 1.0  # (the first item's result starts at 0 * 2 + 1)
    assert sorted(r[0] for r in got) == sorted(a[0] * 2 + 1 for a in items)


def test_a_broken_device_fails_its_chunks_and_the_others_go_on():
    devs = sims(2, 5)
    items = items_of(60, 5)
    with rf.Pipeline(f, device=devs, chunk_bytes=4096, on_error="continue") as pipe:
        first = [pipe.submit(a) for a in items[:20]]
        devs[0].inject_sticky_error()
        later = [pipe.submit(a) for a in items[20:]]
        outcomes = [fu.exception() for fu in first + later]
    failed = [i for i, e in enumerate(outcomes) if e is not None]
    assert failed and all(i < 20 for i in failed)  # only chunks the broken device held
    for i, fu in enumerate(first + later):
        if outcomes[i] is None:
            np.testing.assert_array_equal(fu.result(), items[i] * 2 + 1)
    assert pipe.parts[1].stats().delivered >= 40  # every later item went to the device that works


def test_a_device_found_broken_by_a_submit_while_idle_is_passed_over_from_then_on():
    """A device that breaks while it has no chunks has no step to find it: the first submit that
    tries it (its staging copy raises the sticky error) goes to the next device and hands the
    error to that device's progress thread, which marks it broken; later submits pass it over
    instead of trying it first (it is the least loaded) and failing there, item after item."""
    devs = sims(2, 8)
    items = items_of(12, 8)
    with rf.Pipeline(f, device=devs, chunk_bytes=4096) as pipe:
        np.testing.assert_array_equal(pipe.submit(items[0]).result(), items[0] * 2 + 1)
        devs[0].inject_sticky_error()
        tried = []
        for part in pipe.parts:
            offer = part._submit_if_room
            part._submit_if_room = lambda item, offer=offer, part=part: (tried.append(part), offer(item))[1]
        futs = []
        while pipe.parts[0] not in tried:  # (ties go in turn: the first may go to the other device)
            assert len(futs) < 3, tried
            futs.append(pipe.submit(items[1 + len(futs)]))
        broken = pipe.parts[0]._sched
        deadline = time.monotonic() + JOIN_S
        while broken.broken is None:  # (the break is handed to its progress thread, not waited for)
            assert time.monotonic() < deadline, "the broken device was never marked broken"
            time.sleep(0.001)
        futs += [pipe.submit(a) for a in items[1 + len(futs):]]
        assert tried.count(pipe.parts[0]) == 1, tried
        for a, fu in zip(items[1:], futs):
            np.testing.assert_array_equal(fu.result(), a * 2 + 1)


def test_with_on_error_raise_a_broken_device_stops_the_map():
    devs = sims(2, 6)
    with rf.Pipeline(f, device=devs, chunk_bytes=4096) as pipe:
        it = pipe.map(items_of(200, 6))
        next(it)
        devs[1].inject_sticky_error()
        with pytest.raises((rf.DeviceError, rf.StageError)):
            list(it)


def test_threads_submitting_at_once():
    items = items_of(200, 7)
    results = [None] * len(items)
    with rf.Pipeline(f, device=sims(2, 7), chunk_bytes=4096) as pipe:
        def work(k):
            for i in range(k, len(items), 4):
                results[i] = pipe.submit(items[i]).result()

        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert all(np.array_equal(r, a * 2 + 1) for r, a in zip(results, items))


def test_a_report_has_a_trace_per_device(tmp_path):
    with rf.Pipeline(f, device=sims(2, 8), chunk_bytes=4096, profile=True, coalesce=False) as pipe:
        list(pipe.map(items_of(30, 8)))  # a chunk per item: the report counts chunks
    rep = pipe.report()
    assert len(rep.reports) == 2 and rep.chunks == 30 and rep.simulated
    trace = rep.to_chrome()
    assert {ev["pid"] for ev in trace["traceEvents"]} == {1, 2}
    assert rep.save_trace(str(tmp_path / "t.json")).endswith("t.json")


def test_cancel_and_close_reach_every_device_and_leave_nothing():
    devs = sims(2, 9)
    pipe = rf.Pipeline(f, device=devs, chunk_bytes=4096)
    futs = [pipe.submit(a) for a in items_of(30, 9)]
    pipe.cancel()
    pipe.close()
    pipe.close()
    assert all(fu.done() for fu in futs)
    assert all(d.live().total == 0 for d in devs)
    with pytest.raises(RuntimeError, match="closed"):
        pipe.submit(np.ones(3, np.float32))
    assert "over" in repr(pipe)


def test_the_report_plots_a_track_group_per_device(tmp_path):
    pytest.importorskip("matplotlib")
    with rf.Pipeline(f, device=sims(2, 10), chunk_bytes=4096, profile=True) as pipe:
        list(pipe.map(items_of(20, 10)))
    fig = pipe.report().plot(str(tmp_path / "two.png"))
    assert len(fig.axes) == 2 and (tmp_path / "two.png").stat().st_size > 1000


def test_the_report_refuses_a_plot_type_matplotlib_cannot_write_before_drawing(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    with rf.Pipeline(f, device=sims(2, 10), chunk_bytes=4096, profile=True) as pipe:
        list(pipe.map(items_of(4, 10)))
    report = pipe.report()

    def drawn(*args, **kwargs):
        raise AssertionError("a chart was drawn for a file type that cannot be written")

    monkeypatch.setattr(rf.Report, "plot", drawn)
    with pytest.raises(ValueError, match=r"plot: matplotlib cannot write \.txt files .*\.png"):
        report.plot(str(tmp_path / "two.txt"))
    assert not (tmp_path / "two.txt").exists()


@pytest.mark.parametrize("items", [5, None, 2.5], ids=repr)
def test_map_of_something_not_iterable_is_refused_at_once_naming_items_as_on_one_device(items):
    with rf.Pipeline(f, device=sims(2), chunk_bytes=4096) as pipe:
        check_map_refuses_not_iterable(pipe, items)
        a = items_of(1)[0]
        np.testing.assert_array_equal(list(pipe.map([a]))[0], a * 2 + 1)
    assert pipe.stats().in_flight == 0

def test_a_subclass_given_several_devices_says_it_runs_on_one():
    class Mine(rf.Pipeline):
        pass

    with pytest.raises(TypeError, match="Mine runs on one device"):
        Mine(f, device=sims(2, 11), chunk_bytes=4096)
    with Mine(f, device=sims(1, 11), chunk_bytes=4096) as pipe:  # a list of one is that device
        np.testing.assert_array_equal(pipe.submit(np.ones(3, np.float32)).result(), np.full(3, 3, np.float32))


@pytest.mark.parametrize("on_error", ["raise", "continue"])
def test_map_and_amap_end_alike_when_the_pipeline_is_cancelled_under_them(on_error):
    """A cancel from another thread (here the consumer of the fifth result) ends an ordered map
    and an amap the same way: after the results already out, with the map's own
    concurrent.futures.CancelledError saying it was cut short, never with asyncio's (which an
    asyncio caller would take for its own task's cancellation)."""
    outcomes = {}
    for face in ("map", "amap"):
        devs = sims(2, 4)
        pipe = rf.Pipeline(f, device=devs, chunk_bytes=4096, on_error=on_error, max_in_flight=4)
        items = items_of(40, 4)
        got = []

        def take(r):
            got.append(r)
            if len(got) == 5:  # joined: the cancel lands before the map could have run to its end
                canceller = threading.Thread(target=pipe.cancel)
                canceller.start()
                canceller.join(60)

        with pytest.raises(concurrent.futures.CancelledError, match="cut short .* the pipeline was cancelled") as info:
            take_each(pipe, face, items, take)
        assert f"after handing out {len(got)} result" in str(info.value), (str(info.value), len(got))
        pipe.close()
        # in order; with on_error="continue" a cancelled item is skipped, so the results are the
        # expected ones with some left out
        expected = iter(a * 2 + 1 for a in items)
        assert all(any(np.array_equal(r, e) for e in expected) for r in got)
        outcomes[face] = len(got) < len(items)
        assert all(d.live().total == 0 for d in devs)
    assert outcomes == {"map": True, "amap": True}


def test_a_map_stopped_early_cancels_what_it_took_with_one_hand_over_a_device():
    devs = sims(2, seed=21)
    items = [np.arange(64, dtype=np.float32) + i for i in range(40)]
    with rf.Pipeline(f, device=devs, chunk_bytes=512, slots=2, max_in_flight=6, checked=True) as pipe:
        gen = pipe.map(items)
        assert np.array_equal(next(gen), items[0] * 2 + 1)
        calls: list = []
        for part in pipe.parts:
            real = part._driver.command
            part._driver.command = lambda fn, _real=real, **kw: (calls.append(fn), _real(fn, **kw))[1]
        gen.close()
        assert 1 <= len(calls) <= 2
    s = pipe.stats()
    assert s.in_flight == 0 and s.balanced() and s.cancelled >= 1
    assert s.delivered + s.cancelled == s.accepted < len(items)


def _interrupting(x, y):
    if x[0] == -1:
        raise KeyboardInterrupt("raised by this item's compute")
    y[...] = x * 2 + 1


@pytest.mark.parametrize("face", ["map", "amap"])
def test_with_continue_an_item_whose_compute_raised_keyboard_interrupt_is_skipped_as_on_one_device(face):
    items = [np.full(8, -1.0 if i == 3 else float(i), np.float32) for i in range(8)]
    for devs in (sims(1, seed=31)[0], sims(2, seed=31)):
        with rf.Pipeline(_interrupting, device=devs, chunk_bytes=512, on_error="continue", coalesce=False) as pipe:
            got = take_all(pipe, items, face)
            assert [float(r[0]) for r in got] == [i * 2 + 1.0 for i in range(8) if i != 3]
            assert len(pipe.failures) == 1
            assert isinstance(pipe.failures[0].__cause__, KeyboardInterrupt)


def test_ctrl_c_in_the_callers_wait_ends_that_map_only():
    """A Ctrl-C while the caller waits in a map over two devices is the caller's, not a chunk's:
    the map raises it and cancels what it took; the pipeline still takes work."""
    from _thread import interrupt_main

    fired = []

    def consume(index, item, view):
        if index == 2 and not fired:
            fired.append(index)
            interrupt_main()  # lands in the main thread's wait for a result
        return np.array(view)

    items = [np.full(8, float(i), np.float32) for i in range(30)]
    with rf.Pipeline(f, device=sims(2, seed=33), chunk_bytes=512, slots=1, max_in_flight=3, consume=consume,
                     coalesce=False) as pipe:
        with pytest.raises(KeyboardInterrupt):
            for _ in pipe.map(items):
                pass
        assert np.array_equal(pipe.submit(items[0]).result(timeout=30), items[0] * 2 + 1)
    s = pipe.stats()
    assert s.in_flight == 0 and s.balanced() and s.failed == 0


def _fails_on_negative(x, y):
    if x[0] < 0:
        raise ValueError("negative item")
    y[...] = x * 2 + 1


@pytest.mark.parametrize("face", ["map", "amap"])
@pytest.mark.parametrize("seed,bad_at", [(1, 2), (3, 9), (5, 2)])
def test_a_failure_stops_a_spread_map_with_its_error_not_quietly(face, seed, bad_at):
    """With ``on_error="raise"`` a part's failure cancels that part's other chunks, earlier ones
    too: the map meets a cancelled chunk first, and must still raise the failure (as one device's
    map does), not end quietly with fewer results."""
    pipe = rf.Pipeline(_fails_on_negative, device=sims(2, seed), chunk_bytes=512, slots=2, max_in_flight=6)
    items = [np.arange(16.0) + 100 * k for k in range(20)]
    items[bad_at] = -items[bad_at] - 1
    got: list = []
    with pytest.raises(rf.StageError, match="negative item"):
        if face == "map":
            got.extend(pipe.map(items))
        else:
            async def go():
                async for r in pipe.amap(items):
                    got.append(r)

            asyncio.run(go())
    pipe.close()
    assert len(got) < bad_at + 1
    for r, a in zip(got, items):
        np.testing.assert_array_equal(r, a * 2 + 1)
    s = pipe.stats()
    assert s.failed == 1 and s.in_flight == 0 and s.balanced(), s


def test_a_timed_out_spread_amap_cancels_its_own_window_not_the_pipeline():
    """The consuming task cancelled (by ``asyncio.timeout``) just as the chunk at the head of its
    window ended: the task's cancellation, not a failure; the pipeline takes work after it."""
    pipe = rf.Pipeline(f, device=sims(2, 1), chunk_bytes=4096, slots=2, max_in_flight=4)
    items = items_of(400, 4)

    async def main():
        for trial in range(60):
            try:
                async with asyncio.timeout(0.0005 * (trial % 20 + 1)):
                    async for _ in pipe.amap(items):
                        pass
            except TimeoutError:
                pass
            got = await pipe.asubmit(items[0])  # RuntimeError if the pipeline was cancelled
            np.testing.assert_array_equal(got, items[0] * 2 + 1)

    asyncio.run(main())
    pipe.close()
    s = pipe.stats()
    assert s.failed == 0 and s.in_flight == 0 and s.balanced(), s


@pytest.mark.parametrize("coalesce", [False, True])
def test_indices_are_submission_indices_across_the_devices(coalesce):
    """Each part numbered its own chunks: item 5's StageError said chunk 2, and device results
    over two devices came back numbered 0, 0, 1, 1, ..."""
    devs = [rf.device("sim"), rf.device("sim")]

    def bad(x, y):
        if x[0] in (5, 6):
            raise ValueError(f"value {x[0]}")
        y[...] = x

    with rf.Pipeline(bad, device=devs, on_error="continue", coalesce=coalesce) as p:
        futs = [p.submit(np.full(4, i, np.float32)) for i in range(10)]
        failed = {i: fut.exception().index for i, fut in enumerate(futs) if fut.exception() is not None}
    assert failed == {5: 5, 6: 6}
    with rf.Pipeline(lambda x, y: y.__setitem__(..., x), device=devs, deliver="device") as p:
        indices = []
        for r in p.map(np.full(4, i, np.float32) for i in range(8)):
            indices.append(r.index)
            r.release()
    assert indices == list(range(8))


@pytest.mark.parametrize("call", ("map", "amap"))
@pytest.mark.parametrize("stage", ("prepare", "compute"))
def test_a_part_failure_that_ends_a_map_keeps_its_cause(stage, call):
    """A map that finds its chunk cancelled by another part's failure raises that failure: it was
    raised 'from None', which cleared the StageError's own __cause__ (the user's exception) for
    this caller and for every later reader of pipe.failures."""
    def prepare(item):
        if item[0] == 2.0 and stage == "prepare":
            raise ValueError("the user's")
        return item

    def compute(x, y):
        if x[0] == 2.0 and stage == "compute":
            raise ValueError("the user's")
        y[...] = x * 2

    devs = sims(2, seed=3)
    pipe = rf.Pipeline(compute, device=devs, chunk_bytes=256, slots=2, prepare=prepare)
    items = [np.full(4, float(k)) for k in range(5)]

    async def collect():
        return [r async for r in pipe.amap(items)]

    with pytest.raises(rf.StageError) as info:
        list(pipe.map(items)) if call == "map" else asyncio.run(collect())
    assert info.value.stage == stage and isinstance(info.value.__cause__, ValueError), repr(info.value.__cause__)
    assert all(isinstance(e.__cause__, ValueError) for e in pipe.failures)
    del info
    pipe.close()


@pytest.mark.parametrize("how", ["map", "amap"])
def test_a_1d_array_handed_to_map_over_two_devices_warns_as_on_one(how):
    x = np.arange(4, dtype=np.float32)
    with rf.Pipeline(f, device=sims(2), chunk_bytes=4096) as pipe, pytest.warns(UserWarning, match="each element"):
        out = take_all(pipe, x, how)
    assert len(out) == 4


def _after_the_first_item_ended(pipe, items, pulled):
    """Yield ``items``, recording in ``pulled`` how many were taken; the second is given only once
    the first item's chunk has ended (its result ready to hand out), and every later one at once.
    The wait blocks the caller's thread (an event loop's too) while it drives the part the first
    item went to (the first: every part was idle), so what the map does next is decided once the
    first result is ready, whatever the timing of the progress threads."""
    first = getattr(pipe, "parts", [pipe])[0]
    for k, item in enumerate(items):
        if k == 1:
            first._drive_until(lambda: first._sched.stats().delivered >= 1)
        pulled.append(k)
        yield item


@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("max_in_flight", [4, 16])
@pytest.mark.parametrize("face,n_devices", [("map", 2), ("amap", 1), ("amap", 2), ("amap-async", 1),
                                            ("amap-async", 2)])
def test_a_ready_result_is_handed_out_before_the_map_takes_more_items(face, n_devices, max_in_flight, ordered):
    """The first item's result is ready by the time the second item is given, and every later
    item comes at once: the map hands that result out before it takes a third, whatever its
    window (``max_in_flight``, added up over the devices). The map over two devices took items
    until its whole window was full before it handed out the first result (its latency grew
    with the window), in each face; the amap of one device too, where the source never let the
    event loop run."""
    pipe = rf.Pipeline(f, device=sims(n_devices, 41), chunk_bytes=4096, max_in_flight=max_in_flight,
                       ordered=ordered)
    items = [np.full(16, float(k), np.float32) for k in range(3 * n_devices * max_in_flight)]
    pulled: list = []
    seen: list = []
    source = _after_the_first_item_ended(pipe, items, pulled)

    def consume():
        got = []
        for r in pipe.map(source):
            if not got:
                seen.append(len(pulled))
            got.append(r)
        return got

    async def aconsume():
        got = []
        src = source
        if face == "amap-async":
            async def agen():
                for item in source:  # (each item at once, but for the wait before the second)
                    yield item
            src = agen()
        async for r in pipe.amap(src):
            if not got:
                seen.append(len(pulled))
            got.append(r)
        return got

    try:
        got = join([start(consume if face == "map" else lambda: asyncio.run(aconsume()))], timeout=JOIN_S)[0]
    finally:
        pipe.close()
    assert seen and seen[0] <= 2, f"{seen[0]} items taken before the first result was handed out"
    assert sorted(r[0] for r in got) == sorted(a[0] * 2 + 1 for a in items)


@pytest.mark.parametrize("face", ["map", "amap"])
def test_two_maps_of_device_results_over_two_devices_both_finish(face):
    """Two maps on one pipeline of device results over two devices (threads, or amaps on one loop),
    each releasing every result at once. A map that took more items while its window held ready
    results waited for room those results held (their slots, lent): each map waited for the
    other's, for ever. Each now hands a ready result out before it takes another item, and does
    not wait for room while its window holds results (as one device's map and amap do)."""
    pipe = rf.Pipeline(f, device=sims(2, 12), chunk_bytes=1024, deliver="device")
    items = [np.full(8, i, np.float32) for i in range(60)]

    async def both():
        return await asyncio.gather(_amap_releasing_each(pipe, items), _amap_releasing_each(pipe, items))

    if face == "map":
        got = join([start(_map_releasing_each, pipe, items), start(_map_releasing_each, pipe, items)], timeout=JOIN_S)
    else:
        got = join([start(asyncio.run, both())], timeout=JOIN_S)[0]
    assert [len(g) for g in got] == [60, 60] and all(g == sorted(g) for g in got)  # each in its order
    pipe.close()
    s = pipe.stats()
    assert s.delivered == 120 and s.in_flight == 0 and s.balanced(), s


def _map_releasing_each(pipe, items) -> list:
    """``pipe.map(items)`` of device results, each released as soon as it is handed out; returns
    the results' indices in the order they came."""
    seen = []
    for res in pipe.map(items):
        seen.append(res.index)
        res.release()
    return seen


async def _amap_releasing_each(pipe, items) -> list:
    """As :func:`_map_releasing_each`, through ``pipe.amap(items)``."""
    seen = []
    async for res in pipe.amap(items):
        seen.append(res.index)
        res.release()
    return seen


def _map_on_a_thread_releasing_each(pipe, items, face: str) -> list:
    """:func:`_map_releasing_each` (``face`` "map") or :func:`_amap_releasing_each` under its own
    event loop (``face`` "amap") on another thread, waited for at most ``JOIN_S`` real seconds;
    returns the indices. Raises tests.helpers.threads.Hang if the map does not end in time."""
    if face == "map":
        return join([start(_map_releasing_each, pipe, items)], timeout=JOIN_S)[0]
    return join([start(asyncio.run, _amap_releasing_each(pipe, items))], timeout=JOIN_S)[0]


GATED = -1.0  # the first element of the item whose compute waits for the test's gate


def _gated_by(gate, let_go):
    def compute(x, y):
        if x[0] == GATED:
            let_go.append(gate.wait(JOIN_S))
        y[...] = x * 2 + 1

    return compute


def _indices_releasing_each(futs) -> list:
    """The indices of ``futs``' device results, in turn, each released once it has come."""
    got = []
    for fut in futs:
        res = fut.result()
        got.append(res.index)
        res.release()
    return got


def _map_beside_another_thread(pipe, source, face: str, other: list, gate: threading.Event) -> tuple:
    """:func:`_map_on_a_thread_releasing_each` over ``source``, then the thread that ``source``
    started (into ``other``) joined; ``gate`` set in any case, so that no compute stays held.
    Returns the map's indices and that thread's value."""
    try:
        seen = _map_on_a_thread_releasing_each(pipe, source, face)
        return seen, join(other, timeout=JOIN_S)[0]
    finally:
        gate.set()


@pytest.mark.parametrize("face", ["map", "amap"])
def test_a_map_whose_room_another_thread_took_after_it_looked_hands_its_results_out(face):
    """Results on the device, one device-out slot and room for two chunks a device. The map takes
    its first item (a compute held by a gate) to device 0 and its second to device 1, where it
    ends. The map looks, finds room, and pulls its third item; while it is pulled, that is
    between the look and the submit, the first item ends too and another thread submits four
    items, taking every room of both devices; their chunks wait for the device-out slot that
    each device lent the map's results. The map found no room then for the item it had pulled:
    it waited for room in its submit, room that only its own results, never handed out, could
    give back (a hang), where it now keeps the item, hands those results out first, and submits
    the item once there is room."""
    gate, let_go = threading.Event(), []
    pipe = rf.Pipeline(_gated_by(gate, let_go), device=sims(2, 17), chunk_bytes=1024, deliver="device",
                       slots=1, max_in_flight=2)
    first, second = pipe.parts
    mine = [np.full(8, GATED, np.float32)] + [np.full(8, k, np.float32) for k in range(1, 8)]
    others = [np.full(8, 100 + k, np.float32) for k in range(4)]
    filled = threading.Event()

    def other_thread():
        futs = [pipe.submit(b) for b in others]
        filled.set()
        return _indices_releasing_each(futs)

    other: list = []

    def source():
        yield mine[0]  # to the first device (both idle: the first in turn), held by the gate
        yield mine[1]  # to the second (the less loaded), where the map finds room
        # the map looked (the first item not ended, and room on both devices) before this pull
        second._drive_until(lambda: second._sched.stats().delivered >= 1)
        gate.set()
        first._drive_until(lambda: first._sched.stats().delivered >= 1)
        other.append(start(other_thread))
        assert filled.wait(JOIN_S)
        assert [p.stats().in_flight for p in pipe.parts] == [2, 2]  # no room left on either device
        yield from mine[2:]

    seen, theirs = _map_beside_another_thread(pipe, source(), face, other, gate)
    assert let_go == [True]
    assert len(seen) == len(mine) and seen == sorted(seen)  # every item, in order
    assert len(theirs) == len(others)
    pipe.close()
    s = pipe.stats()
    assert s.delivered == len(mine) + len(others) and s.in_flight == 0 and s.balanced(), s


@pytest.mark.parametrize("face", ["map", "amap"])
def test_on_one_device_a_map_whose_room_another_thread_took_after_it_looked_hands_its_results_out(face):
    """As the test above, on one device (room for two chunks, one device-out slot): the first
    item's compute is held by a gate, so the map finds room and pulls its second item; while it
    is pulled the first item ends (its result lent the device-out slot) and another thread's
    submits take the room that is left (map's results not handed out hold room of their own),
    their chunks waiting for that slot. The amap then waited for room in its submit (on the
    loop's executor), for ever; it now keeps the item and hands its result out first, as map
    does."""
    gate, let_go = threading.Event(), []
    pipe = rf.Pipeline(_gated_by(gate, let_go), device=sims(1, 19)[0], chunk_bytes=1024, deliver="device",
                       slots=1, max_in_flight=2)
    mine = [np.full(8, GATED, np.float32)] + [np.full(8, k, np.float32) for k in range(1, 6)]
    others = [np.full(8, 100 + k, np.float32) for k in range(2)]
    filled = threading.Event()

    def other_thread():
        futs = []
        try:
            for b in others:
                futs.append(pipe.submit(b, timeout=0))
        except TimeoutError:
            pass  # no room left (a submit that does not wait for room raises at once)
        filled.set()
        return _indices_releasing_each(futs)

    other: list = []

    def source():
        yield mine[0]  # held by the gate
        # the map looked (the first item not ended, and room) before this pull
        gate.set()
        pipe._drive_until(lambda: pipe._sched.stats().delivered >= 1)
        other.append(start(other_thread))
        assert filled.wait(JOIN_S)
        assert not pipe._sched.has_capacity()
        yield from mine[1:]

    seen, theirs = _map_beside_another_thread(pipe, source(), face, other, gate)
    assert let_go == [True]
    assert len(seen) == len(mine) and seen == sorted(seen)
    assert theirs  # (map: one, its result not handed out holding room; amap: two)
    pipe.close()
    s = pipe.stats()
    assert s.delivered == len(mine) + len(theirs) and s.in_flight == 0 and s.balanced(), s


def _stall_on(stalled: float, started: threading.Event, release: threading.Event):
    """A prepare that blocks (until ``release``) for the item whose first element is ``stalled``,
    setting ``started`` as it begins to."""

    def prepare(item):
        if float(item[0]) == stalled:
            started.set()
            assert release.wait(JOIN_S), "the stalled prepare was never released"
        return item

    return prepare


@pytest.mark.parametrize("face", ["submit", "asubmit"])
def test_a_submit_with_no_room_anywhere_takes_the_first_room_any_device_frees(face):
    """Room for one chunk a device: the first item goes to device 0, whose prepare of it does not
    return until the test says so, the second to device 1. The third finds no room on either;
    once device 0's stall has begun, device 1's chunk is finished by another thread's wait, and
    the third item goes there. It used to be sent to device 0 (equally loaded, first in turn)
    and to wait for room there only, for as long as that prepare stalled."""
    started, release, ready = threading.Event(), threading.Event(), threading.Event()
    pipe = rf.Pipeline(lambda x, y: np.copyto(y, x * 2 + 1), device=sims(2, 23),
                       prepare=_stall_on(0.0, started, release), chunk_bytes=512, slots=1, workers=1,
                       max_in_flight=1)
    first, second = pipe.parts
    try:
        futs = [pipe.submit(np.full(8, float(k))) for k in range(2)]
        assert [f._driver for f in futs] == [first._driver, second._driver]
        assert not any(p._sched.has_capacity() for p in pipe.parts)

        def third():
            try:
                if face == "submit":
                    return pipe.submit(np.full(8, 2.0))

                async def accept():
                    return await pipe._asubmit_future(np.full(8, 2.0))

                return asyncio.run(accept())
            finally:
                ready.set()

        def finish_second():
            # once the third submit waits (device 0's prepare began: only that wait runs it), or
            # it returned (it ran device 1 itself)
            assert ready.wait(JOIN_S)
            return futs[1].result()

        submitting = start(third)
        watcher = start(lambda: (started.wait(JOIN_S), ready.set()))
        finisher = start(finish_second)
        fut = join([submitting], timeout=JOIN_S)[0]
        assert fut._driver is second._driver  # device 1's room, not device 0's
        np.testing.assert_array_equal(join([finisher])[0], np.full(8, 3.0))
        assert not release.is_set() and not futs[0].done()  # device 0 still stalls
        release.set()
        np.testing.assert_array_equal(fut.result(timeout=JOIN_S), np.full(8, 5.0))
        np.testing.assert_array_equal(futs[0].result(timeout=JOIN_S), np.full(8, 1.0))
        join([watcher])  # (device 0's prepare began by now: this wait ran it, if the submit did not)
    finally:
        release.set()
        ready.set()
        pipe.close()
    s = pipe.stats()
    assert s.delivered == 3 and s.in_flight == 0 and s.balanced(), s


def _stall_each(started: "dict[float, threading.Event]", release: "dict[float, threading.Event]",
                breaks: "dict | None" = None):
    """A prepare that blocks, for each item whose first element is a key of ``started``, until
    that key's ``release`` event is set (setting its ``started`` event as it begins to); then,
    where ``breaks`` names a device for the key, breaks it (the prepare runs where the device's
    lock is held: another thread's inject_sticky_error would wait for it)."""

    def prepare(item):
        key = float(item[0])
        if key in started:
            started[key].set()
            assert release[key].wait(JOIN_S), "a stalled prepare was never released"
            if breaks and key in breaks:
                breaks[key].inject_sticky_error()
        return item

    return prepare


@contextlib.contextmanager
def _both_devices_full_and_stalled(seed: int):
    """Two simulated devices with room for one chunk each, filled by items 0.0 and 1.0 whose
    prepares stall (:func:`_stall_each`); yields ``(pipe, started, release)``, both keyed by
    item. Then those two results checked (once the body released the stalls), every stall
    released and the pipeline closed, with exactly those two accepted and delivered."""
    started = {k: threading.Event() for k in (0.0, 1.0)}
    release = {k: threading.Event() for k in (0.0, 1.0)}
    pipe = rf.Pipeline(lambda x, y: np.copyto(y, x * 2 + 1), device=sims(2, seed),
                       prepare=_stall_each(started, release), chunk_bytes=512, slots=1, workers=1, max_in_flight=1)
    try:
        futs = [pipe.submit(np.full(8, float(k))) for k in range(2)]
        yield pipe, started, release
        for k, fut in enumerate(futs):
            np.testing.assert_array_equal(fut.result(timeout=JOIN_S), np.full(8, 2.0 * k + 1))
    finally:
        for e in release.values():
            e.set()
        pipe.close()
    s = pipe.stats()
    assert s.accepted == 2 and s.delivered == 2 and s.balanced(), s


def test_a_submit_waiting_for_room_passes_over_a_device_that_breaks_meanwhile():
    """Both devices full, each prepare stalled; while the third submit waits, device 1 breaks
    (its prepare then returns, and its chunk fails with the device): the item is not sent there
    but to device 0 once its prepare returns; once both devices are broken a waiting submit
    raises the device's error instead of waiting on."""
    devs = sims(2, 29)
    started = {k: threading.Event() for k in (0.0, 1.0, 3.0)}
    release = {k: threading.Event() for k in (0.0, 1.0, 3.0)}
    breaks = {1.0: devs[1], 3.0: devs[0]}
    pipe = rf.Pipeline(lambda x, y: np.copyto(y, x * 2 + 1), device=devs,
                       prepare=_stall_each(started, release, breaks), chunk_bytes=512, slots=1, workers=1,
                       max_in_flight=1, on_error="continue")
    first, second = pipe.parts
    try:
        futs = [pipe.submit(np.full(8, float(k))) for k in range(2)]
        submitting = start(pipe.submit, np.full(8, 2.0))
        assert started[0.0].wait(JOIN_S) and started[1.0].wait(JOIN_S)  # the submit's wait runs both devices
        release[1.0].set()  # device 1 breaks
        with pytest.raises(rf.DeviceError):
            futs[1].result(timeout=JOIN_S)
        assert not submitting.done()
        release[0.0].set()
        fut = join([submitting])[0]
        assert fut._driver is first._driver
        np.testing.assert_array_equal(fut.result(timeout=JOIN_S), np.full(8, 5.0))
        # device 0 full again (its next prepare stalls); a submit waiting for room there raises
        # once that device breaks too
        futs.append(pipe.submit(np.full(8, 3.0)))
        submitting = start(pipe.submit, np.full(8, 4.0))
        assert started[3.0].wait(JOIN_S)
        release[3.0].set()
        with pytest.raises(rf.DeviceError):
            join([submitting])
    finally:
        for e in release.values():
            e.set()
        pipe.close()
    s = pipe.stats()
    assert s.accepted == 4 and s.in_flight == 0 and s.balanced(), s


def test_a_submit_waiting_for_room_on_every_device_times_out_accepting_nothing():
    """Both devices full with kernels of ten (virtual) seconds: a submit with a timeout of one
    second raises TimeoutError and nothing of it is accepted; without a timeout it is accepted
    on the first device whose kernel ends."""
    def slow(x, y):
        y[...] = x * 2 + 1

    slow.sim_seconds = 10.0
    pipe = rf.Pipeline(slow, device=sims(2, 31), chunk_bytes=512, slots=1, max_in_flight=1, coalesce=False)
    try:
        futs = [pipe.submit(np.full(8, float(k))) for k in range(2)]
        with pytest.raises(TimeoutError):
            pipe.submit(np.full(8, 2.0), timeout=1.0)
        assert pipe.stats().accepted == 2
        futs.append(pipe.submit(np.full(8, 2.0)))
        for k, fut in enumerate(futs):
            np.testing.assert_array_equal(fut.result(timeout=JOIN_S), np.full(8, 2.0 * k + 1))
    finally:
        pipe.close()
    s = pipe.stats()
    assert s.accepted == 3 and s.delivered == 3 and s.balanced(), s


def test_ctrl_c_gets_out_of_a_submit_waiting_for_room_on_every_device():
    """Both devices full, each with a prepare that does not return: Ctrl-C (a real SIGINT) on
    the main thread while a submit waits for room on either raises KeyboardInterrupt there,
    nothing accepted, and the pipeline closes once the prepares return."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("delivers SIGINT to the main thread: the test must run there")
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is not Python's default KeyboardInterrupt handler here")
    with _both_devices_full_and_stalled(37) as (pipe, started, release):
        # Ctrl-C once both prepares stall; stalled until either is released
        CtrlCWhileStalled(release.values(), ready=lambda: all(e.wait(JOIN_S) for e in started.values())).run(
            lambda: pipe.submit(np.full(8, 2.0)), "the submit")


def test_a_small_item_with_no_room_anywhere_never_waits_for_a_stalled_devices_lock():
    """Small items share chunks. Device 0's compute, run inside a step (its host calls advance
    the simulated GPU), does not return until the test says so: its progress thread keeps that
    pipeline's lock. With no room on either device, a submit from another thread offered the
    item to device 0 first (equally loaded, first in turn) and, finding no chunk there taking
    items, waited for that lock to look for room, for as long as the compute stalled, although
    device 1 could take the item. It now looks for room without the lock and goes on to device 1."""
    started, release = threading.Event(), threading.Event()

    def compute(x, y):
        if x[0] == 7.0:
            started.set()
            assert release.wait(JOIN_S), "the stalled compute was never released"
        np.copyto(y, x + 1)

    pipe = rf.Pipeline(compute, device=[rf.device("sim", seed=41 + k) for k in range(2)], chunk_bytes=512, slots=1,
                       max_in_flight=1)
    first, second = pipe.parts
    try:
        stalled = pipe.submit(np.full(8, 7.0, np.float32))
        waiter = start(stalled.exception, JOIN_S)  # someone waits on device 0: its step runs the compute
        assert started.wait(JOIN_S)
        assert "step" in stack_names(first._driver.thread)  # the stall keeps device 0's lock
        futs = [pipe.submit(np.full(8, 1.0, np.float32))]
        assert stalled._driver is first._driver and futs[0]._driver is second._driver
        futs.append(join([start(pipe.submit, np.full(8, 2.0, np.float32))])[0])
        assert futs[1]._driver is second._driver
        for k, fut in enumerate(futs):
            np.testing.assert_array_equal(fut.result(timeout=JOIN_S), np.full(8, k + 2.0, np.float32))
        assert not release.is_set() and not stalled.done()
        release.set()
        join([waiter])
        np.testing.assert_array_equal(stalled.result(), np.full(8, 8.0, np.float32))
    finally:
        release.set()
        pipe.close()
    s = pipe.stats()
    assert s.delivered == 3 and s.in_flight == 0 and s.balanced(), s


def test_a_cancelled_asubmit_waiting_for_room_on_every_device_accepts_nothing():
    """Both devices full, each prepare stalled: an asubmit waits for room on either (on the loop's
    executor). Cancelling the awaiting task ends that wait with nothing accepted, and asyncio.run,
    which joins the executor's threads, returns while the prepares still stall."""
    with _both_devices_full_and_stalled(43) as (pipe, started, release):
        async def main():
            task = asyncio.ensure_future(pipe.asubmit(np.full(8, 2.0)))
            loop = asyncio.get_running_loop()
            # the asubmit's wait runs both devices: both prepares begin
            assert await loop.run_in_executor(None, lambda: all(e.wait(JOIN_S) for e in started.values()))
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        join([start(asyncio.run, main())])
        assert not any(e.is_set() for e in release.values())  # the prepares still stall
        # (nothing accepted: the stats, which take each part's lock, once the prepares return)
        for e in release.values():
            e.set()


@pytest.mark.parametrize("face", ["map", "amap"])
def test_a_map_is_cut_short_after_what_it_took_once_close_begins_on_another_thread(face):
    """close() on another thread while a map over two devices runs: the parts stop taking work
    one after another, and here the first part's close waits (its progress thread is held), so
    the second still accepts. The map's next item found the pipeline closed and raised that
    RuntimeError, cancelling the item it had taken; the amap gave its items to the second part
    after close() had begun. On one device close() stops admission at once and a map hands out
    what it took, then is cut short (CancelledError): so do both now, and nothing is accepted
    after close() began."""
    devs = sims(2, seed=9)
    pipe = rf.Pipeline(f, device=devs, chunk_bytes=256, max_in_flight=2)
    first, second = pipe.parts
    release = hold_progress_thread(first.submit(np.full(4, -1.0)))
    try:
        # the first part is full and cannot move: the map's items go to the second
        stuck = [first.submit(np.full(4, -2.0 - k)) for k in range(2)]
        closing: list = []

        def items():
            yield np.full(4, 0.0)
            closing.append(start(pipe.close, name="test-closer"))
            deadline = time.monotonic() + JOIN_S
            while not pipe._closed:  # close() has begun; the first part's close waits for its thread
                assert time.monotonic() < deadline, "close() never began"
                time.sleep(0.001)
            assert second._sched.accepting  # (the second part's close has not begun)
            for k in range(1, 6):
                yield np.full(4, float(k))

        got: list = []

        async def amap():
            async for r in pipe.amap(items()):
                got.append(r)

        def run():
            with pytest.raises(concurrent.futures.CancelledError, match="cut short after handing out 1 result: "
                                                                         "the pipeline was closed"):
                if face == "map":
                    for r in pipe.map(items()):
                        got.append(r)
                else:
                    asyncio.run(amap())

        join([start(run)])
        accepted = pipe.stats().accepted
    finally:
        release.set()
    join(closing)
    assert [r[0] for r in got] == [1.0]  # the one item taken before close() began: 0 * 2 + 1
    assert accepted == 4  # three on the first part, one of the map's: none after close() began
    s = pipe.stats()
    assert s.delivered == 4 and s.cancelled == 0 and s.in_flight == 0 and s.balanced(), s
    assert all(fut.result()[0] == -2.0 * (2.0 + k) + 1 for k, fut in enumerate(stuck))


@pytest.mark.parametrize("face", ["map", "amap"])
def test_a_map_that_raises_a_parts_failure_keeps_none_of_the_results_it_did_not_hand_out(face):
    """The first item fails on one device after the other device delivered results into the map's
    window (on the device: each holds a slot). The map raises the failure, and the failure keeps
    the map's frame in its traceback: the results the map had not handed out stayed in that
    frame's window, their device buffers allocated after close() for as long as the failure
    lived (``pipe.failures`` keeps it), the collector notwithstanding. Now none is kept."""
    gate = threading.Event()

    def prepare(item):
        if item[0] == 0.0:
            assert gate.wait(JOIN_S), "the failing prepare was never let go"
            raise ValueError("the user's")
        return item

    devs = sims(2, seed=13)
    pipe = rf.Pipeline(f, device=devs, chunk_bytes=256, slots=3, max_in_flight=3, deliver="device", prepare=prepare)
    second = pipe.parts[1]
    items = [np.full(4, float(k)) for k in range(6)]

    def let_go_once_the_other_device_delivered():
        # (the map waits for the first item: on the simulated GPU the second device moves only
        # while someone waits on it)
        second._drive_until(lambda: second._sched.stats().delivered >= 2)
        gate.set()

    opener = start(let_go_once_the_other_device_delivered)

    async def amap():
        async for res in pipe.amap(items):
            res.release()

    def run():
        if face == "map":
            for res in pipe.map(items):
                res.release()
        else:
            asyncio.run(amap())

    try:
        with pytest.raises(rf.StageError) as info:
            join([start(run)])
    finally:
        gate.set()
        join([opener])
    assert isinstance(info.value.__cause__, ValueError) and info.value.index == 0
    pipe.close()
    s = pipe.stats()
    assert s.in_flight == 0 and s.balanced() and second.stats().delivered >= 2, s
    gc.collect()
    assert [dev.live().total for dev in devs] == [0, 0], [dev.live() for dev in devs]


@pytest.mark.parametrize("on_error", ["raise", "continue"])
def test_a_device_closed_under_a_spread_pipeline_fails_its_items_saying_so_not_as_a_ringflow_bug(on_error):
    """Another thread closes one device while its part holds unfinished items: that part's items
    fail with an error that says its device was closed under the pipeline (the caller's doing,
    which the caller can change), not that ringflow has a bug; the other device's items are
    delivered right, every item ends, and the pipeline's close reports the same error."""
    devs = sims(2, 11)
    items = items_of(16, 11)
    pipe = rf.Pipeline(f, device=devs, chunk_bytes=4096, on_error=on_error)
    futs = [pipe.submit(a) for a in items]
    held = [fu for fu in futs if not fu.done()]
    assert pipe.parts[1].stats().in_flight > 0  # (the simulated GPU runs nothing until someone waits)
    devs[1].close()
    errors = [fu.exception() for fu in futs]
    with pytest.raises(RuntimeError) as closing:
        pipe.close()
    failed = [e for e in errors if e is not None]
    assert failed and held
    for err in failed + [closing.value]:
        text = str(err)
        assert "ringflow bug" not in text, text
        assert "was closed while the pipeline ran" in text and "sim" in text, text
    for a, fu, err in zip(items, futs, errors):
        if err is None:
            np.testing.assert_array_equal(fu.result(), a * 2 + 1)
    assert pipe.parts[0].stats().delivered == pipe.parts[0].stats().accepted > 0
    stats = pipe.stats()
    assert stats.in_flight == 0 and stats.accepted == stats.delivered + stats.failed + stats.cancelled == 16
    rf.drop_warm_pipelines()
    gc.collect()
    assert devs[0].live().total == 0


@pytest.mark.parametrize("face", ["submit", "asubmit"])
def test_with_on_error_raise_a_failure_on_one_device_stops_every_device_for_submit(face):
    """``on_error="raise"``: the first failure stops every device, as on one, for items handed over
    one by one too (not only through a map, which cancels the pipeline itself). Device 1 holds an
    item whose compute waits for a gate; the item that fails goes to device 0. Once its failure is
    seen, an item offered next is refused (it went to device 1 and ran), and device 1's held item
    ends cancelled, not delivered."""
    gate = threading.Event()

    def g(x, y):
        if x[0] == 1.0:
            gate.wait(JOIN_S)  # (the compute of device 1's item: the progress thread waits here)
        if x[0] < 0:
            raise ValueError("negative item")
        y[...] = x * 2 + 1

    pipe = rf.Pipeline(g, device=sims(2, 11), chunk_bytes=512, slots=2, on_error="raise")
    held = pipe.parts[1].submit(np.ones(16))

    async def failing_then_next():
        with pytest.raises(rf.StageError, match="negative item"):
            await pipe.asubmit(-np.ones(16))
        with pytest.raises(RuntimeError, match="a failure stopped it"):
            await pipe.asubmit(np.zeros(16))

    try:
        if face == "asubmit":
            asyncio.run(failing_then_next())
        else:
            with pytest.raises(rf.StageError, match="negative item"):
                pipe.submit(-np.ones(16)).result(timeout=JOIN_S)
            with pytest.raises(RuntimeError, match="a failure stopped it"):
                pipe.submit(np.zeros(16))
    finally:
        gate.set()
    with pytest.raises(concurrent.futures.CancelledError):
        held.result(timeout=JOIN_S)
    pipe.close()
    s = pipe.stats()
    assert (s.accepted, s.failed, s.cancelled, s.in_flight) == (2, 1, 1, 0), s


@pytest.mark.parametrize("on_error", ["raise", "continue"])
@pytest.mark.parametrize("door", ["submit", "map"])
def test_a_device_closed_under_an_idle_pipeline_is_named_by_the_next_call(door, on_error):
    """A device closed while its pipeline waited for work made the next call raise the device's
    own "this simulated device is closed; create a new one", which names neither the device nor
    the pipeline; the pipeline still closes."""
    d0, d1 = rf.device("sim"), rf.device("sim")
    pipe = rf.Pipeline(f, device=[d0, d1], on_error=on_error)
    xs = [np.full(256, i, np.float32) for i in range(6)]
    assert [float(r[0]) for r in pipe.map(xs)] == [2.0 * i + 1 for i in range(6)]
    d1.close()
    with pytest.raises(RuntimeError, match=r"device 1 \(.*\) of this pipeline is closed.*close the pipeline before"):
        if door == "submit":
            pipe.submit(xs[0])
        else:
            next(iter(pipe.map(xs)))
    pipe.close()
    assert d0.live().total == 0, d0.live()
    d0.close()


@pytest.mark.parametrize("face", ["submit", "map"])
def test_results_held_on_one_device_send_further_items_to_the_device_with_free_slots(face):
    """One device-out slot on each of two devices; the consumer keeps the first result (its
    device's only slot) and takes the rest one at a time, releasing each. The dispatcher counted
    unfinished chunks only, not slots held by results: with both devices idle it sent items in
    turn to the device whose slot is held, where they waited for a release that never came (the
    held-results warning, then a TimeoutError), while the other device's slot stood free."""
    devs = sims(2, 40)
    with rf.Pipeline(f, device=devs, chunk_bytes=1024, deliver="device",
                     slots=rf.SlotCounts(host_in=1, device_in=1, device_out=1, host_out=1)) as pipe:
        kept = pipe.submit(np.full(4, -1, np.float32)).result(timeout=10)
        items = [np.full(4, k, np.float32) for k in range(8)]
        seen = []

        def take():
            results = (pipe.submit(a).result(timeout=10) for a in items) if face == "submit" else pipe.map(items)
            for res in results:
                seen.append(res._device)
                res.release()

        join([start(take)], timeout=JOIN_S)
        assert len(seen) == 8 and kept._device not in seen, seen  # every item went where a slot was free
        kept.release()
    s = pipe.stats()
    assert s.delivered == 9 and s.in_flight == 0 and s.balanced(), s
