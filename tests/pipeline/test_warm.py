"""stream_map keeps its finished pipeline warm for the next call of the same shape."""

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import types
import warnings
import weakref

import numpy as np
import pytest

import ringflow as rf
from tests.helpers.hooks import engines
from tests.helpers.interrupts import InterruptAt
from tests.helpers.sim import named_sims
from tests.helpers.threads import JOIN_S, bounded, join, start
from tests.helpers.collector import collector_off
from ringflow._device.protocol import Device
from ringflow._errors import OutOfMemoryError, StageError
from ringflow._pipeline import warm


def f(x, y):
    y[:] = x * 2 + 1


@pytest.fixture(autouse=True)
def empty_cache():
    rf.drop_warm_pipelines()
    yield
    rf.drop_warm_pipelines()


def run(x, dev, **kw):
    """stream_map returning (result, the pipeline that ran it); staged unless ``host`` says
    otherwise (the scheduler's pipeline, whatever "auto" would pick for these small arrays)."""
    kw.setdefault("host", "stage")
    seen = {}
    with engines(on=lambda p: seen.setdefault("pipe", p)):
        y = rf.stream_map(f, x, device=dev, **kw)
    return y, seen["pipe"]


def fresh(n, seed):
    return np.random.default_rng(seed).uniform(0.5, 1.5, n).astype(np.float32)


