"""The baselines ``ringflow bench`` compares against, each run on the real GPU.

Every baseline runs one workload and returns a JSON-ready dict::

    {"name", "ms_median", "ms_p10", "ms_p90", "ms_min", "ms_max", "runs", "correct",
     "timing": "cuda_events" | "host_clock", "kernel", "host", "bytes_in", "bytes_out",
     "chunks", "streams", ...}

Measurement rules: warm-up runs first, then ``repeats`` timed runs, median and
spread; CUDA events around regions that are GPU-only (data already in pinned memory), the host
clock after a synchronize for end-to-end regions (a pageable numpy array in, a new numpy array
out); the output of the last timed run is poisoned (NaN) beforehand and checked against an
exact float64 reference on the caller's data (use :func:`random_input`: fresh random values,
never zeros).

The kernels are the ``affine_iter`` (the tutorial's ``v*0.999+0.001`` repeated ``iters``
times; 64 for the ``seed`` workload) and ``scale_shift`` (``y = x*2+1``) kernels of
``native/overlap_pipeline.cu``, compiled with NVRTC through CuPy and launched on PyTorch's
streams, one thread per element in blocks of 256 -- the same code the CUDA C++ baseline and
ringflow's own :mod:`ringflow._bench.kernels` run, so every comparison is of the pipeline.

Baselines need PyTorch and CuPy with a CUDA GPU (``cuda_cpp_pipeline`` needs nvcc and a GPU);
where those are missing they raise :class:`BaselineUnavailable`, whose message says what is
missing (:func:`run_or_skip` turns that into ``{"name", "skipped": reason}``).

``link_floor`` and ``host_floor`` measure what the fastest possible pipeline is bound by; their
keys are prefixed ``link_`` and ``host_`` so the two dicts merge.

The request-stream baselines (``torch_requests_naive``, ``torch_requests_ring``) measure a
stream of small requests instead of one array: capacity in requests per second and latency
percentiles (:func:`measure_request_server`), every result compared with numpy's ``x*2+1`` bit
for bit. They need PyTorch with a CUDA GPU only; the request servers and the open-loop driver
they run on (:class:`SyncServer`, :class:`RingServer`, :func:`open_loop`) need no GPU.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import ctypes
import dataclasses
import gc
import itertools
import math
import os
import queue
import threading
import time
import warnings
from typing import Any, Callable, Sequence

import numpy as np

__all__ = [
    "BaselineUnavailable", "BaselineKernel", "resolve_kernel", "random_input", "gpu_available", "availability",
    "run_or_skip", "serial_copy_compute_copy", "torch_naive", "torch_streams_pipeline", "cuda_cpp_pipeline",
    "link_floor", "host_floor", "versions", "scale_shift_expected", "open_loop", "SyncServer", "RingServer",
    "measure_request_server", "queue_floor", "torch_requests_naive", "torch_requests_ring",
]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
BLOCK = 256
PAGE = 4096


class BaselineUnavailable(RuntimeError):
    """This baseline cannot run here: no GPU, or PyTorch, CuPy or nvcc is missing (the message says which)."""


def run_or_skip(fn: Callable[..., dict], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """``fn(*args, **kwargs)``, or ``{"name": fn.__name__, "skipped": reason}`` if it is unavailable here."""
    try:
        return fn(*args, **kwargs)
    except BaselineUnavailable as exc:
        return {"name": getattr(fn, "__name__", str(fn)), "skipped": str(exc)}


# -- what is installed ----------------------------------------------------------------------------
def _torch():
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - any import failure means no PyTorch here
        raise BaselineUnavailable(f"PyTorch is not installed or does not import ({type(exc).__name__}: {exc})") from None
    if not torch.cuda.is_available():
        raise BaselineUnavailable("PyTorch sees no CUDA GPU (torch.cuda.is_available() is False)")
    return torch


def preload_frameworks() -> dict[str, str]:
    """Import PyTorch and CuPy now (each if usable), so that nothing imports them inside a
    timed region and their objects exist before the benchmark freezes the garbage collector's
    heap. Returns what each import gave ("ok" or why not)."""
    out = {}
    for name, load in (("torch", _torch), ("cupy", _cupy)):
        try:
            load()
            out[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - a missing framework only skips its baselines
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


_cupy_ok = False


def _cupy():
    global _cupy_ok
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001
        raise BaselineUnavailable(f"CuPy is not installed or does not import ({type(exc).__name__}: {exc})") from None
    if not _cupy_ok:
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:  # noqa: BLE001 - no driver, no device
            raise BaselineUnavailable(f"CuPy sees no CUDA GPU ({type(exc).__name__}: {exc})") from None
        if count < 1:
            raise BaselineUnavailable("CuPy sees no CUDA GPU (device count 0)")
        _cupy_ok = True
    return cupy


def gpu_available() -> tuple[bool, str]:
    """(usable, reason): whether any of ringflow's CUDA backend, CuPy or PyTorch sees a GPU."""
    reasons = []
    try:
        from .._device import cuda_available

        ok, why = cuda_available()
        if ok:
            return True, why
        reasons.append(f"ringflow: {why}")
    except Exception as exc:  # noqa: BLE001
        reasons.append(f"ringflow: {type(exc).__name__}: {exc}")
    for probe in (_cupy, _torch):
        try:
            probe()
            return True, f"{probe.__name__.strip('_')} sees a GPU"
        except BaselineUnavailable as exc:
            reasons.append(str(exc))
    return False, "; ".join(reasons)


def availability() -> dict[str, str]:
    """What each baseline needs and whether it is here: ``{"torch", "cupy", "nvcc", "gpu"}`` -> "ok" or why not."""
    from . import native

    out = {}
    for key, probe in (("torch", _torch), ("cupy", _cupy)):
        try:
            probe()
            out[key] = "ok"
        except BaselineUnavailable as exc:
            out[key] = str(exc)
    nvcc = native.find_nvcc()
    out["nvcc"] = f"ok ({nvcc})" if nvcc else "nvcc not found"
    ok, why = gpu_available()
    out["gpu"] = "ok" if ok else why
    return out


# -- the kernels ----------------------------------------------------------------------------------
_AFFINE_NAMES = {"seed", "affine", "affine_iter", "v*0.999+0.001", "heavy"}
_SCALE_NAMES = {"scale_shift", "x*2+1", "2x+1", "axpb", "pageable"}
_A32, _B32 = float(np.float32(0.999)), float(np.float32(0.001))
_functions: dict[str, Any] = {}
_functions_lock = threading.Lock()
_ext_streams: dict[int, Any] = {}


