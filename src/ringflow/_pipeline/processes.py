"""``prepare`` in worker processes (``Pipeline(processes=True)``), writing into pinned shared memory.

Threads share the GIL: a ``prepare`` that spends its time in Python, or in many small numpy
calls, runs little faster on eight threads than on one. Worker processes do not share it, as
PyTorch's DataLoader workers do not; unlike a DataLoader, they write each array straight into
the pipeline's pinned host-in slot, so nothing is pickled back or copied again to pin it.

The host-in ring is one block of POSIX shared memory (``multiprocessing.shared_memory``), made
when the pipeline makes its host-in ring (after its device rings, so a GPU without room for those
fails before any of this is paid for), before the workers start, and registered with the device
(``Device.register_host``), so its copy engine reads it as pinned memory. A worker attaches the
block by name when it starts; a task carries the item and the slot's offset, and returns the
array's shape and dtype. The workers run from a ``forkserver``: a clean process, started before
any of them, that forks each worker (forking the pipeline's own process, whose threads may hold
locks, could deadlock a child).

The workers end with the pipeline's process, however it ends. Killed by SIGKILL (the OOM killer,
a job scheduler), that process runs no clean-up, and a worker in the middle of a prepare does not
read its task pipe, so that pipe closing does not end it. Each worker has a lifeline as well: a
pipe whose write end only the pipeline's process holds (it never writes to it), and a thread that
waits on the read end and ends the worker (``os._exit``) once it reads end of file
(:func:`_end_with`); a child forked from the pipeline's process closes its copies of the write
ends as it is forked, so that one left running does not keep the workers alive. The forkserver
and multiprocessing's resource tracker (which then unlinks the block) end once no process holds
their pipes. A prepare in a native call that holds the GIL ends once that call returns (the
thread needs the GIL to end the process).

Each worker has a pipe of its own and runs one task at a time, taken by the CPU worker thread
that waits for it (not a shared ``ProcessPoolExecutor``, where one worker that dies breaks the
pool and fails every task in it, running or queued). So:

* a worker that dies (a crash in native code, ``os._exit``, a signal, the OOM killer) fails only
  the item it was preparing, with a RuntimeError giving its exit code or signal; the items in
  the other workers go on, and a new worker is started for the next item; a worker that ends
  as it started (before it said it was ready) fails its item saying so, and after
  :data:`START_FAILURES` of those in a row no more are started (every later item fails at once);
* :meth:`ProcessPrepare.stop_running` (what ``Pipeline.cancel`` calls first, before it takes any
  lock: on the simulated GPU a prepare runs inside the device's lock) kills the workers running
  a task, whose threads then raise :class:`~ringflow._errors.PrepareStopped` (their chunks end
  CANCELLED), and refuses every later task the same way. A worker's write into its slot ends
  with the worker: its thread returns only once the process is gone, so the slot is reused only
  after that;
* :meth:`ProcessPrepare.stop_task` (what cancelling one chunk's future calls first, for the same
  reason) kills only the worker whose task is that chunk's (:meth:`ProcessPrepare.name_task`
  names it): that task raises PrepareStopped, and a new worker takes the killed one's place; a
  task named but not yet given a worker raises PrepareStopped without one (the thread that
  names a task looks for a stop asked before it, :meth:`.Scheduler.stop_prepare`).

Ordering: the task is submitted, and waited for, by the scheduler's CPU worker thread that owns
the slot's prepare (its checked view declares the write on the simulated GPU); the slot's h2d is
enqueued only after that thread's task is seen complete, as for a prepare on a thread.
"""

from __future__ import annotations

import errno
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import multiprocessing.util
import os
import pickle
import signal
import threading
import time
import traceback
import weakref
from multiprocessing import shared_memory
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

import numpy as np

from .._device.protocol import Device, HostBuffer, close_quietly
from .._errors import PrepareStopped, describe, unpicklable

