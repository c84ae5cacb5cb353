"""Planning a whole-array job (``ringflow._pipeline.sizing``): which jobs are compute-bound, the
compute streams and tapered chunks they get, and what that buys on the simulated clock."""

from __future__ import annotations

import dataclasses
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ringflow as rf
from ringflow import _plan as plan
from ringflow._pipeline import sizing, whole_array
from ringflow._pipeline.whole_array import stream_map_report

MiB = 1 << 20


# the computes write with out= and in place: a temporary (x * 2) would refuse a graph's capture
def heavy(x, y):  # a kernel three times as long as a 4 MiB chunk's copy in, in proportion to its bytes
    np.multiply(x, 2, out=y)
    y += 1


def light(x, y):  # as long as its chunk's copy in: balanced, not compute-bound
    np.multiply(x, 2, out=y)
    y += 1


def _copy_s(nbytes: int) -> float:
    return plan.model_stage_times(rf.device("sim").hardware, nbytes).h2d


heavy.sim_seconds = lambda nbytes: 3 * _copy_s(4 * MiB) * nbytes / (4 * MiB)
light.sim_seconds = lambda nbytes: _copy_s(nbytes)


def slow(x, y):  # 1 us a byte: compute-bound for any chunk of two taper floors (lowered to 64 bytes) or more
    np.multiply(x, 2, out=y)
    y += 1


# in proportion to the bytes, so that a shorter chunk has a shorter kernel (a cost given as a number
# is the same for any chunk, and such a compute is not tapered)
slow.sim_seconds = lambda nbytes: nbytes * 1e-6


def unknown(x, y):  # no cost the planner can read
    y[...] = x * 2 + 1


# -- chunk sizes ------------------------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(length=st.integers(1, 5000), rows=st.integers(1, 600), steps=st.integers(0, 4))
def test_chunk_sizes_cover_the_rows_in_order_with_no_chunk_above_rows(length, rows, steps):
    head = tuple(sorted({max(1, rows >> k) for k in range(1, steps + 1)} - {rows}))
    sizes = sizing.chunk_sizes(length, rows, head)
    assert sum(sizes) == length
    assert all(0 < n <= rows for n in sizes)
    if head and len(sizes) > 1 and length >= 2 * sum(head) + rows:
        assert tuple(sizes[:len(head)]) == head and tuple(sizes[-len(head):]) == head[::-1]
        assert rows in sizes  # a whole chunk between the ends


def test_without_a_taper_every_chunk_is_whole_but_the_last():
    assert sizing.chunk_sizes(10, 4) == [4, 4, 2]
    assert sizing.chunk_sizes(8, 4) == [4, 4]
    assert sizing.chunk_sizes(3, 4) == [3]


def test_a_taper_doubles_up_to_whole_chunks_and_halves_back_down():
    assert sizing.chunk_sizes(100, 16, (2, 4, 8)) == [2, 4, 8] + [16] * 4 + [8] + [8, 4, 2]
    assert sizing.chunk_sizes(44, 16, (2, 4, 8)) == [2, 4, 8, 16, 8, 4, 2]
    # too short for both ends and a whole chunk: no taper
    assert sizing.chunk_sizes(43, 16, (2, 4, 8)) == [16, 16, 11]


