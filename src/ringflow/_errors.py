"""The exceptions ringflow raises.

Every error says what was wrong and, where the caller can fix it, what to change.
"""

from __future__ import annotations

import logging
import pickle
import warnings


def describe(exc: BaseException) -> str:
    """``"Type: text"`` for ``exc``, its type's name and ``str(exc)``; never raises. An
    exception whose ``str()`` raises (a broken ``__str__`` of the user's) is described as
    ``"Type: <str() raised Error>"``: the message being built is for another error, which must
    still be raised."""
    try:
        text = str(exc)
    except Exception as err:  # noqa: BLE001 - whatever a user's __str__ raises
        text = f"<str() raised {type(err).__name__}>"
    return f"{type(exc).__name__}: {text}"


def interrupt_behind(exc: BaseException) -> "BaseException | None":
    """The KeyboardInterrupt or SystemExit ``exc`` stands for, if any, found along its causes:
    the simulated GPU runs a launched function later, inside another call, and reports what it
    raised, Ctrl-C included, as that call's LaunchError (its cause)."""
    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            return exc
        exc, seen = exc.__cause__, seen + 1
    return None


def shown(value: object, width: int = 80) -> str:
    """``repr(value)`` cut to ``width`` characters, for a message about the user's ``value``;
    never raises (a broken ``__repr__`` shows as ``<Type object: repr() raised Error>``)."""
    try:
        text = repr(value)
    except Exception as err:  # noqa: BLE001 - whatever a user's __repr__ raises
        return f"<{type(value).__name__} object: repr() raised {type(err).__name__}>"
    return text if len(text) <= width else text[:width - 3] + "..."


def unpicklable(exc: BaseException) -> "Exception | None":
    """None where ``exc`` survives being sent to another process (pickled, then unpickled);
    else what failed. One that pickles but does not unpickle (an ``__init__`` taking other
    arguments than its ``args``) fails only on the receiving side, so both ways are tried."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception as err:  # noqa: BLE001 - what pickle raises varies (TypeError, AttributeError, ...)
        return err
    return None


def warn_quietly(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` for a finaliser, which must go on to release what it holds: where
    warnings are made errors (``-W error``) the message goes to the log instead of raising."""
    try:
        warnings.warn(message, category, stacklevel=3)
    except Exception:  # noqa: BLE001 - the warning raised: it is an error here
        logging.getLogger("ringflow").warning("%s: %s", category.__name__, message)


class RingflowError(Exception):
    """Base class of ringflow's own errors."""


class HazardError(RingflowError):
    """Two accesses to the same bytes are not ordered by any stream, event or sync.

    Raised by the simulated GPU's happens-before checker. ``first`` and ``second`` are the
    two conflicting :class:`~ringflow._device.sim.hazard.Access` records; the message names
    the operation, the actor (stream or host thread), the buffer and the byte range of each.
    """

    def __init__(self, message: str, first=None, second=None):
        super().__init__(message)
        self.first = first
        self.second = second


class DeviceError(RingflowError):
    """The device reported an error.

    ``sticky`` is True when the error poisons the whole context (an illegal address in a
    kernel, say): every later call fails too and the process must create a new context.
    """

    def __init__(self, message: str, *, sticky: bool = False):
        super().__init__(message)
        self.sticky = sticky


class OutOfMemoryError(DeviceError, MemoryError):
    """The device had no memory for an allocation: device memory (``CUDA_ERROR_OUT_OF_MEMORY``
    from the stream-ordered pool, or the simulated GPU's total memory in use) or pinned host
    memory.

    Never sticky: the context stays usable, and the allocation may succeed once memory is freed.
    It is also a ``MemoryError``, Python's out-of-memory error, so one ``except MemoryError``
    serves both backends and numpy's own. A pipeline or job whose ring cannot be allocated
    raises one naming the ring, ``chunk_bytes`` and the slots that asked for the memory.
    """

    def __init__(self, message: str, *, sticky: bool = False):
        # ``sticky`` is taken so that code rebuilding a DeviceError of the same type with
        # ``type(err)(text, sticky=err.sticky)`` works; an out-of-memory never breaks a context
        if sticky:
            raise ValueError("an OutOfMemoryError is never sticky: running out of memory leaves the context usable")
        super().__init__(message, sticky=False)


class LaunchError(DeviceError):
    """A launched compute callable failed while it ran on the device.

    On the simulated GPU a callable runs when its operation completes in virtual time, so
    its exception is reported by the first event recorded after it on the same stream
    (``Event.error``, and raised by ``Event.sync()``); the original is ``__cause__``. The
    stream's next ``sync()`` raises it too, in words, where such an event reported it first.
    """


class CaptureError(DeviceError):
    """Work enqueued while a stream was capturing cannot be part of a graph: a host
    synchronisation or query, a device allocation, a wait on an event recorded outside the
    capture, or a stream that joined the capture and was not joined back. The capture is
    abandoned; the streams are usable again and nothing captured has run.
    """


class StageError(RingflowError):
    """A pipeline stage failed for one chunk.

    ``stage`` is one of ``"prepare"``, ``"h2d"``, ``"compute"``, ``"d2h"``, ``"consume"``, or
    ``"item_nbytes"`` where the pipeline's ``item_nbytes(item)`` raised or gave no byte count (the
    item's prepare then never ran); ``index`` is the chunk's submission index (over several
    devices, its place among every chunk of the call in row order); the original exception is
    ``__cause__``. ``rows``: from a whole-array call (``stream_map``, a ``MapJob``),
    the ``(start, stop)`` rows of ``x`` the failed chunk held, as the call cut them; None from a
    pipeline's items.
    """

    def __init__(self, stage: str, index: int, cause: BaseException | None = None):
        what = describe(cause) if cause is not None else "failed"
        super().__init__(f"stage {stage!r} failed for chunk {index}: {what}")
        self.stage = stage
        self.index = index
        # (an instance attribute, not a class one: Ray's copy of a raised error, a class made from
        # both its own and this one, finds it on the original only where the class has none)
        self.rows: "tuple[int, int] | None" = None
        if cause is not None:
            self.__cause__ = cause

    def __reduce__(self):
        return (type(self), (self.stage, self.index, self.__cause__), {"rows": self.rows, "args": self.args})


class PrepareStopped(RingflowError):
    """A ``prepare`` that :meth:`~ringflow.Pipeline.cancel` stopped by ending the worker process
    running it (``processes=True``): its chunk ends CANCELLED, not FAILED. Never reaches the
    caller: the scheduler takes it as the chunk's cancellation."""
