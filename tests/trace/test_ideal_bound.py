"""The report's ideal bound is a lower bound on the run's wall time: no run beats it.

On the simulated GPU stage durations are exact: ``charge`` sets a prepare's or consume's CPU
time, a compute callable's ``sim_seconds`` its kernel time, and the ``unit`` profile copies
1 MB in 1 ms each way (the two directions together fit its duplex link) with one CPU worker
copying 1 MB in 1 ms. A stage served by W workers may run W chunks at once, so a bound
that lets chunks pass a CPU stage only one interval apart after a first chunk overshoots.
"""

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ringflow as rf
from ringflow import _plan as plan
from ringflow._device.sim.pool import charge
from ringflow._trace.report import Report, ideal_seconds
from ringflow._trace.timeline import STAGES, ChunkRecord, Timeline

MB = 10**6
ms = 1e-3


def run_pipeline(*, workers, prepare_s, consume_s, compute_s, n, chaos=False, seed=0, slots=None,
                 profile="unit"):
    dev = rf.device("sim", profile=profile, chaos=chaos, seed=seed)

    def f(x, y):
        y[:] = x + 1

    f.sim_seconds = compute_s

    def prepare(item):
        charge(prepare_s)
        return item

    def consume(index, item, result):
        charge(consume_s)
        return float(result[0])

    items = [np.full(MB // 4, i, np.float32) for i in range(n)]
    with rf.Pipeline(f, device=dev, chunk_bytes=MB, workers=workers, profile=True, prepare=prepare,
                     consume=consume, slots=slots if slots is not None else max(4, workers + 2)) as pipe:
        out = list(pipe.map(items))
    assert out == [i + 1.0 for i in range(n)]
    return pipe.report()


def run_stream_map(*, workers, compute_s, n, host="stage", chaos=False, seed=0, profile="unit", **kw):
    dev = rf.device("sim", profile=profile, chaos=chaos, seed=seed)

    def f(x, y):
        y[:] = x * 2

    f.sim_seconds = compute_s
    x = np.arange(n * MB // 4 + 100, dtype=np.float32)  # a short last chunk
    y, rep = rf.stream_map_report(f, x, device=dev, chunk_bytes=MB, workers=workers, host=host, **kw)
    assert np.array_equal(y, x * 2)
    return rep


def assert_sound(rep, floor=0.5):
    assert rep.ideal_s <= rep.measured_s * (1 + 1e-9), rep.headline()
    assert rep.efficiency <= 1.0 + 1e-9, rep.headline()
    assert rep.efficiency > floor, rep.headline()


# -- by hand ----------------------------------------------------------------------------------

def test_workers_each_take_a_chunk_at_once_so_the_first_chunk_is_not_alone():
    """4 workers, 4 chunks: their prepares run side by side, so the bound is set by the four
    H2Ds in a row, not by a first chunk plus three intervals of (prepare + consume) / 4."""
    rep = run_pipeline(workers=4, prepare_s=3 * ms, consume_s=3 * ms, compute_s=0.0, n=4)
    latency = 4 + 1 + 0 + 1 + 4  # ms: prepare, h2d, compute, d2h, consume
    # four H2Ds in a row, then the last chunk's compute, D2H and consume
    h2d_bound = 4 + 4 * 1 + 0 + 1 + 4
    assert rep.ideal_s == pytest.approx(max(latency, h2d_bound) * ms)
    assert_sound(rep, floor=0.9)


def test_cpu_bound_pipeline_with_parallel_workers_was_over_its_bound():
    """The run that used to report efficiency 1.06: 2 workers, prepare and consume 4 ms each."""
    rep = run_pipeline(workers=2, prepare_s=3 * ms, consume_s=3 * ms, compute_s=0.2 * ms, n=12)
    # the pool holds 12 * (4 + 4) ms of work (each CPU stage also copies 1 MB: 1 ms) on 2 workers
    assert rep.ideal_s == pytest.approx(12 * 8 * ms / 2)
    assert rep.bottleneck == "cpu (prepare+consume)"
    assert_sound(rep, floor=0.9)


def test_the_demo_run_on_the_simulated_h200_is_within_its_bound():
    """The demo's profiled run: a pageable array staged by 4 workers on the H200 profile."""
    dev = rf.device("sim")
    x = np.random.default_rng(7).random(16 * (1 << 20) // 4, dtype=np.float32)

    def f(x, y):
        y[:] = x * 2 + 1

    y, rep = rf.stream_map_report(f, x, device=dev, chunk_bytes=1 << 20, workers=4)
    assert np.array_equal(y, x * 2 + 1)
    assert_sound(rep, floor=0.7)


def records(durations, *, gap=0.0):
    """ChunkRecords whose stages follow one another, chunk ``i`` accepted at ``i * gap``."""
    out = []
    for i, d in enumerate(durations):
        t = i * gap
        stages = {}
        for stage in STAGES:
            stages[stage] = (t, t + d[stage])
            t += d[stage]
        out.append(ChunkRecord(index=i, nbytes=1, final="delivered", accepted=i * gap, ended=t, stages=stages))
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.0, 5.0), min_size=5, max_size=5), st.integers(1, 40), st.integers(1, 9))
def test_identical_chunks_give_the_planners_bound(times, n, workers):
    """Over n identical chunks the report's bound is :func:`ringflow._plan.ideal_total`."""
    d = dict(zip(STAGES, times))
    t = plan.StageTimes(workers=workers, **d)
    assert ideal_seconds(records([d] * n), workers) == pytest.approx(plan.ideal_total(t, n), rel=1e-9, abs=1e-12)


def test_a_short_last_chunk_counts_its_own_time_and_hides_no_fill():
    """Medians times n would overstate a run whose last chunk is short, and a bound taking the
    shortest fill and drain of any chunk would take them from that short chunk: over the full
    chunks alone the H2D stream still needs a full prepare before and a full tail after."""
    full = {"prepare": 0.1, "h2d": 1.0, "compute": 0.1, "d2h": 0.1, "consume": 0.1}
    short = {k: v / 10 for k, v in full.items()}
    recs = records([full, full, full, short])
    # the three full chunks: a prepare (0.1), three H2Ds (3.0), compute, D2H and consume (0.3)
    assert ideal_seconds(recs, 1) == pytest.approx(0.1 + 3.0 + 0.3)
    # with the short chunk first, the last full chunk still ends 0.3 s after the H2Ds: not beaten
    assert ideal_seconds(recs, 1) < plan.ideal_total(plan.StageTimes(workers=1, **full), 4)


def test_host_stages_run_inline_count_on_the_scheduler_thread_not_the_pool():
    d = {"prepare": 1.0, "h2d": 0.1, "compute": 0.1, "d2h": 0.1, "consume": 1.0}
    pooled = records([d] * 8)
    inline = [ChunkRecord(r.index, r.nbytes, r.final, r.accepted, r.ended, r.stages, pooled=()) for r in pooled]
    # on a pool of 4: 8 chunks x 2 s / 4 workers; inline, one thread does all 16 s
    assert ideal_seconds(pooled, 4) == pytest.approx(max(16 / 4, 2 * 1.0 + 1.3))
    assert ideal_seconds(inline, 4) == pytest.approx(16.0)


def test_the_schedulers_host_work_counts_as_a_resource_of_one_lane_before_what_waits_for_it():
    """Four chunks of 0.1 s stages, all accepted at 0, each consume waiting for 1 s of the
    scheduler's host work for its chunk (the simulated GPU's model of a staged chunk's host
    time, one chunk's after another's): no run beats 4 x 1 s and the last consume after it,
    4.1 s, which the stages alone put at 0.8 s; the scheduler is the bottleneck, and its host
    work a span of its own in the trace."""
    recs = []
    for i in range(4):
        stages = {s: (0.1 * k, 0.1 * (k + 1)) for k, s in enumerate(STAGES[:-1])}
        stages["consume"] = (i + 1.0, i + 1.1)
        recs.append(ChunkRecord(index=i, nbytes=1, final="delivered", accepted=0.0, ended=i + 1.1, stages=stages,
                                scheduler=(float(i), i + 1.0)))
    assert ideal_seconds([dataclasses.replace(r, scheduler=None) for r in recs], 1) == pytest.approx(0.8)
    assert ideal_seconds(recs, 1) == pytest.approx(4 * 1.0 + 0.1)
    rep = Report.build(Timeline(records=recs), workers=1, memory={}, host_seconds=0.0)
    assert rep.bottleneck == "scheduler (host)" and rep.efficiency == pytest.approx(1.0)
    spans = [s for s in Timeline(records=recs).spans() if s.name == "scheduler"]
    assert [(s.track, s.chunk, s.duration) for s in spans] == [("cpu: scheduler", i, 1.0) for i in range(4)]


def test_report_uses_the_bound_and_names_the_busiest_resource():
    d = {"prepare": 1.0, "h2d": 0.5, "compute": 0.1, "d2h": 0.5, "consume": 3.0}
    rep = Report.build(Timeline(records=records([d] * 6, gap=2.0)), workers=2, memory={}, host_seconds=0.0)
    assert rep.ideal_s == pytest.approx(ideal_seconds(rep.timeline.records, 2)) == pytest.approx(6 * 4.0 / 2)
    assert rep.bottleneck == "cpu (prepare+consume)"
    assert rep.efficiency == pytest.approx(rep.ideal_s / rep.measured_s)


def test_an_empty_report_has_no_bound():
    rep = Report.build(Timeline(), workers=1, memory={}, host_seconds=0.0)
    assert rep.ideal_s == 0.0 and rep.chunks == 0 and math.isnan(rep.efficiency)


# -- no run beats it --------------------------------------------------------------------------

MIXES = {
    # (prepare s, consume s, compute s) charged per chunk; each CPU stage also copies 1 MB (1 ms
    # on one worker), each copy takes 1 ms
    "cpu": (3 * ms, 3 * ms, 0.2 * ms),
    "copy": (0.0, 0.0, 0.3 * ms),
    "compute": (0.0, 0.0, 3 * ms),
}


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mix=st.sampled_from(sorted(MIXES)), workers=st.integers(1, 8), n=st.integers(2, 14),
       chaos=st.booleans(), seed=st.integers(0, 10_000))
