"""A failed whole-array call keeps nothing alive for the cyclic collector
(src/ringflow/_pipeline/frames.py and the raise sites of the engines).

The failure a call raises carries a traceback whose frames hold the call's engine, pipeline,
chunks and events; on the simulated GPU the compute's own frames also reach, through ``f_back``,
whatever host call ran the kernel. None of those may hold the failure in turn: once the caller
drops the error, plain reference counting must free every event, buffer and stream of the call
and every frame of it, with the collector off, whichever chunk failed, however (an interrupt,
``sys.exit``, an ordinary error), on either engine, through ``stream_map`` or a ``MapJob``, on
one device or several.
"""

from __future__ import annotations

import asyncio
import gc
import types

import numpy as np
import pytest

import ringflow as rf
from tests.helpers.pipeline_checks import copy_failing_on_call
from tests.helpers.collector import collector_off

ROWS = 1 << 20  # float32: 16 chunks of CHUNK_BYTES
CHUNK_BYTES = 1 << 16
FAILING_CALLS = (1, 2, 9, 16)  # the compute call that fails: the first chunk, the second, one inside, the last

FAILURES = {
    "KeyboardInterrupt": KeyboardInterrupt("pressed in the compute"),
    "SystemExit": SystemExit(3),
    "ValueError": ValueError("a bad chunk"),
}


def _stream_map(engine, host, ndev=1):
    def call(f, x, devs, keep_warm):
        rf.stream_map(f, x, device=devs[0] if ndev == 1 else devs, chunk_bytes=CHUNK_BYTES, engine=engine,
                      host=host, keep_warm=keep_warm)
    return call, ndev


def _map_job(engine, host, ndev=1):
    def call(f, x, devs, keep_warm):
        with rf.MapJob(f, x, device=devs[0] if ndev == 1 else devs, chunk_bytes=CHUNK_BYTES, engine=engine,
                       host=host) as job:
            job()
    return call, ndev


ENTRIES = {
    "stream_map staged (scheduler)": _stream_map("pipeline", "stage"),
    "stream_map registered (scheduler)": _stream_map("pipeline", "register"),
    "stream_map registered (direct)": _stream_map("direct", "register"),
    "stream_map over two devices": _stream_map("auto", "register", ndev=2),
    "MapJob staged (scheduler)": _map_job("pipeline", "stage"),
    "MapJob registered (direct)": _map_job("direct", "register"),
    "MapJob over two devices": _map_job("auto", "register", ndev=2),
}


def left_for_the_collector() -> list[str]:
    """The frames and exceptions only the cyclic collector could free now (then freed)."""
    before = len(gc.garbage)
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
    finally:
        gc.set_debug(0)
    found = gc.garbage[before:]
    names = [f"frame {o.f_code.co_name}" if isinstance(o, types.FrameType) else repr(o)
             for o in found if isinstance(o, (types.FrameType, BaseException))]
    del gc.garbage[before:], found
    gc.collect()  # unsaved this time
    return names


@pytest.mark.parametrize("failure", FAILURES)
@pytest.mark.parametrize("entry", ENTRIES)
def test_a_failed_whole_array_call_leaves_nothing_for_the_collector(entry, failure):
    """With the collector off, a call whose compute fails at any chunk (keeping its engine warm
    or not) leaves no event, buffer or stream live once it has raised, and no frame or
    exception that only the collector could free."""
    call, ndev = ENTRIES[entry]
    kept = []  # (failing call, keep_warm, what each device still counts live, what only the collector frees)
    for k, n in enumerate(FAILING_CALLS):
        keep_warm = k % 2 == 0
        with collector_off():
            devs = [rf.device("sim", seed=10 * n + i, chaos=True) for i in range(ndev)]
            f = copy_failing_on_call(n, FAILURES[failure])
            with pytest.raises(rf.StageError if failure == "ValueError" else type(FAILURES[failure])):
                call(f, np.arange(ROWS, dtype=np.float32), devs, keep_warm)
            rf.drop_warm_pipelines()
            live = [dev.live() for dev in devs]
            left = left_for_the_collector()
            if any(counts.total for counts in live) or left:
                kept.append((n, keep_warm, live, left))
        for dev in devs:
            dev.close()
    assert not kept


