"""Argument checks shared by every public entry point (``Pipeline``, ``stream_map``, ``MapJob``).

One function per kind of argument, one message style: each error names the argument, what it
got and what it accepts, so both engines and every front door refuse the same input the same
way before any device work starts.
"""

from __future__ import annotations

import inspect
import math
import numbers
import re
import types
import warnings
import weakref
from typing import Any, Iterator, Optional

import numpy as np

from .._checks import MAX_WORKERS, as_float as _as_float, check_count, check_flag
from .._checks import described as _got
from .._device.host_pool import check_shape_dtype
from .._device.protocol import check_device_dtype
from .._plan import MAX_SLOTS, SlotCounts
from .sizing import DEFAULT_CHUNK_BYTES

MAX_CHUNK_BYTES = 1 << 40  # 1 TiB: larger than any GPU's memory, so surely a mistake
# A pebibyte: more memory than any host has. Bounds pinned_budget, and what max_in_flight chunks may hold.
MAX_HOST_BYTES = 1 << 50
MAX_COMPUTE_STREAMS = 16
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10 ** 3, "kib": 1 << 10, "m": 1 << 20, "mb": 10 ** 6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10 ** 9, "gib": 1 << 30, "t": 1 << 40, "tb": 10 ** 12, "tib": 1 << 40,
          "p": 1 << 50, "pb": 10 ** 15, "pib": 1 << 50}  # (a pinned_budget goes up to a PiB)
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(text: str) -> Optional[int]:
    """Bytes written as ``"8MiB"``, ``"1 GiB"``, ``"512k"``, ``"1e6"`` or ``"4096"``; None if ``text``
    is not a size."""
    m = _SIZE.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        return None
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    return int(value) if math.isfinite(value) and value == int(value) else None


def check_bytes(name: str, value: Any, *, allow_auto: bool = False, maximum: int = MAX_CHUNK_BYTES) -> "int | str":
    """A byte count: a positive int, an integral float (``8e6``), or a size string (``"8MiB"``);
    ``"auto"`` too when ``allow_auto``.

    Raises:
        TypeError: a type that cannot be a size.
        ValueError: NaN, infinite, fractional, not positive, larger than ``maximum``, or an
            unreadable string.
    """
    accepted = "an int number of bytes or a size such as '8MiB'" + (", or 'auto'" if allow_auto else "")
    if isinstance(value, str):
        if value == "auto":
            if allow_auto:
                return value
            whole = " ('auto' is for whole arrays: stream_map, MapJob)" if name == "chunk_bytes" else ""
            raise ValueError(f"{name} must be a number of bytes such as 8388608 or '8MiB' here, got 'auto'{whole}")
        parsed = parse_size(value)
        if parsed is None:
            raise ValueError(f"{name} must be {accepted}, got {value!r}")
        value = parsed
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {accepted}, got {_got(value)}")
    elif not isinstance(value, numbers.Integral):
        f = float(value)
        if not math.isfinite(f):
            raise ValueError(f"{name} must be a finite whole number of bytes, got {value!r}")
        if f != int(f):
            raise ValueError(f"{name} must be a whole number of bytes, got {value!r}")
        value = int(f)
    value = int(value)
    if value < 1:
        raise ValueError(f"{name} must be at least 1 byte, got {value}")
    if value > maximum:
        raise ValueError(f"{name} must be at most {maximum} bytes, got {value}; use a smaller chunk "
                         "(8MiB suits most jobs, or 'auto')" if allow_auto else
                         f"{name} must be at most {maximum} bytes, got {value}")
    return value


# how a compute is called, for check_arity: the common mistake is a compute that returns its result
COMPUTE_FORM = "f(x, y), and writes its result into y (y[...] = x * 2, not return x * 2)"


def cannot_take(fn: Any, nargs: int) -> Optional[str]:
    """Where ``fn`` is a Python function, method or object with a Python ``__call__`` that
    cannot be called with ``nargs`` positional arguments: its name and signature, as text.
    None where it can, or where its signature cannot be read cheaply (a builtin, a
    ``functools.partial``): such a callable is checked when it is called.

    Reads the code object: :func:`inspect.signature` would cost every whole-array call many
    times more than the rest of its argument checks."""
    func, bound = fn, 0
    if isinstance(func, types.MethodType):
        func, bound = func.__func__, 1
    elif not isinstance(func, types.FunctionType):
        # (a call finds __call__ on the object's type and the classes it derives from)
        func = next((vars(k)["__call__"] for k in type(fn).__mro__ if "__call__" in vars(k)), None)
        bound = 1
    if not isinstance(func, types.FunctionType):
        return None
    code, n = func.__code__, nargs + bound
    positional, defaults = code.co_argcount, len(func.__defaults__ or ())
    keywords = code.co_varnames[positional:positional + code.co_kwonlyargcount]
    required_keyword = any(k not in (func.__kwdefaults__ or {}) for k in keywords)
    if not required_keyword and positional - defaults <= n and (n <= positional or code.co_flags & inspect.CO_VARARGS):
        return None
    try:
        signature = str(inspect.signature(fn))
    except (TypeError, ValueError):  # (it has a code object, so this is not expected)
        signature = "(...)"
    return f"{getattr(fn, '__qualname__', None) or type(fn).__name__}{signature}"