def test_no_pipeline_run_beats_its_bound(mix, workers, n, chaos, seed):
    prepare_s, consume_s, compute_s = MIXES[mix]
    if mix == "copy":
        workers = max(workers, 4)  # (1 + 1) ms of CPU per chunk on >= 4 workers: the copies bind
    rep = run_pipeline(workers=workers, prepare_s=prepare_s, consume_s=consume_s, compute_s=compute_s, n=n,
                       chaos=chaos, seed=seed)
    assert_sound(rep)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(host=st.sampled_from(["stage", "register", "pinned-pipeline"]), workers=st.integers(1, 6),
       compute_ms=st.sampled_from([0.1, 1.0, 3.0]), n=st.integers(2, 10), chaos=st.booleans(),
       seed=st.integers(0, 10_000), profile=st.sampled_from(["unit", "h200-pcie5"]))
def test_no_stream_map_run_beats_its_bound(host, workers, compute_ms, n, chaos, seed, profile):
    """Staged (CPU copies on the workers: CPU-bound with one worker, copy-bound with several),
    registered (the direct engine) and pinned on the pipeline engine (host stages inline)."""
    kw = {}
    if host == "pinned-pipeline":
        host, kw = "register", {"engine": "pipeline"}
    rep = run_stream_map(workers=workers, compute_s=compute_ms * ms, n=n, host=host, chaos=chaos, seed=seed,
                         profile=profile, **kw)
    assert_sound(rep)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_every_mix_with_chaos_stays_within_its_bound(mix, seed):
    prepare_s, consume_s, compute_s = MIXES[mix]
    rep = run_pipeline(workers=4, prepare_s=prepare_s, consume_s=consume_s, compute_s=compute_s, n=10,
                       chaos=True, seed=seed)
    assert_sound(rep)
    expected = {"cpu": "cpu (prepare+consume)", "copy": ("h2d", "d2h"), "compute": "compute"}[mix]
    assert rep.bottleneck in expected


