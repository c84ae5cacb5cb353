"""``MapJob(graph=True)``: the direct engine's call captured once and replayed (the waits that
order it are checked in graph mode too, in ``test_direct.py``). Here: what a replay reports,
what happens when the capture is refused or interrupted, and what is left afterwards."""

from __future__ import annotations

import gc
import logging
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ringflow as rf
from ringflow._device.sim.stream import SimStream
from ringflow._errors import CaptureError, StageError
from ringflow._pipeline import sizing
from tests.helpers.pipeline_checks import copy_failing_on_call

CHUNK = 4096


def f(x, y):  # with out= and in place: a temporary (x * 3) would refuse the capture
    np.multiply(x, 3, out=y)
    y += 1


def row_sums(x, y):
    x.sum(axis=1, dtype=np.float64, out=y[:, 0])
    x.max(axis=1, out=y[:, 1])


def job_over(x, dev, fn=f, **kw):
    return rf.MapJob(fn, x, device=dev, chunk_bytes=CHUNK, host="register", graph=True, **kw)


def data(seed=0, n=10_000):
    return np.random.default_rng(seed).uniform(size=n).astype(np.float32)


def _calls_with_no_graph_warned(caplog, x, dev, check, **job_kw) -> str:
    """Three calls of a ``job_over(x, dev, **job_kw)``, new data in ``x`` each time, none
    replaying a graph, each result passed to ``check(result, x)``; returns the one "could not be
    captured" warning logged, once nothing of the device is left live."""
    with caplog.at_level(logging.WARNING, logger="ringflow"), job_over(x, dev, **job_kw) as job:
        for call in range(3):
            x[:] = data(call)
            check(job(), x)
            assert not job.replays_graph
    warned = [r.getMessage() for r in caplog.records if "could not be captured" in r.getMessage()]
    assert len(warned) == 1, warned
    assert dev.live().total == 0
    return warned[0]


def _is_f_of(y, x) -> None:
    """``y`` is what :func:`f` makes of ``x``."""
    assert np.array_equal(y, x * 3 + 1)


def test_calls_replay_the_graph_and_profiled_calls_do_not():
    dev = rf.device("sim", seed=3, chaos=True)
    x = data()
    with job_over(x, dev, checked=True) as job:
        for call in range(6):
            x[:] = data(call)
            profile = call == 2
            assert np.array_equal(job(profile=profile), x * 3 + 1)
            assert job.replays_graph is (call > 0 and not profile)  # the first call warms the compute
            if profile:
                assert job.report().chunks == job.chunks
    assert dev.live().total == 0


