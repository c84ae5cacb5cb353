"""Whole-array jobs over several devices (``device=`` a list): the rows split into one shard per
simulated GPU, every shard run at once on its own device, errors named for the whole array, every
shard settled before a call returns or raises, and the predicted time that of the slowest shard."""

import concurrent.futures
import contextlib
import dataclasses
import doctest
import gc
import json
import os
import pickle
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import warnings

import numpy as np
import pytest

import ringflow as rf
from ringflow import _device
from ringflow import _plan as plan
from ringflow._device.hardware import get_profile
from ringflow._device.sim import host as sim_host
from ringflow._errors import DeviceError, StageError
from ringflow._pipeline import sharded, sizing
from tests.helpers.hooks import engines
from tests.helpers.host_strategy import layouts_planned, slow_staged_chunks
from tests.helpers.interrupts import InterruptAt
from tests.helpers.sim import named_sims
from tests.helpers.threads import bounded, run_all

MiB = 1 << 20


def f(x, y):
    y[:] = x * 2 + 1


def contents(shape, seed):
    return np.random.default_rng(seed).uniform(0.5, 1.5, shape).astype(np.float32)


def sims(n, seed=0, **kw):
    return [rf.device("sim", seed=seed * 10 + i, chaos=True, **kw) for i in range(n)]


def assert_nothing_live(devs):
    rf.drop_warm_pipelines()
    gc.collect()
    for dev in devs:
        assert dev.live().total == 0, (dev, dev.live())


def test_the_module_example_runs():
    assert doctest.testmod(sharded).failed == 0


