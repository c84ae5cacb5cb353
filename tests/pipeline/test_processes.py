"""``Pipeline(processes=True)``: prepare in worker processes writing into shared pinned slots."""

from __future__ import annotations

import glob
import os
import signal
import time

import numpy as np
import pytest

import ringflow as rf
from tests.helpers import process_prepare as pp


def f(x, y):
    y[...] = x * 2 + 1


@pytest.fixture
def dev():
    return rf.device("sim", chaos=True, seed=7, checked=True)


def shm_segments() -> set:
    return set(glob.glob("/dev/shm/psm_*"))


def test_results_are_exact_and_come_from_other_processes(dev):
    before = shm_segments()
    with rf.Pipeline(f, device=dev, chunk_bytes=4096, prepare=pp.ramp_and_pid, processes=True, workers=3,
                     checked=True) as pipe:
        out = list(pipe.map(range(60)))
    pids = set()
    for i, r in enumerate(out):
        pids.add(int((r[0] - 1) / 2))
        np.testing.assert_array_equal(r[1:], pp.ramp(i).astype(np.float64) * 2 + 1)
    assert os.getpid() not in pids and 1 <= len(pids) <= 3
    assert shm_segments() <= before  # the shared block is gone with the pipeline
    assert dev.live().total == 0


def test_a_failing_prepare_fails_its_chunk_with_the_workers_error(dev):
    with rf.Pipeline(f, device=dev, chunk_bytes=4096, prepare=pp.fails_on_7, processes=True, workers=2,
                     on_error="continue") as pipe:
        out = list(pipe.map(range(12)))
        failures = pipe.failures
    assert len(out) == 11
    assert len(failures) == 1 and failures[0].stage == "prepare" and failures[0].index == 7
    assert isinstance(failures[0].__cause__, ValueError) and "item 7 is broken" in str(failures[0].__cause__)


@pytest.mark.parametrize("prepare, error, match", [
    (pp.not_an_array, TypeError, "prepare's arrays (each array of a tuple, list or dict) must be numpy arrays"),
    (pp.not_anything, TypeError, "prepare must return a numpy array"),
    (pp.too_big, ValueError, "does not fit a slot of 4096 bytes"),
])
def test_what_a_worker_returns_is_checked_as_on_a_thread(dev, prepare, error, match):
    with rf.Pipeline(f, device=dev, chunk_bytes=4096, prepare=prepare, processes=True, workers=1) as pipe:
        with pytest.raises(rf.StageError) as info:
            pipe.submit(3).result()
    assert isinstance(info.value.__cause__, error) and match in str(info.value.__cause__)


def test_an_unpicklable_prepare_is_refused_at_construction(dev):
    with pytest.raises(TypeError, match="cannot be pickled"):
        rf.Pipeline(f, device=dev, chunk_bytes=4096, prepare=lambda i: np.ones(4), processes=True)


def test_processes_without_prepare_is_refused(dev):
    with pytest.raises(ValueError, match="processes=True runs prepare in worker processes: pass prepare="):
        rf.Pipeline(f, device=dev, chunk_bytes=4096, processes=True)


def test_cancel_and_close_stop_the_workers_and_free_the_block(dev):
    before = shm_segments()
    pipe = rf.Pipeline(f, device=dev, chunk_bytes=4096, prepare=pp.ramp, processes=True, workers=2)
    futs = [pipe.submit(i) for i in range(8)]
    pipe.cancel()
    pipe.close()
    assert all(fu.done() for fu in futs)
    assert shm_segments() <= before and dev.live().total == 0


def slow_prepare(item: int) -> np.ndarray:
    """1 ms of (simulated) CPU work per item."""
    from ringflow._device.sim.pool import charge

    charge(1e-3)
    return np.full(16, item, np.float32)


@pytest.mark.parametrize("workers", [2, 6])
def test_a_user_prepare_keeps_every_worker_busy(workers):
    """The model cannot know a prepare's cost: the host-in ring gets a slot per worker (and one
    for the copy in flight), so n items of 1 ms on W workers take about n / W ms."""
    dev = rf.device("sim", seed=1)
    with rf.Pipeline(f, device=dev, chunk_bytes=4096, prepare=slow_prepare, workers=workers) as pipe:
        assert pipe.config.slots.host_in >= workers + 1
        t0 = dev.now
        out = list(pipe.map(range(60)))
        wall = dev.now - t0
    assert [float(r[0]) for r in out] == [2.0 * i + 1 for i in range(60)]
    assert wall < 1.3 * 60e-3 / workers


def uneven_prepare(item: int) -> np.ndarray:
    """Simulated CPU work of 1 ms per item, 2 ms for every fourth: slow items among fast ones."""
    from ringflow._device.sim.pool import charge

    charge(2e-3 if item % 4 == 0 else 1e-3)
    return np.full(16, item, np.float32)


def test_a_slow_item_does_not_idle_the_other_workers():
    """Chunks go to the device in order, so a slow item holds back those after it: their host-in
    slots stay filled until it is through. With two host-in slots per worker the others go on
    preparing meanwhile and the stream takes about its CPU work over the workers; with a slot
    per worker and one more (the earlier default) they wait for slots."""
    workers, n = 4, 96
    cpu = sum(2e-3 if i % 4 == 0 else 1e-3 for i in range(n))

    def wall(slots=None):
        dev = rf.device("sim", seed=2)
        with rf.Pipeline(f, device=dev, chunk_bytes=4096, prepare=uneven_prepare, workers=workers,
                         slots=slots) as pipe:
            planned = pipe.config.slots
            t0 = dev.now
            out = list(pipe.map(range(n)))
            took = dev.now - t0
        assert [float(r[0]) for r in out] == [2.0 * i + 1 for i in range(n)]
        return took, planned

    took, planned = wall()
    assert planned.host_in == 2 * workers
    assert took < 1.05 * cpu / workers
    fewer, _ = wall(rf.SlotCounts(workers + 1, planned.device_in, planned.device_out, planned.host_out))
    assert fewer > 1.15 * took


