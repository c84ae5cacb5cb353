"""MapJob: a whole-array job set up once and run many times on changing contents."""

import doctest
import gc
import logging
import threading
import warnings
import weakref

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ringflow as rf
from ringflow._errors import StageError
from ringflow import _testing
from ringflow._pipeline import job as job_module
from ringflow._pipeline import scheduler as scheduler_module
from ringflow._pipeline.states import RingKind, SlotState
from tests.helpers.hooks import pipeline_of
from tests.helpers.interrupts import InterruptAt
from tests.helpers.pipeline_checks import copy_failing_on_call
from tests.helpers.sim import named_sims
from tests.helpers.threads import bounded


def f(x, y):
    y[:] = x * 2 + 1


def contents(shape, seed):
    return np.random.default_rng(seed).uniform(0.5, 1.5, shape).astype(np.float32)


def test_the_module_example_runs():
    assert doctest.testmod(job_module).failed == 0


@pytest.mark.parametrize("engine", ["auto", "pipeline"])
@pytest.mark.parametrize("host", ["stage", "register", "pinned"])
@pytest.mark.parametrize("seed", range(5))
def test_every_call_computes_the_current_contents_under_chaos(host, seed, engine):
    dev = rf.device("sim", seed=seed, chaos=True)
    shape = (777, 5)
    kw = {}
    if host == "pinned":
        hx, hy = dev.allocate_host(777 * 5 * 4), dev.allocate_host(777 * 5 * 4)
        x, out = hx.view(np.float32).reshape(shape), hy.view(np.float32).reshape(shape)
        kw = {"x_buffer": hx, "out_buffer": hy}
    else:
        x, out = np.empty(shape, np.float32), None
        kw = {"host": host}
    with rf.MapJob(f, x, out, device=dev, chunk_bytes=5 * 4 * 61, checked=True, engine=engine, **kw) as job:
        assert job.strategy == host and job.chunks == 13
        assert job.engine == ("direct" if engine == "auto" and host != "stage" else "pipeline")
        for call in range(4):
            x[...] = contents(shape, 10 * seed + call)  # the host writes between calls
            y = job()
            assert y is job.out
            np.testing.assert_array_equal(y, x * 2 + 1)
    assert rf.drop_warm_pipelines(dev) == 0  # a job keeps its own pipeline, never the shared cache
    if host == "pinned":
        hx.close()
        hy.close()
    assert dev.live().total == 0


def test_in_place_and_given_out():
    dev = rf.device("sim", seed=3, chaos=True)
    x = contents(4000, 1)
    expected = x * 2 + 1
    with rf.MapJob(f, x, x, device=dev, chunk_bytes=4096, inplace=True) as job:
        assert job() is x
    np.testing.assert_array_equal(x, expected)
    out = np.zeros_like(x)
    with rf.MapJob(f, x, out, device=dev, chunk_bytes=4096) as job:
        assert job() is out
    np.testing.assert_array_equal(out, x * 2 + 1)


def test_register_pins_once_for_the_jobs_life():
    dev = rf.device("sim")
    registered = []
    original = dev.register_host

    def counting(arr):
        buf = original(arr)
        registered.append(buf)
        return buf

    dev.register_host = counting
    x = contents(3000, 2)
    job = rf.MapJob(f, x, device=dev, chunk_bytes=4096, host="register")
    for _ in range(5):
        np.testing.assert_array_equal(job(), x * 2 + 1)
    assert len(registered) == 2  # x and out, once each, however many calls
    assert dev.live().host_buffers == 2
    job.close()
    job.close()  # harmless twice
    assert dev.live().total == 0


