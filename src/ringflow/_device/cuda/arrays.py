"""Framework adapters: what a launched callable receives on a CUDA device.

``array="cupy"`` gives ``cupy.ndarray``; ``"torch"`` gives ``torch.Tensor``; ``"dlpack"`` gives a
``cuda.core.utils.StridedMemoryView`` (it has ``__dlpack__`` and ``.ptr``, so any framework can
import it with its ``from_dlpack``); ``"auto"`` picks CuPy, else PyTorch, else DLPack. Every
array is a zero-copy view of the buffer range: it does not own the memory, and it must not be
used after the buffer is closed (or, for device memory, after the stream-ordered free).

While a launched callable runs, the framework's current stream is the launching stream, and
:func:`current_stream` returns it (that is how :class:`ringflow.Kernel` finds it under
``"dlpack"``, which has no stream of its own).
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np

from .. import ARRAY_KINDS
from ..protocol import DEVICE_DTYPES, ArrayArg
from ._lib import core

if TYPE_CHECKING:
    from .stream import CudaStream


_CURRENT: contextvars.ContextVar["CudaStream | None"] = contextvars.ContextVar("ringflow_cuda_stream", default=None)


def current_stream() -> "CudaStream | None":
    """The ringflow stream whose ``launch`` is running ``fn`` in this thread, if any."""
    return _CURRENT.get()


@contextlib.contextmanager
def using_stream(stream: "CudaStream") -> Iterator[None]:
    token = _CURRENT.set(stream)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def _address(arg: ArrayArg) -> int:
    s = arg.where
    return s.buffer._ptr + s.offset


class _CudaArrayInterface:
    """A minimal ``__cuda_array_interface__`` (v3) exporter; holds the buffer object."""

    __slots__ = ("__cuda_array_interface__", "owner")

    def __init__(self, ptr: int, shape: tuple[int, ...], dtype: np.dtype, owner: Any):
        self.owner = owner
        # stream None: no synchronisation needed, the launching stream is already current.
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": dtype.str, "data": (ptr, False),
                                         "strides": None, "version": 3, "stream": None}


class CupyAdapter:
    name = "cupy"

    def check_dtype(self, name: str, dtype: np.dtype) -> None:
        """Nothing: a CuPy array holds every dtype of :data:`~ringflow._device.protocol.DEVICE_DTYPES`."""

    def __init__(self) -> None:
        import cupy

        self._cp = cupy

    def array(self, arg: ArrayArg, index: int) -> Any:
        cp = self._cp
        mem = cp.cuda.UnownedMemory(_address(arg), arg.where.nbytes, arg.where.buffer, index)
        return cp.ndarray(arg.shape, dtype=arg.dtype, memptr=cp.cuda.MemoryPointer(mem, 0))

    def stream_context(self, stream: "CudaStream") -> contextlib.AbstractContextManager:
        cp = self._cp
        cs = stream._framework_streams.get("cupy")
        if cs is None:
            if hasattr(cp.cuda.Stream, "from_external"):  # CuPy >= 14
                cs = cp.cuda.Stream.from_external(stream)
            else:
                cs = cp.cuda.ExternalStream(stream.handle, stream._device.index)
            stream._framework_streams["cupy"] = cs
        stack = contextlib.ExitStack()
        stack.enter_context(cp.cuda.Device(stream._device.index))
        stack.enter_context(cs)
        return stack


def torch_unheld(torch: Any) -> frozenset:
    """The dtypes of :data:`~ringflow._device.protocol.DEVICE_DTYPES` that this PyTorch has no
    tensor for. PyTorch reads a ``__cuda_array_interface__``'s dtype through the same numpy
    mapping as ``torch.from_numpy``, so an empty host array of each tells, without the GPU; older
    releases have no uint16, uint32 or uint64 there."""
    unheld = []
    for dtype in sorted(DEVICE_DTYPES, key=str):
        try:
            torch.from_numpy(np.empty(0, dtype))
        except TypeError:
            unheld.append(dtype)
    return frozenset(unheld)


class TorchAdapter:
    name = "torch"

    def __init__(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("PyTorch is installed but sees no CUDA GPU (a CPU-only build?)")
        self._torch = torch
        self.unheld = torch_unheld(torch)

    def check_dtype(self, name: str, dtype: np.dtype) -> None:
        """Refuse a device dtype this PyTorch has no tensor for (:func:`torch_unheld`).

        Raises:
            TypeError: naming ``name``, the dtype and what to do instead.
        """
        if dtype in self.unheld:
            bits = 8 * dtype.itemsize
            raise TypeError(f"{name}: dtype {dtype} cannot be a tensor of PyTorch {self._torch.__version__}, which "
                            f"has no such type, and this device hands computes PyTorch tensors (array='torch'); "
                            f"install a PyTorch that has it, make the device with array='cupy' or array='dlpack', or "
                            f"view the array as signed integers of its size (a.view(np.int{bits}))")

    def array(self, arg: ArrayArg, index: int) -> Any:
        self.check_dtype("array(dtype)", arg.dtype)
        torch = self._torch
        return torch.as_tensor(_CudaArrayInterface(_address(arg), arg.shape, arg.dtype, arg.where.buffer),
                               device=torch.device("cuda", index))

    def stream_context(self, stream: "CudaStream") -> contextlib.AbstractContextManager:
        torch = self._torch
        ts = stream._framework_streams.get("torch")
        if ts is None:
            ts = torch.cuda.ExternalStream(stream.handle, device=torch.device("cuda", stream._device.index))
            stream._framework_streams["torch"] = ts
        return torch.cuda.stream(ts)


class DlpackAdapter:
    name = "dlpack"

    def check_dtype(self, name: str, dtype: np.dtype) -> None:
        """Nothing: DLPack has a type for every dtype of :data:`~ringflow._device.protocol.DEVICE_DTYPES`."""

    def array(self, arg: ArrayArg, index: int) -> Any:
        from cuda.core.utils import StridedMemoryView

        buf = core().Buffer.from_handle(_address(arg), arg.where.nbytes, owner=arg.where.buffer)
        return StridedMemoryView.from_buffer(buf, tuple(arg.shape), dtype=arg.dtype)

    def stream_context(self, stream: "CudaStream") -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


@contextlib.contextmanager
def framework_allocations(index: int) -> Iterator[Callable[[], int]]:
    """Count the device allocations CuPy's and PyTorch's caching allocators serve on this thread
    (device ``index``) inside the block, cached blocks included (which no driver call shows);
    yields a callable returning the count so far. A framework not imported is not counted."""
    counts = [0]
    stack = contextlib.ExitStack()
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        class _Count(cupy.cuda.MemoryHook):  # memory hooks are per thread
            name = "ringflow-capture"

            def malloc_preprocess(self, **kwargs):
                counts[0] += 1

            def alloc_preprocess(self, **kwargs):
                counts[0] += 1

        stack.enter_context(_Count())
    torch = sys.modules.get("torch")
    before = None
    if torch is not None and torch.cuda.is_initialized():
        before = torch.cuda.memory_stats(index).get("allocation.all.allocated", 0)

    def count() -> int:
        n = counts[0]
        if before is not None:
            n += torch.cuda.memory_stats(index).get("allocation.all.allocated", 0) - before
        return n

    with stack:
        yield count


def resolve(kind: str) -> CupyAdapter | TorchAdapter | DlpackAdapter:
    """The adapter for ``array=kind``; ``"auto"`` tries CuPy, then PyTorch, then DLPack."""
    if kind not in ARRAY_KINDS:
        raise ValueError(f"unknown array type {kind!r}; choose one of {', '.join(map(repr, ARRAY_KINDS))}")
    if kind == "dlpack":
        return DlpackAdapter()
    errors = []
    for name, cls in (("cupy", CupyAdapter), ("torch", TorchAdapter)):
        if kind not in ("auto", name):
            continue
        try:
            return cls()
        except Exception as exc:  # noqa: BLE001 - missing or unusable framework
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
    if kind == "auto":
        return DlpackAdapter()
    raise RuntimeError(f"array={kind!r} is not usable here ({'; '.join(errors)}); install it, or pass "
                       "array='auto' or array='dlpack'")
