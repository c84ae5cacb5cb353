"""``Pipeline(processes=True)``: prepare in worker processes writing into shared pinned slots."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types
import weakref

import numpy as np
import pytest

import ringflow as rf
from ringflow._pipeline.trees import flatten
from tests.helpers import process_prepare as pp
from tests.helpers.dtypes import holding_no_uint16
from tests.helpers.pipeline_checks import check_kept_slot_items
from tests.helpers import threads
from tests.helpers.collector import collector_off


def f(x, y):
    y[...] = x * 2 + 1


@pytest.fixture
def dev():
    return rf.device("sim", chaos=True, seed=7, checked=True)


class Segments:
    """The blocks of POSIX shared memory the prepare processes' pool made during one test, by
    name, recorded as each is created (other processes on the machine make blocks of their own,
    named alike: only these are this test's)."""

    def __init__(self):
        self.made: list = []

    def left(self) -> list:
        """The blocks made that still exist."""
        return [name for name in self.made if os.path.exists(os.path.join("/dev/shm", name.lstrip("/")))]


@pytest.fixture
def segments(monkeypatch):
    """A :class:`Segments` recording every block ringflow's prepare processes create in this test."""
    from ringflow._pipeline import processes

    recorded = Segments()
    real = processes.shared_memory.SharedMemory

    class Recorded(real):
        def __init__(self, name=None, create=False, size=0, **options):
            super().__init__(name, create, size, **options)
            if create:
                recorded.made.append(self.name)

    monkeypatch.setattr(processes, "shared_memory", types.SimpleNamespace(SharedMemory=Recorded))
    return recorded


def test_results_are_exact_and_come_from_other_processes(dev, segments):
    with rf.Pipeline(f, device=dev, chunk_bytes=4096, prepare=pp.ramp_and_pid, processes=True, workers=3,
                     checked=True) as pipe:
        out = list(pipe.map(range(60)))
    pids = set()
    for i, r in enumerate(out):
        pids.add(int((r[0] - 1) / 2))
        np.testing.assert_array_equal(r[1:], pp.ramp(i).astype(np.float64) * 2 + 1)
    assert os.getpid() not in pids and 1 <= len(pids) <= 3
    assert segments.made and segments.left() == []  # the shared block is gone with the pipeline
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


@pytest.mark.parametrize("prepare", [pp.uint16_on_3, pp.uint16_leaf_on_3])
def test_what_a_worker_returns_is_asked_of_the_device(dev, prepare):
    """The device's own narrowing of the dtype rule (its array type may hold fewer) checks a
    worker's arrays as it checks a thread's, in the prepare stage."""
    dev = holding_no_uint16(dev)

    def each_leaf(x, y):
        for a, b in zip(flatten(x)[0], flatten(y)[0]):
            f(a, b)

    with rf.Pipeline(each_leaf, device=dev, chunk_bytes=4096, prepare=prepare, processes=True, workers=1,
                     on_error="continue") as pipe:
        with pytest.raises(rf.StageError) as info:
            pipe.submit(3).result()
        assert pipe.submit(2).result() is not None
    assert info.value.stage == "prepare"
    assert isinstance(info.value.__cause__, TypeError)
    assert "dtype uint16 is not held by this device's arrays" in str(info.value.__cause__)


def test_an_unpicklable_prepare_is_refused_at_construction(dev):
    with pytest.raises(TypeError, match="cannot be pickled"):
        rf.Pipeline(f, device=dev, chunk_bytes=4096, prepare=lambda i: np.ones(4), processes=True)


def test_processes_without_prepare_is_refused(dev):
    with pytest.raises(ValueError, match="processes=True runs prepare in worker processes: pass prepare="):
        rf.Pipeline(f, device=dev, chunk_bytes=4096, processes=True)


def test_cancel_and_close_stop_the_workers_and_free_the_block(dev, segments):
    pipe = rf.Pipeline(f, device=dev, chunk_bytes=4096, prepare=pp.ramp, processes=True, workers=2)
    futs = [pipe.submit(i) for i in range(8)]
    pipe.cancel()
    pipe.close()
    assert all(fu.done() for fu in futs)
    assert segments.made and segments.left() == [] and dev.live().total == 0


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
    """Started at their first items, a pipeline's first items would be served by its first few
    workers while the rest came up. Every worker is started at construction, before any item."""
    from ringflow._pipeline.processes import ProcessPrepare

    prepare = ProcessPrepare(dev, pp.ramp, 1 << 16, 4096, 3)
    try:
        prepare.open()
        assert len(prepare.pids()) == 3 and not any(gone(p) for p in prepare.pids())
    finally:
        prepare.close()


def test_workers_that_fail_to_start_leave_nothing_registered(dev, monkeypatch, segments):
    """The shared block was registered before the workers started; when they failed to start
    (a script without a __main__ guard, run again in the child), the registration stayed, and
    every later pipeline over that memory was refused. The workers started before the one that
    failed are ended too."""
    from ringflow._pipeline import processes

    real, started = processes._Worker, []

    class Failing(real):
        def __init__(self, *a):
            if started:
                raise RuntimeError("worker start failed")
            super().__init__(*a)
            started.append(self.pid)

    monkeypatch.setattr(processes, "_Worker", Failing)
    with pytest.raises(RuntimeError, match="worker start failed"):
        rf.Pipeline(f, device=dev, chunk_bytes=4096, prepare=pp.ramp_and_pid, processes=True, workers=2)
    assert len(started) == 1 and gone(started[0])
    assert dev.live().total == 0, dev.live()
    assert segments.made and segments.left() == []


def test_a_block_shared_memory_has_no_room_for_is_refused_at_construction(dev, monkeypatch, segments):
    """/dev/shm (a tmpfs: 64 MiB in a Docker container unless --shm-size says more) made a
    block larger than its free space without a word (its pages are taken as written); a
    worker's write past that space then died of SIGBUS, failing its item as a crash, and a
    device registering the block as pinned memory faults every page in, in the pipeline's own
    process. The block's pages are taken as it is made: no room is refused then, saying how
    many bytes were asked for and what to change, and nothing is left behind."""
    import errno

    from ringflow._pipeline import processes

    asked, pools = [], []
    real_worker = processes._Worker

    def no_room(fd, offset, length):
        asked.append(length)
        raise OSError(errno.ENOSPC, "No space left on device")

    class Counted(real_worker):
        def __init__(self, *a):
            pools.append(1)
            super().__init__(*a)

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    monkeypatch.setattr(processes, "_Worker", Counted)
    with pytest.raises(OSError, match="shared memory") as caught:
        rf.Pipeline(f, device=dev, chunk_bytes=4096, prepare=pp.ramp, processes=True, workers=2,
                    slots=rf.SlotCounts(host_in=3, device_in=2, device_out=2, host_out=2))
    assert caught.value.errno == errno.ENOSPC
    message = str(caught.value)
    assert asked == [3 * 4096] and f"{3 * 4096} bytes" in message, message
    assert "chunk_bytes" in message and "slots" in message and "--shm-size" in message, message
    assert pools == []
    assert dev.live().total == 0, dev.live()
    assert segments.made and segments.left() == []


def test_a_device_with_no_room_for_the_rings_starts_no_worker_and_pins_nothing(monkeypatch, segments):
    """The device rings are allocated before anything is pinned (test_ring.py); the prepare
    processes' shared block was made, registered and its workers started before them, so a GPU
    without room for the rings cost a process pool's start and a registration first."""
    from ringflow._pipeline import processes
    from tests.helpers import small_memory_device

    chunk = 64 << 10
    dev = small_memory_device(chunk)  # no room for two device-in slots
    registered, pools = [], []
    real_register, real_worker = dev.register_host, processes._Worker

    class Counted(real_worker):
        def __init__(self, *a):
            pools.append(1)
            super().__init__(*a)

    monkeypatch.setattr(dev, "register_host", lambda a: registered.append(a.nbytes) or real_register(a))
    monkeypatch.setattr(processes, "_Worker", Counted)
    with pytest.raises(rf.OutOfMemoryError, match="device-in ring"):
        rf.Pipeline(f, device=dev, chunk_bytes=chunk, prepare=pp.ramp, processes=True, workers=2,
                    slots=rf.SlotCounts(host_in=2, device_in=2, device_out=2, host_out=2))
    assert registered == [] and pools == []
    assert dev.live().total == 0, dev.live()
    assert segments.made == []  # (made after the device rings)


def _item_5_fails_alone(dev, prepare, n: int, cause_type: type) -> BaseException:
    """``range(n)`` mapped through a two-worker pipeline (``on_error="continue"``) whose
    ``prepare`` fails item 5: the cause of that failure, of ``cause_type``, once every other item
    was handed out and it alone failed."""
    with rf.Pipeline(f, device=dev, chunk_bytes=4096, prepare=prepare, processes=True, workers=2,
                     on_error="continue") as pipe:
        out = list(pipe.map(range(n)))
        failures = pipe.failures
    assert len(out) == n - 1
    assert [(e.stage, e.index) for e in failures] == [("prepare", 5)]
    cause = failures[0].__cause__
    assert type(cause) is cause_type, repr(cause)
    return cause


@pytest.mark.parametrize("prepare, kind", [(pp.fails_on_5_unpicklably, "NeedsTwoArguments"),
                                           (pp.fails_on_5_with_a_lambda, "HoldsALambda")])
def test_an_error_that_cannot_leave_its_worker_fails_its_chunk_alone(dev, prepare, kind):
    # one that pickled but did not unpickle broke the process pool: every later item failed
    # with BrokenProcessPool; one that did not pickle came back as pickle's own AttributeError
    cause = _item_5_fails_alone(dev, prepare, 12, RuntimeError)
    assert str(cause).startswith(f"prepare raised {kind}: item 5 is broken (")
    assert "cannot be sent back from its worker process" in str(cause)
    assert dev.live().total == 0


def test_an_error_that_comes_back_as_no_exception_fails_its_chunk_alone_saying_so(dev):
    """An exception whose pickle rebuilds something else (an int) came back from its worker as
    that, and the item failed with ringflow's own AttributeError ('int' object has no attribute
    '__cause__'). It fails saying what came back; the worker's traceback is its cause."""
    cause = _item_5_fails_alone(dev, pp.fails_on_5_rebuilt_as_an_int, 8, TypeError)
    assert "came back from its worker process as int" in str(cause), str(cause)
    assert "RebuiltAsAnInt: item 5 is broken" in str(cause.__cause__), repr(cause.__cause__)
    assert dev.live().total == 0


def test_an_item_that_cannot_reach_its_worker_fails_alone_saying_so(dev):
    """An item that pickled but did not unpickle in its worker ended that worker: its
    traceback was printed, the item failed as if the worker had crashed ("died (exit code 1)
    ... a crash in native code, os._exit, or a signal"), and a new worker was started. One
    that did not pickle failed with pickle's own words alone. Each fails saying that
    processes=True sends items to worker processes; the worker serves the next items."""
    with rf.Pipeline(f, device=dev, chunk_bytes=4096, prepare=pp.ramp_of_n, processes=True, workers=1,
                     on_error="continue") as pipe:
        pids = pipe._procs.pids()
        futs = [pipe.submit(i) for i in (1, 2)]
        futs.append(pipe.submit(pp.ArrivesBroken(3, "broken")))
        futs.append(pipe.submit(threading.Lock()))  # (cannot be pickled)
        futs += [pipe.submit(i) for i in (5, 6)]
        outcomes = [fu.exception(timeout=30) for fu in futs]
        failures = pipe.failures
        assert pipe._procs.pids() == pids  # nothing ended its worker
    assert [i for i, o in enumerate(outcomes) if o is not None] == [2, 3]
    assert [(e.stage, e.index) for e in failures] == [("prepare", 2), ("prepare", 3)]
    unpickled, pickled = (e.__cause__ for e in failures)
    assert type(unpickled) is TypeError and type(pickled) is TypeError, (repr(unpickled), repr(pickled))
    assert "could not be unpickled in its worker process" in str(unpickled), str(unpickled)
    assert "missing 1 required positional argument" in str(unpickled), str(unpickled)
    assert "died" not in str(unpickled)
    assert "processes=True sends each item to a worker process" in str(pickled), str(pickled)
    assert "cannot be pickled" in str(pickled) and "lock" in str(pickled), str(pickled)
    for i, n in ((0, 1), (1, 2), (4, 5), (5, 6)):
        assert np.array_equal(futs[i].result(), pp.ramp(n) * 2 + 1)
    assert dev.live().total == 0


def test_an_array_in_another_items_slot_fails_its_item_instead_of_sending_that_items_data(dev):
    """A prepare returned an array from an earlier prepare's empty_slot, kept past its return:
    it lies in the shared block, in the slot of whatever item that slot holds now, and was
    copied from there: the item came back with another item's data, and no one was told.
    Such an item fails saying why; one that lands in that same slot again is its own data."""
    with rf.Pipeline(f, device=dev, chunk_bytes=4096, prepare=pp.keeps_its_first_slot, processes=True,
                     workers=1, on_error="continue") as pipe:
        check_kept_slot_items(pipe, 16, lambda i, y: np.testing.assert_array_equal(
            y, np.full(8, 2 * i + 1, np.float32), err_msg=str(i)))
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
        procs = pipe.scheduler._procs
        pids = procs.pids()
        deadline = time.monotonic() + 10
        while not all(ignores_sigint(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.01)  # (each worker's initializer has yet to run)
        assert all(ignores_sigint(p) for p in pids)
        for pid in pids:
            os.kill(pid, signal.SIGINT)
        out = [pipe.submit(i).result(timeout=30) for i in range(8)]
    assert all(np.array_equal(r, pp.ramp(i) * 2 + 1) for i, r in enumerate(out))
    assert dev.live().total == 0


# -- a prepare that never returns, a worker that dies ----------------------------------------------

def gone(pid: int) -> bool:
    """Whether process ``pid`` has ended and been reaped (no /proc entry, not even a zombie's)."""
    return not os.path.exists(f"/proc/{pid}")


def stuck_item(tmp_path) -> tuple:
    """An item for :func:`pp.reports_then_waits` that never returns, and the FIFO it reports on."""
    ready = pp.Fifo(tmp_path, "ready")
    return (0, ready.path, None), ready


def awaited(fut):
    """A thread waiting on ``fut`` (the simulated GPU advances only while someone waits)."""
    def wait():
        try:
            return fut.exception(timeout=30)
        except concurrent.futures.CancelledError as err:
            return err

    return threads.start(wait)


def test_cancel_stops_a_prepare_that_never_returns_by_killing_its_worker(dev, tmp_path, segments):
    """cancel() waited for the running prepare, for ever. With processes=True it kills the
    worker running it: the chunk ends CANCELLED, the worker is reaped, the block is freed."""
    item, ready = stuck_item(tmp_path)
    pipe = rf.Pipeline(f, device=dev, chunk_bytes=4096, prepare=pp.reports_then_waits, processes=True, workers=2)
    pid = None
    try:
        first = pipe.submit(1)
        assert np.array_equal(first.result(timeout=30), pp.ramp(1) * 2 + 1)
        stuck = pipe.submit(item)
        waiter = awaited(stuck)
        pid = int(ready.read_line())  # its prepare is running in that worker now
        threads.join([threads.start(pipe.cancel), waiter], timeout=10)
        assert stuck.cancelled()
        s = pipe.stats()
        assert (s.delivered, s.cancelled, s.in_flight) == (1, 1, 0)
        threads.join([threads.start(pipe.close)], timeout=10)
    finally:
        if pid is not None and not gone(pid):
            os.kill(pid, signal.SIGKILL)  # (the test failed: let the run go on)
    assert gone(pid)
    assert segments.made and segments.left() == [] and dev.live().total == 0


def test_ctrl_c_leaving_a_with_block_stops_a_running_prepare(dev, tmp_path, segments):
    """Ctrl-C (or any error) in the caller, on the main thread, while a prepare runs in a
    worker: leaving the with block cancels, which kills the worker running it, and the
    KeyboardInterrupt goes on up. (A watchdog kills that worker after a while, so that a
    regression fails here instead of hanging: it must not have fired.)"""
    item, ready = stuck_item(tmp_path)
    pid, fired = [], []

    def watchdog():
        if pid and not gone(pid[0]):
            fired.append(pid[0])
            os.kill(pid[0], signal.SIGKILL)

    timer = threading.Timer(10, watchdog)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            with rf.Pipeline(f, device=dev, chunk_bytes=4096, prepare=pp.reports_then_waits, processes=True,
                             workers=2) as pipe:
                futs = [pipe.submit(item), pipe.submit(2)]
                waiter = awaited(futs[0])
                pid.append(int(ready.read_line()))
                raise KeyboardInterrupt
    finally:
        timer.cancel()
    assert not fired
    threads.join([waiter], timeout=10)
    assert gone(pid[0])
    assert futs[0].cancelled() and all(fu.done() for fu in futs)
    assert segments.made and segments.left() == [] and dev.live().total == 0


@pytest.mark.parametrize("prepare, death", [(pp.dies_on_3, "exit code 7"),
                                            (pp.segfaults_on_3, "signal 11 (SIGSEGV)"),
                                            (pp.killed_on_3, "signal 9 (SIGKILL)")])
def test_a_worker_that_dies_fails_its_item_alone_and_is_replaced(dev, prepare, death, segments):
    """One worker that died broke the whole process pool: its item and every later one failed
    with BrokenProcessPool. Its item fails saying so; a new worker serves the later items."""
    with rf.Pipeline(f, device=dev, chunk_bytes=4096, prepare=prepare, processes=True, workers=2,
                     on_error="continue") as pipe:
        futs = [pipe.submit(i) for i in range(10)]
        outcomes = [fu.exception(timeout=30) for fu in futs]
        failures = pipe.failures
    assert [i for i, o in enumerate(outcomes) if o is not None] == [3]
    assert [(e.stage, e.index) for e in failures] == [("prepare", 3)]
    cause = failures[0].__cause__
    assert type(cause) is RuntimeError, repr(cause)
    assert "worker process" in str(cause) and "died" in str(cause) and death in str(cause), str(cause)
    for i in (0, 1, 2, 4, 9):
        assert np.array_equal(futs[i].result(), pp.ramp(i) * 2 + 1)
    s = pipe.stats()
    assert (s.accepted, s.delivered, s.failed, s.in_flight) == (10, 9, 1, 0)
    assert segments.made and segments.left() == [] and dev.live().total == 0


def test_a_worker_that_dies_leaves_the_item_running_in_another_alone(dev, tmp_path):
    """A worker died while another was preparing an item: in a process pool both failed (the
    pool broke, failing every task running or queued in it). Each worker has its own pipe: the
    other item comes back whole, and a new worker takes the dead one's place."""
    from ringflow._pipeline.processes import ProcessPrepare

    ready, go = pp.Fifo(tmp_path, "ready"), pp.Fifo(tmp_path, "go")
    procs = ProcessPrepare(dev, pp.dies_or_waits, 3 * 4096, 4096, 2)
    try:
        procs.open()
        slots = [np.ndarray((4096,), np.uint8, buffer=procs._shm.buf, offset=k * 4096) for k in range(3)]
        waiting = threads.start(procs, (6, ready.path, go.path), slots[0])
        waiting_pid = int(ready.read_line())  # that item is in its worker now
        with pytest.raises(RuntimeError, match=r"worker process .* died \(exit code 7\)"):
            procs("die", slots[1])
        go.write_line()
        shape, dtype = threads.join([waiting])[0]
        assert np.array_equal(slots[0][:dtype.itemsize * shape[0]].view(dtype), pp.ramp(6))
        shape, dtype = procs(9, slots[2])  # served by the worker started in the dead one's place
        assert np.array_equal(slots[2][:dtype.itemsize * shape[0]].view(dtype), pp.ramp(9))
        pids = procs.pids()
        assert len(pids) == 2 and waiting_pid in pids
        del slots
    finally:
        procs.close()
    assert all(gone(p) for p in pids)


# -- fork() in the pipeline's process ---------------------------------------------------------------

_FORKED_CHILD_EXITS = textwrap.dedent("""
    import os, sys, threading
    import numpy as np
    import ringflow as rf
    from tests.helpers import process_prepare as pp
    import pathlib

    def f(x, y):
        y[...] = x * 2 + 1

    folder = pathlib.Path(sys.argv[1])
    ready, go = pp.Fifo(folder, "ready"), pp.Fifo(folder, "go")
    pipe = rf.Pipeline(f, device=rf.device("sim"), chunk_bytes=4096, prepare=pp.reports_then_waits,
                       processes=True, workers=2)
    fut = pipe.submit((5, ready.path, go.path))
    waiter = threading.Thread(target=fut.exception, args=(60,), daemon=True)
    waiter.start()
    pid = int(ready.read_line())  # its prepare runs in that worker now
    child = os.fork()
    if child == 0:
        sys.exit(0)  # a child that ends as a script does: at-exit handlers and finalizers run
    _, status = os.waitpid(child, 0)
    print("child status", status)
    with open(f"/proc/{pid}/stat") as stat:
        print("worker state", stat.read().split()[2])
    go.write_line()
    print("result", fut.result(timeout=60).tolist() == (pp.ramp(5) * 2 + 1).tolist())
    pipe.close()
    print("parent ok")
""")


@pytest.mark.skipif(not hasattr(os, "fork") or not os.path.exists("/proc/self/stat"), reason="fork() and /proc")
def test_a_forked_child_that_exits_leaves_the_parents_workers_alone(tmp_path):
    """A child forked from the pipeline's process that ended normally ran the pipeline's finalizer
    and the pool's at-exit hook there: they killed the parent's worker running a prepare (the
    parent's item failed, its worker died 'killed by signal 9'), and multiprocessing printed an
    AssertionError traceback ('can only join a child process') as the child joined them."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.path.join(root, "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", _FORKED_CHILD_EXITS, str(tmp_path)], capture_output=True,
                         text=True, timeout=120, cwd=root, env=env)
    out = run.stdout
    assert run.returncode == 0, out + run.stderr[-3000:]
    assert "child status 0" in out and "worker state S" in out, out + run.stderr[-3000:]
    assert "result True" in out and "parent ok" in out, out + run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]


# -- the pipeline's process killed ----------------------------------------------------------------

_KILLED_WITH_BUSY_WORKERS = textwrap.dedent("""
    import json, os, pathlib, sys, threading, time
    from multiprocessing import forkserver, resource_tracker
    import ringflow as rf
    from tests.helpers import process_prepare as pp

    def f(x, y):
        y[...] = x * 2 + 1

    folder = pathlib.Path(sys.argv[1])
    pipes = []
    # a pipeline for each (a prepare on the simulated GPU runs in the device's lock): in each, one
    # worker busy for good and one idle
    for how in ("sleep", "spin"):
        pipe = rf.Pipeline(f, device=rf.device("sim"), chunk_bytes=4096, prepare=pp.reports_its_pid_then_hangs,
                           processes=True, workers=2)
        fut = pipe.submit((str(folder / "busy"), how))
        threading.Thread(target=fut.exception, daemon=True).start()  # (the simulated GPU moves while waited on)
        pipes.append(pipe)
    info = {"workers": [p for pipe in pipes for p in pipe.scheduler._procs.pids()],
            "forkserver": forkserver._forkserver._forkserver_pid, "tracker": resource_tracker._resource_tracker._pid,
            "blocks": [pipe.scheduler._procs._shm.name for pipe in pipes]}
    if sys.argv[2] == "fork":  # a child forked from this process, left running after it
        info["child"] = os.fork()
        if info["child"] == 0:
            time.sleep(600)  # until the test kills this process
            os._exit(0)
    (folder / "info.tmp").write_text(json.dumps(info))
    os.replace(folder / "info.tmp", folder / "info.json")
    time.sleep(600)  # until the test kills this process
""")


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and is no zombie (one that ended, not yet reaped, holds no
    memory and runs nothing; an orphan's is reaped by init, which in a container may never do it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def until(check, timeout: float) -> bool:
    """Whether ``check()`` came true within ``timeout`` real seconds (asked every 50 ms)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads processes from /proc")
def test_workers_end_when_the_pipelines_process_is_killed(tmp_path):
    """The pipeline's process killed by SIGKILL (no clean-up runs: the OOM killer, a job
    scheduler) left its workers running a prepare alive: they ran on, holding their memory, until
    the prepare returned (for ever, for one that never does). An idle worker ended (its pipe
    closed), but the forkserver and the resource tracker stayed as long as any worker did (each
    worker holds their pipes), and so did the shared block. Every worker ends at once, busy in a
    call that lets go of the GIL or in a Python loop, and the rest goes with them."""
    with killed_with_busy_workers(tmp_path, fork=False) as info:
        started = info["workers"] + [info["forkserver"], info["tracker"]]
        blocks = [os.path.join("/dev/shm", name.lstrip("/")) for name in info["blocks"]]
        assert until(lambda: not running_of(started), 20), (
            f"still running 20 s after the pipeline's process was killed: {running_of(started)} of workers "
            f"{info['workers']} (busy {info['busy']}), forkserver {info['forkserver']}, resource tracker "
            f"{info['tracker']}")
        assert until(lambda: not any(os.path.exists(b) for b in blocks), 10), blocks


@pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(os, "fork"), reason="fork() and /proc")
def test_workers_end_when_the_pipelines_process_is_killed_leaving_a_forked_child(tmp_path):
    """A child forked from the pipeline's process has a copy of each worker's lifeline: left
    running after the pipeline's process was killed, it kept every worker alive, busy or idle.
    It closes its copies as it is forked, so the workers end as they do without it (the child
    still holds multiprocessing's own pipes: the forkserver and the resource tracker wait for it)."""
    with killed_with_busy_workers(tmp_path, fork=True) as info:
        assert until(lambda: not running_of(info["workers"]), 20), (
            f"still running 20 s after the pipeline's process was killed: {running_of(info['workers'])} of workers "
            f"{info['workers']} (busy {info['busy']})")
        assert running(info["child"])


@pytest.mark.skipif(not hasattr(os, "register_at_fork"), reason="no fork() here")
def test_a_child_forked_while_a_worker_starts_closes_that_workers_lifeline(dev, monkeypatch, segments):
    """A fork on another thread while a worker was being started (its lifeline made, the worker
    not yet in its pool's list) left the child a copy of that worker's lifeline, which would
    keep the worker alive as long as the child once the pipeline's process was killed. Every
    lifeline's write end is closed in a forked child, a worker's still starting too."""
    import multiprocessing.context

    real_start = multiprocessing.context.ForkServerProcess.start
    closed_in_child = []

    def start(process):
        if not closed_in_child:
            fd = sys._getframe(1).f_locals["lifeline"].fileno()  # (_Worker.__init__'s write end)
            pid = os.fork()
            if pid == 0:  # the child: is its copy of that end closed?
                try:
                    os.fstat(fd)
                except OSError:
                    os._exit(0)
                os._exit(1)
            closed_in_child.append(os.waitpid(pid, 0)[1] == 0)
        return real_start(process)

    monkeypatch.setattr(multiprocessing.context.ForkServerProcess, "start", start)
    with rf.Pipeline(f, device=dev, chunk_bytes=4096, prepare=pp.ramp, processes=True, workers=1) as pipe:
        out = list(pipe.map(range(2)))
    assert all(np.array_equal(r, pp.ramp(i) * 2 + 1) for i, r in enumerate(out))
    assert closed_in_child == [True]


def running_of(pids: list) -> list:
    """Those of ``pids`` that are :func:`running`."""
    return [p for p in pids if running(p)]


@contextlib.contextmanager
def killed_with_busy_workers(tmp_path, fork: bool):
    """Runs :data:`_KILLED_WITH_BUSY_WORKERS` in a process of its own group, waits until both
    prepares run, SIGKILLs that process, and gives what it wrote (``busy``: the pids of the
    workers running a prepare), under ``info``; at the end kills every process of the group."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.path.join(root, "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    (tmp_path / "busy").mkdir()
    info_path = tmp_path / "info.json"
    with open(tmp_path / "out", "w") as out:
        parent = subprocess.Popen([sys.executable, "-c", _KILLED_WITH_BUSY_WORKERS, str(tmp_path),
                                   "fork" if fork else "-"], cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        ok = until(lambda: (info_path.exists() and len(os.listdir(tmp_path / "busy")) == 2) or parent.poll() is not None,
                   pp.HANG_S)
        assert ok and parent.poll() is None, (tmp_path / "out").read_text()[-3000:]
        info = json.loads(info_path.read_text())
        info["busy"] = sorted(int(name) for name in os.listdir(tmp_path / "busy"))
        assert len(info["workers"]) == 4 and set(info["busy"]) <= set(info["workers"]), info
        assert all(running(p) for p in info["workers"] + [info["forkserver"], info["tracker"]]), info
        parent.kill()  # (not reaped until the end: its pid, which names the test's process group, stays taken)
        yield info
    finally:
        # (the test failed: nothing of it outlives the run) every process it started is in the
        # group it made, named by the pid of its first process, not yet reaped, so no other
        # process can have that id: a pid in `info` may have been taken by another since
        try:
            os.killpg(parent.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        parent.kill()
        parent.wait(10)


def test_a_worker_started_as_cancel_stops_the_pool_is_stopped_too(dev, tmp_path, monkeypatch):
    """An item found its idle worker dead (killed from outside) and started another in its place
    while cancel() stopped the pool from another thread: stop_running() had listed the workers
    running a task before the new one was listed, so it was not killed, and the item's prepare
    ran in it to the end (for ever, for a prepare that never returns), cancel() waiting for it."""
    from ringflow._errors import PrepareStopped
    from ringflow._pipeline import processes

    item, _ready = stuck_item(tmp_path)
    procs = processes.ProcessPrepare(dev, pp.reports_then_waits, 4096, 4096, 1)
    real = processes._Worker

    class StartedAsCancelStops(real):
        def __init__(self, *a):
            procs.stop_running()  # (cancel() on another thread, between the item's check and this start)
            super().__init__(*a)

    try:
        procs.open()
        (idle,) = procs._idle
        idle.process.kill()
        idle.process.join(10)
        monkeypatch.setattr(processes, "_Worker", StartedAsCancelStops)
        slot = np.ndarray((4096,), np.uint8, buffer=procs._shm.buf)
        with pytest.raises(PrepareStopped):
            threads.join([threads.start(procs, item, slot)], timeout=10)
        del slot
        assert procs.pids() == []
    finally:
        for pid in procs.pids():
            os.kill(pid, signal.SIGKILL)  # (the test failed: let the run go on)
        procs.close()


def test_workers_that_end_as_they_start_fail_the_items_saying_so_and_are_not_restarted_for_ever(
        dev, monkeypatch, segments):
    """Workers that ended as they started (a script without a __main__ guard, run again in each)
    failed each item as a crash in prepare would ('died before prepare returned ... a crash in
    native code'), and a new worker was started for every item, each ending the same way. Now an
    item whose worker ended before it was ready says so, and once a few have in a row no more are
    started: every later item fails at once, saying why."""
    from ringflow._pipeline import processes

    real, started = processes._Worker, []

    class Counted(real):
        def __init__(self, *a):
            super().__init__(*a)
            started.append(self.pid)

    monkeypatch.setattr(processes, "_Worker", Counted)
    with rf.Pipeline(f, device=dev, chunk_bytes=4096, prepare=pp.EndsItsWorkerAsItStarts(), processes=True,
                     workers=2, on_error="continue") as pipe:
        outcomes = [fu.exception(timeout=30) for fu in [pipe.submit(i) for i in range(12)]]
    causes = [o.__cause__ for o in outcomes]
    assert all(type(c) is RuntimeError for c in causes), causes
    first = str(causes[0])
    assert "ended (exit code 3) as it started, before it was ready" in first, first
    assert "__main__" in first, first
    last = str(causes[-1])
    assert f"{processes.START_FAILURES} worker processes in a row ended as they started" in last, last
    assert "no more are started" in last and "exit code 3" in last, last
    assert len(started) <= 2 + processes.START_FAILURES, started
    assert all(gone(p) for p in started)
    assert segments.made and segments.left() == [] and dev.live().total == 0


def test_cancelling_one_future_stops_its_prepare_by_killing_its_worker_and_the_rest_go_on(dev, tmp_path, segments):
    """A future cancelled while its prepare ran in a worker left that worker running it: on the
    simulated GPU cancel() itself waited for it (the thread driving the device was in it), and
    close() waited for it later (for ever, for a prepare that never returns). Now that worker is
    killed, the chunk ends CANCELLED, a new worker takes its place and later items go on."""
    item, ready = stuck_item(tmp_path)
    pipe = rf.Pipeline(f, device=dev, chunk_bytes=4096, prepare=pp.reports_then_waits, processes=True, workers=2)
    pid = None
    try:
        assert np.array_equal(pipe.submit(1).result(timeout=30), pp.ramp(1) * 2 + 1)
        stuck = pipe.submit(item)
        waiter = awaited(stuck)
        pid = int(ready.read_line())  # its prepare is running in that worker now
        assert threads.bounded(stuck.cancel, timeout=10) is True
        threads.join([waiter], timeout=10)
        assert stuck.cancelled() and gone(pid)
        later = [pipe.submit(i) for i in range(2, 8)]
        for i, fu in enumerate(later, 2):
            assert np.array_equal(fu.result(timeout=30), pp.ramp(i) * 2 + 1)
        assert pid not in pipe.scheduler._procs.pids() and len(pipe.scheduler._procs.pids()) == 2
        s = pipe.stats()
        assert (s.delivered, s.cancelled, s.failed, s.in_flight) == (7, 1, 0, 0)
        threads.bounded(pipe.close, timeout=10)
    finally:
        if pid is not None and not gone(pid):
            os.kill(pid, signal.SIGKILL)  # (the test failed: let the run go on)
        threads.bounded(pipe.cancel, timeout=10)
        threads.bounded(pipe.close, timeout=10)
    assert segments.made and segments.left() == [] and dev.live().total == 0


def _pairs(x, y):
    for a, b in zip(x, y):
        f(a, b)


def _item_1_fails_alone(dev, prepare, compute) -> tuple:
    """Items 2..5 through a one-worker pipeline (``on_error="continue"``) whose ``prepare`` fails
    the second: ``(futures, the TypeError its failure was caused by)``, once the pipeline closed
    with its worker never ended and only that item failed."""
    with rf.Pipeline(compute, device=dev, chunk_bytes=4096, prepare=prepare, processes=True, workers=1,
                     on_error="continue") as pipe:
        pids = pipe._procs.pids()
        futs = [pipe.submit(i) for i in range(2, 6)]
        outcomes = [fu.exception(timeout=30) for fu in futs]
        failures = pipe.failures
        assert pipe._procs.pids() == pids  # nothing ended its worker
    assert [i for i, o in enumerate(outcomes) if o is not None] == [1]
    assert [(e.stage, e.index) for e in failures] == [("prepare", 1)]
    cause = failures[0].__cause__
    assert type(cause) is TypeError, repr(cause)
    return futs, cause


def test_a_structure_that_cannot_leave_its_worker_fails_its_item_alone_saying_so(dev):
    """prepare returned a structure whose layout (here a named tuple type pickle cannot find by
    its name) could not be pickled back: the worker's send raised, the worker died printing its
    traceback, and the item failed as a crash would ("died (exit code 1) ... a crash in native
    code"), a new worker started in its place. It fails saying what cannot travel back; the
    worker serves the next items."""
    futs, cause = _item_1_fails_alone(dev, pp.misnamed_on_3, _pairs)
    assert "cannot be sent back from its worker process" in str(cause), str(cause)
    assert "NotItsName" in str(cause) and "died" not in str(cause), str(cause)
    for i, n in ((0, 2), (2, 4), (3, 5)):
        x, y = futs[i].result()
        assert np.array_equal(x, pp.ramp(n) * 2 + 1) and np.array_equal(y, pp.ramp(n + 1) * 2 + 1)
    assert dev.live().total == 0


@pytest.mark.parametrize("prepare", [pp.raises_a_class_of_its_worker_on_3, pp.returns_a_class_of_its_worker_on_3])
def test_a_reply_the_pipelines_process_cannot_unpickle_fails_its_item_alone_saying_so(dev, prepare):
    """What prepare raised, or the layout of what it returned, pickled and unpickled in its
    worker (so the worker sent it) but could not be unpickled in the pipeline's process (a
    class made in the worker at run time): the item failed with pickle's bare error
    (ModuleNotFoundError naming a module the user never wrote to import), and its worker, whose
    reply had been read whole, was ended and replaced. It fails saying what could not be read
    back; the worker serves the next items."""
    compute = _pairs if prepare is pp.returns_a_class_of_its_worker_on_3 else f
    futs, cause = _item_1_fails_alone(dev, prepare, compute)
    assert "cannot be unpickled in the pipeline's process" in str(cause), str(cause)
    assert "ringflow_test_worker_only" in str(cause) and "processes=False" in str(cause), str(cause)
    for i, n in ((0, 2), (2, 4), (3, 5)):
        if compute is f:
            assert np.array_equal(futs[i].result(), pp.ramp(n) * 2 + 1)
        else:
            x, y = futs[i].result()
            assert np.array_equal(x, pp.ramp(n) * 2 + 1) and np.array_equal(y, pp.ramp(n + 1) * 2 + 1)
    assert dev.live().total == 0


def test_cancelling_a_future_whose_prepare_has_yet_to_start_keeps_that_prepare_from_running(
        dev, tmp_path, monkeypatch, segments):
    """A future cancelled while its chunk's prepare had no worker yet (another prepare held the
    only one) had no worker to kill: the cancel waited for the pipeline, whose next step ran that
    prepare all the same, and a prepare that never returns held the cancel (and close()) for
    ever. The cancel is now seen before that prepare starts: it never runs, the chunk ends
    CANCELLED, nothing is killed and later items go on."""
    first_ready, go = pp.Fifo(tmp_path, "first"), pp.Fifo(tmp_path, "go")
    item, _ready = stuck_item(tmp_path)
    pipe = rf.Pipeline(f, device=dev, chunk_bytes=4096, prepare=pp.reports_then_waits, processes=True, workers=1)
    sched = pipe.scheduler
    asked = threading.Event()
    real_stop = sched.stop_prepare

    def stop_prepare(index):
        try:
            return real_stop(index)
        finally:
            asked.set()

    monkeypatch.setattr(sched, "stop_prepare", stop_prepare)
    try:
        first = pipe.submit((1, first_ready.path, go.path))
        waiter = awaited(first)
        pid = int(first_ready.read_line())  # the only worker runs the first prepare now
        queued = pipe.submit(item)
        canceller = threads.start(queued.cancel)
        assert asked.wait(10)  # (its prepare has yet to start: no worker can be killed for it)
        go.write_line()
        assert threads.join([canceller, waiter], timeout=10)[0] is True
        assert np.array_equal(first.result(), pp.ramp(1) * 2 + 1) and queued.cancelled()
        assert np.array_equal(pipe.submit(2).result(timeout=30), pp.ramp(2) * 2 + 1)
        assert sched._procs.pids() == [pid]  # (nothing was killed: that prepare never ran)
        s = pipe.stats()
        assert (s.delivered, s.cancelled, s.failed, s.in_flight) == (2, 1, 0, 0)
        threads.bounded(pipe.close, timeout=10)
    finally:
        threads.bounded(pipe.cancel, timeout=10)  # (the test failed: kills a prepare left running)
        threads.bounded(pipe.close, timeout=10)
    assert segments.made and segments.left() == [] and dev.live().total == 0


def test_a_prepare_stopped_before_it_started_keeps_nothing_of_the_step_that_saw_it_alive(
        dev, tmp_path, monkeypatch, segments):
    """The PrepareStopped raised for a prepare cancelled before it started is kept by its host
    task, and its traceback's frames (the task's run, holding the task) make a cycle of the two.
    The traceback also reaches, through ``f_back``, the step that saw the task end, whose locals
    held other chunks' slots and events: after close() an event stayed alive until the cyclic
    collector happened to run (``dev.live()`` counted it, now and then, in a loaded run). Its
    frames are now cleared as a failure's are: with the collector off, the error goes with its
    task and nothing it reached stays alive."""
    from ringflow._errors import PrepareStopped

    first_ready, go = pp.Fifo(tmp_path, "first"), pp.Fifo(tmp_path, "go")
    item, _ready = stuck_item(tmp_path)
    stopped: list = []
    with collector_off():
        pipe = rf.Pipeline(f, device=dev, chunk_bytes=4096, prepare=pp.reports_then_waits, processes=True,
                           workers=1)
        sched = pipe.scheduler
        asked, seen_stopped = threading.Event(), threading.Event()
        real_stop, real_drain = sched.stop_prepare, sched._drain

        def stop_prepare(index):
            try:
                return real_stop(index)
            finally:
                asked.set()
                # the cancel goes on once a step has seen the prepare task end PrepareStopped (it
                # would otherwise end the chunk first, and the task's error would go unread)
                seen_stopped.wait(10)

        def drain(chunk, state):
            seen = sys.exc_info()[1]  # (the scheduler drains the chunk while it handles the error)
            if isinstance(seen, PrepareStopped):
                stopped.append(weakref.ref(seen))
                seen_stopped.set()
            del seen
            return real_drain(chunk, state)

        monkeypatch.setattr(sched, "stop_prepare", stop_prepare)
        monkeypatch.setattr(sched, "_drain", drain)
        try:
            first = pipe.submit((1, first_ready.path, go.path))
            waiter = awaited(first)
            first_ready.read_line()  # the only worker runs the first prepare now
            queued = pipe.submit(item)
            canceller = threads.start(queued.cancel)
            assert asked.wait(10)  # (its prepare has yet to start)
            go.write_line()
            assert seen_stopped.wait(10)
            threads.join([canceller, waiter], timeout=10)
            assert np.array_equal(first.result(), pp.ramp(1) * 2 + 1) and queued.cancelled()
            threads.bounded(pipe.close, timeout=10)
        finally:
            seen_stopped.set()
            threads.bounded(pipe.cancel, timeout=10)
            threads.bounded(pipe.close, timeout=10)
        assert len(stopped) == 1 and stopped[0]() is None
        assert segments.made and segments.left() == [] and dev.live().total == 0


def test_close_gives_workers_that_do_not_exit_one_grace_between_them(dev, monkeypatch, segments):
    """Workers that do not exit once told to (a thread that is no daemon keeps each one) were
    given the grace one after another: close() took the grace once a worker. They are given it
    side by side, then killed together."""
    from ringflow._pipeline import processes

    monkeypatch.setattr(processes, "EXIT_GRACE_S", 1.0)
    given = []  # the grace each worker was given, as close gave it
    end = processes._Worker.end

    def recorded(worker, grace):
        given.append(grace)
        return end(worker, grace)

    pipe = rf.Pipeline(f, device=dev, chunk_bytes=4096, prepare=pp.KeepsItsWorkerFromExiting(), processes=True,
                       workers=4)
    try:
        out = list(pipe.map(range(8)))
        pids = pipe.scheduler._procs.pids()
        monkeypatch.setattr(processes._Worker, "end", recorded)
        threads.bounded(pipe.close, timeout=30)
    finally:
        threads.bounded(pipe.close, timeout=30)
    assert all(np.array_equal(r, pp.ramp(i) * 2 + 1) for i, r in enumerate(out))
    assert len(pids) == 4 and all(gone(p) for p in pids)
    # each was given what was left of one grace: the first waited it out (its worker does not exit),
    # the others had what remained of it; one after another, each would have had a whole grace.
    # (Counted in the graces given, not in the time close took: a slow machine only shortens them.)
    real = [g for g in given if g > 0]
    assert len(given) >= 4 and sum(real) <= processes.EXIT_GRACE_S + 1e-6, given
    assert segments.made and segments.left() == [] and dev.live().total == 0
