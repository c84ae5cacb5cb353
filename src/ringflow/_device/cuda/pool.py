"""CPU workers for the host stages, on ThreadPoolExecutors.

numpy copies release the GIL, so staging into pinned memory scales with threads. A task's
effects are visible to a thread that has observed it done (``is_done``, ``sync`` or
``Device.wait_any``): completing a future and observing it go through one lock.

The threads belong to the device (:class:`WorkerThreads`), lent to one pool at a time: each
open :class:`ThreadWorkerPool` runs on an executor of its own, so two pipelines on one device
never wait for each other's workers (as on the simulated GPU, where each pool has its lanes).
A closed pool's executor, threads started, is kept for the next pool of its size, since
starting and joining a pool's threads for each short call costs more than a small call's
transfer (docs/design.md, "Worker threads"); at most :data:`IDLE_EXECUTORS_KEPT` are kept, the
least recently used given back first (their idle threads end), so a device used with many
``workers=`` values keeps a bounded number of threads.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
import weakref
from typing import Any, Callable

from ..protocol import HostTask, WorkerPool, check_workers


class CudaHostTask(HostTask):
    def __init__(self, name: str):
        self._future: cf.Future | None = None
        self._name = name
        self._start: float | None = None
        self._end: float | None = None

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        self._start = time.perf_counter()  # the device's host clock (CudaDevice.now)
        try:
            return fn(*args)
        finally:
            self._end = time.perf_counter()

    @property
    def span(self) -> "tuple[float, float | None] | None":
        return None if self._start is None else (self._start, self._end)

    @property
    def is_done(self) -> bool:
        return self._future.done()

    def sync(self) -> None:
        cf.wait([self._future])

    def result(self) -> Any:
        if not self._future.done():
            raise RuntimeError(f"{self!r} has not finished; sync() it or wait for it with Device.wait_any first")
        return self._future.result()

    def __repr__(self) -> str:
        state = "done" if self._future.done() else "pending"
        return f"<CudaHostTask {self._name} {state}>"


IDLE_EXECUTORS_KEPT = 4  # executors of closed pools a device keeps for later pools

_FORKED = ("this device's worker threads belong to the process that made the device, which this one was "
           "forked from: they are not in this child. Make a device in the child (and start children with "
           "the 'spawn' or 'forkserver' method where the parent has used CUDA)")


class WorkerThreads:
    """A device's worker threads: an executor lent to each open pool (:meth:`take`), kept idle
    once given back (:meth:`give_back`) for a later pool of its size, at most
    :data:`IDLE_EXECUTORS_KEPT` of them. Safe from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lent: set[cf.ThreadPoolExecutor] = set()
        self._idle: list[tuple[int, cf.ThreadPoolExecutor]] = []  # (size, executor), least recent first
        self._closed = False
        self._pid = os.getpid()

    def forked(self) -> bool:
        """Whether this is a child forked after these threads were made: the executors, their
        threads and the lock's holder are the parent's (an executor's idle count says threads
        wait that are not here, so a task given it would never run)."""
        return os.getpid() != self._pid

    def take(self, workers: int) -> cf.ThreadPoolExecutor:
        """An executor of ``workers`` threads for one pool alone: an idle one of that size, or a
        new one.

        Raises:
            RuntimeError: after :meth:`shutdown`, or in a child forked after these threads were
                made.
        """
        if self.forked():
            raise RuntimeError(_FORKED)
        with self._lock:
            if self._closed:
                raise RuntimeError("the device's worker threads are shut down (the device is closed)")
            for k, (size, executor) in enumerate(self._idle):
                if size == workers:
                    del self._idle[k]
                    break
            else:
                executor = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"ringflow-host{workers}")
            self._lent.add(executor)
            return executor

    def give_back(self, executor: cf.ThreadPoolExecutor, workers: int) -> None:
        """A pool is done with ``executor`` (its tasks have ended): keep it idle, and give the
        least recently used beyond :data:`IDLE_EXECUTORS_KEPT` back (their threads end once idle,
        without waiting here). After :meth:`shutdown` it is shut down. In a forked child nothing
        is done (the executors are the parent's). Never raises."""
        if self.forked():
            return
        with self._lock:
            if executor not in self._lent:
                return  # given back already
            self._lent.discard(executor)
            if self._closed:
                ended = [executor]
            else:
                self._idle.append((workers, executor))
                ended = [ex for _, ex in self._idle[:-IDLE_EXECUTORS_KEPT]]
                del self._idle[:-IDLE_EXECUTORS_KEPT]
        for ex in ended:
            ex.shutdown(wait=False)

    def threads(self) -> int:
        """The threads started by every executor, lent or idle (for tests and leak checks)."""
        with self._lock:
            executors = list(self._lent) + [ex for _, ex in self._idle]
        return sum(len(ex._threads) for ex in executors)

    def shutdown(self) -> None:
        """Shut every executor down, waiting for their threads (the device closes): lent ones
        too, whose pools have been closed first. Later :meth:`take` calls raise. In a forked child
        it only marks them shut down (their threads are the parent's)."""
        if self.forked():
            self._closed = True
            return
        with self._lock:
            self._closed = True
            executors = list(self._lent) + [ex for _, ex in self._idle]
            self._lent.clear()
            self._idle.clear()
        for ex in executors:
            ex.shutdown(wait=True)


