"""The ``feed`` workload of ``ringflow bench``: batches of images fed to a model on the GPU.

Each batch is ``batch`` uint8 images of 3 x ``size`` x ``size``, made on CPU workers by a
decode/augment stand-in (:meth:`ImageBatches.decode_augment`: a crop, a flip and a brightness
look-up per image, all numpy work that lets go of the GIL), copied to the GPU as uint8,
normalised there to float16 (:func:`normalise`) and handed, on the device, to a model step
(:func:`model_step`: a fixed float16 matmul of the flattened batch). Two systems do the same
work in the same run:

* ringflow: ``rf.Pipeline(normalise, prepare=decode_augment, workers=N, output=(shape,
  "float16"), deliver="device")``, the consumer running the model step on each delivered
  device array and releasing it;
* PyTorch's ``DataLoader(pin_memory=True, num_workers=N)`` with ``.cuda(non_blocking=True)``,
  ``normalise`` in torch and the same model step.

Reported per system: batches per second, its fraction of the bound set by the slowest stage
measured alone (the CPU work per batch over N workers, the H2D copy of a batch, the GPU's
normalise and model step), and the GPU's idle time between model steps (from timing events
around each step: the sum of the gaps over the span from the first step's start to the last
one's end). Every delivered batch of a checking pass is copied back and compared bit for bit
with numpy.

On the simulated GPU the torch rows are skipped with the reason and the model step is
launched on a stream of the simulated device.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import math
import multiprocessing
import os
import time
from typing import Any, Callable, Iterable, Optional

import numpy as np

import ringflow as rf

from .._device.protocol import Device
from .baselines import BaselineUnavailable, _torch
from .measure import Timing
from .workloads import _baseline, _gpu_only, _row, _skip

Row = dict[str, Any]
Span = tuple[float, float]

# Normalisation constants exactly representable in float16 (a power-of-two scale, a mean with
# one fractional bit): every step of (x - MEAN) * INV_STD on a uint8 x is exact, so numpy, CuPy
# and PyTorch give the same bits whatever precision they compute in and however they round.
MEAN = 114.5
INV_STD = 1.0 / 64

# The simulated GPU does not time Python: each decode/augment there charges this much virtual
# CPU time per byte of the batch it makes (a modelled cost, so the CPU stage has one on the sim).
SIM_CPU_SECONDS_PER_BYTE = 3e-9

RINGFLOW = "ringflow Pipeline(prepare=decode_augment, deliver='device')"
RINGFLOW_PROCESSES = "ringflow Pipeline(prepare=decode_augment, deliver='device', processes=True)"
DATALOADER = "torch DataLoader(pin_memory=True, num_workers=N) + .cuda(non_blocking=True)"
STAGES = ("cpu_decode_augment", "h2d_copy", "gpu_normalise_model")


def default_workers() -> int:
    """CPU workers for each system: half the host's CPUs (the rest run the consumer loop, the
    pipeline's progress thread and the DataLoader's pinning thread), between 1 and 8."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


