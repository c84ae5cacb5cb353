"""The pipeline: :class:`Pipeline`, five overlapped stages over a stream of items.

>>> import numpy as np, ringflow as rf
>>> def f(x, y):              # runs on the device: y[:] = 2x + 1
...     y[:] = x * 2 + 1
>>> items = [np.random.rand(1000).astype(np.float32) for _ in range(8)]
>>> with rf.Pipeline(f, device=rf.device("sim"), chunk_bytes=1 << 14) as pipe:
...     results = list(pipe.map(items))
>>> all(np.array_equal(r, a * 2 + 1) for r, a in zip(results, items))
True

A pipeline advances on a progress thread of its own (:mod:`.driver`): its futures complete while
the caller's code runs, and every method may be called from any thread.
"""

from __future__ import annotations

import asyncio
import collections
import copy as copy_module
import dataclasses
import functools
import inspect
import itertools
import logging
import math
import threading
import warnings
import weakref
from typing import Any, AsyncIterator, Callable, Iterable, Iterator, Optional

import numpy as np

from .._device import device as make_device, device_label, device_list
from .._device import host_pool
from .._device.protocol import Device, check_device_dtype
from .._errors import DeviceError, StageError, describe, shown, warn_quietly
from .._plan import aligned
from .aio import (NO_ROOM, RAISE, SKIP, STOP, CancelIfDropped, OffLoopSubmit, amap_window, follow, give_up_pulled_by,
                  give_up_stranded, retrieve)
from .chunk import Chunk, ChunkFuture, cancel_unwanted, post_cancel
from .driver import CallerDriver, Hold, ProgressThread, ThreadEnded, resolve, warn_if_stalled
from .frames import forget_own_frames
from .config import PipelineConfig, SlotCounts
from .sizing import DEFAULT_CHUNK_BYTES, default_workers, fit_pinned_budget, lent_slots, resolve_slots
from .trees import ALIGN, Packed, flatten, host_views, is_spec, is_tree, pack_into, packed, unflatten
from .like import converter
from .validate import (COMPUTE_FORM, MAX_CHUNK_BYTES, as_host_array, check_arity, check_choice, check_flag,
                       check_iterable, check_not_masked, check_options, check_output_spec, check_timeout,
                       warn_if_elements_as_items)
from .scheduler import Scheduler, check_fill_rows, map_cut_short
from .reentry import (check_process, generation as reentry_generation, on_progress_thread, refuse_from_stage,
                      refuse_on_progress_thread)
from .sigint import ShieldedIterator, interruptible_device_calls, shielded, shielded_call, try_lock
from .slot_array import check_in_its_slot, in_slot, run_offering
from .states import ChunkState
from .stats import PipelineStats
from .uncopyable import Uncopyable
from .._trace import nvtx
from .._trace.report import Report, memory_of
from .._trace.timeline import Anchor, Span, Timeline, record_chunk, stall_spans

logger = logging.getLogger(__name__)


def grow_slots(nbytes: int, split: str = " or split the item") -> str:
    """What to change where ``nbytes`` do not fit a slot: raise ``chunk_bytes`` to them (or
    ``split``), unless they are more than ``chunk_bytes`` may be."""
    if nbytes > MAX_CHUNK_BYTES:
        return f"that is more than any slot holds (chunk_bytes is at most {MAX_CHUNK_BYTES} bytes); split it"
    return f"raise chunk_bytes to at least {nbytes}{split}"


def _copy_array_in(arr: np.ndarray, raw: np.ndarray, chunk_bytes: int) -> tuple:
    if arr.nbytes > chunk_bytes:
        raise ValueError(f"an item of {arr.nbytes} bytes (shape {arr.shape}, {arr.dtype}) does not fit a slot of "
                         f"{chunk_bytes} bytes; {grow_slots(arr.nbytes)}")
    dst = raw[:arr.nbytes].view(arr.dtype).reshape(arr.shape)
    np.copyto(dst, arr, casting="no")
    return arr.shape, arr.dtype


def _untrack(sched: Scheduler, chunks: list) -> None:
    """A map that took ``chunks`` has ended: their results are no longer its to hand out, nor
    held for it (lock held). Once for each chunk, however often it is called."""
    for chunk in chunks:
        if chunk.in_map:
            chunk.in_map = False
            if chunk.state.final:
                sched.unclaimed -= 1


def _private_copy(item: Any) -> Any:
    """A copy of a plain array item (or of each array of a tuple, list or dict of them) in
    ordinary memory that only the pipeline holds."""
    if is_tree(item):
        leaves, tree = flatten(item)
        return unflatten(tree, [np.array(as_host_array(leaf)) for leaf in leaves])
    return np.array(item)


def _prepare_array(user_prepare: Optional[Callable], chunk_bytes: int, item: Any, raw: np.ndarray,
                   check: Callable[[str, np.dtype], None] = check_device_dtype,
                   ring: Optional[np.ndarray] = None) -> tuple:
    """The prepare stage of a pipeline of arrays: ``user_prepare(item)`` (or the item itself)
    copied into the pinned slot, each array's dtype checked by ``check`` (the device's
    :meth:`~ringflow._device.protocol.Device.check_dtype` where the device is at hand). ``ring``:
    the bytes of the host-in ring ``raw`` is a slot of (none is read), where an array lying in
    another of its slots is refused (:func:`check_in_its_slot`). A module function, not a
    method: the scheduler must not hold the pipeline (a pipeline dropped without close() is
    collected and its finaliser cleans up)."""
    arr = run_offering(user_prepare, item, raw) if user_prepare is not None else item
    if is_tree(arr):  # several arrays: packed into the slot, moved as bytes
        leaves, layout = tree_layout(arr, chunk_bytes, "items" if user_prepare is None else "prepare's arrays",
                                     check)
        if ring is not None:
            check_in_its_slot(leaves, raw, ring)
        # an array made in the slot (empty_slot) would be overwritten by the leaves packed before it
        leaves = [a.copy() if np.may_share_memory(a, raw) else a for a in leaves]
        pack_into(layout, leaves, raw)
        return (layout.nbytes,), np.dtype(np.uint8), layout
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"prepare must return a numpy array (or a tuple, list or dict of them), got "
                        f"{type(arr).__name__}")
    check_not_masked("items" if user_prepare is None else "prepare's array", arr)
    check("items" if user_prepare is None else "prepare's array", arr.dtype)
    if user_prepare is not None and in_slot(arr, raw):  # made in the slot (ringflow.host.empty_slot)
        return arr.shape, arr.dtype
    if ring is not None:
        check_in_its_slot((arr,), raw, ring)
    return _copy_array_in(arr, raw, chunk_bytes)


class _ThreadPrepare:
    """The prepare stage on CPU worker threads: :func:`_prepare_array` into each chunk's slot.
    ``ring``: the bytes of the host-in ring (none is read), set once the scheduler has made it,
    for a ``prepare``: an array it returns from another item's slot then fails its item."""

    __slots__ = ("user_prepare", "chunk_bytes", "check", "ring")

    def __init__(self, user_prepare: Optional[Callable], chunk_bytes: int, check: Callable[[str, np.dtype], None]):
        self.user_prepare, self.chunk_bytes, self.check = user_prepare, chunk_bytes, check
        self.ring: Optional[np.ndarray] = None

    def __call__(self, item: Any, raw: np.ndarray) -> tuple:
        return _prepare_array(self.user_prepare, self.chunk_bytes, item, raw, self.check, self.ring)


# Items up to this size may share a chunk. A larger one fills most of a chunk, and in a part of a
# shared chunks' slab it would leave the slab's tail unused (more slabs pinned for the same
# requests): it goes in a chunk of its own, staged into a pool array of its size. A pool array up
# to this size given to ``submit`` is copied into a shared chunk too (the copy costs the
# submitting thread less than a chunk of its own costs the progress thread).
SHARE_AT_MOST_BYTES = 4 << 20


_SHARES = object()  # a map's pulled item that goes into a shared chunk


def _break_unless_broken(sched: Scheduler, err: DeviceError) -> None:
    """On the progress thread: break the pipeline with ``err``, a sticky device error an
    accepting thread met, unless a step found the device broken first."""
    if sched.broken is None:
        sched.break_on(err)


def _used_up(source: Iterator[Any]) -> bool:
    """Whether ``source`` has no item left (one it still had is taken from it, and not run)."""
    try:
        next(source)
    except StopIteration:
        return True
    return False


def _never(*_args: Any) -> bool:
    """False, whatever it is given: the wait's condition of a submit nobody can give up, and a
    command that does nothing (:meth:`Pipeline._wake_waits`)."""
    return False


class _GaveUp(Exception):
    """An asubmit's accepting, on the loop's executor, stopped waiting for capacity: the task
    awaiting it gave up (nothing of the item was accepted)."""


class _Shared:
    """An item a map put in a shared chunk: its future and its bytes (held by the map until it
    hands the result out)."""

    __slots__ = ("future", "nbytes")

    def __init__(self, future: ChunkFuture, nbytes: int):
        self.future, self.nbytes = future, nbytes

    @property
    def index(self) -> int:
        return self.future.index

    def ended(self) -> bool:
        return self.future.done()

    def outcome(self) -> tuple:
        """``(state, value, error)`` of the ended item, as a chunk of its own has them."""
        fut = self.future
        if fut.cancelled():
            return ChunkState.CANCELLED, None, None
        error = fut.settled_error()
        if error is not None:
            return ChunkState.FAILED, None, error
        return ChunkState.DELIVERED, fut.settled_value(), None


def tree_layout(item: Any, chunk_bytes: int, where: str = "items",
                check: Callable[[str, np.dtype], None] = check_device_dtype) -> tuple:
    """``(leaves as numpy arrays, packed layout)`` of an item of several arrays, each leaf's
    dtype checked by ``check`` (a device's :meth:`~ringflow._device.protocol.Device.check_dtype`
    where the device is known).

    Raises:
        TypeError: a leaf that is not a host array, or of a dtype no device array may have.
        ValueError: a leaf's dtype has items of 0 bytes, or the packed arrays do not fit a slot
            of ``chunk_bytes``.
    """
    leaves, tree = flatten(item)
    arrays = [as_host_array(leaf, f"{where} (each array of a tuple, list or dict)") for leaf in leaves]
    for a in arrays:
        check(f"{where} (each array of a tuple, list or dict)", a.dtype)
    layout = packed(tree, [(a.shape, a.dtype) for a in arrays])
    if layout.nbytes > chunk_bytes:
        raise ValueError(f"an item of {len(arrays)} arrays takes {layout.nbytes} bytes packed (each aligned to "
                         f"{ALIGN} bytes), more than a slot of {chunk_bytes}; {grow_slots(layout.nbytes)}")
    return arrays, layout


def spec_nbytes(spec: Any) -> int:
    """The bytes of a checked output spec (:func:`output_tree`'s): its packed arrays' or its array's."""
    if isinstance(spec, Packed):
        return spec.nbytes
    shape, dtype = spec
    return math.prod(shape) * dtype.itemsize


def spec_dtypes(spec: Any) -> list:
    """The dtype of each array of a checked output spec (:func:`output_tree`'s)."""
    if isinstance(spec, Packed):
        return [dtype for _offset, _shape, dtype in spec.leaves]
    return [spec[1]]


def output_tree(spec: Any, where: str) -> Any:
    """An output spec checked: one ``(shape, dtype)`` pair, or a tuple/list/dict of them (their
    packed layout).

    Raises:
        TypeError, ValueError: as :func:`check_output_spec`, for any pair of it.
    """
    if is_spec(spec) or not is_tree(spec):
        return check_output_spec(spec, where)
    pairs, tree = flatten(spec, is_leaf=lambda o: is_spec(o) or not is_tree(o))
    return packed(tree, [check_output_spec(p, where) for p in pairs])


