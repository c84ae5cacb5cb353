"""The direct engine (``ringflow._pipeline.direct``): a whole-array job enqueued in one pass.

Its safety rests on four event waits; each is switched off in turn (through the test-only
``ringflow._testing.inject(guards_off=...)`` seam) to show the sim's happens-before checker — and, with the checker
off, the checked mode's poison — catches its absence. With every wait on it must agree with
the pipeline engine exactly, under chaos, for every ring size down to one slot."""

from __future__ import annotations

import contextlib
import gc
import weakref
from unittest import mock

import numpy as np
import pytest

import ringflow as rf
from tests.helpers.hooks import engines
from ringflow._errors import StageError
from ringflow._pipeline import direct, sizing
from ringflow._pipeline.whole_array import stream_map_report
from ringflow import _testing
from ringflow._pipeline.engine import why_not_direct
from tests.helpers.pipeline_checks import caught, copy_failing_on_call, guard_outcome


def f(x, y):  # with out= and in place: a temporary (x * 3) would refuse a graph's capture
    np.multiply(x, 3, out=y)
    y += 1


f.sim_seconds = 20e-6


def fast(x, y):  # a kernel far shorter than a chunk's copy out
    np.multiply(x, 3, out=y)
    y += 1


fast.sim_seconds = 1e-7
SHAPE = (1000, 7)  # 28,000 bytes: 14 chunks of 2016 bytes (72 rows), the last shorter
CHUNK = 72 * 7 * 4


def contents(seed, shape=SHAPE):
    return np.random.default_rng(seed).uniform(0.5, 1.5, shape).astype(np.float32)


def run_job(dev, *, engine="auto", slots=None, inplace=False, checked=False, guards=(), calls=3, seed=0,
            big=False, graph=False):
    """MapJob over registered x (and out), the host rewriting x between calls; True when every
    call's result is right. ``big``: 64x the rows and chunk, and a kernel far shorter than a copy.
    ``graph``: every call but a profiled first one replays the job's captured graph."""
    scale = 64 if big else 1
    shape = (SHAPE[0] * scale, SHAPE[1])
    x = np.empty(shape, np.float32)
    out = x if inplace else None
    kw = {"slots": slots} if slots is not None else {}
    # with a graph the first call is an ordinary one: the guards go off after it, so what is
    # caught is caught in the captured graph
    # fourteen chunks are too few for copy groups by the planned rule: with four slots they are
    # made to move two to a copy, so the guards are also tried on groups
    grouping = mock.patch.object(sizing, "MIN_COPY_GROUPS", 4) if slots == 4 else contextlib.nullcontext()
    with grouping, _testing.inject(guards_off=() if graph else guards), \
            rf.MapJob(fast if big else f, x, out, device=dev, chunk_bytes=CHUNK * scale, host="register", engine=engine,
                      inplace=inplace, checked=checked, graph=graph, **kw) as job:
        assert job.engine == ("pipeline" if engine == "pipeline" else "direct") and job.chunks == 14
        if job.engine == "direct" and slots == 4:
            assert job._held.engine.copy_group == 2
        for call in range(calls):
            x[...] = contents(100 * seed + call, shape)
            expected = x * 3 + 1
            # with a graph, the first call is an ordinary one (profiled or not), and the capture
            # must be ordered after it
            profile = graph and call == 0 and seed % 2 == 1
            if not np.array_equal(job(profile=profile), expected):
                return False
            assert job.replays_graph == (graph and engine != "pipeline" and call > 0)
            if graph and call == 0 and guards:
                job._held.engine._guard_off = frozenset(guards)
    return True