# -- the work ----------------------------------------------------------------------------------
class ImageBatches:
    """Batches of ``batch`` uint8 images of 3 x ``size`` x ``size``, each made from a fixed
    pseudo-encoded source (``sources`` of them, used in turn) by :meth:`decode_augment`.

    Args:
        batch: images per batch.
        size: height and width of an image after cropping, in pixels.
        sources: how many distinct source batches there are (batch ``i`` reads ``i % sources``).
        seed: the seed of the sources and of every batch's augmentation.
        in_slot: make each batch with ``ringflow.host.empty_slot`` (in a pipeline's pinned slot);
            False makes it in a new array, as a loader written without ringflow would.
    """

    def __init__(self, batch: int, size: int, *, sources: int = 4, seed: int = 0, in_slot: bool = True):
        if batch < 1 or size < 1 or sources < 1:
            raise ValueError(f"batch, size and sources must be at least 1, got {batch}, {size}, {sources}")
        self.batch, self.size, self.seed = int(batch), int(size), int(seed)
        self.in_slot = bool(in_slot)
        self.pad = max(2, self.size // 7)  # the room a random crop moves in
        rng = np.random.default_rng(seed)
        full = (self.batch, 3, self.size + self.pad, self.size + self.pad)
        self.sources = [rng.integers(0, 256, full, dtype=np.uint8) for _ in range(sources)]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The shape of one batch: (batch, 3, size, size)."""
        return (self.batch, 3, self.size, self.size)

    @property
    def nbytes(self) -> int:
        """Bytes of one uint8 batch (what crosses the link)."""
        return math.prod(self.shape)

    @property
    def features(self) -> int:
        """Values per image (3 x size x size): the model step's input width."""
        return 3 * self.size * self.size

    def decode_augment(self, index: int) -> np.ndarray:
        """Batch ``index``: per image a random crop of its source, a random horizontal flip and
        a random brightness change through a look-up table; the same for the same index.

        Returns:
            a C-contiguous uint8 array of :attr:`shape`: made in the pinned slot of the batch
            when a pipeline's prepare runs this (``ringflow.host.empty_slot``), else a new array.
        """
        rng = np.random.default_rng((self.seed, int(index)))
        src = self.sources[int(index) % len(self.sources)]
        top, left = rng.integers(0, self.pad + 1, (2, self.batch))
        flip = rng.random(self.batch) < 0.5
        luts = np.clip(np.arange(256) * rng.uniform(0.6, 1.4, (self.batch, 1)), 0, 255).astype(np.uint8)
        out = rf.host.empty_slot(self.shape, np.uint8) if self.in_slot else np.empty(self.shape, np.uint8)
        s = self.size
        for j in range(self.batch):
            crop = src[j, :, top[j]:top[j] + s, left[j]:left[j] + s]
            out[j] = luts[j][crop[:, :, ::-1] if flip[j] else crop]
        return out

    def expected(self, index: int) -> np.ndarray:
        """What the device must deliver for batch ``index``: :func:`normalise` of it in numpy
        (float16 of :attr:`shape`)."""
        y = np.empty(self.shape, np.float16)
        normalise(self.decode_augment(index), y)
        return y


def charged(images: ImageBatches, index: int) -> np.ndarray:
    """:meth:`ImageBatches.decode_augment`, charging the simulated GPU's clock its modelled CPU
    time (:data:`SIM_CPU_SECONDS_PER_BYTE`; nothing outside a simulated host task)."""
    from .._device.sim import charge

    out = images.decode_augment(index)
    charge(out.nbytes * SIM_CPU_SECONDS_PER_BYTE)
    return out


def normalise(x, y) -> None:
    """``y = (x - MEAN) * INV_STD`` in ``y``'s dtype (float16), with array methods only, so the
    same function runs on numpy, CuPy and PyTorch arrays (ringflow's compute and the torch
    baseline alike)."""
    y[...] = x
    y -= MEAN
    y *= INV_STD


def model_step(x, w, out) -> None:
    """The model stand-in: ``out = x.reshape(batch, -1) @ w`` (float16; numpy, CuPy or PyTorch)."""
    out[...] = x.reshape(x.shape[0], -1) @ w


def model_weights(features: int, hidden: int) -> np.ndarray:
    """The model step's fixed float16 weights, (features, hidden), scaled so outputs stay small."""
    rng = np.random.default_rng(7)
    return (rng.uniform(-1.0, 1.0, (features, hidden)) / math.sqrt(features)).astype(np.float16)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two float16 arrays have the same shape and the same bits (-0.0 is not 0.0)."""
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(np.uint16), b.view(np.uint16))


# -- the arithmetic --------------------------------------------------------------------------------
def gpu_idle(spans: list[Span]) -> Optional[float]:
    """The GPU's idle fraction between model steps.

    Args:
        spans: (start, end) of each model step, in seconds on one clock, in launch order.

    Returns:
        the sum of the gaps between one step's end and the next one's start over the span from
        the first start to the last end (0 to 1); None with fewer than two steps.
    """
    if len(spans) < 2:
        return None
    gaps = sum(max(0.0, start - end) for (_, end), (start, _) in zip(spans, spans[1:]))
    total = spans[-1][1] - spans[0][0]
    return gaps / total if total > 0 else 0.0


def stage_bound(stage_seconds: dict[str, float]) -> dict[str, Any]:
    """The throughput bound of stages that overlap: the slowest one's time per batch.

    Args:
        stage_seconds: each stage's time per batch measured alone (seconds).

    Returns:
        ``stage_ms`` (each stage, ms per batch), ``bound_ms`` (the largest), ``bound_stage`` (its
        name) and ``bound_batches_per_s`` (1 / the largest).

    Raises:
        ValueError: no stages, or a stage time that is not positive.
    """
    if not stage_seconds or any(not s > 0 for s in stage_seconds.values()):
        raise ValueError(f"need at least one stage, each with a positive time, got {stage_seconds!r}")
    slowest = max(stage_seconds, key=stage_seconds.get)
    return {"stage_ms": {k: v * 1e3 for k, v in stage_seconds.items()}, "bound_ms": stage_seconds[slowest] * 1e3,
            "bound_stage": slowest, "bound_batches_per_s": 1.0 / stage_seconds[slowest]}


def fraction_of_bound(row: Row, bound: dict[str, Any]) -> Optional[float]:
    """A measured row's batches per second over the bound's (None for a skipped row)."""
    rate = row.get("batches_per_s")
    return None if rate is None else rate / bound["bound_batches_per_s"]


# -- the device side: the model step, its timing events, reading back ------------------------------
class _ModelSide:
    """Where the model step runs, for both systems: ``stream`` (what results are released on),
    ``clock`` (the host clock, seconds) and the backend's ``mark``/``seconds``/``sync``/
    ``launch_model``/``launch_normalise``/``scratch``/``read``."""

    stream: Any = None
    clock: Callable[[], float]

    def __init__(self) -> None:
        self._steps: list = []

    def step(self, x) -> None:
        """Enqueue the model step on ``x`` (a device batch) between two timing events."""
        start = self.mark()
        self.launch_model(x)
        self._steps.append((start, self.mark()))

    def finish(self) -> list[Span]:
        """Wait for every step enqueued since the last call; their (start, end) in seconds from
        the first one's start."""
        self.sync()
        steps, self._steps = self._steps, []
        if not steps:
            return []
        first = steps[0][0]
        return [(self.seconds(first, a), self.seconds(first, b)) for a, b in steps]

    def gpu_stage_seconds(self, reps: int) -> float:
        """The GPU's time per batch for normalise and the model step alone (``reps`` of them back
        to back on one stream, after one untimed), in seconds."""
        x, y = self.scratch()
        self.launch_normalise(x, y)
        self.launch_model(y)
        self.sync()
        start = self.mark()
        for _ in range(reps):
            self.launch_normalise(x, y)
            self.launch_model(y)
        end = self.mark()
        self.sync()
        return self.seconds(start, end) / reps

    def close(self) -> None:
        """Release what the side allocated (nothing by default)."""


class SimSide(_ModelSide):
    """The model step on the simulated GPU: launched on a stream of ours, timed with its events;
    results are released on that stream."""

    def __init__(self, dev: Device, images: ImageBatches, hidden: int):
        super().__init__()
        self.stream = dev.create_stream()
        self.clock = lambda: dev.now
        w = model_weights(images.features, hidden)
        self._buffers = [dev.allocate(w.nbytes), dev.allocate(images.batch * hidden * 2),
                         dev.allocate(images.nbytes), dev.allocate(images.nbytes * 2)]
        wbuf, obuf, xbuf, ybuf = self._buffers
        self._w, self._out = wbuf.array(np.float16, w.shape), obuf.array(np.float16, (images.batch, hidden))
        self._x, self._y = xbuf.array(np.uint8, images.shape), ybuf.array(np.float16, images.shape)
        with dev.allocate_host(w.nbytes) as host:
            host.view(np.float16, access="w")[:] = w.reshape(-1)
            self.stream.copy(wbuf, host)
            self.stream.sync()
        self.stream.fill(xbuf, 0)

    def mark(self):
        return self.stream.record(timing=True)

    def seconds(self, a, b) -> float:
        return b.elapsed_since(a)

    def sync(self) -> None:
        self.stream.sync()

    def launch_model(self, x) -> None:
        # the sim's default duration: a pass over the bytes named (input, weights, output)
        self.stream.launch(model_step, x, self._w, self._out, reads=[x, self._w], writes=[self._out])

    def launch_normalise(self, x, y) -> None:
        self.stream.launch(normalise, x, y, reads=[x], writes=[y])

    def scratch(self):
        return self._x, self._y

    def read(self, x) -> np.ndarray:
        """A host copy of the device batch ``x`` (a launch argument), read by a kernel on our stream."""
        out = np.empty(x.shape, x.dtype)
        self.stream.launch(functools.partial(np.copyto, out), x, reads=[x])
        self.stream.sync()
        return out


    def close(self) -> None:
        self.stream.sync()
        for b in self._buffers:
            b.close()
        self.stream.close()


class TorchSide(_ModelSide):
    """The model step in PyTorch on its current stream (the legacy default stream, which
    ``release(stream=None)`` orders the release after), timed with CUDA events."""

    def __init__(self, torch, images: ImageBatches, hidden: int):
        super().__init__()
        self.torch, self.images = torch, images
        self.clock = time.perf_counter
        self._w = torch.from_numpy(model_weights(images.features, hidden)).cuda()
        self._out = torch.empty((images.batch, hidden), dtype=torch.float16, device="cuda")

    def mark(self):
        event = self.torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3

    def sync(self) -> None:
        self.torch.cuda.synchronize()

    def launch_model(self, x) -> None:
        # a CuPy array from ringflow is viewed (no copy) through __cuda_array_interface__
        model_step(self.torch.as_tensor(x, device="cuda"), self._w, self._out)

    def launch_normalise(self, x, y) -> None:
        normalise(x, y)

    def scratch(self):
        torch = self.torch
        x = torch.randint(0, 256, self.images.shape, dtype=torch.uint8, device="cuda")
        return x, torch.empty(self.images.shape, dtype=torch.float16, device="cuda")

    def read(self, x) -> np.ndarray:
        return self.torch.as_tensor(x, device="cuda").cpu().numpy()



def model_side(dev: Device, images: ImageBatches, hidden: int) -> _ModelSide:
    """The model step's side for ``dev``: :class:`SimSide` on the simulated GPU, :class:`TorchSide`
    on a CUDA GPU.

    Raises:
        BaselineUnavailable: on a CUDA GPU where PyTorch is missing or sees no GPU.
    """
    if dev.backend == "sim":
        return SimSide(dev, images, hidden)
    return TorchSide(_torch(), images, hidden)


# -- the stages alone --------------------------------------------------------------------------------
# Passes of the CPU stage alone; its bound is the fastest: the host's load varies from moment to
# moment, and a bound measured in a slow moment is one a stream measured later can beat.
CPU_STAGE_PASSES = 3


def cpu_stage_seconds(dev: Device, prepare: Callable[[int], np.ndarray], workers: int, count: int) -> float:
    """``prepare`` of batches ``0 .. count - 1`` on ``workers`` CPU workers of ``dev``, all
    submitted at once, :data:`CPU_STAGE_PASSES` times: the fastest pass's host-clock seconds per
    batch."""
    pool = dev.create_worker_pool(workers)
    passes = []
    try:
        for _ in range(CPU_STAGE_PASSES):
            t0 = dev.now
            tasks = [pool.submit(prepare, i) for i in range(count)]
            for task in tasks:
                task.sync()
            passes.append((dev.now - t0) / count)
            for task in tasks:
                task.result()  # a failed prepare fails the workload
    finally:
        pool.close()
    return min(passes)


_WORKER_IMAGES: dict = {}  # in a worker process of cpu_stage_seconds_processes: the batches


def _set_images(images: "ImageBatches") -> None:
    _WORKER_IMAGES["images"] = images


def _decode_timed(index: int) -> float:
    """In a worker process: batch ``index`` made, into memory of the worker's that earlier
    batches used (as a pipeline's worker makes it in a pinned slot: no fresh pages to fault
    in); the seconds it took."""
    from .._pipeline.slot_array import run_offering

    images = _WORKER_IMAGES["images"]
    buffer = _WORKER_IMAGES.setdefault("buffer", np.zeros(images.nbytes, np.uint8))
    t0 = time.perf_counter()
    run_offering(images.decode_augment, index, buffer)
    return time.perf_counter() - t0


def cpu_stage_seconds_processes(images: "ImageBatches", workers: int, count: int) -> float:
    """:meth:`ImageBatches.decode_augment` of batches ``0 .. count - 1`` on ``workers`` worker
    processes (a forkserver pool, each given the batches once), after ``2 * workers`` untimed:
    the mean time one batch took inside a worker over ``workers``, in the fastest of
    :data:`CPU_STAGE_PASSES` passes (seconds per batch with every
    worker busy and nothing else in the way: what a process-based loader, or ``processes=True``,
    can reach at best; start-up and hand-offs are left out). The mean, not the median: batches
    take unequal times, and a stream has to make the slow ones too. Each batch is made into
    memory the worker reused, as a pipeline's worker makes it in its slot: a loader that makes
    each batch in new memory does more work than this."""
    ctx = multiprocessing.get_context("forkserver")
    passes = []
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_set_images,
                                                initargs=(images,)) as pool:
        list(pool.map(_decode_timed, range(2 * workers)))  # start and warm the workers
        for _ in range(CPU_STAGE_PASSES):
            took = list(pool.map(_decode_timed, range(count)))
            passes.append(sum(took) / len(took) / workers)
    return min(passes)


