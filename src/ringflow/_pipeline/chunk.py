"""One unit of work moving through the pipeline, and the future that reports its end."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import threading
import weakref
from typing import Any, Callable, Optional

import numpy as np

from .._checks import check_wait_timeout
from .ring import Slot
from .states import LEGAL_CHUNK_TRANSITIONS, ChunkState, check_chunk_transition
from .reentry import check_process, refuse_from_stage
from .sigint import shielded
from .uncopyable import Uncopyable

logger = logging.getLogger(__name__)


_b = concurrent.futures._base
_DONE = frozenset((_b.CANCELLED, _b.CANCELLED_AND_NOTIFIED, _b.FINISHED))
_CANCELLED = frozenset((_b.CANCELLED, _b.CANCELLED_AND_NOTIFIED))
_FINISHED, _RUNNING = _b.FINISHED, _b.RUNNING


class ChunkFuture(Uncopyable, concurrent.futures.Future):
    """The :class:`concurrent.futures.Future` of one accepted chunk.

    Its result is set by the pipeline's driver (a progress thread of the pipeline's own, or, for a
    whole-array job, the waiting caller), so ``concurrent.futures.wait``, ``as_completed``,
    ``add_done_callback`` and ``asyncio.wrap_future`` work from any thread. Done-callbacks run on
    the progress thread, outside the pipeline's lock; one may call the pipeline (``submit``,
    ``result``, ``cancel``, ``close``), which then advances on that thread while it waits.
    """

    def __init__(self, driver: Any, index: int):
        # concurrent.futures.Future.__init__'s fields, but the condition is the driver's, shared
        # by all its futures: nothing waits on it (result() waits on the driver), it only
        # guards state changes, and a condition of one's own would cost each request a
        # Condition, an RLock, a deque and five bound methods, all tracked by the cyclic collector
        self._condition = driver.future_condition
        self._state = concurrent.futures._base.PENDING
        self._result = None
        self._exception = None
        self._done_callbacks: list = []
        self._driver = driver
        self.index = index
        self.token: Any = None  # the driver's hand-off token, observed by the thread taking the result
        self._cancel_reason: Optional[str] = None  # why the pipeline cancelled it, where it says (settled_error)
        self._waiters = _Waiters(self)  # where concurrent.futures.wait / as_completed register

    def _await(self, timeout: Optional[float], call: str) -> None:
        timeout = check_wait_timeout(timeout)
        if not self.done():
            driver = self._driver
            self._check_caller(call)
            # Ctrl-C taken at the wait's checkpoints only (sigint.py), and while another thread keeps
            # the lock (the progress thread, through a stage that does not return) too (Hold)
            with shielded(), driver.hold() as hold:
                driver.wait_for(self.done, timeout, f"chunk {self.index}", hold=hold)

    def result(self, timeout: float | None = None) -> Any:
        """The consumer's value; raises the chunk's error (a StageError, or the original
        KeyboardInterrupt/SystemExit), CancelledError, or TimeoutError after ``timeout`` seconds
        of the device's host clock (virtual seconds on the simulated GPU; None or infinity waits
        without limit, a negative number does not wait). TypeError or ValueError for a
        ``timeout`` that is not a number, or NaN."""
        self._await(timeout, "result()")
        self._driver.device.observe(self.token)
        error = self.settled_error()
        if error is not None:
            try:
                raise error
            finally:
                del error, self  # no cycle through this frame (as concurrent.futures does)
        return self._result

    def exception(self, timeout: float | None = None) -> Optional[BaseException]:
        self._await(timeout, "exception()")
        self._driver.device.observe(self.token)
        return self.settled_error()

    # Reads of a future's state take no lock here: the state is one attribute, set by the driver
    # (under the futures' condition) after the result or exception it announces, and a read of
    # it is atomic. concurrent.futures takes the condition, which every future of the pipeline
    # shares, for each read: contention with the progress thread for nothing.
    def done(self) -> bool:
        return self._state in _DONE

    def cancelled(self) -> bool:
        return self._state in _CANCELLED

    def running(self) -> bool:
        return self._state == _RUNNING

    def settled_error(self) -> Optional[BaseException]:
        """The exception of a future that is done (None: it delivered a value). Raises
        CancelledError for a cancelled one, TimeoutError for one not done."""
        state = self._state
        if state in _CANCELLED:
            reason = self._cancel_reason
            raise concurrent.futures.CancelledError(*(() if reason is None else (reason,)))
        if state != _FINISHED:
            raise concurrent.futures.TimeoutError()
        return self._exception

    def failed_with(self, err: BaseException) -> bool:
        """Whether ``err``, raised while taking this future's result, is the chunk's own failure
        (a KeyboardInterrupt its stage raised is; a Ctrl-C in the caller's wait is not)."""
        return self._state == _FINISHED and self._exception is err

    def settled_value(self) -> Any:
        """The value of a future that is done and delivered one (see :meth:`settled_error`)."""
        return self._result

    def add_done_callback(self, fn: Callable[["ChunkFuture"], Any]) -> None:
        """As :meth:`concurrent.futures.Future.add_done_callback`; someone now waits for this
        chunk, so the pipeline keeps advancing until it ends (on the simulated GPU too)."""
        if not self.done() and getattr(self._driver, "gated", False):
            # the simulated GPU's progress thread runs only while someone waits: tell it. A real
            # GPU's runs whenever there is work, and a request server's every request would
            # otherwise add an entry it scans.
            # Shielded (sigint.py): asyncio.wrap_future calls this on the loop's thread, where a
            # Ctrl-C inside the threading code of add_interest's wake-up would leave that lock
            # taken. The entry holds the future only weakly and the callback only the entry: no
            # cycle keeps a finished future (and its result) alive until the cyclic collector runs
            with shielded():
                entry = self._driver.add_interest(_done_of(self))
                if not self._add_callback(lambda f, _entry=entry: f._driver.drop_interest(_entry)):
                    self._driver.drop_interest(entry)  # done meanwhile
        added = self._add_callback(fn)  # (its lock is entered in C: no shield needed)
        if not added:  # done already: called at once, as concurrent.futures does (outside the shield)
            try:
                fn(self)
            except Exception:  # noqa: BLE001 - as concurrent.futures: logged, not raised
                concurrent.futures._base.LOGGER.exception("exception calling callback for %r", self)

    def _add_callback(self, fn: Callable[["ChunkFuture"], Any]) -> bool:
        """Add ``fn`` to the callbacks unless the future is done (False: it was not added).
        The condition's lock is entered by its C ``__enter__`` (see above)."""
        with self._condition._lock:  # type: ignore[attr-defined]
            if self._state not in _DONE:
                self._done_callbacks.append(fn)
                return True
        return False

    def cancel(self) -> bool:
        """Cancel this chunk, not only the future: a chunk not yet on the device ends CANCELLED
        at once; one whose copies or kernel are enqueued stops there and ends CANCELLED once
        that work completes (its buffers are freed only then). The future is cancelled at once
        either way. Returns False if the chunk's consumer is running or it has ended, and for
        an item sharing a chunk whose own compute has failed already (it ends FAILED).

        With ``processes=True``, a ``prepare`` of this chunk running in a worker process is
        stopped: that worker is killed (a new one takes its place for later items)."""
        if self.done():
            return False
        return cancel_chunks([self])[0]

    def _check_caller(self, call: str) -> None:
        """Refuse a wait for this chunk where it could not end (:mod:`.reentry`): from inside one
        of its pipeline's stages, or in a child forked after it was made."""
        sched = self._driver.sched  # made in the same process as this future
        check_process(sched.made_in, "Pipeline's future")
        refuse_from_stage(sched.stage_owner, f"ChunkFuture.{call}")

    def _invoke_callbacks(self) -> None:
        # set by the progress thread under the pipeline's lock: its callbacks run once it lets go
        thread = getattr(self._driver, "thread", None)
        if thread is not None and thread is threading.current_thread():
            self._driver.sched.resolved.append(self)
        else:
            super()._invoke_callbacks()

    def _mark_cancelled(self) -> None:
        if not self.done():  # (before the cancel: its callbacks may read the reason)
            self._cancel_reason = self._driver.sched.cancel_reason
        if concurrent.futures.Future.cancel(self):
            concurrent.futures.Future.set_running_or_notify_cancel(self)

    # how its pipeline's driver ends the future, with the chunk's value or error (the executor
    # side's own calls, under names of the driver's: no frame of ours on the per-chunk path)
    _put_result = concurrent.futures.Future.set_result
    _put_error = concurrent.futures.Future.set_exception

    # concurrent.futures.Future's executor side: a chunk's future is settled by its pipeline alone.
    # Taken from the caller, set_result/set_exception put its value in place of the chunk's (which
    # the pipeline then counted as an item failed, with no failure kept), and
    # set_running_or_notify_cancel left the future RUNNING, which no cancel can end.
    def set_result(self, result: Any) -> None:
        raise _settled_by_pipeline("set_result")

    def set_exception(self, exception: Optional[BaseException]) -> None:
        raise _settled_by_pipeline("set_exception")

    def set_running_or_notify_cancel(self) -> bool:
        raise _settled_by_pipeline("set_running_or_notify_cancel")

    def _not_copied(self, what: str) -> str:
        # a copy is no future the pipeline settles (it would stay pending for ever), and a pickle
        # cannot carry the chunk's pipeline to another process
        return (f"a pipeline's future cannot be {what}: only the future submit() returned is settled by its "
                "pipeline; share that one, or take its result() and copy or pickle the result")


def _settled_by_pipeline(call: str) -> RuntimeError:
    return RuntimeError(f"{call}() cannot be called on a pipeline's future: it is settled by its pipeline alone, "
                        "with the chunk's result or error; wait for it (result(), a done-callback), or cancel() it")


def cancel_chunks(futures: "list[ChunkFuture]") -> list:
    """Cancel the chunks of ``futures`` as :meth:`ChunkFuture.cancel` does, with one hand-over to
    each pipeline's driver rather than one a future (a map that stops early cancels its whole
    window: a round trip to the progress thread each would keep an event loop's thread that long).
    Returns, a future each, whether it was cancelled.

    Raises:
        RuntimeError: from inside one of the pipeline's stages, or after fork() (:mod:`.reentry`).
        DeviceError: the first a cancel met (the others are still cancelled).
    """
    outcome = {id(f): False for f in futures}
    first_error = None
    for live in _live_by_driver(futures):
        driver = live[0]._driver
        for f in _stop_prepares(live):  # (ended CANCELLED by that alone, maybe, before the lock is had)
            outcome[id(f)] = True
        with shielded(), driver.hold() as hold:  # (a Ctrl-C gets out; the cancel is still carried out)
            for f in live:
                # ended CANCELLED since: a prepare stopped before it started (its chunk's
                # stop_prepare), or another cancel, which a second cancel() reports as done
                outcome[id(f)] = outcome[id(f)] or f.cancelled()
            live = [f for f in live if not f.done()]
            if not live:
                continue
            for f, flag in zip(live, driver.command(_cancelling(live, driver.sched), hold=hold)):
                if isinstance(flag, BaseException):
                    first_error = first_error or flag
                else:
                    outcome[id(f)] = flag or f.cancelled()
    if first_error is not None:
        raise first_error
    return [outcome[id(f)] for f in futures]


def post_cancel(futures: "list[ChunkFuture]", then: Optional[Callable[[Any], Any]] = None) -> int:
    """Hand the cancel of ``futures``' chunks (as :func:`cancel_chunks`) to their pipelines'
    progress threads and return at once: no wait for a pipeline's lock, which its progress thread
    holds through a whole step, nor for the cancel. For an event loop's thread. ``then(device,
    command)`` is called once per pipeline, on its progress thread, when that pipeline's part is
    done (:meth:`~.driver.ProgressThread.post`). Returns how many pipelines it was handed to.

    Raises:
        RuntimeError: from inside one of the pipeline's stages, or after fork() (nothing handed over).
    """
    groups = _live_by_driver(futures)
    for live in groups:
        driver = live[0]._driver
        _stop_prepares(live)
        hand_back = _ignore if then is None else functools.partial(then, driver.device)
        driver.post(_cancelling(live, driver.sched), hand_back)
    return len(groups)


def _stop_prepares(live: "list[ChunkFuture]") -> list:
    """Kill the worker processes running the prepares of ``live``'s chunks (``processes=True``),
    before the driver's lock is taken (:meth:`.Scheduler.stop_prepare`); returns the futures
    whose worker was killed (their chunks end CANCELLED). Never raises."""
    sched = live[0]._driver.sched
    return [f for f in live if sched.stop_prepare(f.index)]


def _ignore(_command: Any) -> None:
    pass


def _live_by_driver(futures: "list[ChunkFuture]") -> list:
    """The futures not done yet, grouped by driver. Raises as :func:`cancel_chunks` does."""
    by_driver: dict = {}
    for f in futures:
        if not f.done():
            by_driver.setdefault(id(f._driver), []).append(f)
    groups = list(by_driver.values())
    for live in groups:
        live[0]._check_caller("cancel()")
    return groups


def _cancelling(live: "list[ChunkFuture]", sched: Any) -> Callable[[], list]:
    """The command that cancels the chunks of ``live`` (futures of one driver), run by its driving
    thread: returns, a future each, True/False as :meth:`ChunkFuture.cancel`, or the error met."""

    def cancel_each() -> list:
        flags = []
        for f in live:
            if f.done():  # (ended since it was handed over)
                flags.append(False)
                continue
            try:
                flag = sched.cancel_chunk(f.index)
            except BaseException as exc:  # noqa: BLE001 - the rest are still cancelled
                flag = exc
            if flag is True and not f.done():
                # still draining: the future does not wait for that. Marked here, before the
                # next: an item sharing a chunk cancels the chunk itself only once no other item
                # of it is wanted
                f._mark_cancelled()
            flags.append(flag)
        return flags

    return cancel_each


def cancel_unwanted(futures: list, wait: bool = True) -> None:
    """Cancel the chunks a map took and no longer wants, from its clean-up: never raises an
    Exception (a refusal from inside a stage or after fork(), a device found broken), so that it
    cannot mask the error the map is ending with; chunks not cancelled then end by themselves.
    With ``wait``, returns once the driver has cancelled them: a map that ends has nothing of its
    own left to stop (a Ctrl-C may get it out of that wait: the cancel is then still carried
    out); without, hands the cancel over (:func:`post_cancel`) and returns at once."""
    if not futures:
        return
    try:
        if wait:
            cancel_chunks(futures)
        else:
            post_cancel(futures)
    except Exception as exc:  # noqa: BLE001 - clean-up: see above
        logger.debug("a map's unwanted chunks were not cancelled: %r", exc)


def _done_of(fut: ChunkFuture) -> Callable[[], bool]:
    """``fut.done`` without holding ``fut`` (a collected future is done)."""
    ref = weakref.ref(fut)

    def done() -> bool:
        f = ref()
        return f is None or f.done()

    return done


class _Waiters(list):
    """A future's waiter list: ``concurrent.futures.wait`` and ``as_completed`` append to it, which
    tells the simulated GPU's progress thread someone waits (it may then advance the simulated
    clock). Appends run under the future's own lock, so the interest is registered without the
    pipeline's lock."""

    __slots__ = ("_fut", "_driver", "_entries")  # one per request: no __dict__

    def __init__(self, fut: ChunkFuture):
        super().__init__()
        # weakly: a future and its waiter list in a cycle would keep every result alive until
        # the cyclic collector runs (pinned result blocks would pile up between collections)
        self._fut = weakref.ref(fut)
        self._driver = fut._driver
        self._entries: Optional[dict] = None  # made by the first waiter (most futures get none)

    def append(self, waiter: Any) -> None:
        super().append(waiter)
        fut = self._fut()
        if fut is not None and getattr(self._driver, "gated", False) and not fut.done():
            if self._entries is None:
                self._entries = {}
            self._entries[id(waiter)] = self._driver.add_interest(_done_of(fut))

    def remove(self, waiter: Any) -> None:
        super().remove(waiter)
        entry = None if self._entries is None else self._entries.pop(id(waiter), None)
        if entry is not None:
            self._driver.drop_interest(entry)


# what an accept that may not wait for room returns for an item that found none (nothing of it was
# accepted): a map's, an amap's, one offered to each device of a pipeline over several, or the
# first try of a submit, made without the driver's lock
NO_ROOM = object()


@dataclasses.dataclass(eq=False, slots=True)
class Chunk:
    index: int
    item: Any
    future: ChunkFuture
    state: ChunkState = ChunkState.ACCEPTED
    # what prepare wrote into the host-in slot
    shape: tuple[int, ...] = ()
    dtype: Optional[np.dtype] = None
    nbytes: int = 0
    # what compute writes and the d2h brings back (the input's shape and dtype unless an output
    # spec says otherwise)
    out_spec: Optional[tuple] = None
    out_shape: tuple[int, ...] = ()
    out_dtype: Optional[np.dtype] = None
    out_nbytes: int = 0
    # several arrays per item: the packed layout of the input / result (.trees.Packed), whose
    # bytes the chunk moves as uint8; None for one array
    in_tree: Any = None
    out_tree: Any = None
    filled: Optional[list] = None  # fill="rows": where the compute's return (rows filled) lands
    host_in: Optional[Slot] = None
    dev_in: Optional[Slot] = None
    dev_out: Optional[Slot] = None
    host_out: Optional[Slot] = None
    staged: Optional[np.ndarray] = None  # a pinned pool copy of the item made at acceptance, or None
    on_device: Any = None  # a device array item: (BufferSlice, shape, dtype), copied device to device
    source_ready: Any = None  # the event after its producer's work, which the copy waits for
    source: Any = None  # the pinned memory the h2d reads in place (a BufferSlice), or None
    result: Optional[np.ndarray] = None  # the pinned pool array the d2h writes, or None (the host-out slot)
    result_buffer: Any = None  # the pinned buffer behind ``result``
    prepare_task: Any = None
    consume_task: Any = None
    # the scheduler's host work for it, which its last pool task (or, with none, its copy in) comes after; or None
    host_work: Any = None
    h2d_event: Any = None
    compute_event: Any = None
    d2h_event: Any = None
    in_map: bool = False  # a map() will hand out this chunk's result
    # its future's cancel asked for its prepare to be stopped (processes=True): a prepare yet to
    # start in a worker process never starts (Scheduler.stop_prepare)
    stop_prepare: bool = False
    token: Any = None  # the accepting thread's hand-off token, observed when the chunk is admitted
    ending: Optional[ChunkState] = None  # FAILED or CANCELLED once draining
    error: Optional[BaseException] = None
    value: Any = None
    stamps: dict = dataclasses.field(default_factory=dict)  # stage -> (start, end) host-clock seconds
    events: dict = dataclasses.field(default_factory=dict)  # timing events when profiling
    # items sharing this chunk (see Member), or None for a chunk of one item; while the chunk
    # takes more items: its pinned pool array, the bytes used, the items whose copies into it
    # are still being made, and the hand-off tokens of those made
    members: Optional[list] = None
    batch: Optional[np.ndarray] = None
    used: int = 0
    copying: set = dataclasses.field(default_factory=set)  # members whose copy in is being made
    tokens: Optional[list] = None

    def ended(self) -> bool:
        return self.state.final

    def move(self, new: ChunkState) -> None:
        if (self.state, new) not in LEGAL_CHUNK_TRANSITIONS:
            check_chunk_transition(self.index, self.state, new)  # raises IllegalTransition
        self.state = new

    def slots(self) -> list[Slot]:
        seen, out = set(), []
        for s in (self.host_in, self.dev_in, self.dev_out, self.host_out):
            if s is not None and id(s) not in seen:
                seen.add(id(s))
                out.append(s)
        return out


class Member:
    """One item of a chunk that several items share: where its bytes lie in the chunk's block
    (``offset``, ``nbytes``, aligned to :data:`ringflow._plan.SLOT_ALIGN`), what they are (``shape``,
    ``dtype``; its result is the same bytes of the block once the d2h has written them), its own
    future and index, the event after its compute (its errors are its own), the error it failed
    with, if any, whether its submit raised with its take-back still to come (``withdrawn``),
    and the error checked mode's pointwise test found in its result (``broken``: it fails
    with it once its compute's event is done)."""

    __slots__ = ("index", "future", "offset", "nbytes", "shape", "dtype", "event", "error", "withdrawn", "broken")

    def __init__(self, index: int, future: ChunkFuture, offset: int, shape: tuple, dtype: np.dtype, nbytes: int):
        self.index, self.future, self.offset = index, future, offset
        self.shape, self.dtype, self.nbytes = shape, dtype, nbytes
        self.event: Any = None
        self.error: Optional[BaseException] = None
        self.withdrawn = False
        self.broken: Optional[Exception] = None


# at most this many items share a chunk: a chunk's latency grows with its launches
MAX_MEMBERS = 64


Callback = Callable[[], None]