def test_a_replay_calls_f_no_more_and_keeps_the_host_state_f_read_while_captured():
    """As a CUDA graph does: ``f`` is called for each chunk of the first call and of the call
    that captures, and never in a replay, which computes on each call's new data with the host
    values (a global, a counter) that ``f`` read while it was captured."""
    dev = rf.device("sim", seed=5, chaos=True)
    calls, scale = [0], [2.0]

    def scaled(x, y):
        calls[0] += 1
        np.multiply(x, scale[0], out=y)
        y += calls[0]

    def counted(first):  # what f added to each element: its call's count, one chunk after another
        return np.arange(first, first + n).repeat(CHUNK // 4)[:x.size].astype(np.float32)

    x = data()
    # one compute stream: the chunks' kernels, and so f's calls, come in chunk order
    with job_over(x, dev, fn=scaled, checked=True, compute_streams=1) as job:
        n = job.chunks
        for call in range(5):
            x[:] = data(call)
            scale[0] = 10.0 + call  # read by f on the first call and while captured (the second)
            before = calls[0]
            y = job()
            assert calls[0] - before == (n if call < 2 else 0)
            assert job.replays_graph is (call > 0)
            frozen = min(call, 1)
            assert np.array_equal(y, x * np.float32(10 + frozen) + counted(1 + frozen * n))
    assert dev.live().total == 0


def _copy_refusing_negatives(x, y):
    if (x < 0).any():
        raise ValueError("a negative value")
    y[...] = x


COPY = rf.Kernel('extern "C" __global__ void copy(const float* x, float* y, size_t n) {}', "copy",
                 reference=_copy_refusing_negatives)


def test_a_kernel_failing_in_a_replay_is_reported_for_its_chunk():
    """A kernel's body is device code: each replay runs it on that call's data (on the simulated
    GPU, an ``rf.Kernel``'s reference), and a failure there is reported for its chunk."""
    dev = rf.device("sim", seed=1, chaos=True)
    x = data()
    job = job_over(x, dev, fn=COPY)
    for _ in range(3):
        assert np.array_equal(job(), x)
    assert job.replays_graph
    x[5 * CHUNK // 4 + 3] = -1
    with pytest.raises(StageError) as info:
        job()
    assert info.value.stage == "compute" and info.value.index == 5
    assert isinstance(info.value.__cause__, ValueError)
    assert job.closed
    del info  # its traceback holds the call's frames, and so their events
    gc.collect()
    assert dev.live().total == 0


def test_a_compute_raising_while_captured_is_logged_and_the_job_runs_without_a_graph(caplog):
    """As on a GPU: ``f`` runs when the capture launches it, so an exception it raises there
    refuses the capture, and the call (and every later one) runs without a graph."""
    dev = rf.device("sim", seed=1, chaos=True)
    x = data()
    chunks = -(-x.nbytes // CHUNK)
    fn = copy_failing_on_call(chunks + 6, ValueError("bad chunk"))  # the capture's sixth call

    def is_a_copy(y, x):
        assert np.array_equal(y, x)

    assert "ValueError: bad chunk" in _calls_with_no_graph_warned(caplog, x, dev, is_a_copy, fn=fn)


def test_a_refused_capture_is_logged_and_the_job_runs_without_a_graph(monkeypatch, caplog):
    def refuse(self):
        self.abort_capture()
        raise CaptureError("capture abandoned: compute synchronised its stream")

    monkeypatch.setattr(SimStream, "end_capture", refuse)
    dev = rf.device("sim", seed=2, chaos=True)
    x = data()
    assert "compute synchronised its stream" in _calls_with_no_graph_warned(caplog, x, dev, _is_f_of, checked=True)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_while_capturing_closes_the_job_and_leaves_nothing(monkeypatch, exc):
    launch = SimStream.launch

    def interrupted(self, *args, **kw):
        if self._capture() is not None:
            raise exc()
        return launch(self, *args, **kw)

    monkeypatch.setattr(SimStream, "launch", interrupted)
    dev = rf.device("sim", seed=4, chaos=True)
    x = data()
    job = job_over(x, dev)
    job()
    with pytest.raises(exc):
        job()
    assert job.closed and not dev._captures
    assert dev.live().total == 0


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_as_the_capture_begins_leaves_no_capture(monkeypatch, exc):
    """Ctrl-C (a second one, which a shielded call raises at once) landing as ``begin_capture``
    returns: the capture has begun but nothing has been enqueued yet. It must be abandoned, or
    the device goes on capturing for this thread, and every later allocation on the thread is
    refused as made while capturing."""
    begin = SimStream.begin_capture

    def interrupted(self):
        begin(self)
        raise exc()  # as a signal raised at the instruction after the call

    dev = rf.device("sim", seed=4, chaos=True)
    x = data()
    job = job_over(x, dev)
    job()
    with monkeypatch.context() as patch:
        patch.setattr(SimStream, "begin_capture", interrupted)
        with pytest.raises(exc):
            job()
    assert job.closed and not dev._captures
    assert dev.live().total == 0
    with job_over(x, dev) as again:  # the thread allocates (and captures) as before
        for _ in range(3):
            _is_f_of(again(), x)
        assert again.replays_graph
    assert dev.live().total == 0


def test_a_compute_reading_its_data_on_the_host_is_captured_by_no_graph(caplog):
    """``float(x.max())`` needs the GPU to have run the work captured so far: a synchronisation,
    which a capture refuses. On the simulated GPU too: logged, and every call runs without a
    graph (and right)."""
    def normalised(x, y):
        y[...] = x / float(x.max())

    dev = rf.device("sim", seed=6, chaos=True)
    x = data()

    def normalised_by_chunk(y, x):
        for start in range(0, x.size, CHUNK // 4):
            chunk = x[start:start + CHUNK // 4]
            assert np.array_equal(y[start:start + CHUNK // 4], chunk / float(chunk.max()))

    warned = _calls_with_no_graph_warned(caplog, x, dev, normalised_by_chunk, fn=normalised)
    assert "read device data on the host" in warned and "float()" in warned


def test_a_compute_synchronising_the_device_while_captured_is_captured_by_no_graph(caplog):
    """A compute that synchronises the device while its call is captured asks a GPU for what a
    capture refuses (cudaErrorStreamCaptureUnsupported): on the simulated GPU too, logged with
    the reason, and every call runs without a graph (and right). (Called uncaptured, a launched
    callable is a kernel there, which must not block, so it synchronises only when captured.)"""
    dev = rf.device("sim", seed=8, chaos=True)
    x = data()
    chunks = -(-x.nbytes // CHUNK)
    calls = []

    def synchronising(x, y):
        calls.append(1)
        f(x, y)
        if len(calls) == chunks + 1:  # the capture's first call
            dev.synchronize()

    warned = _calls_with_no_graph_warned(caplog, x, dev, _is_f_of, fn=synchronising)
    assert "synchronising the device while" in warned, warned


def test_a_compute_making_a_temporary_is_captured_by_no_graph(caplog):
    """``x * 3`` makes a new device array, which a GPU's caching allocator hands out while the
    stream captures: a capture refuses it. On the simulated GPU too: logged, with what made the
    array and how to write without one, and every call runs without a graph (and right)."""
    def temporary(x, y):
        y[...] = x * 3 + 1

    dev = rf.device("sim", seed=7, chaos=True)
    x = data()
    warned = _calls_with_no_graph_warned(caplog, x, dev, _is_f_of, fn=temporary)
    assert "allocated device memory while captured: np.multiply made a new" in warned
    assert "out=" in warned and "in place" in warned


def test_graph_needs_the_direct_engine(caplog):
    dev = rf.device("sim")
    x = data()
    with caplog.at_level(logging.WARNING, logger="ringflow"), \
            rf.MapJob(f, x, device=dev, chunk_bytes=CHUNK, host="stage", graph=True) as job:
        assert np.array_equal(job(), x * 3 + 1)
        assert job.engine == "pipeline" and not job.replays_graph
    assert any("runs without a graph" in r.getMessage() for r in caplog.records)


def test_graph_over_several_devices_replays_on_each():
    x = data(n=40_000)
    with rf.MapJob(f, x, device=["sim:0", "sim:1"], chunk_bytes=CHUNK, host="register", graph=True) as job:
        for call in range(3):
            x[:] = data(call, n=x.size)
            assert np.array_equal(job(), x * 3 + 1)
            assert job.replays_graph is (call > 0)


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_graph_must_be_a_bool(bad):
    with pytest.raises(TypeError, match="graph must be True or False"):
        rf.MapJob(f, data(), device=rf.device("sim"), graph=bad)


def test_stream_map_takes_no_graph():
    with pytest.raises(TypeError, match="graph"):
        rf.stream_map(f, data(), device=rf.device("sim"), graph=True)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(1, 2000), cols=st.integers(1, 9), chunk_rows=st.integers(1, 400),
       slots=st.sampled_from([None, 1, 2, 3, 4, 6, 8]), streams=st.sampled_from([None, 1, 2, 4]),
       inplace=st.booleans(), checked=st.booleans(), graph=st.booleans(), min_groups=st.sampled_from([2, 16]),
       reshaped=st.booleans(), seed=st.integers(0, 2**16))
def test_random_jobs_in_copy_groups_and_graphs_are_right_under_chaos(rows, cols, chunk_rows, slots, streams, inplace,
                                                                    checked, graph, min_groups, reshaped, seed):
    """Any shape, chunk size, ring, stream count and group rule (the planned sixteen groups, or
    two so that groups form on small jobs too), a result of another row shape and dtype or not,
    with and without a graph: every call right, under chaos with the checker on, and nothing left.
    At most 256 chunks a call (chunk_rows raised where needed): an example's time is its chunks'
    (1 to 2000 rows of one row each had a mean of 160, most of this file's time), and 256 still
    makes copy groups of up to 16 chunks with sixteen groups, of up to 128 with two."""
    chunk_rows = max(chunk_rows, -(-rows // 256))
    dev = rf.device("sim", seed=seed, chaos=True)
    x = np.random.default_rng(seed).uniform(size=(rows, cols)).astype(np.float32)
    reshaped = reshaped and not inplace
    fn, output = (row_sums, ((rows, 2), "float64")) if reshaped else (f, None)
    with mock.patch.object(sizing, "MIN_COPY_GROUPS", min_groups), \
            rf.MapJob(fn, x, x if inplace else None, device=dev, host="register",
                      chunk_bytes=chunk_rows * max(cols * 4, 16 if reshaped else 0),  # a row of each side fits
                      slots=slots, compute_streams=streams, inplace=inplace, checked=checked, graph=graph,
                      output=output) as job:
        for call in range(3):
            x[...] = np.random.default_rng(seed + call).uniform(size=x.shape).astype(np.float32)
            expected = np.empty((rows, 2)) if reshaped else x * 3 + 1
            if reshaped:
                row_sums(x, expected)
            assert np.array_equal(job(), expected)
            assert job.replays_graph is (graph and call > 0)
    assert dev.live().total == 0