def test_engine_choice():
    dev = rf.device("sim")
    x = contents(0)
    with rf.MapJob(f, x, device=dev, chunk_bytes=CHUNK, host="register") as job:
        assert job.engine == "direct" and "engine=direct" in repr(job)
    with rf.MapJob(f, x, device=dev, chunk_bytes=CHUNK, host="stage") as job:
        assert job.engine == "pipeline"
    with rf.MapJob(f, x, device=dev, chunk_bytes=CHUNK, host="register", on_error="continue") as job:
        assert job.engine == "pipeline"
    with rf.MapJob(f, x, device=dev, chunk_bytes=CHUNK, host="register", engine="pipeline") as job:
        assert job.engine == "pipeline"
    with pytest.raises(ValueError, match="host='stage' copies x and out"):
        rf.MapJob(f, x, device=dev, chunk_bytes=CHUNK, host="stage", engine="direct")
    with pytest.raises(ValueError, match="engine must be one of"):
        rf.MapJob(f, x, device=dev, chunk_bytes=CHUNK, engine="fast")
    with _testing.inject(guards_off=["consume.after_d2h"]):
        assert why_not_direct("register", {}).startswith("the guard")
    assert why_not_direct("pinned", {"inplace": True, "checked": True, "slots": 2}) is None
    with pytest.raises(ValueError, match="unknown guards"), _testing.inject(guards_off=["no.such_guard"]):
        direct.DirectSchedule(dev, f, [], np.float32, chunk_bytes=8, slots=rf.SlotCounts(1, 1, 1, 1), inplace=False)
    assert dev.live().total == 0


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("slots", [1, 2, 3, None])
@pytest.mark.parametrize("seed", range(4))
def test_direct_agrees_with_the_pipeline_under_chaos(inplace, slots, seed):
    for engine, graph in (("direct", False), ("direct", True), ("pipeline", False)):
        dev = rf.device("sim", seed=seed, chaos=True)
        assert run_job(dev, engine=engine, slots=slots, inplace=inplace, checked=seed % 2 == 1, seed=seed,
                       graph=graph)
        assert dev.live().total == 0


# four slots: chunks move two to a copy (a copy group), one slot per chunk otherwise
CONFIGS = [(slots, inplace, seed, big) for big in (False, True) for seed in range(3) for slots in (1, 2, 4)
           for inplace in (False, True)]


def _outcome(guard, slots, inplace, seed, big, checker=True, graph=False):
    dev = rf.device("sim", seed=seed, chaos=True, checked=checker)
    return guard_outcome(lambda: run_job(dev, engine="direct", slots=slots, inplace=inplace, checked=not checker,
                                         guards=[guard], seed=seed, big=big, graph=graph))


@pytest.mark.parametrize("graph", [False, True])
def test_every_config_passes_with_every_guard_on(graph):
    # no false alarms: the configurations below catch a missing wait, not a healthy job
    for slots, inplace, seed, big in CONFIGS:
        assert run_job(rf.device("sim", seed=seed, chaos=True), slots=slots, inplace=inplace, seed=seed, big=big,
                       graph=graph)
        assert run_job(rf.device("sim", seed=seed, chaos=True, checked=False), slots=slots, inplace=inplace,
                       checked=True, seed=seed, big=big, graph=graph)


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("guard", direct.GUARDS)
def test_each_wait_is_needed(guard, graph):
    if guard == "compute.wait_slot_ready":
        configs = [c for c in CONFIGS if not c[1]]  # only a separate device-out ring has this wait
    else:
        configs = CONFIGS
    tried = []
    for config in configs:
        outcome = _outcome(guard, *config, graph=graph)
        if caught(outcome):
            return
        tried.append(f"{config}: {outcome!r}"[:200])
    pytest.fail(f"switching off {guard!r} went unnoticed:\n" + "\n".join(tried))


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("guard", direct.GUARDS)
def test_poison_shows_a_missing_wait_without_the_checker(guard, graph):
    configs = [c for c in CONFIGS if not c[1]] if guard == "compute.wait_slot_ready" else CONFIGS
    tried = []
    for config in configs:
        outcome = _outcome(guard, *config, checker=False, graph=graph)
        assert not isinstance(outcome, rf.HazardError), "the checker was meant to be off"
        if outcome is False:
            return
        tried.append(f"{config}: {outcome!r}"[:200])
    pytest.fail(f"with the checker off, switching off {guard!r} never gave a wrong result:\n" + "\n".join(tried))


def test_a_failed_compute_is_reported_for_its_chunk_and_nothing_leaks():
    dev = rf.device("sim", seed=1, chaos=True)
    sixth_fails = copy_failing_on_call(6, ValueError("bad chunk"))
    x = contents(2)
    job = rf.MapJob(sixth_fails, x, device=dev, chunk_bytes=CHUNK, host="register")
    with pytest.raises(StageError) as info:
        job()
    assert info.value.stage == "compute" and info.value.index == 5
    assert isinstance(info.value.__cause__, ValueError) and job.closed
    with pytest.raises(RuntimeError, match="closed"):
        job()
    del info  # its traceback holds the call's frames, and so their events
    gc.collect()
    assert dev.live().total == 0  # streams, rings, events and the registrations are gone


