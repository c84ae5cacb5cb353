"""``prepare`` in worker processes (``Pipeline(processes=True)``), writing into pinned shared memory.

Threads share the GIL: a ``prepare`` that spends its time in Python, or in many small numpy
calls, runs little faster on eight threads than on one. Worker processes do not share it, as
PyTorch's DataLoader workers do not; unlike a DataLoader, they write each array straight into
the pipeline's pinned host-in slot, so nothing is pickled back or copied again to pin it.

The host-in ring is one block of POSIX shared memory (``multiprocessing.shared_memory``), made
when the pipeline makes its host-in ring (after its device rings, so a GPU without room for those
fails before any of this is paid for), before the workers start, and registered with the device
(``Device.register_host``), so its copy engine reads it as pinned memory. A worker attaches the
block by name when it starts; a task
carries the item and the slot's offset, and returns the array's shape and dtype. The workers
run from a ``forkserver``: a clean process, started before any of them, that forks each worker
(forking the pipeline's own process, whose threads may hold locks, could deadlock a child).

Ordering: the task is submitted, and waited for, by the scheduler's CPU worker thread that owns
the slot's prepare (its checked view declares the write on the simulated GPU); the slot's h2d is
enqueued only after that thread's task is seen complete, as for a prepare on a thread.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import pickle
import signal
from multiprocessing import shared_memory
from typing import Any, Callable

import numpy as np

from .._device.protocol import Device, HostBuffer, close_quietly
from .._errors import describe, unpicklable

_SHARED: dict = {}  # in a worker: the attached block and its bytes


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
        self._shm = None
        self._pool = None
        self.buffer: HostBuffer | None = None

    def open(self) -> HostBuffer:
        """Make the shared block, register it with the device and start the workers; returns
        the block (:attr:`buffer`). Called when the pipeline makes its host-in ring, after its
        device rings: a device without room for those fails before any of this is paid for.

        Raises:
            whatever making, registering or starting them raised; what was made is closed.
        """
        nbytes, workers = self._nbytes, self._workers
        self._shm = shared_memory.SharedMemory(create=True, size=nbytes)
        try:
            view = np.ndarray((nbytes,), np.uint8, buffer=self._shm.buf)
            self._base = view.__array_interface__["data"][0]
            self.buffer = self._device.register_host(view)
            del view
            ctx = multiprocessing.get_context("forkserver")
            # prepare goes to each worker once, at its start (it may carry data: a dataset)
            self._pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_attach,
                                                                initargs=(self._shm.name, self._pickled))
            # a pool started from a forkserver makes a process per task only when none is idle, so
            # a first few items would be served by the first few workers while the rest start;
            # one empty task per worker starts them all now, without waiting for them
            for _ in range(workers):
                self._pool.submit(os.getpid)
        except BaseException:
            self.close()
            raise
        return self.buffer

    def __call__(self, item: Any, raw: np.ndarray) -> tuple:
        """The prepare stage for one chunk (on a CPU worker thread): ``raw`` is the chunk's slot,
        a view of :attr:`buffer`. Waits for the worker process; returns ``(shape, dtype)``.

        Raises:
            whatever ``prepare`` raised in the worker (TypeError/ValueError for an array that is
            not one or does not fit), or BrokenProcessPool if a worker died.
        """
        offset = raw.__array_interface__["data"][0] - self._base
        described = self._pool.submit(_prepare_in_worker, self._chunk_bytes, item, offset, raw.nbytes).result()
        return (described[0], np.dtype(described[1])) + tuple(described[2:])

    def close(self) -> None:
        """Stop the workers, drop the block's registration (the ring that used it has dropped it
        already, unless the pipeline's set-up failed before that ring took it) and free the
        block; nothing where :meth:`open` was never called. Never raises."""
        pool, self._pool = self._pool, None
        if pool is not None:
            try:
                pool.shutdown(wait=True, cancel_futures=True)
            except Exception:  # noqa: BLE001 - cleanup never raises
                pass
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


def _attach(name: str, prepare: bytes) -> None:
    """A worker's initializer: ignore Ctrl-C, map the shared block and take the prepare callable."""
    # Ctrl-C at a terminal signals the whole foreground process group: the pipeline's process
    # handles it (cancelling, closing, which ends the workers); a worker taking it would print a
    # KeyboardInterrupt traceback and die, breaking the pool for every later item
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    shm = shared_memory.SharedMemory(name=name)
    _SHARED["shm"] = shm
    _SHARED["bytes"] = np.ndarray((shm.size,), np.uint8, buffer=shm.buf)
    _SHARED["prepare"] = pickle.loads(prepare)


def _prepare_in_worker(chunk_bytes: int, item: Any, offset: int, nbytes: int) -> tuple:
    """In a worker: ``prepare(item)`` copied into the slot at ``offset`` (as a thread's prepare
    does it); returns ``(shape, dtype string)``."""
    from .api import _prepare_array

    raw = _SHARED["bytes"][offset:offset + nbytes]
    try:
        described = _prepare_array(_SHARED["prepare"], chunk_bytes, item, raw)
    except BaseException as exc:  # noqa: BLE001 - raised as itself where it can travel back
        stand_in = _stand_in(exc)
        if stand_in is None:
            raise
        # (raised while handling exc: the traceback text sent back with it shows exc's too)
        raise stand_in  # noqa: B904
    return (tuple(described[0]), np.dtype(described[1]).str) + tuple(described[2:])


def _stand_in(exc: BaseException) -> "RuntimeError | None":
    """None where ``exc`` survives the trip back to the pipeline's process; else a RuntimeError
    to send instead, saying what it was. One that pickles but cannot be unpickled would break
    the process pool, failing every later item; one that cannot be pickled would come back as
    pickle's own error."""
    err = unpicklable(exc)
    if err is None:
        return None
    return RuntimeError(f"prepare raised {describe(exc)} (it cannot be sent back from its worker process: "
                        f"{describe(err)}); make the exception picklable to receive it as itself")