def check_fill_output(spec: Any, where: str) -> None:
    """Refuse, for ``fill="rows"``, a checked output spec (:func:`output_tree`'s) the compute
    could not fill by rows: several arrays (their packed layout), or a 0-d array.

    Raises:
        ValueError: naming ``where``, ``fill`` and what to change.
    """
    if isinstance(spec, Packed):
        raise ValueError(f"fill='rows' needs a result of one array (the rows filled are counted along its first "
                         f"axis); {where} is a tuple, list or dict of (shape, dtype) pairs: give one pair, or drop "
                         "fill='rows'")
    if not spec[0]:
        raise ValueError(f"fill='rows' needs a result with rows (the rows filled are counted along its first axis); "
                         f"{where} is 0-d (shape ()): give a shape such as (n,) or (n, ...), or drop fill='rows'")


def _pinned_source(device: Device, item: Any) -> Optional[tuple]:
    """Where an item is an array from ``device``'s host pool (:mod:`ringflow.host`), or a
    C-contiguous view of one from any byte: its bytes, shape and dtype, which the h2d reads in
    place; else None."""
    where = host_pool.receive_slice(item, device)
    if where is None:
        return None
    return where, item.shape, item.dtype


class Pipeline(Uncopyable):
    """Five overlapped stages with per-buffer ownership, backpressure and cancellation.

    ``compute(x, y)`` runs on the device with ``x`` the chunk's input and ``y`` an output of
    the same shape and dtype (device arrays: numpy on the simulated GPU, CuPy or PyTorch on a
    real one); it must write ``y`` (with ``inplace=True`` it gets the same array twice).
    ``prepare(item) -> ndarray`` (CPU) turns an item into the array to send (default: the item
    itself); ``consume(index, item, result) -> value`` (CPU) gets a read-only view of the
    result, valid during the call (default: the result itself). Without ``prepare``, ``submit``
    and ``map`` copy each array into pinned memory from :mod:`ringflow.host`'s pool on the
    calling thread, so the caller may reuse its array once ``submit`` returns (an array from that
    pool is read in place by ``map``, and by ``submit`` above 4 MiB or where ``coalesce`` does not
    apply, so it must be left unchanged until its result is handed out, while ``submit`` copies a
    smaller one where ``coalesce`` applies; ``asubmit`` and ``amap`` accept items as ``submit``
    does), and the result comes back in pinned memory, which goes
    back to the pool once dropped; where the pool has no room, the item is copied into ordinary
    memory instead (a CPU worker then copies it into a slot) and results are new numpy arrays.
    A compute callable may carry a ``sim_seconds`` attribute (seconds, or a function of the
    chunk's bytes) for its duration on the simulated GPU.

    ``output`` gives the result's shape and dtype where they are not the input's: one
    ``(shape, dtype)`` pair for every item, or ``output(item) -> (shape, dtype)``, called by
    ``submit``/``map`` on the accepting thread. ``compute`` then gets ``y`` of that shape and
    dtype, only its bytes are copied back, and it must fit a slot (``chunk_bytes``).

    ``deliver="device"`` leaves each result on the device: ``map``, ``submit`` and the rest give
    :class:`~ringflow.DeviceResult` objects (the device array, lent until released) instead of
    host arrays, and nothing is copied back; ``consume`` cannot be given then. Each result held
    keeps its device slot: release it (``with res as y:``, ``res.release(stream)``, or drop it)
    before waiting for more than a few further results, or the pipeline waits for the slot.

    ``processes=True`` runs ``prepare`` in ``workers`` worker processes instead of threads (no
    GIL between them), each writing its array straight into the pipeline's pinned host-in slot
    (shared memory); ``prepare`` and the items must then be picklable (a module-level function),
    as for a DataLoader's workers. A worker that dies fails only the item it was preparing (a
    RuntimeError with its exit code or signal) and is replaced; :meth:`cancel` kills the workers
    still running a ``prepare`` (see :meth:`cancel` and :meth:`close`). The workers end with the
    pipeline's process however it ends, SIGKILL included (no clean-up runs there): a worker
    running a ``prepare`` ends then too, once no native call holds its GIL, and a child forked
    from that process and left running does not keep them alive.

    ``fill="rows"``: the compute returns how many rows (along axis 0) of ``y`` it filled, an int;
    only those come back, and the result has that many rows (``output`` is then an upper bound:
    a filter, a compaction). The copy back waits for the compute to finish (the host reads the
    count), so chunks lose the overlap of compute and copy back.

    ``like`` gives the results as another framework's arrays over the same memory: ``"torch"``
    (host results as CPU tensors, device results as CUDA tensors), ``"cupy"`` (device results
    only) or ``"numpy"`` (host results only; a ValueError otherwise); None keeps numpy on the
    host and the device's framework on the device.

    ``coalesce`` (on by default) lets ``submit`` (and ``asubmit``, ``amap``) put small plain-array
    items in a chunk other items share: an item submitted while the pipeline is busy (the chunk
    before it not yet taken in, or waiting for a slot) is copied into that chunk's pinned block
    (each item aligned to 256 bytes) instead of starting its own, so the chunk moves with one copy in and one set of
    slots, events and stage changes. ``compute`` still runs once per item, on that item's own
    part of the slots, with its own shape and dtype, unless it is pointwise (its ``pointwise``
    attribute is True, as for ``rf.Kernel(..., pointwise=True)``: each output element from the
    same input element alone): then it runs once over the chunk's items of one dtype, as one
    flat array from the first to the last, gaps included; one copy brings the chunk's results back
    over its inputs, each item's result a pinned view of its own bytes (chunks lie packed in
    pool slabs of four chunks' bytes; a result kept holds its slab). An item whose compute
    fails, or that is cancelled, ends so alone; the others go on. When the pipeline keeps up,
    each chunk holds one item, as with ``coalesce=False``; at most 64 items share one. It
    applies with no ``consume``, ``output``, ``prepare`` or ``fill``, results delivered on the
    host, and to arrays of up to 4 MiB that fit a chunk (for ``map``, those not already pinned
    pool arrays, which it reads in place).

    ``slots`` (None: derived by :mod:`ringflow._plan`; an int for every ring; or a
    :class:`SlotCounts`) and ``chunk_bytes`` (the slot size in bytes, an int or a size such as
    ``"8MiB"``; None for 8 MiB; not ``"auto"``, which is for whole arrays) bound pinned memory at
    ``(slots.host_in + slots.host_out) * chunk_bytes`` (with a fixed ``output`` smaller than a chunk,
    each host-out slot holds that output's bytes instead, rounded up to 256), which ``pinned_budget``
    (bytes) caps: planned slots shrink to fit it, explicit ones that do not fit are refused. At most
    ``max_in_flight`` accepted chunks are unfinished (including results a ``map`` has not handed
    out yet; items sharing a chunk count once); ``submit`` blocks while that many are, and ``map``
    pulls input only as capacity frees up (and holds at most ``max_in_flight * chunk_bytes`` of items sharing chunks
    that it has not handed out). A ``max_in_flight`` whose chunks would hold more than 2**50
    bytes, more than any host has, is refused (ValueError): it would bound nothing.

    A pipeline, and a future it returns, cannot be pickled or copied (TypeError): share the one
    (its methods may be called from any thread), or make a new pipeline.

    Raises:
        TypeError, ValueError: a bad argument, or more than the compute given by position (the
            message names it and what to pass instead).
    """

    def __new__(cls, *args: Any, device: Any = None, **kwargs: Any):
        if len(args) > 1:  # (stream_map and MapJob take f, x and out by position: a usual first try)
            raise TypeError(f"Pipeline takes one positional argument, the compute f(x, y), got {len(args)}; pass "
                            "the other arguments by keyword (Pipeline(f, device=dev, chunk_bytes=...)), and the "
                            "items to submit(item) or map(items)")
        # a list of devices (or "cuda:all") makes a pipeline per device behind one face
        if cls is Pipeline:
            many = device_list(device)
            if many is not None and len(many) > 1:
                from .spread import SpreadPipeline

                return object.__new__(SpreadPipeline)
        return object.__new__(cls)

    def __init__(self, compute: Callable, *, device: "Device | str | None" = None, prepare: Optional[Callable] = None,
                 consume: Optional[Callable] = None, slots: "int | SlotCounts | None" = None,
                 chunk_bytes: "int | str | None" = None, max_in_flight: Optional[int] = None, ordered: bool = True,
                 on_error: str = "raise", profile: bool = False, workers: Optional[int] = None,
                 inplace: bool = False, checked: bool = False, item_nbytes: Optional[Callable] = None,
                 pinned_budget: "int | str | None" = None, output: "tuple | Callable | None" = None,
                 deliver: str = "host", processes: bool = False, like: Optional[str] = None,
                 fill: Optional[str] = None, coalesce: bool = True):
        # every public call runs with Ctrl-C taken at its checkpoints only (sigint.py; docs/design.md,
        # "Ctrl-C in a whole-array call")
        with shielded() as shield:
            self._build(compute, device=device, user_prepare=prepare, consume=consume, slots=slots,
                        chunk_bytes=chunk_bytes, max_in_flight=max_in_flight, ordered=ordered, on_error=on_error,
                        profile=profile, workers=workers, inplace=inplace, checked=checked, item_nbytes=item_nbytes,
                        pinned_budget=pinned_budget, output=output, deliver=deliver, processes=processes, like=like,
                        fill=fill, coalesce=coalesce)
            if shield is not None and shield.pending:
                self.close()  # Ctrl-C while it was being made: nothing left running (raised as the block ends)

    @classmethod
    def _for_whole_array(cls, compute: Callable, *, prepare: Callable, consume: Callable, item_nbytes: Callable,
                         host_in_buffer, host_out_buffer, max_chunks: int, host_strides: tuple = (None, None),
                         host_s_per_chunk: Optional[float] = None, planned_bytes: tuple = (None, None),
                         **options: Any) -> "Pipeline":
        """A pipeline for a whole-array job (:mod:`.scheduled`): its stage callbacks describe or
        stage rows of the caller's arrays, and its host rings may be the caller's pinned memory
        (chunk i of each at ``i *`` its stride in ``host_strides``). ``host_s_per_chunk``: the
        scheduler's host seconds per chunk, charged on the simulated GPU (see :class:`Scheduler`).
        ``planned_bytes``: a whole chunk's (input, result) bytes, which the slot plan models
        (None: a slot's, ``chunk_bytes``)."""
        pipe = object.__new__(cls)
        pipe._build(compute, stage_prepare=prepare, consume=consume, item_nbytes=item_nbytes,
                    host_in_buffer=host_in_buffer, host_out_buffer=host_out_buffer, max_chunks=max_chunks,
                    bulk=True, host_strides=host_strides, host_s_per_chunk=host_s_per_chunk,
                    planned_bytes=planned_bytes, **options)
        return pipe

    def _build(self, compute: Callable, *, device=None, user_prepare: Optional[Callable] = None,
               stage_prepare: Optional[Callable] = None, consume: Optional[Callable] = None, slots=None,
               chunk_bytes=None, max_in_flight=None, ordered: bool = True, on_error: str = "raise",
               profile: bool = False, workers=None, inplace: bool = False, checked: bool = False,
               item_nbytes=None, pinned_budget=None, host_in_buffer=None, host_out_buffer=None,
               max_chunks: Optional[int] = None, bulk: bool = False, output=None, deliver: str = "host",
               processes: bool = False, like: Optional[str] = None, fill: Optional[str] = None,
               host_strides: tuple = (None, None), coalesce: bool = False,
               host_s_per_chunk: Optional[float] = None, planned_bytes: tuple = (None, None)) -> None:
        self._closed = True  # until built: a finaliser or close() on a half-built pipeline does nothing
        self._procs = None  # processes=True: the prepare processes (ProcessPrepare)
        if not callable(compute):
            raise TypeError(f"compute must be a callable f(x, y), got {type(compute).__name__}")
        for name, fn in (("prepare", user_prepare), ("consume", consume), ("item_nbytes", item_nbytes)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be a callable or None, got {type(fn).__name__}")
        if not bulk:  # (a whole-array job's own stages, and its f, are checked where it starts)
            check_arity("compute", compute, 2, COMPUTE_FORM)
            for name, fn, nargs, form in (("prepare", user_prepare, 1, "prepare(item)"),
                                          ("consume", consume, 3, "consume(index, item, result)"),
                                          ("item_nbytes", item_nbytes, 1, "item_nbytes(item)"),
                                          ("output", output, 1, "output(item)")):
                if callable(fn):
                    check_arity(name, fn, nargs, form)
        opts = check_options(chunk_bytes=chunk_bytes, workers=workers, max_in_flight=max_in_flight,
                             pinned_budget=pinned_budget, slots=slots, on_error=on_error, ordered=ordered,
                             profile=profile, inplace=inplace, checked=checked)
        deliver = check_choice("deliver", deliver, ("host", "device"))
        if check_flag("processes", processes) and user_prepare is None:
            raise ValueError("processes=True runs prepare in worker processes: pass prepare= (a module-level "
                             "function); plain array items are copied on the calling thread")
        if fill is not None:
            check_choice("fill", fill, ("rows",))
        if like is not None and consume is not None:
            raise ValueError("like= converts the results a pipeline delivers itself; with consume= the consumer "
                             "makes the result: convert there")
        if deliver == "device" and consume is not None:
            raise ValueError("consume= cannot be used with deliver='device': the results stay on the device and "
                             "go to whoever iterates the pipeline (each a DeviceResult to release when done)")
        if output is not None:
            if opts["inplace"]:
                raise ValueError("output= cannot be used with inplace=True: an in-place compute writes its result "
                                 "over its input, so the result is shaped as the input; drop one of them")
            if not callable(output):
                output = output_tree(output, "output")
                if fill is not None:
                    check_fill_output(output, "output")
        self._output = output
        chunk_bytes, workers, max_in_flight, pinned_budget, slots = (
            opts["chunk_bytes"], opts["workers"], opts["max_in_flight"], opts["pinned_budget"], opts["slots"])
        many = device_list(device)
        if many is not None:  # a list of one device is that device
            if len(many) > 1:
                raise TypeError(f"{type(self).__name__} runs on one device; a list of several makes a "
                                "ringflow.Pipeline per device only through ringflow.Pipeline itself")
            device = many[0]
        self.device = make_device(device) if not isinstance(device, Device) else device
        if output is not None and not callable(output):
            for dtype in spec_dtypes(output):
                self.device.check_dtype("output", dtype)
        chunk_bytes = DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
        if workers is None:
            workers = default_workers(self.device, bulk=bulk)
        # the slots are planned for a chunk's input and result bytes where they are known: a
        # whole-array job's, or an output spec's for every item (a slot's bytes stand for the rest)
        in_bytes, out_bytes = planned_bytes
        if out_bytes is None and output is not None and not callable(output):
            out_bytes = min(spec_nbytes(output), chunk_bytes)  # (a larger one fails each item: no plan for it)
        counts = resolve_slots(self.device, slots, in_bytes or chunk_bytes, inplace, workers, compute,
                               external=(host_in_buffer is not None, host_out_buffer is not None), bulk=bulk,
                               max_chunks=max_chunks, user_prepare=user_prepare is not None, out_bytes=out_bytes)
        if deliver == "device" and slots is None:
            counts = lent_slots(counts, inplace)
        if pinned_budget is not None:
            counts = fit_pinned_budget(counts, chunk_bytes, pinned_budget, explicit=slots is not None,
                                       out_bytes=out_bytes, in_bytes=in_bytes, inplace=inplace)
        if max_in_flight is None:
            max_in_flight = counts.host_in + counts.device_in + counts.device_out + counts.host_out
        self.config = PipelineConfig(chunk_bytes=chunk_bytes, slots=counts, max_in_flight=max_in_flight,
                                     workers=workers, inplace=inplace, ordered=ordered, on_error=on_error,
                                     profile=profile, checked=checked, deliver=deliver, fill=fill,
                                     out_bytes=out_bytes, in_bytes=in_bytes)
        procs = None
        if processes:
            from .processes import ProcessPrepare

            procs = ProcessPrepare(self.device, user_prepare, counts.host_in * chunk_bytes, chunk_bytes, workers)
        self._procs = procs
        on_threads = None if stage_prepare or procs else _ThreadPrepare(user_prepare, chunk_bytes,
                                                                        self.device.check_dtype)
        prepare_stage = stage_prepare or procs or on_threads
        self._items_are_arrays = stage_prepare is None and user_prepare is None  # sizes known before acceptance
        # submit() lets small array items share a chunk where each item's result is its own
        # compute's output in a pooled array (see docs/design.md, "Items sharing a chunk")
        self._coalesce = (check_flag("coalesce", coalesce) and not bulk and self._items_are_arrays and not processes
                          and consume is None and output is None and deliver == "host" and fill is None)
        consume_stage = consume
        if profile:
            prepare_stage = nvtx.ranged(prepare_stage, "prepare")
            consume_stage = None if consume is None else nvtx.ranged(consume, "consume")
        # a stream of items gets its results in pinned pool arrays (docs/design.md, "Pinned
        # staging and results"); a whole-array job has the caller's out or its own host-out ring
        self._pool = None if bulk else host_pool.pool_for(self.device)
        # a device closed under the pipeline is named by the next call (_check_open); a
        # whole-array job's caller made no pipeline, so there the device's own error speaks
        self._names_closed_device = not bulk
        results = self._pool if deliver == "host" else None
        source_of = functools.partial(_pinned_source, self.device) if self._items_are_arrays else None
        self._recorder = _Recorder(self.device, chunk_bytes, counts, workers) if profile else None
        convert = converter(like, deliver, self.device)
        try:
            self._sched = Scheduler(self.device, compute, prepare_stage, consume_stage, self.config,
                                    item_nbytes=item_nbytes or (lambda item: getattr(item, "nbytes", 0)),
                                    on_chunk_end=self._recorder.on_chunk_end if profile else None,
                                    host_in_buffer=host_in_buffer, host_out_buffer=host_out_buffer,
                                    results=results, source_of=source_of,
                                    host_in_memory=procs.open if procs else None, procs=procs,
                                    convert=convert, host_strides=host_strides,
                                    host_s_per_chunk=host_s_per_chunk)
        except BaseException:
            if procs is not None:
                procs.close()
            raise
        if on_threads is not None and user_prepare is not None and not self._sched.host_in.external:
            # the ring's bytes, queried, never read (an array a prepare kept from another slot)
            on_threads.ring = self._sched.host_in.buffer._memory()
        if self._recorder is not None:
            self._recorder.start(self._sched.streams.h2d)
        if bulk:
            self._driver = CallerDriver(self._sched)  # a whole-array call: its caller drives
        else:
            self._driver = ProgressThread(self._sched, name=f"ringflow-progress-{next(_NAMES)}")
        self._finalizer = weakref.finalize(self, _abandon, self._driver, self._sched, procs)
        self._closed = False

    # -- set-up -------------------------------------------------------------------------------
    def _check_item(self, item: Any) -> Any:
        """The item to accept: a plain array item viewed as a numpy array (:func:`as_host_array`);
        refused, before acceptance, if it can never fit (when its size is known)."""
        if self._items_are_arrays:
            found = self.device.device_source(item)
            if found is not None:  # a device array: copied device to device, no staging
                nbytes = found[0].nbytes
                self.device.check_dtype("items", np.dtype(found[2]))
                if self.config.fill == "rows":
                    check_fill_rows(False, len(found[1]), "this item")
                if nbytes > self.config.chunk_bytes:
                    raise ValueError(f"a device array item of {nbytes} bytes does not fit a slot of "
                                     f"{self.config.chunk_bytes} bytes; {grow_slots(nbytes, '')}")
                return item
            if is_tree(item):
                if self.config.fill == "rows":
                    check_fill_rows(True, 1, "this item")
                # checked now; packed when staged or prepared
                tree_layout(item, self.config.chunk_bytes, check=self.device.check_dtype)
                return item
            item = as_host_array(item)
            if self.config.fill == "rows":
                check_fill_rows(False, item.ndim, "this item")
            self.device.check_dtype("items", item.dtype)
            if item.nbytes > self.config.chunk_bytes:
                raise ValueError(f"an item of {item.nbytes} bytes (shape {item.shape}, {item.dtype}) does not fit "
                                 f"a slot of {self.config.chunk_bytes} bytes; {grow_slots(item.nbytes)}")
        return item

    def _output_spec(self, item: Any) -> Optional[tuple]:
        """The result's ``(shape, dtype)`` for ``item`` when an ``output`` spec was given, checked
        against the slot size; None: shaped as the prepared input.

        Raises:
            TypeError, ValueError: the spec (or what ``output(item)`` returned) is not a valid
                ``(shape, dtype)``, is several arrays with ``fill="rows"``, or its bytes do not fit
                a slot.
            TypeError: ``output(item)`` raised StopIteration (from it).
        """
        spec = self._output
        if spec is None:
            return None
        if callable(spec):
            try:
                got = spec(item)
            except StopIteration as exc:
                # raised on, it would end map()'s generator as "generator raised StopIteration",
                # and out of submit() the caller's own loop, as if its items had run out
                raised = describe(exc) if exc.args else "StopIteration"
                raise TypeError(f"output(item) must return the result's (shape, dtype); for item {shown(item)} "
                                f"it raised {raised}. A StopIteration cannot end a map or stop submitting: "
                                "end the items' iterator instead") from exc
            spec = output_tree(got, "output(item)")
            for dtype in spec_dtypes(spec):
                self.device.check_dtype("output(item)", dtype)
            if self.config.fill == "rows":
                check_fill_output(spec, "output(item)")
        nbytes = spec_nbytes(spec)
        what = f"{len(spec.leaves)} arrays packed" if isinstance(spec, Packed) else f"shape {spec[0]}, {spec[1]}"
        if nbytes > self.config.chunk_bytes:
            raise ValueError(f"an output of {nbytes} bytes ({what}) does not fit a slot of "
                             f"{self.config.chunk_bytes} bytes; {grow_slots(nbytes, '')}")
        return spec

    def _accepting(self, item: Any, copy: bool = False) -> dict:
        """What the accepting thread prepares for ``item`` before taking the lock: its output spec,
        its pinned staging copy (or, where the pool has no room, a copy in ordinary memory, the
        item from then on: a plain array is copied before ``submit`` returns either way), and a
        pinned result array where the staging copy cannot carry the result back (shaped
        otherwise, or no staging copy) (keyword arguments of :meth:`Scheduler.accept`, the item
        among them). Nothing of the item is accepted yet: on the main thread in a shielded call,
        a Ctrl-C while a device call here waits for the simulated GPU's lock (a stage another
        thread runs keeps it) is raised there (:class:`.sigint.interruptible_device_calls`).
        ``copy``: a pool array is copied too, not read in place (one ``submit`` promised to copy,
        as a shared chunk would have, where the pool had no room for shared chunks)."""
        with interruptible_device_calls():
            try:
                return self._accepting_here(item, copy)
            except DeviceError as err:
                self._break_on_sticky(err)
                raise

    def _break_on_sticky(self, err: DeviceError) -> None:
        """A device error an accepting thread met: a sticky one is handed to the progress thread,
        which breaks the pipeline with it. A device that broke while it had no chunks has no step
        to find it, and a dispatcher over several devices went on offering every item to it first
        (the least loaded) and having it fail there."""
        if err.sticky and self._sched.broken is None:
            self._driver.post(functools.partial(_break_unless_broken, self._sched, err), _never)

    def _accepting_here(self, item: Any, copy: bool = False) -> dict:
        out_spec = self._output_spec(item)
        found = self.device.device_source(item) if self._items_are_arrays else None
        if found is not None:  # a device array: read in place after its producer's stream
            where, shape, dtype, stream = found
            result = None
            if self._pool is not None and self.config.deliver == "host":  # pinned here, not on the progress thread
                if out_spec is None:
                    want = (shape, np.dtype(dtype))
                elif isinstance(out_spec, Packed):
                    want = ((out_spec.nbytes,), np.dtype(np.uint8))
                else:
                    want = out_spec
                result = self._pool.take(*want)
            return {"item": item, "out_spec": out_spec, "result": result, "on_device": (where, shape, np.dtype(dtype)),
                    "source_ready": self.device.record_on(stream)}
        in_place = not copy and self._read_in_place(item)  # one pool lookup an item
        staged, staged_at, in_tree = (None if in_place else self._staged_copy(item)) or (None, None, None)
        if staged is None and self._items_are_arrays and not in_place:
            # the pool had no room: a CPU worker copies the item into a slot later, so the copy
            # after which the caller may change its array is made now, into ordinary memory
            item = _private_copy(item)
        result = None
        if self._pool is not None and self.config.deliver == "host":
            if out_spec is not None:
                shape, dtype = ((out_spec.nbytes,), np.dtype(np.uint8)) if isinstance(out_spec, Packed) else out_spec
                if staged is None or (staged.shape, staged.dtype) != (shape, dtype):
                    result = self._pool.take(shape, dtype)  # pinned on this thread, not on the progress thread
            elif in_place:
                # a pool array read in place gets its pinned result here: the progress thread
                # takes cached blocks only, and where none is cached the result would come back
                # through a slot and a CPU copy (an item the pool had no room to stage is not
                # asked for more)
                result = self._pool.take(item.shape, item.dtype)
        return {"item": item, "staged": staged, "staged_at": staged_at, "out_spec": out_spec, "result": result,
                "in_tree": in_tree}

    def _staged_copy(self, item: Any) -> Optional[tuple]:
        """``(array, (start, end), packed layout or None)``: a plain array item (or a tuple, list
        or dict of them, packed) that is not read in place (the caller has asked
        :meth:`_read_in_place`) copied into a pinned pool array on the accepting thread (the copy
        lets go of the GIL) and when (host clock); or None: the pool has no room (the item goes
        through a host-in slot and a CPU worker), or items are not plain arrays. See
        docs/design.md, "Pinned staging and results"."""
        if not self._items_are_arrays or self._pool is None:
            return None
        if is_tree(item):
            leaves, layout = tree_layout(item, self.config.chunk_bytes)
            if layout.nbytes == 0:
                return None
            t0 = self.device.now
            staged = self._pool.take((layout.nbytes,), np.dtype(np.uint8))
            if staged is None:
                return None
            for view, leaf in zip(flatten(host_views(layout, staged))[0], leaves):
                self._copy_from_caller(view, leaf)
            at = (t0, self.device.now)
        else:
            t0 = self.device.now
            staged, layout = self._pool.take(item.shape, item.dtype), None
            if staged is None:
                return None
            self._copy_from_caller(staged, item)
            at = (t0, self.device.now)
        # an item refused after its copy (a timeout, a pipeline that stopped taking work) is
        # dropped wherever its error goes: the block's next holder is ordered after this copy
        host_pool.hand_off(staged, self.device.publish())
        return staged, at, layout

    def _copy_from_caller(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Copy ``src``, an array the caller handed in, into ``dst`` on the calling thread. Where
        ``src`` is this device's pool memory (a result, or a view of one, that is not read in
        place: a leaf of a tuple, list or dict, or a strided view) the thread is first ordered
        after the block's hand-out and every device use of it seen complete since (a pipeline's
        d2h into it among them), as a shared submit's copy is: the caller may have got it on
        another thread and passed it on by means the simulated GPU's checker cannot see. It then
        leaves a token on the block, so whichever thread drops it last hands it back after this
        read."""
        pooled = host_pool.device_of(src) is self.device
        if pooled:
            host_pool.receive(src, self.device)
        self.device.host_copy(dst, src)
        if pooled:
            host_pool.hand_off(src, self.device.publish())

    def _read_in_place(self, item: Any) -> bool:
        """Whether the h2d reads ``item`` where it is: a plain array in pool memory (a pool array
        or a view of one), which the accepting thread leaves unstaged."""
        return type(item) is np.ndarray and host_pool.slice_behind(item, self.device) is not None

    # -- submitting and mapping ---------------------------------------------------------------
    @shielded_call
    def submit(self, item: Any, timeout: Optional[float] = None) -> ChunkFuture:
        """Accept one item; blocks while ``max_in_flight`` chunks are unfinished. Safe from any
        thread.

        Args:
            item: a numpy array (or anything ``prepare`` turns into one).
            timeout: seconds of the device's host clock (virtual on the simulated GPU) to wait for
                capacity; None waits as long as it takes.

        Returns:
            a :class:`concurrent.futures.Future` of the consumer's value, settled by the pipeline
            alone (its ``set_result``, ``set_exception`` and ``set_running_or_notify_cancel``
            raise RuntimeError).

        Raises:
            TimeoutError: no capacity freed up within ``timeout``.
            TypeError, ValueError: an item that can never fit, or a bad ``timeout``.
            RuntimeError: the pipeline is closed or no longer accepts work.
        """
        timeout = check_timeout(timeout)
        self._check_caller("submit()")
        return self._submit(self._check_item(item), timeout)

    def _submit(self, item: Any, timeout: Optional[float], gave_up: Optional[Callable[[], bool]] = None,
                wait: bool = True) -> "ChunkFuture | object":
        """:meth:`submit` of a checked item: where it goes (a shared chunk, or a chunk of its own)
        and what is copied of it, decided here alone for ``submit``, ``asubmit`` (and ``amap``)
        and the no-wait submit of a pipeline over several devices.

        Args:
            gave_up: for an asubmit's accepting on the loop's executor: whether the task awaiting
                it gave up, which ends its wait for capacity (None: it waits as long as it takes).
            wait: False: never wait for capacity, nor for the driver's lock (which a step holds),
                as :meth:`_submit_if_room`: :data:`NO_ROOM` where there is no room now (nothing
                of the item was accepted).

        Raises:
            _GaveUp: ``gave_up()`` held before the item was accepted; as :meth:`submit` otherwise
                (with ``wait`` False, as :meth:`_submit_if_room`).
        """
        shares = self._shares_chunk(item)
        if shares:
            fut = self._submit_shared(item, timeout, wait=wait, gave_up=gave_up)
            if fut is NO_ROOM:
                return self._no_room()
            if fut is not None:
                return fut
        # (no room in the pool for shared chunks: a pool array goes alone, still copied, as submit says)
        if wait:
            return self._accept_staged(self._accepting(item, copy=shares), timeout, gave_up)
        if not self._sched.has_capacity():  # a look without the lock: no staging copy of an item with no room
            return self._no_room()
        return self._accept_staged_if_room(self._accepting(item, copy=shares))

    @shielded_call
    def _submit_if_room(self, item: Any) -> "ChunkFuture | object":
        """Accept ``item`` if the pipeline has room for it now, as :meth:`submit` does, but never
        wait for capacity (nor for the driver's lock, which a step holds): its future, or
        :data:`NO_ROOM` where there is no room (nothing of the item was accepted). For a map over
        several devices, which must not wait for room while it holds results: room is chosen and
        taken in one call, under the scheduler's batch lock.

        Raises:
            DeviceError: the device is broken.
            RuntimeError: the pipeline is closed or no longer accepts work.
            TypeError, ValueError: as :meth:`submit`.
        """
        self._check_caller("submit()")
        return self._submit(self._check_item(item), None, wait=False)

    @shielded_call
    def _accept_staged_if_room(self, accepting: dict) -> "ChunkFuture | object":
        """:meth:`_accept_staged` that never waits for capacity: the chunk's future, or
        :data:`NO_ROOM` where the pipeline has no room (nothing accepted). Raises as
        :meth:`_submit_if_room`."""
        chunk = self._accept_if_room(accepting)
        return self._no_room() if chunk is NO_ROOM else chunk.future

    def _accept_if_room(self, accepting: dict, **options: Any) -> "Chunk | object":
        """Accept an item :meth:`_accepting` made ready where the pipeline has room this instant,
        without the driver's lock (docs/design.md, "Accepting without the driver's lock"): its
        chunk, the driver woken to admit it, or :data:`NO_ROOM` (nothing accepted: the pipeline
        is full or takes no more work). ``options``: more keyword arguments of
        :meth:`Scheduler.accept` (``in_map``)."""
        chunk = self._sched.accept(driver=self._driver, if_room=True, **accepting, **options)
        if chunk is not NO_ROOM:
            self._driver.wake.set()
        return chunk

    def _no_room(self) -> object:
        """:data:`NO_ROOM` for an item found no room; where the pipeline takes no more work (so
        has no room for ever), the error :meth:`submit` raises then instead.

        Raises:
            DeviceError: the device is broken.
            RuntimeError: the pipeline no longer accepts work.
        """
        s = self._sched
        if s.broken is not None:
            raise s.broken
        if not s.accepting:
            raise s.refusal()
        return NO_ROOM

    def _wait_for_capacity(self, timeout: Optional[float], gave_up: Optional[Callable[[], bool]] = None,
                           hold: Optional[Hold] = None) -> None:
        """Lock held: wait until the pipeline has room for another chunk (or takes no more).

        Args:
            gave_up: see :meth:`_submit`: once it holds, the wait ends and nothing is accepted.
            hold: the lock as the caller holds it (:class:`.driver.Hold`), which the wait may give
                up to a Ctrl-C (KeyboardInterrupt raised, nothing accepted).

        Raises:
            _GaveUp: ``gave_up()`` held (before or during the wait).
            TimeoutError: no room came within ``timeout``.
        """
        d, s = self._driver, self._sched
        given_up = gave_up or _never
        if not s.has_capacity():
            t0 = self.device.now
            d.wait_for(lambda: s.has_capacity() or not s.accepting or s.broken is not None or given_up(), timeout,
                       "capacity", hold=hold)
            self._stall("stall: producer", "producer blocked by backpressure", t0)
        if given_up():
            raise _GaveUp()

    def _take_room(self, take: Callable[[], Any], timeout: Optional[float], gave_up: Optional[Callable[[], bool]],
                   hold: Hold) -> Any:
        """Lock held: wait for room, then take it with ``take`` (an accept that returns
        :data:`NO_ROOM` where it finds none); what ``take`` returned. A thread accepting without
        the driver's lock may take the room between the wait and the take: the wait then starts
        again, within what is left of ``timeout``.

        Raises:
            _GaveUp, TimeoutError: as :meth:`_wait_for_capacity`.
            DeviceError, RuntimeError: the pipeline takes no more work (why, as :meth:`submit`).
        """
        deadline = None if timeout is None else self.device.now + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - self.device.now)
            self._wait_for_capacity(left, gave_up, hold)
            got = take()
            if got is not NO_ROOM:
                return got
            self._no_room()  # raises where the pipeline takes no more work; else another thread took the room

    def _shares_chunk(self, item: Any) -> bool:
        """Whether ``submit`` puts ``item`` in a chunk other items may share: a plain array of up
        to :data:`SHARE_AT_MOST_BYTES` that fits a chunk. A pool array of that size shares too:
        copying it costs the submitting thread less than a chunk of its own costs the progress
        thread (docs/design.md, "Items sharing a chunk")."""
        return (self._coalesce and type(item) is np.ndarray
                and 0 < item.nbytes <= min(SHARE_AT_MOST_BYTES, self.config.chunk_bytes))

    def _submit_shared(self, item: np.ndarray, timeout: Optional[float],
                       wait: bool = True, gave_up: Optional[Callable[[], bool]] = None) -> "ChunkFuture | None | object":
        """``submit`` of an item that may share a chunk: a place in the chunk still taking items
        (or a new one, in the pinned slab of shared chunks: a new slab from the pool when it is
        full), then the item copied there on this thread, outside the lock; its result comes back
        into the same bytes. Returns the item's future, or None where the pool has no room for a
        slab (the item then goes alone), or, with ``wait`` False, :data:`NO_ROOM` where the item
        would have to wait for capacity (or the pipeline takes no more work): nothing of it was
        accepted. ``gave_up``: as :meth:`_submit` (raises _GaveUp, nothing accepted)."""
        d, s = self._driver, self._sched
        nbytes, shape, dtype = item.nbytes, item.shape, item.dtype
        spec = (shape, dtype, nbytes)
        claim: list = []  # (chunk, member) once the scheduler starts registering the item
        try:
            place = s.join_open_batch(d, spec, claim)  # under the scheduler's batch lock, not the driver's
            while place is None:
                # a new chunk where there is room, under the batch lock too: the driver's lock,
                # which a step keeps for as long as a stage it runs does not return, is taken only
                # to wait for room (docs/design.md, "Accepting without the driver's lock")
                place = NO_ROOM if gave_up is not None and gave_up() else s.open_new_batch(d, spec, claim, if_room=True)
                if place is NO_ROOM:
                    if not wait:
                        # a caller that must not wait for room (a submit over several devices
                        # offering the item to each) goes on to the next at once
                        return NO_ROOM
                    with d.hold() as hold:
                        place = s.join_open_batch(d, spec, claim)  # another thread may have opened one
                        if place is None:
                            place = self._take_room(
                                lambda: s.join_open_batch(d, spec, claim) or s.open_new_batch(d, spec, claim,
                                                                                                if_room=True),
                                timeout, gave_up, hold)
                if place is None:  # the slab of shared chunks is full: a new one, taken outside the lock
                    slab = self._pool.take((s.space.slab_bytes,), np.dtype(np.uint8))
                    if slab is None:
                        return None
                    s.add_slab(slab, nbytes)
            chunk, member = place
            # the chunk's block may have been handed out on the thread that opened the chunk, and
            # the item may be a pool array from another thread or hold a result a d2h wrote: this
            # thread's copy (a checked host access on the simulated GPU) is ordered after both
            # hand-outs and every device use of either seen complete since
            # (a Ctrl-C while a device call here waits for the simulated GPU's lock, which a stage
            # run by another thread keeps, is raised there: the item is then taken back below)
            with interruptible_device_calls():
                host_pool.receive(chunk.batch, self.device)
                pooled = host_pool.device_of(item) is self.device
                if pooled:
                    host_pool.receive(item, self.device)
                block, at = chunk.batch, member.offset
                t0 = self.device.now
                self.device.host_copy(block[at:at + nbytes].view(dtype).reshape(shape), item)
                # the alignment gap after the item is zeroed: a pointwise compute runs over it
                # with the items around it (docs/design.md, "Items sharing a chunk"), and a kernel
                # that traps on a value must not meet stale bytes or another request's there
                if aligned(nbytes) > nbytes:
                    block[at + nbytes:at + aligned(nbytes)] = 0
                if pooled:  # whichever thread drops the item last hands its block back after this read
                    host_pool.hand_off(item, self.device.publish())
                s.member_written(chunk, member, (t0, self.device.now))  # the driver's lock is not needed
            d.wake.set()
            if s.stopped_by is not None:
                # the driver died while this copy was being made: it could not admit the chunk,
                # nor those behind it (set before it looked at the chunk, so seen here if it did)
                with d.cv:
                    s.admit_after_death()
        except BaseException as exc:
            # the copy failed or an interrupt (Ctrl-C) landed anywhere above: an item not wholly
            # registered, or whose copy did not end, is taken back; one whose copy ended stays.
            # Another interrupt inside the clean-up (a second Ctrl-C) starts it again: an item
            # left half taken back would keep its chunk from ever being admitted.
            late = None
            while claim:
                try:
                    self._take_back(claim)
                except Exception as err:  # noqa: BLE001 - never masks the caller's error
                    warnings.warn(f"taking back an item whose submit failed failed: {err!r}", RuntimeWarning,
                                  stacklevel=2)
                    break
                except BaseException as again:  # noqa: BLE001 - raised below, once the item is back
                    late = again
            if late is not None and isinstance(exc, Exception):
                raise late from exc  # Ctrl-C during the clean-up outranks the copy's error
            if isinstance(exc, DeviceError):  # (once the item is back: the take-back comes first)
                self._break_on_sticky(exc)
            raise
        return member.future

    def _take_back(self, claim: list) -> None:
        """Take back the item ``claim`` names (its shared submit raised before the commit) and
        empty ``claim``; every step may be repeated if this is interrupted. Under the pipeline's
        lock where it is free; where another thread keeps it, the take-back is handed to the
        progress thread, which carries it out at its next turn, before it steps (the chunk waits
        for it either way): a step keeps the lock for as long as a stage it runs does not
        return, and the caller's Ctrl-C must not wait for that. A thread that has ended by then
        refuses it, and it is carried out where that is seen (the lock then kept by nobody for
        long)."""
        d, s = self._driver, self._sched
        taken = claim[0]

        def back() -> None:  # (lock held)
            s.member_written(*taken, None)
            s.admit_after_death()  # (a driver that died meanwhile left the chunk's other items to this thread)
            d.notify()

        def back_when_locked(cmd: Any = None) -> None:  # (a posted take-back refused: cmd.error)
            if cmd is None or cmd.error is not None:
                with d.cv:
                    back()

        if not d.background:
            back_when_locked()
        else:
            with try_lock(d.lock) as held:
                if held:
                    back()
                else:
                    s.withdraw(*taken)  # (counted out of stats() until the progress thread takes it back)
                    d.post(back, back_when_locked)
        claim.clear()

    def map(self, items: Iterable[Any]) -> Iterator[Any]:
        """Results of ``items`` (in order unless ``ordered=False``), pulling input only as capacity
        frees up. Several threads may each run a map on one pipeline; each gets its own items'
        results.

        An item is pulled only where the map has room for it: with ``max_in_flight`` items of
        chunks of their own accepted and not handed out, it waits for a result first, so a map
        stopped after ``k`` results (a break, a close of its iterator) has asked its input for at
        most ``k + max_in_flight - 1`` items (``k + max_in_flight`` where a failure raised after
        ``k`` results stopped it). Items sharing chunks are bounded by their bytes instead (see
        ``coalesce``): none is pulled while those held fill ``max_in_flight * chunk_bytes``, but
        whether the next item's bytes pass that bound is known only once it is pulled: such an
        item (as one whose room another thread's submit took first) is held back until a result
        is handed out, and a map stopped meanwhile never runs it.

        With ``on_error="raise"`` the first failure cancels the rest and is raised here (once, as
        StageError, or the original KeyboardInterrupt/SystemExit); with ``"continue"`` failed
        items are skipped (see :attr:`failures`).

        A map cut short by :meth:`cancel` or :meth:`close` (from another thread, or from the
        loop over it), while input is left or items of its own are pending, first hands out the
        results that had ended, then raises ``concurrent.futures.CancelledError``: it never ends
        as if its input were used up. A map whose input was used up and whose every result was
        handed out ends normally whatever comes after; to tell, a map that had not yet reached
        the end of its input asks it for one more item (which, if there is one, is not run, and
        the map raises), so a source that blocks until its next item delays that end. To stop a
        map of your own, break out of its loop (or close its iterator): that raises nothing.

        Raises:
            RuntimeError: at once (not when iterated) on a closed pipeline; when first iterated,
                where the pipeline took no more work by then.
            TypeError: at once, where ``items`` is not iterable.
            concurrent.futures.CancelledError: when iterated, the map cut short by a cancel or a
                close (the message says which, whether another thread closed the pipeline or
                the loop over the map did, and how many results it had handed out); the items
                it had not run were not run.
        """
        self._check_caller("map()")
        if self._items_are_arrays:
            warn_if_elements_as_items(items, "Pipeline.map()")
        return ShieldedIterator(self._map(check_iterable("items", items)))

    def _map(self, items: Iterable[Any]) -> Iterator[Any]:
        self._check_open()  # again: the pipeline may have closed before the first next()
        d, s = self._driver, self._sched
        source = iter(items)
        # this map's accepted items in input order, by index: a chunk of its own, or an item
        # sharing a chunk (_Shared: its future)
        pending: collections.OrderedDict[int, Any] = collections.OrderedDict()
        exhausted = started = interrupted = False
        handed_out = 0  # results handed out (told by the error of a map cut short)
        carried: list = []  # an item pulled but not yet accepted: (item, what _accepting made, or _SHARES)
        # items sharing chunks hold no capacity once their chunk ended: the bytes of those this
        # map accepted and has not handed out are bounded instead, by what max_in_flight chunks hold
        held, held_limit = 0, self.config.max_in_flight * self.config.chunk_bytes
        try:
            while True:
                needs_room = True  # False: the next item waits for results to be handed out, not for capacity
                # take input while there is room (outside the lock: the caller's iterator is user code)
                while not exhausted or carried:
                    if not carried:
                        # read without the driver's lock, which the progress thread holds for a
                        # whole step: the look only decides whether to pull input, and the
                        # accepting call below decides again under the batch lock
                        if not self._room_now():
                            break
                        if held >= held_limit:
                            # no item that shares a chunk fits the bytes held (each has some): the
                            # next waits for a result to be handed out, unpulled, so a map stopped
                            # then has not asked its input for an item it could not take
                            needs_room = False
                            break
                        try:
                            item = next(source)
                        except StopIteration:
                            exhausted = True
                            break
                        # an item refused here (TypeError, ValueError) was never accepted: the
                        # error is this caller's, raised to this map alone, which then cancels
                        # what it took (finally); the pipeline and others' items go on
                        item = self._check_item(item)
                        if self._map_shares(item):
                            carried.append((item, _SHARES))
                        else:
                            carried.append((item, self._accepting(item)))
                    item, accepting = carried[-1]
                    if accepting is _SHARES:
                        if held and held + item.nbytes > held_limit:
                            # (chunks end in the order they were admitted, so the results held
                            # include the map's next: it need not wait for capacity, nor spin on it)
                            needs_room = False
                            break
                        fut = self._submit_shared(item, None, wait=False)
                        if fut is NO_ROOM:
                            break
                        carried.pop()
                        if fut is None:  # the pool has no room for a shared chunk: the item goes alone
                            carried.append((item, self._accepting(item)))
                            continue
                        pending[fut.index] = _Shared(fut, item.nbytes)
                        held += item.nbytes
                        started = True
                        continue
                    # accepted without the driver's lock, as submit does where there is room
                    # (docs/design.md, "Accepting without the driver's lock"): NO_ROOM where the
                    # pipeline is full or takes no more work, which the wait below sorts out
                    taken = carried.pop()
                    chunk = self._accept_if_room(accepting, in_map=True)
                    if chunk is NO_ROOM:
                        carried.append(taken)
                        break
                    pending[chunk.index] = chunk
                    started = True
                entry = self._next_ready(pending)
                if type(entry) is _Shared:  # ended: nothing of the scheduler's to change, no lock
                    del pending[entry.index]
                    held -= entry.nbytes
                    state, value, error = entry.outcome()
                else:
                    with d.hold() as hold:
                        entry = self._next_ready(pending)
                        if entry is None:
                            outcome = self._map_wait(pending, needs_room and (not exhausted or bool(carried)),
                                                     started, hold)
                            if outcome == "stop":
                                return
                        else:
                            del pending[entry.index]
                            if type(entry) is _Shared:
                                held -= entry.nbytes
                                state, value, error = entry.outcome()
                            else:
                                s.unclaimed -= 1
                                state, value, error = entry.state, entry.value, entry.error
                    if entry is None:
                        if outcome == "cut":
                            # the pipeline takes no more work and nothing of this map's is pending:
                            # it ends as its input does where that is used up (looked at without
                            # the lock: the iterator is user code), and is cut short otherwise
                            if not carried and _used_up(source):
                                return
                            raise map_cut_short("map()", [s], handed_out)
                        continue
                broke = s.broken is not None and error is s.broken
                self.device.observe(entry.future.token)
                if state is ChunkState.DELIVERED:
                    handed_out += 1
                    yield value
                elif state is ChunkState.FAILED:
                    # with "continue" an item's own StageError is skipped even once the device
                    # broke; an item the broken device ended raises that device error
                    if self.config.on_error == "raise" or broke:
                        self._settle_after_error()
                        raise error
                else:  # cancelled: the pipeline was cancelled (or failed) under this map
                    self._settle_after_error()
                    if s.first_error is not None and self.config.on_error == "raise":
                        raise s.first_error
                    raise map_cut_short("map()", [s], handed_out)
        except BaseException as err:
            interrupted = isinstance(err, KeyboardInterrupt)
            # the frames of this map's steps that raised it (a wait's, a submit's) have returned,
            # and stay in the traceback of what the caller may keep: they keep nothing of it
            forget_own_frames(err)
            raise
        finally:
            # the caller stopped early (a break, an error in its loop, Ctrl-C): what this map took
            # and has not handed out is not wanted, as concurrent.futures' Executor.map has it
            # (a whole-array call's driver is its caller: no other thread keeps its lock)
            self._drop_unwanted(pending, wait=not (interrupted and d.background))
            # this generator has ended, and its frame stays in the traceback of what it raised
            # (and is an ancestor of the frames a stage ran in, on the simulated GPU): its locals
            # must not keep a failure, nor a chunk or future holding one, or the two would form
            # a cycle (keeping the pipeline, its chunks and their events until the cyclic
            # collector runs); nor, for a caller that keeps the failure, the pipeline (its rings),
            # the caller's items or the last result handed out
            pending.clear()
            chunk = entry = fut = error = value = None
            self = d = s = source = items = item = carried = accepting = taken = hold = None  # noqa: F841

    def _drop_unwanted(self, pending: "collections.OrderedDict[int, Any]", wait: bool) -> None:
        """A map ends: cancel what it took and has not handed out (``pending``'s entries), and
        stop counting their results as the map's (:attr:`Scheduler.unclaimed`). With ``wait``,
        returns once both are done, unless a Ctrl-C gets it out of the wait; otherwise, and where
        a Ctrl-C did, both are handed to the progress thread without waiting for its lock
        (:meth:`.driver.ProgressThread.post`), carried out on its next turn, before any command
        posted later (close()'s). After a Ctrl-C the map does not wait: what it interrupted may
        be a stage that does not return, through which the progress thread keeps its lock."""
        d, s = self._driver, self._sched
        unwanted = [entry.future for entry in pending.values() if not entry.ended()]
        chunks = [entry for entry in pending.values() if type(entry) is not _Shared]
        done = False
        try:
            if wait:
                cancel_unwanted(unwanted)
                with d.hold():
                    _untrack(s, chunks)
                done = True
        finally:
            if not done and d.background:  # (a whole-array call's driver waits: it is the caller)
                cancel_unwanted(unwanted, wait=False)
                if chunks:
                    d.post(functools.partial(_untrack, s, chunks), _never)

    def _map_shares(self, item: Any) -> bool:
        """Whether ``map`` puts ``item`` in a chunk other items may share: one :meth:`submit`
        would share that is not pinned already (a pool array is read in place: copying it into a
        shared chunk would add a copy, where a plain array is copied into pinned memory anyway)."""
        return self._shares_chunk(item) and not self._read_in_place(item)

    def _map_wait(self, pending, needs_room: bool, started: bool, hold: Hold) -> Optional[str]:
        """Wait (lock held as ``hold``, which the wait may give up to a Ctrl-C) for the next result
        of a map, or, where ``needs_room`` (input is left that waits for capacity), for room to
        take more. None once there may be either; "stop" where nothing more can come and no
        input is left; "cut" where input is left and the pipeline takes no more work (a cancel or
        a close cut the map short)."""
        d, s = self._driver, self._sched
        if not pending and not needs_room:
            return "stop"
        if not pending and not s.accepting:
            # input is left but the pipeline takes no more (cancelled, closed, stopped by an
            # error or a broken device): nothing could ever arrive, so do not wait for it
            if s.broken is not None:
                raise s.broken
            if not started:
                raise s.refusal()
            if s.first_error is not None and self.config.on_error == "raise":
                raise s.first_error
            return "cut"
        t0 = self.device.now
        # also stop waiting if the pipeline stops taking work meanwhile (a failure, a broken
        # device) while nothing of this map is pending: no capacity would ever come
        d.wait_for(lambda: self._next_ready(pending) is not None
                   or (needs_room and (s.has_capacity() or (not pending and not s.accepting))), None,
                   "the next result", hold=hold)
        if self._next_ready(pending) is not None:
            self._stall("stall: consumer", "consumer waiting for data", t0)
        else:
            self._stall("stall: producer", "producer blocked by backpressure", t0)
        return None

    def _next_ready(self, pending: "collections.OrderedDict[int, Any]") -> "Chunk | _Shared | None":
        """The map's next entry to hand out: its first, or with ``ordered=False`` any, that has
        ended; None if there is none yet. An entry that has ended stays so, so this may look
        without the driver's lock; a chunk's hand-out then looks again under it."""
        if not pending:
            return None
        if self.config.ordered:
            head = next(iter(pending.values()))
            return head if head.ended() else None
        for entry in pending.values():
            if entry.ended():
                return entry
        return None

    def _stall(self, track: str, name: str, start: float) -> None:
        """Record that the caller was blocked from ``start`` until now (lock held)."""
        if self._recorder is not None:
            self._recorder.stall(track, name, start)

    def _settle_after_error(self) -> None:
        """Before a map raises an item's failure (or that it was cut short, on a cancel): with
        on_error="raise" the pipeline's pending work is cancelled; then everything has ended. A
        progress thread that has ended (the pipeline closed under the map) had nothing left to
        cancel."""
        d, s = self._driver, self._sched
        with d.hold() as hold:
            if self.config.on_error == "raise":
                try:
                    d.command(s.cancel_pending, hold=hold)
                except ThreadEnded:
                    pass  # it ended (only once everything had finished): nothing is left to cancel
            d.wait_for(s.finished, None, "the pipeline to settle", hold=hold)

    # -- asyncio --------------------------------------------------------------------------------
    async def asubmit(self, item: Any, timeout: Optional[float] = None) -> Any:
        """``await pipe.asubmit(item)``: :meth:`submit` without blocking the event loop, then the
        consumer's value. The item is accepted as :meth:`submit` accepts it (the same code): what
        ``submit`` copies (a plain array; a pool array of up to 4 MiB where ``coalesce`` applies) is
        copied before it is accepted, so a change made to it once accepted does not reach its
        result; what ``submit`` reads in place must be left unchanged until the await ends.
        Waiting for capacity happens on the loop's default executor. Cancelling
        the awaiting task cancels the item as ``cancel()`` on the future :meth:`submit` returns
        does; where its submit was still waiting for capacity, that submit stops waiting and
        accepts nothing (no executor thread is left waiting, which ``asyncio.run`` would join).

        Raises:
            TimeoutError, TypeError, ValueError, RuntimeError: as :meth:`submit`; RuntimeError also
                on an event loop run in one of this pipeline's done-callbacks (its progress thread,
                which would have to set the future the await waits for).
            StageError: a stage failed for the item.
            asyncio.CancelledError: the item was cancelled (or the awaiting task was).
        """
        fut = await self._asubmit_future(item, timeout)
        return await follow(fut)

    async def _asubmit_future(self, item: Any, timeout: Optional[float] = None,
                              ending: Optional[CancelIfDropped] = None, wait: bool = True) -> "ChunkFuture | object":
        # the loop's thread never waits for the pipeline: not for capacity, and not for its lock,
        # which the progress thread holds through a whole step (a compute's launch code, which
        # may be long). Where either would wait, the accepting waits on the loop's executor.
        # ``ending``: the amap the item is for, told of a chunk accepted there (close() may give
        # its window up before the loop runs the map again). ``wait`` False: as _submit_if_room,
        # NO_ROOM (nothing accepted) where there is no room, never waiting for capacity
        try:
            timeout = check_timeout(timeout)
            self._check_caller("asubmit()", awaited=True)
            item = self._check_item(item)
            # first where there is room now, on the loop's thread: accepted as submit accepts it
            # (_submit decides where it goes and what is copied of it), or nothing of it accepted
            # (shielded as the other calls are, sigint.py: a Ctrl-C inside the batch lock's code)
            with shielded():
                fut = self._submit(item, None, wait=False)
            if fut is not NO_ROOM or not wait:
                return fut
            # A cancelled await ends the wait for capacity of a submit running on the executor
            # (gave_up: it then accepts nothing); an item accepted before that submit saw it is cancelled
            off = OffLoopSubmit(ending)
            submit = functools.partial(self._submit_off_loop, item, timeout, off)
            if ending is not None:
                ending.accepting(self._driver)
            try:
                return await asyncio.get_running_loop().run_in_executor(None, submit)
            except BaseException:  # CancelledError mostly: the task awaiting asubmit gave up
                fut = off.abandon()
                if fut is not None:
                    post_cancel([fut])  # (not fut.cancel(): the loop's thread does not wait for the lock)
                else:
                    # a submit waiting for capacity stops waiting: left to wait, it would hold the
                    # executor's thread until capacity came, and asyncio.run, which joins that thread
                    # as it ends, with it
                    self._wake_waits()
                raise
        finally:
            # on the simulated GPU a stage may run inside this coroutine's copy of the item (it
            # advances virtual time), so a failure's traceback reaches this frame, which outlives
            # the coroutine with its locals: it must not keep the pipeline, nor the item
            self = item = off = submit = fut = ending = None  # noqa: F841

    def _submit_off_loop(self, item: Any, timeout: Optional[float], off: OffLoopSubmit) -> "ChunkFuture | None":
        """An asubmit's accepting, on the loop's executor, where the pipeline had no room on the
        loop's thread: ``item`` submitted (:meth:`_submit`, waiting for capacity). None where the
        await was given up first (nothing accepted)."""
        try:
            fut = self._submit(item, timeout, off.gave_up)
        except _GaveUp:
            return None  # (nobody awaits this any more)
        return off.accepted(fut)

    def _wake_waits(self) -> None:
        """Have the threads waiting on the pipeline look at what they wait for again, without
        taking its lock (for the loop's thread): a command that does nothing, posted to the
        progress thread, which wakes them once it ran. Never raises."""
        try:
            self._driver.post(_never, _never)
        except Exception as exc:  # noqa: BLE001 - clean-up: a driver that ended wakes its waiters itself
            logger.debug("waking the pipeline's waits failed: %r", exc)

    @shielded_call
    def _accept_staged(self, accepting: dict, timeout: Optional[float],
                       gave_up: Optional[Callable[[], bool]] = None) -> ChunkFuture:
        """:meth:`submit` for an item :meth:`_accepting` made ready: wait for capacity, accept.
        ``gave_up``: as :meth:`_submit` (raises _GaveUp, nothing accepted). Where there is room it
        takes no driver's lock, which a step of the progress thread keeps (docs/design.md,
        "Accepting without the driver's lock"); only a wait for room does."""
        d, s = self._driver, self._sched
        if gave_up is None or not gave_up():
            chunk = self._accept_if_room(accepting)
            if chunk is not NO_ROOM:
                return chunk.future
        with d.hold() as hold:
            chunk = self._take_room(lambda: s.accept(driver=d, if_room=True, **accepting), timeout, gave_up, hold)
            d.notify()
        return chunk.future

    def amap(self, items: "Iterable[Any] | AsyncIterator[Any]") -> AsyncIterator[Any]:
        """``async for r in pipe.amap(items)``: the results of ``items`` (a sync or async iterable)
        in input order (``ordered=False``: each as it ends), as :meth:`map` gives them, without
        blocking the event loop; each item is accepted as :meth:`asubmit` (so :meth:`submit`)
        accepts it, a pool array of up to 4 MiB copied where ``map`` reads it in place. At most
        ``max_in_flight`` items of chunks of their own are taken ahead of the results handed out,
        that handed out among them (an amap stopped after ``k`` results has pulled at most
        ``k + max_in_flight - 1``; one cut short by a cancel or a close may then ask for one
        more, as :meth:`map` does); items that share chunks are bounded as :meth:`map` bounds
        them, by their bytes (``max_in_flight * chunk_bytes``), so that they fill chunks;
        while it holds results not handed out it never waits for room (an item it pulled whose
        room another thread took meanwhile is submitted after a result is handed out). An async source's
        next item is awaited in a task of its own, and a result ready meanwhile is handed out
        (the pull goes on; it is cancelled when the map ends). What the source raises, a
        KeyboardInterrupt or SystemExit too, is raised here, in the task iterating the map.
        :meth:`close` does not wait for an amap whose event loop cannot run meanwhile (closed, or the calling thread's):
        what it took and has not handed out is cancelled, or dropped if delivered already, and
        the amap, run again, hands out nothing more: it is cut short (raises
        ``concurrent.futures.CancelledError``) where it held items or its input was left. An
        amap whose loop runs on (on another thread) is waited for, as a :meth:`map` is, even where
        its consumer stopped pulling; :meth:`cancel` first ends its chunks without the consumer.

        Raises:
            RuntimeError, StageError: as :meth:`map`; RuntimeError also as :meth:`asubmit`, on an
                event loop run in one of this pipeline's done-callbacks.
            concurrent.futures.CancelledError: as :meth:`map`, the amap cut short by a cancel or a
                close (not asyncio.CancelledError, which stays the awaiting task's own).
        """
        if self._items_are_arrays:
            warn_if_elements_as_items(items, "Pipeline.amap()")  # (at the line that called amap)
        return amap_window(self, items)

    # the steps of amap_window that are this pipeline's own (see there)
    def _amap_begin(self) -> None:
        self._check_caller("amap()", awaited=True)

    def _amap_limit(self) -> int:
        return self.config.max_in_flight

    def _amap_byte_limit(self) -> int:
        return self.config.max_in_flight * self.config.chunk_bytes  # (as map bounds them)

    def _amap_shared_bytes(self, item: Any) -> int:
        return item.nbytes if self._shares_chunk(item) else 0

    def _room_now(self) -> bool:
        """Whether an item may find room now (a look without the lock, which only decides whether
        to pull input; the accepting call decides again): capacity for a chunk of its own, or a
        shared chunk still taking items."""
        s = self._sched
        return s.has_capacity() or s.open_batch is not None

    _amap_room = _room_now  # (amap_window's look: as map's)

    def _amap_takes_more(self) -> bool:
        return self._sched.accepting

    async def _amap_submit(self, item: Any, started: bool, ending: CancelIfDropped,
                           wait: bool) -> "ChunkFuture | object | None":
        try:
            return await self._asubmit_future(item, ending=ending, wait=wait)
        except RuntimeError:
            if self._sched.accepting:
                raise
            return None  # stopped meanwhile (cancelled, closed, a failure): as map, take no more

    def _amap_out_of_work(self, exhausted: bool, started: bool) -> bool:
        s = self._sched
        if exhausted:
            return True
        # input is left but the pipeline takes no more work: cut short, as map is
        if s.broken is not None:
            raise s.broken
        if not started:
            raise s.refusal()
        return False

    async def _amap_failed(self, fut: ChunkFuture, err: BaseException) -> str:
        if fut.cancelled():
            return STOP  # the pipeline was cancelled, or a failure stopped it, under this map: cut short
        if self.config.on_error == "continue" and err is not self._sched.broken and fut.failed_with(err):
            return SKIP  # a failed chunk (whatever its stage raised) is skipped, as map does
        return RAISE

    def _amap_stopped(self, cut_short: bool, handed_out: int, own_close: bool = False) -> Optional[BaseException]:
        if self._sched.first_error is not None and self.config.on_error == "raise":
            return self._sched.first_error
        if cut_short:
            return map_cut_short("amap()", [self._sched], handed_out, own_close)
        return None

    # -- ending ----------------------------------------------------------------------------------
    @shielded_call
    def cancel(self) -> None:
        """Stop admission; chunks not yet on a stream end CANCELLED at once; enqueued chunks
        end CANCELLED once their events complete (their slots are released only then).
        Returns with ``stats().in_flight == 0``. Harmless to call twice; safe from any thread.

        A ``prepare`` running in a worker process (``processes=True``) is stopped: the workers
        running one are killed first, their chunks end CANCELLED, and the pipeline takes no
        more work (:meth:`close` then ends the idle workers). A ``prepare`` running on a thread
        cannot be stopped: this waits for it to return (for ever, should it never return).
        A wait for a stage call (or a done-callback) that has run for 10 s without returning is
        logged once for that call, as a warning on the ``ringflow`` logger naming the stage, the
        item and how long it has run.

        Ctrl-C while this waits raises KeyboardInterrupt. A cancel already handed over is carried
        out all the same; one interrupted before that (while a stage held the pipeline) has
        cancelled nothing, and the pipeline takes work as before: call it again.

        A :meth:`map` or :meth:`amap` running meanwhile (on another thread, or the caller's own
        loop) hands out the results that had ended, then raises
        ``concurrent.futures.CancelledError`` where input was left or its items were cancelled.
        To stop a map of your own, break out of its loop instead.

        Raises:
            RuntimeError: called from inside one of the pipeline's own stages.
            KeyboardInterrupt: Ctrl-C while this waits (above).
        """
        if self._closed:
            return
        self._check_caller("cancel()", opened=False)
        self._stop_prepares()
        d, s = self._driver, self._sched
        # a Ctrl-C that comes while the progress thread keeps the lock through a stage gets this
        # out without it (see Hold); a cancel already handed over is carried out all the same
        with warn_if_stalled(s.stage_owner, "cancel()"), d.hold() as hold:
            try:
                d.command(s.cancel_pending, hold=hold)
            except ThreadEnded:
                return  # a close() on another thread ended it, once everything had ended: nothing to cancel
            d.wait_for(s.finished, None, "cancelled chunks to drain", hold=hold)

    @shielded_call
    def close(self) -> None:
        """Finish every accepted chunk, then release rings, streams, workers and the progress
        thread. Harmless twice; safe from any thread (one of them closes, the others return
        once it is closed). In a child forked from the process that made the pipeline, only
        forgets it (what it holds is the parent's). An :meth:`amap` whose event loop cannot run
        while this waits (the loop is closed, or it is the calling thread's) is not waited for:
        what it took and has not handed out is cancelled, or, delivered already, dropped; run
        again, it raises ``concurrent.futures.CancelledError`` where it held items or its input
        was left.

        A :meth:`map` or :meth:`amap` that can still run (its thread, or its loop on another
        thread) is waited for, as its consumer may still take its results. With
        ``deliver="device"``, results it has not handed out hold device slots its other chunks
        wait for: should its consumer have stopped pulling, this returns only once it pulls again.
        Call :meth:`cancel` first to end such work without the consumer: it never waits for one.
        Such a map takes no more of its input: once it has handed out the results of the items
        it had taken, it raises ``concurrent.futures.CancelledError`` where input was left.

        Finishing the accepted chunks includes waiting for a running ``prepare``, on a thread or
        in a worker process (``processes=True``): a ``prepare`` that never returns keeps this
        waiting for ever. With ``processes=True``, :meth:`cancel` first (or leaving a ``with``
        block by an error, Ctrl-C included) kills the workers running one instead. Once this has
        waited 10 s while a stage call (or a done-callback) that has run as long has not returned,
        a warning on the ``ringflow`` logger names the stage, the item and how long it has run
        (once for each such call); leaving a ``with`` block does the same.

        Ctrl-C while this waits (on the main thread) cancels what is left and raises
        KeyboardInterrupt once the rest has ended, or at once where a stage it would wait for has
        not returned (a ``prepare`` on a thread cannot be stopped): the progress thread then ends
        the pipeline and releases everything as that stage returns, and the next ``close()``
        waits for it (``submit`` and ``map`` already refuse).

        Raises:
            RuntimeError: called from inside one of the pipeline's own stages.
        """
        if self._forget_if_forked():
            return
        self._check_caller("close()", opened=False)
        with warn_if_stalled(self._sched.stage_owner, "close()"):
            self._close()

    def _close(self) -> None:
        """The waits of :meth:`close`, once it has found the call allowed."""
        d, s = self._driver, self._sched
        if not (d.background and d.handed_over):
            try:
                with d.hold() as hold:
                    if self._closed:
                        return
                    try:
                        if s.closed_by is None:
                            s.closed_by = threading.current_thread()  # (told by a map cut short: map_cut_short)
                        d.command(s.stop_admission, hold=hold)
                        # an amap whose event loop cannot run while this waits hands nothing out
                        # before close() returns: what it holds is given up rather than waited for
                        give_up_stranded(d)
                        d.wait_for(s.finished, None, "the pipeline to finish", hold=hold)
                    except BaseException as exc:
                        if d.background and not isinstance(exc, Exception):
                            raise  # (ended below: the hold may have been given up to a Ctrl-C)
                        self._stop_prepares()
                        self._shut()
                        raise
                    self._shut()
                    return
            except BaseException as exc:
                if d.background and not isinstance(exc, Exception):
                    self._end_interrupted()
                raise
        # an ending that Ctrl-C stopped handed the end to the progress thread: wait for it
        d.join_handed_over()
        self._after_progress_thread()

    def _end_interrupted(self) -> None:
        """An ending (close, leaving a with block) stopped as it waited by Ctrl-C, or by another
        exception raised in the caller's thread rather than by the pipeline, the lock held or
        given up to it (:class:`.driver.Hold`): closed from now on, the progress thread takes the
        end over (:meth:`ProgressThread.hand_over`: what is left is cancelled, everything released
        once the rest has ended), and this waits for that unless a stage call of the pipeline runs
        through a whole poll of the wait (:meth:`ProgressThread.join_unless_stalled`); a later
        close() waits for the end. Also where :meth:`_shut` handed the end over as its wait for
        the thread was interrupted. Takes no lock; raises only a second Ctrl-C."""
        d = self._driver
        if not self._closed:
            self._stop_prepares()  # with processes=True: no running prepare is waited for
            self._closed = True
            self._finalizer.detach()
            d.hand_over()
        elif not (d.background and d.handed_over):
            return  # ended already
        if d.join_unless_stalled():
            self._after_progress_thread()

    def _after_progress_thread(self) -> None:
        """Once the progress thread a handed-over end was left to has ended (not on that thread):
        what :meth:`_shut` does after it. The thread closed the scheduler, unless it died first."""
        d = self._driver
        if on_progress_thread(d):
            return
        if not self._sched.closed:
            with d.cv:
                self._sched.close()
        if self._recorder is not None:
            self._recorder.stop()

    def _stop_prepares(self) -> None:
        """With ``processes=True``: kill the workers running a prepare now, ending those chunks
        CANCELLED (:meth:`.ProcessPrepare.stop_running`). Called before the driver's lock is
        taken: on the simulated GPU a prepare runs on the thread that advances the device,
        holding its lock, and one that never returns would keep both. Never raises."""
        if self._procs is not None:
            self._procs.stop_running()

    def _shut(self) -> None:
        """Closed from now on: stop the driver, then release the scheduler's resources (lock
        held). Raises only what stopped the wait for the progress thread to end (a second Ctrl-C,
        or a SIGINT handler of the user's that raises at once): that thread may still run, so the
        end is handed over to it (:meth:`_end_interrupted` then waits for it)."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        d = self._driver
        if d.background:
            try:
                with _released(d.cv):
                    d.close()
            except BaseException:
                # freeing the rings now would race the thread's last turn (a done-callback it
                # still runs, the buffers it last wrote): it closes the scheduler as it ends
                d.hand_over()
                raise
        self._sched.close()
        if self._recorder is not None:
            self._recorder.stop()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Pipeline is closed; create a new one to submit more work")
        if self._names_closed_device and getattr(self.device, "closed", False):  # (another make may not say)
            # (the device's own refusal, raised by the first step on it, names neither)
            raise RuntimeError(f"the pipeline's device ({device_label(self.device)}) is closed, and a pipeline runs "
                               f"its work there until it is closed: close the pipeline before its device, or make "
                               f"a new pipeline on an open device")

    def _check_caller(self, call: str, opened: bool = True, awaited: bool = False) -> None:
        """Refuse ``call`` where the pipeline cannot serve it (:mod:`.reentry`): in a child forked
        after it was made, from inside one of its own stages, (``awaited``: an asyncio call) on
        its own progress thread, and (``opened``) once closed."""
        check_process(self._sched.made_in)
        refuse_from_stage(self._sched.stage_owner, call)
        if awaited:
            refuse_on_progress_thread(self._driver, call)
        if opened:
            self._check_open()

    def _forget_if_forked(self) -> bool:
        """In a child forked after the pipeline was made: closed from now on, touching nothing
        (its threads are not in this process; its memory and device state are the parent's)."""
        if self._sched.made_in == reentry_generation():
            return False
        self._closed = True
        self._finalizer.detach()
        return True

    def __enter__(self) -> "Pipeline":
        return self

    def _exit_at_once(self, exc_type) -> bool:
        """The start of ``__exit__``, over one device or several: a block left without an error
        closes the pipeline (:meth:`close`, raising as it does); in a child forked after the
        pipeline was made, the pipeline is forgotten (:meth:`_forget_if_forked`). Returns
        whether either happened, which leaves ``__exit__`` nothing more to do."""
        if exc_type is None:
            self.close()
            return True
        return self._forget_if_forked()

    @shielded_call
    def __exit__(self, exc_type, exc, tb) -> None:
        if self._exit_at_once(exc_type):
            return
        # an error (Ctrl-C included) left the block: cancel what is left, never mask the error
        refuse_from_stage(self._sched.stage_owner, "__exit__")
        with warn_if_stalled(self._sched.stage_owner, "leaving the with block"):
            self._exit_by_error()

    def _exit_by_error(self) -> None:
        """The waits of :meth:`__exit__` for a block left by an error (Ctrl-C included)."""
        self._stop_prepares()
        d = self._driver
        if d.background and d.handed_over:
            return  # a close in the block that Ctrl-C stopped handed the end over: not waited for here
        try:
            with d.hold() as hold:
                if self._closed:
                    return
                try:
                    if d.failure is None:  # (else the driver died, as the error leaving the block says: nothing runs)
                        d.command(self._sched.cancel_pending, hold=hold)
                        give_up_stranded(d)  # (results delivered into such an amap are released: see close)
                        d.wait_for(self._sched.finished, None, "cancelled chunks to drain", hold=hold)
                except Exception as err:  # noqa: BLE001 - never mask the user's exception
                    warnings.warn(f"cancelling the pipeline after an error failed: {err!r}", RuntimeWarning)
                self._shut()
        except BaseException:
            # Ctrl-C as it waited (another, or a second one): the progress thread ends it (see close)
            if d.background:
                self._end_interrupted()
            raise

    async def __aenter__(self) -> "Pipeline":
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        """Leave ``async with``: what leaving ``with`` does (close when the block ended without an
        error; when it ended by one, Ctrl-C included, cancel what is left and never mask it), its
        waits on the loop's default executor, so the event loop runs on meanwhile.

        Other tasks' :meth:`amap` s run on too, and the close waits for what they took, as for a map
        on another thread. An amap that only the task leaving the block could pull (it ran the map's
        last step, or the task that did has ended) cannot run while that task waits: its window is
        given up, as :meth:`close` on the loop's thread gives up that loop's amaps.

        Cancelling the task while it waits here (``task.cancel()``, ``asyncio.run`` ending,
        Ctrl-C under ``asyncio.run``) cancels the pipeline's work, as an error would, so the close
        it had begun ends soon; the task waits for that end (a second cancellation stops waiting,
        and the close still ends in the background), then raises CancelledError.

        On an event loop run in one of this pipeline's done-callbacks (its progress thread, which
        the executor's thread would wait for), the ending runs on that thread, as :meth:`close`
        called in the callback does: the loop waits meanwhile.

        Raises:
            RuntimeError: from inside one of the pipeline's own stages; as :meth:`close`, where
                the block ended without an error.
            asyncio.CancelledError: the task was cancelled while it waited (above).
        """
        if self._forget_if_forked():
            return
        self._check_caller("__aexit__", opened=False)
        parts = self._each()
        if any(on_progress_thread(part._driver) for part in parts):
            self.__exit__(exc_type, exc, tb)  # (the executor's thread would wait for this one)
            return
        give_up_pulled_by(asyncio.current_task(), [part._driver for part in parts])
        try:
            ending = asyncio.get_running_loop().run_in_executor(None, self.__exit__, exc_type, exc, tb)
        except RuntimeError:  # the loop's executor was shut down: nothing else could wait for the ending
            self.__exit__(exc_type, exc, tb)
            return
        ending.add_done_callback(retrieve)  # (its outcome is raised below, unless the task gave up waiting)
        try:
            # shielded: the task's cancellation must not cancel the ending, only stop the wait for it
            await asyncio.shield(ending)
        except asyncio.CancelledError:
            if ending.done():
                raise
            # the close would wait for work that may never finish without the task (a consumer
            # it was to release results for): cancel that work, as leaving by an error does, so
            # the pipeline never stays half closed, and asyncio.run's join of its executor ends
            for part in parts:
                part._cancel_soon()
            await asyncio.wait((ending,))
            raise

    def _each(self) -> "list[Pipeline]":
        """The single-device pipelines this one runs as: itself (several behind a spread one)."""
        return [self]

    def _cancel_soon(self) -> None:
        """:meth:`cancel` without waiting, for the loop's thread: running prepares in worker
        processes are stopped, and the cancel is posted to the progress thread. Never raises."""
        self._stop_prepares()
        try:
            self._driver.post(self._sched.cancel_pending, _never)
        except Exception as exc:  # noqa: BLE001 - clean-up: a driver that ended has nothing left to cancel
            logger.debug("cancelling the pipeline's work failed: %r", exc)

    # -- kept warm between stream_map calls (ringflow._pipeline.warm) -------------------------------
    def _park(self) -> bool:
        """Forget the finished job and report whether this pipeline can be kept for another."""
        s = self._sched
        if self._closed or self._recorder is not None or not s.idle():
            return False
        s.park()
        return True

    def _forget_failures(self) -> None:
        """Drop the failures kept for :attr:`failures` (a closed whole-array job's pipeline, which
        nobody else can ask for them; see :meth:`Scheduler.forget_failures`)."""
        with self._driver.cv:
            self._sched.forget_failures()

    def _rearm(self, prepare, consume, item_nbytes, host_in_buffer=None, host_out_buffer=None) -> None:
        self._sched.rearm(prepare, consume, item_nbytes, host_in_buffer=host_in_buffer,
                          host_out_buffer=host_out_buffer)

    # -- introspection ---------------------------------------------------------------------------
    @shielded_call
    def stats(self) -> PipelineStats:
        """Counts of accepted, delivered, failed, cancelled and in-flight items (each item once,
        whether or not it shares a chunk with others), taken at one instant:
        ``accepted == delivered + failed + cancelled + in_flight``."""
        with self._driver.hold():
            return self._sched.stats()

    @property
    @shielded_call
    def failures(self) -> list[StageError]:
        """The most recent StageErrors (at most 1024 are kept; with ``on_error="continue"`` map
        skips these items)."""
        with self._driver.hold():  # (a Ctrl-C gets out while a stage keeps the lock: see Hold)
            return list(self._sched.failures)

    @property
    def scheduler(self) -> Scheduler:
        """The pipeline's scheduler (internal: its state for tests and diagnostics)."""
        return self._sched

    def _step(self) -> bool:
        """One scheduler pass on the calling thread (tests: on the simulated GPU the progress
        thread runs only while someone waits, so a test may step a pipeline by hand)."""
        d = self._driver
        with d.cv:
            d.take_over()
            try:
                progressed = self._sched.step()
            finally:
                d.hand_back()
            resolve(self._sched.take_resolved())
            return progressed

    def _drive_until(self, pred: Callable[[], bool], timeout: Optional[float] = None) -> None:
        """Wait until ``pred()`` holds while the driver works (tests)."""
        with self._driver.cv:
            self._driver.wait_for(pred, timeout)

    @shielded_call
    def report(self, reset: bool = False) -> Report:
        """Stage times, bottleneck, ideal bound, efficiency, latency, stalls and memory of the
        chunks finished so far (since the last reset).

        Args:
            reset: also forget what this report covers (the finished chunks' records and the
                stalls so far), so that the next report covers only what ends after it. A
                pipeline that serves for a long time keeps a record for every chunk that
                ended; reporting with ``reset=True`` now and then keeps that bounded. The
                memory high-water marks are the pipeline's since it began.

        Raises:
            RuntimeError: the pipeline was not made with ``profile=True``.
            TypeError: ``reset`` is not a bool.
        """
        reset = check_flag("reset", reset)
        if self._recorder is None:
            raise RuntimeError("report() needs a pipeline made with profile=True")
        with self._driver.hold():
            # a copy: the recorder's timeline keeps growing as the run goes on, a report must not
            timeline, host_seconds = self._recorder.window(self._sched.host_seconds, reset)
            return Report.build(timeline, workers=self.config.workers, memory=memory_of(self._sched),
                                host_seconds=host_seconds)

    def _not_copied(self, what: str) -> str:
        # a copy would be a second face on the one scheduler and progress thread (closing either
        # closes both), and a pickle cannot carry threads, streams or pinned memory to another process
        return (f"a Pipeline cannot be {what}: it owns a progress thread, device streams and pinned memory; share "
                "this one (its methods may be called from any thread), or make a new Pipeline with the same "
                "arguments (in another process, make it there)")

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (f"<Pipeline {state} on {self.device.name}: chunk_bytes={self.config.chunk_bytes}, "
                f"slots={self.config.slots}, max_in_flight={self.config.max_in_flight}>")


# help(), notebooks and IDEs ask inspect.signature, which reads __new__ before __init__: show the
# constructor's parameters, not __new__'s dispatch on ``device``
Pipeline.__signature__ = inspect.signature(Pipeline.__init__).replace(  # type: ignore[attr-defined]
    parameters=list(inspect.signature(Pipeline.__init__).parameters.values())[1:])

_NAMES = itertools.count(1)


class _released:
    """Let go of a (possibly re-entered) lock for the duration of a block."""

    def __init__(self, cv):
        self.cv, self.depth = cv, 0

    def __enter__(self):
        while True:
            try:
                self.cv.release()
            except RuntimeError:
                break
            self.depth += 1

    def __exit__(self, *exc):
        for _ in range(self.depth):
            self.cv.acquire()


class _Recorder:
    """A profiled pipeline's timeline: each chunk's record when it ends, and the callers' stalls."""

    def __init__(self, device: Device, chunk_bytes: int, counts: SlotCounts, workers: int):
        self.device = device
        self.timeline = Timeline(meta={"device": device.name, "chunk_bytes": chunk_bytes,
                                       "slots": dataclasses.asdict(counts), "workers": workers})
        self.anchor = None
        self.host_seconds_before = 0.0  # the scheduler's host time at the last reset (see window)

    def start(self, stream) -> None:
        self.anchor = Anchor(self.device, stream)

    def stop(self) -> None:
        self.anchor = None  # its event goes back

    def on_chunk_end(self, chunk: Chunk) -> None:
        self.timeline.records.append(record_chunk(chunk, self.anchor))
        self.timeline.stalls.extend(stall_spans(chunk.stamps, chunk.index))

    def stall(self, track: str, name: str, start: float) -> None:
        end = self.device.now
        if end > start:
            self.timeline.stalls.append(Span(track, name, start, end))

    def window(self, host_seconds: float, reset: bool) -> "tuple[Timeline, float]":
        """A copy of what was recorded since the last reset, and the scheduler's host time since
        then (``host_seconds``: its total so far); with ``reset``, that is forgotten here."""
        live = self.timeline
        # the meta's nested dicts copied too: a report the caller edits must not edit the next one
        copy = Timeline(records=list(live.records), stalls=list(live.stalls), meta=copy_module.deepcopy(live.meta),
                        host=list(live.host))
        spent = host_seconds - self.host_seconds_before
        if reset:
            live.records.clear()
            live.stalls.clear()
            live.host.clear()
            self.host_seconds_before = host_seconds
        return copy, spent


def _abandon(driver, sched, procs) -> None:
    """A pipeline dropped without ``close()``: warn, and have its driver cancel, drain and release
    (``procs``: its prepare processes, whose running prepares are stopped as cancel stops them).
    Never blocks and never raises (it runs in whichever thread the collector runs)."""
    try:
        if procs is not None:
            procs.stop_running()
        if sched.chunks or sched.inbox:
            warn_quietly("a Pipeline with work in flight was garbage-collected; cancelling it. "
                         "Use it as a context manager or call close()", ResourceWarning)
        if driver.background:
            driver.abandon()
        else:
            sched.close()
    except Exception:  # noqa: BLE001 - never raise from a finaliser
        pass