def test_a_failing_call_closes_the_job_and_loses_nothing():
    dev = rf.device("sim")
    flaky = copy_failing_on_call(7, RuntimeError("the kernel refused"))

    x = contents(4000, 3)
    job = rf.MapJob(flaky, x, device=dev, chunk_bytes=4096, host="register")
    np.testing.assert_array_equal(job(), x)  # 4 chunks: calls 1-4
    with pytest.raises(StageError) as info:
        job()
    assert isinstance(info.value.__cause__, RuntimeError) and job.closed
    with pytest.raises(RuntimeError, match="closed"):
        job()
    del info
    gc.collect()
    assert dev.live().total == 0  # pipeline and registrations released with the failure


@pytest.mark.parametrize("host", ["register", "pinned"])
def test_a_device_closed_by_another_thread_mid_call_fails_the_call_cleanly(host, monkeypatch):
    """Another thread closes the device between two of the direct engine's chunks: the call
    raises the device's own error and the job is closed, and its clean-up (freeing the device
    rings, dropping the registrations) warns of no hazard: the close ran every copy to
    completion, though the calling thread could not see them complete."""
    from ringflow._pipeline.direct import DirectSchedule

    dev = rf.device("sim", seed=3, chaos=True, checked=True)
    if host == "pinned":
        x, out = rf.host.empty(8192, np.float32, device=dev), rf.host.empty(8192, np.float32, device=dev)
    else:
        x, out = np.empty(8192, np.float32), None
    x[:] = contents(8192, 4)
    job = rf.MapJob(f, x, out, device=dev, chunk_bytes=4096, host="auto" if host == "pinned" else host)
    assert job.engine == "direct" and job.strategy == host and job.chunks == 8
    np.testing.assert_array_equal(job(), x * 2 + 1)
    enqueue, groups = DirectSchedule._enqueue, []

    def enqueue_closing_at_the_fifth(self, *args, **kw):
        groups.append(None)
        if len(groups) == 5:
            bounded(dev.close)  # on another thread, which returns once the device is closed
        return enqueue(self, *args, **kw)

    monkeypatch.setattr(DirectSchedule, "_enqueue", enqueue_closing_at_the_fifth)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean-up that failed warns
        with pytest.raises(RuntimeError, match="this simulated device is closed"):
            job()
        assert job.closed
        job.close()
    assert dev.live().total == 0


@pytest.mark.parametrize("call", ["job", "stream_map"])
def test_a_device_closed_by_another_thread_mid_staged_call_frees_its_host_rings(call, caplog):
    """Another thread closes the device while the scheduled engine stages a call through its
    pinned host rings (the second chunk's result is back, six chunks to go): the call raises the
    device's own error, as on the direct engine, and its clean-up frees the host rings. The close
    ran every operation to completion and none runs after it, so nothing can still write them;
    they used to be kept until the process ended, with a warning that a progress thread had died
    (a whole-array call has none)."""
    dev = rf.device("sim", seed=3, chaos=True, checked=True)
    x = contents(8192, 4)
    engines, rings, results_back = [], [], []

    def close_at_the_second_result(kind, slot, old, new):
        if kind is RingKind.HOST_OUT and new is SlotState.CONSUMING:
            results_back.append(None)
            if len(results_back) == 2:
                rings.extend(weakref.ref(r.buffer) for r in pipeline_of(engines[0]()).scheduler.rings if r.buffer.is_host)
                bounded(dev.close)  # on another thread, which returns once the device is closed

    kept = len(scheduler_module.KEPT)
    with _testing.inject(slot_hook=close_at_the_second_result, on_engine=lambda e: engines.append(weakref.ref(e))), \
            warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="ringflow"):
        warnings.simplefilter("error")  # a clean-up that failed warns
        with pytest.raises(RuntimeError, match="this simulated device is closed"):
            if call == "job":
                with rf.MapJob(f, x, device=dev, chunk_bytes=4096, host="stage") as job:
                    assert job.engine == "pipeline" and job.chunks == 8
                    job()
            else:
                rf.stream_map(f, x, device=dev, chunk_bytes=4096, host="stage")
    assert len(rings) == 2, rings  # the input and result rings, staged through
    assert not caplog.records, caplog.text
    assert len(scheduler_module.KEPT) == kept
    assert dev.live().total == 0, dev.live()
    gc.collect()
    assert all(ref() is None for ref in rings)  # nothing keeps them


