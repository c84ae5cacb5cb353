"""A launched callable's work on its arrays, recorded while its stream captures a graph and
replayed by each launch of the graph: the simulated GPU's captured kernels.

On a GPU a launched callable is host code that enqueues kernels: captured into a graph, it is
called once, while capturing, and every launch of the graph replays the kernels it enqueued,
on whatever the buffers hold then, with the host values (a global, a counter, a random draw)
it handed them while captured. On the simulated GPU the callable's numpy work *is* the kernel,
run when the launch completes in virtual time, so replaying the callable would run its host
code again on every launch: its side effects would happen, and the host values it reads would
be read anew, where a GPU's replay computes with stale ones. A capture therefore calls it once,
with stand-ins for its arrays (:class:`TapeArray`) that record each numpy operation made on
them (a ufunc, a numpy function, a method, an index, an assignment, an ``rf.Kernel``) with its
other arguments as they were then; a launch of the graph replays those operations (a
:class:`Tape`) on arrays over the buffers' bytes at that moment, and never calls the callable.

Each recorded operation is also done at once on shadow arrays (zero bytes for device memory, a
copy for a host array), so that the callable sees its results' shapes and dtypes, which a GPU
knows without the data. What needs the data itself on the host (a truth value, ``float()``,
``.item()``, ``.tolist()``, ``np.asarray``, printing, writing it out with ``np.save``) would
make a GPU synchronise, which a capture refuses; so would a result whose size depends on the data (a boolean mask,
``np.nonzero``): each raises a :class:`HostRead` and abandons the capture. A numpy array the
callable holds from outside (scratch memory, weights) stands for device memory made outside
it, as a CuPy array would be: a replay uses that array as it is then.

An operation whose result is a new array (``x * 2``, ``x.copy()``, ``x.astype(np.float64)``,
a reduction, indexing with an array), rather than an array the launch was given or one held
from outside, or a view of either, stands for device memory that a framework's allocator hands
out while the stream captures, which a GPU's capture refuses (a graph would keep writing that
memory after it is handed out again). The callable goes on, as it would on a GPU, and once it
returns the capture is abandoned, naming the first such operation; a host read meanwhile is
the reason given instead, as the synchronisation fails inside the callable on a GPU. Writing
into existing memory is what captures: ``out=``, in-place operators, assignments into an array
or a view of it, ``y.fill()`` and kernels. (A GPU library may also allocate inside an operation,
a sort's scratch space for one, which the stand-ins do not see.)
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Optional

import numpy as np
from numpy.lib.array_utils import byte_bounds
from numpy.lib.mixins import NDArrayOperatorsMixin

from ..._errors import CaptureError
from ..protocol import CAPTURED_ALLOCATION_ADVICE, ArrayArg

# numpy functions whose result is about the arrays' shapes and types, not their data
_METADATA = frozenset({"shape", "ndim", "size", "result_type", "iscomplexobj", "isrealobj", "min_scalar_type",
                       "can_cast", "may_share_memory", "shares_memory"})
# numpy functions (and methods) whose result's size depends on the data
_DATA_SIZED = frozenset({"nonzero", "flatnonzero", "argwhere", "unique", "unique_all", "unique_counts",
                         "unique_inverse", "unique_values", "extract", "trim_zeros", "bincount"})
# numpy functions that write the data out on the host (a file, a stream)
_HOST_WRITERS = frozenset({"save", "savez", "savez_compressed", "savetxt"})
# methods that hand the data itself to the host
_HOST_METHODS = frozenset({"item", "tolist", "tobytes", "tostring", "tofile", "dump", "dumps"})
# attributes about the array, not its data
_ATTRIBUTES = frozenset({"shape", "dtype", "ndim", "size", "itemsize", "nbytes", "strides", "flags"})

_WHY = ("a GPU must run the work captured so far and synchronise before the host has it, which a capture refuses; "
        "compute with the device arrays only (np.where(cond, a, b) rather than an if on their values)")


class HostRead(CaptureError):
    """A captured callable needed its device data on the host: the capture is abandoned."""


class Ref:
    """The value of a tape's slot ``index``: a launch argument, or an operation's result."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"<value {self.index}>"