# -- results ---------------------------------------------------------------------------------------------------------
SHAPES = [(1001,), (777, 5), (4097, 3), (3,), (2, 7), (1, 4)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("host", ["stage", "register"])
@pytest.mark.parametrize("seed", range(3))
def test_one_two_and_four_devices_give_bit_identical_results_under_chaos(shape, host, seed):
    x = contents(shape, seed)
    row = x.nbytes // shape[0]
    results = []
    used = []
    for n in (1, 2, 4):
        devs = sims(n, seed, checked=True)
        used += devs
        y = rf.stream_map(f, x, device=devs, chunk_bytes=row * 37, host=host, checked=True)
        results.append(y)
    for y in results:
        assert y.tobytes() == (x * 2 + 1).tobytes()
    assert_nothing_live(used)


@pytest.mark.parametrize("host", ["stage", "register"])
@pytest.mark.parametrize("seed", range(2))
def test_devices_of_one_host_give_bit_identical_results_under_chaos(host, seed):
    # the "sim:N" devices share one host: its copy rate changes their timing, never their results
    x = contents((4097, 3), seed)
    row = x.nbytes // x.shape[0]
    for n in (1, 2, 4):
        with named_sims(*range(40, 40 + n), seed=seed, chaos=True, checked=True) as devs:
            y = rf.stream_map(f, x, device=[f"sim:{40 + i}" for i in range(n)], chunk_bytes=row * 37, host=host,
                              checked=True)
            assert y.tobytes() == (x * 2 + 1).tobytes()
            assert_nothing_live(devs)


@pytest.mark.parametrize("engine", ["auto", "pipeline"])
@pytest.mark.parametrize("seed", range(3))
def test_in_place_over_two_devices_under_chaos(engine, seed):
    x = contents((5000, 2), seed)
    expected = x * 2 + 1
    devs = sims(2, seed)
    assert rf.stream_map(f, x, x, device=devs, chunk_bytes=8 * 100, inplace=True, engine=engine,
                         host="register") is x
    np.testing.assert_array_equal(x, expected)
    assert_nothing_live(devs)


def test_strided_arrays_are_staged_on_every_device():
    base = contents((400, 6), 1)
    x = base[:, ::2]  # not contiguous: each shard x[a:b] neither
    devs = sims(3)
    with engines() as seen:
        y = rf.stream_map(f, x, device=devs, chunk_bytes=12 * 10)
    np.testing.assert_array_equal(y, x * 2 + 1)
    assert len(seen) == 3 and all(hasattr(e, "submit") for e in seen)  # three scheduled pipelines
    with pytest.raises(ValueError, match="C-contiguous"):
        rf.stream_map(f, x, device=devs, host="register")
    with pytest.raises(ValueError, match="engine='direct' cannot run this job") as info:
        rf.stream_map(f, x, device=devs, engine="direct")
    assert not getattr(info.value, "__notes__", None)  # refused once, before any shard ran


def test_empty_x_returns_at_once_over_a_list():
    for x in (np.empty(0, np.float32), np.empty((0, 4), np.float32), np.empty((5, 0), np.float32)):
        y = rf.stream_map(f, x, device=sims(2))
        assert y.shape == x.shape
        out, report = rf.stream_map_report(f, x, device=sims(2))
        assert report is None and out.shape == x.shape


def test_fewer_rows_than_devices_uses_one_device_a_row():
    x = contents((3, 4), 2)
    devs = sims(4)
    with engines() as seen:
        y, report = rf.stream_map_report(f, x, device=devs)
    np.testing.assert_array_equal(y, x * 2 + 1)
    assert len(seen) == 3 and report.rows == ((0, 1), (1, 2), (2, 3))
    assert report.devices == tuple(f"device[{i}] {devs[i]!r}" for i in range(3))
    assert devs[3].live().total == 0 and devs[3].now == 0.0  # the fourth device was never touched


def test_a_sharded_trace_path_that_is_not_a_file_name_is_refused(capfd):
    """save_trace(1) took 1 as a file descriptor: it wrote the trace over stdout and closed it."""
    _, report = rf.stream_map_report(f, contents((8, 4), 1), device=sims(2))
    with pytest.raises(TypeError, match="path must be a file name"):
        report.save_trace(1)
    assert capfd.readouterr().out == ""


def test_a_sharded_trace_onto_a_pipe_is_refused_at_once(tmp_path):
    """It opened the pipe to write and waited for a reader for ever."""
    path = str(tmp_path / "t.pipe")
    os.mkfifo(path)
    _, report = rf.stream_map_report(f, contents((8, 4), 1), device=sims(2))
    failed = []

    def save():
        try:
            report.save_trace(path)
        except OSError as exc:
            failed.append(exc)

    saver = threading.Thread(target=save, daemon=True)
    saver.start()
    saver.join(10)
    if saver.is_alive():  # let the blocked open go on, then fail
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
    assert not saver.is_alive() and failed and "not a regular file" in str(failed[0]), failed
    assert failed[0].filename == path and stat.S_ISFIFO(os.stat(path).st_mode)


def test_each_device_runs_its_own_rows_on_its_own_engine():
    x = contents((1000, 4), 3)
    devs = sims(2)
    with engines() as seen:
        y, report = rf.stream_map_report(f, x, device=devs, chunk_bytes=16 * 100, host="register")
    np.testing.assert_array_equal(y, x * 2 + 1)
    assert len(seen) == 2 and seen[0] is not seen[1]
    assert report.rows == ((0, 500), (500, 1000))
    assert [r.chunks for r in report.reports] == [5, 5] and report.chunks == 10
    assert all(d.now > 0 for d in devs)


def test_one_device_in_a_list_is_exactly_that_device():
    dev = rf.device("sim", seed=5, chaos=True)
    x = contents((3000, 2), 5)
    with engines() as seen:
        rf.stream_map(f, x, device=dev, chunk_bytes=8 * 100, host="register")
        y = rf.stream_map(f, x, device=[dev], chunk_bytes=8 * 100, host="register")
        z = rf.stream_map(f, x, device=(dev,), chunk_bytes=8 * 100, host="register")
    np.testing.assert_array_equal(y, x * 2 + 1)
    np.testing.assert_array_equal(z, y)
    assert seen[0] is seen[1] is seen[2]  # the same warm engine: the single-device path, no shard thread
    _, report = rf.stream_map_report(f, x, device=[dev], chunk_bytes=8 * 100)
    assert isinstance(report, rf.Report)
    with rf.MapJob(f, x, device=[dev], chunk_bytes=8 * 100) as job:
        assert job.device is dev and job.chunks == 30


# -- named simulated GPUs -------------------------------------------------------------------------------------------
def test_sim_n_names_one_device_per_process():
    a, b = rf.device("sim:7"), rf.device("sim:8")
    assert a is rf.device("sim:7") and a is not b
    assert _device.device_label(a) == "sim:7"
    x = contents((600,), 1)
    with engines() as seen:
        rf.stream_map(f, x, device=["sim:7", "sim:8"], chunk_bytes=400)
        rf.stream_map(f, x, device=["sim:7", "sim:8"], chunk_bytes=400)
    assert {id(e) for e in seen[:2]} == {id(e) for e in seen[2:]}  # each device's engine kept warm
    with pytest.raises(ValueError, match="sim:7.*exists already"):
        rf.device("sim:7", seed=3)
    c = rf.device("sim:9", seed=3, chaos=True)
    assert rf.device("sim:9", seed=3, chaos=True) is c and c.seed == 3
    c.close()
    assert rf.device("sim:9") is not c  # a closed one is replaced
    rf.drop_warm_pipelines()


# -- errors ----------------------------------------------------------------------------------------------------------
class Boom(Exception):
    pass


def failing_at(row_value):
    def compute(x, y):
        if (x == row_value).any():
            raise Boom(f"row {row_value}")
        y[:] = x * 2 + 1

    return compute


@pytest.mark.parametrize("host", ["stage", "register"])
@pytest.mark.parametrize("seed", range(3))
def test_a_stage_error_names_the_global_chunk_the_rows_and_the_device(host, seed):
    x = np.arange(2000, dtype=np.float32)  # 2 shards of 10 chunks of 100 rows
    out = np.zeros_like(x)
    devs = sims(2, seed)
    with pytest.raises(StageError) as info:
        rf.stream_map(failing_at(1234.0), x, out, device=devs, chunk_bytes=400, host=host)
    err = info.value
    assert err.stage == "compute" and err.index == 12 and err.rows == (1200, 1300) and err.device is devs[1]
    assert "chunk 12" in str(err) and "x[1200:1300]" in str(err) and "device[1]" in str(err)
    assert isinstance(err.__cause__, Boom)
    np.testing.assert_array_equal(out[:1000], x[:1000] * 2 + 1)  # the other shard finished
    del info, err  # its traceback holds the call's frames, and so their events
    assert_nothing_live(devs)


def test_on_error_continue_finishes_every_other_chunk_then_raises_the_first():
    x = np.arange(2000, dtype=np.float32)
    out = np.zeros_like(x)
    devs = sims(2, 1)
    with pytest.raises(StageError) as info:
        rf.stream_map(failing_at(1234.0), x, out, device=devs, chunk_bytes=400, on_error="continue")
    assert info.value.index == 12
    good = np.ones(2000, bool)
    good[1200:1300] = False
    np.testing.assert_array_equal(out[good], x[good] * 2 + 1)
    del info
    assert_nothing_live(devs)


def test_on_error_continue_on_one_device_raises_the_first_failure_too():
    x = np.arange(2000, dtype=np.float32)
    out = np.zeros_like(x)
    with pytest.raises(StageError) as info:
        rf.stream_map(failing_at(1234.0), x, out, device=rf.device("sim"), chunk_bytes=400, on_error="continue")
    assert info.value.index == 12
    np.testing.assert_array_equal(out[1300:], x[1300:] * 2 + 1)


def test_four_devices_keep_their_engines_warm_between_calls():
    devs = sims(4, 2)
    x = contents((4000,), 2)
    with engines() as seen:
        for _ in range(3):
            np.testing.assert_array_equal(rf.stream_map(f, x, device=devs, chunk_bytes=400), x * 2 + 1)
    assert len(seen) == 12 and len({id(e) for e in seen}) == 4  # one engine per device, taken back warm
    assert_nothing_live(devs)


def test_when_both_shards_fail_the_first_in_row_order_is_raised_and_the_other_noted():
    def compute(x, y):
        if (x == 150.0).any() or (x == 1850.0).any():
            raise Boom("here")
        y[:] = x * 2 + 1

    x = np.arange(2000, dtype=np.float32)
    with pytest.raises(StageError) as info:
        rf.stream_map(compute, x, device=sims(2), chunk_bytes=400)
    assert info.value.index == 1
    assert any("1 other shard(s) failed" in n and "chunk 8" in n for n in info.value.__notes__)


@pytest.mark.parametrize("when", ["before", "during"])
@pytest.mark.parametrize("host", ["stage", "register"])
def test_a_sticky_error_on_one_of_two_devices_fails_its_shard_only(when, host):
    devs = sims(2, 4)
    x = np.arange(4000, dtype=np.float32)
    out = np.zeros_like(x)

    def compute(x_, y):
        if when == "during" and (x_ == 3000.0).any():
            devs[1].inject_sticky_error()
        y[:] = x_ * 2 + 1

    if when == "before":
        devs[1].inject_sticky_error()
    with pytest.raises((DeviceError, StageError)) as info:
        rf.stream_map(compute, x, out, device=devs, chunk_bytes=800, host=host)
    err = info.value
    text = str(err) + "".join(getattr(err, "__notes__", []))
    assert "device[1]" in text and "sticky" in text.lower()
    if isinstance(err, DeviceError):
        assert err.sticky and err.device is devs[1]
    np.testing.assert_array_equal(out[:2000], x[:2000] * 2 + 1)  # the healthy device's rows are right
    del info, err
    assert_nothing_live(devs[:1])
    # the healthy device still works; the broken one refuses every later call
    np.testing.assert_array_equal(rf.stream_map(f, x, device=devs[0]), x * 2 + 1)
    with pytest.raises(DeviceError):
        rf.stream_map(f, x, device=devs[1])


def test_a_compute_raising_keyboard_interrupt_on_one_shard_settles_every_shard():
    devs = sims(2, 6)
    x = np.arange(4000, dtype=np.float32)
    out = np.zeros_like(x)
    done = []

    def compute(x_, y):
        if (x_ == 2500.0).any():
            raise KeyboardInterrupt
        y[:] = x_ * 2 + 1
        done.append(float(x_[0]))

    # staged: the scheduler delivers a compute's KeyboardInterrupt as itself
    with pytest.raises(KeyboardInterrupt):
        rf.stream_map(compute, x, out, device=devs, chunk_bytes=800, host="stage")
    np.testing.assert_array_equal(out[:2000], x[:2000] * 2 + 1)  # shard 0 ran to its end
    assert sorted(v for v in done if v < 2000) == [0.0, 200.0, 400.0, 600.0, 800.0, 1000.0, 1200.0, 1400.0,
                                                    1600.0, 1800.0]
    assert_nothing_live(devs)


def test_an_interrupt_while_the_caller_waits_settles_every_shard_first(monkeypatch):
    devs = sims(2, 7)
    x = contents((200_000,), 7)
    out = np.zeros_like(x)
    real_wait = sharded._wait

    def interrupted(futures):
        raise KeyboardInterrupt  # Ctrl-C lands as soon as the caller starts waiting

    monkeypatch.setattr(sharded, "_wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        rf.stream_map(f, x, out, device=devs, chunk_bytes=4096, host="register")
    # nothing still runs: every shard had finished when the interrupt reached the caller
    np.testing.assert_array_equal(out, x * 2 + 1)
    monkeypatch.setattr(sharded, "_wait", real_wait)
    assert_nothing_live(devs)


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals reach the main thread")
def test_a_real_sigint_while_the_caller_waits_settles_every_shard_first():
    devs = sims(2, 8)
    x = contents((100_000,), 8)
    out = np.zeros_like(x)
    main = threading.main_thread().ident
    sent = []

    def compute(x_, y):
        if threading.get_ident() != main and not sent:
            sent.append(True)
            signal.pthread_kill(main, signal.SIGINT)  # Ctrl-C, delivered to the waiting caller
        y[:] = x_ * 2 + 1

    with pytest.raises(KeyboardInterrupt):
        rf.stream_map(compute, x, out, device=devs, chunk_bytes=4096, host="register")
    assert sent
    np.testing.assert_array_equal(out, x * 2 + 1)
    assert_nothing_live(devs)


# -- MapJob ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("host", ["stage", "register"])
@pytest.mark.parametrize("seed", range(3))
def test_a_job_over_two_devices_called_again_and_again(host, seed):
    devs = sims(2, seed)
    shape = (777, 5)
    x = np.empty(shape, np.float32)
    with rf.MapJob(f, x, device=devs, chunk_bytes=5 * 4 * 61, host=host, checked=True) as job:
        assert job.device == tuple(devs) and job.strategy == host and job.chunks == 14  # 7 + 7 chunks
        assert job.engine == ("direct" if host == "register" else "pipeline")
        for call in range(4):
            x[...] = contents(shape, 10 * seed + call)
            y = job(profile=call == 3)
            assert y is job.out
            np.testing.assert_array_equal(y, x * 2 + 1)
        report = job.report()
        assert report.rows == ((0, 389), (389, 777)) and len(report.reports) == 2
    assert job.closed and "closed" in repr(job)
    assert_nothing_live(devs)


def test_a_failed_call_closes_a_job_over_two_devices():
    devs = sims(2, 2)
    x = np.arange(2000, dtype=np.float32)
    job = rf.MapJob(failing_at(-1.0), x, device=devs, chunk_bytes=400, host="register")
    job()
    x[1500] = -1.0
    with pytest.raises(StageError) as info:
        job()
    assert info.value.index == 15 and job.closed
    with pytest.raises(RuntimeError, match="closed"):
        job()
    del info
    assert_nothing_live(devs)


def test_a_job_whose_set_up_fails_on_one_device_releases_the_others():
    devs = sims(2, 3)
    devs[1].inject_sticky_error()
    with pytest.raises(DeviceError, match="device\\[1\\]") as info:
        rf.MapJob(f, np.ones(4000, np.float32), device=devs, chunk_bytes=800, host="register")
    del info
    assert_nothing_live(devs[:1])



def test_a_job_too_large_for_one_devices_memory_names_chunk_bytes_and_releases_the_others():
    from tests.helpers import small_memory_device

    devs = [rf.device("sim"), small_memory_device(2000)]  # the second has room for 2 chunks of 800 bytes
    with pytest.raises(MemoryError, match=r"device-\w+ ring: \d+ slots of chunk_bytes=800 bytes") as info:
        rf.MapJob(f, np.ones(4000, np.float32), device=devs, chunk_bytes=800, host="register")
    # named for its shard, and still the out-of-memory error it was
    assert "device[1]" in str(info.value) and isinstance(info.value, rf.OutOfMemoryError)
    del info
    assert_nothing_live(devs)


def test_an_out_of_memory_named_for_its_shard_is_still_a_memory_error():
    """A shard's device error is raised again naming the shard; an out-of-memory keeps its kind
    (a MemoryError, never sticky) rather than becoming a plain DeviceError."""
    from ringflow._errors import OutOfMemoryError

    dev = rf.device("sim")
    shard = sharded.Shard(position=1, device=dev, label="device[1]", start=2000, stop=4000, rows=200,
                          chunk_bytes=800)
    err = sharded.named_error(shard, OutOfMemoryError("allocating 800 bytes of device memory failed"))
    assert isinstance(err, OutOfMemoryError) and isinstance(err, MemoryError) and not err.sticky
    assert "device[1]" in str(err) and err.device is dev

# -- prediction ------------------------------------------------------------------------------------------------------
def seed_like():
    """The seed workload's shape: 256 MiB of float32 in place, a 64-iteration kernel's time."""
    def affine(x, y):
        np.multiply(x, np.float32(0.999), out=y)
        y += np.float32(0.001)

    affine.sim_seconds = lambda nbytes: 2 * nbytes / 4.3e12 + 64 * nbytes * 2.7e-14
    return affine, np.ones(256 * MiB // 4, np.float32)


def call_seconds(job, devs):
    job()  # warm
    start = [d.now for d in devs]
    job()
    return max(d.now - s for d, s in zip(devs, start))


@pytest.mark.parametrize("host_of", ["its own", "one shared"])
def test_two_simulated_gpus_predict_at_least_1_9x_one_on_the_seed_workload(host_of):
    # registered in place: nothing is copied on the host, so sharing one host costs nothing
    g, x = seed_like()
    with contextlib.ExitStack() as stack:
        if host_of == "its own":
            one = [rf.device("sim", checked=False)]
            two = [rf.device("sim", checked=False) for _ in range(2)]
        else:
            one = stack.enter_context(named_sims(40, checked=False))
            two = stack.enter_context(named_sims(41, 42, checked=False))
            assert one[0].host is two[0].host is two[1].host
        with rf.MapJob(g, x, x, device=one, inplace=True, host="register") as job:
            t1 = call_seconds(job, one)
        with rf.MapJob(g, x, x, device=two, inplace=True, host="register") as job:
            t2 = call_seconds(job, two)
            start = [d.now for d in two]
            job(profile=True)
            profiled = [d.now - s for d, s in zip(two, start)]
            report = job.report()
    assert t1 / t2 >= 1.9
    assert report.simulated and report.predicted_s == report.wall_s == max(profiled)
    assert report.elapsed_s == pytest.approx(profiled)
    predicted = plan.predict_devices("h200-pcie5", x.nbytes, x.nbytes // report.chunks, 2,
                                     compute_s_per_byte=g.sim_seconds(1 << 20) / (1 << 20), host_stages=False)
    assert predicted.speedup >= 1.9 and predicted.host_floor_s == 0


def test_an_unstaged_scheduled_job_over_two_gpus_takes_each_shards_scheduler_time_the_plan_charges():
    """8 MiB registered in place over two simulated GPUs, in 64 KiB chunks, on a profile whose
    scheduler takes 1 ms a chunk: engine="pipeline" runs each shard on the scheduler unstaged, and
    each shard's chunks cost it that time, as predict_devices charges them (within 10%); on the
    direct engine the figure is no cost."""
    slow = dataclasses.replace(get_profile("h200-pcie5"), name="slow-scheduler", scheduled_chunk_host_s=1e-3)

    def double(a, b):
        np.multiply(a, 2, out=b)

    double.sim_seconds = 0.0
    x = np.arange(2 * MiB, dtype=np.float32)
    chunk = 64 << 10
    wall = {}
    for engine in ("pipeline", "direct"):
        with named_sims(43, 44, profile=slow):
            y, report = rf.stream_map_report(double, x, device=["sim:43", "sim:44"], chunk_bytes=chunk,
                                             host="register", engine=engine, keep_warm=False)
            assert np.array_equal(y, x * 2) and [r.chunks for r in report.reports] == [64, 64]
            wall[engine] = [r.measured_s for r in report.reports]
    predicted = plan.predict_devices(slow, x.nbytes, chunk, 2, host_stages=False, scheduler=True).predicted_s
    assert min(wall["pipeline"]) >= 64 * 1e-3
    assert max(wall["pipeline"]) == pytest.approx(predicted, rel=0.10)
    assert max(wall["direct"]) < 64 * 1e-3 / 4


def test_shards_declare_their_host_copies_while_they_run():
    seen = []
    with named_sims(40, 41, checked=False) as devs:
        shards = [sharded.Shard(i, d, f"sim:{40 + i}", 0, 1, 1, 4, copy_threads=3 + i) for i, d in enumerate(devs)]
        sharded.run_shards(shards, lambda shard: seen.append(shard.device.host.threads_besides(shard.device)))
        assert sorted(seen) == [3, 4]  # each shard sees the other's threads
        assert devs[0].host.threads_besides(devs[0]) == 0  # and none once the call is over
        x = np.ones((64, 256), np.float32)
        for host, threads in (("stage", 4), ("register", 0)):
            assert [s.copy_threads for s in sharded.plan_shards(f, x, x, False, devs, 4096, host, "auto", {})] == \
                [threads, threads]


def test_a_sharded_report_is_the_slowest_shard_and_one_trace_with_a_process_per_device(tmp_path):
    devs = [rf.device("sim"), rf.device("sim", profile="h200-pcie5")]
    x = contents((3000, 4), 1)
    y, report = rf.stream_map_report(f, x, device=devs, chunk_bytes=16 * 150, host="register")
    np.testing.assert_array_equal(y, x * 2 + 1)
    assert isinstance(report, sharded.ShardedReport)
    assert report.wall_s == max(report.elapsed_s) and all(e > 0 for e in report.elapsed_s)
    assert report.bytes_in == x.nbytes and report.chunks == 20
    assert len(report.reports) == 2 and all(r.measured_s <= e for r, e in zip(report.reports, report.elapsed_s, strict=True))
    assert report.as_dict()["wall_s"] == report.wall_s and "2 devices" in report.headline()
    path = report.save_trace(str(tmp_path / "trace.json"))
    events = json.load(open(path))["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names == {1: f"ringflow on device[0] {devs[0]!r}", 2: f"ringflow on device[1] {devs[1]!r}"}
    spans = [e for e in events if e.get("ph") == "X"]
    assert {e["pid"] for e in spans} == {1, 2}
    for pid in (1, 2):
        end = max(e["ts"] + e["dur"] for e in spans if e["pid"] == pid)
        assert end <= report.elapsed_s[pid - 1] * 1e6 + 1e-6  # within the shard's own time from the call's start


# -- hostile device= values ------------------------------------------------------------------------------------------
@pytest.fixture
def fake_gpus(monkeypatch):
    import ringflow._device.cuda as cuda_pkg

    class FakeCuda:
        backend = "cuda"

        def __init__(self, index=0, **options):
            self.index = index

    monkeypatch.setattr(_device, "cuda_available", lambda: (True, "2 fake GPUs"))
    monkeypatch.setattr(_device, "_gpu_count", lambda: 2)
    monkeypatch.setattr(cuda_pkg, "CudaDevice", FakeCuda)
    return FakeCuda


HOSTILE = [
    ([], ValueError, "device is an empty list"),
    ((), ValueError, "device is an empty tuple"),
    ([3], TypeError, r"device\[0\] must be a device"),
    ([None], TypeError, r"device\[0\] must be a device"),
    (["sim:0", object()], TypeError, r"device\[1\] must be a device"),
    (["sim:0", "gpu"], ValueError, r"device\[1\]: unknown device 'gpu'"),
    (["auto", "sim:0"], ValueError, r"device\[0\] is 'auto'"),
    (["sim:0", "cuda:all"], ValueError, r"device\[1\] is 'cuda:all'"),
    (["sim:0", "sim:0"], ValueError, r"device\[0\] and device\[1\] are the same device \(sim:0\)"),
    ({"sim:0"}, TypeError, "device must be a device"),
    (3, TypeError, "device must be a device"),
]


@pytest.mark.parametrize("value, exc, message", HOSTILE)
@pytest.mark.parametrize("door", ["stream_map", "MapJob"])
def test_hostile_device_values_are_refused_naming_device(value, exc, message, door):
    x = np.ones(100, np.float32)
    with pytest.raises(exc, match=message):
        if door == "stream_map":
            rf.stream_map(f, x, device=value)
        else:
            rf.MapJob(f, x, device=value)


def test_the_same_device_object_twice_is_refused():
    dev = rf.device("sim")
    with pytest.raises(ValueError, match=r"device\[0\] and device\[2\] are the same device"):
        rf.stream_map(f, np.ones(8, np.float32), device=[dev, rf.device("sim"), dev])


@pytest.mark.parametrize("door", ["stream_map", "MapJob", "Pipeline"])
@pytest.mark.parametrize("closed_at", [0, 1])
def test_a_closed_device_in_a_list_is_refused_by_its_place_before_any_work(door, closed_at):
    """A device closed before the call, in a list: refused as ``device[i]``, naming it, before any
    work on the other devices (a shard on the open device used to run to its end, then the call
    raised the closed device's own words, which say neither which item nor that it was given
    closed)."""
    devs = [rf.device("sim"), rf.device("sim")]
    devs[closed_at].close()
    ran = []

    def counting(x, y):
        ran.append(len(x))
        y[...] = x * 2 + 1

    x = np.ones(1 << 12, np.float32)
    with pytest.raises(RuntimeError, match=rf"device\[{closed_at}\] \(<SimDevice[^)]*>\) is closed"):
        if door == "stream_map":
            rf.stream_map(counting, x, device=devs, chunk_bytes=1 << 10)
        elif door == "MapJob":
            rf.MapJob(counting, x, device=devs, chunk_bytes=1 << 10)
        else:
            rf.Pipeline(counting, device=devs)
    assert ran == []
    assert_nothing_live([devs[1 - closed_at]])


def test_cuda_all_without_a_gpu_names_device(monkeypatch):
    monkeypatch.setattr(_device, "cuda_available", lambda: (False, "no driver"))
    with pytest.raises(_device.DeviceUnavailableError, match="device='cuda:all' is not usable: no driver"):
        rf.stream_map(f, np.ones(8, np.float32), device="cuda:all")
    monkeypatch.setenv("RINGFLOW_DEVICE", "cuda:all")
    with pytest.raises(_device.DeviceUnavailableError, match="RINGFLOW_DEVICE"):
        rf.stream_map(f, np.ones(8, np.float32))
    with pytest.raises(ValueError, match="'cuda:all' names every GPU"):
        rf.device("cuda:all")


def test_cuda_all_and_a_mix_of_kinds(fake_gpus):
    assert [d.index for d in _device.devices("cuda:all")] == [0, 1]
    with pytest.raises(ValueError, match=r"device\[0\] and device\[1\] are the same device \(cuda:1\)"):
        _device.devices(["cuda:1", "cuda:1"])
    with pytest.raises(ValueError, match=r"device mixes a sim device \(device\[0\]\) with a cuda one \(device\[1\]\)"):
        rf.stream_map(f, np.ones(8, np.float32), device=["sim:0", "cuda:0"])


def test_one_devices_pinned_memory_is_refused_over_several():
    devs = sims(2)
    hb = devs[0].allocate_host(400)
    x = hb.view(np.float32)
    with pytest.raises(ValueError, match="x_buffer and out_buffer are one device's pinned memory"):
        rf.stream_map(f, x, x, device=devs, x_buffer=hb, out_buffer=hb)
    hb.close()


def test_arrays_from_the_host_pool_are_staged_over_several_devices():
    devs = sims(2)
    x = rf.host.empty((1000,), np.float32, device=devs[0])
    x[:] = contents(1000, 3)
    with engines() as seen:
        y = rf.stream_map(f, x, device=devs, chunk_bytes=400)
    np.testing.assert_array_equal(y, x * 2 + 1)
    assert all(hasattr(e, "submit") for e in seen)  # staged: scheduled pipelines
    with pytest.raises(ValueError, match="host='register' cannot pin arrays from ringflow.host"):
        rf.stream_map(f, x, device=devs, host="register")
    del x
    gc.collect()
    rf.host.release_cached(device=devs[0])


# -- Ctrl-C landing between the library's steps ---------------------------------------------------------------------
class _SigintsAfterFirstSubmit:
    """The shard threads' pool, sending the calling (main) thread ``presses`` real SIGINTs right
    after the first shard is handed to it: Ctrl-C landing between a shard's start and the next
    one's (pressed twice: the first is deferred, the second raised at once, as the submit
    returns)."""

    def __init__(self, pool, presses: int = 1):
        self.pool, self.presses, self.submitted = pool, presses, []

    def submit(self, *args):
        fut = self.pool.submit(*args)
        self.submitted.append(fut)
        if len(self.submitted) == 1:
            for _ in range(self.presses):
                signal.raise_signal(signal.SIGINT)
        return fut


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals reach the main thread")
@pytest.mark.parametrize("presses", [1, 2])
def test_a_ctrl_c_while_the_shards_are_started_still_settles_every_shard(monkeypatch, presses):
    """Every shard started has ended before a Ctrl-C reaches the caller (run_shards' rule), one
    press or two: a second is raised at once, but the shards are still settled first. Raised as
    the first shard's submit returned, before its future was kept, it left that shard unwaited
    for: the call raised while the shard still ran, writing ``out`` behind the caller's back."""
    devs = sims(2, 9)
    x = contents((20_000,), 9)
    out = np.zeros_like(x)
    waiting = threading.Event()

    def waits_for(real):
        def wait(futures):
            waiting.set()
            real(futures)
        return wait

    def compute(x_, y):
        # the first shard ends only once its caller waits for it (bounded: never a hang)
        waiting.wait(10)
        y[:] = x_ * 2 + 1

    pool = _SigintsAfterFirstSubmit(sharded._threads(), presses)
    monkeypatch.setattr(sharded, "_wait", waits_for(sharded._wait))
    monkeypatch.setattr(sharded, "_settle", waits_for(sharded._settle))
    monkeypatch.setattr(sharded, "_threads", lambda: pool)
    try:
        with pytest.raises(KeyboardInterrupt):
            rf.stream_map(compute, x, out, device=devs, chunk_bytes=4096, host="register")
        assert all(fut.done() for fut in pool.submitted)
    finally:
        waiting.set()  # a shard the call left running ends now (the test has failed then)
        concurrent.futures.wait(pool.submitted, timeout=30)
    if presses == 1:  # deferred to the end: every shard ran
        np.testing.assert_array_equal(out, x * 2 + 1)
    assert_nothing_live(devs)


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals reach the main thread")
def test_a_ctrl_c_while_a_job_over_two_devices_closes_closes_every_shard():
    devs = sims(2, 10)
    x = contents((4000,), 10)
    # staged: closing a shard's scheduled engine drives it, through the steps where a Ctrl-C is taken
    job = rf.MapJob(f, x, device=devs, chunk_bytes=800, host="stage")
    np.testing.assert_array_equal(job(), x * 2 + 1)
    parts = job._held.engine.parts
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)  # a shard left to the garbage collector warns
        # Ctrl-C as close() starts releasing: raised once every shard is closed, not half way
        with InterruptAt(0, ["_take_turn"], files=["/ringflow/_pipeline/job.py"], sigint=True) as at:
            with pytest.raises(KeyboardInterrupt):
                job.close()
        assert at.fired == 1 and job.closed
        assert all(part.closed for part in parts)
        gc.collect()
    assert_nothing_live(devs)


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals reach the main thread")
@pytest.mark.parametrize("where", ["starting the shards", "assembling the job"])
def test_a_ctrl_c_while_a_job_over_two_devices_is_set_up_closes_what_was_made(monkeypatch, where):
    devs = sims(2, 11)
    x = contents((4000,), 11)
    if where == "starting the shards":
        pool = _SigintsAfterFirstSubmit(sharded._threads())
        monkeypatch.setattr(sharded, "_threads", lambda: pool)
        at = contextlib.nullcontext()
    else:  # every shard's job made, the job over them not yet
        at = InterruptAt(0, ["__init__"], files=["/ringflow/_pipeline/sharded.py"], sigint=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)  # a shard's job left to the garbage collector warns
        with at, pytest.raises(KeyboardInterrupt):
            rf.MapJob(f, x, device=devs, chunk_bytes=800, host="stage")
        gc.collect()
    assert_nothing_live(devs)


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals reach the main thread")
@pytest.mark.parametrize("devices", [1, 2])
def test_a_ctrl_c_anywhere_in_a_jobs_set_up_leaves_nothing_to_the_garbage_collector(devices):
    """A Ctrl-C at any instruction of ``MapJob.__init__`` where CPython raises it: the job is not
    made and what its set-up had made is released at once. Between the engine's being made and
    the job's finaliser (and, over several devices, between the shards' job and its being held)
    a Ctrl-C left them to the garbage collector, with a ResourceWarning."""
    x = contents((4000,), 11)
    n, fired = 0, 0
    while True:
        devs = sims(devices, 11)
        with warnings.catch_warnings():
            warnings.simplefilter("error", ResourceWarning)
            with InterruptAt(n, ["__init__"], files=["/ringflow/_pipeline/job.py"], sigint=True) as at:
                try:
                    job = rf.MapJob(f, x, device=devs if devices > 1 else devs[0], chunk_bytes=800, host="stage")
                except KeyboardInterrupt:
                    job = None
            if job is not None:
                assert not at.fired
                np.testing.assert_array_equal(job(), x * 2 + 1)
                job.close()
            gc.collect()
        assert_nothing_live(devs)
        if not at.fired:
            break
        fired += 1
        n += 1
    assert fired > 5  # the sweep reached the set-up's steps


def _fails_where_x_is_1500000(x, y):
    if (x == 1_500_000).any():
        raise ValueError("refused")
    y[...] = x


_fails_where_x_is_1500000.sim_seconds = lambda nbytes: nbytes * 1e-8  # compute-bound: tapered chunks


def test_a_failed_chunk_of_a_compute_bound_call_over_two_devices_names_the_rows_it_held():
    """A compute-bound job tapers its chunks (its first and last shorter), so the rows a failed
    chunk held are not its index times a chunk's rows: each shard's engine says which they were,
    and the error names them in the whole array's rows."""
    n = 8_000_000
    x = np.arange(n, dtype=np.float32)
    with pytest.raises(rf.StageError) as info:
        rf.stream_map(_fails_where_x_is_1500000, x, device=sims(2, 12), chunk_bytes=4 << 20, host="register")
    a, b = info.value.rows
    assert a <= 1_500_000 < b and b - a <= 1 << 20, (a, b)  # (a whole chunk: 1 Mi rows)
    assert f"rows x[{a}:{b}]" in str(info.value)


def _call_chunks(length: int, rows: int, row_bytes: int, shards: int) -> list:
    """Every chunk ``(start, stop)`` of ``x`` a compute-bound call over ``shards`` equal shards
    runs, in row order: each shard tapered at both of its ends."""
    share, bounds = length // shards, []
    for s in range(shards):
        start = s * share
        for n in sizing.chunk_sizes(share, rows, sizing.taper(rows, row_bytes)):
            bounds.append((start, start + n))
            start += n
    return bounds


@pytest.mark.parametrize("engine", ["direct", "pipeline"])
@pytest.mark.parametrize("api", ["stream_map", "MapJob"])
def test_a_failed_chunk_of_a_tapered_call_over_two_devices_is_indexed_over_the_whole_call(api, engine):
    """The index counts the chunks every shard before the failed one ran, tapered ones included
    (each shard of a compute-bound call on the direct engine has short chunks at both ends; the
    scheduled engine cuts whole ones), so chunk ``index`` of the call is the one whose rows the
    error names; it survives pickling with the rows."""
    x = np.arange(8_000_000, dtype=np.float32)
    x[5_500_000] = 1_500_000  # the failing value, in the second shard
    x[1_500_000] = 0
    kw = dict(device=sims(2, 13), chunk_bytes=4 << 20, host="register", engine=engine)
    with pytest.raises(rf.StageError) as info:
        if api == "stream_map":
            rf.stream_map(_fails_where_x_is_1500000, x, **kw)
        else:
            with rf.MapJob(_fails_where_x_is_1500000, x, **kw) as job:
                job()
    err = info.value
    if engine == "direct":
        chunks = _call_chunks(8_000_000, 1 << 20, 4, 2)
        assert len(chunks) == 18  # 9 a shard: 3 short ones at each end, 3 between
    else:
        chunks = _whole_chunks(8_000_000, 1 << 20, 2)
    assert err.device is not None and err.rows in chunks and err.rows[0] <= 5_500_000 < err.rows[1]
    assert (err.index, chunks[err.index]) == (chunks.index(err.rows), err.rows)
    assert f"failed for chunk {err.index}:" in str(err) and f"x[{err.rows[0]}:{err.rows[1]}]" in str(err)
    back = pickle.loads(pickle.dumps(err))
    assert (back.stage, back.index, back.rows, str(back)) == (err.stage, err.index, err.rows, str(err))


def _whole_chunks(length: int, rows: int, shards: int) -> list:
    """Every chunk ``(start, stop)`` of ``x`` an untapered call over ``shards`` equal shards
    runs, in row order."""
    share = length // shards
    return [(s + a, s + min(a + rows, share)) for s in range(0, length, share) for a in range(0, share, rows)]


def _slow_kernel_sims(n: int, seed: int) -> list:
    """Simulated GPUs whose kernels are slower than any copy: with no cost stated, the direct
    engine times a chunk of a job's first call and tapers its later ones."""
    slow = dataclasses.replace(get_profile("h200-pcie5"), name="slow-kernels", device_GBps=0.5)
    return sims(n, seed, profile=slow)


@pytest.mark.parametrize("failing_call", ["first", "second"])
def test_a_failed_chunk_of_a_measured_job_over_two_devices_is_indexed_over_the_call_it_ran_in(failing_call):
    """A MapJob measures its first call and tapers its later ones: the index counts the chunks
    each earlier shard ran in the failing call (untapered in the first, tapered after it), not
    the ones it will run next."""
    x = np.arange(8_000_000, dtype=np.float32) + 2_000_000  # no row holds 1500000
    with rf.MapJob(_untimed_fails_where_x_is_1500000, x, device=_slow_kernel_sims(2, 14), chunk_bytes=4 << 20,
                   host="register") as job:
        if failing_call == "second":
            job()
        x[5_500_000] = 1_500_000
        with pytest.raises(rf.StageError) as info:
            job()
    err = info.value
    if failing_call == "first":  # uniform chunks of 1 Mi rows: 4 a shard
        chunks = _whole_chunks(8_000_000, 1 << 20, 2)
    else:
        chunks = _call_chunks(8_000_000, 1 << 20, 4, 2)
    assert err.rows in chunks and err.rows[0] <= 5_500_000 < err.rows[1]
    assert err.index == chunks.index(err.rows), (err.index, err.rows, chunks)


def _untimed_fails_where_x_is_1500000(x, y):  # no cost stated: the engine measures it
    _fails_where_x_is_1500000(x, y)


def test_a_measured_job_over_two_devices_counts_the_tapered_chunks_its_later_calls_run():
    x = np.arange(8_000_000, dtype=np.float32) + 2_000_000
    with rf.MapJob(_untimed_fails_where_x_is_1500000, x, device=_slow_kernel_sims(2, 15), chunk_bytes=4 << 20,
                   host="register") as job:
        assert job.chunks == 8
        job()
        job(profile=True)
        assert job.chunks == job.report().chunks == 18


@pytest.mark.parametrize("path, error, match", [
    (1, TypeError, "plot: path must be a file name"),  # open() would take it for stdout's descriptor
    ("", FileNotFoundError, None),  # a path given is written, as Report.plot writes it, not skipped
], ids=repr)
def test_a_sharded_plot_path_that_is_not_a_file_name_is_refused_as_one_device_report_refuses_it(
        path, error, match, capfd, monkeypatch):
    pytest.importorskip("matplotlib")
    _, report = rf.stream_map_report(f, contents((8, 4), 1), device=sims(2))
    with pytest.raises(error, match=match):
        report.reports[0].plot(path)
    with pytest.raises(error, match=match):
        report.plot(path)
    assert capfd.readouterr().out == ""


def test_a_sharded_plot_into_a_text_file_is_refused_before_drawing(monkeypatch):
    pytest.importorskip("matplotlib")
    import io

    _, report = rf.stream_map_report(f, contents((8, 4), 1), device=sims(2))

    def drawn(*args, **kwargs):
        raise AssertionError("a chart was drawn for a file it cannot be written to")

    monkeypatch.setattr(rf.Report, "plot", drawn)
    with pytest.raises(TypeError, match="plot: path must be a file name .*or an open binary file"):
        report.plot(io.StringIO())


_FORK_SHARDS = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    import ringflow as rf

    def f(a, b):
        b[...] = a * 2

    x = np.arange(1 << 14, dtype=np.float32)
    assert (rf.stream_map(f, x, device=["sim:0", "sim:1"], chunk_bytes=1 << 12) == x * 2).all()
    from ringflow._pipeline import sharded
    from tests.helpers.threads import wait_until_idle
    wait_until_idle(sharded._threads())  # the child inherits them counted idle
    pid = os.fork()
    if pid == 0:
        signal.alarm(10)  # a hang ends the child, and the parent reports its status
        row = x.reshape(4, -1)[:1]  # one row: one shard for the pool, which one idle thread counted takes
        one = rf.stream_map(f, row, device=["sim:0", "sim:1"], chunk_bytes=1 << 14, keep_warm=False)
        y = rf.stream_map(f, x, device=["sim:0", "sim:1"], chunk_bytes=1 << 12, keep_warm=False)
        sys.stdout.write(f"one row: {bool((one == row * 2).all())}\\n")
        sys.stdout.write(f"child: {bool((y == x * 2).all())}\\n")
        sys.stdout.flush()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert (rf.stream_map(f, x, device=["sim:0", "sim:1"], chunk_bytes=1 << 12) == x * 2).all()
    print("child status", status)
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
def test_a_forked_child_runs_its_own_shards():
    """The shard threads are shared by the process's calls and kept: a child forked after a call
    over several devices inherited the pool without its threads, and the pool counted them idle,
    so the child's first such call queued its shards for threads that do not exist and waited for
    ever. The child starts a pool of its own."""
    run = subprocess.run([sys.executable, "-c", _FORK_SHARDS], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONWARNINGS": "ignore::DeprecationWarning"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "child status 0" in run.stdout and "child: True" in run.stdout, run.stdout + run.stderr[-2000:]
    assert "one row: True" in run.stdout, run.stdout


@pytest.mark.parametrize("host", ["register", "stage"])
def test_two_calls_over_the_same_devices_at_once_both_return_their_results(monkeypatch, host):
    """Two threads' calls over the same named devices, both declared copying before either ends:
    with pinned memory a call declares no copy thread, and the first call to end took each
    device's declaration away, so the second raised KeyError once its shards had all finished.
    Both return their results."""
    declared, lock, mine = threading.Event(), threading.Lock(), threading.local()
    count = [0]
    real = sim_host.SimHost.sharing

    @contextlib.contextmanager
    def counted(self, dev, threads):
        with real(self, dev, threads):
            with lock:
                count[0] += 1
                if count[0] == 4:  # both calls, each over both devices
                    declared.set()
            mine.entered = getattr(mine, "entered", 0) + 1
            if mine.entered == 2:  # this call has declared both devices; no shard of it started yet
                assert declared.wait(10), "the other call never declared its devices"
            yield

    monkeypatch.setattr(sim_host.SimHost, "sharing", counted)
    with named_sims(46, 47, checked=True) as devs:
        xs = [contents(1 << 12, seed) for seed in (1, 2)]
        ys = run_all([lambda x=x: rf.stream_map(f, x, device=devs, chunk_bytes=1 << 12, host=host) for x in xs],
                     timeout=30)
        for x, y in zip(xs, ys):
            assert np.array_equal(y, x * 2 + 1)
        assert devs[0].host._declared == {}
        assert_nothing_live(devs)


@pytest.mark.parametrize("door", ["stream_map", "MapJob"])
def test_a_compute_running_a_call_over_several_devices_of_its_own_never_waits_for_the_shard_threads(door, monkeypatch):
    # the shards of every call queued on one shared, bounded pool of threads: a compute (run on
    # a shard's thread) making a call over several devices queued that call's shards behind the
    # outer call's, whose threads were all waiting for them, and the call hung for ever. A pool
    # of two threads, as busy as the outer call's two shards keep it, shows the bound being met
    pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="test-shard")
    monkeypatch.setattr(sharded, "_threads", lambda: pool)
    outer = [rf.device("sim", seed=s, checked=True) for s in (1, 2)]
    inner = [rf.device("sim", seed=s, checked=True) for s in (3, 4)]
    x = np.arange(1 << 12, dtype=np.float32)

    def plus_one(a, b):
        b[...] = a + 1

    def f(a, b):
        b[...] = rf.stream_map(plus_one, np.array(a), device=inner, chunk_bytes=1024) * 2

    def call():
        if door == "stream_map":
            return rf.stream_map(f, x, device=outer, chunk_bytes=4096)
        with rf.MapJob(f, x, device=outer, chunk_bytes=4096) as job:
            return job().copy()

    try:
        np.testing.assert_array_equal(bounded(call, timeout=30), (x + 1) * 2)
    finally:
        pool.shutdown(wait=False)
    rf.drop_warm_pipelines()
    for dev in outer + inner:
        assert dev.live().total == 0, dev.live()


def test_a_mapjob_over_two_gpus_weighs_one_call_on_every_shard(monkeypatch):
    """A job's shards each pin once for all its calls: 64 MiB in 8 MiB chunks over two simulated
    GPUs whose staged chunk costs the scheduler 627 µs registers on both, where stream_map of the
    same arrays stages."""
    slow = slow_staged_chunks()

    def double(a, b):
        np.multiply(a, 2, out=b)

    double.sim_seconds = 0.0
    seen = layouts_planned(monkeypatch)
    x = np.arange(32 * MiB // 4 * 2, dtype=np.float32)  # 64 MiB: 32 MiB a shard
    with named_sims(45, 46, profile=slow):
        with rf.MapJob(double, x, device=["sim:45", "sim:46"], chunk_bytes=8 * MiB, workers=4) as job:
            assert job.strategy == "register"
            assert np.array_equal(job(), x * 2)
        del seen[:]
        y = rf.stream_map(double, x, device=["sim:45", "sim:46"], chunk_bytes=8 * MiB, workers=4, keep_warm=False)
        assert np.array_equal(y, x * 2)
        assert [layout.strategy for layout in seen] == ["stage"] * 3  # the probe, then each shard


def test_host_auto_bounds_what_each_device_registers_by_a_quarter_of_the_hosts_memory(monkeypatch):
    """With no pinned_budget, host="auto"'s default bound is per device, as a budget is: a MapJob
    of 64 MiB over two simulated GPUs pins 64 MiB on each (its rows of x and of the result), so
    it registers on a host of four times that and stages on one a page smaller."""
    from ringflow._device import host_pool

    def double(a, b):
        np.multiply(a, 2, out=b)

    double.sim_seconds = 0.0
    seen = layouts_planned(monkeypatch)
    x = np.arange(32 * MiB // 4 * 2, dtype=np.float32)  # 64 MiB: 32 MiB a shard, 64 MiB to pin on each
    with named_sims(47, 48, profile=slow_staged_chunks()):
        for ram, want in ((4 * 64 * MiB, "register"), (4 * 64 * MiB - 4096, "stage")):
            monkeypatch.setattr(host_pool, "physical_memory", lambda: ram)
            del seen[:]
            with rf.MapJob(double, x, device=["sim:47", "sim:48"], chunk_bytes=8 * MiB, workers=4) as job:
                assert job.strategy == want and np.array_equal(job(), x * 2)
            assert [layout.strategy for layout in seen] == [want] * 3, ram  # the probe, then each shard