def check_arity(name: str, fn: Any, nargs: int, form: str) -> None:
    """Refuse a callable ``fn`` (given as ``name``) that cannot be called with ``nargs``
    positional arguments, as ``form`` says it is called (see :func:`cannot_take`).

    Raises:
        TypeError: naming ``name``, the form and ``fn``'s signature."""
    what = cannot_take(fn, nargs)
    if what is not None:
        raise TypeError(f"{name} is called as {form}; {what} cannot take {nargs} positional "
                        f"argument{'s' if nargs != 1 else ''}")


def check_choice(name: str, value: Any, choices: tuple) -> Any:
    """``value`` if it is one of ``choices``. Raises ValueError naming them."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def check_iterable(name: str, value: Any) -> Iterator[Any]:
    """``iter(value)``.

    Raises:
        TypeError: naming ``name``, where ``value`` is not iterable; or the TypeError its own
            ``__iter__`` raised, as it is (the caller's error, with its traceback).
    """
    try:
        return iter(value)
    except TypeError as exc:
        if exc.__traceback__ is not None and exc.__traceback__.tb_next is not None:
            raise  # raised inside a Python __iter__, not by iter() refusing the value
        raise TypeError(f"{name} must be an iterable of items (a list, a generator, ...), got {_got(value)}") from None


def warn_if_elements_as_items(items: Any, call: str) -> None:
    """Warn, at the caller of ``call`` (``"Pipeline.map()"``), where ``items`` is a 1-D numpy
    array handed to a pipeline of arrays: iterating it makes every element a 0-d item (a chunk,
    or a share of one, each), which is almost never what the caller meant. Rows of a 2-D array are
    items by design and do not warn; neither do a ``prepare``'s items (the caller does not ask)."""
    if isinstance(items, np.ndarray) and items.ndim == 1:
        warnings.warn(f"{call} got a 1-D numpy array of {items.size} elements: each element becomes an item of "
                      f"its own (0-d). To stream the array through the GPU in chunks, call rf.stream_map(f, x); to "
                      f"send it as one item, submit(x) or map([x])", UserWarning, stacklevel=3)


def check_timeout(value: Any) -> Optional[float]:
    """None (wait as long as it takes) or a finite number of seconds >= 0.

    Raises:
        TypeError: not a number.
        ValueError: NaN, infinite or negative (use None to wait without limit).
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"timeout must be None or a number of seconds, got {_got(value)}")
    value = _as_float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"timeout must be a finite number of seconds >= 0 (or None to wait without limit), "
                         f"got {value}")
    return value


def check_slots(value: Any, *, inplace: bool = False) -> "int | SlotCounts | None":
    """None (planned), an int from 1 to :data:`~ringflow._plan.MAX_SLOTS` for every ring, or a
    :class:`~ringflow.SlotCounts` (whose counts its construction checked) with ``device_out`` 0
    exactly when ``inplace`` (an in-place compute has no device-out ring).

    Raises:
        TypeError: not None, an int or a SlotCounts.
        ValueError: an int out of range, or ``device_out`` that does not match ``inplace``.
    """
    if value is None:
        return value
    if isinstance(value, SlotCounts):
        if inplace and value.device_out != 0:
            raise ValueError(f"slots.device_out must be 0 with inplace=True (an in-place compute has no "
                             f"device-out ring), got {value.device_out}")
        if not inplace and value.device_out < 1:
            raise ValueError("slots.device_out must be at least 1 unless inplace=True, got 0")
        return value
    return check_count("slots", value, maximum=MAX_SLOTS,
                       hint="; pass None (planned), an int for every ring, or a SlotCounts")


def check_in_flight(value: Any, chunk_bytes: "int | str | None") -> int:
    """``max_in_flight``: an int from 1 up to the count of ``chunk_bytes`` chunks that
    :data:`MAX_HOST_BYTES` holds. The chunks accepted and unfinished hold their items and results
    (a map holds up to ``max_in_flight * chunk_bytes`` bytes of results it has not handed out),
    so a bound above that is one no host could reach: it bounds nothing, and is refused rather
    than taken as "no bound".

    Args:
        value: the ``max_in_flight`` given (not None).
        chunk_bytes: the checked ``chunk_bytes``; None (or ``"auto"``) for the default chunk.

    Raises:
        TypeError: not an integer.
        ValueError: below 1, or above the bound.
    """
    chunk = chunk_bytes if isinstance(chunk_bytes, int) else DEFAULT_CHUNK_BYTES
    return check_count("max_in_flight", value, maximum=max(1, MAX_HOST_BYTES // chunk),
                       hint=f"; that many unfinished chunks of chunk_bytes={chunk} hold up to max_in_flight * "
                            "chunk_bytes bytes of items and results, and a bound above 2**50 bytes (more than any "
                            "host has) bounds nothing: give how many chunks may be unfinished at once, or None "
                            "for the total slot count")


def check_options(*, chunk_bytes: Any = None, allow_auto_chunk: bool = False, workers: Any = None,
                  max_in_flight: Any = None, pinned_budget: Any = None, slots: Any = None,
                  on_error: str = "raise", compute_streams: Any = None, **flags: Any) -> dict:
    """Every engine option a front door takes, checked and normalised; returns them as a dict
    (``None`` meaning "planned"). ``flags`` are booleans (``ordered``, ``profile``, ``checked``,
    ``inplace``, ``keep_warm``).

    Raises:
        TypeError, ValueError: naming the argument, what it got and what it accepts.
    """
    out: dict[str, Any] = {}
    out["chunk_bytes"] = None if chunk_bytes is None else check_bytes("chunk_bytes", chunk_bytes,
                                                                       allow_auto=allow_auto_chunk)
    out["workers"] = None if workers is None else check_count("workers", workers, maximum=MAX_WORKERS)
    out["max_in_flight"] = None if max_in_flight is None else check_in_flight(max_in_flight, out["chunk_bytes"])
    out["pinned_budget"] = None if pinned_budget is None else check_bytes("pinned_budget", pinned_budget,
                                                                           maximum=MAX_HOST_BYTES)
    out["on_error"] = check_choice("on_error", on_error, ("raise", "continue"))
    out["compute_streams"] = None if compute_streams is None else check_count(
        "compute_streams", compute_streams, maximum=MAX_COMPUTE_STREAMS,
        hint="; kernels of that many chunks may run side by side, or None (planned)")
    for name, value in flags.items():
        out[name] = check_flag(name, value)
    # after the flags: whether a SlotCounts may have a device-out ring depends on inplace
    out["slots"] = check_slots(slots, inplace=out.get("inplace", False))
    return out


def same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` and ``b`` are views of exactly the same bytes in the same layout (``x`` and
    ``x[...]``): every element of one is the element of the other at the same index."""
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.strides == b.strides
            and a.shape == b.shape and a.dtype == b.dtype)


