"""Lazy access to NVIDIA's Python packages, and translation of their errors.

Nothing here imports ``cuda.core`` or ``cuda.bindings`` at module import time, so
``import ringflow._device.cuda`` works on a machine with neither the packages nor a driver.
Every backend module reaches CUDA through :func:`core` and :func:`driver`.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from ..._errors import DeviceError, OutOfMemoryError

# Errors after which the CUDA context is unusable: every later call in this process fails too.
STICKY_ERRORS = frozenset({
    "CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_LAUNCH_FAILED", "CUDA_ERROR_ILLEGAL_INSTRUCTION",
    "CUDA_ERROR_MISALIGNED_ADDRESS", "CUDA_ERROR_INVALID_ADDRESS_SPACE", "CUDA_ERROR_INVALID_PC",
    "CUDA_ERROR_HARDWARE_STACK_ERROR", "CUDA_ERROR_ASSERT", "CUDA_ERROR_LAUNCH_TIMEOUT",
    "CUDA_ERROR_ECC_UNCORRECTABLE", "CUDA_ERROR_CONTEXT_IS_DESTROYED", "CUDA_ERROR_UNKNOWN",
    # the CUDA runtime's spelling, as CuPy and PyTorch report it
    "cudaErrorIllegalAddress", "cudaErrorLaunchFailure", "cudaErrorIllegalInstruction",
    "cudaErrorMisalignedAddress", "cudaErrorInvalidAddressSpace", "cudaErrorInvalidPc",
    "cudaErrorHardwareStackError", "cudaErrorAssert", "cudaErrorLaunchTimeout", "cudaErrorECCUncorrectable",
    "cudaErrorContextIsDestroyed", "cudaErrorUnknown",
})
_ERROR_NAME = re.compile(r"\b(CUDA_ERROR_[A-Z0-9_]+|cudaError[A-Za-z0-9]+)\b")
# PyTorch words its sticky errors without the enum name.
_STICKY_PHRASES = ("illegal memory access", "unspecified launch failure", "misaligned address",
                   "device-side assert", "illegal instruction")

# Errors of an allocation there was no memory for (device memory, or pinned host memory). Not
# sticky: the context stays usable, and the allocation may succeed once memory is freed. They are
# raised as OutOfMemoryError, a MemoryError too, as the simulated GPU's refusals are.
OUT_OF_MEMORY_ERRORS = frozenset({"CUDA_ERROR_OUT_OF_MEMORY", "cudaErrorMemoryAllocation"})
OUT_OF_MEMORY = ("out of memory, not a broken context: the device stays usable; free memory (close buffers, and "
                 "pipelines and jobs holding rings) or ask for fewer bytes")

BROKEN_CONTEXT = ("the CUDA context is broken (a sticky error): every later CUDA call in this process will "
                  "fail too; stop using this device and restart the process")


@functools.lru_cache(maxsize=None)
def core():
    """``cuda.core`` (>= 1.2), imported on first use."""
    import cuda.core as cc

    return cc


@functools.lru_cache(maxsize=None)
def driver():
    """``cuda.bindings.driver``, for the few calls cuda.core has no API for."""
    from cuda.bindings import driver as drv

    return drv


def error_name(exc_or_text: Any) -> str | None:
    """The CUDA error enum name in an exception or message, if any."""
    m = _ERROR_NAME.search(str(exc_or_text))
    return m.group(1) if m else None


def is_sticky(exc: BaseException) -> bool:
    if isinstance(exc, DeviceError):
        return exc.sticky
    name = error_name(exc)
    if name is not None:
        return name in STICKY_ERRORS
    text = str(exc).lower()
    return any(p in text for p in _STICKY_PHRASES)


def _text(what: Any) -> str:
    """``what`` is the message, or a callable making it: hot paths describe their operation
    lazily, so the text (a few reprs) costs nothing unless a call fails."""
    return what() if callable(what) else str(what)


def device_error(what: Any, exc: BaseException) -> DeviceError:
    """A :class:`DeviceError` for ``exc`` raised while doing ``what`` (text, or a callable
    returning it); ``sticky`` set where it is, and an :class:`OutOfMemoryError` (also a
    ``MemoryError``) for an out-of-memory."""
    if isinstance(exc, DeviceError):
        return exc
    what = _text(what)
    sticky = is_sticky(exc)
    msg = f"{what} failed: {type(exc).__name__}: {exc}"
    if sticky:
        msg += f"; {BROKEN_CONTEXT}"
        err = DeviceError(msg, sticky=True)
    elif error_name(exc) in OUT_OF_MEMORY_ERRORS:
        err = OutOfMemoryError(f"{msg}; {OUT_OF_MEMORY}")
    else:
        err = DeviceError(msg)
    err.__cause__ = exc
    return err


def cuda_errors() -> tuple[type[BaseException], ...]:
    """Exception types cuda.core raises for a failed driver call."""
    from cuda.core._utils.cuda_utils import CUDAError  # private path: cuda.core exports no error type

    return (CUDAError,)


def as_device_error(what: Any, exc: BaseException) -> "DeviceError | None":
    """``exc`` as the :class:`DeviceError` it stands for: itself if it is one, a new one naming
    ``what`` for a CUDA error cuda.core raised, None for anything else (not the device's)."""
    if isinstance(exc, DeviceError):
        return exc
    if isinstance(exc, cuda_errors()):
        return device_error(what, exc)
    return None


def check(result: Any, what: Any) -> Any:
    """Check a ``cuda.bindings`` return tuple ``(CUresult, *values)``; return the values.

    Raises :class:`DeviceError` (``sticky`` when the context is broken; an
    :class:`OutOfMemoryError` for an out-of-memory) naming ``what`` (text, or a callable
    returning it, evaluated only on failure).
    """
    if isinstance(result, tuple):
        err, rest = result[0], result[1:]
    else:
        err, rest = result, ()
    if int(err) != 0:
        name = getattr(err, "name", None) or f"CUresult {int(err)}"
        sticky = name in STICKY_ERRORS
        msg = f"{_text(what)} failed: {name}"
        if sticky:
            msg += f"; {BROKEN_CONTEXT}"
        elif name in OUT_OF_MEMORY_ERRORS:
            raise OutOfMemoryError(f"{msg}; {OUT_OF_MEMORY}")
        raise DeviceError(msg, sticky=sticky)
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


class translate:
    """Context manager: a CUDA error raised by cuda.core inside becomes a :class:`DeviceError`
    (an :class:`OutOfMemoryError` for an out-of-memory, see :func:`device_error`).
    ``what`` is the operation's description, or a callable returning it (evaluated on failure)."""

    __slots__ = ("what",)

    def __init__(self, what: Any):
        self.what = what

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None or isinstance(exc, DeviceError):
            return False
        err = as_device_error(self.what, exc)
        if err is not None:
            raise err from exc
        return False