# -- a host-bound call: the stream waits for the host between an operation's start event and the operation


@pytest.mark.parametrize("chunk_kib", [256, 512, 1024])
def test_an_unprofiled_host_bound_call_does_not_beat_the_profiled_calls_bound(chunk_kib):
    """Small chunks on the simulated H200 are bound by the host's cost per operation: a profiled
    call's start events then complete while the stream waits for the host to enqueue the
    operation. Counted in the stage's span, that wait made the bound longer than an unprofiled
    call (docs/design.md, "The ideal bound")."""
    from ringflow._bench import kernels

    dev = rf.device("sim")
    n = (16 << 20) // 4
    hb = dev.allocate_host(n * 4)
    x = hb.view(np.float32, access="rw")
    x[:] = 1.0
    job = rf.MapJob(kernels.affine(64, numeric_iters=4), x, x, device=dev, chunk_bytes=chunk_kib << 10,
                    x_buffer=hb, out_buffer=hb, inplace=True)
    try:
        job()
        t0 = dev.now
        job()
        unprofiled = dev.now - t0
        job(profile=True)
        bound = job.report().ideal_s
    finally:
        job.close()
        hb.close()
    assert 0 < bound <= unprofiled


def test_a_span_starts_no_earlier_than_its_operation_was_enqueued():
    from ringflow._trace.timeline import Anchor

    class Done:
        is_done = True

        def __init__(self, t):
            self.t = t

        def elapsed_since(self, other):
            return self.t - other.t

    anchor = Anchor.__new__(Anchor)
    anchor.event, anchor.host, anchor.floor = Done(0.0), 100.0, 0.0
    events = {"h2d.start": Done(1.0), "h2d.end": Done(5.0)}
    assert anchor.span_of(events, "h2d") == (101.0, 105.0)
    assert anchor.span_of({**events, "h2d.enqueued": 103.0}, "h2d") == (103.0, 105.0)
    assert anchor.span_of({**events, "h2d.enqueued": 100.5}, "h2d") == (101.0, 105.0)  # the stream was busy
    assert anchor.span_of({**events, "h2d.enqueued": 107.0}, "h2d") == (105.0, 105.0)  # never past its end
    assert anchor.span_of({"h2d.start": Done(1.0)}, "h2d") is None
    anchor.floor = 0.5  # the events' own time comes off the end, never past the start
    assert anchor.span_of(events, "h2d") == (101.0, 104.5)
    assert anchor.span_of({**events, "h2d.enqueued": 104.8}, "h2d") == (104.8, 104.8)