_SHARED: dict = {}  # in a worker: the attached block and its bytes, the prepare callable or why it is missing
EXIT_GRACE_S = 5.0  # how long a worker told to exit (its pipe closed) has before it is killed
# workers exiting as they start, in a row, after which no more are started: one that cannot start
# (a script without a __main__ guard, a module that does not import in a new process) fails the
# same way each time, and a new one for every item would print its error for every item
START_FAILURES = 3
_POOLS: "weakref.WeakSet[ProcessPrepare]" = weakref.WeakSet()  # every pool opened in this process
# the write end of every worker's lifeline that this process holds, from the moment it is made (a
# worker still starting is in no pool's list yet): a forked child closes its copies of them all
_LIFELINES: set = set()


def _disown_in_child() -> None:
    """In a child forked from a process with worker processes: forget them, so that the child's
    exit, which runs multiprocessing's at-exit join of its children, does not try to join the
    parent's (an AssertionError traceback, 'can only join a child process'), and close the
    child's copies of their lifelines (:func:`_end_with`), so that a child left running does not
    keep them alive once the parent has gone (those of workers still starting on another thread
    as the fork came too: :data:`_LIFELINES`). Never raises."""
    try:
        lifelines = list(_LIFELINES)
        _LIFELINES.clear()
    except Exception:  # noqa: BLE001 - at fork: nothing may fail there
        lifelines = []
    for lifeline in lifelines:
        try:
            lifeline.close()
        except Exception:  # noqa: BLE001 - at fork: nothing may fail there
            pass
    try:
        workers = [worker for pool in list(_POOLS) for worker in list(pool._all)]
        children = multiprocessing.process._children  # (multiprocessing's own set of the children to join)
        for worker in workers:
            children.discard(worker.process)
    except Exception:  # noqa: BLE001 - at fork: nothing may fail there
        pass


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork()
    os.register_at_fork(after_in_child=_disown_in_child)


def _cut(lifeline: Any) -> None:
    """Close a lifeline's write end and forget it (:data:`_LIFELINES`)."""
    _LIFELINES.discard(lifeline)
    lifeline.close()


class _Worker:
    """One worker process, the pipeline's end of its pipe, and the write end of its lifeline
    (see :func:`_end_with`), which nothing is ever written to: it closes with the pipeline's
    process, however that ends, and the worker then ends too."""

    __slots__ = ("process", "conn", "lifeline", "owner", "ready", "key", "stopped")

    def __init__(self, ctx: Any, name: str, prepare: bytes):
        self.owner = os.getpid()  # a child forked from this process must never signal or join it
        self.ready = False  # its "ready" was read: it started (read before its first task's reply)
        self.key: Any = None  # what its task now is for (ProcessPrepare.name_task: the chunk), or None
        self.stopped = False  # stop_task() killed it for its task: that task ends PrepareStopped
        conn, child = ctx.Pipe()
        watched, lifeline = ctx.Pipe(duplex=False)
        _LIFELINES.add(lifeline)  # (before the start: a fork meanwhile closes the child's copy)
        try:
            self.process = ctx.Process(target=_serve, args=(child, name, prepare, watched), name="ringflow-prepare")
            self.process.start()
        except BaseException:
            conn.close()
            _cut(lifeline)
            raise
        finally:
            child.close()  # (the worker has its own copies of these now)
            watched.close()
        self.conn = conn
        self.lifeline = lifeline

    @property
    def pid(self) -> "int | None":
        return self.process.pid

    def kill(self) -> None:
        """SIGKILL it (a prepare may ignore SIGTERM, or loop where nothing else reaches it); never
        raises. Nothing in a child forked from the pipeline's process (the worker is the parent's:
        the child's finalizers must not kill the parent's prepares)."""
        if os.getpid() != self.owner:
            return
        try:
            self.process.kill()
        except Exception:  # noqa: BLE001 - it has gone already
            pass

    def end(self, grace: float) -> None:
        """Close its pipe (an idle worker then exits), give it ``grace`` seconds, kill it if it
        is still there, and reap it; never raises. Only closes the child's copy of the pipe in a
        child forked from the pipeline's process."""
        try:
            self.conn.close()
            if os.getpid() != self.owner:
                _cut(self.lifeline)
                return
            self.process.join(grace)
            if self.process.exitcode is None:
                self.kill()
                self.process.join()
            _cut(self.lifeline)  # (after its exit: closed first, it would cut short an exit under way)
        except Exception:  # noqa: BLE001 - cleanup never raises
            pass