@dataclasses.dataclass(frozen=True)
class BaselineKernel:
    """One of the two kernels, with its exact float64 reference.

    ``kind`` is ``"affine_iter"`` (``iters`` times ``v = v*0.999f + 0.001f``, run in place on
    the device as the tutorial does) or ``"scale_shift"`` (``y = x*2 + 1``, out of place).
    """

    kind: str
    iters: int = 64

    def __post_init__(self):
        if self.kind not in ("affine_iter", "scale_shift"):
            raise ValueError(f"kernel kind must be 'affine_iter' or 'scale_shift', got {self.kind!r}")
        if isinstance(self.iters, bool) or not isinstance(self.iters, (int, np.integer)) or self.iters < 0:
            raise ValueError(f"iters must be a non-negative integer, got {self.iters!r}")

    @property
    def name(self) -> str:
        return f"affine_iter_{self.iters}" if self.kind == "affine_iter" else "scale_shift"

    @property
    def inplace(self) -> bool:
        return self.kind == "affine_iter"

    @property
    def native_name(self) -> str:
        """The ``--kernel`` argument of the CUDA C++ program."""
        return "seed" if self.kind == "affine_iter" else "scale_shift"

    def tolerance(self) -> tuple[float, float]:
        """(rtol, atol) against the reference: float32 rounding of the recurrence is at most
        ~6e-8 per step, damped by 0.999 a step; ``x*2+1`` is compared bit for bit with numpy's
        float32 result (``x*2`` is exact, so the one rounding of ``+1`` is the same with or
        without an FMA)."""
        if self.kind == "scale_shift":
            return 0.0, 0.0
        return 1e-5, max(1e-5, 6e-8 * min(int(self.iters), 1000))

    def reference(self, x: np.ndarray) -> np.ndarray:
        """``x*2+1`` in float32 as the GPU computes it; the affine recurrence exactly in float64
        (closed form: a^k (v - c) + c)."""
        if self.kind == "scale_shift":
            v = np.asarray(x, dtype=np.float32)
            return (v * np.float32(2) + np.float32(1)).astype(np.float64)
        v = np.asarray(x, dtype=np.float64)
        fix = _B32 / (1.0 - _A32)
        return _A32 ** int(self.iters) * (v - fix) + fix

    def check(self, x: np.ndarray, y: np.ndarray, block: int = 1 << 22) -> dict[str, Any]:
        """Compare ``y`` with the reference of ``x``, block by block (bounded memory); NaN fails."""
        x, y = np.ravel(x), np.ravel(y)
        if x.shape != y.shape:
            return {"correct": False, "mismatches": max(x.size, y.size), "max_abs_err": None}
        rtol, atol = self.tolerance()
        bad, worst = 0, 0.0
        for lo in range(0, x.size, block):
            ref = self.reference(x[lo:lo + block])
            err = np.abs(y[lo:lo + block].astype(np.float64) - ref)
            ok = err <= atol + rtol * np.abs(ref)  # False for NaN
            nbad = int(ok.size - np.count_nonzero(ok))
            bad += nbad
            if nbad and not np.isfinite(err).all():
                worst = math.inf
            elif err.size:
                worst = max(worst, float(np.nanmax(err)))
        return {"correct": bad == 0, "mismatches": bad, "max_abs_err": None if math.isinf(worst) else worst}

    def compile(self) -> Any:
        """The CuPy ``RawKernel`` (compiled once per process from ``native.kernel_source()``)."""
        cupy = _cupy()
        with _functions_lock:
            if not _functions:
                from . import native

                module = cupy.RawModule(code=native.kernel_source())
                for name in ("affine_iter", "scale_shift"):
                    _functions[name] = module.get_function(name)
            return _functions[self.kind]

    def launch(self, src_ptr: int, dst_ptr: int, n: int, stream_ptr: int) -> None:
        """Launch on the CUDA stream ``stream_ptr`` (a ``torch.cuda.Stream().cuda_stream``; 0 is
        the legacy default stream): ``ceil(n / 256)`` blocks of 256 threads, like ``rf.Kernel``."""
        if n <= 0:
            return
        fn = self.compile()
        cupy = _cupy()
        ext = _ext_streams.get(stream_ptr)
        if ext is None:
            ext = _ext_streams[stream_ptr] = _external_stream(cupy, stream_ptr)
        blocks = min(-(-n // BLOCK), 0x7FFFFFFF)
        if self.kind == "affine_iter":
            args = (np.uint64(src_ptr), np.uint64(dst_ptr), np.int32(self.iters), np.uint64(n))
        else:
            args = (np.uint64(src_ptr), np.uint64(dst_ptr), np.uint64(n))
        with ext:
            fn((blocks,), (BLOCK,), args)


class _StreamHandle:
    """A raw stream handle in the CUDA stream protocol, for ``cupy.cuda.Stream.from_external``."""

    def __init__(self, ptr: int):
        self.ptr = int(ptr)

    def __cuda_stream__(self):
        return (0, self.ptr)


def _external_stream(cupy, ptr: int):
    """CuPy's view of a stream it did not create (``ExternalStream``, deprecated in CuPy 14 in
    favour of ``Stream.from_external``, which newer releases keep)."""
    ext = getattr(cupy.cuda, "ExternalStream", None)
    if ext is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return ext(ptr)
    return cupy.cuda.Stream.from_external(_StreamHandle(ptr))


def resolve_kernel(spec: Any = "seed", iters: int = 64) -> BaselineKernel:
    """A :class:`BaselineKernel` from a name (``"seed"``/``"affine_iter"``/``"affine_iter_64"``,
    ``"scale_shift"``/``"x*2+1"``), a :class:`BaselineKernel`, or one of
    :mod:`ringflow._bench.kernels`' functions (``affine(iters)``, ``scale_shift()``)."""
    if isinstance(spec, BaselineKernel):
        return spec
    name = spec if isinstance(spec, str) else getattr(spec, "__name__", None)
    if isinstance(name, str):
        key = name.strip().replace(" ", "").lower()
        if key in _SCALE_NAMES:
            return BaselineKernel("scale_shift")
        if key in _AFFINE_NAMES:
            return BaselineKernel("affine_iter", int(getattr(spec, "iters", iters)))
        if key.startswith("affine_iter_") and key[len("affine_iter_"):].isdigit():
            return BaselineKernel("affine_iter", int(key[len("affine_iter_"):]))
    raise ValueError(f"unknown baseline kernel {spec!r}: use 'seed' (affine_iter, iters=...) or 'scale_shift' (x*2+1)")


def random_input(n: int, seed: int | None = None) -> np.ndarray:
    """``n`` fresh random float32 values in [-1, 1) (never zeros: zeros hide unwritten outputs)."""
    rng = np.random.default_rng(seed)
    x = rng.random(int(n), dtype=np.float32)
    x *= 2
    x -= 1
    return x


# -- helpers --------------------------------------------------------------------------------------
def _stats(ms: Sequence[float]) -> dict[str, Any]:
    a = np.asarray(ms, dtype=np.float64)
    return {"ms_median": float(np.median(a)), "ms_p10": float(np.percentile(a, 10)),
            "ms_p90": float(np.percentile(a, 90)), "ms_min": float(a.min()), "ms_max": float(a.max()),
            "runs": int(a.size)}


def _as_f32(x: Any) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise TypeError(f"baselines take float32 arrays, got {x.dtype}")
    if x.size == 0:
        raise ValueError("baselines need a non-empty array")
    if not x.flags.c_contiguous:
        raise ValueError("baselines need a C-contiguous array")
    return x.reshape(-1)


def _counts(v: int | Sequence[int], what: str) -> list[int]:
    vals = [v] if isinstance(v, (int, np.integer)) else list(v)
    if not vals or any(isinstance(c, bool) or int(c) < 1 for c in vals):
        raise ValueError(f"{what} must be positive integers, got {v!r}")
    return [int(c) for c in vals]


def _bounds(n: int, chunks: int) -> list[tuple[int, int]]:
    return [(n * i // chunks, n * (i + 1) // chunks) for i in range(chunks) if n * (i + 1) // chunks > n * i // chunks]


def _host_timed(once: Callable[[], Any], warmup: int, repeats: int,
                before_last: Callable[[], None] | None = None) -> tuple[list[float], Any]:
    """Call ``once()`` ``warmup + repeats`` times, each call timed on the host clock, and
    ``before_last()`` (untimed) just before the last. Returns the last ``repeats`` times in ms
    and the last call's result. The previous call's result is dropped before each call, so that
    two results are never held at once."""
    times, y = [], None
    for i in range(warmup + repeats):
        if before_last is not None and i == warmup + repeats - 1:
            before_last()
        del y
        t0 = time.perf_counter()
        y = once()
        ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(ms)
    return times, y


def _pinned(torch, n: int, dtype=None):
    return torch.empty(int(n), dtype=dtype or torch.float32, pin_memory=True)


def _check_setup(kernel: BaselineKernel):
    torch = _torch()
    kernel.compile()  # NVRTC compile outside any timed region
    return torch


def versions() -> dict[str, Any]:
    """Versions of numpy, PyTorch and CuPy (those that import)."""
    out: dict[str, Any] = {"numpy": np.__version__}
    for mod in ("torch", "cupy"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            pass
    return out


# -- 1. serial copy-compute-copy ------------------------------------------------------------------
def serial_copy_compute_copy(x: np.ndarray, kernel: Any = "seed", *, iters: int = 64, host: str = "pinned",
                             warmup: int = 2, repeats: int = 10) -> dict[str, Any]:
    """One big H2D, the kernel, one big D2H, on one stream: the tutorial's serial version.

    ``host="pinned"``: ``x`` is copied into a pinned buffer beforehand (untimed) and the output
    stays in a second pinned buffer; the region H2D -> kernel -> D2H is timed with CUDA events.
    ``host="pageable"``: end to end from the numpy array ``x`` to a new numpy array, staged
    through pinned buffers by one thread; host clock.
    """
    k = resolve_kernel(kernel, iters)
    if host not in ("pinned", "pageable"):
        raise ValueError(f"host must be 'pinned' or 'pageable', got {host!r}")
    x = _as_f32(x)
    torch = _check_setup(k)
    n = x.size
    s = torch.cuda.Stream()
    d_in = torch.empty(n, dtype=torch.float32, device="cuda")
    d_out = d_in if k.inplace else torch.empty_like(d_in)
    p_in, p_out = _pinned(torch, n), _pinned(torch, n)
    a_in, a_out = p_in.numpy(), p_out.numpy()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if host == "pinned":
        np.copyto(a_in, x)
    torch.cuda.synchronize()

    def enqueue():
        with torch.cuda.stream(s):
            d_in.copy_(p_in, non_blocking=True)
            k.launch(d_in.data_ptr(), d_out.data_ptr(), n, s.cuda_stream)
            p_out.copy_(d_out, non_blocking=True)

    times, y = [], None
    for i in range(warmup + repeats):
        last = i == warmup + repeats - 1
        if last:
            a_out.fill(np.nan)
        if host == "pinned":
            e0.record(s)
            enqueue()
            e1.record(s)
            e1.synchronize()
            ms = e0.elapsed_time(e1)
        else:
            t0 = time.perf_counter()
            y = np.empty_like(x)
            np.copyto(a_in, x)
            enqueue()
            s.synchronize()
            np.copyto(y, a_out)
            ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(ms)
    out = a_out if host == "pinned" else y
    chk = k.check(x, out)
    res = {"name": "serial_copy_compute_copy", **_stats(times), **chk, "kernel": k.name, "host": host,
           "timing": "cuda_events" if host == "pinned" else "host_clock", "bytes_in": x.nbytes,
           "bytes_out": x.nbytes, "chunks": 1, "streams": 1}
    res["GBps"] = 2 * x.nbytes / (res["ms_median"] * 1e6)
    return res


# -- 2. torch naive -------------------------------------------------------------------------------
def torch_naive(x: np.ndarray, fn: Any = "scale_shift", *, iters: int = 64, warmup: int = 1, repeats: int = 5,
                reference: Callable[[np.ndarray], np.ndarray] | None = None) -> dict[str, Any]:
    """``torch.from_numpy(x).cuda()``, the kernel, ``.cpu().numpy()``: the way people do it
    today. End to end (pageable numpy in, new numpy out), host clock.

    ``fn`` is a kernel spec (see :func:`resolve_kernel`), or any callable on a CUDA tensor that
    returns a CUDA tensor, checked against ``reference(x)`` if given (else ``correct`` is None).
    """
    x = _as_f32(x)
    try:
        k: BaselineKernel | None = resolve_kernel(fn, iters)
    except ValueError:
        if not callable(fn):
            raise
        k = None
    torch = _check_setup(k) if k is not None else _torch()
    n = x.size

    def once():
        d = torch.from_numpy(x).cuda()
        if k is not None:
            out = d if k.inplace else torch.empty_like(d)
            k.launch(d.data_ptr(), out.data_ptr(), n, torch.cuda.current_stream().cuda_stream)
        else:
            out = fn(d)
        return out.cpu().numpy()

    torch.cuda.synchronize()
    times, y = _host_timed(once, warmup, repeats)
    if k is not None:
        chk = k.check(x, y)
    elif reference is not None:
        ref = np.asarray(reference(x), dtype=np.float64).reshape(-1)
        yy = np.asarray(y, dtype=np.float64).reshape(-1)
        chk = {"correct": bool(yy.shape == ref.shape and np.allclose(yy, ref, rtol=1e-5, atol=1e-6))}
    else:
        chk = {"correct": None}
    res = {"name": "torch_naive", **_stats(times), **chk, "kernel": k.name if k else getattr(fn, "__name__", "fn"),
           "host": "pageable", "timing": "host_clock", "bytes_in": x.nbytes, "bytes_out": x.nbytes, "chunks": 1,
           "streams": 1}
    res["GBps"] = 2 * x.nbytes / (res["ms_median"] * 1e6)
    return res


# -- 3. hand-written torch multi-stream pipeline --------------------------------------------------
def _pipeline_pinned(torch, x, k, nchunks, nstreams, warmup, repeats):
    n = x.size
    strs = [torch.cuda.Stream() for _ in range(nstreams)]
    p_in, p_out = _pinned(torch, n), _pinned(torch, n)
    a_in, a_out = p_in.numpy(), p_out.numpy()
    np.copyto(a_in, x)
    d_in = torch.empty(n, dtype=torch.float32, device="cuda")
    d_out = d_in if k.inplace else torch.empty_like(d_in)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    joins = [torch.cuda.Event() for _ in strs]
    bounds = _bounds(n, nchunks)
    torch.cuda.synchronize()
    times = []
    for i in range(warmup + repeats):
        if i == warmup + repeats - 1:
            a_out.fill(np.nan)
        e0.record(strs[0])
        for s in strs[1:]:
            s.wait_event(e0)
        for c, (lo, hi) in enumerate(bounds):
            s = strs[c % nstreams]
            with torch.cuda.stream(s):
                d_in[lo:hi].copy_(p_in[lo:hi], non_blocking=True)
                k.launch(d_in[lo:hi].data_ptr(), d_out[lo:hi].data_ptr(), hi - lo, s.cuda_stream)
                p_out[lo:hi].copy_(d_out[lo:hi], non_blocking=True)
        for s, ev in zip(strs[1:], joins[1:]):
            ev.record(s)
            strs[0].wait_event(ev)
        e1.record(strs[0])
        e1.synchronize()
        if i >= warmup:
            times.append(e0.elapsed_time(e1))
    chk = k.check(x, a_out)
    return times, chk, {}


def _pipeline_pageable(torch, x, k, nchunks, nstreams, warmup, repeats):
    n = x.size
    bounds = _bounds(n, nchunks)
    nstreams = min(nstreams, len(bounds))
    m = max(hi - lo for lo, hi in bounds)
    strs = [torch.cuda.Stream() for _ in range(nstreams)]
    t0 = time.perf_counter()
    pin_in = [_pinned(torch, m) for _ in strs]
    pin_out = [_pinned(torch, m) for _ in strs]
    alloc_ms = (time.perf_counter() - t0) * 1e3
    a_in, a_out = [p.numpy() for p in pin_in], [p.numpy() for p in pin_out]
    d_in = [torch.empty(m, dtype=torch.float32, device="cuda") for _ in strs]
    d_out = d_in if k.inplace else [torch.empty(m, dtype=torch.float32, device="cuda") for _ in strs]
    done = [torch.cuda.Event() for _ in strs]
    torch.cuda.synchronize()

    def once():
        y = np.empty_like(x)  # the new output array the caller gets (its first touch is part of the cost)
        pending: list[int | None] = [None] * nstreams

        def drain(slot):
            c = pending[slot]
            lo, hi = bounds[c]
            done[slot].synchronize()
            np.copyto(y[lo:hi], a_out[slot][:hi - lo])
            pending[slot] = None

        for c, (lo, hi) in enumerate(bounds):
            slot = c % nstreams
            if pending[slot] is not None:  # the slot's previous chunk must be out before reuse
                drain(slot)
            np.copyto(a_in[slot][:hi - lo], x[lo:hi])
            s = strs[slot]
            with torch.cuda.stream(s):
                d_in[slot][:hi - lo].copy_(pin_in[slot][:hi - lo], non_blocking=True)
                k.launch(d_in[slot].data_ptr(), d_out[slot].data_ptr(), hi - lo, s.cuda_stream)
                pin_out[slot][:hi - lo].copy_(d_out[slot][:hi - lo], non_blocking=True)
                done[slot].record(s)
            pending[slot] = c
        for c in range(len(bounds)):  # drain the last chunks in order
            slot = c % nstreams
            if pending[slot] == c:
                drain(slot)
        return y

    # a staging slot the last run's D2H did not overwrite would hold an earlier run's correct
    # values: NaN there makes the check see it
    def poison():
        for a in a_out:
            a.fill(np.nan)

    times, y = _host_timed(once, warmup, repeats, before_last=poison)
    chk = k.check(x, y)
    return times, chk, {"staging_alloc_ms": alloc_ms, "staging_bytes": 2 * nstreams * m * 4}


def torch_streams_pipeline(x: np.ndarray, fn: Any = "scale_shift", chunks: int | Sequence[int] = (8, 32, 128),
                           streams: int = 3, *, iters: int = 64, host: str = "pageable", warmup: int = 1,
                           repeats: int = 5) -> dict[str, Any]:
    """A hand-written pinned-memory multi-stream pipeline in PyTorch; the best of ``chunks``.

    Chunk ``c`` goes to stream ``c % streams``: non-blocking H2D, the kernel, non-blocking D2H.

    ``host="pageable"`` (default; ``x`` is an ordinary numpy array): end to end into a new
    numpy array, host clock. One pinned in/out staging slot per stream; the thread copies chunk
    ``c`` of ``x`` into its slot after draining the slot's previous chunk (event wait, then copy
    out of pinned memory into the result) -- the staging copies are what the user has to do,
    so they are timed. The staging slots are allocated once, outside the timed region.
    ``host="pinned"``: ``x`` sits in pinned memory beforehand and the output stays in pinned
    memory (the tutorial's setting); CUDA events around the whole pipeline.

    Returns the best chunk count's figures at the top level (``chunks``) and every count's under
    ``by_chunks``.
    """
    k = resolve_kernel(fn, iters)
    if host not in ("pinned", "pageable"):
        raise ValueError(f"host must be 'pinned' or 'pageable', got {host!r}")
    counts = _counts(chunks, "chunks")
    (nstreams,) = _counts(streams, "streams")
    x = _as_f32(x)
    torch = _check_setup(k)
    runner = _pipeline_pinned if host == "pinned" else _pipeline_pageable
    rows = []
    for nc in counts:
        times, chk, extra = runner(torch, x, k, nc, nstreams, warmup, repeats)
        rows.append({"chunks": nc, "streams": nstreams, **_stats(times), **chk, **extra})
        torch.cuda.synchronize()
    best = min(rows, key=lambda r: r["ms_median"])
    res = {"name": "torch_streams_pipeline", **{k_: v for k_, v in best.items()}, "kernel": k.name, "host": host,
           "timing": "cuda_events" if host == "pinned" else "host_clock", "bytes_in": x.nbytes, "bytes_out": x.nbytes,
           "correct": all(r["correct"] for r in rows), "by_chunks": rows}
    res["GBps"] = 2 * x.nbytes / (res["ms_median"] * 1e6)
    return res


# -- 4. hand-written CUDA C++ pipeline ------------------------------------------------------------
def cuda_cpp_pipeline(n_floats: int, chunks: int | Sequence[int] = (8, 16, 32, 64),
                      streams: int | Sequence[int] = (4, 1), iters: int = 64, kernel: Any = "seed", *,
                      repeats: int = 10, warmup: int = 3, arch: str = "sm_90", seed: int = 12345,
                      timeout: float = 300, refill: bool = False) -> dict[str, Any]:
    """Our own CUDA C++ program like the tutorial's overlap.cu, built with ``nvcc -O3 -arch=sm_90``.

    ``n_floats`` float32 in pinned memory, processed serially (one H2D, kernel, one D2H on one
    stream) and pipelined for every (streams, chunks) pair, chunked round-robin over
    non-blocking streams; CUDA events; every configuration's output checked on random data.
    ``kernel`` is ``"seed"`` (``iters`` iterations of ``v*0.999+0.001``, in place on the
    device) or ``"scale_shift"`` (``x*2+1``).

    Top level: the best pipelined configuration among those with more than one stream (all, if
    only one stream count is asked for), timed with CUDA events (the GPU span); ``host_clock``:
    the best of the same runs timed on the host clock around enqueue and synchronize;
    ``refilled`` (with ``refill``): the best when the CPU rewrites the input before every repeat;
    also ``serial_ms``, ``serial``, ``pipelined`` (every
    configuration), ``stages`` (isolated whole-array H2D, D2H, both at once, kernel) and the
    build (``nvcc_version``, ``build_command``, ``build_s``).
    """
    from . import native

    k = resolve_kernel(kernel, iters)
    chunk_list, stream_list = _counts(chunks, "chunks"), _counts(streams, "streams")
    if int(n_floats) < 1:
        raise ValueError(f"n_floats must be >= 1, got {n_floats!r}")
    if native.find_nvcc() is None:
        raise BaselineUnavailable("nvcc not found (not on PATH, $CUDA_HOME or /usr/local/cuda): "
                                  "the CUDA C++ baseline needs it")
    ok, why = gpu_available()
    if not ok:
        raise BaselineUnavailable(f"no usable CUDA GPU for the CUDA C++ baseline: {why}")
    b = native.build(arch)
    r = native.run(b["exe"], n_floats=int(n_floats), chunks=chunk_list, streams=stream_list, iters=k.iters,
                   kernel=k.native_name, repeats=repeats, warmup=warmup, seed=seed, timeout=timeout, refill=refill)
    rows = r["pipelined"]
    multi = [p for p in rows if p["streams"] > 1] or rows
    best = min(multi, key=lambda p: p["ms_median"])
    nbytes = int(n_floats) * 4
    res = {"name": "cuda_cpp_pipeline", **{key: best[key] for key in
                                           ("ms_median", "ms_p10", "ms_p90", "ms_min", "ms_max", "runs")},
           "correct": bool(r["correct"]), "chunks": best["chunks"], "streams": best["streams"], "kernel": k.name,
           "host": "pinned", "timing": "cuda_events", "bytes_in": nbytes, "bytes_out": nbytes,
           "n_floats": int(n_floats), "serial_ms": r["serial"]["ms_median"], "serial": r["serial"],
           "pipelined": rows, "stages": r["stages"], "device": r.get("device"),
           "cuda_runtime": r.get("cuda_runtime"), "cuda_driver": r.get("cuda_driver"), "arch": b["arch"],
           "nvcc_version": b["nvcc_version"], "build_command": b["command"], "build_s": b["build_s"],
           "run_command": r["command"]}
    res["GBps"] = 2 * nbytes / (res["ms_median"] * 1e6)
    timed_on_host = [p for p in multi if "host_clock" in p]
    if timed_on_host:
        # the same runs on the host clock (enqueue + GPU span + synchronize): what a caller of the
        # C++ function waits, comparable with ringflow's host-timed calls
        best_host = min(timed_on_host, key=lambda p: p["host_clock"]["ms_median"])
        res["host_clock"] = {"chunks": best_host["chunks"], "streams": best_host["streams"], **best_host["host_clock"]}
    refilled = [p for p in multi if "refilled" in p]
    if refilled:
        best_ev = min(refilled, key=lambda p: p["refilled"]["ms_median"])
        best_host = min(refilled, key=lambda p: p["refilled"]["host_clock"]["ms_median"])
        res["refilled"] = {"chunks": best_ev["chunks"], "ms_median": best_ev["refilled"]["ms_median"],
                           "host_clock": {"chunks": best_host["chunks"],
                                          **best_host["refilled"]["host_clock"]}}
    return res


# -- floors ---------------------------------------------------------------------------------------
def link_floor(nbytes_in: int, nbytes_out: int, *, probe_cap: int = 256 * MiB, warmup: int = 2,
               repeats: int = 10, streams: tuple[int, ...] = (1, 2, 4)) -> dict[str, Any]:
    """The PCIe link's floor for moving ``nbytes_in`` to the GPU and ``nbytes_out`` back, from
    pinned memory: H2D alone, D2H alone and both at once, timed with CUDA events.

    Each is measured as the real size (scaled down together to at most ``probe_cap`` bytes, where
    the rate has flattened, and scaled back up) split into ``k`` equal copies on ``k`` streams per
    direction, for each ``k`` in ``streams``: one copy runs on one copy engine, which need not
    fill the link, and a pipeline keeps several copies in flight. A floor is what the link has
    been seen to do, so it takes each measurement's fastest repeat (``*_min_ms``; the medians
    are ``link_h2d_ms``, ``link_d2h_ms`` and ``link_duplex_ms``): the least over ``k`` of
    ``min(both at once, H2D then D2H)`` is ``link_floor_ms``, with ``link_floor_streams`` the
    ``k`` that gave it and ``link_by_streams`` every ``k``'s figures. The top-level
    ``link_h2d_*``, ``link_d2h_*`` and ``link_duplex_*`` keys are the best ``k``'s. Keys are
    prefixed ``link_``; GB/s are 1e9 bytes per second (``link_duplex_GBps`` counts both
    directions' bytes).
    """
    torch = _torch()
    nin, nout = int(nbytes_in), int(nbytes_out)
    if nin < 0 or nout < 0 or nin + nout == 0:
        raise ValueError("link_floor needs a positive byte count in at least one direction")
    if not streams or any(not isinstance(k, int) or k < 1 for k in streams):
        raise ValueError(f"streams must be positive copy counts per direction, got {streams!r}")
    scale = min(1.0, probe_cap / max(nin, nout))
    pin, pout = int(nin * scale), int(nout * scale)
    rng = np.random.default_rng()
    h_in = _pinned(torch, max(pin, 1), torch.uint8)
    h_out = _pinned(torch, max(pout, 1), torch.uint8)
    h_in.numpy()[:] = np.frombuffer(rng.bytes(h_in.numel()), np.uint8)
    d_in = torch.empty(max(pin, 1), dtype=torch.uint8, device="cuda")
    d_out = torch.randint(0, 256, (max(pout, 1),), dtype=torch.uint8, device="cuda")
    most = max(streams)
    s_in = [torch.cuda.Stream() for _ in range(most)]
    s_out = [torch.cuda.Stream() for _ in range(most)]
    e0, e1, join = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True), torch.cuda.Event()
    torch.cuda.synchronize()

    def timed(h2d: bool, d2h: bool, k: int) -> list[float]:
        ms = []
        copies = ([(s, d_in[lo:hi], h_in[lo:hi]) for s, (lo, hi) in zip(s_in, _split(pin, k))] if h2d and pin else []) + \
                 ([(s, h_out[lo:hi], d_out[lo:hi]) for s, (lo, hi) in zip(s_out, _split(pout, k))] if d2h and pout else [])
        base = s_in[0]
        for i in range(warmup + repeats):
            e0.record(base)
            for s, _dst, _src in copies:
                s.wait_event(e0)
            for s, dst, src in copies:
                with torch.cuda.stream(s):
                    dst.copy_(src, non_blocking=True)
            for s, _dst, _src in copies:
                join.record(s)
                base.wait_event(join)
            e1.record(base)
            e1.synchronize()
            if i >= warmup:
                ms.append(e0.elapsed_time(e1))
        return ms

    res: dict[str, Any] = {"link_bytes_in": nin, "link_bytes_out": nout, "link_probe_bytes_in": pin,
                           "link_probe_bytes_out": pout, "link_timing": "cuda_events", "link_by_streams": {}}
    best = None
    for k in streams:
        one: dict[str, Any] = {}
        for key, nbytes, h2d, d2h in (("h2d", pin, True, False), ("d2h", pout, False, True),
                                      ("duplex", pin + pout, True, True)):
            if (h2d and not pin) or (d2h and not pout) or (key == "duplex" and not (pin and pout)):
                continue
            t = _stats(timed(h2d, d2h, k))
            one[f"link_{key}_ms"] = t["ms_median"] / scale
            one[f"link_{key}_min_ms"] = t["ms_min"] / scale
            one[f"link_{key}_GBps"] = nbytes / (t["ms_median"] * 1e6)
            one[f"link_{key}_spread_ms"] = [t["ms_p10"] / scale, t["ms_p90"] / scale]
        serial_ms = one.get("link_h2d_min_ms", 0.0) + one.get("link_d2h_min_ms", 0.0)
        one["link_floor_ms"] = min(one["link_duplex_min_ms"], serial_ms) if "link_duplex_min_ms" in one else serial_ms
        res["link_by_streams"][str(k)] = one
        if best is None or one["link_floor_ms"] < best[1]["link_floor_ms"]:
            best = (k, one)
    res.update(best[1])
    res["link_floor_streams"] = best[0]
    # the round trip moved the right bytes
    with torch.cuda.stream(s_in[0]):
        d_in.copy_(h_in, non_blocking=True)
        back = _pinned(torch, d_in.numel(), torch.uint8)
        back.copy_(d_in, non_blocking=True)
    s_in[0].synchronize()
    res["link_correct"] = bool(np.array_equal(back.numpy()[:pin], h_in.numpy()[:pin]))
    return res


def _aligned_empty(nbytes: int) -> np.ndarray:
    """An untouched, page-aligned uint8 array (large allocations are fresh mmap'd pages)."""
    raw = np.empty(nbytes + PAGE, dtype=np.uint8)
    off = (-raw.ctypes.data) % PAGE
    return raw[off:off + nbytes]


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges of ``n`` bytes, page-aligned boundaries."""
    pages = -(-n // PAGE)
    out = []
    for i in range(parts):
        lo, hi = min(n, pages * i // parts * PAGE), min(n, pages * (i + 1) // parts * PAGE)
        if hi > lo:
            out.append((lo, hi))
    return out


def _parallel(pool: concurrent.futures.ThreadPoolExecutor, ranges, fn) -> None:
    futures = [pool.submit(fn, lo, hi) for lo, hi in ranges]
    for f in futures:
        f.result()


def _host_register_api():
    """(register(ptr, nbytes), unregister(ptr)) through CuPy's runtime, else cuda.bindings."""
    try:
        cupy = _cupy()
        rt = cupy.cuda.runtime
        return (lambda p, n: rt.hostRegister(p, n, 0)), (lambda p: rt.hostUnregister(p)), "cupy.cuda.runtime"
    except BaselineUnavailable:
        pass
    try:
        from cuda.bindings import runtime as crt
    except Exception as exc:  # noqa: BLE001
        raise BaselineUnavailable(f"neither CuPy nor cuda.bindings can call cudaHostRegister ({exc})") from None

    def reg(p, n):
        (err,) = crt.cudaHostRegister(p, n, 0)
        if err != crt.cudaError_t.cudaSuccess:
            raise RuntimeError(f"cudaHostRegister failed: {err}")

    def unreg(p):
        (err,) = crt.cudaHostUnregister(p)
        if err != crt.cudaError_t.cudaSuccess:
            raise RuntimeError(f"cudaHostUnregister failed: {err}")

    return reg, unreg, "cuda.bindings.runtime"


def host_floor(nbytes: int, *, threads: Sequence[int] = (1, 4, 8, 16), touch_threads: Sequence[int] = (1, 16),
               repeats: int = 3, warmup: int = 1) -> dict[str, Any]:
    """The host side of the pageable path, for ``nbytes`` in and ``nbytes`` out:

    * ``host_copy_in_GBps[t]``: parallel ``np.copyto`` (releases the GIL) from a touched
      pageable array into pinned memory on ``t`` threads; ``host_copy_out_GBps[t]``: pinned into
      a touched pageable array; ``host_copy_out_fresh_GBps[t]``: pinned into a fresh array
      (the first touch of its pages is part of the copy, as for a new output array);
    * ``host_register_touched_ms`` / ``host_unregister_touched_ms`` and ``..._fresh_ms``:
      cudaHostRegister / cudaHostUnregister of a touched and of a fresh (never touched) array;
    * ``host_first_touch_ms[t]``: writing every page of a fresh array on ``t`` threads, and
      ``host_fill_touched_ms[t]`` the same write to pages already touched (the difference is the
      page-fault cost);
    * estimates of the host time of the two strategies: ``host_staging_ms_estimate`` (copy in +
      copy out into a fresh array, each at its best thread count) and
      ``host_register_ms_estimate`` (register a touched input and a fresh output, unregister both).

    Thread-count keys are strings (JSON). Median of ``repeats`` after ``warmup``.
    """
    nbytes = int(nbytes)
    if nbytes < PAGE:
        raise ValueError(f"host_floor needs at least {PAGE} bytes, got {nbytes}")
    torch = None
    try:
        torch = _torch()
    except BaselineUnavailable:
        _cupy()  # pinned memory from CuPy instead; raises if neither is usable
    register, unregister, reg_api = _host_register_api()
    if torch is not None:
        pin_t = _pinned(torch, nbytes, torch.uint8)
        pin = pin_t.numpy()
    else:
        import cupy

        pin_mem = cupy.cuda.alloc_pinned_memory(nbytes)
        pin = np.frombuffer(pin_mem, np.uint8, nbytes)
    src = _aligned_empty(nbytes)
    src[:] = 0x5A  # touched (every page written), non-zero; a copy's speed does not depend on the values
    back = _aligned_empty(nbytes)
    back[:] = 0xA5
    pin[:] = 0x3C

    max_t = max(max(threads), max(touch_threads))
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_t)
    res: dict[str, Any] = {"host_bytes": nbytes, "host_cpus": os.cpu_count(), "host_register_api": reg_api,
                           "host_timing": "host_clock"}

    def rate_runs(fn_make, t) -> tuple[float, list[float]]:
        """Median seconds of fn(ranges) over repeats; fn_make() -> (callable, cleanup) per run."""
        ranges = _split(nbytes, t)
        samples = []
        for i in range(warmup + repeats):
            fn, after = fn_make()
            t0 = time.perf_counter()
            _parallel(pool, ranges, fn)
            dt = time.perf_counter() - t0
            after()
            if i >= warmup:
                samples.append(dt)
        return float(np.median(samples)), samples

    def gbps(sec):
        return nbytes / sec / 1e9

    copy_in, copy_out, copy_out_fresh = {}, {}, {}
    for t in threads:
        sec, _ = rate_runs(lambda: ((lambda lo, hi: np.copyto(pin[lo:hi], src[lo:hi])), lambda: None), t)
        copy_in[str(t)] = gbps(sec)
        sec, _ = rate_runs(lambda: ((lambda lo, hi: np.copyto(back[lo:hi], pin[lo:hi])), lambda: None), t)
        copy_out[str(t)] = gbps(sec)

        def fresh_copy():
            dst = _aligned_empty(nbytes)
            return (lambda lo, hi: np.copyto(dst[lo:hi], pin[lo:hi])), (lambda: None)

        sec, _ = rate_runs(fresh_copy, t)
        copy_out_fresh[str(t)] = gbps(sec)
    res["host_copy_in_GBps"] = copy_in
    res["host_copy_out_GBps"] = copy_out
    res["host_copy_out_fresh_GBps"] = copy_out_fresh

    first, touched = {}, {}
    for t in touch_threads:
        holder: dict[str, np.ndarray] = {}

        def fresh_fill():
            holder["a"] = a = _aligned_empty(nbytes)
            return (lambda lo, hi: np.copyto(a[lo:hi], np.uint8(1))), (lambda: None)

        sec, _ = rate_runs(fresh_fill, t)
        first[str(t)] = sec * 1e3
        a = holder.pop("a")
        sec, _ = rate_runs(lambda: ((lambda lo, hi: np.copyto(a[lo:hi], np.uint8(2))), lambda: None), t)
        touched[str(t)] = sec * 1e3
    res["host_first_touch_ms"] = first
    res["host_fill_touched_ms"] = touched
    pool.shutdown(wait=True)

    # registration: warm the context and the call path on a small array first
    small = _aligned_empty(1 * MiB)
    small[:] = 1
    register(small.ctypes.data, small.nbytes)
    unregister(small.ctypes.data)
    def register_cycle(ptr: int) -> tuple[float, float]:
        """Seconds to register ``nbytes`` at ``ptr``, then to unregister them."""
        t0 = time.perf_counter()
        register(ptr, nbytes)
        t1 = time.perf_counter()
        unregister(ptr)
        return t1 - t0, time.perf_counter() - t1

    reg_t, unreg_t, reg_f, unreg_f = [], [], [], []
    for _ in range(repeats):
        r, u = register_cycle(src.ctypes.data)
        reg_t.append(r)
        unreg_t.append(u)
        fresh = _aligned_empty(nbytes)
        r, u = register_cycle(fresh.ctypes.data)
        reg_f.append(r)
        unreg_f.append(u)
        del fresh
    res["host_register_touched_ms"] = float(np.median(reg_t)) * 1e3
    res["host_unregister_touched_ms"] = float(np.median(unreg_t)) * 1e3
    res["host_register_fresh_ms"] = float(np.median(reg_f)) * 1e3
    res["host_unregister_fresh_ms"] = float(np.median(unreg_f)) * 1e3

    best_in = max(copy_in.values())
    best_out_fresh = max(copy_out_fresh.values())
    res["host_staging_ms_estimate"] = (nbytes / best_in + nbytes / best_out_fresh) / 1e6
    res["host_register_ms_estimate"] = (res["host_register_touched_ms"] + res["host_register_fresh_ms"]
                                        + res["host_unregister_touched_ms"] + res["host_unregister_fresh_ms"])
    return res


def staging_floor(nbytes: int, *, splits: Sequence[tuple[int, int]] = ((8, 8), (6, 10)), chunk: int = 16 * MiB,
                  ring_slots: int = 16, repeats: int = 3, with_link: bool = True) -> dict[str, Any]:
    """All of the staged pageable path's memory work at once, with no pipeline around it: ``t_in``
    threads copy a touched pageable array into a pinned ring, ``t_out`` threads copy a pinned ring
    into a fresh pageable array (its pages faulted in by the copy), and — with ``with_link`` —
    the GPU moves ``nbytes`` pinned->device and ``nbytes`` device->pinned on two streams, all
    started together. Nothing waits on anything else, so no schedule of the same work can finish
    sooner: this is the staged path's floor when its parts share the host's memory bandwidth
    (``host_floor`` times each part alone and adds them, which assumes they do not). The CPU
    copies are made three ways, numpy's ``copyto``, the C library's ``memmove``, and ringflow's
    native copy on one thread (``native``, where it is built: streaming stores for long parts,
    which skip reading each destination line first), and the floor is the fastest. Each is a
    floor only for work done with that copy: ringflow's staged path, whose copies use streaming
    stores, beat a floor made of the first two (numpy's copy loop alone moved a fifth less on
    some hosts).

    Returns ``staging_together_ms[f"{t_in}+{t_out} {how}"]`` (median wall time, host clock) per
    split and copy (``numpy``, ``memmove``, ``native``),
    ``staging_together_best_ms`` (the fastest of those medians), ``staging_together_fastest_ms``
    (the fastest single run of any split and copy: the floor a median of the staged path is held
    to, since the host's memory bandwidth drifts from one second to the next and a median of
    three runs of the floor's work can land on a slow stretch that the path's own runs missed),
    ``staging_host_part_ms`` (when the CPU copies finished, median
    over every run) and, with the link, ``staging_link_alone_ms`` (the GPU's copies on an idle host,
    CUDA events)."""
    torch = _torch()
    nbytes = int(nbytes)
    slot = min(int(chunk), nbytes)
    pin_in_t = _pinned(torch, slot * ring_slots, torch.uint8)
    pin_out_t = _pinned(torch, slot * ring_slots, torch.uint8)
    pin_in, pin_out = pin_in_t.numpy(), pin_out_t.numpy()
    src = _aligned_empty(nbytes)
    src[:] = 0x5A
    pin_in[:] = 1
    pin_out[:] = 2
    dev_in = torch.empty(slot * ring_slots, dtype=torch.uint8, device="cuda")
    dev_out = torch.ones(slot * ring_slots, dtype=torch.uint8, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    chunks = [(lo, min(nbytes, lo + slot)) for lo in range(0, nbytes, slot)]

    def link_start(done: torch.cuda.Event):
        for i, (lo, hi) in enumerate(chunks):
            k = (i % ring_slots) * slot
            with torch.cuda.stream(s1):
                dev_in[k:k + hi - lo].copy_(pin_in_t[k:k + hi - lo], non_blocking=True)
            with torch.cuda.stream(s2):
                pin_out_t[k:k + hi - lo].copy_(dev_out[k:k + hi - lo], non_blocking=True)
        s1.wait_stream(s2)
        done.record(s1)

    res: dict[str, Any] = {"staging_bytes": nbytes, "staging_chunk": slot, "staging_ring_slots": ring_slots,
                           "staging_with_link": with_link, "staging_timing": "host_clock"}
    together: dict[str, float] = {}
    fastest = math.inf
    link_ms: list[float] = []
    host_ms: list[float] = []
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(a + b for a, b in splits))
    try:
        def numpy_copy(dst, src):
            np.copyto(dst, src)

        def c_copy(dst, src):  # ctypes lets go of the GIL for the call
            ctypes.memmove(dst.ctypes.data, src.ctypes.data, dst.nbytes)

        def copy_in(part, copy):
            for lo, hi in part:
                k = ((lo // slot) % ring_slots) * slot
                copy(pin_in[k:k + hi - lo], src[lo:hi])

        def copy_out(part, dst, copy):
            for lo, hi in part:
                k = ((lo // slot) % ring_slots) * slot
                copy(dst[lo:hi], pin_out[k:k + hi - lo])

        for (t_in, t_out), (how, copy) in itertools.product(splits, _staging_copies(numpy_copy, c_copy)):
            samples = []
            in_parts = [chunks[j::t_in] for j in range(t_in)]
            out_parts = [chunks[j::t_out] for j in range(t_out)]
            for i in range(repeats + 1):
                dst = _aligned_empty(nbytes)  # fresh pages every run, as a new output array has
                torch.cuda.synchronize()
                done = torch.cuda.Event()
                t0 = time.perf_counter()
                if with_link:
                    link_start(done)
                futures = ([pool.submit(copy_in, p, copy) for p in in_parts]
                           + [pool.submit(copy_out, p, dst, copy) for p in out_parts])
                for f in futures:
                    f.result()
                t_host = time.perf_counter()
                if with_link:
                    done.synchronize()
                t1 = time.perf_counter()
                if i:  # the first run warms the pool, the pinned pages and the copy path
                    samples.append(t1 - t0)
                    host_ms.append((t_host - t0) * 1e3)
                del dst
            together[f"{t_in}+{t_out} {how}"] = float(np.median(samples)) * 1e3
            fastest = min(fastest, min(samples) * 1e3)
        if with_link:
            # the link's copies alone, events around them, for comparison
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _ in range(repeats):
                torch.cuda.synchronize()
                e0.record(s1)
                s2.wait_event(e0)
                link_start(e1)
                e1.synchronize()
                link_ms.append(e0.elapsed_time(e1))
    finally:
        pool.shutdown(wait=True)
    res["staging_together_ms"] = together
    res["staging_together_best_ms"] = min(together.values())
    res["staging_together_fastest_ms"] = fastest
    res["staging_host_part_ms"] = float(np.median(host_ms))
    if link_ms:
        res["staging_link_alone_ms"] = float(np.median(link_ms))
    return res


def _staging_copies(numpy_copy: Callable, c_copy: Callable) -> list:
    """The CPU copies :func:`staging_floor` times, as ``(name, copy(dst, src))``: numpy's,
    ``memmove``'s, and ringflow's native copy on the calling thread where it is built."""
    from .._device import native_copy

    copies = [("numpy", numpy_copy), ("memmove", c_copy)]
    if native_copy.copier() is not None:
        def native(dst, src):
            if not native_copy.copy(dst, src, 1):
                raise RuntimeError("the native copier refused a copy of two C-contiguous byte arrays")
        copies.append(("native", native))
    return copies


# -- 5. request streams ---------------------------------------------------------------------------
# A request server in these baselines is single-threaded and has four calls: ``submit(i, item)``
# (start request ``i``, first completing the oldest if it must), ``poll()`` (complete the oldest
# request if its work is done; True if it did), ``advance(t)`` (make progress until the clock
# reads ``t``) and ``drain()`` (complete everything in flight). It records, per request, when
# ``submit`` was entered and when the result was a fresh numpy array.
def scale_shift_expected(a: np.ndarray) -> np.ndarray:
    """``a*2+1`` in float32, as numpy computes it: what the ``requests`` workload checks every
    result against, bit for bit."""
    return a * np.float32(2) + np.float32(1)


def open_loop(clock: Callable[[], float], gaps: Sequence[float], submit: Callable[[int], Any],
              advance: Callable[[float], Any]) -> tuple[np.ndarray, np.ndarray]:
    """Open-loop arrivals: request ``i`` arrives ``sum(gaps[:i + 1])`` seconds after the start;
    ``advance(t)`` makes progress until ``clock()`` reads ``t`` (returning at once if it already
    does), then ``submit(i)`` runs. A request that arrives while the previous ``submit`` still
    blocks is submitted as soon as it returns, so its latency must count from its arrival, not
    from its submit: a server that falls behind would otherwise hide its queue.

    Returns ``(arrived, submitted)``: the clock readings (seconds) at which each request
    arrived and at which its ``submit`` began (float64 arrays)."""
    arrived = np.zeros(len(gaps))
    submitted = np.zeros(len(gaps))
    arrival = clock()
    for i, gap in enumerate(gaps):
        arrival += gap
        advance(arrival)
        arrived[i] = arrival
        submitted[i] = clock()
        submit(i)
    return arrived, submitted


class _Recorder:
    """Per-request times and results of a request server (see the comment above ``open_loop``)."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.reset(0)

    def reset(self, count: int) -> None:
        """Forget every result and time; make room for requests ``0 .. count - 1``."""
        self.results: list[Any] = [None] * count
        self.submitted = np.full(count, np.nan)
        self.done = np.full(count, np.nan)

    def latencies(self) -> np.ndarray:
        """Seconds from entering ``submit`` to the result, per request (NaN: not completed)."""
        return self.done - self.submitted


class SyncServer(_Recorder):
    """Runs each request to completion inside ``submit``: ``call(item) -> result``."""

    def __init__(self, call: Callable[[np.ndarray], np.ndarray], clock: Callable[[], float] = time.perf_counter):
        super().__init__(clock)
        self.call = call

    def submit(self, i: int, item: np.ndarray) -> None:
        self.submitted[i] = self.clock()
        self.results[i] = self.call(item)
        self.done[i] = self.clock()

    def poll(self) -> bool:
        return False

    def advance(self, t: float) -> None:
        while self.clock() < t:  # nothing in flight: wait for the arrival, as a server would
            pass

    def drain(self) -> None:
        pass

    @property
    def in_flight(self) -> int:
        return 0


class RingServer(_Recorder):
    """Up to ``slots`` requests in flight over a ring of ``slots`` buffers, completed oldest first.

    Request after request takes the next slot round the ring; when all ``slots`` are in flight,
    ``submit`` first completes the oldest, whose slot is the one it needs (completion is in
    submission order, so the oldest request always holds the next slot). ``backend`` does the
    work: ``start(slot, item)`` enqueues it, ``ready(slot)`` says whether it is done without
    waiting, ``finish(slot) -> result`` waits for it and returns a fresh array.
    """

    def __init__(self, backend: Any, slots: int, clock: Callable[[], float] = time.perf_counter):
        (self.slots,) = _counts(slots, "slots")
        super().__init__(clock)
        self.backend = backend
        self._pending: collections.deque = collections.deque()  # (request, slot), oldest first
        self._next = 0

    def submit(self, i: int, item: np.ndarray) -> None:
        self.submitted[i] = self.clock()
        if len(self._pending) == self.slots:
            self._complete_oldest()
        slot = self._next
        self._next = (slot + 1) % self.slots
        self.backend.start(slot, item)
        self._pending.append((i, slot))

    def poll(self) -> bool:
        if self._pending and self.backend.ready(self._pending[0][1]):
            self._complete_oldest()
            return True
        return False

    def advance(self, t: float) -> None:
        while self.clock() < t:
            self.poll()

    def drain(self) -> None:
        while self._pending:
            self._complete_oldest()

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def _complete_oldest(self) -> None:
        i, slot = self._pending.popleft()
        self.results[i] = self.backend.finish(slot)
        self.done[i] = self.clock()


class HandlerThreads:
    """A thread-safe request server's ``submit`` run on ``threads`` handler threads, as a threaded
    server runs each request on a free handler: the arrival thread's ``submit(i, item)`` puts the
    request on one first-in first-out queue and returns; a free handler takes the oldest and
    calls ``server.submit``. Latency still counts from the arrival (``open_loop``); the hand-off
    to a handler is part of it, in isolation as under load. ``drain`` waits until every request
    handed in has been submitted, then drains ``server``; a handler's exception is raised there.
    Times, results and ``advance`` are ``server``'s."""

    def __init__(self, server: Any, threads: int):
        (self.threads,) = _counts(threads, "threads")
        self.server = server
        self.clock = server.clock
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._handed = self._taken = 0
        self._errors: list[BaseException] = []
        self._handlers = [threading.Thread(target=self._handle, name=f"request-handler-{k}", daemon=True)
                          for k in range(self.threads)]
        for t in self._handlers:
            t.start()

    def _handle(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self.server.submit(*job)
            except BaseException as exc:  # noqa: BLE001 - raised by drain on the measuring thread
                self._errors.append(exc)
            with self._cv:
                self._taken += 1
                self._cv.notify_all()

    def submit(self, i: int, item: np.ndarray) -> None:
        self._handed += 1
        self._queue.put((i, item))

    def advance(self, t: float) -> None:
        self.server.advance(t)

    def drain(self) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._taken == self._handed)
        if self._errors:
            raise self._errors[0]
        self.server.drain()

    def reset(self, count: int) -> None:
        self.server.reset(count)

    def latencies(self) -> np.ndarray:
        return self.server.latencies()

    @property
    def results(self) -> list:
        return self.server.results

    @property
    def done(self) -> np.ndarray:
        return self.server.done

    def close(self) -> None:
        """Stop the handlers (after ``drain``)."""
        for _ in self._handlers:
            self._queue.put(None)
        for t in self._handlers:
            t.join()


def _percentile_ms(seconds: np.ndarray, q: float) -> float:
    return 1e3 * float(np.percentile(seconds, q))


def measure_request_server(server: Any, items: Sequence[np.ndarray], expected: Sequence[np.ndarray], *,
                           warmup: int = 30, loads: Sequence[float] = (0.8,), passes: int = 3,
                           seed: int = 11) -> dict[str, Any]:
    """The ``requests`` workload's measurements of a request server over ``items``: one method
    for ringflow and every baseline.

    * isolated latency: each request alone (submitted, drained, its result checked and
      dropped), p50/p99 in ms;
    * capacity: every request submitted as fast as the server takes them, then drained; requests
      per second, the median of ``passes`` passes;
    * at each load in ``loads`` (a fraction of that capacity): open-loop arrivals with
      exponential gaps (:func:`open_loop`), latency from each request's arrival to its result,
      p50/p99 in ms and the p99 over the isolated p99 (also the p50/p99 from entering ``submit``,
      which leaves out the time a request waited for the server to take it), the p99 of each
      request's loaded over isolated latency, the garbage collector's runs during the level
      (count, longest in ms), the five slowest requests, and what a perfect server of the
      measured capacity would give the same arrivals (:func:`queue_floor`: its p99 over the
      isolated p99, ``[every request holding the queue alike, in proportion to its bytes]``), and
      the level's p99 over each of those p99s (``p99_over_perfect_fifo``: how far the server is
      from a perfect queue, whatever the arrivals' bursts make of the ratio to the isolated p99).

    Every request runs once first, outside the capacity (a framework's caching allocator takes
    device memory, and ringflow's host pool pinned memory, the first time it meets each request
    size, and that is set-up, not the steady state asked about; its rate is reported as
    ``cold_pass_per_s``), and ``warmup`` requests again before each load.
    Every result of every measured run is compared with ``expected`` bit for bit (``correct``),
    after the run."""
    count = len(items)
    if count < 1 or len(expected) != count:
        raise ValueError(f"need at least one request and one expected result per request, got {count} requests "
                         f"and {len(expected)} expected results")
    clock = server.clock
    ok = True

    def warm(n: int) -> None:
        server.reset(count)
        for i, it in enumerate(items[:n]):
            server.submit(i, it)
        server.drain()

    def matches(r, e) -> bool:
        return r is not None and r.shape == e.shape and bool(np.array_equal(r, e))

    def check() -> bool:
        good = all(matches(r, e) for r, e in zip(server.results, expected))
        server.reset(count)  # drop the results: a pass holds every output until it is checked
        return good

    t0 = clock()
    warm(count)
    cold = count / (clock() - t0)
    server.reset(count)
    for i, it in enumerate(items):
        server.submit(i, it)
        server.drain()
        # each result checked and dropped as it comes back, as a server hands it on: a request
        # alone has no other's results held around it
        ok &= matches(server.results[i], expected[i])
        server.results[i] = None
    iso = server.latencies()
    server.reset(count)
    rates = []
    for _ in range(passes):
        t0 = clock()
        for i, it in enumerate(items):
            server.submit(i, it)
        server.drain()
        rates.append(count / (clock() - t0))
        ok &= check()
    capacity = float(np.median(rates))
    rng = np.random.default_rng(seed)
    levels = []
    for load in loads:
        rate = float(load) * capacity
        gaps = rng.exponential(1.0 / rate, count)
        warm(warmup)
        server.reset(count)
        with gc_pauses() as pauses:
            arrived, submitted = open_loop(clock, gaps, lambda i: server.submit(i, items[i]), server.advance)
            server.drain()
        lat = server.done - arrived
        from_submit = server.latencies()
        good = check()
        ok &= good
        start = arrived[0] - gaps[0]
        floor = queue_floor(arrived, iso, [it.nbytes for it in items], capacity)
        levels.append({"load": float(load), "offered_per_s": rate, "p50_ms": _percentile_ms(lat, 50),
                       "p99_ms": _percentile_ms(lat, 99), "p99_over_isolated": float(np.percentile(lat, 99)
                                                                                     / np.percentile(iso, 99)),
                       "p50_from_submit_ms": _percentile_ms(from_submit, 50),
                       "p99_from_submit_ms": _percentile_ms(from_submit, 99),
                       "p99_slowdown_per_request": float(np.percentile(lat / iso, 99)), "correct": good,
                       "gc_pauses": len(pauses), "gc_pause_max_ms": 1e3 * max(pauses, default=0.0),
                       "perfect_fifo_p99_over_isolated": [float(np.percentile(f, 99) / np.percentile(iso, 99))
                                                          for f in floor],
                       "p99_over_perfect_fifo": [float(np.percentile(lat, 99) / np.percentile(f, 99)) for f in floor],
                       "slowest": [{"request": int(i), "arrived_ms": 1e3 * float(arrived[i] - start),
                                    "submitted_ms": 1e3 * float(submitted[i] - start),
                                    "latency_ms": 1e3 * float(lat[i]), "bytes": int(items[i].nbytes)}
                                   for i in np.argsort(lat)[::-1][:5]]})
    return {"requests": count, "capacity_per_s": capacity, "capacity_passes_per_s": rates, "cold_pass_per_s": cold,
            "isolated_p50_ms": _percentile_ms(iso, 50), "isolated_p99_ms": _percentile_ms(iso, 99),
            "levels": levels, "correct": bool(ok), "timing": "host_clock"}


def queue_floor(arrived: np.ndarray, isolated: np.ndarray, nbytes: Sequence[int],
                capacity: float) -> tuple[np.ndarray, np.ndarray]:
    """The latencies (seconds) a perfect server of ``capacity`` requests a second would give
    requests arriving at ``arrived`` (seconds): one first-in first-out queue with no stall, each
    request waiting for those before it and then taking its own ``isolated`` latency. How long a
    request holds the queue is not known, so two cases bracket it: every request for the same
    time, and each for a time in proportion to its ``nbytes`` (both ``1 / capacity`` on average).
    No real server of that capacity can do better than the first at high percentiles; the
    second is what one bound by its copies would give.

    Returns:
        ``(fixed, by_size)``: the per-request latencies of the two cases.
    """
    fixed, by_size = request_holds(nbytes, capacity)
    return fifo_waits(arrived, fixed) + isolated, fifo_waits(arrived, by_size) + isolated


def request_holds(nbytes: Sequence[int], capacity: float) -> tuple[np.ndarray, np.ndarray]:
    """How long each request holds a server of ``capacity`` requests a second (seconds), in the
    two cases :func:`queue_floor` brackets: ``(alike, by_size)``, every request ``1 / capacity``,
    and each in proportion to its ``nbytes`` (the same mean)."""
    nbytes = np.asarray(nbytes, dtype=np.float64)
    return np.full(len(nbytes), 1.0 / capacity), nbytes / nbytes.mean() / capacity


def fifo_waits(arrived: np.ndarray, hold: np.ndarray) -> np.ndarray:
    """Seconds each request arriving at ``arrived`` (seconds, rising) waits in one first-in
    first-out queue whose server each holds for ``hold`` (seconds)."""
    wait = np.zeros(len(arrived))
    free = -np.inf
    for i, t in enumerate(arrived):
        begin = max(t, free)
        wait[i] = begin - t
        free = begin + hold[i]
    return wait


@contextlib.contextmanager
def gc_pauses():
    """Durations (host seconds) of the garbage collector's runs inside the block, as a list
    filled in as they happen: a request that waits behind one shows its whole length as
    latency."""
    pauses: list[float] = []
    started: list[float] = []

    def note(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append(time.perf_counter() - started.pop())

    gc.callbacks.append(note)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(note)


def _request_row(name: str, measured: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A result of :func:`measure_request_server` as a bench row: capacity, isolated latency
    and, at the first load measured, p50/p99 at top level."""
    row = {"name": name, **measured, **extra}
    if measured["levels"]:
        first = measured["levels"][0]
        row.update({"load": first["load"], "p50_ms": first["p50_ms"], "p99_ms": first["p99_ms"],
                    "p99_over_isolated": first["p99_over_isolated"]})
    return row


def _torch_scale_shift(torch):
    """``compute(x, y, stream=None)``: ``y = 1 + 2*x`` in one elementwise kernel
    (``torch.add(one, x, alpha=2)``). ``2*x`` is exact in float32, so the one rounding of the
    sum makes it equal to numpy's ``x*2+1`` bit for bit, with or without an FMA."""
    one = torch.ones((), dtype=torch.float32, device="cuda")

    def compute(x, y=None):
        return torch.add(one, x, alpha=2.0, out=y) if y is not None else torch.add(one, x, alpha=2.0)

    return compute


def _bit_exact_sample(torch, compute) -> bool:
    """``compute`` against :func:`scale_shift_expected` on a sample that includes values whose
    sum ``2x + 1`` needs rounding."""
    x = np.random.default_rng(17).uniform(0.5, 1.5, 1 << 16).astype(np.float32)
    got = compute(torch.from_numpy(x).cuda()).cpu().numpy()
    return bool(np.array_equal(got, scale_shift_expected(x)))


def _request_items(items: Sequence[np.ndarray], expected: Sequence[np.ndarray] | None):
    items = [_as_f32(a) for a in items]
    if not items:
        raise ValueError("need at least one request")
    return items, ([scale_shift_expected(a) for a in items] if expected is None else list(expected))


def torch_requests_naive(items: Sequence[np.ndarray], expected: Sequence[np.ndarray] | None = None, *,
                         warmup: int = 30, loads: Sequence[float] = (0.8,), passes: int = 3) -> dict[str, Any]:
    """The request stream the way people write it today: per request
    ``torch.from_numpy(a).cuda()``, ``y = 1 + 2*x`` on the current stream, ``.cpu().numpy()``
    (pageable copies, one request at a time). ``items``: 1-D float32 arrays; ``expected``
    (default ``a*2+1``): what each result must equal bit for bit.

    Returns :func:`measure_request_server`'s figures (capacity in requests/s, latency in ms on
    the host clock), with p50/p99 at the first of ``loads`` at top level."""
    items, expected = _request_items(items, expected)
    torch = _torch()
    compute = _torch_scale_shift(torch)
    exact = _bit_exact_sample(torch, compute)

    def call(a: np.ndarray) -> np.ndarray:
        return compute(torch.from_numpy(a).cuda()).cpu().numpy()

    torch.cuda.synchronize()
    measured = measure_request_server(SyncServer(call), items, expected, warmup=warmup, loads=loads, passes=passes)
    return _request_row("torch_requests_naive", measured, compute="torch.add(1, x, alpha=2)",
                        compute_bit_exact_on_sample=exact, host="pageable", in_flight=1)


class _TorchRingBackend:
    """The buffers and streams of the hand-written ring: per slot a pinned input and output of
    ``slot_floats`` float32 and a device input and output; an H2D stream, a compute stream and
    a D2H stream; per slot an event after each of the three steps."""

    def __init__(self, torch, slots: int, slot_floats: int, compute):
        self.torch, self.compute = torch, compute
        self.p_in = [_pinned(torch, slot_floats) for _ in range(slots)]
        self.p_out = [_pinned(torch, slot_floats) for _ in range(slots)]
        self.a_in = [p.numpy() for p in self.p_in]
        self.a_out = [p.numpy() for p in self.p_out]
        self.d_in = [torch.empty(slot_floats, dtype=torch.float32, device="cuda") for _ in range(slots)]
        self.d_out = [torch.empty(slot_floats, dtype=torch.float32, device="cuda") for _ in range(slots)]
        self.h2d, self.comp, self.d2h = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
        self.copied_in = [torch.cuda.Event() for _ in range(slots)]
        self.computed = [torch.cuda.Event() for _ in range(slots)]
        self.copied_out = [torch.cuda.Event() for _ in range(slots)]
        self.shape: list[tuple] = [()] * slots
        self.slot_floats = slot_floats
        torch.cuda.synchronize()

    def start(self, slot: int, item: np.ndarray) -> None:
        torch, n = self.torch, item.size
        if n > self.slot_floats:
            raise ValueError(f"a request of {item.nbytes} bytes does not fit a slot of {self.slot_floats * 4} bytes; "
                             f"raise slot_bytes")
        # the slot's previous request is complete (the ring waited for it), so its buffers are free
        np.copyto(self.a_in[slot][:n], item.reshape(-1))
        with torch.cuda.stream(self.h2d):
            self.d_in[slot][:n].copy_(self.p_in[slot][:n], non_blocking=True)
            self.copied_in[slot].record(self.h2d)
        self.comp.wait_event(self.copied_in[slot])
        with torch.cuda.stream(self.comp):
            self.compute(self.d_in[slot][:n], self.d_out[slot][:n])
            self.computed[slot].record(self.comp)
        self.d2h.wait_event(self.computed[slot])
        with torch.cuda.stream(self.d2h):
            self.p_out[slot][:n].copy_(self.d_out[slot][:n], non_blocking=True)
            self.copied_out[slot].record(self.d2h)
        self.shape[slot] = item.shape

    def ready(self, slot: int) -> bool:
        return bool(self.copied_out[slot].query())

    def finish(self, slot: int) -> np.ndarray:
        self.copied_out[slot].synchronize()
        shape = self.shape[slot]
        y = np.empty(shape, np.float32)
        np.copyto(y.reshape(-1), self.a_out[slot][:y.size])
        return y


def torch_requests_ring(items: Sequence[np.ndarray], expected: Sequence[np.ndarray] | None = None, *,
                        slots: int = 4, slot_bytes: int | None = None, warmup: int = 30,
                        loads: Sequence[float] = (0.8,), passes: int = 3) -> dict[str, Any]:
    """A hand-written single-threaded pinned ring in PyTorch, for a request stream: ``slots``
    pinned input and output buffers and device buffers of ``slot_bytes`` (default: the largest
    request). Per request: a CPU copy into the next pinned input slot, a non-blocking H2D on a
    copy stream, ``y = 1 + 2*x`` on a compute stream after the H2D's event, a non-blocking D2H
    into the pinned output slot on a second copy stream after the compute's event, an event;
    up to ``slots`` requests in flight, the oldest completed (event synchronize, copy out of the
    pinned slot into a fresh numpy array) when the ring is full, or between arrivals once its
    event has passed (:class:`RingServer`).

    Returns :func:`measure_request_server`'s figures (capacity in requests/s, latency in ms on
    the host clock), with p50/p99 at the first of ``loads`` at top level."""
    items, expected = _request_items(items, expected)
    (slots,) = _counts(slots, "slots")
    need = max(a.nbytes for a in items)
    if slot_bytes is None:
        slot_bytes = need
    elif isinstance(slot_bytes, bool) or int(slot_bytes) < need:
        raise ValueError(f"slot_bytes must hold the largest request ({need} bytes), got {slot_bytes!r}")
    torch = _torch()
    compute = _torch_scale_shift(torch)
    exact = _bit_exact_sample(torch, compute)
    backend = _TorchRingBackend(torch, slots, -(-int(slot_bytes) // 4), compute)
    measured = measure_request_server(RingServer(backend, slots), items, expected, warmup=warmup, loads=loads,
                                      passes=passes)
    return _request_row("torch_requests_ring", measured, compute="torch.add(1, x, alpha=2)",
                        compute_bit_exact_on_sample=exact, host="pinned ring", slots=slots,
                        slot_bytes=int(slot_bytes), streams=3, in_flight=slots)
