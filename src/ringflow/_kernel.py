"""``rf.Kernel``: an elementwise CUDA C++ kernel that also runs on the simulated GPU.

On a CUDA device the source is compiled with NVRTC through cuda.core's ``Program`` (once per
GPU, on first use) and launched on the current stream; on the simulated GPU, whose launched
callables receive numpy arrays, the numpy ``reference`` runs instead. So one object works as
the compute function on both backends::

    scale = rf.Kernel(r'''
        extern "C" __global__ void scale(const float* x, float* y, float a, size_t n) {
            for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
                 i += (size_t)gridDim.x * blockDim.x)
                y[i] = a * x[i];
        }''', "scale", reference=lambda x, y, a: np.multiply(x, a, out=y))
    stream.launch(scale, x_arg, y_arg, np.float32(2.0))

Calling convention, ``k(*args, stream=None)``:

* ``args`` are arrays (all numpy, or all device arrays: CuPy, PyTorch, a cuda.core
  ``StridedMemoryView`` or anything with ``__cuda_array_interface__``; C-contiguous) and
  numpy scalars of a bool, integer, float or complex type (``np.float32(2.0)``: the numpy
  type fixes the C type, so plain Python numbers are refused, and so are numpy strings, dates
  and raw bytes).
* The kernel ``name`` receives, in order, a pointer for each array and each scalar by value,
  then ``size_t n``, where ``n`` is the element count of the first array. Every array must
  hold at least ``n`` elements (unless ``elementwise=False``).
* It is launched with ``block`` threads per block and ``ceil(n / block)`` blocks (at least
  one) on ``stream`` if given, else on the ringflow stream whose ``launch`` is running (see
  :func:`ringflow._device.cuda.current_stream`), else on the framework's current stream.
  A grid-stride loop, as above, keeps the kernel right for any grid.
* ``name`` may be an ``extern "C"`` function or a template instantiation such as
  ``"scale<float>"`` (it is passed to NVRTC as a name expression).
* On numpy arrays ``reference(*args)`` runs and must write its outputs in place and return
  None, as a launch returns nothing.
* ``pointwise=True`` promises more than ``elementwise``: element ``i`` of every output is
  computed from element ``i`` of the inputs (and the scalars) alone, as in ``y = 2x + 1``, not
  in a sum, a sort or a stencil. A :class:`ringflow.Pipeline` then computes the items that
  share a chunk with one launch over all of them instead of one launch each. A kernel that
  breaks the promise gives wrong results there; the default (False) makes none.

``kernel.bind(*scalars)`` fixes trailing scalar arguments and gives a compute function
``f(x, y)`` for a pipeline. Launched through a ringflow stream, a kernel (bound or not) takes
a fast path: its arguments go to the driver as raw pointers, with no framework array built
and no framework stream switched (a pipeline launches once per chunk, so this is host time
saved on every chunk; docs/design.md has the measurements).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import io
import math
import numbers
import threading
from typing import Any, Callable, NamedTuple

import numpy as np

from ._device.cuda.probe import INSTALL_HINT
from ._device.protocol import Stream, check_device_dtype
from ._device.sim.tape import taped
from ._checks import check_count, check_flag, described, is_c_scalar, launch_scalar
from ._kernel_signature import absent_name, check_arguments, read_launch_bound, read_params

__all__ = ["Kernel", "BoundKernel"]

_ACCEPTED = "must be numpy, CuPy, PyTorch or cuda.core arrays or numpy scalars"
_NUMERIC_SCALAR = "pass a numeric numpy scalar (np.float32, np.float64, np.int64, np.bool_, np.complex64, ...)"


class Kernel:
    """An elementwise CUDA C++ kernel, compiled with NVRTC on first use on each GPU, that runs
    its numpy ``reference`` on the simulated GPU (the module's doc gives the calling
    convention). Use it as a compute function, ``kernel.bind(*scalars)`` for ``f(x, y)``.
    It pickles (for worker processes and Ray) without what it compiled, which the copy compiles
    again on its first launch; its ``reference`` must then be picklable too.

    Args:
        source: the CUDA C++ source text.
        name: the ``__global__`` function to launch (``extern "C"``, or a template
            instantiation such as ``"scale<float>"``).
        reference: a numpy function of the same arguments that writes its outputs in place
            and returns None; needed to run on the simulated GPU.
        block: threads per block, 1 to 1024.
        elementwise: every array holds at least as many elements as the first (checked at
            each launch).
        pointwise: element ``i`` of each output depends on element ``i`` of the inputs alone;
            lets a :class:`ringflow.Pipeline` launch once over items sharing a chunk.
        options: extra ``cuda.core.ProgramOptions`` fields for NVRTC, such as
            ``{"fma": False}``; checked here, on the simulated GPU too. Not ``arch``: the
            kernel is compiled for the architecture of each GPU it runs on.

    Raises:
        ValueError: blank ``source`` or ``name``, a ``name`` holding source text (``{``, ``}``,
            ``;`` or a line break: the two given the other way round), a ``name`` that the
            source never mentions (and no ``#include`` or macro may make), ``block`` out of range or
            above the kernel's ``__launch_bounds__`` (a GPU refuses such a launch), ``pointwise``
            without ``elementwise``, an option that is no ``ProgramOptions`` field (the
            message suggests the fields of a similar name), or ``arch``.
        TypeError: ``source`` or ``name`` not a str, ``reference`` not callable, ``block`` not
            an integer, a flag that is not a bool (numpy's bool is one), ``options`` not a dict
            keyed by strings, or an option's value of the wrong type (the message names the
            option and the type it takes).
    """

    def __init__(self, source: str, name: str, reference: Callable[..., Any] | None = None, *,
                 block: int = 256, elementwise: bool = True, pointwise: bool = False,
                 options: dict[str, Any] | None = None):
        if not isinstance(source, str):
            raise TypeError(f"source must be a str of CUDA C++ source, got {type(source).__name__} {source!r:.60}")
        if not source.strip():
            raise ValueError("Kernel needs CUDA C++ source text")
        if not isinstance(name, str):
            raise TypeError(f"name must be a str naming the __global__ function, got {type(name).__name__} {name!r:.60}")
        if not name.strip():
            raise ValueError(f"Kernel needs the name of the __global__ function to launch, got {name!r}")
        if any(c in name for c in "{};\n"):  # (no name expression holds these; source text does)
            raise ValueError(f"name {name!r:.60} looks like CUDA C++ source, not a function's name; the source comes "
                             f"first: Kernel(source, name, reference=...)")
        defined = absent_name(source, name)
        if defined is not None:  # (NVRTC finds no such name expression: a GPU cannot compile it)
            close = difflib.get_close_matches(name.split("<")[0].strip(), defined, n=3)
            hint = (f"did you mean {' or '.join(map(repr, close))}?" if close
                    else f"its __global__ functions are {', '.join(map(repr, defined))}" if defined
                    else "it defines no __global__ function")
            raise ValueError(f"kernel {name!r} is not in the source, so no GPU could compile it; {hint}")
        if reference is not None and not callable(reference):
            raise TypeError("reference must be a callable that takes numpy arrays")
        block = check_count("block", block, minimum=1, maximum=1024, hint=" (threads per block)")
        elementwise = check_flag("elementwise", elementwise)
        pointwise = check_flag("pointwise", pointwise)
        options = _check_options(options)
        if pointwise and not elementwise:
            raise ValueError("pointwise=True needs elementwise=True: a pointwise kernel's arrays all hold n elements")
        bound = read_launch_bound(source, name)
        if bound is not None and block > bound:
            # a GPU refuses such a launch (too many resources requested), so the simulated GPU must not run it
            raise ValueError(f"block={block} is more threads per block than kernel {name!r} allows by its "
                             f"__launch_bounds__({bound}), so a launch on a GPU would fail; pass block={bound} or "
                             f"less, or raise the bound")
        self.source = source
        self.name = name
        self.reference = reference
        self.block = block
        self.elementwise = elementwise
        self.pointwise = pointwise
        self.options = options
        # the parameters read from the source, checked on the simulated GPU (None: not readable)
        self._params = read_params(source, name)
        self._compiled: dict[int, Any] = {}  # GPU index -> cuda.core Kernel
        self._configs: dict[int, Any] = {}  # element count -> cuda.core LaunchConfig
        self._lock = threading.Lock()
        self.__name__ = name  # launch() labels operations with fn.__name__

    def __repr__(self) -> str:
        return f"<ringflow.Kernel {self.name} compiled for {sorted(self._compiled) or 'no GPU yet'}>"

    # -- pickling ------------------------------------------------------------------------------
    # A kernel travels to worker processes and Ray tasks pickled. What it compiled and the launch
    # configurations it made belong to this process's CUDA context, and a lock cannot be
    # pickled: the copy leaves them behind and compiles again on its first launch.
    _PER_PROCESS = ("_compiled", "_configs", "_lock")

    def __getstate__(self) -> dict[str, Any]:
        """The kernel's definition (source, name, reference, block, flags, options), without
        its per-process state. Its ``reference`` is pickled with it, so it must be picklable (a
        function defined at a module's top level, not a lambda).

        Raises:
            pickle.PicklingError, AttributeError, TypeError: as pickle does for a ``reference``
                that cannot be pickled.
        """
        return {k: v for k, v in self.__dict__.items() if k not in self._PER_PROCESS}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a pickled kernel, with nothing compiled yet and a lock of its own.

        Args:
            state: what :meth:`__getstate__` returned.
        """
        self.__dict__.update(state)
        self._params = read_params(self.source, self.name)
        self._compiled = {}
        self._configs = {}
        self._lock = threading.Lock()

    # -- compilation ---------------------------------------------------------------------------
    def compile(self, device_index: int = 0) -> Any:
        """Compile for GPU ``device_index`` (cached); returns the cuda.core ``Kernel``."""
        with self._lock:
            kern = self._compiled.get(device_index)
            if kern is not None:
                return kern
            core = _cuda_core(f"compiling kernel {self.name!r}")
            Program, ProgramOptions = core.Program, core.ProgramOptions
            dev = core.Device(device_index)
            dev.set_current()
            opts = {"std": "c++17", "name": self.name, **self.options, "arch": f"sm_{dev.arch}"}
            log = io.StringIO()
            try:
                prog = Program(self.source, "c++", options=ProgramOptions(**opts))
                obj = prog.compile("cubin", name_expressions=(self.name,), logs=log)
                kern = obj.get_kernel(self.name)
            except Exception as exc:
                raise RuntimeError(f"compiling kernel {self.name!r} for cuda:{device_index} (sm_{dev.arch}) "
                                   f"failed: {exc}\n{log.getvalue()}".rstrip()) from exc
            self._compiled[device_index] = kern
            return kern

    # -- calling -------------------------------------------------------------------------------
    def __call__(self, *args: Any, stream: Any = None) -> Any:
        """Run on ``args``: the ``reference`` on numpy arrays, else a launch on ``stream`` (see
        the module's doc for which stream when None). Raises TypeError for an argument that is
        neither an array nor a scalar (named by its position and type), no array, numpy arrays
        without a reference, numpy and device arrays mixed, a Python scalar or a numpy scalar
        of no C type (a string, a date), a numpy array of a dtype no device array has
        (:func:`~ringflow._device.protocol.check_device_dtype`) or a ``stream`` that is
        neither None, a ringflow stream nor a ``__cuda_stream__`` object, and
        ValueError for a strided array or, elementwise, one shorter than the first: on numpy
        arrays too, before the reference runs, as a launch would, and once it runs for a
        ``reference`` that writes into a read-only argument (named, with its parameter where
        the source gives it). Returns None, as a launch does; a TypeError once it ran for a
        ``reference`` that returned anything but None (or an argument, or a view of one, that it
        wrote in place). Called on the stand-in
        arrays a simulated GPU's capture hands a launched callable, it is recorded, checked
        as a launch, and run by each launch of the graph."""
        return self._call(args, stream, 0)

    def _call(self, args: tuple[Any, ...], stream: Any, bound: int) -> Any:
        """:meth:`__call__`, the last ``bound`` of ``args`` being scalars a :meth:`bind` fixed
        (counted apart in the message for a wrong count)."""
        tape = taped(args)
        if tape is not None:  # called while a simulated GPU captures: each launch of the graph runs it
            if self.reference is None:
                raise TypeError(f"kernel {self.name!r} got arrays of the simulated GPU but has no reference; "
                                "pass reference=<numpy function> to Kernel(...)")
            _check_stream(self.name, stream)
            tape.record_call(self, args, {"stream": stream},
                             check=functools.partial(self._check_captured, bound=bound))
            return None
        arrays = [a for a in args if not isinstance(a, (np.generic, bool, int, float, complex))]
        if not arrays:
            raise TypeError(f"kernel {self.name!r} needs at least one array argument (numpy arrays on the simulated "
                            f"GPU, device arrays on a GPU), then numpy scalars; got only scalars {args!r:.80}")
        if all(isinstance(a, np.ndarray) for a in arrays):
            if self.reference is None:
                raise TypeError(f"kernel {self.name!r} got numpy arrays (the simulated GPU) but has no reference; "
                                "pass reference=<numpy function> to Kernel(...)")
            self._check_like_a_launch(args, bound)
            _check_stream(self.name, stream)
            try:
                result = self.reference(*args)
            except ValueError as exc:
                # numpy's words ("assignment destination is read-only") name no argument
                read_only = [i for i, a in enumerate(args) if isinstance(a, np.ndarray) and not a.flags.writeable]
                if read_only and "read-only" in str(exc):
                    raise ValueError(self._wrote_read_only(read_only, exc)) from exc
                raise
            # a launch writes its outputs and returns nothing, so a reference returns None: what
            # else it returns (a new array, a flag, a count) is a result only the simulated GPU
            # would give, and a new array may be the result it never wrote (one returning an
            # argument, or a writable view of one, np.multiply(x, a, out=y[...]), wrote in place)
            if result is not None and not any(result is a for a in args) and not _view_of(result, args):
                raise TypeError(f"kernel {self.name!r}: its reference returned {_returned(result)}, but a launch "
                                "returns nothing, so a reference must return None (or an output array it wrote "
                                "in place); write the results into the output arrays (np.multiply(x, a, out=y), "
                                "y[...] = ...) and return nothing")
            return None
        # an argument that is no array at all (a list, a string, None) would otherwise read as
        # a device array: beside numpy arrays as "a mix", and alone as a launch that needs
        # cuda.core, which is not what is wrong (checked here, off the fast launch path)
        self._refuse_no_array(args)
        if any(isinstance(a, np.ndarray) for a in arrays):
            raise TypeError(f"kernel {self.name!r} got a mix of numpy and device arrays; pass all device arrays")
        return self._launch(args, stream)

    def _wrote_read_only(self, read_only: list[int], exc: BaseException) -> str:
        """The message for a reference that failed writing a read-only array (numpy's error
        ``exc``), naming the read-only arguments at positions ``read_only``, with their
        parameters where the kernel's signature was read."""
        params = self._params if self._params is not None and len(self._params) > max(read_only) + 1 else None
        named = [f"{i} ({params[i].text})" if params is not None else str(i) for i in read_only]
        which = (f"argument {named[0]} is" if len(named) == 1
                 else f"arguments {', '.join(named[:-1])} and {named[-1]} are")
        return (f"kernel {self.name!r}: its reference wrote into a read-only array (numpy: {exc}); {which} "
                f"read-only; write only the kernel's outputs in the reference, or, where the kernel does write that "
                f"argument, declare its parameter non-const (float* rather than const float*) and pass a writable "
                f"array")

    def _refuse_no_array(self, args: tuple[Any, ...]) -> None:
        """Refuse the first argument that is neither a scalar, a numpy array nor a device array.

        Raises:
            TypeError: naming the argument by its position and type (a list or tuple: with
                ``np.asarray`` as the way to make it an array).
        """
        for i, a in enumerate(args):
            if not isinstance(a, (np.ndarray, np.generic, bool, int, float, complex)) and _framework(a) is None:
                hint = "; make it an array with np.asarray" if isinstance(a, (list, tuple)) else ""
                raise TypeError(f"kernel {self.name!r}: argument {i} is {type(a).__name__} {a!r:.60}; "
                                f"kernel arguments {_ACCEPTED}{hint}")

    def bind(self, *scalars: Any, name: str | None = None) -> "BoundKernel":
        """``f(*arrays)`` that launches this kernel with ``scalars`` after the arrays (numpy
        scalars, as for a direct call)."""
        return BoundKernel(self, scalars, name)

    def __ringflow_launch__(self, cc_stream: Any, device: int, kernel_args: list, sizes: list) -> None:
        """Enqueue on ``cc_stream`` (a cuda.core Stream) with the array arguments already turned
        into device pointers and their element counts in ``sizes``: the fast path
        :meth:`ringflow._device.cuda.CudaStream.launch` takes for a kernel."""
        self._enqueue(cc_stream, device, kernel_args, sizes)

    def _check_captured(self, args: tuple[Any, ...], bound: int = 0) -> None:
        """:meth:`_check_like_a_launch` for a call a simulated GPU's capture records, on its
        arguments as they were then (a stand-in's shadow for each array).

        Raises:
            TypeError: first for an argument that is no array nor scalar (a list, None), as a
                call on numpy arrays does, which the signature check would otherwise describe
                as the scalar numpy makes of it; then as :meth:`_check_like_a_launch`.
            ValueError: as :meth:`_check_like_a_launch`.
        """
        self._refuse_no_array(args)
        self._check_like_a_launch(args, bound)

    def _check_like_a_launch(self, args: tuple[Any, ...], bound: int = 0) -> None:
        """Refuse the numpy arguments a launch on a GPU would refuse (a Python scalar, a strided
        array, an array shorter than the first), or would misread (an array or scalar whose
        dtype is not its parameter's type in the source, a count that does not match:
        :mod:`ringflow._kernel_signature`), so that what runs on the simulated GPU also
        launches, right, on a real one.

        Raises:
            TypeError, ValueError: as :meth:`_launch` and :meth:`_enqueue` do, and TypeError
                for arguments that do not match the kernel's parameters.
        """
        sizes = []
        for i, a in enumerate(args):
            self._check_scalar(i, a)
            if isinstance(a, np.ndarray):
                # on a GPU this argument is a device array, which never has such a dtype (nor
                # objects, nor the other byte order a launch would misread)
                check_device_dtype(f"kernel {self.name!r}: argument {i}", a.dtype)
                if not a.flags.c_contiguous:
                    raise ValueError(f"kernel {self.name!r}: argument {i} is not C-contiguous (strides {a.strides}); "
                                     "kernel arguments must be C-contiguous: use np.ascontiguousarray")
                sizes.append(a.size)
        self._check_sizes(sizes, args)
        if self._params is not None:
            check_arguments(self.name, self._params, args, bound)

    def _check_scalar(self, i: int, a: Any) -> None:
        """Refuse argument ``i`` when it is a scalar a launch cannot pass: a Python number, or a
        numpy scalar of no C type. (numpy's float64 and complex128 are Python floats and complex
        numbers too, so numpy scalars are told apart first.)"""
        if isinstance(a, np.generic):
            if not is_c_scalar(a):
                raise TypeError(f"kernel {self.name!r}: argument {i} is {type(a).__name__} {a!r:.60}, which has "
                                f"no C type to pass by value; {_NUMERIC_SCALAR}")
        elif isinstance(a, (bool, int, float, complex)):
            raise TypeError(f"pass scalars to kernel {self.name!r} as numpy scalars (e.g. np.float32(2.0)) so "
                            f"their C type is explicit; got Python {type(a).__name__} {a!r}")

    def _check_sizes(self, sizes: list, args: Any) -> None:
        """Refuse, for an elementwise kernel, an array holding fewer elements than the first.

        Args:
            sizes: the arrays' element counts, in order.
            args: the arguments they came from, in which every one that is no numpy scalar is an
                array (a launch's addresses included): names the short one by its position.

        Raises:
            ValueError: naming the first short argument, its element count and ``n``.
        """
        n = sizes[0]
        if self.elementwise and min(sizes) < n:
            j = next(j for j, size in enumerate(sizes) if size < n)
            position = [i for i, a in enumerate(args) if not isinstance(a, np.generic)][j]
            raise ValueError(f"kernel {self.name!r}: the first array has {n} elements but argument {position} has "
                             f"{sizes[j]}; every array must hold at least n = {n} elements")

    def _enqueue(self, cc_stream: Any, device: int, kernel_args: list, sizes: list) -> None:
        n = sizes[0]
        self._check_sizes(sizes, kernel_args)
        kern = self._compiled.get(device)
        if kern is None:
            kern = self.compile(device)
        config = self._configs.get(n)
        if config is None:
            if len(self._configs) > 64:
                self._configs.clear()
            config = self._configs[n] = _cuda().LaunchConfig(grid=max(1, math.ceil(n / self.block)), block=self.block)
        _cuda().launch(cc_stream, config, kern, *kernel_args, np.uint64(n))

    def _launch(self, args: tuple[Any, ...], stream: Any) -> None:
        _cuda_core(f"launching kernel {self.name!r} on device arrays")
        kernel_args: list[Any] = []
        sizes, devices, kinds = [], set(), set()
        for i, a in enumerate(args):
            self._check_scalar(i, a)
            if isinstance(a, np.generic):
                kernel_args.append(launch_scalar(a))
                continue
            ptr, size, device, kind = _describe(a, (self.name, i))
            kernel_args.append(ptr)  # cuda.core passes a Python int as a pointer
            sizes.append(size)
            devices.add(device)
            kinds.add(kind)
        if len(devices) != 1:
            raise ValueError(f"kernel {self.name!r} got arrays on several GPUs {sorted(devices)}; use one GPU")
        (device,) = devices
        self._enqueue(_pick_stream(stream, device, kinds), device, kernel_args, sizes)


class BoundKernel:
    """A :class:`Kernel` with its trailing scalar arguments fixed: ``f(*arrays)`` launches
    ``kernel(*arrays, *scalars)``. Attributes such as ``sim_seconds`` may be set on it; without
    one of its own it has its kernel's ``sim_seconds``, where that is set."""

    def __init__(self, kernel: Kernel, scalars: tuple, name: str | None = None):
        for v in scalars:
            if not isinstance(v, np.generic):
                raise TypeError(f"bind takes numpy scalars (e.g. np.float32(2.0)) so their C type is explicit; "
                                f"got {type(v).__name__} {v!r}")
            if not is_c_scalar(v):
                raise TypeError(f"bind: {type(v).__name__} {v!r:.60} has no C type to pass by value; {_NUMERIC_SCALAR}")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"bind: name must be a str or None, got {type(name).__name__} {name!r:.60}")
        self.kernel = kernel
        self.scalars = tuple(launch_scalar(v) for v in scalars)
        self.__name__ = name or kernel.name

    def __call__(self, *arrays: Any, stream: Any = None) -> Any:
        return self.kernel._call((*arrays, *self.scalars), stream, len(self.scalars))

    def __ringflow_launch__(self, cc_stream: Any, device: int, kernel_args: list, sizes: list) -> None:
        self.kernel._enqueue(cc_stream, device, [*kernel_args, *self.scalars], sizes)

    @property
    def pointwise(self) -> bool:
        """The kernel's ``pointwise`` promise (see :class:`Kernel`)."""
        return self.kernel.pointwise

    def __getattr__(self, name: str) -> Any:
        # (called only for what the bound kernel lacks: a sim_seconds set on it comes first)
        kernel = self.__dict__.get("kernel")  # (absent while unpickling)
        if name == "sim_seconds" and kernel is not None:
            return kernel.sim_seconds
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        return f"<ringflow.BoundKernel {self.__name__} = {self.kernel.name}(*arrays, *{self.scalars})>"


class _Option(NamedTuple):
    """The values one ``ProgramOptions`` field takes: ``says`` words them for a message."""

    says: str
    takes: Callable[[Any], bool]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_macro(v: Any) -> bool:
    return isinstance(v, str) or (isinstance(v, tuple) and len(v) == 2 and all(isinstance(x, str) for x in v))


def _is_source(v: Any) -> bool:
    return isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str) and isinstance(v[1], (str, bytes, bytearray))