def test_the_taper_halves_the_chunk_down_to_its_floor_at_most_four_times():
    row = 4
    rows = 8 * MiB // row
    assert sizing.taper(rows, row) == tuple(rows >> k for k in (4, 3, 2, 1))  # 512 KiB to 4 MiB
    assert sizing.taper(2 * MiB // row, row) == (MiB // 8, MiB // 4)  # 512 KiB, 1 MiB
    assert sizing.taper(MiB // row, row) == (MiB // 8,)
    assert sizing.taper(MiB // 2 // row, row) == ()  # half of it would be under the floor
    assert sizing.taper(1, 64 * MiB) == ()  # one row a chunk cannot be halved


def test_the_taper_cuts_no_chunk_whose_kernel_would_fall_below_the_shortest_kernel():
    """A whole chunk's kernel of 8 ms, 1 ms the shortest kernel: a chunk of an eighth of the rows takes
    that 1 ms in proportion, a sixteenth would take it too, for half the bytes."""
    row = 4
    rows = 8 * MiB // row
    assert sizing.taper(rows, row, kernel_s=8e-3, kernel_min_s=1e-3) == (rows >> 3, rows >> 2, rows >> 1)
    assert sizing.taper(rows, row, kernel_s=1e-3, kernel_min_s=1e-3) == ()  # the whole chunk's kernel is at the floor
    assert sizing.taper(rows, row, kernel_s=8e-3, kernel_min_s=0.0) == sizing.taper(rows, row)


# -- compute-bound ----------------------------------------------------------------------------------
def test_compute_bound_needs_a_kernel_twice_its_longer_copy():
    assert sizing.is_compute_bound(2.0, 1.0, 0.5)
    assert not sizing.is_compute_bound(1.9, 1.0, 0.5)
    assert not sizing.is_compute_bound(3.0, 1.0, 2.0)  # the copy out is the longer


def test_the_plan_reads_the_compute_cost_or_says_it_does_not_know():
    dev = rf.device("sim")
    assert sizing.planned_compute_bound(dev, heavy, 4 * MiB, 4 * MiB) is True
    assert sizing.planned_compute_bound(dev, light, 4 * MiB, 4 * MiB) is False
    assert sizing.planned_compute_bound(dev, unknown, 4 * MiB, 4 * MiB) is None


def test_compute_streams_two_for_compute_bound_jobs_one_else_and_a_given_count_wins():
    assert sizing.compute_streams_for(None, 1, True) == sizing.COMPUTE_BOUND_STREAMS == 2
    assert sizing.compute_streams_for(None, 1, False) == 1
    assert sizing.compute_streams_for(None, 1, None) == 1
    assert sizing.compute_streams_for(3, 1, True) == 3
    assert sizing.compute_streams_for(None, 8, True) == sizing.GROUP_COMPUTE_STREAMS


def _job(f, dev_x, **kw):
    dev, x = dev_x
    return rf.MapJob(f, x, rf.host.empty_like(x), device=dev, chunk_bytes=4 * MiB, **kw)


def _pinned(nbytes: int, seed: int = 0, *, chaos: bool = False):
    """``(device, x)``: a new sim device and a float32 pool array of it (pinned: the direct
    engine copies it in place) holding random values."""
    dev = rf.device("sim", seed=seed, chaos=chaos)
    x = rf.host.empty(nbytes // 4, np.float32, device=dev)
    x[:] = np.random.default_rng(seed).uniform(-1, 1, x.shape)
    return dev, x


def test_a_compute_bound_job_is_tapered_and_gets_two_compute_streams():
    x = _pinned(64 * MiB)
    with _job(heavy, x) as job:
        assert job.engine == "direct"
        assert job.chunks == 3 + 14 + 1 + 3  # 512 KiB, 1 MiB and 2 MiB at each end, 1 MiB left between
        assert job._held.engine.compute_streams == 2
    with _job(light, x) as job:
        assert job.chunks == 16
        assert job._held.engine.compute_streams == 1
    with _job(heavy, x, compute_streams=1) as job:  # the caller's count wins; the taper stays
        assert job.chunks == 21 and job._held.engine.compute_streams == 1


def test_a_compute_bound_job_on_the_scheduled_engine_counts_the_whole_chunks_it_runs():
    """The scheduled engine cuts whole chunks only (no taper), so a compute-bound job on it runs
    and counts the untapered chunks."""
    dev, x = _pinned(64 * MiB)
    with rf.MapJob(heavy, x, device=dev, chunk_bytes=4 * MiB, engine="pipeline") as job:
        job(profile=True)
        assert job.chunks == job.report().chunks == 16


@pytest.mark.parametrize("engine", ["direct", "pipeline"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tapered_jobs_are_bit_exact_under_chaos_with_the_checker(engine, seed):
    dev, x = _pinned(3 * MiB + 37 * 4, seed, chaos=True)  # a short whole chunk too
    y = rf.stream_map(heavy, x, device=dev, chunk_bytes=MiB, engine=engine, checked=True, keep_warm=False)
    np.testing.assert_array_equal(y, x * 2 + 1)


def _sim_seconds(f, dev_x) -> float:
    """Virtual seconds of one direct-engine call of ``f`` on ``x``, planned anew (a remembered
    plan would not see a planning constant patched since: call_memo.py)."""
    from ringflow._pipeline import call_memo

    call_memo.MEMO.forget()
    dev, x = dev_x
    out = rf.host.empty_like(x)
    t0 = dev.now
    rf.stream_map(f, x, out, device=dev, chunk_bytes=4 * MiB, compute_streams=1, engine="direct", keep_warm=False)
    return dev.now - t0


def test_the_taper_shortens_a_compute_bound_run_by_its_shorter_end_copies():
    """Expected: the first copy in and the last copy out overlap no kernel; tapered they move
    512 KiB instead of 4 MiB each."""
    x = _pinned(64 * MiB)
    tapered = _sim_seconds(heavy, x)
    with mock.patch.object(sizing, "TAPER_STEPS", 0):
        plain = _sim_seconds(heavy, x)
    ends = 2 * (_copy_s(4 * MiB) - _copy_s(MiB // 2))
    assert plain - tapered >= 0.5 * ends, (plain, tapered, ends)


def test_a_tapered_run_never_beats_its_ideal_bound():
    dev, x = _pinned(32 * MiB, 4)
    y, rep = stream_map_report(heavy, x, rf.host.empty_like(x), device=dev, chunk_bytes=4 * MiB, engine="direct")
    np.testing.assert_array_equal(y, x * 2 + 1)
    assert rep.chunks == 3 + 6 + 1 + 3  # 3.5 MiB at each end, six whole chunks and 1 MiB between
    assert 0 < rep.ideal_s <= rep.measured_s


def _report_and_seconds(f, dev_x):
    """``(report, virtual seconds)`` of a planned direct-engine stream_map of ``f`` over ``x``
    in 4 MiB chunks, its result checked."""
    dev, x = dev_x
    t0 = dev.now
    y, rep = stream_map_report(f, x, rf.host.empty_like(x), device=dev, chunk_bytes=4 * MiB, engine="direct",
                               keep_warm=False)
    seconds = dev.now - t0
    np.testing.assert_array_equal(y, x * 2 + 1)
    return rep, seconds


def test_a_compute_of_fixed_cost_is_not_tapered_and_runs_no_slower_for_it():
    """A number as ``sim_seconds`` is the kernel's time for any chunk: a shorter chunk's kernel
    takes as long as a whole one's, so a taper would add kernels and shorten none. The job is
    still compute-bound (two compute streams) but runs whole chunks, in no more time on the
    simulated clock than with the taper it would have had; a cost in proportion to the bytes,
    the same for a whole chunk, still tapers."""
    def fixed(x, y):
        np.multiply(x, 2, out=y)
        y += 1

    fixed.sim_seconds = 3 * _copy_s(4 * MiB)  # heavy's whole chunk, for a chunk of any size
    x = _pinned(64 * MiB, 9)
    plain, plain_s = _report_and_seconds(fixed, x)
    assert plain.chunks == 16 and plain.timeline.meta["compute_lanes"] == 2
    with _job(fixed, x) as job:
        assert job.chunks == 16 and job._held.engine.compute_streams == 2
    with mock.patch.object(whole_array, "fixed_cost", return_value=False):  # the taper it would have had
        tapered, tapered_s = _report_and_seconds(fixed, x)
    assert tapered.chunks == 3 + 14 + 1 + 3
    assert plain_s < tapered_s, (plain_s, tapered_s)
    per_byte, _ = _report_and_seconds(heavy, x)
    assert per_byte.chunks == 3 + 14 + 1 + 3 and per_byte.timeline.meta["compute_lanes"] == 2


def _doubled(x, y):
    np.multiply(x, 2, out=y)
    y += 1


def _raises_below_a_whole_chunk(nbytes: int) -> float:
    if nbytes < 4 * MiB:
        raise RuntimeError("no cost for a short chunk")
    return 1e-3


def _shorter_below_half_a_chunk(nbytes: int) -> float:
    return 1e-3 if nbytes >= 2 * MiB else 1e-4


@pytest.mark.parametrize("cost, fixed", [
    (None, False), (1e-3, True), (lambda nbytes: 1e-3, True), (lambda nbytes: 1e-3 + 0 * nbytes, True),
    (lambda nbytes: nbytes * 1e-9, False), (lambda nbytes: 1e-3 + nbytes * 1e-12, False),
    (_raises_below_a_whole_chunk, False), (lambda nbytes: float("nan") if nbytes < 4 * MiB else 1e-3, False),
    (_shorter_below_half_a_chunk, False)],
    ids=["none", "seconds", "constant-function", "constant-expression", "per-byte", "affine", "raises-short",
         "refused-short", "same-at-half-shorter-below"])
def test_a_cost_is_fixed_when_a_chunk_and_the_shortest_taper_chunk_take_the_same_time(cost, fixed):
    """A number is one time for any chunk; a function counts as one when it gives a chunk of the
    bytes asked about and the taper's shortest chunk the same seconds: one that gives half a
    chunk a whole one's time but less to shorter chunks is tapered. A function that raises, or
    gives no valid seconds, at either size is not known to be fixed."""
    f = mock.Mock(spec=["sim_seconds"], sim_seconds=cost)
    assert sizing.fixed_cost(f, 4 * MiB, MiB // 2) is fixed
    if callable(cost):  # no shorter chunk: nothing to compare
        assert sizing.fixed_cost(f, 4 * MiB, 4 * MiB) is False and sizing.fixed_cost(f, 1, 0) is False


def test_a_cost_the_same_for_half_a_chunk_but_shorter_below_is_tapered():
    """The taper's shortest chunks have shorter kernels than whole ones, though its first halving
    does not: the job is tapered, and its result right."""
    def stepped(x, y):
        _doubled(x, y)

    stepped.sim_seconds = lambda nbytes: 3 * _copy_s(4 * MiB) * (1.0 if nbytes >= 2 * MiB else nbytes / (4 * MiB))
    rep, _ = _report_and_seconds(stepped, _pinned(64 * MiB, 10))
    assert rep.chunks == 3 + 14 + 1 + 3 and rep.timeline.meta["compute_lanes"] == 2


def test_a_compute_whose_cost_function_returns_one_time_is_not_tapered():
    """A ``sim_seconds`` function that returns the same seconds for any chunk is a fixed cost, as
    a number is: its job is compute-bound (two compute streams) but runs whole chunks, no taper."""
    def fixed(x, y):
        _doubled(x, y)

    seconds = 3 * _copy_s(4 * MiB)
    fixed.sim_seconds = lambda nbytes: seconds
    x = _pinned(64 * MiB, 9)
    rep, _ = _report_and_seconds(fixed, x)
    assert rep.chunks == 16 and rep.timeline.meta["compute_lanes"] == 2
    with _job(fixed, x) as job:
        assert job.chunks == 16 and job._held.engine.compute_streams == 2


# -- measured on first use --------------------------------------------------------------------------
@pytest.mark.parametrize("f, bound", [(heavy, True), (light, False)])
def test_an_unknown_cost_is_measured_on_the_first_call_and_plans_the_later_ones(f, bound):
    """The planner cannot read the cost (as for any kernel on a real GPU): the first call runs
    on one compute stream and times a chunk; later calls get two streams if it was
    compute-bound. Results stay right throughout."""
    dev, x = _pinned(32 * MiB, 5)
    with mock.patch.object(whole_array, "planned_compute_bound", return_value=None):
        with _job(f, (dev, x)) as job:
            engine = job._held.engine
            assert job.chunks == 8 and engine.compute_streams == 1 and engine.measured_compute_bound is None
            for _ in range(3):
                np.testing.assert_array_equal(job(), x * 2 + 1)
                assert engine.measured_compute_bound is bound
                assert engine.compute_streams == (2 if bound else 1)
                assert job.chunks == (3 + 6 + 1 + 3 if bound else 8)  # tapered from the second call on


def test_nothing_is_measured_when_the_cost_is_known_or_the_streams_are_given():
    dev, x = _pinned(32 * MiB, 6)
    with _job(heavy, (dev, x)) as job:
        job()
        assert job._held.engine.measured_compute_bound is None
    with mock.patch.object(whole_array, "planned_compute_bound", return_value=None):
        with _job(heavy, (dev, x), compute_streams=1) as job:
            job()
            assert job._held.engine.measured_compute_bound is None and job._held.engine.compute_streams == 1


@pytest.mark.parametrize("f", [heavy, light])
def test_a_measured_plan_is_captured_as_a_graph_with_the_streams_it_uses(f):
    dev, x = _pinned(32 * MiB, 7)
    with mock.patch.object(whole_array, "planned_compute_bound", return_value=None):
        with _job(f, (dev, x), graph=True) as job:
            for _ in range(3):
                np.testing.assert_array_equal(job(), x * 2 + 1)
            assert job.replays_graph


def test_the_copy_model_is_asked_once_per_profile_and_sizes():
    """Every stream_map call plans its layout: the copy times come from a cache after the first."""
    profile = rf.device("sim").hardware
    want = plan.model_stage_times(profile, 3 * MiB, out_bytes=MiB)
    sizing._COPY_SECONDS.clear()
    with mock.patch.object(plan, "model_stage_times", wraps=plan.model_stage_times) as model:
        for _ in range(3):
            assert sizing._copy_seconds(profile, 3 * MiB, MiB) == (want.h2d, want.d2h)
        assert model.call_count == 1
        sizing._copy_seconds(rf.device("sim", profile="pcie4-x16").hardware, 3 * MiB, MiB)
        assert model.call_count == 2


def test_the_host_cpus_are_asked_of_the_system_once(monkeypatch):
    calls = []
    monkeypatch.setattr(sizing.os, "cpu_count", lambda: calls.append(1) or 8)
    sizing.host_cpus.cache_clear()
    try:
        gpu = type("Gpu", (), {"backend": "cuda"})()
        assert [sizing.default_workers(gpu) for _ in range(3)] == [7, 7, 7]
        assert len(calls) == 1
    finally:
        sizing.host_cpus.cache_clear()


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 3000), cols=st.integers(1, 9), chunk_rows=st.integers(1, 400),
       engine=st.sampled_from(["direct", "pipeline"]), inplace=st.booleans(), seed=st.integers(0, 2 ** 16),
       streams=st.sampled_from([None, 1, 3]))
def test_random_tapered_jobs_are_bit_exact_under_chaos(rows, cols, chunk_rows, engine, inplace, seed, streams):
    """Any shape, chunk size and engine, the taper's floor lowered to 64 bytes so that small jobs
    taper too; the checker on, chaos reordering completions, the checked mode's poison."""
    dev = rf.device("sim", seed=seed, chaos=True)
    x = rf.host.empty((rows, cols), np.float32, device=dev)
    x[...] = np.random.default_rng(seed).uniform(-1, 1, x.shape)
    want = x * 2 + 1
    out = x if inplace else rf.host.empty_like(x)
    with mock.patch.object(sizing, "TAPER_MIN_BYTES", 64):
        y = rf.stream_map(slow, x, out, device=dev, chunk_bytes=chunk_rows * cols * 4, engine=engine,
                          inplace=inplace, checked=True, compute_streams=streams, keep_warm=False)
    np.testing.assert_array_equal(y, want)


def _second_call_seconds(dev, x) -> float:
    with _job(heavy, (dev, x), compute_streams=None) as job:
        job()  # measures
        t0 = dev.now
        job()
        return dev.now - t0


def test_a_measured_compute_bound_job_runs_its_later_calls_tapered_and_faster():
    """Expected: as the planned taper, the first copy in and the last copy out shortened."""
    dev, x = _pinned(64 * MiB, 8)
    with mock.patch.object(whole_array, "planned_compute_bound", return_value=None):
        tapered = _second_call_seconds(dev, x)
        with mock.patch.object(sizing, "TAPER_STEPS", 0):
            plain = _second_call_seconds(dev, x)
    ends = 2 * (_copy_s(4 * MiB) - _copy_s(MiB // 2))
    assert plain - tapered >= 0.5 * ends, (plain, tapered, ends)


def _measured_second_call(profile, total: int, taper: bool) -> tuple[float, int]:
    """(virtual seconds, chunks) of the second call of a MapJob whose compute declares no cost
    (the first call times a chunk's kernel), ``taper`` False: with no halving allowed."""
    dev = rf.device("sim", profile=profile, checked=False)
    x = rf.host.empty(total // 4, np.float32, device=dev)
    x[:] = 1
    with mock.patch.object(sizing, "TAPER_STEPS", sizing.TAPER_STEPS if taper else 0), \
            rf.MapJob(unknown, x, rf.host.empty_like(x), device=dev, chunk_bytes=4 * MiB) as job:
        job()  # measures
        assert job._held.engine.measured_compute_bound
        t0 = dev.now
        job()
        return dev.now - t0, job.chunks


def test_a_measured_job_whose_kernels_take_the_shortest_kernel_is_not_tapered():
    """A compute of no declared cost on a profile whose shortest kernel is 1 ms: every kernel takes
    that 1 ms (a chunk's bytes need far less), far above a 4 MiB copy, so the job is compute-bound.
    Halving a chunk leaves its kernel at 1 ms: the taper would add kernels and shorten none, so the
    later calls run the whole chunks, no slower than without a taper."""
    p = dataclasses.replace(plan.get_profile("h200-pcie5"), name="slow-kernels", kernel_min_s=1e-3)
    tapered, chunks = _measured_second_call(p, 64 * MiB, True)
    plain, whole = _measured_second_call(p, 64 * MiB, False)
    assert chunks == whole == 16
    assert tapered <= plain


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 3000), cols=st.integers(1, 9), chunk_rows=st.integers(1, 400), inplace=st.booleans(),
       seed=st.integers(0, 2 ** 16), graph=st.booleans())
def test_random_measured_jobs_stay_bit_exact_when_later_calls_taper(rows, cols, chunk_rows, inplace, seed, graph):
    """The cost unknown to the planner: the first call measures a chunk, finds it compute-bound,
    and the later calls run tapered on two streams (a graph captured from the second call on);
    every call right under chaos with the checker and poison."""
    dev = rf.device("sim", seed=seed, chaos=True)
    x = rf.host.empty((rows, cols), np.float32, device=dev)
    x[...] = np.random.default_rng(seed).uniform(-1, 1, x.shape)
    want = x * 2 + 1
    with mock.patch.object(sizing, "TAPER_MIN_BYTES", 64), \
            mock.patch.object(whole_array, "planned_compute_bound", return_value=None):
        out = x if inplace else rf.host.empty_like(x)
        with rf.MapJob(slow, x, out, device=dev, chunk_bytes=chunk_rows * cols * 4, inplace=inplace, checked=True,
                       graph=graph) as job:
            for _ in range(3):
                if inplace:  # the call before wrote its result over the input: the same input again
                    x[...] = np.random.default_rng(seed).uniform(-1, 1, x.shape)
                np.testing.assert_array_equal(job(), want)
            assert job.replays_graph is graph


def test_copy_groups_of_many_tiny_chunks_keep_rings_a_slot_counts_can_hold():
    """Planned rings grow to hold whole copy groups; with chunks of a few bytes a group holds
    many thousands of them, and the rings a SlotCounts can hold bound the group instead."""
    dev = rf.device("sim").hardware
    group, slots = sizing.copy_group(dev, 64, 10 ** 7, plan.SlotCounts(3, 3, 3, 3), planned=True, inplace=False)
    assert group > 1 and slots.device_in % group == 0 and slots.device_out % group == 0
    assert max(slots.device_in, slots.device_out) <= plan.MAX_SLOTS


# -- a result of other bytes than its input ---------------------------------------------------------
def _planned_from_times(profile, in_bytes: int, out_bytes: int, workers: int, compute_s: float) -> plan.SlotCounts:
    """The rings planned from the modelled stage times of a chunk of ``in_bytes`` in and ``out_bytes`` out."""
    times = plan.model_stage_times(profile, in_bytes, compute=compute_s, workers=workers, out_bytes=out_bytes)
    return plan.with_device_slack(plan.plan_slots(times).slots, inplace=False)


def test_the_slot_plan_models_the_copy_back_and_consume_at_the_results_bytes():
    """A result of a sixteenth of its input's bytes copies back and is consumed in a fraction of
    the input's times: the rings are planned from those times (model_stage_times given the
    result's bytes), not from a copy back as long as the copy in."""
    small = sizing.planned_slots("h200-pcie5", MiB, False, 8, 0.0, out_bytes=MiB // 16)
    assert small == _planned_from_times("h200-pcie5", MiB, MiB // 16, 8, 0.0)
    same = sizing.planned_slots("h200-pcie5", MiB, False, 8, 0.0)
    assert same == _planned_from_times("h200-pcie5", MiB, MiB, 8, 0.0)
    assert small.host_out < same.host_out  # a shorter consume holds a host-out slot less long
    # the default is a result of the input's bytes
    assert sizing.planned_slots("h200-pcie5", MiB, False, 8, 0.0, out_bytes=MiB) == same


@pytest.mark.parametrize("out_cols, chunk", [(16, MiB), (1024, 256 << 10)], ids=["small-result", "large-result"])
def test_a_whole_array_job_plans_its_rings_for_its_results_bytes(out_cols, chunk):
    """stream_map with output= of fewer (or more) bytes a row than x: the pipeline's rings are
    planned from a chunk's input bytes in and its result's bytes out. They were planned as if
    the result were as large as the slot (the larger of the two) both ways."""
    from tests.helpers.hooks import engines

    rows, cols = 4096, 256  # float32 rows of 1 KiB in; a slot holds the wider of a row in and a row out

    def f(x, y):
        y[:] = x[:, :1]

    f.sim_seconds = 0.0
    x = np.ones((rows, cols), np.float32)
    seen = []
    with engines(on=seen.append):
        y = rf.stream_map(f, x, device=rf.device("sim", checked=False), chunk_bytes=chunk, workers=2, host="stage",
                          output=((x.shape[0], out_cols), np.float32), keep_warm=False)
    assert np.array_equal(y, np.broadcast_to(x[:, :1], y.shape))
    in_row, out_row = cols * 4, out_cols * 4
    per_chunk = chunk // max(in_row, out_row)
    n = -(-x.shape[0] // per_chunk)
    hardware = rf.device("sim").hardware
    as_if_same = sizing.planned_slots(hardware, chunk, False, 2, 0.0, bulk=True, max_chunks=n)
    assert seen[0].config.slots != as_if_same
    want = sizing.planned_slots(hardware, per_chunk * in_row, False, 2, 0.0, bulk=True, max_chunks=n,
                                out_bytes=per_chunk * out_row)
    assert seen[0].config.slots == want


def _small_memory(mem: int):
    return dataclasses.replace(plan.get_profile("h200-pcie5"), name="small-memory", total_memory=mem)


def test_copy_groups_fit_the_devices_memory_with_the_results_own_bytes():
    """The direct engine's device-out slots hold a chunk's result: a group refused because its
    rings of input-sized results would not fit the device is allowed where the results are
    small, and one that fits with input-sized results is refused where they are larger."""
    chunk, n = 256 << 10, 256
    planned = plan.SlotCounts(3, 3, 3, 3)
    big, _ = sizing.copy_group("h200-pcie5", chunk, n, planned, planned=True, inplace=False)
    # room for the device-in ring grown to whole groups of that size and little more
    mem = 4 * big * chunk + 4 * big * chunk // 16
    same, rings = sizing.copy_group(_small_memory(mem), chunk, n, planned, planned=True, inplace=False)
    assert same < big and (rings.device_in + rings.device_out) * chunk <= mem
    small, rings = sizing.copy_group(_small_memory(mem), chunk, n, planned, planned=True, inplace=False,
                                     out_bytes=chunk // 16)
    assert small == big and rings.device_in * chunk + rings.device_out * chunk // 16 <= mem
    # results four times the input's bytes: rings of input-sized results would fit, these do not
    mem = 8 * big * chunk
    wide, rings = sizing.copy_group(_small_memory(mem), chunk, n, planned, planned=True, inplace=False)
    assert wide == big
    large, rings = sizing.copy_group(_small_memory(mem), chunk, n, planned, planned=True, inplace=False,
                                     out_bytes=4 * chunk)
    assert large < big and rings.device_in * chunk + rings.device_out * 4 * chunk <= mem


def test_the_direct_engine_groups_small_results_within_the_devices_memory():
    """stream_map of pinned data (the direct engine) whose result is a sixteenth of its input:
    its copy groups are checked against the device's memory with result-sized device-out slots,
    as the engine allocates them. Checked with input-sized ones, the groups were cut smaller."""
    from tests.helpers.hooks import engines

    chunk, n = 256 << 10, 256
    planned = plan.SlotCounts(3, 3, 3, 3)
    big, _ = sizing.copy_group("h200-pcie5", chunk, n, planned, planned=True, inplace=False)
    profile = _small_memory(4 * big * chunk + 4 * big * chunk // 16)

    def f(x, y):
        y[:] = x[:, :16]

    f.sim_seconds = 0.0
    x = np.arange(n * chunk // 4, dtype=np.float32).reshape(-1, 256)
    seen = []
    with engines(on=seen.append):
        y = rf.stream_map(f, x, device=rf.device("sim", profile=profile, checked=False), chunk_bytes=chunk, workers=4,
                          host="register", output=((x.shape[0], 16), np.float32), keep_warm=False)
    assert np.array_equal(y, x[:, :16])
    (engine,) = seen
    assert engine.copy_group == big
    slots = sizing.planned_slots(profile, chunk, False, 4, 0.0, external=(True, True), bulk=True, max_chunks=n,
                                 out_bytes=chunk // 16)
    group, rings = sizing.copy_group(profile, chunk, n, slots, planned=True, inplace=False, out_bytes=chunk // 16)
    assert group == big
    assert engine.dev_in.nbytes + engine.dev_out.nbytes == rings.device_in * chunk + rings.device_out * chunk // 16
    assert engine.dev_in.nbytes + engine.dev_out.nbytes <= profile.total_memory


def test_a_pipeline_with_an_output_spec_plans_its_rings_for_the_specs_bytes():
    """ringflow.Pipeline with one output= (shape, dtype) for every item: its results' bytes are
    known, and the rings are planned for them coming back (items are planned at a slot's bytes)."""
    def f(x, y):
        y[:] = x[:16]

    f.sim_seconds = 0.0
    hardware = rf.device("sim").hardware
    with rf.Pipeline(f, device=rf.device("sim", checked=False), chunk_bytes=MiB, workers=8,
                     output=((16,), np.float32)) as pipe:
        got = pipe.config.slots
        (y,) = list(pipe.map([np.arange(MiB // 4, dtype=np.float32)]))
    assert np.array_equal(y, np.arange(16, dtype=np.float32))
    assert got != sizing.planned_slots(hardware, MiB, False, 8, 0.0)
    assert got == sizing.planned_slots(hardware, MiB, False, 8, 0.0, out_bytes=64)


def test_the_planned_pinned_caps_count_host_in_slots_of_a_chunks_input():
    """Results 4x a chunk's input: a host-in slot is allocated at the input's bytes
    (plan.host_in_slot), so the pinned caps of the planned floors count it so. The slot per worker
    (two rings under WORKER_SLOTS_PINNED_CAP) and the prepare's two slots per worker (host-in
    alone under PREPARE_SLOTS_PINNED_CAP) each get the slots those bytes allow; in place, a host-in
    slot is a whole chunk's bytes and the floors stay as they were."""
    cap_pair = plan.WORKER_SLOTS_PINNED_CAP // (16 * MiB + 64 * MiB)
    bulk = sizing.planned_slots("h200-pcie5", 16 * MiB, False, 4, 0.0, bulk=True, out_bytes=64 * MiB)
    assert cap_pair == 3 and bulk.host_in == 3 and bulk.host_out >= 3
    floor = min(sizing.PREPARE_SLOTS_PER_WORKER * 4, sizing.PREPARE_SLOTS_PINNED_CAP // (64 * MiB))
    fed = sizing.planned_slots("h200-pcie5", 64 * MiB, False, 4, 0.0, user_prepare=True, out_bytes=256 * MiB)
    assert floor == 8 and fed.host_in == 8
    in_place = sizing.planned_slots("h200-pcie5", 64 * MiB, True, 4, 0.0, user_prepare=True, out_bytes=256 * MiB)
    assert in_place.host_in == 2  # PREPARE_SLOTS_PINNED_CAP holds two slots of 256 MiB
