"""Ctrl-C during a ringflow call, delivered where the call can stop cleanly.

A whole-array call (``stream_map``, a ``MapJob`` call) runs the scheduler, or enqueues the
direct engine's operations, on the calling thread. A KeyboardInterrupt that SIGINT raises at an
arbitrary instruction there could land in the middle of a stage change (a slot half moved), in
the clean-up after another failure, or between the call's end and its engine being parked or
closed: a clean-up that cannot drain, buffers freed under copies still in flight, an engine
neither parked nor closed. A :class:`~ringflow.Pipeline`'s calls hand work over in single
steps, but they run the ``threading`` module's Python code, where an interrupt between taking
a lock and entering the block that releases it leaves the lock taken for ever (and the
pipeline's progress thread waiting for it).

So while such a call runs on the main thread under Python's default SIGINT handler,
:func:`shielded` installs a handler that only records the signal, and the call raises
KeyboardInterrupt at its next :func:`checkpoint`: between two scheduler steps, between the
direct engine's chunks, at every turn of a wait and as it ends (at most a poll interval apart on
a GPU). From there the usual clean-up cancels and settles what was enqueued, as for any
failure, and runs shielded too. A second Ctrl-C before the first was delivered, or during that clean-up, raises at
once, as without the shield: the way out of a clean-up that does not end. A Ctrl-C that arrives
after the call's last checkpoint is raised when the call returns, so none is ever lost. A call
from another thread (SIGINT goes to the main thread), or a process whose SIGINT handler is its
own, is left alone.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Iterator, Optional, TypeVar

# the C module that ``signal`` wraps: its calls convert to and from enums, a few microseconds
# each, and a shielded call makes four of them
import _signal

_SIGINT = _signal.SIGINT


class Shield:
    """The state of one shielded call: a Ctrl-C recorded and not yet raised, one raised at a
    checkpoint, whether the call is settling (no more checkpoints raise), how many blocks share
    it, and how many of them hold a lock only for a moment (:class:`ShieldedCondition`)."""

    __slots__ = ("pending", "delivered", "settling", "depth", "holding", "device_calls")

    def __init__(self) -> None:
        self.device_calls = 0  # > 0 inside interruptible_device_calls
        self.pending = False
        self.delivered = False
        self.settling = False
        self.depth = 0
        self.holding = 0

    def handle(self, signum: int, frame) -> None:
        """The SIGINT handler while shielded: record the first Ctrl-C, raise on the next (but
        while a lock is held for a moment, record that one too: raised there, it would leave
        the lock taken, and the moment ends soon)."""
        if self.holding:
            self.pending = True
            return
        if self.pending or self.delivered:
            self.pending, self.delivered = False, True
            raise KeyboardInterrupt
        self.pending = True

    def settle(self) -> None:
        """The call failed and is settling what it enqueued: checkpoints raise no more (a Ctrl-C
        meanwhile is recorded, and raised once the call returns)."""
        self.settling = True


_active: Optional[Shield] = None  # the main thread's shielded call, if any (only it gets SIGINT)


def checkpoint() -> None:
    """Raise KeyboardInterrupt here if a Ctrl-C arrived since the call began (and none was raised
    yet); a place where stopping leaves nothing half done. Costs a global read otherwise."""
    shield = _active
    if shield is not None and shield.pending and not shield.settling \
            and threading.current_thread() is threading.main_thread():
        shield.pending = False
        shield.delivered = True
        raise KeyboardInterrupt


def shielding_here() -> bool:
    """Whether the calling thread is in a shielded call (the main thread, under the default
    handler): a Ctrl-C it gets waits for a :func:`checkpoint`, so its waits must reach one."""
    return _active is not None and threading.current_thread() is threading.main_thread()


def interrupt_pending() -> bool:
    """Whether the next :func:`checkpoint` on the calling thread raises KeyboardInterrupt."""
    shield = _active
    return (shield is not None and shield.pending and not shield.settling
            and threading.current_thread() is threading.main_thread())


class shielded:
    """``with shielded() as shield:`` defers SIGINT to :func:`checkpoint` within the block (see
    the module's doc); ``shield`` is the :class:`Shield`, or None where the call is left alone.
    Re-entrant: an inner block shares the outer's shield. Leaving the outermost block raises
    KeyboardInterrupt if a Ctrl-C is still pending."""

    __slots__ = ("shield",)

    # Entering and leaving order their steps so that a second Ctrl-C raised between any two
    # (which a shield lets through at once) leaves no shield that later blocks would nest into
    # while its handler is gone, nor a handler of a shield that is gone: either is seen as
    # stale by the next outermost block, which starts afresh. Leaving, the shield stops being
    # active before its handler goes: a Ctrl-C raised as the handler is looked at (right after
    # that call into C) would otherwise leave both in place, a shield that has raised once and
    # that the next call would nest into, taking its first Ctrl-C at once.
    def __enter__(self) -> Optional[Shield]:
        global _active
        if threading.current_thread() is not threading.main_thread():
            self.shield = None
            return None
        handler = _signal.getsignal(_SIGINT)
        if _active is not None and handler == _active.handle:
            self.shield = _active
            _active.depth += 1
        elif handler is not _signal.default_int_handler and not isinstance(getattr(handler, "__self__", None), Shield):
            self.shield = None  # the application's own handler decides
        else:
            shield = Shield()
            shield.depth = 1
            _signal.signal(_SIGINT, shield.handle)
            self.shield = _active = shield
        return self.shield

    def __exit__(self, *exc_info) -> None:
        global _active
        shield = self.shield
        if shield is None:
            return
        shield.depth -= 1
        if shield.depth:
            return
        if _active is shield:
            _active = None
        if _signal.getsignal(_SIGINT) == shield.handle:  # unless the block installed its own
            _signal.signal(_SIGINT, _signal.default_int_handler)
        if shield.pending:
            shield.pending = False
            raise KeyboardInterrupt


class interruptible_device_calls:
    """``with interruptible_device_calls():`` on the main thread in a shielded call: a device call
    inside the block whose take of the simulated GPU's lock waits (another thread keeps it,
    running a stage inside a device wait) takes it in polls, and a Ctrl-C meanwhile is raised
    there, before the call has done anything (:func:`take_device_lock`). Only for a caller
    that an interrupt there leaves consistent: a submit's copy of its item, before the item is
    accepted or with its take-back ready. Elsewhere (another thread, no shield) it does nothing."""

    __slots__ = ("shield",)

    def __enter__(self) -> None:
        shield = _active
        if shield is None or threading.current_thread() is not threading.main_thread():
            self.shield = None
            return
        self.shield = shield
        shield.device_calls += 1

    def __exit__(self, *exc_info: Any) -> None:
        if self.shield is not None:
            self.shield.device_calls -= 1


class try_lock:
    """``with try_lock(lock) as taken:``: ``lock`` taken if it is free this instant (``taken``),
    and let go as the block ends; never waits. On the main thread in a shielded call, a Ctrl-C
    from the take to the end of the block is recorded, a second one too (raised at the next
    :func:`checkpoint`, or as the call ends), as while a :class:`ShieldedCondition` is held: one
    raised between the take and the block would leave the lock taken for ever."""

    __slots__ = ("lock", "taken", "shield")

    def __init__(self, lock: Any) -> None:
        self.lock = lock
        self.taken = False
        self.shield: Optional[Shield] = None

    def __enter__(self) -> bool:
        shield = _active if threading.current_thread() is threading.main_thread() else None
        if shield is not None:
            shield.holding += 1  # (before the take: from there on a Ctrl-C is only recorded)
            self.shield = shield
        self.taken = self.lock.acquire(False)
        return self.taken

    def __exit__(self, *exc_info: Any) -> None:
        if self.taken:
            self.taken = False
            self.lock.release()
        shield, self.shield = self.shield, None
        if shield is not None:
            shield.holding -= 1


_DEVICE_POLL_S = 0.05  # the longest a take of the device's lock waits before it looks for a Ctrl-C


def take_device_lock(lock: Any) -> bool:
    """Take a simulated GPU's ``lock`` (another thread keeps it): within
    :class:`interruptible_device_calls` on the main thread, in polls, raising KeyboardInterrupt
    (nothing taken) at a Ctrl-C; elsewhere, a plain wait. Returns True once taken."""
    shield = _active
    if (shield is None or not shield.device_calls
            or threading.current_thread() is not threading.main_thread()):
        return lock.acquire()
    while not lock.acquire(True, _DEVICE_POLL_S):
        checkpoint()
    return True


F = TypeVar("F", bound=Callable[..., Any])


def shielded_call(fn: F) -> F:
    """``fn`` run within :func:`shielded` (a public method of a pipeline)."""
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with shielded():
            return fn(*args, **kwargs)
    return call  # type: ignore[return-value]


class ShieldedIterator:
    """``iterator``'s items, each step taken within :func:`shielded`: the library's code between
    two items takes Ctrl-C at its checkpoints only; the caller's loop body between them is not
    shielded."""

    __slots__ = ("_iterator",)

    def __init__(self, iterator: Iterator[Any]):
        self._iterator = iterator

    def __iter__(self) -> "ShieldedIterator":
        return self

    def __next__(self) -> Any:
        with shielded():
            return next(self._iterator)

    def close(self) -> None:
        """Stop early: the iterator's clean-up runs (as a generator's ``close``)."""
        with shielded():
            close = getattr(self._iterator, "close", None)
            if close is not None:
                close()


class ShieldedCondition(threading.Condition):
    """A :class:`threading.Condition` (on an RLock) whose lock, while the main thread holds it,
    defers Ctrl-C as :func:`shielded` does: a KeyboardInterrupt is raised only once the main
    thread has let go of it (at its outermost release).

    For the condition a pipeline's futures share. The standard library's
    ``concurrent.futures.wait`` and ``as_completed`` take it in a Python loop, once a future, and
    let go of it in another: a Ctrl-C raised between two instructions there would leave it taken
    for ever, and the progress thread, which sets every future under it, waiting for it. Other
    threads take it as a plain condition's lock (SIGINT only ever reaches the main thread)."""

    def __init__(self) -> None:
        super().__init__(threading.RLock())
        self._main_shields: list = []  # the main thread's shielded blocks, one a take it holds
        # Condition.__init__ binds acquire and release to the lock's own: these come first
        self.acquire = self._acquire  # type: ignore[method-assign]
        self.release = self._release  # type: ignore[method-assign]

    def _acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if threading.current_thread() is not threading.main_thread():
            return self._lock.acquire(blocking, timeout)
        block = shielded()
        shield = block.__enter__()  # before the take: the lock is never held outside the shield
        if shield is not None:
            shield.holding += 1
        try:
            taken = self._lock.acquire(blocking, timeout)
        except BaseException:
            _let_go(block, shield)
            raise
        if taken:
            self._main_shields.append(block)
        else:
            _let_go(block, shield)
        return taken

    def _release(self) -> None:
        if threading.current_thread() is not threading.main_thread() or not self._main_shields:
            self._lock.release()
            return
        block = self._main_shields.pop()
        self._lock.release()
        _let_go(block, block.shield)  # after the lock is let go: may raise a deferred Ctrl-C

    def __enter__(self) -> bool:
        return self._acquire()

    def __exit__(self, *exc_info: Any) -> None:
        self._release()


def _let_go(block: shielded, shield: Optional[Shield]) -> None:
    """Leave a :class:`ShieldedCondition`'s shielded block (raises a deferred Ctrl-C at the
    outermost)."""
    try:
        block.__exit__(None, None, None)  # (still holding: a Ctrl-C meanwhile is recorded)
    finally:
        if shield is not None:
            shield.holding -= 1


def _install() -> None:
    """Have a simulated GPU's lock, where its take waits, take it as :func:`take_device_lock`
    does."""
    from .._device.sim.device import set_blocked_take

    set_blocked_take(take_device_lock)


_install()