def test_every_worker_process_starts_with_the_pipeline(dev):
    """A forkserver pool starts a process per task only while none is idle: without a start of
    its own, a pipeline's first items would be served by its first few workers while the rest
    came up. Every worker is started at construction, before any item."""
    from ringflow._pipeline.processes import ProcessPrepare

    prepare = ProcessPrepare(dev, pp.ramp, 1 << 16, 4096, 3)
    try:
        prepare.open()
        assert len(prepare._pool._processes) == 3
    finally:
        prepare.close()


def test_workers_that_fail_to_start_leave_nothing_registered(dev, monkeypatch):
    """The shared block was registered before the workers started; when they failed to start
    (a script without a __main__ guard, run again in the child), the registration stayed, and
    every later pipeline over that memory was refused."""
    import concurrent.futures

    real = concurrent.futures.ProcessPoolExecutor

    class Failing(real):
        def submit(self, *a, **k):
            raise RuntimeError("worker start failed")

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", Failing)
    before = shm_segments()
    with pytest.raises(RuntimeError, match="worker start failed"):
        rf.Pipeline(f, device=dev, chunk_bytes=4096, prepare=pp.ramp_and_pid, processes=True, workers=1)
    assert dev.live().total == 0, dev.live()
    assert shm_segments() <= before


def test_a_device_with_no_room_for_the_rings_starts_no_worker_and_pins_nothing(monkeypatch):
    """The device rings are allocated before anything is pinned (test_ring.py); the prepare
    processes' shared block was made, registered and its workers started before them, so a GPU
    without room for the rings cost a process pool's start and a registration first."""
    import concurrent.futures

    from tests.helpers import small_memory_device

    chunk = 64 << 10
    dev = small_memory_device(chunk)  # no room for two device-in slots
    registered, pools = [], []
    real_register, real_pool = dev.register_host, concurrent.futures.ProcessPoolExecutor

    class Counted(real_pool):
        def __init__(self, *a, **k):
            pools.append(1)
            super().__init__(*a, **k)

    monkeypatch.setattr(dev, "register_host", lambda a: registered.append(a.nbytes) or real_register(a))
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", Counted)
    before = shm_segments()
    with pytest.raises(rf.OutOfMemoryError, match="device-in ring"):
        rf.Pipeline(f, device=dev, chunk_bytes=chunk, prepare=pp.ramp, processes=True, workers=2,
                    slots=rf.SlotCounts(host_in=2, device_in=2, device_out=2, host_out=2))
    assert registered == [] and pools == []
    assert dev.live().total == 0, dev.live()
    assert shm_segments() <= before


@pytest.mark.parametrize("prepare, kind", [(pp.fails_on_5_unpicklably, "NeedsTwoArguments"),
                                           (pp.fails_on_5_with_a_lambda, "HoldsALambda")])
def test_an_error_that_cannot_leave_its_worker_fails_its_chunk_alone(dev, prepare, kind):
    # one that pickled but did not unpickle broke the process pool: every later item failed
    # with BrokenProcessPool; one that did not pickle came back as pickle's own AttributeError
    with rf.Pipeline(f, device=dev, chunk_bytes=4096, prepare=prepare, processes=True, workers=2,
                     on_error="continue") as pipe:
        out = list(pipe.map(range(12)))
        failures = pipe.failures
    assert len(out) == 11
    assert [(e.stage, e.index) for e in failures] == [("prepare", 5)]
    cause = failures[0].__cause__
    assert type(cause) is RuntimeError, repr(cause)
    assert str(cause).startswith(f"prepare raised {kind}: item 5 is broken (")
    assert "cannot be sent back from its worker process" in str(cause)
    assert dev.live().total == 0


def ignores_sigint(pid: int) -> bool:
    """Whether process ``pid`` ignores SIGINT (its SigIgn mask in /proc)."""
    with open(f"/proc/{pid}/status") as status:
        mask = next(line for line in status if line.startswith("SigIgn:")).split()[1]
    return bool(int(mask, 16) & (1 << (signal.SIGINT - 1)))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads signal masks from /proc")
def test_ctrl_c_is_the_pipelines_process_alone_to_handle(dev):
    """Ctrl-C at a terminal signals every process of the foreground group, the workers too: each
    printed a KeyboardInterrupt traceback and died, and every later item failed with
    BrokenProcessPool. The workers ignore it; the pipeline's process handles it (closing the
    pipeline ends them)."""
    with rf.Pipeline(f, device=dev, chunk_bytes=4096, prepare=pp.ramp, processes=True, workers=2) as pipe:
        (procs,) = pipe.scheduler._owned
        pids = list(procs._pool._processes)
        deadline = time.monotonic() + 10
        while not all(ignores_sigint(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.01)  # (each worker's initializer has yet to run)
        assert all(ignores_sigint(p) for p in pids)
        for pid in pids:
            os.kill(pid, signal.SIGINT)
        out = [pipe.submit(i).result(timeout=30) for i in range(8)]
    assert all(np.array_equal(r, pp.ramp(i) * 2 + 1) for i, r in enumerate(out))
    assert dev.live().total == 0