def test_bad_arguments_say_what_to_change():
    dev = rf.device("sim")
    with pytest.raises(TypeError, match="numpy array"):
        rf.MapJob(f, [1.0, 2.0], device=dev)
    with pytest.raises(ValueError, match="at least one element"):
        rf.MapJob(f, np.empty((0, 3), np.float32), device=dev)
    with pytest.raises(TypeError, match="profile"):  # a job is profiled per call: job(profile=True)
        rf.MapJob(f, np.ones(8, np.float32), device=dev, profile=True)
    with pytest.raises(ValueError, match="host must be"):
        rf.MapJob(f, np.ones(8, np.float32), device=dev, host="pin")
    with pytest.raises(ValueError, match="out must be"):
        rf.MapJob(f, np.ones(8, np.float32), np.ones(9, np.float32), device=dev)
    with pytest.raises(ValueError, match="raise chunk_bytes"):
        rf.MapJob(f, np.ones((4, 100), np.float32), device=dev, chunk_bytes=64)
    assert dev.live().total == 0


def test_matches_stream_map_for_the_same_arguments():
    dev = rf.device("sim", seed=4, chaos=True)
    x = contents((1234, 3), 5)
    with rf.MapJob(f, x, device=dev, chunk_bytes="auto") as job:
        y = job().copy()
    np.testing.assert_array_equal(y, rf.stream_map(f, x, device=dev, chunk_bytes="auto"))
    assert "chunks" in repr(job) and "closed" in repr(job)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(1, 400), width=st.integers(1, 9), dtype=st.sampled_from(["float32", "float64", "int32"]),
       rows_per_chunk=st.integers(1, 64), host=st.sampled_from(["stage", "register", "auto"]),
       calls=st.integers(1, 4), seed=st.integers(0, 2**16), in_place=st.booleans(),
       engine=st.sampled_from(["auto", "pipeline"]))
def test_any_shape_any_chunking_any_strategy(rows, width, dtype, rows_per_chunk, host, calls, seed, in_place, engine):
    dev = rf.device("sim", seed=seed, chaos=True)
    rng = np.random.default_rng(seed)
    x = (rng.uniform(-100, 100, (rows, width))).astype(dtype)
    out = x if in_place else None
    item = x.itemsize * width

    def g(a, b):
        b[...] = a * 3 - 1

    with rf.MapJob(g, x, out, device=dev, chunk_bytes=rows_per_chunk * item, host=host, inplace=in_place,
                   engine=engine) as job:
        for _ in range(calls):
            new = (rng.uniform(-100, 100, (rows, width))).astype(dtype)
            x[...] = new
            y = job()
            np.testing.assert_array_equal(y, new * 3 - 1)
    assert dev.live().total == 0


def test_one_call_profiled():
    """job(profile=True) times that call and job.report() reads it, on either engine; the next
    unprofiled call drops it."""
    dev = rf.device("sim", seed=4, chaos=True)
    x = contents((900, 3), 2)
    for host, engine in (("register", "direct"), ("stage", "pipeline"), ("register", "pipeline")):
        with rf.MapJob(f, x, device=dev, chunk_bytes=3 * 4 * 100, host=host) as job:
            assert job.engine == engine or host == "register"
            with pytest.raises(RuntimeError, match="profile=True"):
                job.report()
            np.testing.assert_array_equal(job(profile=True), x * 2 + 1)
            report = job.report()
            assert report.chunks == job.chunks == 9 and report.ideal_s <= report.measured_s
            assert {"h2d", "compute", "d2h"} <= set(report.stage_median_s) and report.stage_median_s["h2d"] > 0
            np.testing.assert_array_equal(job(), x * 2 + 1)
            with pytest.raises(RuntimeError, match="no profiled call"):
                job.report()
    assert dev.live().total == 0


