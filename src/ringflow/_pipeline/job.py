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
engines, and which kept engine fits; a job does that once. It holds its engine and, with
``host="register"``, keeps ``x`` and ``out`` pinned for its whole life instead of registering them
around every call. Only the contents of ``x`` may change between calls; the arrays themselves,
and ``out``, are fixed.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Callable, Optional

import numpy as np

from .._device import device_list, host_pool
from .._device.protocol import Device, close_quietly
from .._errors import warn_quietly
from . import warm
from .engine import Arrays, Engine, choose_engine, make_engine
from .frames import forget_own_frames
from .reentry import check_process, generation, marked, refuse_from_stage, running_stage_of
from .sigint import shielded
from .uncopyable import Uncopyable
from .whole_array import (STAGE_INSTEAD, check_arrays, check_on_device, check_pool_open, one_device, pinned_arrays,
                          plan_layout, refuse_inside, run_call)
from .validate import BoundArray, check_flag, check_options, check_unchanged

logger = logging.getLogger(__name__)


class _Held:
    """What a job holds that must be released: its engine, over several devices its shards' jobs,
    and its registrations. Shared with the job's finaliser, which must not refer to the job itself."""

    def __init__(self) -> None:
        self.engine: Optional[Engine] = None
        self.parts: list = []  # over several devices: the shards' jobs (the engine closes them too)
        self.registered: list = []

    def left(self) -> int:
        """How many things are still to release."""
        return (self.engine is not None) + len(self.parts) + len(self.registered)

    def release(self) -> None:
        """Close the engine, then the shards' jobs, then drop the registrations; each taken out
        once released, so that a release stopped half way goes on where it stopped when called
        again. A KeyboardInterrupt raised in the engine's close (a second Ctrl-C: the way out of
        a close that does not end) gives the engine up, but the shards' jobs and registrations,
        which pin host memory, are released on the way out all the same.

        Raises:
            KeyboardInterrupt, SystemExit: raised during the release (cleanup's own failures
                are warnings, :func:`close_quietly`).
        """
        engine = self.engine
        try:
            if engine is not None:
                close_quietly(engine, "MapJob engine")
        finally:
            self.engine = None
            try:
                while self.parts:  # (closed by the engine's close already, unless it was stopped: harmless again)
                    self.parts[0].close()
                    del self.parts[0]
            finally:
                while self.registered:
                    close_quietly(self.registered[-1], "registration")
                    del self.registered[-1]


def _refuse_replacing(name: str) -> None:
    """A job's ``x`` and ``out`` are fixed for its life: its chunks, rings and registrations are
    laid out over those very arrays.

    Raises:
        AttributeError: naming ``name`` and what to do instead.
    """
    instead = ("write the new contents into it (job.x[...] = new_x)" if name == "x" else
               "copy the result from it where it is needed (np.copyto(dest, job()))")
    raise AttributeError(f"a MapJob's {name} is the array it was made with and cannot be replaced (the job is laid "
                         f"out over that memory); {instead}, or make a new MapJob for another array")


def _fixed_array(name: str, doc: str) -> property:
    """A job's array ``name`` (kept as ``_name``), read-only: assigning it is refused
    (:func:`_refuse_replacing`)."""
    def get(job: "MapJob") -> np.ndarray:
        return getattr(job, "_" + name)

    def refuse(job: "MapJob", value: Any) -> None:
        _refuse_replacing(name)

    return property(get, refuse, doc=doc)


def _other_pools(x: np.ndarray, out: np.ndarray, devices: tuple) -> tuple:
    """``(name, device)`` for ``x`` and ``out`` where it is :mod:`ringflow.host` memory of a device
    not among the job's ``devices``: that device may close while the job lives, and its memory
    goes with it (a closed device of the job's own says so itself)."""
    found = []
    for name, arr in (("x", x), ("out", out)):
        owner = host_pool.device_of(arr)
        if owner is not None and all(owner is not dev for dev in devices):
            found.append((name, owner))
    return tuple(found)


def _collected(held: _Held, what: str) -> None:
    if held.left():
        warn_quietly(f"{what} was garbage-collected without close(); its streams, device memory and "
                     "registrations were released now. Use it as a context manager or call close()", ResourceWarning)
    held.release()