class Method:
    """``obj.name(*args, **kwargs)``, recorded: a replay calls the method on its own array."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __call__(self, obj: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(obj, self.name)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"x.{self.name}()"


class Op:
    """One recorded operation: ``call`` on ``args`` and ``kwargs`` (templates in which a
    :class:`Ref` stands for a value of the tape), and what its result looked like while captured
    (``signature``; None: not checked)."""

    __slots__ = ("call", "args", "kwargs", "what", "signature")

    def __init__(self, call: Callable, args: tuple, kwargs: dict, what: str, signature: Any):
        self.call, self.args, self.kwargs, self.what, self.signature = call, args, kwargs, what, signature


class Tape:
    """What one captured launch did to its arrays: called with the launch's arguments (its
    arrays over the buffers' bytes now), it replays each recorded operation in order."""

    def __init__(self, name: str, n_args: int, shadows: dict):
        self.__name__ = name  # a launch labels its operation with it
        self.n_args = n_args
        self.ops: list[Op] = []
        self.recording = True
        self.refused: Optional[str] = None  # why the capture is refused: a host read, or a new array
        self._allocated: Optional[str] = None  # the first new array the callable made, if it made one
        self._shadows = shadows  # the capture's shadow memory (device_shadow, host_shadow)

    def __repr__(self) -> str:
        return f"<Tape of {self.__name__}: {len(self.ops)} operations>"

    def __call__(self, *arrays: Any) -> None:
        values = list(arrays)
        for op in self.ops:
            result = op.call(*fill(op.args, values), **fill(op.kwargs, values))
            if op.signature is not None and signature(result) != op.signature:
                raise CaptureError(f"replaying {self.__name__}: {op.what} made {describe(signature(result))} where "
                                   f"the capture made {describe(op.signature)}: a result whose size depends on the "
                                   f"data (or on a host array changed since the capture) cannot be captured, since "
                                   f"a GPU would have to synchronise to learn it")
            values.append(result)

    # -- recording -------------------------------------------------------------------------
    def capture(self, fn: Callable, args: tuple, read_only: list) -> None:
        """Call ``fn`` once on stand-ins for ``args``' arrays, recording what it does to them.
        Afterwards :attr:`refused` says why the capture must be abandoned, if it must: the first
        host read (also one ``fn`` caught), else, where ``fn`` returned, the first new array it
        made. Raises what ``fn`` raised (a :class:`HostRead` for a host read it did not catch)."""
        stand_ins = [TapeArray(self, Ref(i), device_shadow(a, ro, self._shadows)) if isinstance(a, ArrayArg) else a
                     for i, (a, ro) in enumerate(zip(args, read_only))]
        try:
            fn(*stand_ins)
        finally:
            self.recording = False
            self._shadows = {}
        if self.refused is None:
            self.refused = self._allocated

    def refuse(self, what: str) -> HostRead:
        """Note that the callable needed ``what`` on the host; returns the error to raise."""
        text = f"{self.__name__} read device data on the host while captured: {what}; {_WHY}"
        if self.refused is None:
            self.refused = text
        return HostRead(text)

    def _check_new(self, result: Any, what: str) -> None:
        """Note the first operation whose ``result`` (as done on the shadows) holds an array in
        memory of its own: none of the capture's device arguments' or host arrays' memory."""
        if self._allocated is not None:
            return
        for r in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(r, np.generic) or (isinstance(r, np.ndarray) and r.nbytes and not self._known(r)):
                self._allocated = (f"{self.__name__} allocated device memory while captured: {what} made a new "
                                   f"{describe(signature(r))} array; {CAPTURED_ALLOCATION_ADVICE}")
                return

    def _known(self, a: np.ndarray) -> bool:
        """Whether ``a`` lies in the shadow memory of the capture's arguments and host arrays."""
        lo, hi = byte_bounds(a)
        for entry in self._shadows.values():
            raw = entry[1]
            start = raw.ctypes.data
            if start <= lo and hi <= start + raw.nbytes:
                return True
        return False

    def record(self, call: Callable, args: tuple, kwargs: dict, what: str, *, metadata: bool = False,
               view: bool = False) -> Any:
        """Record ``call(*args, **kwargs)`` and do it on the shadows; returns its result as the
        callable sees it (stand-ins for arrays). A result in new memory is noted (the capture
        is abandoned once the callable returns), unless ``view`` says it is a view (a numpy
        scalar from basic indexing, which a GPU's array gives as a view)."""
        targs, tkwargs = self.template(args), self.template(kwargs)
        with np.errstate(all="ignore"):
            result = call(*shadows(args, self._shadows), **shadows(kwargs, self._shadows))
        if not (view or metadata):
            self._check_new(result, what)
        given = stand_ins_in((args, kwargs))
        if isinstance(result, (tuple, list)) and result and all(_is_array(r) for r in result):
            ref = self._append(Op(call, targs, tkwargs, what, signature(result)))
            items = [self._wrap(r, self._append(Op(operator.getitem, (ref, i), {}, what, None)), given)
                     for i, r in enumerate(result)]
            kind = type(result)
            return kind._make(items) if hasattr(kind, "_make") else kind(items)  # (a named tuple: np.linalg's)
        if result is None or _is_array(result):
            return self._wrap(result, self._append(Op(call, targs, tkwargs, what, signature(result))), given)
        if metadata or isinstance(result, (np.dtype, type)):
            return result
        raise self.refuse(f"{what} gave the host a {type(result).__name__}")

    def record_call(self, fn: Callable, args: tuple, kwargs: dict, check: Optional[Callable]) -> None:
        """Record a device function ``fn`` (a kernel) called on ``args``: not run on the shadows
        (its body is device code, which a capture does not run), only ``check``-ed there."""
        targs, tkwargs = self.template(args), self.template(kwargs)
        if check is not None:
            check(tuple(shadows(args, self._shadows)))
        self._append(Op(fn, targs, tkwargs, f"kernel {getattr(fn, '__name__', fn)!r}", None))

    def _append(self, op: Op) -> Ref:
        self.ops.append(op)
        return Ref(self.n_args + len(self.ops) - 1)

    def _wrap(self, result: Any, ref: Ref, given: list) -> Any:
        if result is None:
            return None
        if isinstance(result, np.ndarray):  # (a numpy scalar may be a shared object: np.True_)
            for stand_in in given:  # an operation that returns one of its arguments (out=y) returns its stand-in
                if stand_in._shadow is result:
                    return stand_in
        return TapeArray(self, ref, result)

    def template(self, obj: Any) -> Any:
        """``obj`` with each stand-in replaced by its :class:`Ref` (containers copied: a list the
        callable changes later is not read again)."""
        if isinstance(obj, TapeArray):
            if obj._tape is not self:
                raise CaptureError(f"{self.__name__} used an array of another captured launch ({obj!r}); a launch's "
                                   "work may use only its own arguments and arrays made outside it")
            return obj._ref
        if type(obj) in (tuple, list):
            return type(obj)(self.template(o) for o in obj)
        if type(obj) is dict:
            return {k: self.template(v) for k, v in obj.items()}
        if type(obj) is slice:
            if any(isinstance(b, TapeArray) for b in (obj.start, obj.stop, obj.step)):
                raise self.refuse("a slice bound taken from device data")
            return obj
        return obj