def test_a_job_uses_pool_arrays_as_they_are_rather_than_pinning_them_again():
    """Pool arrays are pinned already (a real GPU refuses to register them again): a job over
    two of them reads and writes them in place; over one, it registers only the other."""
    dev = rf.device("sim")
    x = rf.host.empty((64, 256), np.float32, device=dev)
    x[:] = 1
    out = rf.host.empty((64, 256), np.float32, device=dev)

    def f(a, b):
        b[:] = a * 2

    with rf.MapJob(f, x, out, device=dev, chunk_bytes=4096) as job:
        assert job.strategy == "pinned"
        np.testing.assert_array_equal(job(), np.full((64, 256), 2, np.float32))
    with rf.MapJob(f, x, device=dev, chunk_bytes=4096, host="register") as job:
        assert len(job._held.registered) == 1 and job._held.registered[0].holds(job.out)
        np.testing.assert_array_equal(job(), np.full((64, 256), 2, np.float32))


@pytest.mark.parametrize("host", ["auto", "register", "stage"])
@pytest.mark.parametrize("pooled", [True, False], ids=["pool arrays", "numpy arrays"])
def test_a_job_made_on_one_thread_is_called_and_closed_on_others(host, pooled):
    """The job's set-up (what it took in: pool arrays made on yet other threads, registrations)
    is handed to the first call like one call to the next: no spurious HazardError."""
    dev = rf.device("sim", seed=3, chaos=True)
    if pooled:
        x = bounded(lambda: rf.host.empty((5000,), np.float32, device=dev))
        out = bounded(lambda: rf.host.empty((5000,), np.float32, device=dev))
    else:
        x, out = np.empty(5000, np.float32), np.empty(5000, np.float32)
    x[:] = 3
    job = bounded(lambda: rf.MapJob(f, x, out, device=dev, chunk_bytes=4096, host=host))
    for k in range(3):
        y = bounded(job)
        np.testing.assert_array_equal(y, x * 2 + 1)
        x[:] = k
    bounded(job.close)
    x = out = y = None  # the pool arrays go back before the count
    gc.collect()
    assert dev.live().total == 0


def _reshape(a):
    a.shape = (50, 20)


def _retype(a):
    a.dtype = np.int32


def _freeze(a):
    a.flags.writeable = False


# (what a hostile caller does to an array between calls, which array, whether it can be undone)
CHANGES = [(_reshape, "x"), (_retype, "x"), (_reshape, "out"), (_retype, "out"), (_freeze, "out")]


@pytest.mark.parametrize("host", ["stage", "register"])
@pytest.mark.parametrize("change,which", CHANGES, ids=[f"{c.__name__[1:]} {w}" for c, w in CHANGES])
def test_a_job_refuses_arrays_changed_after_it_was_made(host, change, which):
    """Only the contents of x and out may change between calls: an array reshaped, retyped or
    made read-only is refused before any device work, naming it, and the job stays usable."""
    dev = rf.device("sim")
    x, out = np.arange(1000, dtype=np.float32), np.zeros(1000, np.float32)
    with rf.MapJob(f, x, out, device=dev, chunk_bytes=1024, host=host) as job:
        np.testing.assert_array_equal(job(), x * 2 + 1)
        arrays = {"x": x, "out": out}
        saved = arrays[which].copy()
        change(arrays[which])
        with pytest.raises(ValueError, match=rf"^{which} .*MapJob"):
            job()
        assert not job.closed
        arrays[which].shape, arrays[which].dtype = saved.shape, saved.dtype
        arrays[which].flags.writeable = True
        x[:] = 7
        np.testing.assert_array_equal(job(), np.full(1000, 15, np.float32))
    assert dev.live().total == 0


