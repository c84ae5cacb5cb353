"""Whole arrays through the GPU: :func:`stream_map`, :func:`stream_map_report`, and what every
whole-array job shares with :class:`~ringflow.MapJob`: checking its arguments, laying it out
(:class:`MapLayout`: chunking and the host strategy), pinning its arrays, and running a call on
an engine (:mod:`.engine`).

>>> import numpy as np, ringflow as rf
>>> def f(x, y):              # runs on the device: y[:] = 2x + 1
...     y[:] = x * 2 + 1
>>> x = np.random.rand(1 << 20).astype(np.float32)
>>> y = rf.stream_map(f, x, device=rf.device("sim"), chunk_bytes=1 << 18)
>>> bool(np.array_equal(y, x * 2 + 1))
True

``stream_map`` is a ``MapJob`` made, run once and parked: the engine a call used is kept warm
(:mod:`.warm`) for the next call of the same shape, without any reference to its arrays.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
from typing import Any, Callable, Iterator, NamedTuple, Optional

import numpy as np

from .. import _plan as plan
from .._device import device as make_device
from .._device import device_label, device_list, named_device
from .._device import host_pool
from .._device.protocol import Device, HostBuffer, check_device_dtype, close_quietly, device_names
from .._errors import DeviceError, OutOfMemoryError, StageError
from .._testing import current as current_hooks
from . import call_memo, warm
from .call_memo import array_key, compute_identity, tagged
from .engine import ENGINES, Arrays, Engine, choose_engine, make_engine, why_not_direct
from .frames import forget_own_frames
from .sigint import Shield, shielded
from .sizing import (DEFAULT_CHUNK_BYTES, chunk_sizes, default_workers, fixed_cost, planned_compute_bound,
                     register_budget, resolve_slots, taper)
from .stages import sim_seconds_for
from .validate import (COMPUTE_FORM, check_arity, check_choice, check_not_masked, check_options,
                       check_out, check_output_spec, same_memory)

HOSTS = ("auto", "stage", "register")

# Where stream_map puts a result when no out is given. False: a new ordinary numpy array. True:
# an array from the device's host pool (pinned, reused once dropped), which the copy engines
# write in place; a request the pool cannot serve still gets an ordinary array.
POOLED_OUT = False


def stream_map(f: Callable, x: np.ndarray, out: Optional[np.ndarray] = None, *, device: "Device | str | None" = None,
               chunk_bytes: "int | str | None" = None, host: str = "auto", x_buffer: Optional[HostBuffer] = None,
               out_buffer: Optional[HostBuffer] = None, engine: str = "auto", keep_warm: bool = True, inplace: bool = False,
               slots: "int | plan.SlotCounts | None" = None, workers: Optional[int] = None, checked: bool = False,
               on_error: str = "raise", pinned_budget: "int | str | None" = None, compute_streams: Optional[int] = None,
               profile: bool = False, output: Any = None) -> np.ndarray:
    """Apply ``f(x_chunk, y_chunk)`` on the device to ``x`` in chunks along axis 0; returns ``out``
    once every chunk's result is in it.

    Args:
        f: the compute, called as ``f(x, y)`` with device arrays (numpy on the simulated GPU, CuPy
            or PyTorch on a real one) of one chunk; it must write its result into ``y`` and return
            None. A ``sim_seconds`` attribute (seconds, or a function of the chunk's bytes) sets its
            duration on the simulated GPU, and tells the planner its cost on any device (seconds
            from 0 to 1e6, else a ValueError naming it). A call whose arguments are an
            earlier call's (the same ``f``, device object, buffers and options, and arrays of the
            same memory and layout) reuses that call's checks and plan; the attribute is read again
            when it is replaced, not when a function it names would now answer otherwise.
        x: any numpy array with at least one dimension (pageable or pinned, contiguous or not).
        out: where the result goes: shaped as ``output`` says (else as ``x``), ``x`` itself (in
            place) or memory that does not overlap it; allocated when None. An empty ``x``
            returns at once.
        device: a device, a spec such as ``"cuda:0"`` or ``"sim"``, or None: the device of ``x``'s
            (else ``out``'s) memory when it came from :func:`ringflow.host.empty`, else
            ``ringflow.device()`` (the ``RINGFLOW_DEVICE`` environment variable, else "auto").
            Several devices: a list or tuple of devices or specs (``["cuda:0", "cuda:1"]``,
            ``["sim:0", "sim:1"]``) or ``"cuda:all"``; the rows of ``x`` are split into one
            contiguous shard per device, balanced by rows, and the shards run at once, each an
            ordinary call on its own device (a list of one is that device). Every other
            argument applies to each shard; ``x_buffer``/``out_buffer`` are refused, and arrays
            from :func:`ringflow.host.empty` are staged. See the multi-GPU guide.
        chunk_bytes: bytes per chunk (an int or a size such as ``"8MiB"``), ``"auto"`` to let the
            planner choose, or None for 8 MiB. Never larger than the array needs. A
            compute-bound job's first and last chunks may be shorter (see ``compute_streams``).
        host: how ordinary host memory reaches the copy engines: ``"stage"`` copies each chunk
            through pinned rings on CPU workers; ``"register"`` pins ``x`` and ``out`` in place for
            the call; ``"auto"`` picks by the planner's model.
        x_buffer: pinned memory whose bytes are ``x`` (``allocate_host`` or ``register_host``
            of the call's device; another device's is refused); with ``out_buffer``, nothing
            is staged or registered.
            Found without asking for an ``x`` from :func:`ringflow.host.empty` of the call's
            device (unless ``host="stage"``), and then used in place even where ``out`` is
            registered.
        out_buffer: the same for ``out``; pass both buffers or neither.
        engine: ``"direct"`` enqueues the call in one pass where the copy engines use ``x`` and
            ``out`` in place; ``"pipeline"`` runs it on the scheduler (as staging and
            ``on_error="continue"`` always do); ``"auto"`` picks direct wherever it can.
        keep_warm: keep the call's engine (streams, device rings; never the arrays, nor ``f``
            or a method's object) for the next call of the same shape and compute (a method such
            as ``model.step``: of the same object), until :func:`ringflow.drop_warm_pipelines`
            closes it, ``f`` is collected, or newer engines take its place (at most four a
            device, bounded in bytes).
        inplace: ``f`` gets the same device array as ``x`` and ``y`` (one device ring, not two).
        slots: slots per ring: None (planned), an int, or a :class:`ringflow.SlotCounts`.
        workers: CPU threads for staging (None: on a GPU one per core but one, at most 16; 4 on
            the simulated GPU).
        checked: poison every released slot so a premature reuse gives a wrong result.
        on_error: ``"raise"`` stops at the first failed chunk; ``"continue"`` completes the
            others, then raises the first failure.
        pinned_budget: bytes of pinned staging memory at most; with ``host="auto"`` also the
            most bytes it registers (it stages arrays larger than that). None: no bound on the
            rings, and auto registers at most a quarter of physical memory.
        compute_streams: streams the direct engine spreads kernels over (chunks in different
            device slots), so kernels of several chunks may run side by side. None (planned):
            where small chunks share a copy (copy groups), one per chunk of a group up to four,
            since their kernels are short and start together; for a compute-bound job (a
            chunk's kernel at least twice its longer copy) two; else one. A compute-bound job's
            first and last chunks are also tapered (shorter), unless ``f.sim_seconds`` is a
            number, or a function that returns the same seconds for a chunk and for the taper's
            shortest chunk: that is its kernel's time for a shorter chunk too, which a taper would
            not shorten.
            The kernel's time comes from ``f.sim_seconds`` when ``f`` states it, else
            the direct engine times one chunk of its first call and plans the later ones
            (docs/design.md, "Compute-bound jobs"). The scheduled engine uses one stream.
        profile: time every stage (use :func:`stream_map_report` to get the report).
        output: the result's ``(shape, dtype)`` when it is not shaped as ``x``: the same rows
            (``shape[0] == len(x)``), any row shape and dtype, e.g. ``((n, 10), "float16")`` for
            ten half-precision values per row of ``x``. Chunk ``i``'s ``y`` is then its rows of
            that shape; a chunk's input and its result each fit ``chunk_bytes``, and only the
            result's bytes are copied back. Not with ``inplace``.

    Returns:
        ``out``.

    Raises:
        TypeError, ValueError: a bad argument (the message names it and what it accepts).
        StageError: a chunk failed (its stage and index named, its ``rows`` the ``(start, stop)``
            of ``x`` that chunk held; the original as ``__cause__``).
            Over several devices the index counts chunks over the whole call in row order (the
            chunks every earlier shard ran, tapered ones included), and the device and rows are
            named; every shard has ended (finished or failed) first.
        DeviceError: the device broke (over several devices: a new error naming it).
    """
    try:
        # the options by position, in OPTIONS' order: a warm call passes them on without a dict
        return _stream_map(f, x, out, device, x_buffer, out_buffer,
                           (chunk_bytes, host, engine, keep_warm, profile, output, inplace, slots, workers, checked,
                            on_error, pinned_budget, compute_streams))[0]
    except BaseException as exc:
        # the error's traceback holds this frame and ringflow's below it: a caller keeping the
        # error keeps neither the arrays of the call nor the result made for it (frames.py)
        forget_own_frames(exc)
        del f, x, out, x_buffer, out_buffer
        raise


def stream_map_report(f: Callable, x: np.ndarray, out: Optional[np.ndarray] = None, **options: Any) -> tuple:
    """:func:`stream_map` with profiling on, on the engine it would run on anyway.

    Returns:
        ``(out, report)``: the result and its :class:`ringflow.Report` (None if ``x`` is empty);
        over several devices the report is a ``ShardedReport``: a ``Report`` per shard
        (``reports``), each shard's time on its device's clock (``elapsed_s``) and the call's
        (``wall_s``, the largest; ``predicted_s`` on simulated GPUs), and ``save_trace`` writing
        one Chrome trace with a process per device.

    Raises:
        ValueError: ``profile`` given as anything but True (this call always profiles);
            otherwise as :func:`stream_map`.
    """
    if options.get("profile", True) is not True:
        raise ValueError(f"stream_map_report always profiles (profile={options['profile']!r} was given); leave "
                         "profile= out, or call stream_map for a call without a report")
    unknown = set(options) - _NAMES
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {sorted(unknown)}")
    options["profile"] = True
    try:
        return _stream_map(f, x, out, options.get("device"), options.get("x_buffer"), options.get("out_buffer"),
                           tuple(options.get(name, default) for name, default in OPTIONS))
    except BaseException as exc:
        forget_own_frames(exc)  # as stream_map
        del f, x, out, options
        raise


# A whole-array call's options after its arrays, device and buffers, with their defaults, in the
# order stream_map passes them on (``values`` below): the memo's key lists them so.
OPTIONS = (("chunk_bytes", None), ("host", "auto"), ("engine", "auto"), ("keep_warm", True), ("profile", False),
           ("output", None), ("inplace", False), ("slots", None), ("workers", None), ("checked", False),
           ("on_error", "raise"), ("pinned_budget", None), ("compute_streams", None))
_OUTPUT = 5  # output's place in OPTIONS: the one option that is not a plain value
_NAMES = frozenset([name for name, _ in OPTIONS] + ["device", "x_buffer", "out_buffer"])


def _stream_map(f, x, out, device, x_buffer, out_buffer, values: tuple) -> tuple:
    """:func:`stream_map`'s call, its options ``values`` in :data:`OPTIONS`' order; returns
    ``(out, report)``."""
    # a warm call with an earlier call's arguments reuses its checks and plan (call_memo.py)
    chunk_bytes, host, engine, keep_warm, profile, output = values[:_OUTPUT + 1]
    memo = _memo_key(f, x, out, device, x_buffer, out_buffer, values)
    if memo is not None:
        dev, key, objects, read = memo
        # pool arrays are received on every call (ordered after their hand-off), served or not
        pooled, pattern = pool_sides(dev, x, out, host, x_buffer, out_buffer)
        kept = call_memo.MEMO.get(key, objects, read)
        if kept is not None and kept.pool_pattern == pattern and not _closed(dev, x_buffer, out_buffer):
            call = kept.prepared(dev, x_buffer, out_buffer, pooled)
            fresh_out = out is None
            result = allocate_out(call.out_shape, call.out_dtype, "stream_map", output) if fresh_out else out
            try:
                # (a fresh result is a new numpy array: KeptCall keeps no call whose result was replaced)
                result, report, _ = run_prepared(f, x, result, fresh_out, call, profile,
                                                 unpooled=all(side is None for side in pattern))
                return result, report
            except STAGE_INSTEAD:
                if host != "auto":
                    raise
                # pinned since the kept call was planned (or not pinnable now): the full path plans it again
    opts = check_options(chunk_bytes=chunk_bytes, allow_auto_chunk=True, keep_warm=keep_warm, profile=profile,
                         **{name: value for (name, _), value in zip(OPTIONS[_OUTPUT + 1:], values[_OUTPUT + 1:])})
    out, fresh_out = check_arrays(f, x, out, host, engine, "stream_map", output, opts["inplace"])
    if x.shape[0] == 0 or x.size == 0:
        return out, None
    keep_warm, profile = opts.pop("keep_warm"), opts.pop("profile")
    many = device_list(device)
    # the devices as given, one for each of ``many`` ("cuda:all" gives none: they are made here)
    given = list(device) if isinstance(device, (list, tuple)) else [None] * len(many) if many else [device]
    if many is not None and len(many) > 1:  # the rows are split over the devices (one list of one is one)
        from .sharded import stream_map_sharded

        refuse_inside(many, "stream_map")
        keep_warm = keep_warm and all(_named_again(g, d, x, out) for g, d in zip(given, many))
        return stream_map_sharded(f, x, out, fresh_out, many, opts.pop("chunk_bytes"), host, x_buffer, out_buffer,
                                  engine, keep_warm, profile, opts)
    dev = one_device(device, many, x, out, fresh_out)
    keep_warm = keep_warm and _named_again(given[0], dev, x, out)
    result, report, _, call = _run_whole_call(f, x, out, fresh_out, dev, opts.pop("chunk_bytes"), host, x_buffer,
                                              out_buffer, engine, keep_warm, profile, opts)
    # a call staged in place of registering memory pinned already is not kept: the memory may be
    # unpinned by the next call, which registers it again
    if call is not None and memo is not None and memo[0] is dev and not call.replaced_out:
        call_memo.MEMO.put(memo[1], memo[2], memo[3], KeptCall.of(call, pattern))
    return result, report


def _memo_key(f, x, out, device, x_buffer, out_buffer, values: tuple) -> Optional[tuple]:
    """``(device, key, objects, values)`` for :data:`call_memo.MEMO`, or None for a call the memo
    does not serve: arrays that are not plain numpy arrays, an empty ``x``, options of other types
    than plain values, or a device not given as a device object (a spec or None makes a new device on every
    call, which the full path does once). ``values``: the call's options in :data:`OPTIONS`' order."""
    if type(x) is not np.ndarray or (out is not None and type(out) is not np.ndarray) or x.size == 0:
        return None
    if not isinstance(device, Device):
        return None
    output = values[_OUTPUT]
    plain = values[:_OUTPUT] + values[_OUTPUT + 1:]
    types = tuple(map(type, plain))
    if not _PLAIN.issuperset(types):  # a SlotCounts of floats equals one of ints
        return None
    x_key = array_key(x)
    out_key = None if out is None else x_key if out is x else array_key(out)
    hooks = current_hooks()
    compute, computes = compute_identity(f)
    # (not hashed here: an unhashable key, an output spec holding a list say, is one the memo
    # finds nothing under and keeps nothing under)
    key = (compute, id(device), id(x_buffer), id(out_buffer), id(hooks), x_key, out is x, out_key, plain, types,
           None if output is None else tagged(output), POOLED_OUT)
    return (device, key, (*computes, device, x_buffer, out_buffer, hooks),
            (getattr(f, "sim_seconds", None), device.hardware))


_PLAIN = frozenset({int, float, str, bool, type(None)})  # types whose equal values are the same argument


def _named_again(given: Any, dev: Device, x: np.ndarray, out: Optional[np.ndarray]) -> bool:
    """Whether a later call can run on ``dev`` again, so that an engine kept warm for it can be
    taken: ``dev`` was given as a device, is the device of ``x``'s or ``out``'s pool memory, or
    is the process's simulated GPU a spec such as ``"sim:0"`` names. Any other spec, and None,
    make a device for this call alone: an engine kept for it would never be taken (its key
    names that device) and would only hold the device, its streams and its memory."""
    if isinstance(given, Device) or named_device(dev):
        return True
    return given is None and (dev is host_pool.device_of(x) or (out is not None and dev is host_pool.device_of(out)))


def pool_sides(dev: Device, x: np.ndarray, out: Optional[np.ndarray], host: str, x_buffer, out_buffer) -> tuple:
    """``(pooled, pattern)`` of a call on ``dev`` whose result is ``out`` (None: a fresh one):
    the pool buffers :func:`pooled_buffers` finds behind ``x`` and ``out`` (received: the calling
    thread ordered after their hand-off), and what of them its plan reads, which a memo entry must
    match: for each side, None where it is memory of no pool, else a 1-tuple of the bytes of the
    buffer used in place (None where there is none: another device's pool memory, or a view from
    another byte than its block's first); the pattern is None where a pool array's device is
    closed (no entry matches it)."""
    owners = (host_pool.device_of(x), None if out is None else host_pool.device_of(out))
    if owners == (None, None):  # (ordinary arrays: nothing to receive)
        return (None, None), (None, None)
    if any(owner is not None and owner.closed for owner in owners):
        # its pinned memory went with the device: no plan serves it (the full path refuses it)
        return (None, None), None
    pooled = pooled_buffers(dev, x, out, out is None, host, x_buffer, out_buffer)
    return pooled, tuple(None if owner is None else (None if buf is None else buf.nbytes,)
                         for owner, buf in zip(owners, pooled))


def _unpooled(x: np.ndarray, out: Optional[np.ndarray]) -> bool:
    """Whether neither ``x`` nor a given ``out`` is over any device's pool memory (a call on pool
    arrays hands them off when it ends)."""
    return host_pool.device_of(x) is None and (out is None or out is x or host_pool.device_of(out) is None)


def _closed(dev: Device, x_buffer: Optional[HostBuffer], out_buffer: Optional[HostBuffer]) -> bool:
    """Whether ``dev`` or a given buffer was closed since (the full path then says so)."""
    return dev.closed or (x_buffer is not None and x_buffer.closed) or (out_buffer is not None and out_buffer.closed)


def one_device(device: Any, many: "list | None", x: np.ndarray, out: np.ndarray, fresh_out: bool) -> Device:
    """The device a whole-array call on one device runs on: the one given (``many``: the list
    of one it was given as); for None, the device of ``x``'s :mod:`ringflow.host` pool, else of
    ``out``'s, else the default one.

    Raises:
        RuntimeError: ``device`` is a closed device (naming it as the argument).
    """
    if many is not None:
        device = many[0]
    elif device is None:  # arrays from ringflow.host name their device (open: check_arrays refused others)
        device = host_pool.device_of(x)
        if device is None and not fresh_out:
            device = host_pool.device_of(out)
    elif isinstance(device, Device) and device.closed:
        # (its own words, raised later, say neither that it is the device given nor what to pass)
        raise RuntimeError(f"device= ({device_label(device)}) is closed, and a closed device runs nothing: pass an "
                           f"open device (a new rf.device('sim'), or 'cuda:N' / 'sim:N')")
    return make_device(device) if not isinstance(device, Device) else device


class PreparedCall(NamedTuple):
    """A checked whole-array call on one device, ready to run: its device and layout (as
    ``layout_fields``, :class:`MapLayout`'s fields after the device: a warm call that finds its
    engine never builds the layout), the engine options and kind, the pinned buffers it uses
    (``pooled``: those found behind pool arrays), its warm engine's key (None: not kept warm),
    the result's shape and dtype, and whether a fresh result was replaced by a pool array. Holds
    no array (:class:`KeptCall` is how the memo keeps it). A tuple: made on every warm call."""

    device: Device
    layout_fields: tuple
    opts: dict
    kind: str
    warm_key: Optional[tuple]
    x_buffer: Any
    out_buffer: Any
    pooled: tuple
    out_shape: tuple
    out_dtype: np.dtype
    replaced_out: bool

    @property
    def layout(self) -> "MapLayout":
        """The call's :class:`MapLayout` (made anew on each use)."""
        return MapLayout(self.device, *self.layout_fields)

    @property
    def strategy(self) -> str:
        """The layout's host strategy (without making the layout)."""
        return self.layout_fields[_STRATEGY]


def run_whole(f, x, out, fresh_out: bool, dev: Device, chunk_bytes, host: str, x_buffer, out_buffer, engine: str,
              keep_warm: bool, profile: bool, opts: dict, *, pooled_out: bool = True) -> tuple:
    """One checked, non-empty whole-array call on ``dev`` (``opts`` as :func:`check_options`
    returns them, less ``chunk_bytes``, ``keep_warm`` and ``profile``); returns ``(out, report,
    chunks)``, ``chunks`` the chunks the call ran (a warm engine's may be tapered).
    ``pooled_out``: a fresh ``out`` may be replaced by a pool array (:data:`POOLED_OUT`); a shard
    of a call over several devices writes the caller's ``out`` and passes False."""
    return _run_whole_call(f, x, out, fresh_out, dev, chunk_bytes, host, x_buffer, out_buffer, engine, keep_warm,
                           profile, opts, pooled_out=pooled_out)[:3]


def _run_whole_call(f, x, out, fresh_out: bool, dev: Device, chunk_bytes, host: str, x_buffer, out_buffer,
                    engine: str, keep_warm: bool, profile: bool, opts: dict, *, pooled_out: bool = True) -> tuple:
    """:func:`run_whole`'s ``(out, report, chunks)`` and the :class:`PreparedCall` it ran, or None
    where ``"auto"`` met memory pinned already and staged it instead."""
    try:
        result, fresh_result, call = prepare_whole(f, x, out, fresh_out, dev, chunk_bytes, host, x_buffer, out_buffer,
                                                   engine, keep_warm, opts, pooled_out=pooled_out)
        return (*run_prepared(f, x, result, fresh_result, call, profile), call)
    except STAGE_INSTEAD:
        if host != "auto":
            raise
    # "auto" chose to register memory that something else pins already (an open MapJob, a
    # register_host buffer), or that the host could not pin: staging copies it through its rings
    return (*run_whole(f, x, out, fresh_out, dev, chunk_bytes, "stage", x_buffer, out_buffer, engine, keep_warm,
                       profile, opts, pooled_out=pooled_out), None)


def prepare_whole(f, x, out, fresh_out: bool, dev: Device, chunk_bytes, host: str, x_buffer, out_buffer,
                  engine: str, keep_warm: bool, opts: dict, *, pooled_out: bool = True) -> tuple:
    """:func:`run_whole`'s checks and plan: returns ``(out, fresh_out, call)``, ``out`` replaced
    by a pool array where :data:`POOLED_OUT` says, and the :class:`PreparedCall`.

    Raises:
        as :meth:`MapLayout.plan`, :func:`check_on_device` and :func:`choose_engine`.
    """
    check_on_device(dev, x, out)
    replaced = False
    if pooled_out and fresh_out and POOLED_OUT and x_buffer is None and out_buffer is None and host != "stage":
        out, replaced = host_pool.pool_for(dev).empty(out.shape, out.dtype), True
        fresh_out = host_pool.buffer_behind(out, dev) is None  # a pageable fallback is still untouched
    layout, x_buffer, out_buffer, pooled = plan_layout(f, x, out, fresh_out, dev, chunk_bytes, host, x_buffer,
                                                       out_buffer, opts, engine=engine)
    opts = layout.engine_options(opts)
    kind = choose_engine(engine, layout.strategy, opts)
    key = None
    if keep_warm and not opts.get("checked"):
        opts_key = warm.options_key(opts)
        if opts_key is not None:
            # (a parked engine holds no f: the cache watches what its identity names, warm.py)
            key = ("map", id(layout.device), compute_identity(f)[0], layout.key, kind, out is x,
                   tuple(None if b is None else b.nbytes for b in (x_buffer, out_buffer)), opts_key, cost_key(f))
    return out, fresh_out, PreparedCall(dev, layout.fields(), opts, kind, key, x_buffer, out_buffer, pooled, out.shape,
                                        out.dtype, replaced)


def cost_key(f: Callable) -> Any:
    """``f``'s ``sim_seconds`` as a warm engine's key holds it: the direct engine lays each chunk's
    kernel time out when it is made, so an engine made for one cost must not serve another. A
    number is keyed by its value; anything else (a function of the chunk's bytes) by its identity,
    which the direct engine holds while it lives (so no new object takes that identity), and the
    scheduled engine, which reads the cost on every call, does not need."""
    cost = getattr(f, "sim_seconds", None)
    if isinstance(cost, (int, float, np.integer, np.floating)):
        return float(cost)
    return None if cost is None else (type(cost), id(cost))


@dataclasses.dataclass(frozen=True)
class KeptCall:
    """A :class:`PreparedCall` as :data:`call_memo.MEMO` keeps it: without its device, the
    caller's buffers or the pool buffers behind its arrays (an entry must not keep any alive: a
    device dropped by its caller goes, as a collected RayMapper's must), which each call that it
    serves gives again; with ``pool_pattern``, what the plan read of its pool arrays
    (:func:`pool_sides`), which a call it serves must match."""

    layout_fields: tuple  # MapLayout's fields after the device
    opts: dict
    kind: str
    warm_key: Optional[tuple]
    out_shape: tuple
    out_dtype: np.dtype
    pool_pattern: tuple

    @classmethod
    def of(cls, call: "PreparedCall", pool_pattern: tuple) -> "KeptCall":
        return cls(call.layout_fields, call.opts, call.kind, call.warm_key, call.out_shape, call.out_dtype,
                   pool_pattern)

    def prepared(self, dev: Device, x_buffer, out_buffer, pooled: tuple) -> "PreparedCall":
        """The call on ``dev`` with the caller's buffers and the pool buffers ``pooled`` behind
        its arrays (used as :func:`plan_layout` uses them)."""
        return PreparedCall(dev, self.layout_fields, self.opts, self.kind, self.warm_key,
                            *buffers_in_use(x_buffer, out_buffer, pooled, self.layout_fields[_IN_PLACE]), pooled,
                            self.out_shape, self.out_dtype, False)


def run_prepared(f, x, out, fresh_out: bool, call: PreparedCall, profile: bool, *, unpooled: bool = False) -> tuple:
    """Run a :class:`PreparedCall` on ``x`` and ``out`` (the arrays it was prepared for, or ones
    of the same memory and layout); returns ``(out, report, chunks)`` as :func:`run_whole`.
    ``unpooled``: neither array is pool memory (:func:`pinned_arrays`)."""
    refuse_inside((call.device,), "stream_map")
    # Ctrl-C is taken inside the call's steps only: never between taking an engine and parking
    # or closing it, nor while registrations are made or dropped (sigint.py)
    with shielded() as shield:
        registered: list = []
        try:
            registered, arrays = pinned_arrays(call.device, call.strategy, x, out, fresh_out, call.x_buffer,
                                               call.out_buffer, call.pooled, call.opts.get("workers"),
                                               unpooled=unpooled)
            key = call.warm_key
            taken = warm.WARM.take(key, f) if key is not None else None
            if taken is not None:
                eng, relay = taken
            else:  # an engine that may be kept calls a relay, which a parked engine empties (warm.py)
                relay = warm.ComputeRelay(f) if key is not None else None
                # (the engine gets its own copy of the options: a memo entry is shared)
                eng = warm.with_room(call.device, lambda: make_engine(call.kind, relay or f, call.layout,
                                                                      dict(call.opts), arrays))
            chunks = eng.n_chunks  # before the call: a first call that finds the job compute-bound tapers the next
            run_call(eng, arrays, profile, shield)
            report = eng.report() if profile else None
            if key is not None and eng.park():
                warm.WARM.park(key, eng, relay, compute_identity(f)[1])
            else:
                eng.close()
        except DeviceError as exc:
            # a broken device (a sticky error) fails a registering call before it takes an
            # engine: the engines kept for the device go now, as a taken one goes when it fails
            if exc.sticky:
                warm.WARM.drop(call.device)
            raise
        finally:
            for buf in registered:
                close_quietly(buf, "registration")
    return out, report, chunks


def refuse_inside(devices, who: str) -> None:
    """Refuse a whole-array call (``who``) made from inside work one of ``devices`` runs
    (:meth:`~ringflow._device.protocol.Device.runs_caller`: a compute on the simulated GPU): the
    call waits for that device, which cannot go on until the work the call runs in returns. It
    would fail part way with its clean-up unable to wait (and leave its registrations pinned),
    or, over several devices, wait for ever for a shard on the device this thread holds.

    Raises:
        RuntimeError: naming the call and the device.
    """
    for dev in devices:
        if dev.runs_caller():
            raise RuntimeError(f"{who} was called from inside work that {device_label(dev)} runs (a compute or host "
                               f"task, which the simulated GPU runs as it advances, where nothing may wait for it): "
                               f"the call would wait for the device running it. Make the call once that work has "
                               f"returned (after the call whose f this is), or on another device")


def run_call(engine: Engine, arrays: Arrays, profile: bool, shield: Optional[Shield]) -> None:
    """One call of a whole-array job on ``engine``, made inside a :func:`shielded` block whose
    shield is ``shield`` (None where the call is left alone); if it raises (any BaseException,
    Ctrl-C included) the engine is settled and closed first, so nothing still touches the arrays.
    Ctrl-C is taken only between steps, and not while settling (see sigint.py). A StageError
    raised gets its ``rows`` from the engine that ran the chunks: a compute-bound job's chunks
    are tapered (planned, or measured by a first call), so its index times the rows of a chunk
    is not them."""
    hooks = current_hooks()
    if hooks.on_engine is not None:
        hooks.on_engine(engine)
    try:
        engine.run(arrays, profile=profile)
    except BaseException as exc:
        if shield is not None:
            shield.settle()
        engine.fail(exc)  # settled and closed; never masks exc
        if isinstance(exc, StageError) and exc.rows is None:
            try:
                exc.rows = engine.chunk_rows(exc.index)
            except Exception:  # noqa: BLE001 - rows not known are None, never the call's error
                pass
        raise
    finally:
        _leave_tokens(arrays)


def _leave_tokens(arrays: Arrays) -> None:
    """After a call (its copies all complete, or settled after a failure): whoever drops a pool
    array the call read or wrote in place, on any thread, hands its block on ordered after this
    thread, which saw them complete. Nothing for arrays known not to be pool memory. Never
    raises (it runs after a failed call too)."""
    if not arrays.pooled:
        return
    for arr in (arrays.x, arrays.out):
        try:
            owner_device = host_pool.device_of(arr)
            if owner_device is not None:
                host_pool.hand_off(arr, owner_device.publish())
        except Exception:  # noqa: BLE001, S112 - a token not left costs a checker edge, never the call's result
            continue


def check_arrays(f: Any, x: Any, out: Any, host: Any, engine: Any, who: str, output: Any = None,
                 inplace: bool = False) -> tuple[np.ndarray, bool]:
    """Refuse what a whole-array job cannot take; returns ``out`` (allocated when None, shaped as
    ``output`` says or as ``x``) and whether it is fresh (never touched: its pages are faulted in
    by the job).

    Raises:
        TypeError: ``f`` not callable, ``x`` or ``out`` not a numpy array or a masked one,
            ``output`` not a ``(shape, dtype)`` pair.
        ValueError: a 0-d ``x``, ``x`` or ``output`` of a dtype whose items have 0 bytes, ``out``
            of another shape or dtype than ``output`` (or ``x``) or overlapping ``x``, an
            ``output`` whose rows are not ``x``'s, ``output`` with ``inplace``, or an unknown
            ``host`` or ``engine``.
    """
    if not callable(f):
        raise TypeError(f"{who} needs a callable f(x, y) as its first argument, got {type(f).__name__}")
    check_arity(f"{who}'s first argument", f, 2, COMPUTE_FORM)
    if not isinstance(x, np.ndarray):
        # (np.asarray of a scalar is a 0-d array, which is refused below: the advice must give rows)
        how = ("np.atleast_1d(x)" if isinstance(x, (np.generic, int, float, complex)) else "np.asarray(x)")
        raise TypeError(f"{who} takes a numpy array x, got {type(x).__name__}; convert with {how}")
    check_not_masked("x", x)
    if x.ndim == 0:
        raise ValueError(f"{who} splits x along axis 0; pass an array with at least one dimension (x.reshape(1))")
    check_device_dtype("x", x.dtype)
    check_pool_open("x", x)
    check_choice("host", host, HOSTS)
    check_choice("engine", engine, ENGINES)
    shape, dtype = (x.shape, x.dtype) if output is None else whole_output(output, x, inplace)
    if out is None:
        return allocate_out(shape, dtype, who, output), True
    if not isinstance(out, np.ndarray) or out.shape != shape or out.dtype != dtype:
        hint = "" if output is not None else "; for a result shaped otherwise pass output=(shape, dtype) too"
        got = f"{out.shape} {out.dtype}" if isinstance(out, np.ndarray) else f"a {type(out).__name__}"
        if not isinstance(out, np.ndarray):
            hint = "; pass a numpy array, or None to have one allocated"
        raise ValueError(f"out must be a numpy array of shape {shape} and dtype {dtype}"
                         f"{' (as output= says)' if output is not None else ''}, got {got}{hint}")
    if not out.flags.writeable:
        raise ValueError("out is read-only; pass a writeable array (or out=None to allocate one)")
    check_not_masked("out", out)
    check_pool_open("out", out)
    check_out(x, out)
    return out, False


def check_pool_open(name: str, arr: np.ndarray) -> None:
    """Refuse an array from :mod:`ringflow.host` whose device is closed: a device's pinned memory
    goes with it (a GPU frees every pinned allocation of its context), so the array's bytes are no
    longer there to read or write, on that device or any other.

    Raises:
        RuntimeError: naming ``name``, its device and what to do.
    """
    owner = host_pool.device_of(arr)
    if owner is not None and owner.closed:
        raise RuntimeError(f"{name} is memory from ringflow.host of {device_label(owner)}, which is closed, and its "
                           f"pinned memory went with it: {name} can no longer be read or written. Make {name} again "
                           f"(ringflow.host.empty of an open device, or an ordinary numpy array), and close a device "
                           f"only once its pool arrays are dropped")


def allocate_out(shape: tuple, dtype: np.dtype, who: str, output: Any) -> np.ndarray:
    """A new result array of ``shape`` and ``dtype``.

    Raises:
        MemoryError: numpy could not allocate it (the message names the call, the size and
            ``output=`` where it set the shape).
    """
    try:
        return np.empty(shape, dtype)
    except (MemoryError, ValueError) as exc:  # numpy's words name neither the call nor the argument
        raise MemoryError(f"{who} could not allocate its result of shape {shape} and dtype {dtype} "
                          f"({math.prod(shape) * dtype.itemsize} bytes{', as output= says' if output is not None else ''}): "
                          f"{exc}; pass a smaller output, or out= an array you made") from None


def whole_output(output: Any, x: np.ndarray, inplace: bool) -> tuple:
    """The ``(shape, dtype)`` of a whole-array job's result as ``output`` gives it: the same rows
    as ``x`` (chunks are cut along axis 0 of both), any shape and dtype after them.

    Raises:
        TypeError: ``output`` is not a ``(shape, dtype)`` pair (a callable is refused: one
            spec covers the whole result).
        ValueError: its first dimension is not ``len(x)``, it has no bytes per row while ``x``
            has rows, it has elements while ``x`` has none (``f`` would never write them), or
            ``inplace`` asks for a result written over an input of another shape.
    """
    if callable(output):
        raise TypeError("output= of a whole-array job is one (shape, dtype) pair for the whole result, such as "
                        f"(({x.shape[0]}, 10), 'float32'); a function of the item belongs to ringflow.Pipeline")
    shape, dtype = check_output_spec(output, "output")
    if not shape or shape[0] != x.shape[0]:
        raise ValueError(f"output's shape {shape} must start with x's rows ({x.shape[0]}): chunks are cut along "
                         f"axis 0 of x and of the result alike, e.g. (({x.shape[0]},) + row shape, dtype)")
    if x.size and math.prod(shape) == 0:
        raise ValueError(f"output's shape {shape} has no elements in a row; a result needs at least one")
    if not x.size and math.prod(shape):
        raise ValueError(f"output's shape {shape} has elements but x {x.shape} has no elements, so f is never "
                         f"called and the result would be left unwritten; give output no elements either, such "
                         f"as ({(x.shape[0], 0)}, dtype)")
    if inplace and (shape, dtype) != (x.shape, x.dtype):
        raise ValueError("output= cannot change the result's shape or dtype with inplace=True: an in-place compute "
                         "writes its result over its input; drop one of them")
    return shape, dtype


@dataclasses.dataclass(frozen=True)
class MapLayout:
    """How a whole-array job is cut and moved: chunks of ``rows`` rows over ``length`` rows (the
    last may be shorter, and a compute-bound job's first and last ones may be: ``taper`` gives the
    first ones' rows, see :func:`~ringflow._pipeline.sizing.taper`); a row of ``x`` is
    ``row_bytes`` (``tail`` of ``dtype``), a row of the result ``out_row_bytes`` (``out_tail`` of
    ``out_dtype``); and the host strategy ("stage", "register" or "pinned"). When staging,
    ``in_place`` names the sides (input, result) that are pinned pool arrays already: the copy
    engines use those in place and only the other side is staged. ``compute_bound``: whether the
    compute's known cost makes the job compute-bound (None: not known;
    :func:`~ringflow._pipeline.sizing.planned_compute_bound`)."""

    device: Device
    row_bytes: int
    rows: int
    length: int
    tail: tuple
    dtype: np.dtype
    strategy: str
    out_row_bytes: int
    out_tail: tuple
    out_dtype: np.dtype
    in_place: tuple = (False, False)
    compute_bound: Optional[bool] = None
    taper: tuple = ()

    def fields(self) -> tuple:
        """The layout's fields after the device, in order (``MapLayout(device, *fields)`` makes it again)."""
        return tuple(getattr(self, fld.name) for fld in dataclasses.fields(self)[1:])

    @property
    def staged(self) -> tuple:
        """Which sides (input, result) go through pinned rings and a CPU copy."""
        return staged_sides(self.strategy, self.in_place)

    @property
    def n_chunks(self) -> int:
        return len(self.sizes())

    @property
    def in_chunk_bytes(self) -> int:
        """Bytes of a whole chunk of ``x``."""
        return self.rows * self.row_bytes

    @property
    def out_chunk_bytes(self) -> int:
        """Bytes of a whole chunk of the result."""
        return self.rows * self.out_row_bytes

    @property
    def chunk_bytes(self) -> int:
        """The pipeline's ``chunk_bytes``: the larger of a chunk's input and its result (its
        host-in and device-in slots hold the input, an in-place job's a whole chunk; its
        device-out and host-out slots hold the result)."""
        return max(self.in_chunk_bytes, self.out_chunk_bytes)

    @property
    def reshaped(self) -> bool:
        """Whether the result is shaped otherwise than the input."""
        return (self.out_tail, self.out_dtype) != (self.tail, self.dtype)

    @property
    def key(self) -> tuple:
        """What shapes an engine built for this layout (for the warm cache): whether the job is
        compute-bound among it, since that plans the engine's compute streams."""
        return (self.row_bytes, self.rows, self.length, self.tail, self.dtype.str, self.strategy,
                self.out_tail, self.out_dtype.str, self.in_place, self.taper, self.compute_bound)

    def sizes(self) -> list[int]:
        """Each chunk's rows, in order."""
        return chunk_sizes(self.length, self.rows, self.taper)

    def ranges(self) -> Iterator[tuple[int, int]]:
        """Each chunk's rows ``(start, stop)``, in order."""
        start = 0
        for rows in self.sizes():
            yield start, start + rows
            start += rows

    def engine_options(self, options: dict) -> dict:
        """``options`` as either engine takes them for this layout: ``pinned_budget`` bounds
        staging memory, so it binds nothing where nothing is staged (the copy engines then use
        the caller's memory) and the scheduler must not refuse what the direct engine runs."""
        if self.strategy != "stage" and options.get("pinned_budget") is not None:
            return {**options, "pinned_budget": None}
        return options

    def slots(self, f: Callable, options: dict, *, external: bool) -> "plan.SlotCounts":
        """The ring sizes for this job (``external``: the copy engines use the caller's memory),
        planned for a chunk's input bytes in and its result's bytes out, no ring with more slots
        than the job has chunks before a taper (its short end chunks reuse those slots)."""
        # (the untapered count: the planner checked the device rings of that many chunks against
        # the device's memory, and a taper's extra short chunks reuse those slots)
        return resolve_slots(self.device, options.get("slots"), self.in_chunk_bytes, bool(options.get("inplace")),
                             options.get("workers") or 1, f, external=(external, external), bulk=True,
                             max_chunks=-(-self.length // self.rows), out_bytes=self.out_chunk_bytes)

    @classmethod
    def plan(cls, f: Callable, x: np.ndarray, out: np.ndarray, fresh_out: bool, dev: Device, chunk_bytes,
             host: str, x_buffer, out_buffer, options: dict, pinned: tuple = (None, None), *,
             engine: str = "auto", pins_once: bool = False) -> "MapLayout":
        """Lay out a non-empty whole-array job. ``pinned``: the pinned buffers already behind
        ``x`` and ``out`` (pool arrays, :func:`pooled_buffers`), which registering need not pin.
        ``engine``: the engine asked for (as :func:`choose_engine` takes it); an ``"auto"``
        chunk's device rings are checked at the slot sizes of the engine that will run the job.
        ``pins_once``: whether the job registers once for many calls (a ``MapJob``), which
        ``host="auto"`` weighs by one call (:func:`~ringflow._plan.choose_host_strategy`).
        ``host="auto"`` registers no more bytes than ``options["pinned_budget"]``, or without one
        than :func:`~.sizing.default_register_budget`: it stages instead.

        Raises:
            TypeError: ``x_buffer`` or ``out_buffer`` that is not a host buffer.
            RuntimeError: ``x_buffer`` or ``out_buffer`` closed.
            ValueError: a row larger than a chunk, half a pair of pinned buffers, pinned buffers
                of another device than ``dev``, without ``out`` or that are not ``x``'s and
                ``out``'s memory, or registration of
                strided arrays, of another device's pool memory or of a view into pool memory
                (``host="register"``).
        """
        row_bytes = x.nbytes // x.shape[0]
        out_row_bytes = out.nbytes // out.shape[0]
        in_place = (False, False)
        contiguous = x.flags.c_contiguous and out.flags.c_contiguous
        # pool memory with no buffer of this device behind it: another device's, or a view from
        # another byte than its block's first (a result of items that shared a chunk, say):
        # pinned already, so it cannot be registered, and not used in place either (the engines
        # read a buffer of this device from its first byte): it is staged
        pinned_views = tuple(buf is None and host_pool.device_of(arr) is not None
                             for arr, buf in ((x, pinned[0]), (out, None if fresh_out else pinned[1])))
        workers = options.get("workers") or default_workers(dev)
        cost = None  # the compute's declared cost (compute_cost), read once where it is planned with
        if (x_buffer is None) != (out_buffer is None):
            raise ValueError("pass both x_buffer and out_buffer (the pinned memory behind x and out), or neither")
        if x_buffer is not None and fresh_out:
            raise ValueError("out_buffer is given but out is not: pass out too, the array whose memory out_buffer "
                             "is (out=out_buffer.view(...))")
        if x_buffer is not None:
            for name, buf, arr in (("x_buffer", x_buffer, x), ("out_buffer", out_buffer, out)):
                if not getattr(buf, "is_host", False):
                    raise TypeError(f"{name} must be a host buffer from device.allocate_host or device.register_host, "
                                    f"got {type(buf).__name__}")
                if buf.closed:  # (its own words name a buffer number the caller never saw, not the argument)
                    arr_name = name[:-7]
                    raise RuntimeError(f"{name} ({buf!r}) is closed, and its memory went with it, {arr_name} (a view of "
                                       f"it) included; pass a buffer open for the whole call (allocate_host or "
                                       f"register_host) and make {arr_name} from it")
                owner = getattr(buf, "owner", None)
                if owner is not None and owner is not dev:
                    # only the device that pinned it may copy from it: its streams would refuse
                    # it mid-call, in words that name a buffer and not the argument
                    here, there = device_names(dev, owner)
                    raise ValueError(f"{name} is pinned memory of another device: the call runs on {here}, the "
                                     f"buffer is of {there}; pass a buffer from allocate_host or register_host of "
                                     f"the call's device, or device= the buffer's device")
                if not buf.holds(arr):
                    raise ValueError(f"{name} must be the pinned memory behind {name[:-7]} (C-contiguous, starting at "
                                     f"the buffer's first byte): make it with buffer.view(...) or register_host")
            strategy = "pinned"
        elif host == "auto":
            # staging and registering, each predicted as a whole run: a staged run of small chunks
            # is bound by the scheduler's host time per chunk, a registered one pays the pinning first
            pinned_sides = tuple(b is not None for b in pinned)
            shared = out is x or same_memory(x, out)  # registering pins the one array once
            per_chunk, per_byte = cost = compute_cost(getattr(f, "sim_seconds", None))
            # each strategy predicted at the job's chunk, or at its own best chunk for "auto"
            chunk = None if chunk_bytes == "auto" else chunk_bytes if chunk_bytes is not None else DEFAULT_CHUNK_BYTES
            strategy = plan.choose_host_strategy(
                dev.hardware, x.nbytes, out.nbytes, workers=workers, out_is_fresh=fresh_out, pinned=pinned_sides,
                chunk_bytes=chunk, compute_s_per_byte=per_byte, compute_s_per_chunk=per_chunk, align=row_bytes,
                scheduler=engine == "pipeline" or why_not_direct("register", options) is not None,
                pins_once=pins_once, same_memory=shared, pinned_budget=register_budget(options)).choice
            strategy = strategy if contiguous and not any(pinned_views) else "stage"
            if strategy == "stage":  # a side already pinned is used in place; only the other is staged
                in_place = pinned_sides
        else:
            strategy = host
            if strategy == "register" and not contiguous:
                raise ValueError("host='register' needs C-contiguous x and out; use host='stage' "
                                 "(or np.ascontiguousarray) for strided arrays")
            if strategy == "register" and any(pinned_views):
                name, arr = ("x", x) if pinned_views[0] else ("out", out)
                owner = host_pool.device_of(arr)
                if owner is not dev:
                    raise ValueError(f"host='register' cannot pin {name}: it is pinned memory of another device "
                                     f"({device_label(owner)}), pinned already; pass device= that device, or use "
                                     f"host='stage' (or 'auto') to copy it through this one's memory")
                raise ValueError(f"host='register' cannot pin {name}: it is a view into ringflow.host pinned "
                                 f"memory (not from its block's first byte), pinned already; use host='auto' or "
                                 f"'stage', or pass an array from rf.host.empty")
        widest = max(row_bytes, out_row_bytes)  # a slot holds a chunk's input and, apart, its result
        if chunk_bytes == "auto":
            per_chunk, per_byte = cost if cost is not None else compute_cost(getattr(f, "sim_seconds", None))
            # the sides staged (the layout's staged): a side already pinned is used in place,
            # costing the host no copy and the scheduler no pool task
            staged = staged_sides(strategy, in_place)
            # the scheduler runs some unstaged jobs too (engine="pipeline", on_error="continue"),
            # and starts each of its device slots on a 256-byte boundary
            scheduled = engine == "pipeline" or why_not_direct(strategy, options) is not None
            chunk_bytes = plan.choose_chunk_bytes(dev.hardware, x.nbytes, compute_s_per_byte=per_byte, align=row_bytes,
                                                  compute_s_per_chunk=per_chunk, workers=workers, host_stages=staged,
                                                  # (a budget bounds the staging rings only)
                                                  pinned_budget=options.get("pinned_budget") if any(staged) else None,
                                                  out_ratio=out_row_bytes / row_bytes if row_bytes else 1.0,
                                                  scheduler=scheduled,
                                                  inplace=bool(options.get("inplace"))).chunk_bytes
            chunk_bytes = chunk_bytes // row_bytes * widest if widest > row_bytes else chunk_bytes
        slot = chunk_bytes if chunk_bytes is not None else max(DEFAULT_CHUNK_BYTES, widest)
        if widest > slot:
            what, narrower = (("x", "reshape x") if row_bytes >= out_row_bytes else
                              ("the result", "give output= fewer bytes a row"))
            raise ValueError(f"one row of {what} along axis 0 is {widest} bytes but chunk_bytes is {slot}; "
                             f"raise chunk_bytes to at least {widest} or {narrower}")
        rows = min(max(1, slot // widest), x.shape[0])  # a chunk is never larger than the array
        bound = planned_compute_bound(dev, f, rows * row_bytes, rows * out_row_bytes)
        # a taper shortens the ends only where a shorter chunk has a shorter kernel: a fixed cost (a
        # number, or a function that gives the taper's shortest chunk a whole one's time) is the
        # same for a short chunk, so a taper would add kernels of that length and shorten none
        head = taper(rows, widest) if bound else ()
        if head and fixed_cost(f, rows * row_bytes, head[0] * row_bytes):
            head = ()
        return cls(dev, row_bytes, rows, x.shape[0], x.shape[1:], x.dtype, strategy, out_row_bytes, out.shape[1:],
                   out.dtype, in_place, compute_bound=bound, taper=head)


def staged_sides(strategy: str, in_place: tuple) -> tuple[bool, bool]:
    """Which sides (input, result) a job of host ``strategy`` stages through pinned rings and a
    CPU copy: under ``"stage"`` those not used in place (``in_place``: the sides that are pinned
    pool arrays already); none under another strategy."""
    stage = strategy == "stage"
    return stage and not in_place[0], stage and not in_place[1]


def compute_cost(sim) -> "tuple[float, float] | tuple[None, None]":
    """(seconds per launch, seconds per input byte) of a compute's ``sim_seconds`` for the chunk
    planner: a number is a cost per launch, whatever the chunk; a function of a chunk's bytes is
    read at 1 and 2 MiB, and taken as the line through both (a fixed part and a part per byte,
    neither below 0); (None, None) without one (the planner then times the kernel as the
    simulated GPU times a launch of no declared cost).

    Raises:
        ValueError: as :func:`~ringflow._pipeline.stages.sim_seconds_for`.
    """
    if sim is None:
        return None, None
    one, two = sim_seconds_for(sim, 1 << 20), sim_seconds_for(sim, 2 << 20)
    # (the line's value at 0 is 2 * one - two: exactly 0 for a cost of seconds a byte times bytes)
    return max(0.0, 2 * one - two), max(0.0, two - one) / (1 << 20)


_STRATEGY, _IN_PLACE = ([fld.name for fld in dataclasses.fields(MapLayout)[1:]].index(name)  # in MapLayout.fields()
                         for name in ("strategy", "in_place"))


def check_on_device(dev: Device, x: np.ndarray, out: np.ndarray) -> None:
    """Refuse ``x``'s dtype, or the result's (``out``'s, where it is another), where ``dev``'s
    arrays cannot have it (:meth:`~ringflow._device.protocol.Device.check_dtype`: the rule
    :func:`check_arrays` already checked, narrowed to what ``dev``'s array type holds).

    Raises:
        TypeError: naming ``x`` or ``output``.
    """
    dev.check_dtype("x", x.dtype)
    if out.dtype != x.dtype:
        dev.check_dtype("output", out.dtype)


def plan_layout(f: Callable, x: np.ndarray, out: np.ndarray, fresh_out: bool, dev: Device, chunk_bytes, host: str,
                x_buffer, out_buffer, opts: dict, *, engine: str = "auto", pins_once: bool = False) -> tuple:
    """:meth:`MapLayout.plan` (``engine`` and ``pins_once`` passed on) for arrays that may come
    from ``dev``'s host pool: returns ``(layout, x_buffer, out_buffer, pooled)``, the buffers
    being the pool's where both arrays are pool arrays (used in place), and ``pooled`` the pool
    buffers found behind each (for :func:`pinned_arrays`).

    Raises:
        as :meth:`MapLayout.plan`.
    """
    pooled = pooled_buffers(dev, x, out, fresh_out, host, x_buffer, out_buffer)
    layout = MapLayout.plan(f, x, out, fresh_out, dev, chunk_bytes, host,
                            *buffers_in_use(x_buffer, out_buffer, pooled, (False, False)), opts, pooled,
                            engine=engine, pins_once=pins_once)
    return (layout, *buffers_in_use(x_buffer, out_buffer, pooled, layout.in_place), pooled)


def buffers_in_use(x_buffer, out_buffer, pooled: tuple, in_place: tuple) -> tuple:
    """The pinned buffers a whole-array job hands its engine: the pool buffers ``pooled`` behind
    ``x`` and ``out`` where both are pool arrays (both used in place), or where the layout uses
    one side in place (``in_place``; the other staged); else the caller's ``x_buffer`` and
    ``out_buffer``."""
    return pooled if None not in pooled or any(in_place) else (x_buffer, out_buffer)


def pooled_buffers(dev: Device, x: np.ndarray, out: np.ndarray, fresh_out: bool, host: str, x_buffer,
                   out_buffer) -> tuple:
    """The pinned buffers behind ``x`` and ``out`` where they are arrays from ``dev``'s host pool
    (:mod:`ringflow.host`), each None where not; both None when the caller passed buffers or
    asked for staging."""
    if x_buffer is not None or out_buffer is not None or host == "stage":
        return None, None
    x_pooled = host_pool.receive(x, dev)
    return x_pooled, None if fresh_out else x_pooled if out is x else host_pool.receive(out, dev)


def pinned_arrays(dev: Device, strategy: str, x: np.ndarray, out: np.ndarray, fresh_out: bool, x_buffer, out_buffer,
                  pooled: tuple, workers: Optional[int], *, unpooled: bool = False) -> tuple[list, Arrays]:
    """The call's :class:`Arrays`, with ``x`` and ``out`` pinned in place on ``dev`` where the
    layout's ``strategy`` registers them (sides already in pool arrays, ``pooled``, are used as
    they are); returns the registrations made (the caller closes them) and the arrays.
    ``unpooled``: the caller knows neither array is pool memory (else it is looked up)."""
    pool = not unpooled and not _unpooled(x, out)
    if strategy != "register":
        return [], Arrays(x, out, x_buffer, out_buffer, pool)
    registered = register(dev, x, out, fresh_out, workers, pinned=pooled)
    mine = iter(registered)
    x_buffer = pooled[0] if pooled[0] is not None else next(mine)
    out_buffer = pooled[1] if pooled[1] is not None else next(mine, x_buffer)
    return registered, Arrays(x, out, x_buffer, out_buffer, pool)


def register(dev: Device, x: np.ndarray, out: np.ndarray, fresh_out: bool, workers: Optional[int],
             pinned: tuple = (None, None)) -> list:
    """Pin ``x`` and ``out`` in place (one registration when they are the same memory), first
    touching a fresh ``out`` in parallel; returns the registrations, ``x``'s first. ``pinned``:
    buffers already behind ``x`` / ``out`` (pooled pinned memory), used instead of registering
    that side: pinned memory cannot be pinned again."""
    if fresh_out:
        parallel_first_touch(out, workers or default_workers(dev))
    registered = [_pin(dev, x, "x")] if pinned[0] is None else []
    try:
        # out=x[...] is x's memory: pinning it twice is an error on a real GPU (already registered)
        if pinned[1] is None and out is not x and not same_memory(x, out):
            registered.append(_pin(dev, out, "out"))
    except BaseException:
        for buf in registered:
            close_quietly(buf, "registration")
        raise
    return registered


class PinnedAlready(ValueError):
    """``host="register"`` (asked for, or chosen by ``"auto"``) met an array whose memory is
    pinned already: by an open :class:`~ringflow.MapJob` that registered it, a whole-array call
    in progress that registered it, a buffer from ``register_host``, or another device. A GPU
    refuses to pin memory twice; ``"auto"`` stages such an array instead, and an explicit
    ``"register"`` raises this."""


class PinningRefused(OutOfMemoryError):
    """``host="register"`` (asked for, or chosen by ``"auto"``) met an array that the host could
    not pin: the driver ran out of memory to lock it in place. ``"auto"`` stages such an array
    instead (staging pins only its rings), and an explicit ``"register"`` raises this, naming
    the array."""


# what "auto" meets while registering and answers by staging the arrays instead
STAGE_INSTEAD = (PinnedAlready, PinningRefused)

# the text both backends put in a refused registration of pinned memory: the CUDA driver's
# error name, which the simulated GPU quotes
_ALREADY_PINNED = "HOST_MEMORY_ALREADY_REGISTERED"


def _pin(dev: Device, arr: np.ndarray, name: str) -> HostBuffer:
    """``dev.register_host(arr)``, ``arr`` being the call's ``name`` (``"x"`` or ``"out"``).

    Raises:
        PinnedAlready: ``arr``'s memory is pinned already (naming ``name`` and what to pass).
        PinningRefused: the host had no memory to pin ``arr`` (naming ``name`` and what to pass).
        DeviceError: any other refusal, as the device raised it.
    """
    try:
        return dev.register_host(arr)
    except OutOfMemoryError as err:
        raise PinningRefused(f"host='register' cannot pin {name} ({arr.nbytes} bytes): the host refused to pin "
                             f"that much memory ({err}); use host='stage', which pins only its rings (bounded "
                             f"by pinned_budget), or host='auto', which stages what it cannot pin, or free "
                             f"pinned memory first") from None
    except DeviceError as err:
        if err.sticky or _ALREADY_PINNED not in str(err):
            raise
        raise PinnedAlready(f"host='register' cannot pin {name}: its memory is pinned already, by an open MapJob "
                            f"with host='register', a whole-array call in progress that registered it (on another "
                            f"thread, or the call whose f this is), a buffer from register_host, or another device "
                            f"({err}); pass that pinned buffer as {name}_buffer= (with the other side's), close "
                            f"what pins it or let that call end first, or use host='stage' (host='auto' stages "
                            f"it)") from None


def parallel_first_touch(arr: np.ndarray, workers: int) -> None:
    """Fault in a fresh array's pages on ``workers`` threads (first touch is bound by the page
    faults one thread can take; docs/design.md has the measured rates)."""
    flat = arr.reshape(-1).view(np.uint8)
    if workers <= 1 or flat.nbytes < (64 << 20):
        flat[::4096] = 0
        return
    step = -(-flat.nbytes // workers)
    with concurrent.futures.ThreadPoolExecutor(workers) as ex:
        list(ex.map(lambda a: flat[a:a + step].fill(0), range(0, flat.nbytes, step)))