def test_an_error_while_enqueueing_stops_the_call_after_settling():
    """A callable that fails as it is enqueued (on a real GPU an rf.Kernel checks its arguments
    then): the chunks before it were enqueued and complete before the error reaches the caller."""
    dev = rf.device("sim", seed=2, chaos=True)
    x = contents(3)
    job = rf.MapJob(f, x, device=dev, chunk_bytes=CHUNK, host="register")
    np.testing.assert_array_equal(job(), x * 3 + 1)
    schedule = job._held.engine
    count = []

    def failing(launch):  # every compute stream counts into the one tally
        def failing_launch(fn, *args, **kw):
            count.append(1)
            if len(count) == 4:
                raise TypeError("argument 2 has the wrong dtype")
            return launch(fn, *args, **kw)
        return failing_launch

    for s in schedule.streams.computes:
        s.launch = failing(s.launch)
    with pytest.raises(StageError) as info:
        job()
    assert info.value.index == 3 and isinstance(info.value.__cause__, TypeError) and job.closed
    del info, schedule, s
    gc.collect()
    assert dev.live().total == 0


def test_interrupt_while_waiting_settles_before_raising(monkeypatch):
    dev = rf.device("sim", seed=4, chaos=True)
    x = contents(4)
    job = rf.MapJob(f, x, device=dev, chunk_bytes=CHUNK, host="register")
    schedule = job._held.engine
    record = schedule.streams.d2h.record
    calls = []

    class Interrupting:
        def __init__(self, event):
            self.event = event

        def sync(self):
            raise KeyboardInterrupt

        def __getattr__(self, name):
            return getattr(self.event, name)

    def record_and_interrupt_last(*a, **kw):
        event = record(*a, **kw)
        calls.append(event)
        return Interrupting(event) if len(calls) == len(schedule.groups) + 1 else event

    schedule.streams.d2h.record = record_and_interrupt_last
    with pytest.raises(KeyboardInterrupt):
        job()
    assert job.closed
    del schedule, record, calls
    gc.collect()
    assert dev.live().total == 0


@pytest.mark.gpu
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("checked", [False, True])
def test_direct_on_the_gpu_is_bit_exact_call_after_call(cuda_device, inplace, checked):
    def twice_plus_one(x, y):  # CuPy or torch arrays on the launch stream
        y[...] = x * 2 + 1

    rng = np.random.default_rng(7)
    x = np.empty((3000, 257), np.int32)  # 3 MiB in 12 chunks of 64 KiB-ish rows, the last shorter
    out = x if inplace else None
    with rf.MapJob(twice_plus_one, x, out, device=cuda_device, chunk_bytes=257 * 4 * 256, host="register",
                   slots=2, inplace=inplace, checked=checked) as job:
        assert job.engine == "direct" and job.chunks == 12
        for _ in range(5):
            x[...] = rng.integers(-1000, 1000, x.shape, dtype=np.int32)
            want = x * 2 + 1
            np.testing.assert_array_equal(job(), want)


def test_stream_map_runs_pinned_and_registered_jobs_directly_and_keeps_the_schedule_warm():
    from ringflow._pipeline import warm

    dev = rf.device("sim", seed=5, chaos=True)
    rf.drop_warm_pipelines()
    hb = dev.allocate_host(28_000)
    x = hb.view(np.float32, access="rw").reshape(SHAPE)
    seen = []
    for call in range(3):
        x[...] = contents(call)
        want = x * 3 + 1
        y = rf.stream_map(f, x, x, device=dev, chunk_bytes=CHUNK, x_buffer=hb, out_buffer=hb, inplace=True)
        np.testing.assert_array_equal(y, want)
        ((parked, *_),) = warm.WARM._parked.values()
        assert isinstance(parked, direct.DirectSchedule)
        assert all(g.host_in is None and g.host_out is None for g in parked.groups)  # no slice of the caller's
        seen.append(parked)
    assert seen[0] is seen[1] is seen[2]  # one schedule served every call
    x2 = contents(9)
    np.testing.assert_array_equal(rf.stream_map(f, x2, device=dev, chunk_bytes=CHUNK, host="register"), x2 * 3 + 1)
    assert len(warm.WARM) == 2
    # a profiled call (the report comes from the pipeline's timeline) and an observed one use the pipeline
    _, report = stream_map_report(f, x, x, device=dev, chunk_bytes=CHUNK, x_buffer=hb, out_buffer=hb, inplace=True)
    assert report is not None and report.chunks == 14
    pipes = []
    with engines(on=pipes.append):
        rf.stream_map(f, x, x, device=dev, chunk_bytes=CHUNK, x_buffer=hb, out_buffer=hb, inplace=True)
    assert len(pipes) == 1
    del pipes
    assert rf.drop_warm_pipelines(dev) >= 2
    hb.close()
    gc.collect()
    assert dev.live().total == 0


