"""Threads for the pipeline's concurrency tests, bounded in real time.

Every helper here waits in **real** seconds (``concurrent.futures`` over plain futures, never a
pipeline's own virtual-clock timeouts), so a deadlock fails the test with the stacks of the
threads that hung instead of hanging the run. The threads are daemons: a hung one cannot keep
the interpreter alive after the test has failed.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import resource
import signal
import sys
import threading
import traceback
from typing import Any, Callable, Iterable, Optional

from ringflow._bench.stacks import current_frames

JOIN_S = 60.0  # real seconds any one test waits for its threads before calling it a hang


class Hang(AssertionError):
    """Threads did not finish within the real-time bound."""


def start(fn: Callable[..., Any], *args: Any, name: Optional[str] = None) -> concurrent.futures.Future:
    """Run ``fn(*args)`` on a new daemon thread; returns a plain future of its value (or of what
    it raised, BaseException included)."""
    fut: concurrent.futures.Future = concurrent.futures.Future()
    fut.set_running_or_notify_cancel()

    def body() -> None:
        try:
            value = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the test through the future
            fut.set_exception(exc)
        else:
            fut.set_result(value)

    thread = threading.Thread(target=body, name=name or f"test-{getattr(fn, '__name__', 'thread')}", daemon=True)
    fut.thread = thread  # type: ignore[attr-defined]
    thread.start()
    return fut


def join(futs: Iterable[concurrent.futures.Future], timeout: float = JOIN_S) -> list:
    """Wait (real seconds) for every future of :func:`start`; returns their values in order.

    Raises:
        Hang: some did not finish in ``timeout`` (the message holds every thread's stack).
        the first exception a thread raised, once all have finished.
    """
    futs = list(futs)
    done, not_done = concurrent.futures.wait(futs, timeout=timeout)
    if not_done:
        raise Hang(f"{len(not_done)} of {len(futs)} threads still running after {timeout} real seconds:\n"
                   + all_stacks())
    return [f.result() for f in futs]


def run_all(fns: Iterable[Callable[[], Any]], timeout: float = JOIN_S) -> list:
    """Start every ``fn`` on its own thread at once and :func:`join` them."""
    return join([start(fn, name=f"test-worker-{k}") for k, fn in enumerate(fns)], timeout)


def racing(fn: Callable[[], Any], threads: int, timeout: float = JOIN_S) -> list:
    """:func:`run_all` of ``threads`` copies of ``fn`` started together, the interpreter switching
    between threads as often as it allows meanwhile, so that races show within a few thousand
    steps; the switch interval is restored however they end."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        return run_all([fn] * threads, timeout)
    finally:
        sys.setswitchinterval(interval)


def bounded(fn: Callable[[], Any], timeout: float = JOIN_S) -> Any:
    """``fn()`` on another thread, waited for at most ``timeout`` real seconds (for calls that
    must not hang: ``close()``, ``cancel()``)."""
    return join([start(fn)], timeout)[0]


def all_stacks() -> str:
    frames = current_frames()
    out = []
    for thread in threading.enumerate():
        frame = frames.get(thread.ident)
        if frame is not None:
            out.append(f"--- {thread.name}\n" + "".join(traceback.format_stack(frame)[-8:]))
    return "\n".join(out)


def stack_names(thread: threading.Thread) -> set:
    """The names of the functions on ``thread``'s stack now (empty if it is not running): where a
    stalled thread stands, or whether a thread has entered a call yet."""
    frame = current_frames().get(thread.ident)
    names = set()
    while frame is not None:
        names.add(frame.f_code.co_name)
        frame = frame.f_back
    return names


def wait_until_idle(executor: concurrent.futures.ThreadPoolExecutor, timeout: float = JOIN_S) -> None:
    """Return once every thread ``executor`` has started has finished its work item and counts
    itself idle (polled every 0.01 real seconds: a thread counts itself idle just after its
    future is set, so a caller that saw the future done may still find it busy).

    Raises:
        Hang: they did not, within ``timeout`` real seconds.
    """
    tick = threading.Event()
    for _ in range(int(timeout / 0.01)):
        # (CPython's count of idle threads, and the threads started)
        if executor._idle_semaphore._value >= len(executor._threads) > 0:
            return
        tick.wait(0.01)
    raise Hang(f"the threads of {executor!r} were not all idle after {timeout} real seconds:\n" + all_stacks())


def hold_progress_thread(fut: Any, timeout: float = JOIN_S) -> threading.Event:
    """Hold the thread that runs ``fut``'s done-callbacks (a pipeline's progress thread) in one
    until the returned event is set (or ``timeout`` real seconds pass); returns once it is held."""
    holding, release = threading.Event(), threading.Event()
    caller = threading.current_thread()
    ran_on: list = []

    def hold(_fut: Any) -> None:  # on the progress thread, outside the lock: nothing advances meanwhile
        ran_on.append(threading.current_thread())
        holding.set()
        if ran_on[0] is not caller:  # a future already done runs it at once, here: hold nothing
            release.wait(timeout)

    fut.add_done_callback(hold)
    if not holding.wait(timeout):
        raise Hang(f"the progress thread never ran the holding callback in {timeout} real seconds:\n"
                   + all_stacks())
    assert ran_on[0] is not caller, "the future was done already: no progress thread was held"
    return release


def pause_first_shared_copy(pipe: Any, small: Any, timeout: float = JOIN_S) -> tuple:
    """``pipe.submit(small)`` (an item that shares a chunk) on another thread, held after its bytes
    are in the shared chunk and before its copy counts as ended (``member_written``): the chunk
    stays in the inbox, not admittable, until the returned event is set. Returns
    ``(release, the submit's future)`` once the submit is held there."""
    sched = pipe.scheduler
    copying, release = threading.Event(), threading.Event()
    real_written = sched.member_written

    def member_written(chunk: Any, member: Any, span: Any) -> None:
        if not copying.is_set():  # the first copy only
            copying.set()
            if not release.wait(timeout):
                raise Hang(f"the paused shared copy was not released in {timeout} real seconds")
        real_written(chunk, member, span)

    sched.member_written = member_written
    fut = start(pipe.submit, small)
    if not copying.wait(timeout):
        raise Hang(f"the submit never reached the end of its copy in {timeout} real seconds:\n" + all_stacks())
    return release, fut


class CancelAfter:
    """Cancels ``pipe`` from a thread of its own (:attr:`thread`, a future of :func:`start`) once
    :meth:`count` has counted ``n`` results: a cancel that comes while a map runs elsewhere."""

    def __init__(self, pipe: Any, n: int = 2) -> None:
        self._pipe, self._n, self._counted = pipe, n, 0
        self._reached = threading.Event()
        self.thread = start(self._cancel, name="test-canceller")

    def count(self, result: Any) -> Any:
        """Count one result handed out; returns it unchanged."""
        self._counted += 1
        if self._counted == self._n:
            self._reached.set()
        return result

    def _cancel(self) -> None:
        assert self._reached.wait(JOIN_S), f"fewer than {self._n} results came to cancel after"
        self._pipe.cancel()


def interrupt_main() -> None:
    """Deliver a real SIGINT to the main thread: unlike ``_thread.interrupt_main`` it also wakes a
    main thread blocked in a lock or condition wait, which then raises KeyboardInterrupt."""
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


def rss_bytes() -> int:
    """The process's resident set size now, in bytes (Linux /proc; falls back to the peak)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


async def tick_then_release(ticks: list, release: threading.Event, turns: int = 5) -> None:
    """Append to ``ticks`` on each of ``turns`` turns of the running event loop, then set
    ``release``: a call that blocked the loop until ``release`` was set would never see a tick."""
    import asyncio

    for k in range(turns):
        ticks.append(k)
        await asyncio.sleep(0)
    release.set()


class LogRecords(logging.Handler):
    """The records a logger emits at ``level`` or above, and an event set as each arrives (to
    wait for a warning another thread logs, without sleeping)."""

    def __init__(self, level: int = logging.DEBUG):
        super().__init__(level)
        self.records, self.arrived = [], threading.Event()

    def emit(self, record):
        self.records.append(record)
        self.arrived.set()