@pytest.mark.parametrize("host", ["stage", "register"])
@pytest.mark.parametrize("which", ["x", "x's base", "out"])
def test_an_array_a_job_holds_cannot_be_resized(host, which):
    """resize is the one way an array's memory moves under the same object; a registered job
    would go on reading or writing the freed memory. numpy refuses to resize an array a weak
    reference points to, refcheck=False or not, and the job holds one to each array and to the
    array that owns its memory: the resize fails and the job goes on with the same memory."""
    dev = rf.device("sim")
    base = np.arange(2000, dtype=np.float32)
    x, out = base[:1000], np.zeros(1000, np.float32)
    with rf.MapJob(f, x, out, device=dev, chunk_bytes=1024, host=host) as job:
        target = {"x": x, "x's base": base, "out": out}[which]
        with pytest.raises(ValueError, match="resize"):
            target.resize(target.size * 4, refcheck=False)
        np.testing.assert_array_equal(job(), np.arange(1000, dtype=np.float32) * 2 + 1)
    assert dev.live().total == 0
    if which != "x":  # a view never owns its memory; the others may be resized once the job is closed
        target.resize(target.size * 4, refcheck=False)


def test_a_job_without_a_device_runs_on_the_device_of_its_host_arrays(recwarn):
    """As stream_map: arrays from rf.host name their device, and are used in place. The job
    made a new default device instead, and staged the pinned arrays through rings."""
    dev = rf.device("sim")
    x = rf.host.empty(1 << 16, np.float32, device=dev)
    x[:] = 1
    out = rf.host.empty_like(x)

    def f(a, b):
        b[...] = a * 2

    with rf.MapJob(f, x, out) as job:
        job()
        assert job.device is dev and job.strategy == "pinned" and job.engine == "direct"
    assert (out == 2).all()
    assert not [w for w in recwarn if "simulated GPU" in str(w.message)]
    only_out = rf.host.empty_like(x)
    with rf.MapJob(f, np.ones(1 << 16, np.float32), only_out) as job:  # out alone names it too
        job()
        assert job.device is dev



def test_a_job_dropped_where_warnings_are_errors_is_still_released():
    """The finaliser of a job dropped without close() warns (ResourceWarning), then releases.
    Where warnings are errors (``-W error``) the warning raised and the release never ran: the
    job's streams, rings and registrations stayed for the life of the process."""
    import warnings

    dev = rf.device("sim", seed=3)
    for host in ("stage", "register"):
        job = rf.MapJob(f, contents((4000,), 3), device=dev, chunk_bytes=800, host=host)
        job()
        with warnings.catch_warnings():
            warnings.simplefilter("error", ResourceWarning)
            del job
            gc.collect()
    assert dev.live().total == 0, dev.live()


# -- Ctrl-C pressed twice while a job closes ------------------------------------------------------------------------
_CLOSING = ["close", "_release", "release"]  # MapJob's, the shards' job's and the direct engine's close
_CLOSING_FILES = ["/ringflow/_pipeline/job.py", "/ringflow/_pipeline/sharded.py", "/ringflow/_pipeline/direct.py"]


