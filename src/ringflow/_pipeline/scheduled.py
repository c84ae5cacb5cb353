"""The scheduled engine: a whole-array job run by the pipeline's scheduler
(:class:`ScheduledEngine`), for jobs the direct engine cannot run the same — staging through
pinned rings on CPU workers, or ``on_error="continue"``.

Each chunk is the item ``(start, stop)`` of ``x``'s rows. Its prepare stage copies those rows
into a pinned slot (input staged) or only describes them (the copy engines read the caller's
pinned memory in place); its consume stage copies the result rows into ``out`` (result staged)
or does nothing (the copy engine wrote ``out`` in place). Each side is staged or used in place
on its own: a pool array on one side and ordinary memory on the other stage only the latter.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Optional

import numpy as np

from .. import _plan as plan
from .._device.protocol import close_quietly
from .._trace.report import memory_of
from .api import Pipeline
from .engine import Arrays
from .stages import is_interrupt


class ScheduledEngine:
    """A whole-array job on a :class:`~ringflow.Pipeline` built for its layout. Its stage
    callbacks are bound to one call's arrays at a time; a parked engine holds none.

    On the simulated GPU each chunk costs the scheduler the host time per chunk that the planner
    charges the job (``_plan.host_seconds_per_chunk`` with ``scheduler=True``: the figure for
    the sides it stages, one or both, else the unstaged one), as host work of its worker pool that
    the chunk's last pool task, or where it has none its copy in, comes after (see
    :class:`~.scheduler.Scheduler`). A real GPU's host spends its own."""

    def __init__(self, f: Callable, layout, options: dict, arrays: Arrays):
        self.f = f
        # whole chunks only: the caller's pinned memory is a ring whose slot i is chunk i's rows,
        # at i chunks' bytes (a taper's short chunks would not start there)
        self.layout = dataclasses.replace(layout, taper=())
        # the scheduler runs kernels on one compute stream and captures no graph: those direct
        # engine options mean nothing here
        self.options = {k: v for k, v in options.items() if k not in ("compute_streams", "graph")}
        self.device = layout.device
        self._arrays: Optional[Arrays] = None
        self.pipe: Optional[Pipeline] = self._new_pipeline(arrays, profile=False)

    def _stages(self, arrays: Arrays) -> tuple:
        """The prepare and consume stages (and the bytes a prepare copies) for ``arrays``."""
        x, out, layout = arrays.x, arrays.out, self.layout
        row_bytes, tail = layout.row_bytes, layout.tail
        staging_in, staging_out = layout.staged

        def prepare(item, raw):
            a, b = item
            if raw is not None:  # staging: copy the rows into the pinned slot
                dst = raw[:(b - a) * row_bytes].view(x.dtype).reshape((b - a,) + tail)
                np.copyto(dst, x[a:b])
            return (b - a,) + tail, x.dtype

        def consume(index, item, view):
            if staging_out:
                a, b = item
                out[a:b] = view

        item_nbytes = (lambda item: (item[1] - item[0]) * row_bytes) if staging_in else (lambda item: 0)
        return prepare, consume, item_nbytes

    def _host_rings(self, arrays: Arrays) -> tuple:
        """The caller's pinned memory behind the host rings, for each side not staged."""
        staging_in, staging_out = self.layout.staged
        return None if staging_in else arrays.x_buffer, None if staging_out else arrays.out_buffer

    def _new_pipeline(self, arrays: Arrays, *, profile: bool) -> Pipeline:
        prepare, consume, item_nbytes = self._stages(arrays)
        host_in, host_out = self._host_rings(arrays)
        layout = self.layout
        output = None
        if layout.reshaped:  # each chunk's result is its rows of out, shaped as out is
            out_tail, out_dtype = layout.out_tail, layout.out_dtype

            def output(item):
                return (item[1] - item[0],) + out_tail, out_dtype
        # the chunks cost the scheduler the host time the planner charges them (its predict_seconds
        # with the sides staged and scheduler=True, staged or not): the simulated GPU spends it too
        # (WorkerPool.host_work)
        host_s = plan.host_seconds_per_chunk(layout.device.hardware, layout.staged, scheduler=True)
        pipe = Pipeline._for_whole_array(self.f, prepare=prepare, consume=consume, item_nbytes=item_nbytes,
                                         host_in_buffer=host_in, host_out_buffer=host_out, host_s_per_chunk=host_s,
                                         max_chunks=layout.n_chunks, device=layout.device,
                                         chunk_bytes=layout.chunk_bytes, profile=profile, output=output,
                                         host_strides=(layout.in_chunk_bytes, layout.out_chunk_bytes),
                                         planned_bytes=(layout.in_chunk_bytes, layout.out_chunk_bytes),
                                         **self.options)
        self._arrays = arrays
        return pipe

    def run(self, arrays: Arrays, *, profile: bool = False) -> None:
        """Run every chunk through the pipeline; a profiled call gets a pipeline of its own (its
        report covers that call alone). See :class:`~.engine.Engine`."""
        pipe = self.pipe
        if pipe is None:
            raise RuntimeError("this engine is closed")
        if profile or pipe.config.profile:
            self.pipe = None
            pipe.close()
            pipe = self.pipe = self._new_pipeline(arrays, profile=profile)
        elif arrays is not self._arrays:
            pipe._rearm(*self._stages(arrays), *self._host_rings(arrays))
            self._arrays = arrays
        earlier = {id(err) for err in pipe.failures}
        for _ in pipe.map(self.layout.ranges()):
            pass
        # on_error="continue": map skipped the failed chunks; the call still fails, with the first,
        # or with the first KeyboardInterrupt or SystemExit itself (never inside a StageError, which
        # an except Exception would swallow), as on_error="raise" does
        failed = [err for err in pipe.failures if id(err) not in earlier]
        if failed:
            first = min(failed, key=lambda err: (not is_interrupt(err.__cause__), err.index))
            if is_interrupt(first.__cause__):
                first = first.__cause__
            # this frame is in first's traceback: no local may keep it once raised (a cycle)
            del failed
            try:
                raise first
            finally:
                del first

    @property
    def n_chunks(self) -> int:
        """The chunks a call runs (whole ones: never tapered, whatever the job's plan)."""
        return self.layout.n_chunks

    def chunk_rows(self, index: int) -> Optional[tuple[int, int]]:
        """The rows ``(start, stop)`` of ``x`` that chunk ``index`` held (its item), or None for
        an index the job does not have."""
        return next(itertools.islice(self.layout.ranges(), index, None), None) if index >= 0 else None

    def report(self):
        """The last profiled call's :class:`~ringflow.Report`. Raises RuntimeError if none."""
        if self.pipe is None or not self.pipe.config.profile:
            raise RuntimeError("no profiled call to report; run with profile=True first")
        return self.pipe.report()

    def fail(self, exc: BaseException) -> None:
        """After ``run`` raised ``exc``: cancel, settle and close; never raises or masks ``exc``."""
        pipe, self.pipe = self.pipe, None
        self._arrays = None
        if pipe is not None:
            pipe.__exit__(type(exc), exc, exc.__traceback__)
            # exc is on its way to the caller, and its traceback's frames hold this pipeline:
            # the failures it keeps (exc itself, or the StageError caused by it) must go
            pipe._forget_failures()

    def park(self) -> bool:
        """Forget the call's arrays; True if the pipeline can serve another call as it is."""
        self._arrays = None
        return self.pipe is not None and self.pipe._park()

    def held_bytes(self) -> tuple[int, int]:
        """As :meth:`~.engine.Engine.held_bytes`: the pipeline's rings of its own."""
        pipe = self.pipe
        if pipe is None:
            return 0, 0
        memory = memory_of(pipe.scheduler)
        return memory["pinned allocated"], memory["device allocated"]

    def close(self) -> None:
        """Close the pipeline (streams, rings, workers); harmless twice; never raises."""
        pipe, self.pipe = self.pipe, None
        self._arrays = None
        if pipe is not None:
            close_quietly(pipe, "pipeline")

    def forget_forked(self) -> None:
        """As :meth:`Engine.forget_forked`: the pipeline is forgotten (its finaliser too)."""
        pipe, self.pipe = self.pipe, None
        self._arrays = None
        if pipe is not None:
            pipe._forget_if_forked()

    @property
    def closed(self) -> bool:
        return self.pipe is None