@pytest.mark.parametrize("failure", FAILURES)
@pytest.mark.parametrize("host", ["register", "stage"])
def test_the_caller_gets_the_failure_with_its_own_traceback(host, failure):
    """Breaking the cycles leaves what the caller gets alone: the compute's own exception (the
    cause of a StageError), whose traceback still runs down to the line of the compute that
    raised it (on the direct engine, with that frame's locals)."""
    dev = rf.device("sim")
    like = FAILURES[failure]

    def compute(x, y):
        marker = "the compute's own local"  # noqa: F841 - looked for in the traceback
        raise type(like)(*like.args)

    with pytest.raises(BaseException) as info:
        rf.stream_map(compute, np.ones(4096, np.float32), device=dev, chunk_bytes=4096, host=host)
    err = info.value
    if failure == "ValueError":
        assert isinstance(err, rf.StageError)
        err = err.__cause__
    assert type(err) is type(like) and err.args == like.args
    last = list(_walk(err.__traceback__))[-1].tb_frame
    assert last.f_code is compute.__code__
    if host == "register":
        assert last.f_locals["marker"] == "the compute's own local"
    del info, err, last
    rf.drop_warm_pipelines(dev)
    dev.close()


def _walk(tb):
    while tb is not None:
        yield tb
        tb = tb.tb_next


@pytest.mark.parametrize("engine", ["pipeline", "direct"])
def test_a_call_that_returned_keeps_none_of_the_callers_arrays(engine):
    """With the collector off, a whole-array call that keeps no warm engine frees the caller's
    arrays once it returns. A scheduler used to mark its compute with a closure over itself, a
    cycle through which a closed pipeline kept its stage callbacks, and with them the arrays they
    close over, until the collector ran."""
    import weakref

    dev = rf.device("sim")
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        x = np.ones(ROWS, np.float32)
        out = rf.stream_map(lambda a, b: np.multiply(a, 2, out=b), x, device=dev, chunk_bytes=CHUNK_BYTES,
                            engine=engine, host="stage" if engine == "pipeline" else "register", keep_warm=False)
        assert np.array_equal(out, x * 2)
        gone_x, gone_out = weakref.ref(x), weakref.ref(out)
        del x, out
        assert gone_x() is None and gone_out() is None
    finally:
        if was:
            gc.enable()
        dev.close()
    assert dev.live().total == 0