def test_stream_map_direct_failure_closes_the_schedule_and_raises_for_the_chunk():
    dev = rf.device("sim", seed=6, chaos=True)
    rf.drop_warm_pipelines()
    third_fails = copy_failing_on_call(3, ArithmeticError("overflow"))
    with pytest.raises(StageError) as info:
        rf.stream_map(third_fails, contents(1), device=dev, chunk_bytes=CHUNK, host="register")
    assert info.value.index == 2 and isinstance(info.value.__cause__, ArithmeticError)
    del info
    gc.collect()
    assert rf.drop_warm_pipelines(dev) == 0 and dev.live().total == 0


def test_stream_map_engine_option():
    from ringflow._pipeline import warm

    dev = rf.device("sim", seed=7, chaos=True)
    rf.drop_warm_pipelines()
    x = contents(3)
    for engine in ("pipeline", "direct", "auto"):
        np.testing.assert_array_equal(rf.stream_map(f, x, device=dev, chunk_bytes=CHUNK, host="register",
                                                    engine=engine), x * 3 + 1)
    kinds = sorted(type(e).__name__ for e, *_ in warm.WARM._parked.values())
    assert kinds == ["DirectSchedule", "ScheduledEngine"]  # auto reused the direct one
    with pytest.raises(ValueError, match="engine='direct' cannot run this job: host='stage'"):
        rf.stream_map(f, x, device=dev, chunk_bytes=CHUNK, host="stage", engine="direct")
    with pytest.raises(ValueError, match="engine must be"):
        rf.stream_map(f, x, device=dev, chunk_bytes=CHUNK, engine="graph")
    assert rf.drop_warm_pipelines(dev) == 2 and dev.live().total == 0


def test_a_profiled_direct_run_has_a_timeline_on_one_clock():
    """profile=True on the direct engine: every chunk's copy in, compute and copy out from
    timing events aligned to the host clock, in stream order and each after the one before it,
    plus the host's enqueueing of each copy group; the report and the Chrome trace come from it."""
    import json

    from ringflow._trace.chrome import to_chrome
    from ringflow._trace.timeline import ENQUEUE_TRACK

    dev = rf.device("sim", seed=8, chaos=True)
    rf.drop_warm_pipelines()
    x = contents(5)
    y, report = stream_map_report(f, x, device=dev, chunk_bytes=CHUNK, host="register")
    np.testing.assert_array_equal(y, x * 3 + 1)
    assert report.timeline.meta["engine"] == "direct" and report.chunks == 14
    recs = sorted(report.timeline.records, key=lambda r: r.index)
    for r in recs:
        (h0, h1), (c0, c1), (d0, d1) = (r.stages[s] for s in ("h2d", "compute", "d2h"))
        assert r.accepted <= h0 < h1 <= c0 < c1 <= d0 < d1 <= r.ended
        assert "prepare" not in r.stages and "consume" not in r.stages  # no CPU stage runs
    lanes = report.timeline.meta["compute_lanes"]  # chunk i computes on stream i % lanes
    for stage, step in (("h2d", 1), ("compute", lanes), ("d2h", 1)):  # a stream's spans in chunk order, apart
        for first in range(step):
            spans = [r.stages[stage] for r in recs[first::step]]
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    enqueues = [s for s in report.timeline.host if s.track == ENQUEUE_TRACK]
    # one span per copy group (its chunks are enqueued together), named by its first chunk
    firsts = [s.chunk for s in enqueues]
    assert firsts[0] == 0 and firsts == sorted(set(firsts)) and all(s.end >= s.start for s in enqueues)
    # the host's own enqueueing: it starts before the group's copy in and ends before its copy out does
    assert all(s.start <= recs[s.chunk].stages["h2d"][0] and s.end < recs[s.chunk].stages["d2h"][1] for s in enqueues)
    assert 0 < report.ideal_s <= report.measured_s and report.stage_median_s["compute"] > 0
    assert report.host_overhead_per_chunk_s > 0 and report.memory["device allocated"] > 0
    trace = json.loads(json.dumps(to_chrome(report.timeline)))
    names = {e.get("name", "").split(" #")[0] for e in trace["traceEvents"]}
    assert {"h2d", "compute", "d2h", "enqueue"} <= names
    # staging still profiles on the pipeline, with its five stages
    _, staged = stream_map_report(f, x, device=dev, chunk_bytes=CHUNK, host="stage")
    assert "engine" not in staged.timeline.meta and all("prepare" in r.stages for r in staged.timeline.records)
    rf.drop_warm_pipelines(dev)