class ProcessPrepare:
    """A pool of ``workers`` processes that run ``prepare(item)`` and copy its array into a slot
    of one shared, pinned block (:attr:`buffer`, ``nbytes`` long).

    Raises:
        TypeError: ``prepare`` cannot be pickled (a lambda or a nested function): workers get
            it by reference, so it must be a module-level function or a picklable object.
    """

    def __init__(self, device: Device, prepare: Callable, nbytes: int, chunk_bytes: int, workers: int):
        try:
            self._pickled = pickle.dumps(prepare)
        except Exception as exc:  # noqa: BLE001 - what pickle raises varies (PicklingError, AttributeError, ...)
            raise TypeError(f"processes=True sends prepare to worker processes, but it cannot be pickled ({exc}); "
                            "define it at module level (not a lambda or a nested function)") from None
        self._device, self._nbytes, self._workers = device, nbytes, workers
        self._chunk_bytes = chunk_bytes
        self._owner = os.getpid()  # the workers and the block are this process's (not a forked child's)
        self._shm = None
        self._ctx = None
        self._at_exit = None
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._all: list[_Worker] = []  # every worker started and not yet reaped, idle or running a task
        self._stopping = False  # stop_running() or close() was called: every task is refused
        self._start_failures = 0  # workers that ended as they started since one was last ready
        self._broken: "RuntimeError | None" = None  # too many did: every task fails with this
        self.buffer: HostBuffer | None = None
        # .key, set by name_task on the thread that calls this pool (the scheduler: the chunk
        # whose prepare it runs), names its task for stop_task
        self.task = threading.local()
        self._named: list = []  # the keys of the tasks named (name_task) and not yet ended
        self._stop_asked: list = []  # those of _named that stop_task found no worker running

    def open(self) -> HostBuffer:
        """Make the shared block, register it with the device and start the workers; returns
        the block (:attr:`buffer`). Called when the pipeline makes its host-in ring, after its
        device rings: a device without room for those fails before any of this is paid for.

        Raises:
            OSError: shared memory (``/dev/shm``) has no room for the block (ENOSPC).
            whatever making, registering or starting them raised; what was made is closed.
        """
        nbytes = self._nbytes
        self._shm = shared_memory.SharedMemory(create=True, size=nbytes)
        try:
            _reserve(self._shm, nbytes)
            view = np.ndarray((nbytes,), np.uint8, buffer=self._shm.buf)
            self._base = view.__array_interface__["data"][0]
            self.buffer = self._device.register_host(view)
            del view
            self._ctx = multiprocessing.get_context("forkserver")
            # at exit, before multiprocessing joins its children: a worker still running a prepare
            # (a pipeline left open) would keep the interpreter from ending
            self._at_exit = multiprocessing.util.Finalize(self, _end_all, args=(self._all, 0.0), exitpriority=10)
            _POOLS.add(self)
            # every worker now, not at its first item: the first items would wait for them
            for _ in range(self._workers):
                self._idle.append(self._start())
        except BaseException:
            self.close()
            raise
        return self.buffer

    def pids(self) -> list:
        """The process ids of the workers started and not yet reaped."""
        with self._lock:
            return [w.pid for w in self._all]

    def _start(self) -> _Worker:
        """A new worker (listed in ``_all`` from its start on, so that close ends it).

        Raises:
            PrepareStopped: :meth:`stop_running` came while it started. It listed the workers
                running a task before this one was listed, so it did not kill it: a task sent
                to it would run to its end (for ever, for a prepare that never returns). It is
                ended here instead.
        """
        worker = _Worker(self._ctx, self._shm.name, self._pickled)
        with self._lock:
            stopping = self._stopping
            if not stopping:
                self._all.append(worker)
        if stopping:
            worker.kill()
            worker.end(0.0)
            raise PrepareStopped("the pipeline was cancelled or closed before this prepare started")
        return worker

    def __call__(self, item: Any, raw: np.ndarray) -> tuple:
        """The prepare stage for one chunk (on a CPU worker thread): ``raw`` is the chunk's slot,
        a view of :attr:`buffer`. Runs ``prepare(item)`` in an idle worker and waits for it;
        returns ``(shape, dtype)`` (or, for several arrays, ``((nbytes,), uint8, layout)``).

        Raises:
            whatever ``prepare`` raised in the worker (TypeError/ValueError for an array that is
            not one or does not fit).
            TypeError: the item cannot be pickled, or its worker could not unpickle it.
            TypeError: prepare returned a structure whose layout cannot be pickled back (a named
                tuple type pickle cannot find by its name, a dict key that does not pickle).
            TypeError: what prepare raised or returned cannot be unpickled in this process (a class
                only its worker has).
            TypeError: an array of a dtype this device's arrays cannot hold
                (:meth:`~ringflow._device.protocol.Device.check_dtype`).
            RuntimeError: the worker process died while preparing the item.
            PrepareStopped: :meth:`stop_running` or :meth:`close` stopped it (or came first).
        """
        # pickled here, before a worker is taken: an item that cannot be sent fails alone
        try:
            task = ForkingPickler.dumps((self._chunk_bytes, item, raw.__array_interface__["data"][0] - self._base,
                                         raw.nbytes))
        except Exception as exc:  # noqa: BLE001 - what pickle raises varies (TypeError, AttributeError, ...)
            raise TypeError(f"processes=True sends each item to a worker process, but this item cannot be pickled "
                            f"({describe(exc)}); submit items pickle can send (arrays, numbers, strings, paths, "
                            "objects of module-level classes), or use processes=False") from exc
        key = getattr(self.task, "key", None)
        worker = self._take()
        settled = False  # the worker is between tasks again: it may serve the next one
        try:
            with self._lock:
                # a stop asked for this task before it had a worker (stop_task found none to
                # kill): it is not sent, and the worker, given nothing, is idle again
                settled = any(k is key for k in self._stop_asked)
                if not settled:
                    worker.key = key
            if settled:
                raise PrepareStopped("this item's future was cancelled before its prepare started")
            reply = self._run(worker, task)
            settled = True
        finally:
            self._put_back(worker, settled)
        if reply[0] != "ok":
            exc = reply[1]
            if not isinstance(exc, BaseException):  # (an exception whose __reduce__ rebuilds something else)
                exc = TypeError(f"prepare raised an exception that came back from its worker process as "
                                f"{type(exc).__name__} {exc!r:.60}, not an exception: its class's __reduce__ rebuilds "
                                "something else; make it rebuild the exception (its traceback in the worker is this "
                                "error's cause)")
            exc.__cause__ = _RemoteTraceback(reply[2])
            raise exc
        described = (reply[1][0], np.dtype(reply[1][1])) + tuple(reply[1][2:])
        # the worker checked the rule every device keeps; this device's own narrowing (its array
        # type may hold fewer dtypes) is asked here, where the device is
        if len(described) == 2:
            self._device.check_dtype("prepare's array", described[1])
        else:
            for _offset, _shape, dtype in described[2].leaves:
                self._device.check_dtype("prepare's arrays (each array of a tuple, list or dict)", dtype)
        return described

    def _take(self) -> _Worker:
        """An idle worker, or a new one in place of one that has died (or where none is idle).

        Raises:
            PrepareStopped: the workers are being stopped (or were stopped as it started one).
        """
        with self._lock:
            if self._stopping:
                raise PrepareStopped("the pipeline was cancelled or closed before this prepare started")
            if self._broken is not None:
                raise RuntimeError(str(self._broken))
            worker = self._idle.pop() if self._idle else None
        if worker is not None and worker.process.is_alive():
            return worker
        if worker is not None:  # it died while idle: replaced
            self._forget(worker)
            if not worker.ready and not _said_ready(worker):
                # it ended as it started: counted (a new one may well end so too), though this
                # item fails only where its own worker does (it may have been killed from outside)
                self._failed_to_start(worker)
                with self._lock:
                    broken = self._broken
                if broken is not None:
                    raise RuntimeError(str(broken))
        return self._start()

    def _run(self, worker: _Worker, task: bytes) -> tuple:
        """Send ``task`` (pickled) to ``worker`` and wait for its reply (see :func:`_reply`).

        Raises:
            RuntimeError, PrepareStopped: the worker ended first (:meth:`_died`).
        """
        try:
            worker.conn.send_bytes(task)
        except (BrokenPipeError, ConnectionResetError):
            raise self._died(worker) from None
        if not worker.ready:  # its first task: it says "ready" once it has started
            self._receive(worker)
            worker.ready = True
            with self._lock:
                self._start_failures = 0
        return self._receive(worker)

    def _receive(self, worker: _Worker) -> Any:
        """The next message from ``worker``; an error reply (see :func:`_reply`) where it was read
        whole but cannot be unpickled here (the worker is between tasks all the same).

        Raises:
            RuntimeError, PrepareStopped: the worker ended first (:meth:`_died`).
        """
        ready = multiprocessing.connection.wait([worker.conn, worker.process.sentinel])
        if worker.conn not in ready:
            raise self._died(worker)
        try:
            data = worker.conn.recv_bytes()
        except (EOFError, ConnectionResetError):
            raise self._died(worker) from None
        try:
            return ForkingPickler.loads(data)
        except Exception as exc:  # noqa: BLE001 - what unpickling raises varies (ModuleNotFoundError, ...)
            # the worker checked that it unpickles there; a class only the worker has (one made there at
            # run time, a module imported there alone) cannot be found here
            text = ("the worker's traceback came in the reply, so it is lost; unpickling the reply here raised:\n"
                    + "".join(traceback.format_exception(exc)))
            return "error", TypeError(
                f"prepare's reply from its worker process cannot be unpickled in the pipeline's process "
                f"({describe(exc)}): what prepare raised, or the layout of the tuple, list or dict it returned, "
                "holds a class this process cannot import by the name it was made with; make it importable "
                "here (defined in a module both processes import), or use processes=False"), text

    def _died(self, worker: _Worker) -> Exception:
        """The error for the item whose worker has ended (reaped here): PrepareStopped where
        :meth:`stop_running` killed it, else a RuntimeError saying how it ended (as it started,
        where it never said it was ready: :meth:`_failed_to_start`)."""
        worker.process.join()
        if self._stopping or worker.stopped:
            return PrepareStopped(f"the pipeline was cancelled or closed while this prepare ran: its worker process "
                                  f"(pid {worker.pid}) was killed")
        if not worker.ready:
            return self._failed_to_start(worker)
        return RuntimeError(f"the worker process running prepare for this item (pid {worker.pid}) died "
                            f"({_how_it_ended(worker.process.exitcode)}) before prepare returned; the item is "
                            "failed and a new worker process takes the next ones. A worker dies of a crash in "
                            "native code, os._exit, or a signal (the kernel's OOM killer sends SIGKILL)")

    def _failed_to_start(self, worker: _Worker) -> RuntimeError:
        """The error for the item whose worker (ended, reaped) ended as it started; counts it
        where it exited by itself (not killed by a signal), and after :data:`START_FAILURES` in a
        row keeps the error for every later item (no more workers are started)."""
        how = _how_it_ended(worker.process.exitcode)
        err = RuntimeError(
            f"prepare's worker process (pid {worker.pid}) ended ({how}) as it started, before it was ready; the "
            "item is failed. A worker starts by importing the main module again (a script must start its "
            "pipeline under `if __name__ == '__main__':`), then the module that defines prepare, then prepare "
            "itself: one of these ended the process (its own output above says how)")
        exited = worker.process.exitcode is not None and worker.process.exitcode >= 0
        with self._lock:
            # only a worker that exited by itself counts: one killed by a signal as it started
            # (from outside, the OOM killer) says nothing about the next one
            self._start_failures += exited
            if self._start_failures >= START_FAILURES and self._broken is None:
                self._broken = RuntimeError(
                    f"{self._start_failures} worker processes in a row ended as they started, so no more are "
                    f"started and every item fails; the last: {err}")
        return err

    def _put_back(self, worker: _Worker, settled: bool) -> None:
        """``worker`` idle again if it is still there and between tasks; else ended, forgotten
        and replaced (a wait cut short, by an interrupt say, leaves its reply in the pipe for the
        next task: that worker is ended too). Never raises."""
        alive = settled and worker.process.exitcode is None
        with self._lock:
            worker.key = None  # (its task is over: stop_task no longer finds it)
            if alive and not self._stopping and not worker.stopped:
                self._idle.append(worker)
                return
        if alive:
            worker.end(EXIT_GRACE_S)  # (stopping meanwhile: no one else ends it now)
        else:
            worker.kill()
        self._forget(worker)
        self._replace()

    def _replace(self) -> None:
        """Start a worker in place of one that ended, now rather than at the next item (which
        would wait for it); where that fails, the next item starts one (:meth:`_take`). Never
        raises."""
        if self._stopping or self._broken is not None:
            return
        try:
            worker = self._start()  # (stopped while it started: ended there, PrepareStopped)
        except Exception:  # noqa: BLE001 - the next item tries again, and fails with the reason
            return
        with self._lock:
            stopping = self._stopping
            if not stopping:
                self._idle.append(worker)
        if stopping:  # (stopped since: it is nobody's to end but ours)
            self._forget(worker)

    def _forget(self, worker: _Worker) -> None:
        """Reap ``worker`` (ended) and drop it; never raises."""
        worker.end(0.0)
        with self._lock:
            if worker in self._all:
                self._all.remove(worker)

    def name_task(self, key: Any) -> None:
        """Name the task the calling thread is about to run (:meth:`__call__`) ``key`` (the
        scheduler's chunk), for :meth:`stop_task`, until :meth:`unname_task`. A stop asked for
        ``key`` before this call is the caller's to look for once this has returned."""
        self.task.key = key
        with self._lock:
            self._named.append(key)

    def unname_task(self) -> None:
        """End the name :meth:`name_task` gave the calling thread's task; never raises."""
        key, self.task.key = getattr(self.task, "key", None), None
        with self._lock:
            self._named = [k for k in self._named if k is not key]
            self._stop_asked = [k for k in self._stop_asked if k is not key]

    def stop_task(self, key: Any) -> bool:
        """Kill the worker running the task for ``key`` (see :meth:`name_task`; a cancelled
        chunk), if one is: that task raises :class:`~ringflow._errors.PrepareStopped` once the
        process is gone, the worker is never given another task, and a new one takes its place.
        A task named but not yet given a worker raises PrepareStopped instead of being sent.
        Takes no lock but this pool's own. Returns whether a worker was killed; never raises.

        A worker whose task has ended no longer has the key (cleared before its reply is handed
        back, under this pool's lock), so this never kills a worker running another task."""
        if key is None:
            return False
        with self._lock:
            worker = next((w for w in self._all if w.key is key and not w.stopped), None)
            if worker is None:
                if any(k is key for k in self._named) and not any(k is key for k in self._stop_asked):
                    self._stop_asked.append(key)
                return False
            worker.stopped = True  # (never idle again: the kill below cannot reach a later task)
        worker.kill()
        return True

    def stop_running(self) -> None:
        """Kill the workers running a task now and refuse every later task: their threads raise
        :class:`~ringflow._errors.PrepareStopped` once each process is gone. Takes no lock but
        this pool's own (see the module's doc); idle workers are left for :meth:`close`. Never
        raises."""
        with self._lock:
            self._stopping = True
            running = [w for w in self._all if w not in self._idle]
        for worker in running:
            worker.kill()

    def close(self) -> None:
        """Stop the workers (one still running a task is killed, and reaped by the thread that
        waits for it; an idle one exits as its pipe closes), drop the block's registration (the
        ring that used it has dropped it already, unless the pipeline's set-up failed before that
        ring took it) and free the block; nothing where :meth:`open` was never called, or in a
        child forked from the pipeline's process (the workers and the block are the parent's).
        Never raises."""
        if os.getpid() != self._owner:
            return
        self.stop_running()
        with self._lock:
            idle, self._idle = self._idle, []
        _end_all(idle, EXIT_GRACE_S)
        with self._lock:
            self._all[:] = [w for w in self._all if w not in idle]
        if self._at_exit is not None and not self._all:
            self._at_exit.cancel()
        buffer, self.buffer = self.buffer, None
        if buffer is not None:  # (closing it twice is harmless)
            close_quietly(buffer, "the registration of the prepare processes' block")
        shm, self._shm = self._shm, None
        if shm is not None:
            try:
                shm.close()
            except BufferError:  # a view of it is still alive somewhere: the mapping goes with it
                pass
            try:
                shm.unlink()
            except FileNotFoundError:
                pass


