"""Whole arrays through the GPU: :func:`stream_map` and how a whole-array job is laid out
(:class:`MapLayout`: chunking, host strategy, registration) and run — on the direct engine
where the copy engines use the caller's memory in place, else on a :class:`~.api.Pipeline`.

>>> import numpy as np, ringflow as rf
>>> def f(x, y):              # runs on the device: y[:] = 2x + 1
...     y[:] = x * 2 + 1
>>> x = np.random.rand(1 << 20).astype(np.float32)
>>> y = rf.stream_map(f, x, device=rf.device("sim"), chunk_bytes=1 << 18)
>>> bool(np.array_equal(y, x * 2 + 1))
True
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any, Callable, Iterator, Optional

import numpy as np

from .._device import device as make_device
from .._device.protocol import Device, close_quietly
from . import direct, warm
from .api import DEFAULT_CHUNK_BYTES, Pipeline, _default_workers, resolve_slots


def stream_map(f: Callable, x: np.ndarray, out: Optional[np.ndarray] = None, *, device: "Device | str | None" = None,
               chunk_bytes: "int | str | None" = None, host: str = "auto", x_buffer=None, out_buffer=None,
               **pipeline_options: Any) -> np.ndarray:
    """Apply ``f(x_chunk, y_chunk)`` on the device to ``x`` in chunks along axis 0; returns ``out``.

    ``x`` is any numpy array (pageable or not, contiguous or not, any dtype); ``out`` (allocated
    if None) must have the same shape and dtype and receives the result in place (``out=x`` is
    allowed). An empty ``x`` gives an empty result without touching the device.
    ``chunk_bytes="auto"`` chooses the chunk size with :func:`ringflow._plan.choose_chunk_bytes`.

    ``host`` says how ordinary host memory reaches the copy engines: ``"stage"`` copies each
    chunk through the pinned ring on the CPU workers; ``"register"`` pins ``x`` and ``out`` in
    place for the call (cudaHostRegister) so the copy engines read and write them directly;
    ``"auto"`` picks by :func:`ringflow._plan.choose_host_strategy`. Pass ``x_buffer`` /
    ``out_buffer`` (HostBuffers from ``device.allocate_host`` or ``device.register_host`` whose
    bytes are ``x`` / ``out``) when the arrays are already pinned: nothing is staged or
    registered then.

    ``engine``: where the copy engines read ``x`` and write ``out`` in place (``x_buffer``, or
    ``host="register"``) the call is enqueued in one pass with no scheduler (``"direct"``, the
    default there; :mod:`ringflow._pipeline.direct`); ``"pipeline"`` runs it on the scheduler, as
    staging and ``on_error="continue"`` always do. ``profile=True`` profiles either engine.

    ``keep_warm`` (default True): when the call ends cleanly its engine (streams, rings,
    workers) is kept, without any reference to ``x`` or ``out``, and the next call with the same
    device, ``f``, chunk size, host strategy, chunk count and options reuses it instead of
    setting one up (0.27-0.32 ms a call on our H200 host: the first-call rows of
    bench/results/bench-h200-2026-11-30-run4.json). Kept pipelines count as live
    resources of the device until :func:`ringflow.drop_warm_pipelines` closes them; profiled
    and checked calls are never kept. Returns once every chunk's result is in ``out``.
    """
    out, fresh_out = _check_map_args(x, out, host, "stream_map")
    return _stream_map(f, x, out, fresh_out, device, chunk_bytes, host, x_buffer, out_buffer, pipeline_options)[0]


def _check_map_args(x, out, host: str, who: str) -> tuple[np.ndarray, bool]:
    """Refuse what a whole-array job cannot take; returns ``out`` (allocated when None) and
    whether it is fresh (never touched: its pages are faulted in by the job)."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{who} takes a numpy array, got {type(x).__name__}")
    if x.ndim == 0:
        raise ValueError(f"{who} splits along axis 0; pass an array with at least one dimension "
                         "(x.reshape(1))")
    if host not in ("auto", "stage", "register"):
        raise ValueError(f"host must be 'auto', 'stage' or 'register', got {host!r}")
    if out is None:
        return np.empty(x.shape, x.dtype), True
    if not isinstance(out, np.ndarray) or out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"out must be a numpy array of shape {x.shape} and dtype {x.dtype}, got "
                         f"{getattr(out, 'shape', None)} {getattr(out, 'dtype', type(out).__name__)}")
    return out, False