class TapeArray(NDArrayOperatorsMixin):
    """What a captured callable gets for an array: its shape and dtype as the array's, and every
    numpy operation on it recorded into the launch's :class:`Tape` instead of run on data."""

    __slots__ = ("_tape", "_ref", "_shadow")

    def __init__(self, tape: Tape, ref: Ref, shadow: Any):
        self._tape, self._ref, self._shadow = tape, ref, shadow

    def __repr__(self) -> str:
        return (f"<device array {getattr(self._shadow, 'shape', ())} {self._shadow.dtype} of a captured launch "
                f"(its values exist only when the graph runs)>")

    def _check(self) -> Tape:
        tape = self._tape
        if not tape.recording:
            raise CaptureError(f"{self!r} was kept past the capture of {tape.__name__}: its arrays are stand-ins "
                               "for the duration of the capture only")
        return tape

    # -- about the array, not its data -------------------------------------------------------
    shape = property(lambda self: self._shadow.shape)
    dtype = property(lambda self: self._shadow.dtype)
    ndim = property(lambda self: self._shadow.ndim)
    size = property(lambda self: self._shadow.size)
    itemsize = property(lambda self: self._shadow.itemsize)
    nbytes = property(lambda self: self._shadow.nbytes)
    strides = property(lambda self: getattr(self._shadow, "strides", ()))
    flags = property(lambda self: self._shadow.flags)

    def __len__(self) -> int:
        return len(self._shadow)

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    # -- numpy's work, recorded ------------------------------------------------------------------
    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        what = f"np.{ufunc.__name__}" + ("" if method == "__call__" else f".{method}")
        return self._check().record(getattr(ufunc, method), inputs, kwargs, what)

    def __array_function__(self, func: Callable, types: Any, args: tuple, kwargs: dict) -> Any:
        tape = self._check()
        name = func.__name__
        what = f"np.{name}"
        if name in _DATA_SIZED or (name in ("compress", "extract") and stand_ins_in(args[:1])):
            raise tape.refuse(f"{what}, whose result's size depends on the data")
        if name in _HOST_WRITERS:
            raise tape.refuse(f"{what}, which writes the data out on the host")
        return tape.record(func, args, kwargs, what, metadata=name in _METADATA)

    def __getitem__(self, key: Any) -> Any:
        tape = self._check()
        for k in key if isinstance(key, tuple) else (key,):
            if isinstance(k, TapeArray) and k.dtype == bool:
                raise tape.refuse("indexing with a boolean mask of device data, which selects as many elements as "
                                  "the data says (np.where(mask, a, b), or an assignment y[mask] = v, is fine)")
        basic = all(_is_basic(k) for k in (key if isinstance(key, tuple) else (key,)))
        return tape.record(operator.getitem, (self, key), {}, "indexing" if basic else "indexing with an array",
                           view=basic)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._check().record(operator.setitem, (self, key, value), {}, "an assignment")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_tape", "_ref", "_shadow"):
            raise AttributeError(name)
        tape = self._check()
        if name in _HOST_METHODS:
            raise tape.refuse(f"x.{name}()")
        if name in _DATA_SIZED:
            raise tape.refuse(f"x.{name}(), whose result's size depends on the data")
        attr = getattr(self._shadow, name)
        if callable(attr):
            def method(*args: Any, **kwargs: Any) -> Any:
                return self._check().record(Method(name), (self, *args), kwargs, f"x.{name}()")
            return method
        if _is_array(attr):
            return tape.record(getattr, (self, name), {}, f"x.{name}")
        raise CaptureError(f"x.{name} of a captured launch's array is not supported (its value is about the data "
                           f"on the host, or not an array); {tape.__name__} can use numpy operations, methods, "
                           f"indexing and {', '.join(sorted(_ATTRIBUTES))}")

    def __copy__(self) -> Any:
        # without it copy.copy would copy the stand-in, a second name for the same device array,
        # where an array's copy is a new one: the callable's writes to it would land in the
        # argument in every replay
        return self._check().record(Method("copy"), (self,), {}, "copy.copy()")

    def __deepcopy__(self, memo: dict) -> Any:
        return self._check().record(Method("copy"), (self,), {}, "copy.deepcopy()")

    # -- the data on the host: what a capture cannot give ---------------------------------------
    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise self._check().refuse("np.asarray (or np.array) of a device array, a host array assigned from one, "
                                   "or a list of device arrays where numpy takes one array (np.stack them first)")

    def __bool__(self) -> bool:
        raise self._check().refuse("a truth value (an if, a while, and, or, not)")

    def __float__(self) -> float:
        raise self._check().refuse("float()")

    def __int__(self) -> int:
        raise self._check().refuse("int()")

    def __index__(self) -> int:
        raise self._check().refuse("an index or a size taken from device data (or a host array indexed by device "
                                   "data, which a GPU cannot do: index device arrays only)")

    def __complex__(self) -> complex:
        raise self._check().refuse("complex()")

    def __str__(self) -> str:
        raise self._check().refuse("its values as text (print, str)")

    def __format__(self, spec: str) -> str:
        raise self._check().refuse("its values as text (an f-string, format)")

    def __contains__(self, value: Any) -> bool:
        raise self._check().refuse("a membership test (in)")

    # (without these, pickle would reach the tape's lock and fail with a message about that)
    def __reduce_ex__(self, protocol: Any) -> Any:
        raise self._check().refuse("pickling, which copies the data to the host")

    def __reduce__(self) -> Any:
        raise self._check().refuse("pickling, which copies the data to the host")