def h2d_stage_seconds(dev: Device, nbytes: int, reps: int) -> float:
    """One batch's copy from pinned host memory to the device alone: ``reps`` copies back to back
    on one stream after one untimed, timed with the device's events; seconds per copy."""
    host, device = dev.allocate_host(nbytes), dev.allocate(nbytes)
    stream = dev.create_stream()
    try:
        host.view(np.uint8, access="w")[:] = 1
        stream.copy(device, host)
        stream.sync()
        start = stream.record(timing=True)
        for _ in range(reps):
            stream.copy(device, host)
        end = stream.record(timing=True)
        end.sync()
        return end.elapsed_since(start) / reps
    finally:
        stream.sync()
        device.close()
        host.close()
        stream.close()


# -- the two systems -------------------------------------------------------------------------------
OnePass = Callable[[int, Callable[[int, Any], None]], None]


def measure_feed(name: str, one_pass: OnePass, side: _ModelSide, images: ImageBatches, *, batches: int,
                 rounds: int, check: int, **extra: Any) -> Row:
    """Check, then time, one system.

    ``one_pass(count, consume)`` feeds batches ``0 .. count - 1`` and calls ``consume(i, x)``
    with each on the device (``x`` valid during the call). First an untimed pass of ``check``
    batches copies every one back and compares it bit for bit with :meth:`ImageBatches.expected`,
    and an untimed pass of ``batches`` runs as the timed ones do (the warm-up); then ``rounds``
    timed passes of ``batches`` batches run the model step on each, timed on ``side.clock`` from
    the pass's start to the end of its last step.

    Returns:
        a row: ``ms_median``/``ms_p10``/``ms_p90`` (ms per batch over the rounds),
        ``rounds_ms`` (each round's, in order), ``batches_per_s`` (of the median),
        ``gpu_idle_fraction`` (the median round's, from the model steps' timing events),
        ``correct``, ``checked_batches`` and ``extra``.
    """
    verdicts: list[bool] = []
    one_pass(check, lambda i, x: verdicts.append(same_bits(side.read(x), images.expected(i))))
    one_pass(batches, lambda i, x: side.step(x))  # an untimed round at full speed: the warm-up
    side.finish()
    per_batch, idle = [], []
    for _ in range(rounds):
        t0 = side.clock()
        one_pass(batches, lambda i, x: side.step(x))
        spans = side.finish()
        per_batch.append((side.clock() - t0) / batches)
        idle.append(gpu_idle(spans))
    timing = Timing(per_batch)
    median_round = int(np.argsort(per_batch)[len(per_batch) // 2])
    return _row(name, timing, batches_per_s=1e3 / timing.median_ms, gpu_idle_fraction=idle[median_round],
                rounds_ms=[t * 1e3 for t in per_batch],
                correct=len(verdicts) == check and all(verdicts), checked_batches=len(verdicts), batches=batches,
                **extra)


def ringflow_feed(dev: Device, images: ImageBatches, side: _ModelSide, *, workers: int, batches: int, rounds: int,
                  check: int, prepare: Optional[Callable[[int], np.ndarray]] = None, processes: bool = False,
                  name: Optional[str] = None, **options: Any) -> Row:
    """ringflow's side: one :class:`ringflow.Pipeline` that prepares batches on ``workers``
    threads (``prepare``, default :meth:`ImageBatches.decode_augment`), normalises them on the
    device and delivers each there (``deliver="device"``) to the model step, then releases it on
    ``side.stream``; measured by :func:`measure_feed`. ``processes``: the CPU workers are
    processes (``Pipeline(processes=True)``) instead of threads. ``options``: more
    :class:`ringflow.Pipeline` arguments (``slots``, ``ordered``), with ``name`` for the row.

    Returns:
        :func:`measure_feed`'s row, with ``deliver`` ("device"), ``workers``, ``processes`` and
        the pipeline's ``slots``.
    """
    with rf.Pipeline(normalise, device=dev, prepare=prepare or images.decode_augment, chunk_bytes=images.nbytes * 2,
                     workers=workers, output=(images.shape, "float16"), deliver="device",
                     processes=processes, **options) as pipe:

        def one_pass(count: int, consume: Callable[[int, Any], None]) -> None:
            for i, res in enumerate(pipe.map(range(count))):
                consume(i, res.array)
                res.release(stream=side.stream)  # stream-ordered: after the step just enqueued

        return measure_feed(name or (RINGFLOW_PROCESSES if processes else RINGFLOW), one_pass, side, images,
                            batches=batches, rounds=rounds, check=check, deliver="device", workers=workers,
                            processes=processes, slots=dataclasses.asdict(pipe.config.slots))


class BatchDataset:
    """A map-style dataset (the ``torch.utils.data.Dataset`` protocol) of ``length`` batches:
    item ``i`` is :meth:`ImageBatches.decode_augment` of ``i`` as a uint8 tensor. A plain
    module-level class, so DataLoader workers can unpickle it under any start method."""

    def __init__(self, images: ImageBatches, length: int):
        self.images, self.length = images, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        import torch

        if not 0 <= index < self.length:
            raise IndexError(index)
        return torch.from_numpy(self.images.decode_augment(index))


def dataloader_feed(images: ImageBatches, side: TorchSide, *, workers: int, batches: int, rounds: int,
                    check: int) -> Row:
    """The PyTorch baseline: ``DataLoader(BatchDataset, batch_size=None, pin_memory=True,
    num_workers=workers, persistent_workers=True, prefetch_factor=2)``; per batch
    ``x = b.cuda(non_blocking=True)``, :func:`normalise` into a new float16 tensor and the model
    step on the current stream; measured by :func:`measure_feed`.

    Raises:
        BaselineUnavailable: PyTorch is missing or sees no GPU.
    """
    torch = _torch()
    loader = torch.utils.data.DataLoader(BatchDataset(images, max(batches, check)), batch_size=None, shuffle=False,
                                         num_workers=workers, pin_memory=True, persistent_workers=True,
                                         prefetch_factor=2)

    def one_pass(count: int, consume: Callable[[int, Any], None]) -> None:
        for i, b in enumerate(itertools.islice(loader, count)):
            x = b.cuda(non_blocking=True)
            y = torch.empty(images.shape, dtype=torch.float16, device="cuda")
            normalise(x, y)
            consume(i, y)

    try:
        return measure_feed(DATALOADER, one_pass, side, images, batches=batches, rounds=rounds, check=check,
                            workers=workers)
    finally:
        # persistent workers live as long as the loader's iterator: stop them now, not at some
        # later garbage collection while the next workload is being timed
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None:
            iterator._shutdown_workers()


# -- the workload -----------------------------------------------------------------------------------
def feed(dev: Device, *, batch: int = 64, size: int = 224, batches: int = 200, workers: Optional[int] = None,
         rounds: int = 3, check: Optional[int] = None, hidden: int = 256, progress=None) -> dict[str, Any]:
    """The ``feed`` workload (see the module's docstring).

    Args:
        dev: the device (the simulated GPU runs ringflow only).
        batch: images per batch.
        size: image height and width, in pixels.
        batches: batches per timed pass.
        workers: CPU workers of each system (default :func:`default_workers`).
        rounds: timed passes per system (rows give the median).
        check: batches copied back and compared with numpy before timing (default: all).
        hidden: the model step's output width.
        progress: called with a line of text as each part starts.

    Returns:
        ``rows`` (ringflow, the DataLoader, each stage alone), the ``stage_bound`` figures
        (``stage_ms``, ``bound_ms``, ``bound_stage``, ``bound_batches_per_s``),
        ``ringflow_batches_per_s``, ``dataloader_batches_per_s``, ``ringflow_vs_dataloader``,
        ``*_fraction_of_bound`` and ``*_gpu_idle_fraction`` of both (None where a system was
        skipped), and the sizes used.
    """
    say = progress or (lambda text: None)
    workers = default_workers() if workers is None else workers
    check = batches if check is None else check
    images = ImageBatches(batch, size)
    prepare = functools.partial(charged, images) if dev.backend == "sim" else images.decode_augment
    out: dict[str, Any] = {"workload": "feed", "batch": batch, "image": [3, size, size], "batches": batches,
                           "rounds": rounds, "workers": workers, "hidden": hidden,
                           "deliver": "device"}
    try:
        side = model_side(dev, images, hidden)
    except BaselineUnavailable as exc:  # no PyTorch on this GPU: no model step to feed, say why
        reason = f"the model step runs in PyTorch: {exc}"
        return {**out, **_summary([_skip(RINGFLOW, reason), _skip(DATALOADER, reason)], None)}
    try:
        say("feed: each stage alone")
        cpu = {"threads": cpu_stage_seconds(dev, prepare, workers, 4 * workers)}
        if dev.backend != "sim":  # the simulated GPU charges a modelled cost to its own threads only
            cpu["processes"] = cpu_stage_seconds_processes(images, workers, 8 * workers)
        # the bound is the fastest the CPU stage goes either way: no system may beat it
        stages = {"cpu_decode_augment": min(cpu.values()),
                  "h2d_copy": h2d_stage_seconds(dev, images.nbytes, 8),
                  "gpu_normalise_model": side.gpu_stage_seconds(8)}
        bound = stage_bound(stages)
        out["cpu_stage_ms"] = {k: v * 1e3 for k, v in cpu.items()}
        say("feed: ringflow")
        rows = [ringflow_feed(dev, images, side, workers=workers, batches=batches, rounds=rounds, check=check,
                              prepare=prepare)]
        if dev.backend != "sim":
            say("feed: ringflow, prepare in worker processes")
            rows.append(ringflow_feed(dev, images, side, workers=workers, batches=batches, rounds=rounds,
                                      check=check, processes=True))
        reason = _gpu_only(dev)
        if reason:
            rows.append(_skip(DATALOADER, reason))
        else:
            say("feed: torch DataLoader")
            rows.append(_baseline(DATALOADER, lambda: dataloader_feed(images, side, workers=workers, batches=batches,
                                                                      rounds=rounds, check=check)))
    finally:
        side.close()
    rows += [_row(f"stage alone: {name}", ms_per_batch=bound["stage_ms"][name], bound=name == bound["bound_stage"])
             for name in STAGES]
    return {**out, **bound, **_summary(rows, bound)}


def _summary(rows: Iterable[Row], bound: Optional[dict]) -> dict[str, Any]:
    """The systems' figures side by side (None where a system was skipped or not run), each
    measured row given its ``fraction_of_bound``: ``ringflow_*`` (threads), ``ringflow_processes_*``
    and ``dataloader_*``, and each ringflow row's batches per second over the DataLoader's."""
    rows = list(rows)
    names = {"ringflow": RINGFLOW, "ringflow_processes": RINGFLOW_PROCESSES, "dataloader": DATALOADER}
    out: dict[str, Any] = {"rows": rows}
    for key, name in names.items():
        row = next((r for r in rows if r.get("name") == name), {})
        if bound is not None and row and "skipped" not in row:
            row["fraction_of_bound"] = fraction_of_bound(row, bound)
        out[f"{key}_batches_per_s"] = row.get("batches_per_s")
        out[f"{key}_fraction_of_bound"] = row.get("fraction_of_bound")
        out[f"{key}_gpu_idle_fraction"] = row.get("gpu_idle_fraction")
    theirs = out["dataloader_batches_per_s"]
    for key in ("ringflow", "ringflow_processes"):
        ours = out[f"{key}_batches_per_s"]
        out[f"{key}_vs_dataloader"] = ours / theirs if ours and theirs else None
    return out