def test_an_unprofiled_direct_run_records_no_timing_event():
    dev = rf.device("sim", seed=9)
    x = contents(6)
    with rf.MapJob(f, x, device=dev, chunk_bytes=CHUNK, host="register") as job:
        schedule = job._held.engine
        timed = []
        for s in (schedule.streams.h2d, *schedule.streams.computes, schedule.streams.d2h):
            record = s.record

            def counting(*a, _record=record, **kw):
                timed.append(kw.get("timing", False))
                return _record(*a, **kw)

            s.record = counting
        job()
        assert timed and not any(timed)
        schedule.run(profile=True)
        assert any(timed) and schedule.report().chunks == 14
        job()  # unprofiled again: the last timeline is dropped
        with pytest.raises(RuntimeError, match="no profiled call"):
            schedule.report()


@pytest.mark.gpu
def test_direct_profile_on_the_gpu(cuda_device):
    def twice_plus_one(x, y):
        y[...] = x * 2 + 1

    x = np.random.default_rng(3).integers(-1000, 1000, (4096, 256), dtype=np.int32)  # 4 MiB, 8 chunks
    y, report = stream_map_report(twice_plus_one, x, device=cuda_device, chunk_bytes=512 << 10, host="register",
                                  keep_warm=False)
    np.testing.assert_array_equal(y, x * 2 + 1)
    assert report.timeline.meta["engine"] == "direct" and report.chunks == 8
    for r in report.timeline.records:
        (h0, h1), (c0, c1), (d0, d1) = (r.stages[s] for s in ("h2d", "compute", "d2h"))
        assert h0 < h1 <= c0 + 1e-6 and c0 < c1 <= d0 + 1e-6 and d0 < d1  # event times: stream order
    assert 0 < report.ideal_s <= report.measured_s * 1.05
    with rf.MapJob(twice_plus_one, x, device=cuda_device, chunk_bytes=512 << 10, host="register") as job:
        np.testing.assert_array_equal(job(profile=True), x * 2 + 1)  # host buffers bound once
        assert job.report().chunks == 8 and job.report().stage_median_s["d2h"] > 0


@pytest.mark.parametrize("slots,streams", [(1, 4), (2, 4), (4, 4), (6, 4), (4, 1), (3, 2)])
def test_kernels_of_chunks_in_different_slots_run_on_streams_of_their_own(slots, streams):
    """compute_streams spreads compute over that many streams (never more than device slots), so
    kernels of different chunks may overlap; the result stays right under chaos and checked mode,
    and the report's bound counts one compute lane per stream (no run beats it)."""
    dev = rf.device("sim", seed=slots, chaos=True)
    x = contents(slots)
    with rf.MapJob(f, x, device=dev, chunk_bytes=CHUNK, host="register", slots=slots, checked=True,
                   compute_streams=streams) as job:
        schedule = job._held.engine
        assert schedule.compute_streams == min(slots, streams)
        assert len({id(s) for s in schedule.streams.computes}) == schedule.compute_streams
        for _ in range(2):
            np.testing.assert_array_equal(job(profile=True), x * 3 + 1)
        report = job.report()
        assert report.timeline.meta["compute_lanes"] == schedule.compute_streams
        assert report.ideal_s <= report.measured_s * (1 + 1e-9)
        del schedule
    assert dev.live().total == 0
    with pytest.raises(ValueError, match="compute_streams"):
        rf.stream_map(f, x, device=dev, host="register", compute_streams=0)


