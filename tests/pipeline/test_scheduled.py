"""The scheduled engine (a whole-array job on the scheduler) on the simulated GPU: the host time
per chunk it spends on a job it runs unstaged, as the planner charges it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import ringflow as rf
from ringflow import _plan as plan
from tests.helpers import Timeline

KiB, MiB = 1 << 10, 1 << 20
HOST_S = 1e-3  # the scheduler's host time per chunk: long against a small chunk's copies
CHUNK = 64 * KiB
UNSTAGED = [{"engine": "pipeline"}, {"on_error": "continue"}]
UNSTAGED_IDS = ["engine-pipeline", "on-error-continue"]


def slow_scheduler():
    return dataclasses.replace(plan.get_profile("h200-pcie5"), name="slow-scheduler", scheduled_chunk_host_s=HOST_S)


def double(x, y):
    np.multiply(x, 2, out=y)


double.sim_seconds = 0.0  # (the plan below charges the kernel nothing either)


def pinned_report(total_bytes, **options):
    """The report of a profiled stream_map of ``double`` over ``total_bytes`` of pinned float32
    (``ringflow.host.empty``, in and out) in chunks of CHUNK, on a new simulated GPU whose
    scheduler takes HOST_S a chunk; checks the result."""
    dev = rf.device("sim", profile=slow_scheduler())
    try:
        x = rf.host.empty(total_bytes // 4, np.float32, device=dev)
        x[:] = np.arange(x.size)
        out = rf.host.empty_like(x, device=dev)
        y, report = rf.stream_map_report(double, x, out, device=dev, chunk_bytes=CHUNK, keep_warm=False, **options)
        assert y is out and np.array_equal(y, x * 2)
        return report
    finally:
        dev.close()


@pytest.mark.parametrize("options", UNSTAGED, ids=UNSTAGED_IDS)
def test_an_unstaged_job_of_small_chunks_takes_the_schedulers_host_time_the_plan_charges(options):
    """64 chunks of 64 KiB of pinned memory that the scheduler runs unstaged: the planner charges
    each the scheduler's host time (the profile's scheduled_chunk_host_s), which bounds the job.
    The simulated GPU spends it too (a chunk's copy in waits for its host work, one chunk's after
    another's), so the run takes at least the chunks times that figure and the planned time
    within 10% (without it, a fraction of that), the same on every run, its bound naming the
    scheduler."""
    total = 4 * MiB
    chunks = total // CHUNK
    t, predicted = plan.predict_seconds(slow_scheduler(), total, CHUNK, host_stages=False, scheduler=True)
    assert t.scheduler == HOST_S and t.bottleneck == "scheduler (host)"
    report = pinned_report(total, **options)
    assert report.chunks == chunks
    assert report.measured_s >= chunks * HOST_S
    assert report.measured_s == pytest.approx(predicted, rel=0.10)
    assert pinned_report(total, **options).measured_s == report.measured_s  # deterministic
    assert report.bottleneck == "scheduler (host)"
    assert 0.8 < report.efficiency <= 1.0 + 1e-9, report.headline()


def test_the_direct_engine_is_not_charged_the_schedulers_host_time():
    """The same job on the direct engine (the default on pinned memory): the scheduler's figure
    is no cost of it, in the plan or on the simulated GPU."""
    total = 4 * MiB
    chunks = total // CHUNK
    report = pinned_report(total)
    assert report.chunks == chunks
    assert report.measured_s < chunks * HOST_S / 4
    _, direct = plan.predict_seconds(slow_scheduler(), total, CHUNK, host_stages=False)
    assert direct < chunks * HOST_S / 4


@pytest.mark.parametrize("options", UNSTAGED, ids=UNSTAGED_IDS)
@pytest.mark.parametrize("seed", range(4))
def test_an_unstaged_chunks_copy_in_comes_after_its_host_work_under_chaos(seed, options):
    """Under chaos, checked: each chunk's copy in starts once the scheduler's host work for it is
    done (the i-th host work on its lane, the i-th copy in on the stream), the host work of one
    chunk after another's; the happens-before checker finds nothing and the result is right."""
    dev = rf.device("sim", profile=slow_scheduler(), seed=seed, chaos=True)
    try:
        tl = Timeline(dev)
        x = rf.host.empty((96, 1000), np.float32, device=dev)
        x[:] = np.random.default_rng(seed).uniform(0.5, 1.5, x.shape)
        out = rf.host.empty_like(x, device=dev)
        got = rf.stream_map(double, x, out, device=dev, chunk_bytes=8 * 1000 * 4, checked=True, keep_warm=False,
                            **options)
        assert got is out and np.array_equal(out, x * 2)
        work, copies = tl.of("submitter's host work"), tl.of("copy h2d")
        assert len(work) == len(copies) == 12
        assert all(a.done_at <= b.started_at for a, b in zip(work, work[1:]))
        assert all(w.done_at <= c.started_at for w, c in zip(work, copies))
        assert dev.checks > 0
    finally:
        dev.close()


def test_a_pool_that_does_not_model_host_work_gives_an_unstaged_job_none(monkeypatch):
    """A real GPU's worker pool spends no time for ``host_work`` (its host spends its own): the
    scheduler asks such a pool for none, and no chunk's copy in waits for any (on the simulated
    GPU told so, the run takes the stages' time alone)."""
    from ringflow._device.sim.pool import SimWorkerPool

    asked = []
    real = SimWorkerPool.host_work
    monkeypatch.setattr(SimWorkerPool, "models_host_work", False)
    monkeypatch.setattr(SimWorkerPool, "host_work", lambda self, seconds: asked.append(seconds) or real(self, seconds))
    report = pinned_report(4 * MiB, engine="pipeline")
    assert asked == [] and report.chunks == 64
    assert report.measured_s < 64 * HOST_S / 4