def _reserve(shm: Any, nbytes: int) -> None:
    """Take every page of the new block ``shm`` now, where the system can (Linux). ``/dev/shm``
    is a tmpfs (64 MiB in a Docker container unless ``--shm-size`` says more) that makes a block
    larger than its free space without a word and takes its pages as they are written: a write
    past that space kills the process writing (SIGBUS), a worker, or the pipeline's own process
    where the device registers the block as pinned memory (which faults every page in).

    Raises:
        OSError: no room for ``nbytes`` bytes (ENOSPC), saying what to change.
    """
    fd = getattr(shm, "_fd", -1)
    if not hasattr(os, "posix_fallocate") or fd < 0 or nbytes == 0:
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS):  # (a system that cannot tell)
            return
        raise OSError(exc.errno, f"processes=True puts its host-in slots in one block of shared memory, "
                                 f"{nbytes} bytes (slots.host_in x chunk_bytes), but shared memory (/dev/shm) has "
                                 f"no room for it ({exc.strerror}); lower chunk_bytes or slots (host_in), or give "
                                 f"shared memory more room (in a Docker container: docker run --shm-size)") from None


def _end_all(workers: list, grace: float) -> None:
    """End every worker of ``workers`` (:meth:`_Worker.end`), all told to exit first, so that
    they exit side by side, within one ``grace`` between them (each is waited for what is left
    of it: workers that do not exit are killed together, not one grace after another); never
    raises."""
    workers = list(workers)
    for worker in workers:
        try:
            worker.conn.close()
        except Exception:  # noqa: BLE001 - cleanup never raises
            pass
    deadline = time.monotonic() + grace
    for worker in workers:
        worker.end(max(0.0, deadline - time.monotonic()))


