"""Ctrl-C at any instruction: a KeyboardInterrupt raised inside chosen functions at the n-th
instruction they run on the calling thread (or at several: Ctrl-C pressed again), as a signal
could raise it between any two; or a real SIGINT sent there, for code that handles the signal.
Also Ctrl-C sent to the main thread while a call there waits on a stalled thread, checked to get out
of the call while the stall lasts (:class:`CtrlCWhileStalled`)."""

from __future__ import annotations

import dis
import signal
import sys
import threading
from typing import Any, Callable, Iterable, Optional

from tests.helpers.threads import JOIN_S, all_stacks, interrupt_main, join, stack_names, start

# How long (real seconds) a test lets a stalled call block after Ctrl-C before it calls the call
# hung and lets the stall end: far longer than an interrupted call takes to raise, short enough
# that a hang fails the test in reasonable time.
STALL_S = 15.0


class InterruptAt:
    """Within the ``with`` block, raise KeyboardInterrupt at the ``n``-th instruction (counted from
    0) run by a function named in ``names`` whose file path contains one of ``files``, on this
    thread only (``n`` a collection: at each of those); :attr:`seen` counts the instructions run,
    :attr:`fired` how many interrupts were raised (:attr:`where_fired`: the file of each), and
    :attr:`functions` names the function of each instruction counted (a run that fires at none,
    ``n`` past its end, maps where each instruction is).

    Only instructions where CPython raises a pending signal's exception count: a function's
    start (its first traced instruction: ``RESUME`` on 3.11, the one after it from 3.12, where
    the call event comes after ``RESUME``), a backward jump, and the instruction after a call (not, say, between a ``with``
    statement's lock acquisition and its block, where no signal is ever raised). CPython stops
    tracing a frame once a trace function raised in it, so after the first interrupt only the
    functions called later are traced (a profile hook switches tracing on again for them).

    ``sigint``: send the calling (main) thread a SIGINT there instead of raising, so that the
    process's SIGINT handler decides: Python's default raises KeyboardInterrupt at once, as
    above; a handler that defers it (ringflow's whole-array calls) is exercised as Ctrl-C would.

    ``skip``: (file part, function name) pairs whose calls, and everything they call, are not
    counted (code the test does not cover).
    """

    def __init__(self, n: int | Iterable[int], names: Iterable[str],
                 files: Iterable[str] = ("/ringflow/_pipeline/",), *, sigint: bool = False,
                 skip: Iterable[tuple[str, str]] = ()):
        self.sigint = sigint
        self.at = frozenset([n] if isinstance(n, int) else n)
        self.names, self.files = frozenset(names), tuple(files)
        self.skip = tuple(skip)
        self.seen, self.fired = 0, 0
        self.functions: list = []
        self.where_fired: list = []
        self._after_call: dict = {}  # frame -> whether its last instruction was a call
        self._skipping = None  # the skipped frame now running, if any

    def _call(self, frame, event, arg):
        if self._skipping is not None:
            return None
        code = frame.f_code
        if any(code.co_name == name and part in code.co_filename.replace("\\", "/") for part, name in self.skip):
            self._skipping = frame
            return self._until_return
        if code.co_name in self.names and any(f in code.co_filename.replace("\\", "/") for f in self.files):
            frame.f_trace_opcodes = True
            if sys.version_info >= (3, 12):
                # from 3.12 (tracing built on sys.monitoring) a frame's opcode events start only
                # once the trace function is set again after f_trace_opcodes
                sys.settrace(self._call)
            return self._step
        return None

    def _step(self, frame, event, arg):
        if event == "opcode" and self.fired < len(self.at):
            name = dis.opname[frame.f_code.co_code[frame.f_lasti]]
            first = frame not in self._after_call
            eligible = first or name == "JUMP_BACKWARD" or self._after_call.get(frame, False)
            self._after_call[frame] = name.startswith("CALL")
            if eligible:
                self.seen += 1
                self.functions.append(frame.f_code.co_name)
                if self.seen - 1 in self.at:
                    self.fired += 1
                    self.where_fired.append(frame.f_code.co_filename)
                    # frames seen keep their place (a frame's first instruction counts once)
                    self._after_call = dict.fromkeys(self._after_call, False)
                    if self.sigint:
                        signal.raise_signal(signal.SIGINT)
                        return self._step
                    raise KeyboardInterrupt(f"injected at instruction {self.seen - 1}")
        return self._step

    def _until_return(self, frame, event, arg):
        if event == "return" and frame is self._skipping:
            self._skipping = None
        return self._until_return

    def _rearm(self, frame, event, arg):
        if event == "call" and self.fired < len(self.at) and sys.gettrace() is None:
            sys.settrace(self._call)
            # the frame being entered had its call event already: trace it from here on too
            local = self._call(frame, event, arg)
            if local is not None:
                frame.f_trace = local

    def __enter__(self) -> "InterruptAt":
        sys.settrace(self._call)
        sys.setprofile(self._rearm)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(None)
        sys.setprofile(None)
        self._after_call.clear()
        self._skipping = None