def taped(args: tuple) -> Optional[Tape]:
    """The tape of the first stand-in among ``args``, if any: a kernel called on stand-ins
    records itself there (:meth:`Tape.record_call`) instead of running."""
    for a in args:
        if isinstance(a, TapeArray):
            return a._check()
    return None


def stand_ins_in(obj: Any) -> list:
    """The stand-ins in ``obj`` and in the tuples, lists and dicts it holds."""
    if isinstance(obj, TapeArray):
        return [obj]
    if type(obj) in (tuple, list):
        return [s for o in obj for s in stand_ins_in(o)]
    if type(obj) is dict:
        return [s for o in obj.values() for s in stand_ins_in(o)]
    return []


def fill(template: Any, values: list) -> Any:
    """A recorded template with each :class:`Ref` replaced by its value now."""
    if type(template) is Ref:
        return values[template.index]
    if type(template) in (tuple, list):
        return type(template)(fill(t, values) for t in template)
    if type(template) is dict:
        return {k: fill(v, values) for k, v in template.items()}
    return template


def shadows(obj: Any, memo: dict) -> Any:
    """``obj`` with each stand-in replaced by its shadow, and each host array by a copy (the
    shadow work must not write the caller's arrays: a capture runs nothing)."""
    if isinstance(obj, TapeArray):
        return obj._shadow
    if isinstance(obj, np.ndarray):
        return host_shadow(obj, memo)
    if type(obj) in (tuple, list):
        return type(obj)(shadows(o, memo) for o in obj)
    if type(obj) is dict:
        return {k: shadows(v, memo) for k, v in obj.items()}
    return obj