class ThreadWorkerPool(WorkerPool):
    """A pool of ``workers`` threads lent by a device's :class:`WorkerThreads`, which tracks the
    tasks submitted through it; closing it gives the threads back. A pool collected unclosed
    gives them back as it goes."""

    def __init__(self, workers: int, threads: WorkerThreads,
                 on_close: Callable[["ThreadWorkerPool"], None] | None = None,
                 on_task_done: Callable[[], None] | None = None):
        self.workers = check_workers(workers)
        self._threads = threads
        self._executor = threads.take(self.workers)
        # once: at close, or when the pool is collected unclosed (it holds nothing of the pool)
        self._give_back = weakref.finalize(self, threads.give_back, self._executor, self.workers)
        self._pending: set[cf.Future] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._on_close = on_close
        self._on_task_done = on_task_done  # called once each task's future is done

    def submit(self, fn: Callable[..., Any], *args: Any, nbytes: int = 0, sim_seconds: float | None = None,
               after: Any = None) -> HostTask:
        """Run ``fn(*args)`` on a worker thread; ``nbytes``/``sim_seconds``/``after`` only matter on the sim.

        Raises:
            TypeError: ``fn`` is not callable.
            RuntimeError: the pool is closed, or this is a child forked after it was made.
        """
        if not callable(fn):
            raise TypeError(f"submit needs a callable, got {type(fn).__name__}")
        if self._threads.forked():
            raise RuntimeError(_FORKED)
        task = CudaHostTask(getattr(fn, "__qualname__", type(fn).__name__))
        with self._lock:
            if self._closed:
                raise RuntimeError("this worker pool is closed; create a new one with device.create_worker_pool()")
            fut = self._executor.submit(task._run, fn, args)
            task._future = fut
            self._pending.add(fut)
        fut.add_done_callback(self._forget)
        return task

    def _forget(self, fut: cf.Future) -> None:
        with self._lock:
            self._pending.discard(fut)
        if self._on_task_done is not None:
            self._on_task_done()

    def close(self) -> None:
        """Wait for the tasks submitted through this pool, then give its threads back to the
        device (kept for a later pool). Harmless twice; a close while another thread's is
        waiting waits for the tasks too. In a forked child it waits for nothing:
        the tasks and threads are the parent's, whose tasks never end here."""
        if self._threads.forked():
            self._closed = True
            self._give_back.detach()
            if self._on_close is not None:
                self._on_close(self)
            return
        with self._lock:
            pending = list(self._pending)
            if self._closed:
                again = True
            else:
                again, self._closed = False, True
        cf.wait(pending)
        if again:
            return  # (a close from another thread at once waits for the tasks as well, no more)
        self._give_back()
        if self._on_close is not None:
            self._on_close(self)
