"""Ctrl-C at any instruction: a KeyboardInterrupt raised inside chosen functions at the n-th
instruction they run on the calling thread (or at several: Ctrl-C pressed again), as a signal
could raise it between any two; or a real SIGINT sent there, for code that handles the signal."""

from __future__ import annotations

import dis
import signal
import sys
from typing import Iterable


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

    def __enter__(self) -> "InterruptAt":
        sys.settrace(self._call)
        sys.setprofile(self._rearm)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(None)
        sys.setprofile(None)
        self._after_call.clear()
        self._skipping = None