def stream_map_report(f: Callable, x: np.ndarray, out: Optional[np.ndarray] = None, **kw: Any):
    """:func:`stream_map` with profiling on, on the engine it would run on anyway; returns
    ``(out, report)`` (report None if x is empty)."""
    kw["profile"] = True
    result: dict = {}
    kw["_report_to"] = result
    out = stream_map(f, x, out, **kw)
    return out, result.get("report")


@dataclasses.dataclass(frozen=True)
class MapLayout:
    """How a whole-array job is cut and moved: ``rows`` rows of ``row_bytes`` per chunk (the last
    may be shorter), the host strategy, and the stage callbacks bound to ``x`` and ``out``."""
    dev: Device
    row_bytes: int
    rows: int
    length: int
    strategy: str  # "stage", "register" or "pinned"
    describe: Callable
    deliver: Callable
    item_nbytes: Callable

    @property
    def n_chunks(self) -> int:
        return -(-self.length // self.rows)

    @property
    def slot_bytes(self) -> int:
        return self.rows * self.row_bytes

    def ranges(self) -> Iterator[tuple[int, int]]:
        """Each chunk's rows ``(start, stop)``, made as the pipeline pulls them."""
        rows, length = self.rows, self.length
        return ((a, min(a + rows, length)) for a in range(0, length, rows))

    def host_rings(self, x_buffer, out_buffer) -> tuple:
        """The caller's pinned memory behind the host rings: none when staging (the pipeline
        stages through rings of its own), else ``x``'s and ``out``'s buffers."""
        return (None, None) if self.strategy == "stage" else (x_buffer, out_buffer)

    def pipeline(self, f: Callable, host_in, host_out, options: dict) -> "Pipeline":
        """A new pipeline shaped for this job (its stage callbacks, slot size, chunk count)."""
        return Pipeline(f, device=self.dev, chunk_bytes=self.slot_bytes, _fill=self.describe, _drain=self.deliver,
                        item_nbytes=self.item_nbytes, _host_in_buffer=host_in, _host_out_buffer=host_out,
                        _max_chunks=self.n_chunks, _bulk=True, **options)

    def direct_schedule(self, f: Callable, x: np.ndarray, x_buffer, out_buffer, options: dict):
        """A :class:`~ringflow._pipeline.direct.DirectSchedule` for this job (``x``'s chunks, the
        planned device rings); host buffers bound now, or None to give them to each run."""
        inplace = bool(options.get("inplace", False))
        slots = resolve_slots(self.dev, options.get("slots"), self.slot_bytes, inplace, options.get("workers") or 1,
                              f, external=(True, True), bulk=True, max_chunks=self.n_chunks)
        tail, row = x.shape[1:], self.row_bytes
        chunks = [(a * row, (b - a) * row, (b - a,) + tail) for a, b in self.ranges()]
        return direct.DirectSchedule(self.dev, f, x_buffer, out_buffer, chunks, x.dtype, slot_bytes=self.slot_bytes,
                              slots=slots, inplace=inplace, checked=bool(options.get("checked", False)),
                              disabled_guards=options.get("_disabled_guards", ()))


def _layout_map(f, x, out, fresh_out, device, chunk_bytes, host, x_buffer, out_buffer, pipeline_options) -> MapLayout:
    """Check a whole-array job's arguments and lay it out (x non-empty). Raises ValueError for a
    row larger than a chunk, half a pair of pinned buffers, or registration of strided arrays."""
    row_bytes = x.nbytes // x.shape[0]
    dev = make_device(device) if not isinstance(device, Device) else device
    tail = x.shape[1:]
    contiguous = x.flags.c_contiguous and out.flags.c_contiguous
    if (x_buffer is None) != (out_buffer is None):
        raise ValueError("pass both x_buffer and out_buffer (the pinned memory behind x and out), or neither")
    if x_buffer is not None:
        if not contiguous or x_buffer.nbytes < x.nbytes or out_buffer.nbytes < out.nbytes:
            raise ValueError("x_buffer/out_buffer must hold x/out whole, and x/out must be C-contiguous")
        strategy = "pinned"
    elif host == "auto":
        from .. import _plan as plan

        workers = pipeline_options.get("workers") or _default_workers(dev)
        strategy = plan.choose_host_strategy(getattr(dev, "profile", "h200-pcie5"), x.nbytes, out.nbytes,
                                             workers=workers, out_is_fresh=fresh_out).choice
        strategy = strategy if contiguous else "stage"
    else:
        strategy = host
        if strategy == "register" and not contiguous:
            raise ValueError("host='register' needs C-contiguous x and out; use host='stage' "
                             "(or np.ascontiguousarray) for strided arrays")
    if chunk_bytes == "auto":
        from .. import _plan as plan

        sim = getattr(f, "sim_seconds", None)
        per_byte = (sim(1 << 20) / (1 << 20)) if callable(sim) else 0.0
        chunk_bytes = plan.choose_chunk_bytes(getattr(dev, "profile", "h200-pcie5"), x.nbytes,
                                              compute_s_per_byte=per_byte, align=row_bytes,
                                              workers=pipeline_options.get("workers") or _default_workers(dev),
                                              host_stages=strategy == "stage").chunk_bytes
    slot = int(chunk_bytes) if chunk_bytes is not None else max(DEFAULT_CHUNK_BYTES, row_bytes)
    if row_bytes > slot:
        raise ValueError(f"one row of x along axis 0 is {row_bytes} bytes but chunk_bytes is {slot}; "
                         f"raise chunk_bytes to at least {row_bytes} or reshape x")
    rows = max(1, slot // row_bytes)

    def describe(item, raw):
        a, b = item
        if raw is not None:  # staging: copy the rows into the pinned slot
            dst = raw[:(b - a) * row_bytes].view(x.dtype).reshape((b - a,) + tail)
            np.copyto(dst, x[a:b])
        return (b - a,) + tail, x.dtype

    def deliver(index, item, view):
        if strategy == "stage":
            a, b = item
            out[a:b] = view

    item_nbytes = (lambda item: (item[1] - item[0]) * row_bytes) if strategy == "stage" else (lambda item: 0)
    return MapLayout(dev, row_bytes, rows, x.shape[0], strategy, describe, deliver, item_nbytes)


def _register(dev: Device, x: np.ndarray, out: np.ndarray, fresh_out: bool, workers: int) -> list:
    """Pin ``x`` and ``out`` in place (one registration when they are the same array), first
    touching a fresh ``out`` in parallel; returns the registrations, ``x``'s first."""
    if fresh_out:
        parallel_first_touch(out, workers)
    registered = [dev.register_host(x)]
    try:
        if out is not x:
            registered.append(dev.register_host(out))
    except BaseException:
        close_quietly(registered[0], "registration")
        raise
    return registered


def _stream_map(f, x, out, fresh_out, device, chunk_bytes, host, x_buffer, out_buffer, pipeline_options):
    if x.shape[0] == 0 or x.size == 0:
        return out, None
    layout = _layout_map(f, x, out, fresh_out, device, chunk_bytes, host, x_buffer, out_buffer, pipeline_options)
    dev, strategy = layout.dev, layout.strategy
    options = dict(pipeline_options)
    on_pipeline = options.pop("_on_pipeline", None)
    report_to = options.pop("_report_to", None)
    keep_warm = options.pop("keep_warm", True)
    engine = direct.choose_engine(options.pop("engine", "auto"), strategy, options)
    registered = []
    try:
        if strategy == "register":
            registered = _register(dev, x, out, fresh_out, options.get("workers") or _default_workers(dev))
            x_buffer, out_buffer = registered[0], registered[-1]
        host_in, host_out = layout.host_rings(x_buffer, out_buffer)
        if engine == "direct" and on_pipeline is None:
            _run_direct(f, x, layout, host_in, host_out, options, keep_warm, report_to)
            return out, None
        # the pipeline's shape: a warm one parked under the same key serves this call as it is
        key = None
        if keep_warm and not options.get("profile") and not options.get("checked"):
            opts = warm.options_key(options)
            if opts is not None:
                key = (id(dev), id(f), layout.slot_bytes, strategy, layout.n_chunks,
                       host_in.nbytes if host_in is not None else None,
                       host_out.nbytes if host_out is not None else None, host_in is host_out, opts)
        pipe = warm.WARM.take(key) if key is not None else None
        if pipe is not None:
            pipe._rearm(layout.describe, layout.deliver, layout.item_nbytes, host_in, host_out)
        else:
            pipe = layout.pipeline(f, host_in, host_out, options)
        parked = False
        try:
            if on_pipeline is not None:
                on_pipeline(pipe)
            for _ in pipe.map(layout.ranges()):
                pass
            if report_to is not None:
                report_to["report"] = pipe.report()
            if key is not None and pipe._park():
                warm.WARM.park(key, pipe)
                parked = True
        except BaseException as exc:
            pipe.__exit__(type(exc), exc, exc.__traceback__)  # cancel, settle, close; never masks exc
            raise
        if not parked:
            pipe.close()
    finally:
        for buf in registered:
            close_quietly(buf, "registration")
    return out, None


def _run_direct(f, x: np.ndarray, layout: MapLayout, x_buffer, out_buffer, options: dict, keep_warm: bool,
                report_to: Optional[dict] = None) -> None:
    """One call through the direct engine (no scheduler: :mod:`ringflow._pipeline.direct`), with
    a warm schedule of the same shape reused and parked again, as pipelines are. A parked
    schedule holds no slice of the caller's buffers (they are given to each run). Profiling is
    a property of the run, not of the schedule: a profiled call may use a warm one."""
    options = dict(options)
    profile = bool(options.pop("profile", False))
    key = None
    if keep_warm and not options.get("checked"):
        opts = warm.options_key(options)
        if opts is not None:
            key = ("direct", id(layout.dev), id(f), layout.slot_bytes, x.shape, x.dtype.str, opts)
    schedule = warm.WARM.take(key) if key is not None else None
    if schedule is None:
        schedule = layout.direct_schedule(f, x, None, None, options)
    try:
        schedule.run(x_buffer, out_buffer, profile=profile)
        if report_to is not None:
            report_to["report"] = schedule.report() if profile else None
    except BaseException as exc:
        schedule.fail(exc)  # settled and closed; never masks exc
        raise
    if key is not None:
        warm.WARM.park(key, schedule)
    else:
        schedule.close()


def parallel_first_touch(arr: np.ndarray, workers: int) -> None:
    """Fault in a fresh array's pages on ``workers`` threads (one thread is ~8x slower on our
    H200 host: 284 vs 34 ms per GiB)."""
    flat = arr.reshape(-1).view(np.uint8)
    if workers <= 1 or flat.nbytes < (64 << 20):
        flat[::4096] = 0
        return
    step = -(-flat.nbytes // workers)
    with concurrent.futures.ThreadPoolExecutor(workers) as ex:
        list(ex.map(lambda a: flat[a:a + step].fill(0), range(0, flat.nbytes, step)))
