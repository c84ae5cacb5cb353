"""The named workloads of ``ringflow bench``; each returns a JSON-ready dict of rows.

Every workload runs ringflow and its baselines side by side in one process, on fresh random
data, checks every output against numpy, and reports the ideal bound computed from the
stage times measured in the same run (a profiled ringflow run, whose copies run at the
concurrent H2D/D2H rate). Baselines that need a GPU framework (torch, CuPy, nvcc) are skipped
with the reason on the simulated GPU.
"""

from __future__ import annotations

import gc
import time
from typing import Any, Callable, Optional

import numpy as np

import ringflow as rf

from .. import _plan as plan
from .._device.protocol import Device
from .._pipeline.whole_array import stream_map_report
from . import kernels
from .baselines import HandlerThreads, _Recorder, measure_request_server
from .measure import Timing, fresh_random, time_calls

MiB = 1 << 20
Row = dict[str, Any]


def _row(name: str, timing: Timing | None = None, **extra: Any) -> Row:
    row = {"name": name}
    if timing is not None:
        row.update(timing.as_dict())
    row.update(extra)
    return row


def _skip(name: str, reason: str) -> Row:
    return {"name": name, "skipped": reason}


def _baseline(name: str, call: Callable[[], Row]) -> Row:
    """Run a baseline from :mod:`.baselines`; any failure to run becomes a skipped row."""
    try:
        row = call()
    except Exception as exc:  # noqa: BLE001 - a missing framework or nvcc is not our failure
        return _skip(name, f"{type(exc).__name__}: {exc}")
    row = dict(row)
    row["name"] = name
    return row


# -- the ringflow runs ---------------------------------------------------------------------------
def affine_tolerance(iters: int) -> float:
    """float32 rounding of ``iters`` steps of ``v*0.999+0.001`` (FMA or not) against a float64
    reference: each step may add about one ulp of relative error."""
    return max(1e-5, 4 * iters * 2.0 ** -24)


# Profiled calls whose lowest ideal bound a chunk size is held to: one call's bound is built from
# the stage times that call had, and a call whose copies ran slow (a busy host, the link shared
# with another process) gives a bound the unprofiled calls beat.
BOUND_CALLS = 3


def lowest_bound_report(profiled: Callable[[], Any], *, calls: int, before: Callable[[], None]):
    """The report of the profiled call (``profiled()`` returns its report) with the lowest ideal
    bound over ``calls`` calls, each after ``before()``."""
    best = None
    for _ in range(max(1, calls)):
        before()
        rep = profiled()
        if best is None or rep.ideal_s < best.ideal_s:
            best = rep
    return best


def serial_protocol_baseline(dev: Device, f, x: np.ndarray, expected: np.ndarray, repeats: int,
                             sample: np.ndarray, rtol: float) -> Row:
    """Copy everything in, compute once, copy everything out: one stream, no overlap."""
    n = x.nbytes
    hin = dev.allocate_host(n)
    hout = dev.allocate_host(n)
    din, dout = dev.allocate(n), dev.allocate(n)
    s = dev.create_stream()
    hin.view(x.dtype, access="w")[:] = x.reshape(-1)
    sim = getattr(f, "sim_seconds", None)

    def once():
        s.copy(din, hin)
        s.launch(f, din.array(x.dtype, x.shape), dout.array(x.dtype, x.shape), reads=[din], writes=[dout],
                 sim_seconds=sim(n) if callable(sim) else None)
        s.copy(hout, dout)
        s.sync()

    try:
        timing = time_calls(lambda: dev.now, once, warmup=1, repeats=repeats)
        got = hout.view(x.dtype, access="r").reshape(-1)[sample]
        ok = bool(np.allclose(got, expected, rtol=rtol, atol=rtol))
    finally:
        for b in (din, dout):
            b.close()
        for b in (hin, hout):
            b.close()
        s.close()
    return _row("serial copy-compute-copy (pinned, one stream)", timing, correct=ok,
                note="pinned buffers prepared outside the timed region")


def _baselines():
    from . import baselines

    return baselines


def _gpu_only(dev: Device) -> str | None:
    return None if dev.backend == "cuda" else "needs a CUDA GPU (this run is on the simulated GPU)"


