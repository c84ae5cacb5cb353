"""Argument checks shared by the device layer and the pipeline's front doors.

Each names the argument, what it got and what it accepts; the device layer uses them without
importing the pipeline, and :mod:`ringflow._pipeline.validate` builds its checks on them.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional

import numpy as np

# The most host worker threads a pipeline (``workers=``) or a device's worker pool may have.
MAX_WORKERS = 1024


def described(value: Any) -> str:
    """``value`` as a message shows what it got: its repr and its type."""
    return f"{value!r} ({type(value).__name__})"


def check_count(name: str, value: Any, *, minimum: int = 1, maximum: Optional[int] = None,
                hint: str = "") -> int:
    """``value`` as an int in ``[minimum, maximum]``.

    Raises:
        TypeError: not an integer (a bool, a float, a string, None).
        ValueError: out of range.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {described(value)}{hint}")
    value = int(value)
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f"at least {minimum}"
        raise ValueError(f"{name} must be {bound}, got {value}{hint}")
    return value


def check_flag(name: str, value: Any) -> bool:
    """``value`` as a plain bool: a bool or numpy's bool. Raises TypeError for anything else (a
    string 'False' is not False)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {described(value)}")
    return bool(value)


def is_c_scalar(value: Any) -> bool:
    """Whether ``value`` is a numpy scalar a kernel can take by value: a bool, an integer, a float
    of 2, 4 or 8 bytes or a complex number of 8 or 16 (numpy's strings, dates and raw bytes have
    no C type to pass, and cuda.core passes no long double)."""
    if not isinstance(value, np.generic):
        return False
    kind, size = value.dtype.kind, value.dtype.itemsize
    return kind in "biu" or (kind == "f" and size <= 8) or (kind == "c" and size <= 16)


# numpy types of their own beside the sized ones of the same bits (np.longlong beside np.int64),
# which cuda.core's launch refuses: it checks the sized types
_UNSIZED = {t: np.dtype(np.dtype(t).str).type for t in (np.longlong, np.ulonglong, np.intc, np.uintc)
            if np.dtype(np.dtype(t).str).type is not t}


def launch_scalar(value: Any) -> Any:
    """``value`` (a numpy scalar :func:`is_c_scalar` takes) as the sized numpy type a launch
    passes: np.longlong as np.int64 where they are two types; else ``value`` itself."""
    sized = _UNSIZED.get(type(value))
    return value if sized is None else sized(value)


def _is_native(dtype: np.dtype) -> bool:
    """Whether every number in ``dtype`` is in this machine's byte order, looking into fields and
    sub-arrays (numpy's ``isnative`` does not look into a field's sub-array)."""
    if dtype.subdtype is not None:
        return _is_native(dtype.subdtype[0])
    if dtype.fields:
        return all(_is_native(field[0]) for field in dtype.fields.values())
    return dtype.isnative


def check_native_byte_order(name: str, dtype: np.dtype) -> None:
    """Refuse a dtype in the other byte order than this machine's (``>f4`` on a little-endian
    host), or one with such a field.

    Raises:
        TypeError: naming ``name`` and the conversion that makes it native.
    """
    # ringflow would move the bytes unchanged, and numpy reads them right in either order; but
    # CuPy, PyTorch and a CUDA kernel read numbers in the native order only, so on a GPU the
    # compute would misread every value while the simulated GPU (numpy) showed nothing wrong
    if not _is_native(dtype):
        raise TypeError(f"{name}: dtype {dtype} is in non-native byte order, which GPU code (CuPy, PyTorch, a CUDA "
                        "kernel) would misread; convert it first: a.astype(a.dtype.newbyteorder('='))")


def as_float(value: numbers.Real) -> float:
    """``float(value)``, with an integer (or fraction) beyond a float's range as an infinity of
    its sign instead of an OverflowError."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def check_wait_timeout(value: Any) -> Optional[float]:
    """A wait's timeout, as :mod:`concurrent.futures` takes it: None or infinity waits without
    limit, a negative number does not wait.

    Raises:
        TypeError: not a number.
        ValueError: NaN.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"timeout must be None or a number of seconds, got {described(value)}")
    value = as_float(value)
    if math.isnan(value):
        raise ValueError("timeout must be a number of seconds (or None to wait without limit), got nan")
    return None if value == math.inf else max(0.0, value)


def as_dtype(value: Any, name: str = "dtype") -> np.dtype:
    """``np.dtype(value)``.

    Raises:
        TypeError: naming ``name``, where numpy reads no dtype in ``value``: numpy raises a
            TypeError for most, but a SyntaxError or ValueError for some strings it parses as
            a structure (``","``, ``"i4,(2"``), which no caller expects from a bad argument.
    """
    try:
        return np.dtype(value)
    except (TypeError, SyntaxError, ValueError, KeyError) as exc:
        detail = exc.msg if isinstance(exc, SyntaxError) else exc
        raise TypeError(f"{name} {value!r} is not a numpy dtype ({detail}); give one such as 'float32' or "
                        f"np.float32") from None