def _job_over(devs, x):
    job = rf.MapJob(f, x, device=devs if len(devs) > 1 else devs[0], chunk_bytes=800, host="register")
    np.testing.assert_array_equal(job(), x * 2 + 1)
    return job


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals reach the main thread")
@pytest.mark.parametrize("devices", [1, 3])
def test_a_second_ctrl_c_while_a_job_closes_still_releases_every_registration(devices):
    """Ctrl-C once close() has started releasing (deferred: raised once all is released), then
    again at every later instruction of the close where CPython raises it (raised at once, as the
    way out of a close that does not end). The second stopped the release half way: the
    registrations of x and out of the job it landed in stayed pinned, their finaliser detached
    already, and over several devices the shards' jobs after it stayed open. Every registration
    is released now, everything else too unless the second Ctrl-C stopped an engine's own close
    (given up: the way out), and the KeyboardInterrupt still reaches the caller."""
    x = contents((3000,), 12)
    with named_sims(*range(devices), seed=12, chaos=True) as devs:  # where each instruction of close() is
        job = _job_over(devs, x)
        with InterruptAt(10**9, _CLOSING + ["_take_turn"], files=_CLOSING_FILES) as at:
            job.close()
    first = at.functions.index("_take_turn")  # inside the close's shield, before anything is released
    second, fired = first + 1, 0
    while True:
        with named_sims(*range(devices), seed=12, chaos=True) as devs:
            job = _job_over(devs, x)
            parts = job._held.engine.parts if devices > 1 else [job]
            assert all(len(part._held.registered) == 2 for part in parts)
            with InterruptAt([first, second], _CLOSING + ["_take_turn"], files=_CLOSING_FILES, sigint=True) as at:
                try:
                    job.close()
                except KeyboardInterrupt:
                    pass
                else:
                    raise AssertionError("close() swallowed the Ctrl-C")
            assert job.closed and all(part.closed for part in parts), (second, [part.closed for part in parts])
            assert [dev.live().host_buffers for dev in devs] == [0] * devices, (second, [d.live() for d in devs])
            in_engine = "direct.py" in at.where_fired[-1]
            assert in_engine or [dev.live().total for dev in devs] == [0] * devices, (second, [d.live() for d in devs])
            job.close()  # (harmless again)
        if at.fired < 2:
            break
        fired += 1
        second += 1
    assert fired > 10  # the sweep reached the close's steps


@pytest.mark.parametrize("which", ["x", "out"])
def test_a_jobs_arrays_cannot_be_replaced(which):
    """job.x and job.out are the arrays the job was made with: assigning another array would be
    ignored by the calls (x) or returned without the results (out), so it is refused, saying to
    write into the array instead; the job goes on with its own arrays."""
    dev = rf.device("sim")
    x, out = np.arange(10, dtype=np.float32), np.zeros(10, np.float32)
    with rf.MapJob(f, x, out, device=dev) as job:
        advice = {"x": r"job\.x\[\.\.\.\] = new_x", "out": r"np\.copyto\(dest, job\(\)\)"}[which]
        with pytest.raises(AttributeError, match=rf"MapJob's {which} .*cannot be replaced.*{advice}.*new MapJob"):
            setattr(job, which, np.ones(10, np.float32))
        assert job.x is x and job.out is out
        np.testing.assert_array_equal(job(), x * 2 + 1)
    assert dev.live().total == 0


@pytest.mark.parametrize("how", ["pickle", "copy", "deepcopy"])
def test_a_job_cannot_be_pickled_or_copied_and_says_what_to_do(how):
    """A job holds its device's streams, rings and registrations over its arrays, in this
    process. Pickling one failed on its compute, in words that named a ringflow module ("attribute
    lookup f on ringflow._pipeline.reentry failed"), or on a lock; ``copy.copy`` made a second
    job sharing the first's engine, so that closing (or collecting) either closed the other under
    it. Each is refused naming the job and what to make instead; the job goes on."""
    import copy
    import pickle

    dev = rf.device("sim")
    x = np.arange(10, dtype=np.float32)
    with rf.MapJob(f, x, device=dev) as job:
        act = {"pickle": lambda: pickle.dumps(job), "copy": lambda: copy.copy(job),
               "deepcopy": lambda: copy.deepcopy(job)}[how]
        with pytest.raises(TypeError, match=r"a MapJob cannot be (pickled|copied).*make a MapJob"):
            act()
        np.testing.assert_array_equal(job(), x * 2 + 1)
    assert dev.live().total == 0


def test_a_call_given_an_array_says_how_a_job_takes_new_contents():
    """job() runs over the x the job was made with; job(new_x), the usual first try, is refused
    with a message that says to write the contents into job.x (or call stream_map)."""
    dev = rf.device("sim")
    x = np.arange(10, dtype=np.float32)
    with rf.MapJob(f, x, device=dev) as job:
        with pytest.raises(TypeError, match=r"takes no arrays.*job\.x\[\.\.\.\] = .*stream_map"):
            job(np.ones(10, np.float32))
        np.testing.assert_array_equal(job(), x * 2 + 1)
    assert dev.live().total == 0