@pytest.mark.parametrize("fails", ["on the device", "as it is enqueued"])
def test_a_failed_direct_call_keeps_neither_the_callers_arrays_nor_the_engines_buffers(fails):
    """The failure a direct engine's call raises carries the engine's own frames, whose locals
    held the caller's arrays, the engine and its device rings for as long as the caller kept
    the error. With the collector off, once the caller drops its arrays and the engine, they
    are freed though the error is still held; its traceback still runs down to the user's line
    that raised, with that frame's locals. ``as it is enqueued``: the launch raises, as a
    kernel checking its arguments on a real GPU does."""
    import traceback
    import weakref

    from ringflow._pipeline.direct import DirectSchedule
    from ringflow._pipeline.engine import Arrays

    dev = rf.device("sim")
    n, chunk = 4096, 4096  # float32: four chunks
    hx, hout = dev.allocate_host(4 * n), dev.allocate_host(4 * n)

    def compute(x, y):
        marker = "the user's own local"  # noqa: F841 - looked for in the traceback
        raise ValueError("a bad chunk")

    def launch(fn, *arrays, **kw):
        del arrays, kw  # (the user's frame keeps none of the engine's arrays: what stays alive is ringflow's doing)
        marker = "the user's own local"  # noqa: F841 - looked for in the traceback
        raise ValueError("a bad chunk")

    raising = compute if fails == "on the device" else launch
    with collector_off():
        engine = DirectSchedule(dev, compute, [(i * chunk, chunk, (chunk // 4,)) for i in range(4)], np.float32,
                                chunk_bytes=chunk, slots=rf.SlotCounts(2, 2, 2, 2), inplace=False)
        for s in engine.streams.computes if raising is launch else ():
            s.launch = launch
        x, out = hx.view(np.float32), hout.view(np.float32)
        kept = {name: weakref.ref(o) for name, o in
                [("x", x), ("out", out), ("engine", engine), ("device in", engine.dev_in), ("device out", engine.dev_out)]}
        with pytest.raises(rf.StageError, match="a bad chunk") as info:
            engine.run(Arrays(x, out, hx, hout))
        engine.fail(info.value)
        del x, out, engine
        alive = [name for name, ref in kept.items() if ref() is not None]
        assert alive == []
        cause = info.value.__cause__
        last = list(_walk(cause.__traceback__))[-1].tb_frame
        assert last.f_code is raising.__code__ and last.f_locals["marker"] == "the user's own local"
        assert 'raise ValueError("a bad chunk")' in traceback.format_exception(cause)[-2]
    del info, cause, last
    for buf in (hx, hout):
        buf.close()
    dev.close()
    assert dev.live().total == 0


WHOLE_ARRAY_CALLS = {
    "stream_map staged (scheduler)": ("stream_map", "pipeline", "stage", 1),
    "stream_map registered (scheduler)": ("stream_map", "pipeline", "register", 1),
    "stream_map registered (direct)": ("stream_map", "direct", "register", 1),
    "stream_map over two devices": ("stream_map", "auto", "register", 2),
    "MapJob staged (scheduler)": ("MapJob", "pipeline", "stage", 1),
    "MapJob registered (direct)": ("MapJob", "direct", "register", 1),
    "MapJob over two devices": ("MapJob", "auto", "register", 2),
}


@pytest.mark.parametrize("entry", WHOLE_ARRAY_CALLS)
def test_a_failure_held_by_the_caller_keeps_neither_its_input_nor_its_result(entry):
    """A caller that keeps the error of a failed whole-array call (to log it, or to retry later)
    keeps only the error: once it drops its own references, the input array and the result the
    call made for it are freed (with the collector off), though ringflow's frames of the call are
    in the error's traceback. A 1 GiB call would otherwise hold its 1 GiB input and its pinned
    result for as long as the error lives."""
    import weakref

    door, engine, host, ndev = WHOLE_ARRAY_CALLS[entry]
    devs = [rf.device("sim") for _ in range(ndev)]
    device = devs[0] if ndev == 1 else devs
    pools = [rf.host.stats(device=dev).in_use_bytes for dev in devs]

    def compute(x, y):
        raise ValueError("a bad chunk")

    with collector_off():
        x = np.ones(ROWS, np.float32)
        kept = weakref.ref(x)
        with pytest.raises(rf.StageError, match="a bad chunk") as info:
            if door == "stream_map":
                rf.stream_map(compute, x, device=device, chunk_bytes=CHUNK_BYTES, engine=engine, host=host,
                              keep_warm=False)
            else:
                with rf.MapJob(compute, x, device=device, chunk_bytes=CHUNK_BYTES, engine=engine, host=host) as job:
                    job()
        job = None
        del x
        assert kept() is None, "the failure held by the caller keeps its input alive"
        assert [rf.host.stats(device=dev).in_use_bytes for dev in devs] == pools, "it keeps its pooled result"
        assert isinstance(info.value, rf.StageError)  # (still held, and whole)
    del info
    for dev in devs:
        dev.close()


@pytest.mark.parametrize("failing_call", [1, 9], ids=["first chunk", "after some delivered"])
@pytest.mark.parametrize("door", ["stream_map", "Pipeline.map", "Pipeline.amap"])
def test_a_failure_held_by_the_caller_keeps_neither_the_pipeline_nor_its_items(door, failing_call):
    """A map's generator frame stays in the traceback of the failure it raises (and of a whole-
    array call's on the scheduler): a caller that keeps the error (to log it, or to retry
    later) must keep neither the closed pipeline (its driver, scheduler and rings: on the
    simulated GPU, a ring's bytes) nor the items it was given, nor the last result it handed
    out, once it drops its own references, with the collector off."""
    import weakref

    from tests.helpers.hooks import engines

    dev = rf.device("sim")
    f = copy_failing_on_call(failing_call, ValueError("a bad chunk"))
    with collector_off():
        x = np.ones(ROWS, np.float32)
        kept = {"x": weakref.ref(x)}
        with pytest.raises(rf.StageError, match="a bad chunk") as info:
            if door == "stream_map":
                with engines(on=lambda p: kept.setdefault("pipeline", weakref.ref(p))):
                    rf.stream_map(f, x, device=dev, chunk_bytes=CHUNK_BYTES, engine="pipeline", host="stage",
                                  keep_warm=False)
            else:
                with rf.Pipeline(f, device=dev, chunk_bytes=CHUNK_BYTES) as pipe:
                    kept["pipeline"] = weakref.ref(pipe)
                    items = _Items(x[i:i + CHUNK_BYTES // 4] for i in range(0, ROWS, CHUNK_BYTES // 4))
                    kept["items"] = weakref.ref(items)
                    if door == "Pipeline.map":
                        for result in pipe.map(items):
                            kept["result"] = weakref.ref(result)
                    else:
                        async def amap():
                            async for result in pipe.amap(items):
                                kept["result"] = weakref.ref(result)
                                del result  # (this frame is in the traceback too: the caller's own)

                        asyncio.run(amap())
        pipe = items = result = None  # (the raise skipped any del in the block)
        del x
        alive = [name for name, ref in kept.items() if ref() is not None]
        assert alive == [], f"the failure held by the caller keeps {alive} alive"
        assert isinstance(info.value, rf.StageError)  # (still held, and whole)
    del info
    rf.drop_warm_pipelines(dev)
    dev.close()


class _Items(list):
    """A list of items a weak reference can follow."""



def test_frames_of_another_threads_running_call_are_cleared_once_it_returns():
    """On the simulated GPU a stage may run inside another thread's call (a caller's staging copy
    or wait advanced virtual time): the failure's traceback reaches that thread's frames, still
    running when the progress thread first clears them. :func:`forget_frames` says so, and a later
    call, once that thread's call has returned, clears them (they held the call's arguments)."""
    import threading
    import weakref

    from ringflow._pipeline.frames import forget_frames
    from ringflow._pipeline.reentry import run_counted
    from ringflow._pipeline.scheduler import Scheduler

    class Owner:
        running: dict = {}

    class Item:
        pass

    failed, release = threading.Event(), threading.Event()
    kept: list = []

    def stage(item):  # a stage run inside another thread's ringflow call, which runs on after it failed
        try:
            raise ValueError("a bad chunk")
        except ValueError as exc:
            kept.append(exc)
        failed.set()
        release.wait(10)

    item = Item()
    item_ref = weakref.ref(item)
    other = threading.Thread(target=run_counted, args=(Owner(), stage, item))
    del item
    # the scheduler's list of failures to look at again, as its steps keep it
    steps = types.SimpleNamespace(_forget_again=[])
    with collector_off():
        other.start()
        assert failed.wait(10)
        assert forget_frames(kept[0]) is True, "a caller still running on another thread is left for later"
        steps._forget_again.append(kept[0])
        Scheduler._forget_finished_frames(steps)  # a step while that call still runs
        assert steps._forget_again == kept, "the scheduler looks again at its next step"
        release.set()
        other.join(10)
        other = None
        Scheduler._forget_finished_frames(steps)  # a step once it has returned
        assert steps._forget_again == []
        assert item_ref() is None, "the returned call's frame keeps its argument"
        assert forget_frames(kept[0]) is False, "nothing is left once that call returned"


def test_a_finished_asubmit_keeps_neither_the_pipeline_nor_the_item_in_its_frame():
    """On the simulated GPU a stage may run inside an ``asubmit``'s staging copy (which advances
    virtual time): a failure's traceback then reaches the accepting coroutine's frame through
    ``f_back``, and a frame outlives its coroutine with the locals it had. Held as such a traceback
    holds it, that frame keeps neither the pipeline nor the item once the coroutine has finished."""
    import sys
    import weakref

    dev = rf.device("sim")
    frames: list = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "_asubmit_future" and frame not in frames:
            frames.append(frame)

    with collector_off():
        x = np.ones(CHUNK_BYTES // 4, np.float32)
        pipe = rf.Pipeline(copy_failing_on_call(0, ValueError()), device=dev, chunk_bytes=CHUNK_BYTES)
        kept = {"x": weakref.ref(x), "pipeline": weakref.ref(pipe)}

        async def one():
            sys.setprofile(profile)
            try:
                return await pipe.asubmit(x)
            finally:
                sys.setprofile(None)

        asyncio.run(one())
        pipe.close()
        pipe = x = None
        assert frames, "the accepting coroutine ran"
        alive = [name for name, ref in kept.items() if ref() is not None]
        assert alive == [], f"the finished coroutine's frame keeps {alive} alive"
    frames.clear()
    dev.close()


STOPPED_MAPS = {  # (devices, when the other item failed)
    "one device, before the map": (1, "before"),  # the map's first submit is refused
    "one device, during the map": (1, "during"),
    # over two devices a part stopped before the map is passed over: the map goes on without it
    "two devices, during the map": (2, "during"),  # the map's chunks on the stopped part are cancelled
}


@pytest.mark.parametrize("case", STOPPED_MAPS)
@pytest.mark.parametrize("door", ["Pipeline.map", "Pipeline.amap"])
def test_a_map_stopped_by_another_items_failure_keeps_nothing_in_what_it_raises(door, case):
    """A map stopped by the failure of an item it did not take (another thread's submit) raises
    that failure, or the refusal of a pipeline it stopped, from the map's own steps: their frames
    are in that error's traceback, and must not keep the pipeline nor the map's items for a caller
    that keeps the error, once the pipeline is closed and dropped (with the collector off)."""
    import weakref

    devices, when = STOPPED_MAPS[case]

    devs = [rf.device("sim") for _ in range(devices)]
    f = copy_failing_on_call(1, ValueError("a bad chunk"))
    rows = CHUNK_BYTES // 4
    with collector_off():
        x = np.ones(8 * rows, np.float32)
        kept = {"x": weakref.ref(x)}
        with pytest.raises((rf.StageError, RuntimeError)) as info:
            with rf.Pipeline(f, device=devs[0] if devices == 1 else devs, chunk_bytes=CHUNK_BYTES) as pipe:
                kept["pipeline"] = weakref.ref(pipe)
                bad = pipe.submit(np.ones(rows, np.float32))
                if when == "before":
                    bad.exception()
                items = _Items(x[i:i + rows] for i in range(0, x.size, rows))
                kept["items"] = weakref.ref(items)
                if door == "Pipeline.map":
                    for result in pipe.map(items):
                        del result
                else:
                    async def amap():
                        async for result in pipe.amap(items):
                            del result

                    asyncio.run(amap())
        pipe = items = bad = None  # (the raise skipped any del in the block)
        del x
        alive = [name for name, ref in kept.items() if ref() is not None]
        assert alive == [], f"the error held by the caller ({info.value!r}) keeps {alive} alive"
    del info
    for dev in devs:
        rf.drop_warm_pipelines(dev)
        dev.close()


def test_forgetting_a_kept_failure_never_closes_a_generator_it_was_raised_through():
    """A kept failure can be raised on to a caller, which adds its frames to the traceback: an
    interrupt a compute raised reaches an unordered ``amap`` as itself, and the map skips it
    (``on_error="continue"``) and goes on. Clearing the frames of the kept failure later must leave
    such a generator as it is: clearing a suspended generator's frame closes it (a sync one at
    once; an async one through its event loop's finaliser, whose ``aclose()`` fails, logged as a
    task exception never retrieved, while the generator awaits)."""
    from ringflow._pipeline.frames import forget_frames

    err = KeyboardInterrupt()

    def through():
        try:
            raise err
        except KeyboardInterrupt:
            pass  # skipped, and the generator goes on
        yield 1
        yield 2

    gen = through()
    assert next(gen) == 1
    forget_frames(err)
    assert next(gen) == 2

    async def async_through():
        try:
            raise err
        except KeyboardInterrupt:
            pass
        yield 1
        await asyncio.sleep(0)
        yield 2

    async def main():
        agen = async_through()
        assert await agen.__anext__() == 1
        forget_frames(err)
        await asyncio.sleep(0)  # (the loop's turn, where a finaliser's aclose() would run)
        assert await agen.__anext__() == 2

    asyncio.run(main())
