"""A whole-array job bound once and run many times: :class:`MapJob`.

>>> import numpy as np, ringflow as rf
>>> def f(x, y):
...     y[:] = x * 2 + 1
>>> x = np.ones(1 << 16, np.float32)
>>> with rf.MapJob(f, x, device=rf.device("sim"), chunk_bytes=1 << 14) as job:
...     y = job()              # f over x's current contents, into job.out
...     x[:] = 3
...     y = job()              # again, on the new contents: no planning, no set-up
>>> bool((y == 7).all())
True

``stream_map`` works out, on every call, how to cut the arrays, how host memory reaches the copy
engines, and which kept pipeline fits; a job does that once. It holds its streams and rings and,
with ``host="register"``, keeps ``x`` and ``out`` pinned for its whole life instead of
registering them around every call (about 34 ms per GiB on our H200 host). Only the contents of
``x`` may change between calls; the arrays themselves, and ``out``, are fixed.

Two engines run a job. When the copy engines read ``x`` and write ``out`` in place (``host=
"register"``, or ``x_buffer``/``out_buffer``) nothing runs on the CPU between the copies, so by
default every call is enqueued in one pass with no scheduler (``engine="direct"``,
:mod:`ringflow._pipeline.direct`), as a hand-written CUDA program does. Staging (CPU copies on
worker threads) and ``on_error="continue"`` need the pipeline's scheduler (``engine="pipeline"``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from .._device.protocol import close_quietly
from . import direct
from .api import Pipeline, _default_workers
from .whole_array import _check_map_args, _layout_map, _register

class MapJob:
    """``f(x_chunk, y_chunk)`` over ``x`` into ``out`` (allocated if None), as :func:`stream_map`
    with the same arguments, set up once; each call runs the whole array again and returns
    ``out`` once every chunk's result is in it.

    ``engine``: "auto" (direct where it can run, see the module's doc), "direct" (ValueError
    saying why where it cannot) or "pipeline".

    A call that fails (a stage error, a broken device) closes the job and raises; so does
    calling a closed job. ``out``'s contents after a failed call are unspecified. ``close()`` (or
    leaving a ``with`` block) releases the streams, rings and any registration; it never raises."""

    def __init__(self, f: Callable, x: np.ndarray, out: Optional[np.ndarray] = None, *, device=None,
                 chunk_bytes: "int | str | None" = None, host: str = "auto", x_buffer=None, out_buffer=None,
                 engine: str = "auto", **pipeline_options: Any):
        if engine not in direct.ENGINES:  # before any work on the arrays
            raise ValueError(f"engine must be one of {direct.ENGINES}, got {engine!r}")
        out, fresh_out = _check_map_args(x, out, host, "MapJob")
        if x.shape[0] == 0 or x.size == 0:
            raise ValueError("MapJob needs at least one element in x; for an empty array call stream_map, "
                             "which returns at once")
        if "profile" in pipeline_options:
            raise ValueError("MapJob does not take profile=; profile one call with job(profile=True) and "
                             "read job.report()")
        if "keep_warm" in pipeline_options:
            raise ValueError("MapJob does not take keep_warm=: a job keeps its engine for its own life")
        self.x, self.out = x, out
        self._layout = layout = _layout_map(f, x, out, fresh_out, device, chunk_bytes, host, x_buffer, out_buffer,
                                            pipeline_options)
        self.device = layout.dev
        self.engine = direct.choose_engine(engine, layout.strategy, pipeline_options)
        self._registered: list = []
        self._runner: "direct.DirectSchedule | _PipelineRunner | None" = None
        try:
            if layout.strategy == "register":
                # pinned for the job's life: later calls pay no registration and no first touch
                self._registered = _register(layout.dev, x, out, fresh_out,
                                             pipeline_options.get("workers") or _default_workers(layout.dev))
                x_buffer, out_buffer = self._registered[0], self._registered[-1]
            if self.engine == "direct":
                self._runner = layout.direct_schedule(f, x, x_buffer, out_buffer, pipeline_options)
            else:
                pipe = layout.pipeline(f, *layout.host_rings(x_buffer, out_buffer), pipeline_options)
                self._runner = _PipelineRunner(pipe, layout.ranges)
        except BaseException:
            self.close()
            raise

    @property
    def strategy(self) -> str:
        """How host memory reaches the copy engines: "stage", "register" or "pinned"."""
        return self._layout.strategy

    @property
    def chunks(self) -> int:
        return self._layout.n_chunks

    def report(self):
        """The :class:`~ringflow._trace.report.Report` of the last call made with ``profile=True``
        (stage times, ideal bound, efficiency, trace and plot); RuntimeError if the last call was
        not profiled."""
        runner = self._runner
        if runner is None or self.engine != "direct":
            raise RuntimeError("report() needs an open job on the direct engine and a call with profile=True")
        return runner.report()

    @property
    def enqueue_seconds(self) -> Optional[float]:
        """Host time the last call spent enqueueing its chunks (direct engine), else None."""
        return getattr(self._runner, "enqueue_seconds", None)

    @property
    def closed(self) -> bool:
        return self._runner is None

    def __call__(self, *, profile: bool = False) -> np.ndarray:
        """Run ``f`` over ``x``'s current contents; returns ``out`` once every chunk's result is
        in it (every operation of the call has then completed: ``x`` may be rewritten).

        ``profile=True`` (direct engine) times this call's copies and kernels with events and keeps
        its timeline for :meth:`report`; an unprofiled call records no timing event."""
        runner = self._runner
        if runner is None:
            raise RuntimeError("this MapJob is closed; create a new one")
        if profile and self.engine != "direct":
            raise ValueError("job(profile=True) profiles the direct engine; this job runs on the pipeline "
                             "(staging or on_error='continue'): use stream_map_report for a profiled run")
        try:
            if profile:
                runner.run(profile=True)
            else:
                runner.run()
        except BaseException as exc:
            self._runner = None
            runner.fail(exc)  # settled and closed; never masks exc
            self._release_registrations()
            raise
        return self.out

    def close(self) -> None:
        """Close the engine (streams, rings, workers) and drop the registrations. Harmless
        twice; never raises."""
        runner, self._runner = self._runner, None
        if runner is not None:
            close_quietly(runner, "MapJob engine")
        self._release_registrations()

    def _release_registrations(self) -> None:
        registered, self._registered = self._registered, []
        for buf in registered:
            close_quietly(buf, "registration")

    def __enter__(self) -> "MapJob":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._runner is None else "open"
        return (f"<MapJob {self.x.shape} {self.x.dtype} in {self.chunks} chunks of {self._layout.slot_bytes} "
                f"bytes, host={self.strategy}, engine={self.engine}, {state}>")


class _PipelineRunner:
    """A job's pipeline, run over the whole array by each call."""

    def __init__(self, pipe: Pipeline, ranges: Callable):
        self.pipe, self.ranges = pipe, ranges

    def run(self) -> None:
        for _ in self.pipe.map(self.ranges()):
            pass

    def fail(self, exc: BaseException) -> None:
        self.pipe.__exit__(type(exc), exc, exc.__traceback__)  # cancel, settle, close; never masks exc

    def close(self) -> None:
        self.pipe.close()