def test_copy_groups_follow_the_copy_curve_and_fit_the_rings():
    from ringflow._pipeline.sizing import copy_group

    dev = rf.device("sim").hardware
    planned = rf.SlotCounts(4, 3, 3, 4)
    big = copy_group(dev, 64 << 20, 100, planned, planned=True, inplace=False)
    assert big == (1, planned)  # a big chunk moves alone
    group, slots = copy_group(dev, 256 << 10, 1000, planned, planned=True, inplace=False)
    assert group > 1 and slots.device_in % group == 0 and slots.device_out % group == 0
    assert slots.device_in >= 4 * group and (slots.host_in, slots.host_out) == (4, 4)
    # a slower link's curve flattens later: bigger groups for the same chunk
    slow, _ = copy_group(rf.device("sim", profile="pcie4-x16").hardware, 256 << 10, 1000, planned, planned=True,
                         inplace=False)
    assert slow >= group
    assert copy_group(dev, 256 << 10, 64, planned, planned=True, inplace=True)[0] == 4  # sixteen groups at least
    assert copy_group(dev, 256 << 10, 8, planned, planned=True, inplace=True)[0] == 1
    given = rf.SlotCounts(6, 6, 6, 6)  # given rings keep their size: the group divides them twice over
    assert copy_group(dev, 256 << 10, 1000, given, planned=False, inplace=False) == (3, given)
    assert copy_group(dev, 256 << 10, 1000, rf.SlotCounts(5, 5, 5, 5), planned=False, inplace=False)[0] == 1


@pytest.mark.parametrize("how", ["stream_map", "MapJob"])
def test_an_engine_whose_layout_fails_frees_its_streams_and_rings(how):
    """The chunks' layout (here a compute's sim_seconds refused for the short last chunk) ran
    after the rings were allocated and outside their clean-up: each failed set-up leaked the
    device rings and every stream."""
    dev = rf.device("sim")

    def f(a, b):
        b[...] = a * 2

    f.sim_seconds = lambda n: 1e-5 if n == 100_000 else float("nan")
    x = rf.host.empty(65536, np.float32, device=dev)  # 262144 bytes: chunks of 100000, 100000, 62144
    out = rf.host.empty_like(x)
    for _ in range(2):
        with pytest.raises(ValueError, match="sim_seconds"):
            if how == "MapJob":
                rf.MapJob(f, x, out, device=dev, chunk_bytes=100_000)
            else:
                rf.stream_map(f, x, out=out, device=dev, chunk_bytes=100_000)
    rf.drop_warm_pipelines()
    del x, out
    gc.collect()
    assert dev.live().total == 0, dev.live()


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("checked", [False, True])
def test_a_warm_call_starts_its_first_copy_without_waiting_on_slots_its_last_sync_saw_done(inplace, checked):
    """After a call's last sync every slot's last use is done, so the next call's first pass
    through the rings enqueues no wait (the first would delay its first copy); a checked call's
    poison fills run on a stream of their own, which that sync does not cover, so it keeps them.
    The events forgotten are dropped once the next call's first copy is enqueued: neither in the
    tail of the call that recorded them nor before that copy."""
    dev = rf.device("sim", seed=4, chaos=True)
    x = contents(8)
    expected = x * 3 + 1
    with rf.MapJob(f, x, x if inplace else None, device=dev, chunk_bytes=CHUNK, host="register",
                   checked=checked) as job:
        schedule = job._held.engine
        h2d = schedule.streams.h2d
        seen = []
        previous: list = []  # weak references to the slots' events as the last call left them

        def logging(name):
            op = getattr(h2d, name)

            def logged(*a, **kw):
                alive = sum(ref() is not None for ref in previous)
                seen.append(name if name == "wait" else (name, alive))
                return op(*a, **kw)

            setattr(h2d, name, logged)

        logging("wait")
        logging("copy")
        x0 = x.copy()
        for call in range(3):
            x[...] = x0
            seen.clear()
            y = job()
            assert np.array_equal(y, expected)
            slots = len(schedule._in_ready)
            copies = [op for op in seen if op != "wait"]
            first_pass = seen[:seen.index(copies[0]) + 1]
            if call and not checked:
                assert first_pass == [("copy", len(previous))], seen  # no wait, and none dropped yet
                assert copies[1][1] == 0, seen  # all dropped once the first copy was on its way
                assert seen.count("wait") <= schedule.n_chunks - slots, (seen, slots)
            elif call:
                assert first_pass[0] == "wait", seen
            held = {id(e): e for e in schedule._in_ready + schedule._out_ready if e is not None}
            previous = [weakref.ref(e) for e in held.values()]
            del held
            assert previous and all(ref() is not None for ref in previous)  # kept past the call's return