def check_out(x: np.ndarray, out: np.ndarray) -> None:
    """``out`` may be ``x`` itself (in place) or memory that does not overlap ``x``.

    Raises:
        ValueError: ``out`` and ``x`` overlap other than exactly: chunk ``i``'s result would
            overwrite input that a later chunk still has to read.
    """
    if out is x or not np.may_share_memory(x, out) or same_memory(x, out):
        return
    try:
        overlap = np.shares_memory(x, out, max_work=10 ** 6)
    except np.exceptions.TooHardError:  # too costly to decide exactly: refuse, as if they overlap
        overlap = True
    if overlap:
        # out=x works in place only where a result has x's own shape and dtype
        fix = ("pass out=x to work in place, or a separate array" if (out.shape, out.dtype) == (x.shape, x.dtype)
               else f"pass a separate array (out is {out.shape} {out.dtype} over x's bytes, x is {x.shape} "
                    f"{x.dtype}: no result of that shape works in place)")
        raise ValueError(f"out overlaps x without being x itself: results would overwrite input still to be read; "
                         f"{fix}")


class BoundArray:
    """What a :class:`~ringflow.MapJob` keeps of one of its arrays besides the array itself: the
    layout it was cut by (shape, strides, dtype), which :func:`check_unchanged` compares on each
    call, and weak references to it and to the array that owns its memory.

    The weak references are what keeps the memory where the job registered it: numpy refuses to
    ``resize`` an array that a weak reference points to, ``refcheck=False`` or not. A refused
    resize is cheaper to explain than a job that reads freed memory, and cheaper to check than
    the array's address on every call. Not guarded: ``ndarray.__setstate__`` (unpickling into an
    existing array), which gives the object new memory and frees the old while views of it
    still point there, as it does to numpy's own views; a job's array must not be given one."""

    __slots__ = ("layout", "_refs")

    def __init__(self, a: np.ndarray) -> None:
        self.layout = (a.shape, a.strides, a.dtype)
        refs, seen = [], a
        while isinstance(seen, np.ndarray):  # the array and each base up to the owner
            refs.append(weakref.ref(seen))
            seen = seen.base
        self._refs = refs

    def release(self) -> None:
        """Drop the weak references: numpy may resize the arrays again."""
        self._refs = []