# -- seed, balanced, compute-bound ----------------------------------------------------------------
def inplace_pinned(dev: Device, *, name: str, size_bytes: int, iters: int, repeats: int,
                   chunk_counts=(8, 16, 32, 64), progress=None) -> dict[str, Any]:
    """The tutorial's shape: float32 in pinned host memory, processed in place, ``iters``
    iterations of ``v*0.999+0.001`` per element. ringflow runs at its chosen chunk size and at
    each of ``chunk_counts``; baselines: serial, the hand-written CUDA C++ pipeline."""
    n = size_bytes // 4
    f = kernels.affine(iters, numeric_iters=min(iters, 16) if dev.backend == "sim" else None)
    measured_per_byte = None
    if dev.backend == "cuda":
        # the planner (slots, chunk size) takes compute time from f.sim_seconds, a model of the
        # simulated GPU; on a real one give it this kernel's measured time instead
        from .gpu_calibrate import kernel_seconds

        measured_per_byte = kernel_seconds(dev, f, 16 * MiB) / (16 * MiB)
        f.sim_seconds = lambda nbytes: measured_per_byte * nbytes
    hb = dev.allocate_host(n * 4)
    rows: list[Row] = []
    try:
        x = hb.view(np.float32, access="rw")
        x0 = fresh_random(n, seed=1)
        # the reference on a random sample of elements (every chunk is hit): a full numpy
        # reference of hundreds of iterations over 256 MiB would take minutes
        sample = np.sort(np.random.default_rng(9).choice(n, size=min(n, 1 << 18), replace=False))
        expected = kernels.affine_expected(x0[sample].astype(np.float64), f.numeric_iters)
        rtol = affine_tolerance(f.numeric_iters)

        def refill():
            hb.view(np.float32, access="w")[:] = x0

        def correct() -> bool:  # the sampled elements of one call on refilled input
            return bool(np.allclose(hb.view(np.float32, access="r")[sample], expected, rtol=rtol, atol=rtol))

        def run(chunk_bytes):
            return rf.stream_map(f, x, x, device=dev, chunk_bytes=chunk_bytes, x_buffer=hb, out_buffer=hb,
                                 inplace=True)

        auto = plan.choose_chunk_bytes(dev.hardware, n * 4, host_stages=False,
                                       compute_s_per_byte=f.sim_seconds(MiB) / MiB, align=4)
        sizes = sorted({auto.chunk_bytes} | {n * 4 // c for c in chunk_counts})
        results = {}
        untouched_ms = {}
        for cb in sizes:
            if progress:
                progress(f"{name}: ringflow, {n * 4 // cb} chunks")
            refill()
            run(cb)
            ok = correct()
            timing = time_calls(lambda: dev.now, lambda: run(cb), warmup=1, repeats=repeats, before=refill)
            # the same calls back to back with the input left as the last call wrote it (still random,
            # iterated further): how the C++ baseline's repeats run, with no CPU write in between
            untouched = time_calls(lambda: dev.now, lambda: run(cb), warmup=1, repeats=repeats)
            rep = lowest_bound_report(lambda: stream_map_report(f, x, x, device=dev, chunk_bytes=cb, x_buffer=hb,
                                                                out_buffer=hb, inplace=True)[1],
                                      calls=BOUND_CALLS if dev.backend == "cuda" else 1, before=refill)
            results[cb] = (timing, ok, rep)
            untouched_ms[cb] = untouched.median_ms
            rows.append(_row(f"ringflow {n * 4 // cb} chunks of {cb / MiB:g} MiB" + (" (auto)" if cb == auto.chunk_bytes else ""),
                             timing, correct=ok, chunk_bytes=cb, chunks=-(-n * 4 // cb), ideal_ms=rep.ideal_s * 1e3,
                             efficiency=rep.ideal_s * 1e3 / timing.median_ms,
                             host_us_per_chunk=rep.host_overhead_per_chunk_s * 1e6,
                             ms_median_no_refill=untouched.median_ms, ms_p10_no_refill=untouched.p10_ms,
                             ms_p90_no_refill=untouched.p90_ms,
                             stage_ms={k: v * 1e3 for k, v in rep.stage_median_s.items()},
                             bottleneck=rep.bottleneck, predicted_ms=_predict(dev, n * 4, cb, f),
                             prediction_error=_predict(dev, n * 4, cb, f) / timing.median_ms - 1))
        # the first call of a shape sets its pipeline up (later calls reuse it warm): time that too
        def cold_refill():
            refill()
            rf.drop_warm_pipelines(dev)

        cold = time_calls(lambda: dev.now, lambda: run(auto.chunk_bytes), warmup=1, repeats=repeats, before=cold_refill)
        rows.append(_row(f"ringflow {n * 4 // auto.chunk_bytes} chunks, first call (set up)", cold,
                         overhead_vs_warm=cold.median_ms / results[auto.chunk_bytes][0].median_ms - 1))
        # the same job bound once (rf.MapJob): no per-call planning, cache lookup or rearming; its
        # default engine here enqueues a whole call in one pass (direct), at every chunk size; the
        # scheduler's engine at the chosen size for comparison
        job_ms = {}
        for cb, engine in [(cb, "direct") for cb in sizes] + [(auto.chunk_bytes, "pipeline")]:
            if progress:
                progress(f"{name}: MapJob {engine}, {n * 4 // cb} chunks")
            with rf.MapJob(f, x, x, device=dev, chunk_bytes=cb, x_buffer=hb, out_buffer=hb, inplace=True,
                           engine=engine) as job:
                refill()
                job()
                job_ok = correct()
                enqueue = []  # host time enqueueing each refilled call (direct engine), the warm-up's first

                def timed_call():
                    job()
                    enqueue.append(job.enqueue_seconds)

                job_t = time_calls(lambda: dev.now, timed_call, warmup=1, repeats=repeats, before=refill)
                job_untouched = time_calls(lambda: dev.now, job, warmup=1, repeats=repeats)
            enqueue_s = None if enqueue[-1] is None else float(np.median(enqueue[1:]))
            ideal = results[cb][2].ideal_s * 1e3
            job_ms[(cb, engine)] = (job_t.median_ms, job_untouched.median_ms, enqueue_s)
            label = "" if engine == "direct" else ", engine=pipeline"
            rows.append(_row(f"ringflow MapJob {n * 4 // cb} chunks (set up once){label}"
                             + (" (auto)" if cb == auto.chunk_bytes else ""), job_t, correct=job_ok,
                             engine=engine, chunk_bytes=cb, ideal_ms=ideal, efficiency=ideal / job_t.median_ms,
                             ms_median_no_refill=job_untouched.median_ms,
                             efficiency_no_refill=ideal / job_untouched.median_ms,
                             host_us_per_chunk=None if enqueue_s is None else enqueue_s * 1e6 / -(-n * 4 // cb)))
        # what profiling costs: the auto chunk size again with profile=True (timing events, records)
        refill()
        profiled = time_calls(lambda: dev.now, lambda: rf.stream_map(f, x, x, device=dev, chunk_bytes=auto.chunk_bytes,
                                                                     x_buffer=hb, out_buffer=hb, inplace=True,
                                                                     profile=True),
                              warmup=1, repeats=repeats, before=refill)
        rows.append(_row(f"ringflow {n * 4 // auto.chunk_bytes} chunks, profile=True", profiled,
                         overhead_vs_unprofiled=profiled.median_ms / results[auto.chunk_bytes][0].median_ms - 1))
        if progress:
            progress(f"{name}: serial baseline")
        rows.append(serial_protocol_baseline(dev, f, x0, expected, repeats, sample, rtol))
        reason = _gpu_only(dev)
        if reason:
            rows.append(_skip("hand-written CUDA C++ pipeline", reason))
        else:
            if progress:
                progress(f"{name}: CUDA C++ baseline")
            rows.append(_baseline("hand-written CUDA C++ pipeline",
                                  lambda: _baselines().cuda_cpp_pipeline(n, chunks=list(chunk_counts), streams=4,
                                                                         iters=iters, refill=True)))
    finally:
        hb.close()
    best_cb = min(results, key=lambda cb: results[cb][0].median_ms)
    versus_cpp = _versus_cpp(rows, {cb: r[0].median_ms for cb, r in results.items()}, untouched_ms, n * 4)
    auto_t, _, auto_rep = results[auto.chunk_bytes]
    min_eff_chunk = min((cb for cb in results if results[cb][2].ideal_s * 1e3 / results[cb][0].median_ms >= 0.9),
                        default=None)
    return {"workload": name, "size_bytes": n * 4, "iters": iters, "rows": rows,
            "kernel_ms_per_MiB_measured": None if measured_per_byte is None else measured_per_byte * MiB * 1e3,
            "auto_chunk_bytes": auto.chunk_bytes, "auto_prediction": auto.describe(),
            "ringflow_ms": auto_t.median_ms, "ideal_ms": auto_rep.ideal_s * 1e3,
            "efficiency": auto_rep.ideal_s * 1e3 / auto_t.median_ms, "best_chunk_bytes": best_cb,
            # the same chunk size with the input untouched between calls (the C++ program's method)
            "ringflow_ms_no_refill": untouched_ms[auto.chunk_bytes],
            "efficiency_no_refill": auto_rep.ideal_s * 1e3 / untouched_ms[auto.chunk_bytes],
            "smallest_chunk_with_efficiency_0.9": min_eff_chunk, "versus_cpp": versus_cpp,
            # ringflow's best over the C++ program's best, both on the host clock and untouched input
            "vs_cpp_like_with_like": (versus_cpp or {}).get("untouched_input", {}).get("ratio_vs_host_clock"),
            # the same for MapJob (set up once, as the C++ program is): its best untouched call
            "vs_cpp_mapjob_like_with_like": _over_cpp(min(v[1] for (cb, e), v in job_ms.items() if e == "direct"),
                                                      versus_cpp),
            # the same chosen chunk size bound once as a MapJob (direct engine), refilled input
            "mapjob_ms": job_ms[(auto.chunk_bytes, "direct")][0],
            "mapjob_efficiency": auto_rep.ideal_s * 1e3 / job_ms[(auto.chunk_bytes, "direct")][0],
            "mapjob_best_ms": min(v[0] for (cb, e), v in job_ms.items() if e == "direct"),
            # host time per chunk at the chosen size: of the profiled run (the engine stream_map uses
            # here: direct, so its enqueueing) and of an unprofiled MapJob call
            "host_us_per_chunk": auto_rep.host_overhead_per_chunk_s * 1e6,
            "mapjob_host_us_per_chunk": job_ms[(auto.chunk_bytes, "direct")][2] * 1e6 / auto.chunks}


def _over_cpp(ms: float, versus_cpp: Optional[dict]) -> Optional[float]:
    """``ms`` over the C++ program's best on the host clock with untouched input (None without it)."""
    cpp = (versus_cpp or {}).get("untouched_input", {}).get("cpp_best_ms_host_clock")
    return ms / cpp if cpp else None


def _versus_cpp(rows: list, refilled_ms: dict, untouched_ms: dict, total_bytes: int) -> Optional[dict]:
    """ringflow's best against the CUDA C++ program's best, like with like. ringflow's calls are
    timed on the host clock, the C++ program's runs with CUDA events (its GPU span, as the
    tutorial reports it) and on the host clock around enqueue + synchronize; each both with the
    input untouched between repeats (the C++ program's own method) and rewritten by the CPU
    before every repeat (the bench's ringflow rows). ``*_ms``: chunk bytes -> median ms."""
    cpp = next((r for r in rows if r.get("name") == "hand-written CUDA C++ pipeline" and "ms_median" in r), None)
    if cpp is None:
        return None

    def best_of(ms_by_cb):
        cb = min(ms_by_cb, key=ms_by_cb.get)
        return ms_by_cb[cb], -(-total_bytes // cb)

    host = cpp.get("host_clock", {})
    refilled = cpp.get("refilled", {})
    cases = {"untouched_input": (best_of(untouched_ms), cpp["ms_median"], cpp.get("chunks"),
                                 host.get("ms_median"), host.get("chunks")),
             "refilled_input": (best_of(refilled_ms), refilled.get("ms_median"), refilled.get("chunks"),
                                refilled.get("host_clock", {}).get("ms_median"),
                                refilled.get("host_clock", {}).get("chunks"))}
    out = {}
    for name, ((ours, chunks), events_ms, events_chunks, host_ms, host_chunks) in cases.items():
        out[name] = {"ringflow_best_ms": ours, "ringflow_chunks": chunks,
                     "cpp_best_ms_cuda_events": events_ms, "cpp_chunks_cuda_events": events_chunks,
                     "cpp_best_ms_host_clock": host_ms, "cpp_chunks_host_clock": host_chunks,
                     "ratio_vs_cuda_events": ours / events_ms if events_ms else None,
                     "ratio_vs_host_clock": ours / host_ms if host_ms else None}
    return out


def _predict(dev: Device, total: int, chunk: int, f) -> float:
    """The device's hardware model's prediction (ms) for the in-place pinned workload."""
    _, seconds = plan.predict_seconds(dev.hardware, total, chunk, compute_s_per_byte=f.sim_seconds(chunk) / chunk,
                                      host_stages=False)
    return seconds * 1e3


def calibrate_iters(dev: Device, chunk_bytes: int, ratio: float) -> int:
    """Iterations that make the kernel ``ratio`` times as long as one chunk's H2D copy."""
    prof = getattr(dev, "profile", None)
    if prof is not None:  # sim: from the kernel model
        copy = plan.model_stage_times(prof, chunk_bytes).h2d
        per_iter = kernels._ITER_S_PER_BYTE * chunk_bytes
        return max(1, round((ratio * copy - 2 * chunk_bytes / kernels._DEVICE_BPS) / per_iter))
    from .gpu_calibrate import iters_for

    return iters_for(dev, chunk_bytes, ratio)[0]


# -- pageable -----------------------------------------------------------------------------------------
def pageable(dev: Device, *, size_bytes: int, repeats: int, progress=None) -> dict[str, Any]:
    """A fresh ordinary numpy array in, a new array out, ``y = 2x + 1``, end to end."""
    n = size_bytes // 4
    f = kernels.scale_shift()
    rows: list[Row] = []
    x = fresh_random(n, seed=2)
    expected = x * np.float32(2) + np.float32(1)
    results = {}
    for host in ("stage", "register", "auto"):
        if progress:
            progress(f"pageable: ringflow host={host}")
        y = rf.stream_map(f, x, device=dev, chunk_bytes="auto", host=host)
        ok = bool(np.array_equal(y, expected))
        del y
        timing = time_calls(lambda: dev.now, lambda: rf.stream_map(f, x, device=dev, chunk_bytes="auto", host=host),
                            warmup=0, repeats=repeats)
        results[host] = timing
        rows.append(_row(f"ringflow stream_map host={host}", timing, correct=ok))
    # not this workload's question (a new output array each call) but the one after it: the same
    # arrays again and again, pinned once by a MapJob; its set-up (registration, first touch) is
    # timed on its own. Excluded from ringflow_ms.
    if progress:
        progress("pageable: MapJob, x and out pinned once")
    t0 = dev.now
    with rf.MapJob(f, x, device=dev, chunk_bytes="auto", host="register") as job:
        setup_ms = (dev.now - t0) * 1e3
        job_ok = bool(np.array_equal(job(), expected))
        job_t = time_calls(lambda: dev.now, job, warmup=0, repeats=repeats)
    rows.append(_row("ringflow MapJob host=register, repeated calls (x, out pinned once)", job_t, correct=job_ok,
                     setup_ms=setup_ms))
    choice = plan.choose_host_strategy(dev.hardware, x.nbytes, x.nbytes,
                                       workers=_workers(dev), out_is_fresh=True)
    reason = _gpu_only(dev)
    floors: dict[str, Any] = {}
    if reason:
        for b in ("torch naive .cuda()/.cpu()", "hand-written torch 3-stream pipeline"):
            rows.append(_skip(b, reason))
        p = plan.get_profile(dev.profile)
        floors["link_ms"] = 1e3 * 2 * x.nbytes / (p.duplex_GBps * 1e9)
    else:
        if progress:
            progress("pageable: torch baselines")
        rows.append(_baseline("torch naive .cuda()/.cpu()", lambda: _baselines().torch_naive(x, "scale_shift")))
        rows.append(_baseline("hand-written torch 3-stream pipeline",
                              lambda: _baselines().torch_streams_pipeline(x, "scale_shift")))
        if progress:
            progress("pageable: floors")
        try:
            floors.update(_baselines().link_floor(x.nbytes, x.nbytes))
            floors.update(_baselines().host_floor(x.nbytes))
            # the parts above, measured alone, share the host's memory bandwidth when they run
            # together (the GPU's copies read and write the same DRAM as the CPU's)
            floors.update(_baselines().staging_floor(x.nbytes))
        except Exception as exc:  # noqa: BLE001
            floors["error"] = f"{type(exc).__name__}: {exc}"
    best_ms = min(t.median_ms for t in results.values())
    res = {"workload": "pageable", "size_bytes": x.nbytes, "rows": rows, "floors": floors,
           "host_strategy_rule": choice.describe(), "ringflow_ms": best_ms}
    floor = pageable_floor_ms(floors)
    if floor is not None:
        res["floor_ms"] = floor
        res["efficiency_vs_floor"] = floor / best_ms
    return res


def pageable_floor_ms(floors: dict[str, Any]) -> Optional[float]:
    """The ``pageable`` workload's floor (ms) from its measured ``floors``: the link's floor or
    the fastest single run of all the path's memory work at once
    (:func:`~ringflow._bench.baselines.staging_floor`), whichever is longer; None where either
    was not measured. A single run, not a median: a median of the floor's few runs can land on
    a slow stretch of the host's memory bandwidth that the path's own runs missed, and the
    path then beats its floor."""
    if "staging_together_fastest_ms" not in floors or "link_floor_ms" not in floors:
        return None
    return max(floors["link_floor_ms"], floors["staging_together_fastest_ms"])


def _workers(dev: Device) -> int:
    from .._pipeline.sizing import default_workers

    return default_workers(dev)


# -- requests -----------------------------------------------------------------------------------------
def request_sizes(count: int, chunk_bytes: int) -> np.ndarray:
    """The ``requests`` workload's sizes in float32 elements: lognormal (median 1 MiB, at least
    4 KiB, at most ``chunk_bytes``), the same for a given ``count``."""
    rng = np.random.default_rng(3)
    return np.minimum(chunk_bytes // 4, np.maximum(1024, rng.lognormal(np.log(MiB // 4), 1.0, count).astype(int)))


def request_items(count: int, chunk_bytes: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The ``requests`` workload's items and their expected results: ``count`` float32 arrays of
    fresh random values, :func:`request_sizes` long."""
    items = [fresh_random(int(s), seed=i) for i, s in enumerate(request_sizes(count, chunk_bytes))]
    return items, [it * np.float32(2) + np.float32(1) for it in items]


def requests(dev: Device, *, loads=(0.5, 0.8, 0.95), count: int = 200, chunk_bytes: int = 8 * MiB,
             warmup: int = 30, progress=None, pipeline_options: dict | None = None, handlers: int = 1,
             baselines: bool = True) -> dict[str, Any]:
    """Lognormal request sizes (median 1 MiB, capped at a slot), fresh numpy in and out, through
    one :class:`ringflow.Pipeline` measured by
    :func:`~ringflow._bench.baselines.measure_request_server`, the method every baseline is
    measured by: an untimed pass over every request, isolated latency, capacity (closed loop, the
    median of three passes), then open-loop Poisson arrivals at each of ``loads`` (fractions of
    that capacity) with latency from arrival to result (``p99_over_isolated`` compares the two
    p99s). Also the pipeline's pinned high-water mark over the whole run (memory stays
    bounded). ``pipeline_options`` (keyword arguments of :class:`ringflow.Pipeline`) are for
    experiments; the bench leaves them out.

    On a CUDA GPU the same requests then go through two torch baselines (a naive
    ``.cuda()``/``.cpu()`` per request and a hand-written single-threaded pinned ring), measured
    at 80% of their own capacity; :func:`versus_torch` sets the figures side by side (skipped
    rows, null ratios on the simulated GPU)."""
    items, expected = request_items(count, chunk_bytes)
    if progress:
        progress(f"requests: ringflow (a pass to warm up, isolated, capacity, {len(loads)} loads)")
    with rf.Pipeline(kernels.scale_shift(), device=dev, chunk_bytes=chunk_bytes, **(pipeline_options or {})) as pipe:
        server = PipelineServer(pipe, dev)
        if handlers > 1:
            server = HandlerThreads(server, handlers)
        try:
            ours = measure_request_server(server, items, expected, warmup=warmup, loads=loads)
        finally:
            if handlers > 1:
                server.close()
        mem = pipe.scheduler.rings
        pinned_hw = sum(r.high_water * r.chunk_bytes for r in mem if r.buffer.is_host)
        pinned = sum(len(r) * r.chunk_bytes for r in mem if r.buffer.is_host)
    rows = [{"name": f"ringflow at {int(lv['load'] * 100)}% load", **lv} for lv in ours["levels"]]
    rows.append({"name": "ringflow capacity, isolated latency",
                 **{k: v for k, v in ours.items() if k not in ("levels", "requests", "timing")}})
    torch_rows = _torch_request_baselines(dev, items, expected, chunk_bytes=chunk_bytes, warmup=warmup,
                                          progress=progress) if baselines else []
    return {"workload": "requests", "count": count, "warmup_requests_per_level": warmup, "handler_threads": handlers,
            "isolated_p99_ms": ours["isolated_p99_ms"], "isolated_p50_ms": ours["isolated_p50_ms"],
            "capacity_per_s": ours["capacity_per_s"], "capacity_passes_per_s": ours["capacity_passes_per_s"],
            "cold_pass_per_s": ours["cold_pass_per_s"],
            "levels": ours["levels"], "correct": ours["correct"], "pinned_high_water_MiB": pinned_hw / MiB,
            "pinned_allocated_MiB": pinned / MiB,
            # what a perfect server of ringflow's measured capacity would give the 80% level's arrivals
            "p99_80_perfect_fifo_over_isolated": _at(_level_80(ours["levels"]), "perfect_fifo_p99_over_isolated"),
            # ringflow's p99 at 80% load over that perfect server's (every request alike, by bytes)
            "p99_80_over_perfect_fifo": _at(_level_80(ours["levels"]), "p99_over_perfect_fifo"),
            **versus_torch(ours, torch_rows), "rows": rows + torch_rows}


class PipelineServer(_Recorder):
    """A :class:`ringflow.Pipeline` as a request server of
    :func:`~ringflow._bench.baselines.measure_request_server`: ``submit`` hands the request to
    ``pipe.submit`` (blocking only while the pipeline is full), a done-callback stamps the
    moment its result lands (on the pipeline's progress thread), ``drain`` collects every
    result. Times are ``dev.now`` (the simulated GPU's virtual clock, or the host clock)."""

    def __init__(self, pipe: "rf.Pipeline", dev: Device):
        self.pipe, self.dev = pipe, dev
        self._futures: list = []
        super().__init__(lambda: dev.now)

    def reset(self, count: int) -> None:
        super().reset(count)
        self._futures = []

    def submit(self, i: int, item: np.ndarray) -> None:
        clock, done = self.clock, self.done
        self.submitted[i] = clock()
        fut = self.pipe.submit(item)

        def landed(_fut) -> None:  # runs as the result lands
            done[i] = clock()

        fut.add_done_callback(landed)
        self._futures.append((i, fut))

    def advance(self, t: float) -> None:
        wait_until(self.pipe, self.dev, t)

    def drain(self) -> None:
        futures, self._futures = self._futures, []
        for i, fut in futures:
            self.results[i] = fut.result()
        # a future's result is visible to its waiter a moment before its done-callbacks run on
        # the thread that set it: wait for every landing to be stamped
        stamped = [i for i, _ in futures]
        deadline = time.perf_counter() + 10.0
        while np.isnan(self.done[stamped]).any():
            if time.perf_counter() > deadline:
                raise RuntimeError("a request's result came back but its done-callback never ran")
            time.sleep(0)

    @property
    def in_flight(self) -> int:
        return sum(not fut.done() for _, fut in self._futures)


TORCH_NAIVE = "torch naive .cuda()/.cpu() per request"
TORCH_RING = "hand-written torch pinned ring (one thread)"


def _torch_request_baselines(dev: Device, items, expected, *, chunk_bytes: int, warmup: int,
                             progress=None) -> list[Row]:
    """The torch baselines of the ``requests`` workload on the same requests (skipped rows with
    the reason on the simulated GPU or where PyTorch cannot run)."""
    reason = _gpu_only(dev)
    if reason:
        return [_skip(TORCH_NAIVE, reason), _skip(TORCH_RING, reason)]
    rows = []
    for name, run in ((TORCH_NAIVE, lambda: _baselines().torch_requests_naive(items, expected, warmup=warmup)),
                      (TORCH_RING, lambda: _baselines().torch_requests_ring(items, expected, slot_bytes=chunk_bytes,
                                                                            warmup=warmup))):
        if progress:
            progress(f"requests: {name}")
        gc.collect()
        rows.append(_baseline(name, run))
    return rows


def _level_80(levels: list) -> Optional[dict]:
    return next((lv for lv in levels if abs(lv["load"] - 0.8) < 1e-9), None)


def _at(level: Optional[dict], key: str) -> Any:
    return None if level is None else level[key]


def versus_torch(ours: dict[str, Any], torch_rows: list[Row]) -> dict[str, Any]:
    """ringflow's request figures beside the torch baselines'. ``ours``: ``capacity_per_s``,
    ``isolated_p50_ms``, ``isolated_p99_ms`` and ``levels`` (each with ``load``, ``p50_ms``,
    ``p99_ms``, ``p99_over_isolated``); ``torch_rows``: rows named :data:`TORCH_NAIVE` and
    :data:`TORCH_RING`, measured or skipped.

    Returns ``ringflow_vs_torch_ring`` and ``ringflow_vs_torch_naive`` (ringflow's capacity over
    the baseline's; None where the baseline did not run), ``p99_80_over_isolated`` (ringflow's
    p99 at 80% load over its isolated p99; None without that level) and ``side_by_side``: per
    system its capacity (requests/s), isolated p50/p99 and p50/p99 at 80% of its own capacity
    (ms), or why it was skipped."""
    at80 = _level_80(ours.get("levels", []))
    side = [{"name": "ringflow", "capacity_per_s": ours["capacity_per_s"],
             "isolated_p50_ms": ours["isolated_p50_ms"], "isolated_p99_ms": ours["isolated_p99_ms"],
             "p50_80_ms": _at(at80, "p50_ms"), "p99_80_ms": _at(at80, "p99_ms"),
             "p99_80_over_isolated": _at(at80, "p99_over_isolated")}]
    out: dict[str, Any] = {"p99_80_over_isolated": side[0]["p99_80_over_isolated"]}
    for key, name in (("torch_ring", TORCH_RING), ("torch_naive", TORCH_NAIVE)):
        row = next((r for r in torch_rows if r.get("name") == name), None)
        cap = None if row is None else row.get("capacity_per_s")
        out[f"ringflow_vs_{key}"] = ours["capacity_per_s"] / cap if cap else None
        if row is None or "skipped" in row or not cap:
            side.append({"name": name, "skipped": (row or {}).get("skipped", "not run")})
            continue
        level = _level_80(row.get("levels", []))
        side.append({"name": name, "capacity_per_s": cap, "isolated_p50_ms": row["isolated_p50_ms"],
                     "isolated_p99_ms": row["isolated_p99_ms"], "p50_80_ms": _at(level, "p50_ms"),
                     "p99_80_ms": _at(level, "p99_ms"), "p99_80_over_isolated": _at(level, "p99_over_isolated"),
                     "correct": row.get("correct")})
    out["side_by_side"] = side
    return out


def wait_until(pipe, dev: Device, t: float, *, spin: bool = True) -> None:
    """Wait until the host clock reads ``t`` (an open-loop arrival) while the pipeline works on
    its own. On the simulated GPU virtual time passes only while someone waits on the pipeline,
    so the wait is made there. ``spin``: the last 0.2 ms is a loop of GIL-releasing yields (the
    arrival is on time, and the loop competes for the GIL with the pipeline's threads); else one
    sleep (the arrival thread holds no GIL while it waits, as one blocked on a socket, and wakes
    up to tens of microseconds late, which counts as latency)."""
    if dev.backend == "sim":
        try:
            pipe._drive_until(lambda: dev.now >= t, timeout=max(0.0, t - dev.now))
        except TimeoutError:
            pass
        return
    while True:
        left = t - dev.now
        if left <= 0:
            return
        if not spin:
            time.sleep(left)
        else:  # half the time left, then yields for the last 0.2 ms
            time.sleep(left / 2 if left > 2e-4 else 0)


WORKLOADS = ("seed", "balanced", "compute-bound", "pageable", "requests")
# run only when named (``ringflow bench feed``): each would lengthen every default run
BY_NAME_ONLY = ("feed",)


def run_workload(dev: Device, name: str, *, quick: bool = False, progress=None) -> dict[str, Any]:
    sim = dev.backend == "sim"
    repeats = 3 if (quick or sim) else 7
    if name == "seed":
        size = (16 if quick else 64 if sim else 256) * MiB
        return inplace_pinned(dev, name="seed", size_bytes=size, iters=64, repeats=repeats, progress=progress)
    if name in ("balanced", "compute-bound"):
        size = (16 if quick else 64 if sim else 256) * MiB
        iters = calibrate_iters(dev, size // 32, 1.0 if name == "balanced" else 3.0)
        return inplace_pinned(dev, name=name, size_bytes=size, iters=iters, repeats=repeats, progress=progress,
                              chunk_counts=(16, 32))
    if name == "pageable":
        size = (16 if quick else 64 if sim else 1024) * MiB
        return pageable(dev, size_bytes=size, repeats=repeats, progress=progress)
    if name == "requests":
        return requests(dev, count=60 if (quick or sim) else 1000, warmup=10 if (quick or sim) else 30,
                        progress=progress)
    if name == "feed":
        from .feed import feed

        if sim:  # tiny images: the sim checks the plumbing, its clock is virtual
            return feed(dev, batch=4, size=16, batches=24, workers=4, rounds=2, progress=progress)
        return feed(dev, batches=60 if quick else 200, rounds=2 if quick else 3, check=16, progress=progress)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS + BY_NAME_ONLY)}")
