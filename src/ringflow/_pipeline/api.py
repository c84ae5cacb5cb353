"""The pipeline: :class:`Pipeline` (five overlapped stages, a stream of items) and how its rings
are sized (:func:`resolve_slots`, :func:`fit_pinned_budget`) and its workers counted.

>>> import numpy as np, ringflow as rf
>>> def f(x, y):              # runs on the device: y[:] = 2x + 1
...     y[:] = x * 2 + 1
>>> items = [np.random.rand(1000).astype(np.float32) for _ in range(8)]
>>> with rf.Pipeline(f, device=rf.device("sim"), chunk_bytes=1 << 14) as pipe:
...     results = list(pipe.map(items))
>>> all(np.array_equal(r, a * 2 + 1) for r, a in zip(results, items))
True

Whole arrays (``stream_map``, ``MapJob``) are cut and moved by :mod:`ringflow._pipeline.whole_array`.

Progress happens inside the calls made on a pipeline (``map``, ``submit``, ``close``,
``cancel`` and waiting on a returned future); no background thread runs the scheduler.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import warnings
from typing import Any, Callable, Iterable, Iterator, Optional

import numpy as np

from .._device import device as make_device
from .._device.protocol import Device
from .._errors import StageError
from .chunk import Chunk, ChunkFuture
from .config import PipelineConfig, SlotCounts
from .scheduler import Scheduler
from .states import ChunkState
from .stats import PipelineStats
from .._trace import nvtx
from .._trace.report import Report, memory_of
from .._trace.timeline import Anchor, Span, Timeline, record_chunk, stall_spans

DEFAULT_CHUNK_BYTES = 8 << 20


def _copy_array_in(arr: np.ndarray, raw: np.ndarray, slot_bytes: int, parameter: str = "chunk_bytes") -> tuple:
    if arr.nbytes > slot_bytes:
        raise ValueError(f"an item of {arr.nbytes} bytes (shape {arr.shape}, {arr.dtype}) does not fit a slot of "
                         f"{slot_bytes} bytes; raise {parameter} to at least {arr.nbytes} or split the item")
    dst = raw[:arr.nbytes].view(arr.dtype).reshape(arr.shape)
    np.copyto(dst, arr, casting="no")
    return arr.shape, arr.dtype


def _copy_out(index: int, item: Any, view: np.ndarray) -> np.ndarray:
    return np.array(view, copy=True)


def resolve_slots(device: Device, slots, slot_bytes: int, inplace: bool, workers: int, compute: Callable,
                  external=(False, False), bulk: bool = False, max_chunks: Optional[int] = None) -> SlotCounts:
    """The slot counts: given, or planned from modelled stage times (device rings with slack).
    ``bulk`` (a whole array, stream_map): staging rings also get a slot per worker, for
    throughput; a stream of requests keeps the planned rings, whose shorter queues keep
    latency down. A job of known length (``max_chunks``, a whole array) never gets more slots in a
    ring than it has chunks, unless ``slots`` says so."""
    if isinstance(slots, SlotCounts):
        return slots
    if isinstance(slots, bool):
        raise TypeError("slots must be None, an int or a SlotCounts")
    if isinstance(slots, int):
        return SlotCounts(slots, slots, 0 if inplace else slots, slots)
    if slots is not None:
        raise TypeError(f"slots must be None, an int or a SlotCounts, got {type(slots).__name__}")
    from .. import _plan as plan

    profile = getattr(device, "profile", "h200-pcie5")
    sim = getattr(compute, "sim_seconds", None)
    guess = sim(slot_bytes) if callable(sim) else sim
    times = plan.model_stage_times(profile, slot_bytes, compute=guess, workers=workers)
    if guess is None:  # unknown compute: plan for one as long as a copy (a balanced pipeline)
        times = dataclasses.replace(times, compute=max(times.compute, times.h2d))
    # the caller's pinned memory: prepare and consume only describe the chunk
    overhead = plan.get_profile(profile).host_task_overhead_s
    if external[0]:
        times = dataclasses.replace(times, prepare=overhead)
    if external[1]:
        times = dataclasses.replace(times, consume=overhead)
    counts = plan.with_device_slack(plan.plan_slots(times, inplace=inplace).slots, inplace=inplace)
    if bulk and not external[0] and not external[1]:  # both host rings are staging rings
        counts = plan.with_worker_slots(counts, workers, slot_bytes)
    if max_chunks is not None:
        counts = SlotCounts(*(min(c, max_chunks) if c else 0 for c in
                              (counts.host_in, counts.device_in, counts.device_out, counts.host_out)))
    return counts


class Pipeline:
    """Five overlapped stages with per-buffer ownership, backpressure and cancellation.

    ``compute(x, y)`` runs on the device with ``x`` the chunk's input and ``y`` an output of
    the same shape and dtype (device arrays: numpy on the simulated GPU, CuPy or PyTorch on a
    real one); it must write ``y`` (with ``inplace=True`` it gets the same array twice).
    ``prepare(item) -> ndarray`` (CPU) turns an item into the array to send (default: the item
    itself); ``consume(index, item, result) -> value`` (CPU) gets a read-only view of the
    result valid only during the call (default: a copy of it). A compute callable may carry a
    ``sim_seconds`` attribute (seconds, or a function of the chunk's bytes) for its duration on
    the simulated GPU.

    ``slots`` (None: derived by :mod:`ringflow._plan`; an int for every ring; or a
    :class:`SlotCounts`) and ``chunk_bytes`` (the slot size) bound pinned memory at
    ``(slots.host_in + slots.host_out) * chunk_bytes``, which ``pinned_budget`` (bytes) caps: planned
    slots shrink to fit it, explicit ones that do not fit are refused. At most ``max_in_flight`` accepted
    chunks are unfinished (including results a ``map`` has not handed out yet); ``submit``
    blocks while that many are, and ``map`` pulls input only as capacity frees up.
    """

    def __init__(self, compute: Callable, *, device: "Device | str | None" = None, prepare: Optional[Callable] = None,
                 consume: Optional[Callable] = None, slots: "int | SlotCounts | None" = None,
                 chunk_bytes: Optional[int] = None, max_in_flight: Optional[int] = None, ordered: bool = True,
                 on_error: str = "raise", profile: bool = False, workers: Optional[int] = None,
                 inplace: bool = False, checked: bool = False, item_nbytes: Optional[Callable] = None,
                 pinned_budget: Optional[int] = None, _disabled_guards: Iterable[str] = (), _fill=None, _drain=None, _slot_hook=None,
                 _host_in_buffer=None, _host_out_buffer=None, _max_chunks: Optional[int] = None,
                 _bulk: bool = False):
        if not callable(compute):
            raise TypeError(f"compute must be a callable f(x, y), got {type(compute).__name__}")
        self.device = make_device(device) if not isinstance(device, Device) else device
        slot_bytes = int(chunk_bytes) if chunk_bytes is not None else DEFAULT_CHUNK_BYTES
        if slot_bytes < 1:
            raise ValueError(f"chunk_bytes must be a positive number of bytes, got {chunk_bytes}")
        if workers is None:
            workers = _default_workers(self.device, bulk=_bulk)
        counts = resolve_slots(self.device, slots, slot_bytes, inplace, workers, compute,
                               external=(_host_in_buffer is not None, _host_out_buffer is not None), bulk=_bulk,
                               max_chunks=_max_chunks)
        if pinned_budget is not None:
            counts = fit_pinned_budget(counts, slot_bytes, int(pinned_budget), explicit=slots is not None)
        if max_in_flight is None:
            max_in_flight = counts.host_in + counts.device_in + counts.device_out + counts.host_out
        self.config = PipelineConfig(slot_bytes=slot_bytes, slots=counts, max_in_flight=max_in_flight,
                                     workers=workers, inplace=inplace, ordered=ordered, on_error=on_error,
                                     profile=profile, checked=checked)
        self._prepare = prepare
        fill = _fill or self._default_fill
        self._items_are_arrays = _fill is None and prepare is None  # sizes known before acceptance
        drain = _drain or (consume if consume is not None else _copy_out)
        if profile:
            fill, drain = nvtx.ranged(fill, "prepare"), nvtx.ranged(drain, "consume")
        self._closed = False
        self._timeline = Timeline(meta={"device": self.device.name, "chunk_bytes": slot_bytes,
                                        "slots": counts.__dict__, "workers": workers}) if profile else None
        self._anchor = None
        self._sched = Scheduler(self.device, compute, fill, drain, self.config,
                                item_nbytes=item_nbytes or (lambda item: getattr(item, "nbytes", 0)),
                                disabled_guards=_disabled_guards, slot_hook=_slot_hook,
                                on_chunk_end=self._on_chunk_end, host_in_buffer=_host_in_buffer,
                                host_out_buffer=_host_out_buffer)
        if profile:
            self._anchor = Anchor(self.device, self._sched.h2d_stream)

    # -- set-up -------------------------------------------------------------------------------
    def _default_fill(self, item: Any, raw: np.ndarray) -> tuple:
        arr = self._prepare(item) if self._prepare is not None else item
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"prepare must return a numpy array, got {type(arr).__name__}")
        return _copy_array_in(arr, raw, self.config.slot_bytes)

    def _check_item(self, item: Any) -> None:
        """Refuse, before acceptance, an item that can never fit (when its size is known)."""
        if self._items_are_arrays:
            if not isinstance(item, np.ndarray):
                raise TypeError(f"items must be numpy arrays (or pass prepare=), got {type(item).__name__}")
            if item.nbytes > self.config.slot_bytes:
                raise ValueError(f"an item of {item.nbytes} bytes (shape {item.shape}, {item.dtype}) does not fit "
                                 f"a slot of {self.config.slot_bytes} bytes; raise chunk_bytes to at least "
                                 f"{item.nbytes} or split the item")

    # -- submitting and mapping ---------------------------------------------------------------
    def submit(self, item: Any, timeout: Optional[float] = None) -> ChunkFuture:
        """Accept one item; blocks while ``max_in_flight`` chunks are unfinished.

        Returns a future whose result is the consumer's value; raises TimeoutError if no
        capacity frees up within ``timeout`` seconds of the device's host clock (virtual seconds
        on the simulated GPU), ValueError for an item that cannot fit."""
        self._check_open()
        self._check_item(item)
        s = self._sched
        t0 = self.device.now
        blocked = not s.has_capacity()
        s.run_until(lambda: s.has_capacity() or not s.accepting or s.broken is not None, timeout)
        if blocked:
            self._stall("stall: producer", "producer blocked by backpressure", t0)
        return s.accept(item).future

    def map(self, items: Iterable[Any]) -> Iterator[Any]:
        """Results of ``items`` (ordered unless ``ordered=False``), pulling input only as capacity
        frees up. With ``on_error="raise"`` the first failure cancels the rest and is raised here
        (once, as StageError); with ``"continue"`` failed items are skipped (see ``failures``).
        Raises RuntimeError at once (not when iterated) on a closed pipeline."""
        self._check_open()
        return self._map(items)

    def _map(self, items: Iterable[Any]) -> Iterator[Any]:
        self._check_open()  # again: the pipeline may have closed before the first next()
        s = self._sched
        source = iter(items)
        pending: collections.OrderedDict[int, Chunk] = collections.OrderedDict()
        exhausted = started = False
        try:
            while True:
                while not exhausted and s.has_capacity():
                    try:
                        item = next(source)
                    except StopIteration:
                        exhausted = True
                        break
                    try:
                        self._check_item(item)
                    except (TypeError, ValueError):
                        self._settle_after_error()
                        raise
                    chunk = s.accept(item)
                    chunk.in_map = True
                    pending[chunk.index] = chunk
                    if not started:
                        # start the device on the first chunk now; the rest are accepted while
                        # its copy runs (accepting a chunk costs a few microseconds each)
                        started = True
                        s.step()
                chunk = self._next_ready(pending)
                if chunk is not None:
                    del pending[chunk.index]
                    s.unclaimed -= 1
                    if chunk.state is ChunkState.DELIVERED:
                        yield chunk.value
                    elif chunk.state is ChunkState.FAILED:
                        # with "continue" a chunk's own StageError is skipped even once the device
                        # broke; a chunk the broken device ended raises that device error
                        if self.config.on_error == "raise" or (s.broken is not None and chunk.error is s.broken):
                            self._settle_after_error()
                            raise chunk.error
                    else:  # cancelled: the pipeline was cancelled (or failed) under this map
                        self._settle_after_error()
                        if s.first_error is not None and self.config.on_error == "raise":
                            raise s.first_error
                        return
                    continue
                if not pending and exhausted:
                    return
                if not pending and not s.accepting:
                    # input is left but the pipeline takes no more (cancelled, closed, stopped by an
                    # error or a broken device): nothing could ever arrive, so do not wait for it
                    if s.broken is not None:
                        raise s.broken
                    if not started:
                        raise RuntimeError("the pipeline no longer accepts work (it was closed, cancelled or "
                                           "stopped by an error); create a new Pipeline")
                    if s.first_error is not None and self.config.on_error == "raise":
                        raise s.first_error
                    return
                t0 = self.device.now
                # also stop waiting if the pipeline stops taking work meanwhile (a failure, a broken
                # device) while nothing of this map is pending: no capacity would ever come
                s.run_until(lambda: self._next_ready(pending) is not None
                            or (not exhausted and (s.has_capacity() or (not pending and not s.accepting))))
                if self._next_ready(pending) is not None:
                    self._stall("stall: consumer", "consumer waiting for data", t0)
                else:
                    self._stall("stall: producer", "producer blocked by backpressure", t0)
        finally:
            for chunk in pending.values():  # the caller stopped early: stop tracking these
                chunk.in_map = False
                if chunk.state.final:
                    s.unclaimed -= 1

    def _next_ready(self, pending: "collections.OrderedDict[int, Chunk]") -> Optional[Chunk]:
        if not pending:
            return None
        if self.config.ordered:
            head = next(iter(pending.values()))
            return head if head.state.final else None
        for chunk in pending.values():
            if chunk.state.final:
                return chunk
        return None

    def _on_chunk_end(self, chunk: Chunk) -> None:
        if getattr(chunk, "in_map", False):
            self._sched.unclaimed += 1
        if self._timeline is not None:
            self._timeline.records.append(record_chunk(chunk, self._anchor))
            self._timeline.stalls.extend(stall_spans(chunk.stamps, chunk.index))

    def _stall(self, track: str, name: str, start: float) -> None:
        """Record that the caller was blocked from ``start`` until now."""
        if self._timeline is not None:
            end = self.device.now
            if end > start:
                self._timeline.stalls.append(Span(track, name, start, end))

    def _settle_after_error(self) -> None:
        if self.config.on_error == "raise":
            self._sched.cancel_pending()
        self._sched.settle()

    # -- ending ----------------------------------------------------------------------------------
    def cancel(self) -> None:
        """Stop admission; chunks not yet on a stream end CANCELLED at once; enqueued chunks
        end CANCELLED once their events complete (their slots are released only then).
        Returns with ``stats().in_flight == 0``. Harmless to call twice."""
        if self._closed:
            return
        self._sched.cancel_pending()
        self._sched.settle()

    def close(self) -> None:
        """Finish every accepted chunk, then release rings, streams and workers. Harmless twice."""
        if self._closed:
            return
        try:
            self._sched.accepting = False
            self._sched.settle()
        finally:
            self._closed = True
            self._sched.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Pipeline is closed; create a new one to submit more work")

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and not self._closed:
            try:
                self.cancel()
            except Exception as err:  # noqa: BLE001 - never mask the user's exception
                warnings.warn(f"cancelling the pipeline after an error failed: {err!r}", RuntimeWarning)
            finally:
                try:
                    self._closed = True
                    self._sched.close()
                except Exception:  # noqa: BLE001
                    pass
            return
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_closed", True):
            return
        if getattr(self, "_sched", None) is not None and self._sched.chunks:
            warnings.warn("a Pipeline with work in flight was garbage-collected; cancelling it. "
                          "Use it as a context manager or call close()", ResourceWarning)
        try:
            self.cancel()
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass
        try:
            self._closed = True
            self._sched.close()
        except Exception:  # noqa: BLE001
            pass

    # -- kept warm between stream_map calls (ringflow._pipeline.warm) -------------------------------
    def _park(self) -> bool:
        """Forget the finished job and report whether this pipeline can be kept for another."""
        s = self._sched
        if self._closed or self._timeline is not None or not s.idle():
            return False
        s.park()
        return True

    def _rearm(self, fill, drain, item_nbytes, host_in_buffer=None, host_out_buffer=None) -> None:
        self._sched.rearm(fill, drain, item_nbytes, host_in_buffer=host_in_buffer, host_out_buffer=host_out_buffer)

    # -- introspection ---------------------------------------------------------------------------
    def stats(self) -> PipelineStats:
        return self._sched.stats()

    @property
    def failures(self) -> list[StageError]:
        """Every StageError so far (with ``on_error="continue"`` map skips these items)."""
        return list(self._sched.failures)

    @property
    def scheduler(self) -> Scheduler:
        return self._sched

    def report(self) -> Report:
        """Stage times, bottleneck, ideal bound, efficiency, latency, stalls and memory of the
        chunks finished so far; needs ``profile=True``."""
        if self._timeline is None:
            raise RuntimeError("report() needs a pipeline made with profile=True")
        return Report.build(self._timeline, workers=self.config.workers, memory=memory_of(self._sched),
                            host_seconds=self._sched.host_seconds)


def fit_pinned_budget(counts: SlotCounts, slot_bytes: int, budget: int, *, explicit: bool) -> SlotCounts:
    """Slot counts whose pinned rings (host-in + host-out) fit ``budget`` bytes.

    Planned counts shrink, the larger ring first (the pipeline then runs below its bottleneck
    rate, never above its memory); counts the caller gave explicitly are refused instead."""
    def pinned(c: SlotCounts) -> int:
        return (c.host_in + c.host_out) * slot_bytes

    if pinned(counts) <= budget:
        return counts
    if explicit or 2 * slot_bytes > budget:
        raise ValueError(f"the pinned rings need {pinned(counts)} bytes ({counts.host_in} host-in + {counts.host_out} "
                         f"host-out slots of {slot_bytes} bytes) but pinned_budget is {budget}; raise pinned_budget, "
                         "lower chunk_bytes, or give fewer slots")
    while pinned(counts) > budget:
        ring = "host_in" if counts.host_in >= counts.host_out else "host_out"
        counts = counts.minus(ring)
    return counts


def _default_workers(dev: Device, bulk: bool = True) -> int:
    """CPU workers for prepare/consume.

    A whole-array job (``bulk``: stream_map) splits one large copy over many chunks at once:
    staging copies release the GIL and scale to ~16 threads on our H200 host (10 GB/s on one,
    41 GB/s on 16: DESIGN.md section 6), so it gets a worker per core but one, which is left
    to the scheduler on the caller's thread (with a worker on every core it waits for a core
    at each hand-off; measured, 1 GiB staged: 15 workers 87 ms, 16 workers 93).

    A stream of requests (``Pipeline.submit``/``map``) has only a few chunks in its host
    stages at a time, and every busy worker competes with the scheduler for the GIL at each of
    its hand-offs: on the H200 the ``requests`` workload's p99 at 80% load was 3.4-4.3x its
    isolated p99 with 15 workers (three runs) and 1.6-2.1x with 4 (three runs), with 2-3 no
    better than 4 (``bench/results/diagnose-requests-h200-2026-11-30-s3-open-loop.txt``,
    ``bench-h200-2026-11-30-s3-requests-4workers-run*.json``), so it gets at most 4."""
    if dev.backend == "sim":
        return 4
    cores = max(1, min(16, (os.cpu_count() or 2) - 1))
    return cores if bulk else min(4, cores)