def device_shadow(a: ArrayArg, read_only: bool, memo: dict) -> np.ndarray:
    """Zero bytes standing for launch argument ``a`` (a GPU's capture knows nothing of the data),
    shared by every argument over the same buffer, as their memory is."""
    buf = a.where.buffer
    key = ("device", id(buf))
    entry = memo.get(key)
    if entry is None:
        memo[key] = entry = (buf, _aligned_zeros(len(buf._mem)))
    raw = entry[1]
    view = raw[a.where.offset:a.where.offset + a.where.nbytes].view(a.dtype).reshape(a.shape)
    if read_only and a.where.nbytes > 0:
        view.flags.writeable = False
    return view


def host_shadow(a: np.ndarray, memo: dict) -> np.ndarray:
    """A copy of host array ``a`` that views of the same memory share, made once a capture."""
    if type(a) is not np.ndarray or a.dtype.hasobject:
        copy = a.copy()
        memo[("copy", id(copy))] = (a, copy)  # (memory a result may be a view of: not new)
        return copy
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    key = ("host", id(root))
    entry = memo.get(key)
    if entry is None:
        lo, hi = byte_bounds(root)
        raw = np.empty(hi - lo, np.uint8)
        np.ndarray(root.shape, root.dtype, raw, root.ctypes.data - lo, root.strides)[...] = root
        memo[key] = entry = (root, raw, lo)
    _, raw, lo = entry
    view = np.ndarray(a.shape, a.dtype, raw, a.ctypes.data - lo, a.strides)
    view.flags.writeable = a.flags.writeable
    return view


def _aligned_zeros(nbytes: int) -> np.ndarray:
    raw = np.zeros(nbytes + 255, np.uint8)
    start = -raw.ctypes.data % 256
    return raw[start:start + nbytes]


def _is_basic(key: Any) -> bool:
    """Whether index ``key`` selects a view (basic indexing), as an integer, a slice, ``...`` or
    None does; an array, a list or a bool makes a copy."""
    return isinstance(key, (int, np.integer, slice, type(Ellipsis), type(None))) and not isinstance(key, bool)


def _is_array(value: Any) -> bool:
    return isinstance(value, (np.ndarray, np.generic))


def signature(value: Any) -> Any:
    """What a replay checks of an operation's result: its shape and dtype (for arrays)."""
    if isinstance(value, np.ndarray):
        return (value.shape, value.dtype)
    if isinstance(value, np.generic):
        return ((), value.dtype)
    if isinstance(value, (tuple, list)):
        return tuple(signature(v) for v in value)
    return None


def describe(sig: Any) -> str:
    if isinstance(sig, tuple) and len(sig) == 2 and isinstance(sig[1], np.dtype):
        return f"shape {sig[0]} {sig[1]}"
    return repr(sig)