def test_a_failed_chunk_of_a_compute_bound_job_carries_the_rows_it_held():
    """A MapJob's StageError carries the rows of ``x`` its failed chunk held, as stream_map's
    does, from the engine that cut the chunks (a compute-bound job's are tapered, so not its
    index times a chunk's rows)."""
    def f(x, y):
        if (x == 1_500_000).any():
            raise ValueError("refused")
        y[...] = x

    f.sim_seconds = lambda nbytes: nbytes * 1e-8  # compute-bound: tapered chunks
    x = np.arange(4_000_000, dtype=np.float32)
    with rf.MapJob(f, x, device=rf.device("sim"), chunk_bytes=4 << 20, host="register") as job:
        with pytest.raises(rf.StageError) as info:
            job()
    a, b = info.value.rows
    assert a <= 1_500_000 < b and b - a <= 1 << 20, (a, b)  # (a whole chunk: 1 Mi rows)


def test_a_ctrl_c_during_a_graph_replay_is_raised_as_the_call_returns_with_the_job_open_and_out_complete():
    """A graph's replay runs to its end, as a GPU's graph launch does: a Ctrl-C (a real SIGINT)
    at any instruction of it is raised as the call returns, the job left open (``closed`` False)
    and ``out`` complete, and the next call runs as usual (docs/guide/mapjob.md)."""
    dev = rf.device("sim")
    x = rf.host.empty(1 << 16, np.float32, device=dev)
    out = rf.host.empty_like(x)

    def f(a, b):
        np.multiply(a, 2, out=b)
        b += 1

    with rf.MapJob(f, x, out, host="register", graph=True, chunk_bytes=1 << 14) as job:
        x[:] = 0
        job()
        job()
        assert job.replays_graph
        interrupted = 0
        for n in range(0, 400, 13):
            x[:] = n
            try:
                with InterruptAt(n, names=["launch"], files=["sim/graph.py"], sigint=True):
                    job()
            except KeyboardInterrupt:
                interrupted += 1
                assert not job.closed, f"a Ctrl-C at instruction {n} of the replay closed the job"
                np.testing.assert_array_equal(out, 2 * n + 1)
        assert interrupted > 5, "the replay was interrupted"
        x[:] = 5
        np.testing.assert_array_equal(job(), 11)
    dev.close()


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("side", ["x", "out"])
def test_a_job_over_a_pool_array_of_another_device_that_closed_since_is_refused_by_name(side, devices):
    """A pool array's memory goes with its device (a GPU frees every pinned allocation of its
    context). A job made on another device over such an array went on reading (or writing) it
    after that device closed, as if its memory were still there; each call now refuses, naming
    the array, and runs nothing."""
    old = rf.device("sim")
    devs = [rf.device("sim") for _ in range(devices)]
    n = 1024
    x, out = np.arange(n, dtype=np.float32), np.zeros(n, np.float32)
    pooled = rf.host.empty(n, np.float32, device=old)
    if side == "x":
        pooled[...] = x
        x = pooled
    else:
        out = pooled
    ran = []

    def counting(a, b):
        ran.append(len(a))
        b[...] = a * 2 + 1

    job = rf.MapJob(counting, x, out, device=devs[0] if devices == 1 else devs, chunk_bytes=1024)
    try:
        assert np.array_equal(job(), np.arange(n, dtype=np.float32) * 2 + 1)
        ran.clear()
        old.close()
        with pytest.raises(RuntimeError, match=rf"{side} is memory from ringflow.host of <SimDevice[^>]*>, which "
                                               rf"is closed.*went with it"):
            job()
        assert ran == []
    finally:
        job.close()
    assert all(d.live().total == 0 for d in devs)