def call_interrupted_at(n: int, fn: Callable[[], Any], names: Iterable[str], files: Iterable[str]) -> tuple:
    """``fn()`` under :class:`InterruptAt` ``(n, names, files)``, its KeyboardInterrupt caught:
    returns the hook and ``fn``'s result (None where it was interrupted). A sweep of ``n`` from 0
    has reached past the call's end once ``hook.fired == 0``."""
    got = None
    with InterruptAt(n, names=names, files=files) as hook:
        try:
            got = fn()
        except KeyboardInterrupt:
            pass
    return hook, got


def once_inside(name: str, thread: Optional[threading.Thread] = None) -> Callable[[], bool]:
    """A ``ready`` for :class:`CtrlCWhileStalled`: polls (every 0.01 real seconds, for at most
    ``JOIN_S``) until a function named ``name`` is on ``thread``'s stack (the main thread's by
    default), that is until the call has got that far; returns True then or once the time is up
    (Ctrl-C is sent either way: a call that never got there fails the checks instead)."""

    def ready() -> bool:
        tick = threading.Event()
        for _ in range(int(JOIN_S / 0.01)):
            if name in stack_names(thread or threading.main_thread()):
                break
            tick.wait(0.01)
        return True

    return ready


class CtrlCWhileStalled:
    """Ctrl-C on the calling (main) thread while a call there waits on something a stalled thread
    keeps (user code that does not return until one of ``release`` is set).

    Made, it starts a watchdog thread that waits until ``ready()`` is true (the call is stalled),
    sends Ctrl-C with ``deliver()`` (a real SIGINT by default) and waits up to ``stall_s`` real
    seconds for the call to raise KeyboardInterrupt. If none came it stores every thread's stacks
    in :attr:`hung`, runs ``on_hang(self)`` (another Ctrl-C, say) and sets ``release`` so that the
    call can end and the test fail. Then it runs ``hold()`` where given (the stall lasts until it
    returns) and sets ``release``. Where ``ready()`` is false it sends nothing and sets nothing:
    :meth:`finish` lets the stall end.

    :meth:`call` runs the call on this thread, :meth:`finish` ends the stall and joins the
    watchdog, :meth:`check` asserts the outcome; :meth:`run` does all three.
    """

    def __init__(self, release: threading.Event | Iterable[threading.Event], *,
                 ready: Callable[[], Any] = lambda: True, deliver: Callable[[], None] = interrupt_main,
                 on_hang: Optional[Callable[["CtrlCWhileStalled"], None]] = None,
                 hold: Optional[Callable[[], Any]] = None, stall_s: float = STALL_S):
        self.releases = [release] if isinstance(release, threading.Event) else list(release)
        self.stall_s = stall_s
        self.raised = threading.Event()  # set once the call raised KeyboardInterrupt
        self.hung: Optional[str] = None  # every thread's stacks, where Ctrl-C did not get out in time
        self.interrupted: Optional[bool] = None  # the call raised: whether the stall still lasted then
        self.returned: Optional[bool] = None  # the call returned: whether the stall still lasted then
        self._ready, self._deliver, self._on_hang, self._hold = ready, deliver, on_hang, hold
        self._watchdog = start(self._watch, name="test-ctrl-c-watchdog")

    def stalled(self) -> bool:
        """Whether the stall still lasts (none of ``release`` is set)."""
        return not any(e.is_set() for e in self.releases)

    def _release(self) -> None:
        for e in self.releases:
            e.set()

    def _watch(self) -> None:
        if not self._ready():
            return
        self._deliver()
        if not self.raised.wait(self.stall_s):
            self.hung = all_stacks()
            if self._on_hang is not None:
                self._on_hang(self)
            self._release()
        if self._hold is not None:
            self._hold()
        self._release()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` here, recording whether it raised KeyboardInterrupt (:attr:`interrupted`)
        or returned (:attr:`returned`) while the stall lasted; returns its value (None where it
        raised). Other exceptions pass through."""
        try:
            value = fn()
        except KeyboardInterrupt:
            self.interrupted = self.stalled()
            self.raised.set()
            return None
        self.returned = self.stalled()
        return value

    def finish(self) -> None:
        """End the stall (set ``release``) and join the watchdog (bounded in real seconds: raises
        tests.helpers.threads.Hang if it does not end)."""
        self._release()
        join([self._watchdog])

    def check(self, what: str, *, raises: bool = True) -> None:
        """Assert that Ctrl-C got out of ``what`` (named in the messages) within ``stall_s``, and
        that the call raised KeyboardInterrupt while the stall lasted (``raises=False``: that it
        returned while the stall lasted, without waiting for it). Raises AssertionError if not."""
        assert self.hung is None, f"Ctrl-C did not get out of {what} in {self.stall_s} s:\n{self.hung}"
        if raises:
            assert self.interrupted, f"{what} did not raise KeyboardInterrupt while stalled"
        else:
            assert self.returned, f"{what} waited for the stall"

    def run(self, fn: Callable[[], Any], what: str, *, raises: bool = True) -> Any:
        """:meth:`call`, :meth:`finish`, then :meth:`check`; returns ``fn``'s value (None where it
        raised)."""
        value = self.call(fn)
        self.finish()
        self.check(what, raises=raises)
        return value
