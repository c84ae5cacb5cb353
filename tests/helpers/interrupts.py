"""Ctrl-C at any instruction: a KeyboardInterrupt raised inside chosen functions at the n-th
instruction they run on the calling thread (or at several: Ctrl-C pressed again), as a signal
could raise it between any two."""

from __future__ import annotations

import dis
import sys
from typing import Iterable


class InterruptAt:
    """Within the ``with`` block, raise KeyboardInterrupt at the ``n``-th instruction (counted from
    0) run by a function named in ``names`` whose file path contains one of ``files``, on this
    thread only (``n`` a collection: at each of those); :attr:`seen` counts the instructions run,
    :attr:`fired` how many interrupts were raised.

    Only instructions where CPython raises a pending signal's exception count: a function's
    start, a backward jump, and the instruction after a call (not, say, between a ``with``
    statement's lock acquisition and its block, where no signal is ever raised). CPython stops
    tracing a frame once a trace function raised in it, so after the first interrupt only the
    functions called later are traced (a profile hook switches tracing on again for them).
    """

    def __init__(self, n: int | Iterable[int], names: Iterable[str],
                 files: Iterable[str] = ("/ringflow/_pipeline/",)):
        self.at = frozenset([n] if isinstance(n, int) else n)
        self.names, self.files = frozenset(names), tuple(files)
        self.seen, self.fired = 0, 0
        self._after_call: dict = {}  # frame -> whether its last instruction was a call

    def _call(self, frame, event, arg):
        code = frame.f_code
        if code.co_name in self.names and any(f in code.co_filename.replace("\\", "/") for f in self.files):
            frame.f_trace_opcodes = True
            return self._step
        return None

    def _step(self, frame, event, arg):
        if event == "opcode" and self.fired < len(self.at):
            name = dis.opname[frame.f_code.co_code[frame.f_lasti]]
            eligible = name in ("RESUME", "JUMP_BACKWARD") or self._after_call.get(frame, False)
            self._after_call[frame] = name.startswith("CALL")
            if eligible:
                self.seen += 1
                if self.seen - 1 in self.at:
                    self.fired += 1
                    self._after_call.clear()
                    raise KeyboardInterrupt(f"injected at instruction {self.seen - 1}")
        return self._step

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