class MapJob(Uncopyable):
    """``f(x_chunk, y_chunk)`` over ``x`` into ``out``, as :func:`~ringflow.stream_map` with the
    same arguments, set up once; each call runs the whole array again.

    Every argument means what it means for :func:`~ringflow.stream_map` (``x`` must have at least
    one element); ``profile`` and ``keep_warm`` are not taken here: a job is profiled per call
    (``job(profile=True)``) and keeps its engine for its own life. A job that registers its
    arrays pins them once, at set-up, for all its calls, so ``host="auto"`` registers where one
    registered call is predicted faster than one staged call: the pinning is set-up, as the
    staged rings' allocation is (``stream_map`` weighs it within its one call).

    Over several devices (``device=`` a list, or ``"cuda:all"``) the job holds a single-device
    job per shard of rows, set up at once on every device, and each call runs them side by side;
    ``job.device`` is then the tuple of devices, ``job.strategy`` and ``job.engine`` are the
    shards' (``"mixed"`` where they differ), and :meth:`report` gives a ``ShardedReport``.

    ``graph=True`` (direct engine only: ``x`` and ``out`` pinned or registered) captures the
    first unprofiled call after the job's first call (which always runs ordinarily) as one CUDA
    graph and makes every later call one launch of it, so the host spends a few microseconds
    per call instead of per operation and small chunks cost little more than large ones. ``f``
    is then called only while capturing (once per chunk of that call), never in a replay: a
    replay runs the device work ``f`` enqueued, on the new contents of ``x``, but whatever ``f``
    read on the host (a global, a counter, a random number drawn there) keeps the value it had
    at the capture, and its side effects happen then only.
    So ``f`` must enqueue the same work on every call, write only into ``y`` and allocate
    nothing, and not synchronise. Allocating nothing means no temporaries: ``f`` writes into
    ``y``, views of it, or scratch arrays made outside ``f``, with ``out=`` or in place
    (``np.multiply(x, 2, out=y); y += 1`` rather than ``y[...] = x * 2 + 1``, whose ``x * 2``
    is a new device array). The simulated GPU keeps these rules: while capturing, ``f`` gets
    stand-ins for its arrays that record the numpy work done on them, and a replay runs that
    work without calling ``f``; ``f`` reading the data on the host (an ``if`` on its values,
    ``float()``, ``.item()``, ``np.asarray``) refuses the capture there, as the synchronisation
    it needs would on a GPU, and an operation making a new array (``x * 2``, ``x.copy()``,
    ``x.astype(...)``, a reduction without ``out=``, indexing with an array) refuses it once
    ``f`` returns, as the allocation does on a GPU. A capture the device refuses, an exception
    from ``f`` while capturing, or a framework allocation seen inside ``f``, is logged (logger
    ``ringflow``, with the reason) and the job goes on without a graph;
    :attr:`replays_graph` says which way the last call ran. A profiled call never replays (its
    timing events are per operation).

    Raises:
        TypeError, ValueError: a bad argument (the message names it and what it accepts).

    A call that fails (a stage error, a broken device, Ctrl-C) closes the job and raises; so does
    calling a closed job. A Ctrl-C that finds no step of the call left to stop at (after its last
    step, or during a graph's capture or replay, which run to their end) is raised as the call
    returns, the job open and ``out`` complete (:attr:`closed` says which). ``out``'s contents after a failed call are unspecified. ``close()`` (or
    leaving a ``with`` block) releases the streams, rings and any registration; it never raises.
    A job dropped without ``close()`` is released by its finaliser, with a ResourceWarning.
    """

    def __init__(self, f: Callable, x: np.ndarray, out: Optional[np.ndarray] = None, *,
                 device: "Device | str | None" = None, chunk_bytes: "int | str | None" = None, host: str = "auto",
                 x_buffer=None, out_buffer=None, engine: str = "auto", inplace: bool = False, slots=None,
                 workers: Optional[int] = None, checked: bool = False, on_error: str = "raise",
                 pinned_budget: "int | str | None" = None, compute_streams: Optional[int] = None, output: Any = None,
                 graph: bool = False):
        self._held = _Held()
        # one call at a time; close() from another thread waits for the call in progress, and
        # from inside it (f closing its own job) takes effect when the call ends
        self._lock = threading.RLock()
        self._close_pending = False
        self._handed: list = []  # what the last thread to hold the lock published (see _take_turn)
        self._made_in = generation()
        opts = check_options(chunk_bytes=chunk_bytes, allow_auto_chunk=True, inplace=inplace, slots=slots,
                             workers=workers, checked=checked, on_error=on_error, pinned_budget=pinned_budget,
                             compute_streams=compute_streams, graph=graph)
        out, fresh_out = check_arrays(f, x, out, host, engine, "MapJob", output, opts["inplace"])
        # f runs marked as this job's (on the calling thread, or on a shard's thread over several
        # devices), so a call of the job from inside it is refused instead of waiting for itself;
        # the mark is a token, not the job, which a reference from f would keep alive
        self._token = object()
        f = marked(self._token, "f", f)
        if x.shape[0] == 0 or x.size == 0:
            raise ValueError("MapJob needs at least one element in x; for an empty array call stream_map, "
                             "which returns at once")
        self._x, self._out = x, out
        self._arrays_bound = BoundArray(x), BoundArray(out)
        try:
            # a Ctrl-C waits for the set-up's checkpoints (or its end): one between the engine's
            # being made and its being held, or before the finaliser, would leave what was made
            # to the garbage collector; here it is released at once
            with shielded():
                many = device_list(device)
                if many is not None and len(many) > 1:  # a job per device over its rows (one list of one is one)
                    from .sharded import ShardedJob

                    sharded = ShardedJob.build(f, x, out, fresh_out, many, opts.pop("chunk_bytes"), host, x_buffer,
                                               out_buffer, engine, opts, part=MapJob._part)
                    self._layout, self.device, self.engine = sharded.layout, sharded.devices, sharded.layout.kind
                    self._arrays = Arrays(x, out)
                    self._held.parts = list(sharded.parts)
                    self._held.engine = sharded
                else:
                    dev = one_device(device, many, x, out, fresh_out)
                    self._bind(f, x, out, fresh_out, dev, opts.pop("chunk_bytes"), host, x_buffer, out_buffer,
                               engine, opts)
                self._note_devices(x, out)
                self._finalizer = weakref.finalize(self, _collected, self._held, repr(self))
                self._hand_over()  # the first call, on any thread, comes after the set-up (and what it took in)
        except BaseException:
            finalizer = getattr(self, "_finalizer", None)
            if finalizer is not None:
                finalizer.detach()
            self._held.release()
            raise

    def _bind(self, f, x, out, fresh_out: bool, dev: Device, chunk_bytes, host: str, x_buffer, out_buffer,
              engine: str, opts: dict) -> None:
        """Lay the job out on ``dev``, pin its arrays (``host="register"``; arrays from
        :mod:`ringflow.host` are pinned already and used as they are) and build its engine."""
        check_on_device(dev, x, out)
        # the job pins its arrays once for all its calls: host="auto" weighs one call
        layout, x_buffer, out_buffer, pooled = plan_layout(f, x, out, fresh_out, dev, chunk_bytes, host, x_buffer,
                                                           out_buffer, opts, engine=engine, pins_once=True)
        self._layout = layout
        self.device = layout.device
        opts = layout.engine_options(opts)
        self.engine = choose_engine(engine, layout.strategy, opts)
        if opts.get("graph") and self.engine != "direct":
            logger.warning("MapJob(graph=True) runs without a graph: only the direct engine (x and out pinned or "
                           "registered, host='register') captures one, and this job is on the %r engine with "
                           "host strategy %r", self.engine, layout.strategy)
        try:
            # pinned for the job's life: later calls pay no registration and no first touch
            self._held.registered, self._arrays = pinned_arrays(dev, layout.strategy, x, out, fresh_out, x_buffer,
                                                                out_buffer, pooled, opts.get("workers"))
            self._held.engine = warm.with_room(dev, lambda: make_engine(self.engine, f, layout, opts, self._arrays,
                                                                        bind=True))
        except STAGE_INSTEAD:
            self._held.release()
            if host != "auto":
                raise
            # "auto" chose to register memory that something else pins already, or that the host
            # could not pin: staged instead
            self._bind(f, x, out, fresh_out, dev, chunk_bytes, "stage", x_buffer, out_buffer, engine, opts)
        except BaseException:
            self._held.release()
            raise

    @classmethod
    def _part(cls, f, x, out, fresh_out: bool, dev: Device, chunk_bytes, host: str, engine: str,
              opts: dict) -> "MapJob":
        """A job on one device over arrays already checked: one shard of a job over several."""
        job = cls.__new__(cls)
        job._held = _Held()
        job._lock = threading.RLock()
        job._close_pending = False
        job._handed = []
        job._made_in = generation()
        job._token = object()  # f is marked with the whole job's token already
        job._x, job._out = x, out
        job._arrays_bound = BoundArray(x), BoundArray(out)
        job._bind(f, x, out, fresh_out, dev, chunk_bytes, host, None, None, engine, opts)
        job._note_devices(x, out)
        job._finalizer = weakref.finalize(job, _collected, job._held, repr(job))
        job._hand_over()
        return job

    x = _fixed_array("x", "The input array the job was made with; each call reads its current contents.")
    out = _fixed_array("out", "The array each call writes its result into, and returns.")

    @property
    def strategy(self) -> str:
        """How host memory reaches the copy engines: "stage", "register" or "pinned"."""
        return self._layout.strategy

    @property
    def chunks(self) -> int:
        """How many chunks each call runs (more from the second call on where the first found the
        job compute-bound and tapered its ends)."""
        return getattr(self._held.engine, "n_chunks", None) or self._layout.n_chunks

    @property
    def chunk_bytes(self) -> int:
        """Bytes per chunk (the last may be shorter)."""
        return self._layout.chunk_bytes

    def report(self):
        """The :class:`~ringflow.Report` of the last call made with ``profile=True`` (stage times,
        ideal bound, efficiency, trace and plot).

        Raises:
            RuntimeError: the job is closed or its last call was not profiled.
        """
        engine = self._held.engine
        if engine is None:
            raise RuntimeError("this MapJob is closed")
        return engine.report()

    @property
    def enqueue_seconds(self) -> Optional[float]:
        """Host time (s) the last call spent enqueueing its chunks (direct engine; virtual on the simulated
        GPU, as its other times are), else None."""
        return getattr(self._held.engine, "enqueue_seconds", None)

    @property
    def closed(self) -> bool:
        """Whether the job is closed: by :meth:`close`, or by a call that failed or was stopped by
        Ctrl-C; a closed job refuses calls (RuntimeError)."""
        return self._held.engine is None

    @property
    def replays_graph(self) -> bool:
        """Whether the last call was one launch of a captured graph (``graph=True``); over
        several devices, whether every shard's was."""
        engine = self._held.engine
        parts = getattr(engine, "parts", None)
        if parts is not None:
            return all(part.replays_graph for part in parts)
        return bool(getattr(engine, "replayed", False))

    def __call__(self, *arrays: Any, profile: bool = False) -> np.ndarray:
        """Run ``f`` over ``x``'s current contents.

        Args:
            arrays: none: a job runs over the ``x`` it was made with (a TypeError says so).
            profile: time this call's copies and kernels (and CPU stages) for :meth:`report`.

        Returns:
            ``out``, once every chunk's result is in it (every operation of the call has then
            completed: ``x`` may be rewritten).

        Raises:
            TypeError: arrays were given (write new contents into ``job.x`` instead).
            RuntimeError: the job is closed; ``f`` calls it (from within this call); it is called
                from inside work one of its devices runs (a compute on the simulated GPU: the job
                stays open); ``x`` or ``out`` is :mod:`ringflow.host` memory of another device,
                closed since (its memory went with it; the job stays open); or the job was made in
                a parent of this (forked) process.
            ValueError: ``x`` or ``out`` changed other than in its contents since the job was made
                (reshaped, retyped, moved by ``resize``, or ``out`` made read-only); the job
                stays open.
            StageError: a chunk failed; the job is then closed.
            DeviceError: the device broke; the job is then closed.
        """
        if arrays:
            raise TypeError(f"a MapJob call takes no arrays (got {len(arrays)}): each call runs over the x the job "
                            "was made with; write the new contents into it (job.x[...] = new_x) and call job(), "
                            "or call stream_map(f, new_x) for an array of its own")
        try:
            return self._call(profile)
        except BaseException as exc:
            # the error's traceback holds this frame and ringflow's below it: a caller keeping the
            # error keeps neither the job nor its arrays (frames.py)
            forget_own_frames(exc)
            del self
            raise

    def _call(self, profile: bool) -> np.ndarray:
        """:meth:`__call__`'s call, raising as it says."""
        profile = check_flag("profile", profile)
        check_process(self._made_in, "MapJob")
        # before the lock: over several devices f runs on a shard's thread while this call holds it
        refuse_from_stage(self._token, "MapJob()", kind="job")
        refuse_inside(self._devices, "MapJob()")
        with shielded() as shield, self._lock:  # Ctrl-C is taken inside the call's steps only (sigint.py)
            self._take_turn()
            engine = self._held.engine
            if engine is None:
                raise RuntimeError("this MapJob is closed; create a new one")
            self._check_arrays()
            try:
                run_call(engine, self._arrays, profile, shield)
            except BaseException:
                self._held.engine = None  # run_call closed it
                self._release()
                raise
            finally:
                if self._close_pending:
                    self._release()
                self._hand_over()
        return self.out

    def _note_devices(self, x: np.ndarray, out: np.ndarray) -> None:
        """Once the job is bound: the devices it runs on (``_devices``, one or a shard's each),
        and the other devices whose pool memory ``x`` or ``out`` is (``_other_pools``), which
        each call looks at."""
        self._devices = self.device if isinstance(self.device, tuple) else (self.device,)
        self._other_pools = _other_pools(x, out, self._devices)

    def _check_arrays(self) -> None:
        """Refuse a call on arrays that changed other than in their contents since the job was
        made (a job over several devices checks here, before any shard runs).

        Raises:
            ValueError: naming ``x`` or ``out`` (:func:`check_unchanged`).
            RuntimeError: ``x`` or ``out`` is pool memory of another device, closed since
                (:func:`check_pool_open`).
        """
        check_unchanged("x", self.x, self._arrays_bound[0])
        check_unchanged("out", self.out, self._arrays_bound[1], writeable=True)
        for name, owner in self._other_pools:
            if owner.closed:
                check_pool_open(name, getattr(self, name))

    def close(self) -> None:
        """Close the engine (streams, rings, workers) and drop the registrations, after the call
        in progress on another thread, if any, has returned; called from inside ``f``, when the
        call it runs in ends. In a child forked from the process that made the job, it only
        forgets the job (what it holds belongs to the parent). Harmless twice.

        Raises:
            KeyboardInterrupt: a Ctrl-C during the close, once everything is released; pressed
                again meanwhile, it stops an engine's close that does not end, but the shards'
                jobs and the registrations are still released (_Held.release). Nothing else.
        """
        if self._made_in != generation():
            self._finalizer.detach()
            self._held.engine, self._held.parts, self._held.registered = None, [], []
            return
        if running_stage_of(self._token) is not None:  # nothing may go before the call f runs in ends
            self._close_pending = True
            return
        with shielded(), self._lock:  # a Ctrl-C waits until all is released (sigint.py)
            interrupted, left, stalled = None, None, 0
            while True:
                try:
                    left = self._held.left()
                    self._take_turn()
                    self._release()
                    break
                except BaseException as exc:
                    # a second Ctrl-C is raised at once, wherever it lands (sigint.py): the
                    # release goes on where it stopped (_Held.release gives up only an engine's
                    # close it stopped), and the first interrupt is raised once all is released.
                    # Two passes in a row that release nothing end it: a close that keeps
                    # failing is not retried for ever.
                    if interrupted is None:
                        interrupted = exc
                    stalled = 0 if left is None or self._held.left() < left else stalled + 1
                    if stalled >= 2:
                        break
            if interrupted is not None:
                try:
                    raise interrupted
                finally:
                    del interrupted

    # The lock hands the job from one thread to the next; the devices' happens-before checkers
    # (on the simulated GPU) see that hand-off through a published token, as a Pipeline's
    # hand-offs between threads are seen: the next holder is ordered after everything the last
    # one saw complete. On a real GPU both calls do nothing.
    def _hand_over(self) -> None:
        devices = self.device if isinstance(self.device, tuple) else (self.device,)
        self._handed = [(d, d.publish()) for d in devices]

    def _take_turn(self) -> None:
        for device, token in self._handed:
            device.observe(token)

    def _release(self) -> None:
        with shielded() as shield:
            if shield is not None:
                # a Ctrl-C that came during the call or the close is raised once everything is
                # released: taken at a step of the engine's close (a staged engine drives its
                # pipeline to close it), it would stop that close half way, and over several
                # devices leave the later shards' jobs open
                shield.settle()
            self._held.release()
            # after the release: one stopped half way is still the finaliser's to finish
            self._finalizer.detach()
            for bound in self._arrays_bound:  # a closed job no longer keeps numpy from resizing them
                bound.release()

    def __enter__(self) -> "MapJob":
        return self

    def _not_copied(self, what: str) -> str:
        # a job holds its device's streams, rings and registrations over its arrays, in this
        # process: a pickle cannot carry them, and a copy would share them (closing either closes the other)
        return (f"a MapJob cannot be {what}: it holds its device's streams and memory, and any registration of its "
                f"arrays, in this process, and a second job over the same arrays would share them; make a MapJob "
                f"of its own where it is needed (rf.MapJob(f, x, ...), in the other process for a pickle), or pass "
                f"f and x themselves")

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._held.engine is None and hasattr(self, "_finalizer") else "open"
        return (f"<MapJob {self.x.shape} {self.x.dtype} in {self.chunks} chunks of {self._layout.chunk_bytes} "
                f"bytes, host={self.strategy}, engine={self.engine}, {state}>")