def _one_or_list(takes: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: takes(v) or (isinstance(v, (list, tuple)) and all(takes(x) for x in v))


# None leaves a field at cuda.core's default, except the program's name, which cuda.core encodes
_FLAG = _Option("True or False", lambda v: v is None or isinstance(v, (bool, np.bool_)))
_TEXT = _Option("a str", lambda v: v is None or isinstance(v, str))
_COUNT = _Option("an integer", lambda v: v is None or (isinstance(v, numbers.Integral) and not isinstance(v, bool)))
# cuda.core tells one number from a list of them with isinstance(v, int)
_NUMBERS = _Option("an int or a list of ints", lambda v: v is None or _one_or_list(_is_int)(v))
_TEXTS = _Option("a str or a list of str", lambda v: v is None or _one_or_list(lambda x: isinstance(x, str))(v))
_MACROS = _Option("a str, a (name, value) tuple of str, or a list of them",
                  lambda v: v is None or _one_or_list(_is_macro)(v))
_SOURCES = _Option("a list of (name, source) tuples", lambda v: v is None or _one_or_list(_is_source)(v))

# cuda.core's ProgramOptions fields (of its newest release here), and the values each takes.
# Where cuda.core imports, its own fields say which options there are; this list checks them
# where it does not (tests/test_kernel.py holds it to the installed cuda.core's fields).
_PROGRAM_OPTIONS: dict[str, _Option] = {
    "name": _Option("a str", lambda v: isinstance(v, str)), "arch": _TEXT,
    "relocatable_device_code": _FLAG, "extensible_whole_program": _FLAG, "debug": _FLAG, "lineinfo": _FLAG,
    "device_code_optimize": _FLAG, "ptxas_options": _TEXTS, "max_register_count": _COUNT, "ftz": _FLAG,
    "prec_sqrt": _FLAG, "prec_div": _FLAG, "fma": _FLAG, "use_fast_math": _FLAG,
    "extra_device_vectorization": _FLAG, "link_time_optimization": _FLAG, "gen_opt_lto": _FLAG,
    "define_macro": _MACROS, "undefine_macro": _TEXTS, "include_path": _TEXTS, "pre_include": _TEXTS,
    "no_source_include": _FLAG, "std": _TEXT, "builtin_move_forward": _FLAG, "builtin_initializer_list": _FLAG,
    "disable_warnings": _FLAG, "restrict": _FLAG, "device_as_default_execution_space": _FLAG,
    "device_int128": _FLAG, "optimization_info": _TEXT, "no_display_error_number": _FLAG,
    "diag_error": _NUMBERS, "diag_suppress": _NUMBERS, "diag_warn": _NUMBERS, "brief_diagnostics": _FLAG,
    "time": _TEXT, "split_compile": _COUNT, "fdevice_syntax_only": _FLAG, "minimal": _FLAG, "no_cache": _FLAG,
    "fdevice_time_trace": _TEXT, "device_float128": _FLAG, "frandom_seed": _TEXT, "ofast_compile": _TEXT,
    "pch": _FLAG, "create_pch": _TEXT, "use_pch": _TEXT, "pch_dir": _TEXT, "pch_verbose": _FLAG,
    "pch_messages": _FLAG, "instantiate_templates_in_pch": _FLAG, "extra_sources": _SOURCES,
    "use_libdevice": _FLAG, "numba_debug": _FLAG, "use_bundled_headers": _FLAG,
}


def _option_names() -> list[str]:
    """The ``ProgramOptions`` fields: the installed cuda.core's, else those of the list kept here."""
    try:
        program_options = _cuda().ProgramOptions
    except (ImportError, AttributeError):
        return list(_PROGRAM_OPTIONS)
    if not dataclasses.is_dataclass(program_options):
        return list(_PROGRAM_OPTIONS)
    return [f.name for f in dataclasses.fields(program_options)]


def _check_options(options: Any) -> dict[str, Any]:
    """A copy of a Kernel's ``options``, checked as ``ProgramOptions`` would check them when the
    kernel compiles (on a GPU, at its first launch), so the simulated GPU refuses them too.

    Raises:
        TypeError: not a dict, a key that is not a str, or a value of the wrong type for its field.
        ValueError: a key that is no ``ProgramOptions`` field (close names are suggested), or
            ``arch``, which :meth:`Kernel.compile` sets to each GPU's own.
    """
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise TypeError(f"options must be a dict of cuda.core ProgramOptions fields, got {type(options).__name__}")
    if not options:
        return {}
    names = _option_names()
    for key, value in options.items():
        if not isinstance(key, str):
            raise TypeError(f"options must be a dict of cuda.core ProgramOptions fields, keyed by their names; "
                            f"got {type(key).__name__} {key!r:.60}")
        if key not in names:
            close = difflib.get_close_matches(key, names, n=3)
            hint = (f"did you mean {' or '.join(map(repr, close))}?" if close
                     else f"its fields are {', '.join(map(repr, names))}")
            raise ValueError(f"options: {key!r} is not a cuda.core ProgramOptions field; {hint}")
        if key == "arch":
            # compile() builds a cubin for the GPU it loads on; another architecture's would not load
            raise ValueError(f"options: 'arch' ({value!r:.40}) is chosen by ringflow: each GPU gets a cubin for its "
                             "own architecture (sm_XX) when the kernel first runs there; leave 'arch' out")
        field = _PROGRAM_OPTIONS.get(key)  # (a field of a newer cuda.core than this list knows goes unchecked)
        if field is not None and not field.takes(value):
            raise TypeError(f"options[{key!r}] must be {field.says}, got {described(value)}")
    return dict(options)


def _cuda_core(what: str) -> Any:
    """The cuda.core module, for ``what`` (a phrase naming the call).

    Raises:
        RuntimeError: cuda.core does not import; the message says how to install it.
    """
    try:
        return _cuda()  # (remembered once imported: launches ask on every call)
    except ImportError as exc:
        raise RuntimeError(f"{what} needs cuda.core, which did not import ({exc}); install it with: "
                           f"{INSTALL_HINT}") from exc


@functools.lru_cache(maxsize=None)
def _cuda() -> Any:
    import cuda.core

    return cuda.core


def _returned(result: Any) -> str:
    """What a reference returned, for the message refusing it: a new array by its type, any
    other value by its type and value."""
    if isinstance(result, np.ndarray):
        return f"a new {type(result).__name__}"
    shown = str(result) if isinstance(result, np.generic) else repr(result)  # (np.int64(4) as 4)
    return f"{type(result).__name__} {shown:.40}"


def _view_of(result: Any, args: tuple[Any, ...]) -> bool:
    """Whether ``result`` is a writable numpy view of memory of one of the arrays in ``args``
    (what a reference returns that wrote an output through a view of it)."""
    return (isinstance(result, np.ndarray) and result.flags.writeable and result.base is not None
            and any(isinstance(a, np.ndarray) and np.may_share_memory(result, a) for a in args))


def _framework(a: Any) -> "str | None":
    """Which kind of device array ``a`` is: ``"cupy"``, ``"torch"``, ``"dlpack"`` (a cuda.core
    StridedMemoryView), ``"cai"`` (any other ``__cuda_array_interface__``), or None for none."""
    mod = type(a).__module__.split(".")[0]
    if mod in ("cupy", "torch"):
        return mod
    if type(a).__name__ == "StridedMemoryView":
        return "dlpack"
    return "cai" if getattr(a, "__cuda_array_interface__", None) is not None else None


def _describe(a: Any, where: "tuple[str, int] | None" = None) -> tuple[int, int, int, str]:
    """(device pointer, element count, GPU index, framework) of a contiguous device array;
    ``where`` (the kernel's name and the argument's position) names it in an error, formatted
    only then (this runs for every argument of every launch).

    Raises:
        ValueError: a strided array, or a torch tensor not on a GPU.
        TypeError: no device array.
    """
    kind = _framework(a)
    if kind == "cupy":
        if not a.flags.c_contiguous:
            raise ValueError(f"{_argument(where)} is not C-contiguous; kernel arguments must be C-contiguous: use "
                             "cupy.ascontiguousarray")
        return int(a.data.ptr), int(a.size), int(a.device.id), "cupy"
    if kind == "torch":
        if a.device.type != "cuda":
            raise ValueError(f"{_argument(where)} is a torch tensor on {a.device}, which cannot be a kernel "
                             "argument; move it to the GPU")
        if not a.is_contiguous():
            raise ValueError(f"{_argument(where)} is not contiguous; kernel arguments must be contiguous: use "
                             "tensor.contiguous()")
        return int(a.data_ptr()), int(a.numel()), int(a.device.index), "torch"
    if kind == "dlpack":
        if a.strides is not None and not _c_contiguous(a.shape, a.strides):
            raise _strided(where)
        return int(a.ptr), int(math.prod(a.shape)), int(a.device_id), "dlpack"
    if kind == "cai":
        cai = a.__cuda_array_interface__
        if cai.get("strides") is not None and not _c_contiguous(cai["shape"], cai["strides"], cai["typestr"]):
            raise _strided(where)
        from cuda.bindings import driver

        ptr = int(cai["data"][0])
        err, dev = driver.cuPointerGetAttribute(driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
        return ptr, int(math.prod(cai["shape"])), int(dev) if int(err) == 0 else 0, "cai"
    raise TypeError(f"{_argument(where)}: kernel arguments {_ACCEPTED}; got {type(a).__name__}")


def _argument(where: "tuple[str, int] | None") -> str:
    """A kernel argument, named by its kernel and position where ``where`` gives them."""
    return "a kernel argument" if where is None else f"kernel {where[0]!r}: argument {where[1]}"


def _strided(where: "tuple[str, int] | None") -> ValueError:
    return ValueError(f"{_argument(where)} is not C-contiguous; kernel arguments must be C-contiguous: make a "
                      "contiguous copy (its framework's ascontiguousarray)")


def _c_contiguous(shape, strides, typestr: str | None = None) -> bool:
    if typestr is not None:  # __cuda_array_interface__ strides are in bytes
        itemsize = np.dtype(typestr).itemsize
        strides = tuple(s // itemsize for s in strides)
    expected = 1
    for dim, stride in zip(reversed(tuple(shape)), reversed(tuple(strides))):
        if dim > 1 and stride != expected:
            return False
        expected *= dim
    return True


def _check_stream(name: str, stream: Any) -> None:
    """Refuse a ``stream=`` that a launch could not use (None, a ringflow stream or any object
    with ``__cuda_stream__``), on the simulated GPU too, where the reference ignores it."""
    if stream is not None and not isinstance(stream, Stream) and not hasattr(stream, "__cuda_stream__"):
        raise TypeError(f"kernel {name!r}: stream must be None, a ringflow stream or an object with "
                        f"__cuda_stream__, got {type(stream).__name__} {stream!r:.60}")


def _pick_stream(stream: Any, device: int, kinds: set[str]) -> Any:
    """The stream to launch on: explicit, else the running ringflow launch's, else the framework's."""
    from cuda.core import Stream

    from ._device.cuda.arrays import current_stream
    from ._device.cuda.stream import CudaStream

    if stream is not None:
        return stream._cc if isinstance(stream, CudaStream) else stream  # or any __cuda_stream__ object
    rs = current_stream()
    if rs is not None and rs._device.index == device:
        return rs._cc
    if "torch" in kinds:
        import torch

        return Stream.from_handle(torch.cuda.current_stream(device).cuda_stream)
    if "cupy" in kinds:
        import cupy

        with cupy.cuda.Device(device):
            return Stream.from_handle(cupy.cuda.get_current_stream().ptr)
    raise RuntimeError("no stream to launch on: call the kernel inside stream.launch(...) or pass stream=")