def check_unchanged(name: str, a: np.ndarray, bound: BoundArray, *, writeable: bool = False) -> None:
    """``a`` still has the layout a :class:`~ringflow.MapJob` was made with (``bound``), and is
    writeable where the job writes it: the job cuts its chunks by that layout, so an array
    reshaped or retyped in place would be cut wrongly.

    Raises:
        ValueError: naming ``name``, what changed and what to do.
    """
    now = (a.shape, a.strides, a.dtype)
    if now != bound.layout:
        what = [f"{label} {old} -> {new}" for label, old, new in
                zip(("shape", "strides", "dtype"), bound.layout, now) if old != new]
        raise ValueError(f"{name} changed since the MapJob was made ({'; '.join(what)}): only the contents of a "
                         f"job's arrays may change between calls; give {name} back its shape and dtype, or make "
                         f"a new MapJob for the new array")
    if writeable and not a.flags.writeable:
        raise ValueError(f"{name} was made read-only since the MapJob was made, and each call writes it; set "
                         f"{name}.flags.writeable = True again, or make a new MapJob")


def check_output_spec(spec: Any, where: str = "output") -> tuple:
    """An output spec ``(shape, dtype)`` checked and normalised to ``(tuple of ints, numpy dtype)``.

    Raises:
        TypeError: not a pair, a shape that is not an int or a sequence of ints, or a dtype numpy
            does not know or that no device array may have (see
            :func:`~ringflow._device.protocol.check_device_dtype`).
        ValueError: a negative dimension, more than 64 dimensions, a shape numpy cannot index, or a
            dtype whose items have 0 bytes.
    """
    if not isinstance(spec, (tuple, list)) or len(spec) != 2:
        raise TypeError(f"{where} must be a (shape, dtype) pair such as ((64, 10), 'float16'), got {_got(spec)}")
    try:
        shape, dtype = check_shape_dtype(*spec)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{where}: {exc}") from None
    check_device_dtype(where, dtype)
    return shape, dtype


_DLPACK_CPU = (1, 3)  # kDLCPU, kDLCUDAHost (pinned host memory): bytes the CPU can read


def check_not_masked(name: str, a: np.ndarray) -> None:
    """Refuse a numpy masked array: its data would be moved and its mask dropped, so masked
    elements would come back as results.

    Raises:
        TypeError: naming ``name`` and what to pass instead.
    """
    if isinstance(a, np.ma.MaskedArray):
        raise TypeError(f"{name}: a numpy masked array, whose mask ringflow would drop (it moves the data "
                        f"alone); pass its .filled(value) or .data, and apply the mask to the result")


def as_host_array(item: Any, where: str = "items") -> np.ndarray:
    """``item`` as a numpy array over the same memory where it can be one without a copy: a
    numpy array as it is; a CPU DLPack producer (a torch CPU tensor, pinned or not) through
    ``np.from_dlpack``; any other object with ``__array__`` through ``np.asarray``.

    Raises:
        TypeError: a device array (``__cuda_array_interface__`` or a DLPack device that is not
            the CPU), or an object numpy cannot view as an array, naming ``where``.
    """
    if type(item) is np.ndarray:
        return item
    if isinstance(item, np.ndarray):
        check_not_masked(where, item)
        return item
    if hasattr(item, "__cuda_array_interface__"):
        raise TypeError(f"{where} must be host arrays; got a device array ({type(item).__name__}); copy it to the "
                        "host first (e.g. .get() or .cpu()), or compute on it directly")
    if hasattr(item, "__dlpack__") and hasattr(item, "__dlpack_device__"):
        try:
            kind = int(item.__dlpack_device__()[0])
        except Exception as exc:  # noqa: BLE001 - a producer that cannot say where it lives
            raise TypeError(f"{where}: {type(item).__name__}.__dlpack_device__() failed ({exc})") from None
        if kind not in _DLPACK_CPU:
            raise TypeError(f"{where} must be host arrays; got a {type(item).__name__} on DLPack device type {kind} "
                            "(not the CPU); copy it to the host first (e.g. .cpu())")
        try:
            return np.from_dlpack(item)
        except (TypeError, BufferError, RuntimeError) as exc:
            if not hasattr(item, "__array__"):
                raise TypeError(f"{where}: numpy cannot view this {type(item).__name__} ({exc})") from None
    if hasattr(item, "__array__"):
        arr = np.asarray(item)
        if arr.dtype.hasobject:
            raise TypeError(f"{where}: a {type(item).__name__} holds Python objects; items are moved as raw bytes")
        return arr
    hint = " (or pass prepare= to make them)" if where.startswith("items") else ""
    raise TypeError(f"{where} must be numpy arrays, torch CPU tensors, DLPack producers or objects with __array__"
                    f"{hint}, got {type(item).__name__}")
