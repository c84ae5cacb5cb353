"""The CUDA backend's worker threads (src/ringflow/_device/cuda/pool.py), which need no GPU: each
open pool runs on threads of its own, and a device keeps a bounded number of threads however
many ``workers=`` values its pools asked for."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from ringflow._device.cuda.pool import IDLE_EXECUTORS_KEPT, ThreadWorkerPool, WorkerThreads
from tests.helpers.threads import JOIN_S


def test_two_open_pools_of_one_size_each_run_their_own_workers():
    """Two pipelines on one device, each with ``workers=2``, run four tasks at once (as on the
    simulated GPU, where each pool has its own lanes): sharing one executor of two threads, the
    four tasks below would wait for each other for ever."""
    threads = WorkerThreads()
    pools = [ThreadWorkerPool(2, threads) for _ in range(2)]
    all_four = threading.Barrier(4, timeout=JOIN_S)
    tasks = [pool.submit(all_four.wait) for pool in pools for _ in range(2)]
    for task in tasks:
        task.sync()
        task.result()  # (a broken barrier raises here)
    for pool in pools:
        pool.close()
    threads.shutdown()


def test_a_device_keeps_a_bounded_number_of_threads_whatever_the_pool_sizes():
    """Pools of 1..24 workers made and closed one after another leave at most
    ``IDLE_EXECUTORS_KEPT`` idle executors, and their threads, not one executor per size."""
    threads = WorkerThreads()
    for workers in range(1, 25):
        pool = ThreadWorkerPool(workers, threads)
        done = threading.Barrier(workers, timeout=JOIN_S)  # every thread of the pool started
        for task in [pool.submit(done.wait) for _ in range(workers)]:
            task.sync()
        pool.close()
    kept = sum(range(24 - IDLE_EXECUTORS_KEPT + 1, 25))  # the last few sizes' threads, at most
    assert threads.threads() <= kept
    assert threads.threads() > 0, "the last pools' threads are kept for later pools"
    threads.shutdown()
    assert threads.threads() == 0


def test_a_closed_pools_threads_serve_the_next_pool_of_its_size():
    threads = WorkerThreads()
    first = ThreadWorkerPool(3, threads)
    executor = first._executor
    first.close()
    second = ThreadWorkerPool(3, threads)
    assert second._executor is executor, "reused, not started again"
    other = ThreadWorkerPool(3, threads)
    assert other._executor is not executor, "but never lent to two open pools"
    second.close()
    other.close()
    threads.shutdown()


def test_a_pool_collected_unclosed_gives_its_threads_back():
    threads = WorkerThreads()
    pool = ThreadWorkerPool(2, threads)
    executor = pool._executor
    del pool
    gc.collect()
    again = ThreadWorkerPool(2, threads)
    assert again._executor is executor
    again.close()
    threads.shutdown()


def test_after_shutdown_no_pool_is_made_and_a_late_give_back_ends_its_threads():
    threads = WorkerThreads()
    pool = ThreadWorkerPool(2, threads)
    task = pool.submit(sum, [1, 2])
    task.sync()
    threads.shutdown()  # (a device closes its pools first; this one is given back after)
    pool.close()
    assert pool._executor._shutdown
    with pytest.raises(RuntimeError, match="shut down"):
        ThreadWorkerPool(2, threads)


_FORK_POOLS = textwrap.dedent("""
    import concurrent.futures as cf, os, signal, sys, threading
    from ringflow._device.cuda.pool import ThreadWorkerPool, WorkerThreads
    from tests.helpers.forks import leave_child

    threads = WorkerThreads()
    idle = ThreadWorkerPool(2, threads)
    for task in [idle.submit(sum, [1, 2]) for _ in range(4)]:
        task.sync()
    idle.close()  # its executor, threads started, kept for the next pool of two
    lent = ThreadWorkerPool(3, threads)
    lent.submit(sum, [1]).sync()
    release = threading.Event()
    running = lent.submit(release.wait, 60)  # running as the process forks: it never ends in the child
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)
        lines = []
        try:
            task = ThreadWorkerPool(2, threads).submit(sum, [1, 2])
            lines.append(f"new pool: ran {bool(cf.wait([task._future], timeout=5).done)}")
        except RuntimeError as exc:
            lines.append(f"new pool: {exc}")
        try:
            task = lent.submit(sum, [1])
            lines.append(f"lent pool: ran {bool(cf.wait([task._future], timeout=5).done)}")
        except RuntimeError as exc:
            lines.append(f"lent pool: {exc}")
        lent.close()
        threads.shutdown()
        lines.append("closed")
        leave_child(lines)
    _, status = os.waitpid(pid, 0)
    release.set()
    lent.close()
    threads.shutdown()
    print("child status", status)
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
def test_a_forked_child_is_refused_the_parents_worker_threads_and_closes_without_waiting_for_them():
    """In a child forked after a device's worker threads started, a task given a pool of the
    parent's threads never ran (the executor counted idle threads the child has not got) and
    closing a pool waited for ever on a task running in the parent: the child is refused by
    name, and closes without waiting."""
    run = subprocess.run([sys.executable, "-c", _FORK_POOLS], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONWARNINGS": "ignore::DeprecationWarning",
                              "PYTHONPATH": os.pathsep.join(sys.path)})
    out = run.stdout
    assert "child status 0" in out, out + run.stderr[-2000:]
    for line in ("new pool: this device's worker threads belong to the process that made the device",
                 "lent pool: this device's worker threads belong to the process that made the device", "closed"):
        assert line in out, out


def test_a_pool_closed_from_two_threads_at_once_returns_from_both_only_once_its_tasks_have_ended():
    """The second close() returned at once while the first still waited for a running task."""
    from tests.helpers.threads import join, stack_names, start

    threads = WorkerThreads()
    pool = ThreadWorkerPool(2, threads)
    release = threading.Event()
    task = pool.submit(release.wait, JOIN_S)
    first = start(pool.close)

    def second():
        pool.close()
        return task.is_done

    tick = threading.Event()
    for _ in range(int(JOIN_S / 0.001)):  # the first close waiting for the task: a place, not a time
        if "wait" in stack_names(first.thread):
            break
        tick.wait(0.001)
    other = start(second)
    for _ in range(int(JOIN_S / 0.001)):
        if other.done() or "wait" in stack_names(other.thread):
            break
        tick.wait(0.001)
    release.set()
    assert join([first, other]) == [None, True], "the second close returned before the task ended"
    threads.shutdown()