def test_the_next_call_of_the_same_shape_reuses_the_pipeline():
    dev = rf.device("sim", seed=1, chaos=True)
    pipes = []
    for i in range(4):
        x = fresh(5000, i)
        y, pipe = run(x, dev, chunk_bytes=4096)
        assert np.array_equal(y, x * 2 + 1)
        pipes.append(pipe)
    assert all(p is pipes[0] for p in pipes)
    assert pipes[0].stats().accepted == -(-5000 * 4 // 4096)  # counters restart with each call
    _, other = run(fresh(5000, 9), dev, chunk_bytes=8192)  # another chunk size: another pipeline
    assert other is not pipes[0]
    _, again = run(fresh(5000, 10), dev, chunk_bytes=4096)
    assert again is pipes[0]  # both shapes fit the cache (capacity 2)
    assert rf.drop_warm_pipelines(dev) == 2
    assert dev.live().total == 0


@pytest.mark.parametrize("host", ["stage", "register"])
@pytest.mark.parametrize("seed", range(4))
def test_a_pipeline_parked_by_one_thread_serves_another_in_order(seed, host):
    """Parking and taking are a hand-off between threads: without its ordering edge the checker
    finds the second thread's staging write unordered after the first thread's call."""
    dev = rf.device("sim", seed=seed, chaos=True)
    pipes = []
    for k in range(2):  # one thread after the other, the same key
        x = fresh(4096, seed * 10 + k)
        y, pipe = bounded(lambda x=x: run(x, dev, chunk_bytes=2048, host=host))
        np.testing.assert_array_equal(y, x * 2 + 1)
        pipes.append(pipe)
    assert pipes[0] is pipes[1]
    rf.drop_warm_pipelines(dev)
    assert dev.live().total == 0


def test_keep_warm_false_closes_the_pipeline():
    dev = rf.device("sim")
    run(fresh(1000, 0), dev, chunk_bytes=1024, keep_warm=False)
    assert len(warm.WARM) == 0
    assert dev.live().total == 0


def test_profiled_and_checked_calls_are_not_kept():
    """On the scheduler (staged) a profiled call runs on a pipeline of its own, not kept; a
    checked call is never kept (the direct engine's profiled calls time one pass of the same
    engine, which stays warm)."""
    dev = rf.device("sim")
    x = fresh(1000, 0)
    rf.stream_map(f, x, device=dev, chunk_bytes=1024, checked=True, host="stage")
    rf.stream_map(f, x, device=dev, chunk_bytes=1024, host="stage")
    assert rf.drop_warm_pipelines(dev) == 1  # only the plain call's
    from ringflow._pipeline.whole_array import stream_map_report

    stream_map_report(f, x, device=dev, chunk_bytes=1024, host="stage")
    assert len(warm.WARM) == 0


def test_a_kept_pipeline_holds_none_of_the_callers_arrays():
    dev = rf.device("sim")
    for host in ("stage", "register"):
        x = fresh(4096, 3)
        out = np.empty_like(x)
        rf.stream_map(f, x, out, device=dev, chunk_bytes=2048, host=host)
        refs = weakref.ref(x), weakref.ref(out)
        del x, out
        gc.collect()
        assert refs[0]() is None and refs[1]() is None, host
    assert rf.drop_warm_pipelines(dev) == 2


def test_pinned_buffers_are_rebound_each_call():
    """x_buffer/out_buffer: the kept pipeline's external rings point at each call's buffers."""
    dev = rf.device("sim", seed=4, chaos=True)
    n = 3000
    bufs = [(dev.allocate_host(4 * n), dev.allocate_host(4 * n)) for _ in range(3)]
    pipes = set()
    for i, (hx, hy) in enumerate(bufs * 2):
        x = hx.view(np.float32, access="rw")
        x[:] = fresh(n, i)
        y = hy.view(np.float32, access="rw")
        seen = {}
        with engines(on=lambda p: seen.setdefault("p", p)):
            rf.stream_map(f, x, y, device=dev, chunk_bytes=1024, x_buffer=hx, out_buffer=hy)
        pipes.add(id(seen["p"]))
        assert np.array_equal(y, x * 2 + 1)
    assert len(pipes) == 1
    rf.drop_warm_pipelines(dev)
    for hx, hy in bufs:
        hx.close()
        hy.close()
    assert dev.live().total == 0


def test_in_place_calls_reuse_and_stay_correct_under_chaos():
    for seed in range(6):
        dev = rf.device("sim", seed=seed, chaos=True)
        for i in range(5):
            x = fresh(7777, seed * 10 + i)
            want = x * 2 + 1
            assert rf.stream_map(f, x, x, device=dev, chunk_bytes=4096, inplace=True) is x
            assert np.array_equal(x, want)
        rf.drop_warm_pipelines(dev)
        assert dev.live().total == 0


def test_a_failed_call_is_not_kept_and_the_next_one_works():
    dev = rf.device("sim")
    calls = {"n": 0}

    def flaky(x, y):
        calls["n"] += 1
        if calls["n"] == 6:  # the second chunk of the second call
            raise RuntimeError("boom")
        y[:] = x * 2 + 1

    x = fresh(4096, 0)
    rf.stream_map(flaky, x, device=dev, chunk_bytes=4096)  # 4 chunks of 4 KiB, kept
    assert len(warm.WARM) == 1
    with pytest.raises(StageError, match="boom"):
        rf.stream_map(flaky, x, device=dev, chunk_bytes=4096)  # reuses it; a chunk fails: dropped
    assert len(warm.WARM) == 0
    assert np.array_equal(rf.stream_map(flaky, x, device=dev, chunk_bytes=4096), x * 2 + 1)
    rf.drop_warm_pipelines()
    assert dev.live().total == 0


@pytest.mark.parametrize("host", ["stage", "register", "auto"])
def test_a_broken_device_is_not_kept(host):
    """A call on a device broken since the last (a sticky error) raises it, and the engines kept
    for that device go: taken and closed by a staged call, dropped by a registering one, whose
    registration fails before it takes an engine."""
    dev = rf.device("sim")
    x = fresh(4096, 0)
    rf.stream_map(f, x, device=dev, chunk_bytes=1024, host=host)
    assert len(warm.WARM) == 1
    dev.inject_sticky_error()
    with pytest.raises(rf.DeviceError):
        rf.stream_map(f, x, device=dev, chunk_bytes=1024, host=host)
    assert len(warm.WARM) == 0


def no_close_callbacks(monkeypatch):
    """Devices that never call the warm cache back at close, as for an engine parked while its
    device was closing: the cache's own checks of a closed device are then all that drop it."""
    monkeypatch.setattr(Device, "on_close", lambda self, callback: (lambda: None))


def test_a_pipeline_of_a_closed_device_is_discarded(monkeypatch):
    no_close_callbacks(monkeypatch)
    dev = rf.device("sim")
    x = fresh(4096, 0)
    rf.stream_map(f, x, device=dev, chunk_bytes=1024)
    dev.close()
    assert warm.WARM.take(next(iter(warm.WARM._parked)), f) is None
    dev2 = rf.device("sim")
    assert np.array_equal(rf.stream_map(f, x, device=dev2, chunk_bytes=1024), x * 2 + 1)


def test_least_recently_used_is_closed_beyond_capacity():
    dev = rf.device("sim")
    x = fresh(4096, 0)
    firsts = []
    for cb in (256, 512, 1024, 2048, 4096):
        _, p = run(x, dev, chunk_bytes=cb)
        firsts.append(p)
    assert len(warm.WARM) == warm.DEFAULT_CAPACITY == 4
    assert firsts[0]._closed and not any(p._closed for p in firsts[1:])


def test_the_engines_kept_for_a_device_hold_at_most_their_share_of_its_memory_and_the_hosts(monkeypatch):
    """Beyond the count, the parked engines of one device are bounded in bytes (pinned and
    device, each on its own): the least recently used go first, and the newest stays whatever
    its size."""
    dev = rf.device("sim")
    x = fresh(1 << 16, 0)
    sizes = {}
    for cb in (4096, 8192, 16384):
        _, p = run(x, dev, chunk_bytes=cb)
        sizes[cb] = p
    held = {cb: warm_held(p) for cb, p in sizes.items()}
    assert all(pinned > 0 and device > 0 for pinned, device in held.values())
    rf.drop_warm_pipelines()
    for side in (0, 1):
        # room for the two larger engines' bytes on this side, not for all three
        room = held[8192][side] + held[16384][side]
        bound = [1 << 60, 1 << 60]
        bound[side] = room
        monkeypatch.setattr(warm, "parked_bytes_bound", lambda device, bound=tuple(bound): bound)
        kept = [run(x, dev, chunk_bytes=cb)[1] for cb in (4096, 8192, 16384)]
        assert [p._closed for p in kept] == [True, False, False], side
        monkeypatch.setattr(warm, "parked_bytes_bound", lambda device: (1, 1))
        _, last = run(x, dev, chunk_bytes=2048)
        assert all(p._closed for p in kept) and not last._closed and len(warm.WARM) == 1
        rf.drop_warm_pipelines()
    assert dev.live().total == 0


def warm_held(pipe):
    """The bytes the parked engine of ``pipe`` holds (pinned, device)."""
    (engine,) = [entry[0] for entry in warm.WARM._parked.values() if getattr(entry[0], "pipe", None) is pipe]
    return engine.held_bytes()


def test_the_default_bound_is_a_sixteenth_of_the_devices_memory_and_of_the_hosts(monkeypatch):
    from ringflow._device import host_pool

    monkeypatch.setattr(host_pool, "physical_memory", lambda: 64 << 30)
    dev = rf.device("sim")
    assert warm.parked_bytes_bound(dev) == (4 << 30, dev.hardware.total_memory // 16)
    monkeypatch.setattr(host_pool, "physical_memory", lambda: None)
    assert warm.parked_bytes_bound(dev)[0] == 1 << 30


@pytest.mark.parametrize("host", ["stage", "register"])
def test_a_call_that_finds_no_memory_for_its_engine_closes_the_kept_ones_and_runs(host):
    """Memory the cache holds never makes a call fail: a device whose memory the parked engines
    fill builds a new call's engine once they are closed (a profile of little device memory)."""
    import dataclasses

    from ringflow import _plan as plan

    small = dataclasses.replace(plan.get_profile("h200-pcie5"), total_memory=96 << 10)
    dev = rf.device("sim", profile=small)
    x = fresh(1 << 14, 3)
    _, first = run(x, dev, chunk_bytes=16384, host=host, slots=2)
    assert not is_closed(first) and dev.live().device_buffers > 0
    with pytest.raises(OutOfMemoryError):
        dev.allocate(96 << 10)  # the parked engine holds device memory
    y, second = run(x, dev, chunk_bytes=8192, host=host, slots=4)
    assert np.array_equal(y, x * 2 + 1) and is_closed(first) and not is_closed(second)
    out = np.empty_like(x)
    with rf.MapJob(f, x, out, device=dev, chunk_bytes=8192, host=host, slots=4) as job:  # a job as well
        assert job() is out and np.array_equal(out, x * 2 + 1) and is_closed(second)


def is_closed(engine) -> bool:
    """Whether a pipeline (the scheduled engine's) or a direct schedule is closed."""
    return engine._closed if isinstance(engine, rf.Pipeline) else engine.closed


@pytest.mark.parametrize("seed", range(20))
def test_warm_calls_mixing_host_strategies_stay_correct_under_chaos(seed):
    """Consecutive calls on one chaotic device, each strategy reusing its kept pipeline: staged,
    registered, the caller's pinned buffers rebound, in place. The checker sees every access."""
    reused, last = [], None
    dev = rf.device("sim", seed=seed, chaos=True)
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1000, 20000))
    hx, hy = dev.allocate_host(4 * n), dev.allocate_host(4 * n)
    for i in range(12):
        x = fresh(n, seed * 100 + i)
        mode = (seed + i // 3) % 4  # three calls of a kind in a row: the second and third reuse
        seen = {}
        with engines(on=lambda p: seen.setdefault("p", p)):
            if mode == 0:
                y = rf.stream_map(f, x, device=dev, chunk_bytes=4096, host="stage")
            elif mode == 1:
                y = rf.stream_map(f, x, device=dev, chunk_bytes=4096, host="register")
            elif mode == 2:
                xv, y = hx.view(np.float32, access="rw"), hy.view(np.float32, access="rw")
                xv[:] = x
                rf.stream_map(f, xv, y, device=dev, chunk_bytes=4096, x_buffer=hx, out_buffer=hy)
            else:
                y = x.copy()
                rf.stream_map(f, y, y, device=dev, chunk_bytes=8192, inplace=True)
        assert np.array_equal(y, x * 2 + 1), (seed, i, mode)
        reused.append(i % 3 and seen["p"] is last)
        last = seen["p"]
    assert sum(reused) == 8  # every second and third call of a kind ran on the kept pipeline
    rf.drop_warm_pipelines(dev)
    hx.close()
    hy.close()
    assert dev.live().total == 0


def test_pipelines_parked_by_another_thread_close_quietly_at_exit():
    """A process that ends with a pipeline kept warm by a thread other than the main one: the
    pipeline is closed at exit ordered after that thread (the cache's hand-off), so the
    simulated GPU's checker reports nothing. Its pipeline's own finaliser, which knows nothing
    of the parking thread, used to close it first and warn of a hazard per ring."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import threading, warnings
        import numpy as np
        import ringflow as rf
        warnings.simplefilter("always")
        dev = rf.device("sim", seed=2, chaos=True)
        x = np.arange(1 << 14, dtype=np.float32)
        def f(x, y):
            y[...] = x * 2 + 1
        t = threading.Thread(target=lambda: rf.stream_map(f, x, device=dev, chunk_bytes=4096))
        t.start(); t.join()
        assert dev.live().streams > 0  # kept warm, not closed by the call
        print("ran")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ran" in done.stdout, done.stderr
    assert "Warning" not in done.stderr and "Hazard" not in done.stderr, done.stderr


@pytest.mark.parametrize("device", ["sim", "auto", "sim:x", 0, True, ["sim"]], ids=repr)
def test_dropping_the_warm_pipelines_of_something_not_a_device_is_refused(device):
    """A spec, a number or a list names no device whose pipelines are kept: it used to drop
    nothing and return 0, so a leak check after it went on with the pipelines still warm."""
    dev = rf.device("sim")
    rf.stream_map(f, np.ones(64, np.float32), device=dev, chunk_bytes=64)
    with pytest.raises(TypeError, match="drop_warm_pipelines.*device"):
        rf.drop_warm_pipelines(device)
    assert rf.drop_warm_pipelines(dev) == 1


@pytest.mark.parametrize("device", ["sim", None, ["sim"], ["sim", "sim"]], ids=repr)
def test_a_call_on_a_device_made_for_it_keeps_no_engine_warm(device, monkeypatch):
    """A spec such as "sim" or "cuda:0" (alone or in a list), and None, make a new device on
    every call: an engine kept warm for it could never be taken again (its key names that
    device), and only held its device, streams and rings, a full cache of them at a time."""
    monkeypatch.setenv("RINGFLOW_DEVICE", "sim")
    made = []
    x = np.ones(1 << 12, np.float32)
    for _ in range(3):
        with engines(on=lambda p: made.append(weakref.ref(p.device))):
            assert (rf.stream_map(f, x, device=device, chunk_bytes=1 << 12) == x * 2 + 1).all()
    assert len(warm.WARM) == 0
    gc.collect()
    assert [ref() for ref in made] == [None] * len(made)


def test_a_call_on_a_named_spec_keeps_its_engine_warm():
    """"sim:N" names the same device on every call: its engine is kept, and the next call takes it."""
    from tests.helpers.sim import named_sims

    x = np.ones(1 << 12, np.float32)
    with named_sims(0) as (dev,):
        ran = [run(x, "sim:0", chunk_bytes=1 << 12)[1] for _ in range(2)]
        assert ran[0] is ran[1] and len(warm.WARM) == 1
        assert rf.drop_warm_pipelines(dev) == 1


def test_a_named_spec_drops_the_warm_pipelines_of_the_device_it_names():
    """"sim:N" is the same device for every call naming it, and "cuda:N" the same GPU: refused
    as a spec that "makes a new device, which has none"."""
    from ringflow import _device
    from tests.helpers.sim import named_sims

    with named_sims(0, 1) as (first, second):
        for dev in (first, second):
            rf.stream_map(f, np.ones(64, np.float32), device=dev, chunk_bytes=64)
        assert rf.drop_warm_pipelines("sim:0") == 1 and first.live().total == 0
        assert second.live().total > 0 and rf.drop_warm_pipelines("sim:1") == 1
    made = dict(_device._named_sims)
    assert rf.drop_warm_pipelines("sim:7") == 0 and _device._named_sims == made  # none made to find none

    closed = []
    gpu = types.SimpleNamespace(backend="cuda", index=1, closed=False, observe=lambda token: None)
    warm.WARM._parked["gpu 1"] = (types.SimpleNamespace(device=gpu, close=lambda: closed.append(1)), None,
                                   warm.ComputeRelay(f))
    assert rf.drop_warm_pipelines("cuda:0") == 0 and rf.drop_warm_pipelines("cuda:1") == 1 and closed == [1]


_FORK_WARM = textwrap.dedent("""
    import os, signal, sys, warnings
    import numpy as np
    import ringflow as rf
    from tests.helpers.forks import leave_child

    def f(a, b):
        b[...] = a * 2

    x = np.arange(1 << 12, dtype=np.float32)
    d = rf.device("sim")
    rf.stream_map(f, x, device=d, chunk_bytes=1 << 12)  # parks its pipeline
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)
        lines = []
        try:
            rf.stream_map(f, x, device=d, chunk_bytes=1 << 12)
            lines.append("same device: worked")
        except RuntimeError as exc:
            lines.append(f"same device: {exc}")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lines.append(f"dropped: {rf.drop_warm_pipelines()}")
        lines.append(f"warnings: {[str(w.message) for w in caught]}")
        y = rf.stream_map(f, x, device=rf.device("sim"), chunk_bytes=1 << 12)
        lines.append(f"own device: {bool((y == x * 2).all())}")
        leave_child(lines)
    _, status = os.waitpid(pid, 0)
    assert (rf.stream_map(f, x, device=d, chunk_bytes=1 << 12) == x * 2).all()
    print("child status", status)
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
def test_a_forked_child_never_takes_the_parents_warm_pipelines():
    """The child's stream_map took the pipeline its parent had parked, and failed saying a
    Pipeline (which the caller never made) was made before fork(); the parked pipelines are the
    parent's, and the child forgets them, touching nothing."""
    run = subprocess.run([sys.executable, "-c", _FORK_WARM], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONWARNINGS": "ignore::DeprecationWarning"})
    out = run.stdout
    assert run.returncode == 0, run.stderr[-2000:]
    assert "child status 0" in out, out + run.stderr[-2000:]
    assert "same device: this simulated GPU was made in a parent process before fork()" in out, out
    assert "dropped: 0" in out and "warnings: []" in out and "own device: True" in out, out


def test_a_compute_whose_cost_is_replaced_gets_an_engine_planned_for_the_new_cost():
    """The warm key holds whether the job is compute-bound: an engine planned with two compute
    streams for a costly compute does not serve the same compute once its cost is replaced."""
    dev = rf.device("sim", seed=3)

    def g(x, y):
        y[:] = x * 2 + 1

    hb_x, hb_y = dev.allocate_host(1 << 14), dev.allocate_host(1 << 14)  # pinned: the direct engine
    x, y = hb_x.view(np.float32, access="rw"), hb_y.view(np.float32, access="rw")
    x[:] = fresh(x.size, 1)
    lanes = []
    try:
        for cost in (1e-3, 1e-9, 1e-3):
            g.sim_seconds = cost
            _, rep = rf.stream_map_report(g, x, y, device=dev, chunk_bytes=4096, x_buffer=hb_x, out_buffer=hb_y)
            assert np.array_equal(y, x * 2 + 1)
            lanes.append(rep.timeline.meta["compute_lanes"])
    finally:
        rf.drop_warm_pipelines(dev)
        hb_x.close()
        hb_y.close()
    assert lanes == [2, 1, 2]


@pytest.mark.parametrize("host", ["register", "stage"])
def test_a_compute_whose_cost_is_replaced_runs_for_its_new_cost_on_a_warm_engine(host):
    """A cost replaced by another that leaves the job as compute-bound as before (here never)
    found the engine kept for the old cost: the direct engine lays each chunk's kernel time out
    when it is made, so the warm call's kernels ran for the old cost, and the report said so."""
    dev = rf.device("sim", seed=3)

    def g(x, y):
        y[:] = x * 2 + 1

    x = fresh(1 << 20, 1)
    costs = (1e-6, 1e-5, 3e-6, 1e-5)  # each well below a chunk's copy: not compute-bound
    ran = []
    for cost in costs:
        g.sim_seconds = cost
        y, rep = rf.stream_map_report(g, x, device=dev, chunk_bytes=1 << 20, host=host)
        assert np.array_equal(y, x * 2 + 1)
        ran.append(rep.stage_median_s["compute"])
    assert ran == pytest.approx(costs, rel=1e-6)
    g.sim_seconds = lambda n: n * 2e-12  # a function of the chunk's bytes: its own kernel time
    _, rep = rf.stream_map_report(g, x, device=dev, chunk_bytes=1 << 20, host=host)
    assert rep.stage_median_s["compute"] == pytest.approx((1 << 20) * 2e-12, rel=1e-6)


_FORK_WARM_STAGED = textwrap.dedent("""
    import gc, os, signal, sys, warnings
    import numpy as np
    import ringflow as rf

    def f(a, b):
        b[...] = a * 2

    x = np.arange(1 << 12, dtype=np.float32)
    d = rf.device("sim")
    for host in ("stage", "register"):  # a scheduled engine and a direct one parked
        rf.stream_map(f, x, device=d, chunk_bytes=1 << 10, host=host)
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gc.collect()  # the parent's engines, forgotten, close nothing of the parent's
            y = rf.stream_map(f, x, device=rf.device("sim"), chunk_bytes=1 << 10, host="stage")
            gc.collect()
        sys.stdout.write(f"own device: {bool((y == x * 2).all())}\\n")
        sys.stdout.write(f"warnings: {[str(w.message) for w in caught]}\\n")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert (rf.stream_map(f, x, device=d, chunk_bytes=1 << 10, host="stage") == x * 2).all()
    print("child status", status)
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
def test_a_forked_child_forgets_the_parents_parked_engines_of_either_kind_touching_nothing():
    """The cache holds engines, not pipelines: the child's fork hook asked each parked engine for
    a method only a Pipeline has, failed on the first (an ignored AttributeError), and left the
    parent's pipelines to the child's collector, which closed the parent's workers, rings and
    streams from the child (a warning each). Every parked engine, scheduled or direct, is
    forgotten, and the child says nothing."""
    run = subprocess.run([sys.executable, "-c", _FORK_WARM_STAGED], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONWARNINGS": "ignore::DeprecationWarning"})
    out = run.stdout
    assert run.returncode == 0, run.stderr[-2000:]
    assert "child status 0" in out, out + run.stderr[-2000:]
    assert "own device: True" in out and "warnings: []" in out, out
    assert "Exception ignored" not in run.stderr and "Warning" not in run.stderr, run.stderr[-2000:]


# the functions dropping the warm engines runs through: the cache's own, and with them each
# engine's close (swept at points spread over it)
_DROP_NAMES = ("drop_warm_pipelines", "drop", "_close")
_CLOSE_NAMES = _DROP_NAMES + ("close", "close_quietly", "free_quietly", "settle", "_shut")


@pytest.mark.parametrize("names, files, points", [(_DROP_NAMES, "/ringflow/_pipeline/warm.py", None),
                                                  (_CLOSE_NAMES, "/ringflow/", 24)], ids=["cache", "closes"])
def test_ctrl_c_anywhere_in_dropping_the_warm_engines_closes_each_or_leaves_it_parked(names, files, points):
    """A Ctrl-C after the cache had let go of its engines and before each was closed left them to
    the garbage collector (their streams and device rings collected unclosed, their pipelines'
    finalisers closing the rest). Dropping is shielded: a Ctrl-C is raised once every engine
    taken out is closed, and those not taken out stay parked for the next drop."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("sends SIGINT to the main thread under Python's default handler")
    dev = rf.device("sim", seed=4, checked=True)
    x = fresh(1 << 12, 4)

    def park_two():  # a scheduled engine and a direct one
        for host in ("stage", "register"):
            np.testing.assert_array_equal(rf.stream_map(f, x, device=dev, chunk_bytes=1 << 11, host=host), x * 2 + 1)

    park_two()
    with InterruptAt(10 ** 9, names, files=(files,), sigint=True) as counting:
        assert rf.drop_warm_pipelines() == 2
    assert counting.seen > 20, counting.seen
    sweep = range(counting.seen) if points is None else np.linspace(0, counting.seen - 1, points).astype(int)
    for n in map(int, sweep):
        park_two()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with InterruptAt(n, names, files=(files,), sigint=True) as at:
                with pytest.raises(KeyboardInterrupt):
                    rf.drop_warm_pipelines()
            assert at.fired == 1, n
            rf.drop_warm_pipelines()  # what the interrupted drop left parked
            assert dev.live().total == 0, (n, dev.live())  # no collection in between
            gc.collect()
            assert not any(dev.collected_unclosed().values()), (n, at.functions[n], dev.collected_unclosed())
        assert not [str(w.message) for w in seen], n


def test_dropping_a_named_devices_engines_also_drops_those_of_the_device_it_named_before(monkeypatch):
    """"sim:N" names a new device once the one it named is closed: dropping the warm engines of
    "sim:N" then matched the new device only, and the engines parked on the closed one stayed
    cached (with their rings' memory and the closed device) until evicted. Engines of a closed
    device serve no call, and a drop discards them whatever it names (closing a device drops its
    engines itself; here it does not, so that the drop's own check is what drops them)."""
    no_close_callbacks(monkeypatch)
    with named_sims(48) as (old,):
        rf.stream_map(f, fresh(1 << 12, 1), device=old, chunk_bytes=1 << 11, host="stage")
        assert len(warm.WARM) == 1
    gone = weakref.ref(old)
    del old
    with named_sims(48) as (new,):
        replaced = gone() is not None and gone() is not new  # (no assert's temporaries hold the old one)
        assert replaced  # "sim:48" names another device now
        assert rf.drop_warm_pipelines("sim:48") == 1 and len(warm.WARM) == 0
    gc.collect()
    assert gone() is None  # nothing of the closed device is kept


def test_closing_a_device_drops_its_warm_engines_at_once():
    """``dev.close()`` closes the engines kept warm for ``dev`` and takes them out of the cache
    then, not at the next lookup; another device's engines stay."""
    x = fresh(4096, 0)
    dev, other = rf.device("sim"), rf.device("sim")
    with collector_off():
        _, pipe = run(x, dev, chunk_bytes=1024)
        _, kept = run(x, other, chunk_bytes=1024)
        assert len(warm.WARM) == 2 and not pipe._closed
        ref = weakref.ref(pipe)
        del pipe
        dev.close()
        assert len(warm.WARM) == 1 and ref() is None  # gone from the cache, and freed, at once
        assert not kept._closed and rf.drop_warm_pipelines(other) == 1


def test_closing_a_device_twice_drops_its_engines_once_and_raises_nothing():
    x = fresh(4096, 0)
    dev = rf.device("sim")
    _, pipe = run(x, dev, chunk_bytes=1024)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dev.close()
        dev.close()
    assert len(warm.WARM) == 0 and pipe._closed


def test_closing_a_device_from_inside_a_stage_neither_hangs_nor_leaves_engines():
    """A compute that closes its own device while the call runs: the call ends (with the device's
    error, or done), bounded in real time, and no engine of the device is left kept."""
    x = fresh(4096, 0)
    dev = rf.device("sim")
    run(x, dev, chunk_bytes=2048)  # an engine kept warm for the device before
    calls = []

    def closing(a, b):
        calls.append(1)
        if len(calls) == 2:
            dev.close()
        b[:] = a * 2 + 1

    def call():
        try:
            rf.stream_map(closing, x, device=dev, chunk_bytes=1024)
        except (rf.DeviceError, rf.StageError, RuntimeError) as exc:
            return exc
        return None

    (outcome,) = join([start(call)])
    assert dev.closed and len(warm.WARM) == 0, outcome


def test_closing_a_device_from_another_thread_while_a_call_runs_on_it():
    """``dev.close()`` on one thread while a stream_map runs on ``dev`` on another: neither hangs
    (bounded in real time), and no engine of the device is kept once both are done."""
    x = fresh(1 << 16, 0)
    dev = rf.device("sim", chaos=True, seed=4)
    run(x, dev, chunk_bytes=4096)  # an engine kept warm for the device before
    started = threading.Event()

    def slow(a, b):
        started.set()
        b[:] = a * 2 + 1

    def call():
        try:
            return rf.stream_map(slow, x, device=dev, chunk_bytes=1024)
        except (rf.DeviceError, rf.StageError, RuntimeError) as exc:
            return exc

    runner = start(call)
    assert started.wait(JOIN_S)
    closer = start(dev.close)
    join([runner, closer])
    assert dev.closed and len(warm.WARM) == 0


def test_a_named_sim_device_closed_drops_its_engines_and_the_name_makes_a_new_one():
    x = fresh(4096, 0)
    with named_sims(5) as (dev,):
        run(x, "sim:5", chunk_bytes=1024)
        assert len(warm.WARM) == 1
        dev.close()
        assert len(warm.WARM) == 0
        again = rf.device("sim:5")
        assert again is not dev and not again.closed
        y, pipe = run(x, "sim:5", chunk_bytes=1024)
        assert np.array_equal(y, x * 2 + 1) and pipe.device is again and len(warm.WARM) == 1
        again.close()
        assert len(warm.WARM) == 0


class Model:
    """A compute that is a method of an object holding state (a model and its weights)."""

    def __init__(self, k):
        self.k = np.float32(k)

    def step(self, x, y):
        np.multiply(x, self.k, out=y)

    __call__ = step


@pytest.mark.parametrize("host,engine", [("stage", "auto"), ("register", "auto"), ("register", "pipeline")],
                         ids=["scheduled-staged", "direct", "scheduled-registered"])
def test_a_parked_engine_keeps_no_compute_alive_and_is_closed_once_its_compute_is_collected(host, engine):
    """A warm engine holds its compute only while a call runs: after a call of model.step, or of
    a callable object, dropping the caller's last reference collects the model though its engine
    is parked; that engine is closed at the cache's next use, its device resources released. A
    compute kept alive keeps its engine warm call after call, every result right."""
    dev = rf.device("sim")
    x = fresh(1 << 14, 0)
    kw = dict(device=dev, host=host, engine=engine, chunk_bytes=1 << 12)
    model = Model(2)
    collected = weakref.ref(model)
    seen = []
    with engines(on=seen.append):
        assert np.array_equal(rf.stream_map(model.step, x, **kw), x * 2)
        assert np.array_equal(rf.stream_map(model.step, x, **kw), x * 2)
    assert seen[0] is seen[1] and len(warm.WARM) == 1  # the second call took the parked engine
    del model
    gc.collect()
    assert collected() is None, "the parked engine kept the compute alive"
    held = dev.live().total
    assert held > 0  # the dead compute's engine is parked until the cache is next used
    other = Model(3)
    assert np.array_equal(rf.stream_map(other.step, x, **kw), x * 3)
    assert len(warm.WARM) == 1  # other's engine alone: the dead compute's was closed
    assert rf.drop_warm_pipelines(dev) == 1 and dev.live().total == 0
    for kind in ("method", "callable object", "ufunc"):  # a ufunc cannot be weakly referenced
        compute = np.negative if kind == "ufunc" else Model(4)
        ref = None if kind == "ufunc" else weakref.ref(compute)
        fn = compute.step if kind == "method" else compute
        assert np.array_equal(rf.stream_map(fn, x, **kw), -x if kind == "ufunc" else x * 4)
        del fn, compute
        gc.collect()
        assert ref is None or ref() is None, kind
    assert len(warm.WARM) == 1  # the ufunc's engine is kept (and keeps it); the collected model's is closed
    assert np.array_equal(rf.stream_map(np.negative, x, **kw), -x) and len(warm.WARM) == 1
    rf.drop_warm_pipelines(dev)
    assert dev.live().total == 0


@pytest.mark.gpu
def test_on_a_gpu_a_parked_engine_lets_a_models_device_memory_go(cuda_device):
    """A model whose weights live on the GPU: after its method ran through stream_map (kept
    warm), dropping the model frees its 64 MiB of device memory (CuPy's pool no longer counts it
    used), and the next call closes the dead model's engine."""
    import cupy

    class Weights:
        def __init__(self):
            self.w = cupy.full(16 << 20, 2, dtype=cupy.float32)

        def step(self, x, y):
            cupy.multiply(x, self.w[:x.size], out=y)

    pool = cupy.get_default_memory_pool()
    x = fresh(1 << 20, 0)
    model = Weights()
    ref, held = weakref.ref(model), pool.used_bytes()
    for _ in range(2):
        assert np.array_equal(rf.stream_map(model.step, x, device=cuda_device, chunk_bytes=1 << 20), x * 2)
    assert len(warm.WARM) == 1
    del model
    gc.collect()
    assert ref() is None and pool.used_bytes() <= held - (64 << 20)
    assert np.array_equal(rf.stream_map(f, x, device=cuda_device, chunk_bytes=1 << 20), x * 2 + 1)
    assert len(warm.WARM) == 1
    rf.drop_warm_pipelines(cuda_device)


@pytest.mark.parametrize("seed", range(3))
def test_threads_whose_computes_are_collected_between_calls_get_their_own_results_and_leak_nothing(seed):
    """Four threads on one device, each calling stream_map with the method of a new model every
    time (so computes are collected while their engines are parked, often with a new model at a
    freed one's address, and the collector runs on any thread): every result is its own
    model's, the cache never holds more than its capacity, and once it is dropped nothing of
    the device is live."""
    dev = rf.device("sim", seed=seed, chaos=True)

    def worker(t):
        rng = np.random.default_rng(seed * 10 + t)
        for i in range(12):
            x = rng.uniform(0.5, 1.5, 2048).astype(np.float32)
            k = 1 + (t * 12 + i) % 5
            y = rf.stream_map(Model(k).step, x, device=dev, chunk_bytes=2048, host=("stage", "register")[i % 2])
            np.testing.assert_array_equal(y, x * np.float32(k))
            if i % 3 == 0:
                gc.collect()
            assert len(warm.WARM) <= warm.WARM.capacity
        return True

    assert join([start(worker, t) for t in range(4)]) == [True] * 4
    gc.collect()
    rf.drop_warm_pipelines(dev)
    assert len(warm.WARM) == 0 and dev.live().total == 0


def test_a_call_that_finds_no_memory_even_with_nothing_kept_fails_naming_it_and_leaks_nothing():
    import dataclasses

    from ringflow import _plan as plan

    small = dataclasses.replace(plan.get_profile("h200-pcie5"), total_memory=96 << 10)
    dev = rf.device("sim", profile=small)
    x = fresh(1 << 14, 4)
    _, first = run(x, dev, chunk_bytes=16384, slots=2)
    hog = dev.allocate(32 << 10)  # the user's own: with the kept engine's rings, the device is full
    with pytest.raises(OutOfMemoryError, match="cannot allocate the device-(in|out) ring"):
        run(x, dev, chunk_bytes=16384, slots=4)
    assert is_closed(first) and len(warm.WARM) == 0  # closed to make room, which was not enough
    hog.close()
    live = dev.live()
    assert (live.device_buffers, live.host_buffers, live.streams) == (0, 0, 0)
    y, _ = run(x, dev, chunk_bytes=16384, slots=2)
    assert np.array_equal(y, x * 2 + 1)