def _said_ready(worker: _Worker) -> bool:
    """Whether ``worker`` (ended) said it was ready before it ended: it started, and ended later
    (killed from outside while idle). Never raises."""
    try:
        return worker.conn.poll() and worker.conn.recv() == "ready"
    except Exception:  # noqa: BLE001 - closed, or nothing complete in the pipe: it did not
        return False


def _how_it_ended(exitcode: "int | None") -> str:
    """``"exit code 7"`` or ``"killed by signal 11 (SIGSEGV)"`` for a process's exit code."""
    if exitcode is None:
        return "exit code unknown"
    if exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        return f"killed by signal {-exitcode}"
    return f"killed by signal {-exitcode} ({name})"


class _RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker process, as text (its ``__cause__``)."""

    def __init__(self, tb: str):
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f'\n"""\n{self.tb}"""'


def _end_with(lifeline: Any) -> None:
    """In a worker, as it starts: a daemon thread that ends the process (``os._exit``) once the
    read end ``lifeline`` reads end of file, when its write end, the pipeline's process's alone,
    closes (:meth:`_Worker.end`, after the worker has exited, or the pipeline's process ending,
    SIGKILL included). The worker's parent is the forkserver, not the pipeline's process, and
    the forkserver outlives that process as long as any worker does, so neither a parent-death
    signal nor a pipe read between tasks reaches a worker running a prepare. A pipe, unlike a
    process id, cannot name a new process that took the old one's id. The thread waits in a
    read that lets go of the GIL: nothing per task. Never raises."""
    def watch() -> None:
        try:
            while os.read(lifeline.fileno(), 1):  # (nothing is written: only end of file returns)
                pass
        except (OSError, ValueError):  # closed here (by the prepare, say): nothing to watch
            return
        os._exit(1)

    try:
        threading.Thread(target=watch, name="ringflow-lifeline", daemon=True).start()
    except Exception:  # noqa: BLE001 - no thread to be had: the worker then ends only as its task pipe closes
        pass


def _serve(conn: Any, name: str, prepare: bytes, lifeline: Any) -> None:
    """A worker's body: watch ``lifeline`` (:func:`_end_with`), attach the block and take the
    prepare callable, then answer tasks one at a time until the pipe closes."""
    _end_with(lifeline)  # (first: attaching, or importing what prepare needs, may hang too)
    # Ctrl-C at a terminal signals the whole foreground process group: the pipeline's process
    # handles it (cancelling, closing, which ends the workers); a worker taking it would print a
    # KeyboardInterrupt traceback and die, failing the item it was preparing
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _attach(name, prepare)
    except Exception as exc:  # noqa: BLE001 - each task is answered with it (a worker that died would be replaced, and fail again)
        _SHARED["broken"] = RuntimeError(f"prepare's worker process could not start: {describe(exc)}")
    try:
        conn.send("ready")  # (read before the first task's reply: one that ends first ended as it started)
    except OSError:
        return
    while True:
        try:
            task = conn.recv_bytes()  # (unpickled by _reply: an item that fails there fails alone)
        except (EOFError, OSError):  # the pipeline closed its end: no more tasks
            return
        conn.send_bytes(_pickled_reply(_reply(task)))


def _pickled_reply(reply: tuple) -> bytes:
    """``reply`` pickled as ``Connection.send`` pickles it; where it cannot be (a structure
    prepare returned whose layout holds a named tuple type or a dict key that pickle cannot
    send), an error reply saying so, for the item alone: the worker, had its send raised, would
    have died."""
    try:
        return ForkingPickler.dumps(reply)
    except Exception as exc:  # noqa: BLE001 - what pickle raises varies (PicklingError, TypeError, ...)
        text = "".join(traceback.format_exception(exc))
        err = TypeError(f"prepare's result cannot be sent back from its worker process ({describe(exc)}); "
                        "processes=True sends the layout of a tuple, list or dict of arrays back by pickle: "
                        "a named tuple's type must be importable by the name it was made with, and dict keys "
                        "must pickle (strings, numbers), or use processes=False")
        return ForkingPickler.dumps(("error", err, text))


def _attach(name: str, prepare: bytes) -> None:
    """Map the shared block and take the prepare callable."""
    shm = shared_memory.SharedMemory(name=name)
    _SHARED["shm"] = shm
    _SHARED["bytes"] = np.ndarray((shm.size,), np.uint8, buffer=shm.buf)
    _SHARED["prepare"] = pickle.loads(prepare)


def _reply(task: bytes) -> tuple:
    """In a worker: ``("ok", (shape, dtype string)[, layout])`` for a task (pickled), or
    ``("error", exception, traceback text)`` with what it raised (or a stand-in that can travel
    back)."""
    try:
        broken = _SHARED.get("broken")
        if broken is not None:
            raise broken
        try:
            task = ForkingPickler.loads(task)
        except BaseException as exc:  # noqa: BLE001 - the item's own unpickling, whatever it raised
            raise TypeError(f"the item could not be unpickled in its worker process ({describe(exc)}); "
                            "processes=True sends each item to a worker process by pickle: an item must unpickle "
                            "there (a class importable by its module's name, a __reduce__ that rebuilds it), "
                            "or use processes=False") from exc
        return "ok", _prepare_in_worker(*task)
    except BaseException as exc:  # noqa: BLE001 - sent back as itself where it can travel
        text = "".join(traceback.format_exception(exc))
        return "error", _stand_in(exc) or exc, text


def _prepare_in_worker(chunk_bytes: int, item: Any, offset: int, nbytes: int) -> tuple:
    """In a worker: ``prepare(item)`` copied into the slot at ``offset`` (as a thread's prepare
    does it); returns ``(shape, dtype string)``."""
    from .api import _prepare_array

    block = _SHARED["bytes"]
    # an array from another slot of the block (an empty_slot array kept past its prepare) is refused
    described = _prepare_array(_SHARED["prepare"], chunk_bytes, item, block[offset:offset + nbytes], ring=block)
    return (tuple(described[0]), np.dtype(described[1]).str) + tuple(described[2:])


def _stand_in(exc: BaseException) -> "RuntimeError | None":
    """None where ``exc`` survives the trip back to the pipeline's process; else a RuntimeError
    to send instead, saying what it was. One that pickles but cannot be unpickled would fail in
    the pipeline's process as its reply is read; one that cannot be pickled could not be sent."""
    err = unpicklable(exc)
    if err is None:
        return None
    return RuntimeError(f"prepare raised {describe(exc)} (it cannot be sent back from its worker process: "
                        f"{describe(err)}); make the exception picklable to receive it as itself")
