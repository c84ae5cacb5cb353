"""Tapered chunks and compute streams against the plain layout, on one machine in one run: warm
``MapJob`` calls of the in-place pinned workloads (256 MiB float32, the affine kernel at the
seed's 64 iterations and at the balanced and compute-bound counts), each variant a job of its
own, called in turn with the input untouched between calls (how the C++ program times itself);
the CUDA C++ program in the same process.

Variants, for each chunk size: ``<c>MiB s<k>`` (``compute_streams=k``) with and without a
``taper`` (the library's, see ``ringflow._pipeline.sizing.taper``; switched off for the others);
``planned`` (what the library plans when it knows the kernel's time, as ``ringflow bench``
tells it) and ``measured`` (what it does when it does not: the first call times a chunk).

    python3 bench/diagnose_taper.py --device cuda:0 --out FILE [--chunk-mib 4,8] [--streams 1,2,4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from unittest import mock

from _script import header, pinned_random, write

import ringflow as rf
from ringflow._bench import kernels
from ringflow._bench.gpu_calibrate import kernel_seconds
from ringflow._bench.workloads import _baselines, calibrate_iters
from ringflow._pipeline import sizing


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--chunk-mib", default="4,8")
    ap.add_argument("--streams", default="1,4")
    ap.add_argument("--workloads", default="seed,balanced,compute-bound")
    ap.add_argument("--calls", type=int, default=11)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = rf.device(args.device)
    hb, x = pinned_random(dev, args.mib)
    n = x.size
    out = {**header(dev.name), "mib": args.mib, "taper_min_kib": sizing.TAPER_MIN_BYTES >> 10, "workloads": []}
    for name in args.workloads.split(","):
        iters = 64 if name == "seed" else calibrate_iters(dev, args.mib * (1 << 20) // 32,
                                                         1.0 if name == "balanced" else 3.0)
        f = kernels.affine(iters)
        per_byte = kernel_seconds(dev, f, 16 << 20) / (16 << 20)
        known = kernels.affine(iters)  # the same kernel, its time told to the planner
        known.sim_seconds = lambda nbytes: per_byte * nbytes
        if dev.backend == "cuda":
            del f.sim_seconds  # its time unknown to the planner (on the simulated GPU: its model's)
        jobs = {}

        def job(key, g, cmib, streams, taper=True):
            with mock.patch.object(sizing, "TAPER_STEPS", sizing.TAPER_STEPS if taper else 0):
                jobs[key] = rf.MapJob(g, x, x, device=dev, chunk_bytes=cmib << 20, x_buffer=hb, out_buffer=hb,
                                      inplace=True, compute_streams=streams)
            jobs[key]()

        for cmib in (int(v) for v in args.chunk_mib.split(",")):
            for k in (int(v) for v in args.streams.split(",")):
                job(f"{cmib}MiB s{k}", known, cmib, k, taper=False)
                job(f"{cmib}MiB s{k} taper", known, cmib, k)
            job(f"{cmib}MiB planned", known, cmib, None)
            job(f"{cmib}MiB measured", f, cmib, None)
        times = {key: [] for key in jobs}
        for i in range(args.calls + 2):
            for key, j in jobs.items():
                t0 = time.perf_counter()
                j()
                if i >= 2:
                    times[key].append((time.perf_counter() - t0) * 1e3)
        planned = {key: {"chunks": j.chunks, "compute_streams": j._held.engine.compute_streams,
                         "measured_compute_bound": j._held.engine.measured_compute_bound}
                   for key, j in jobs.items() if key.endswith(("planned", "measured"))}
        for j in jobs.values():
            j.close()
        try:
            cpp = _baselines().cuda_cpp_pipeline(n, chunks=[16, 32, 64], streams=4, iters=iters, refill=False)
        except Exception as exc:  # noqa: BLE001 - no nvcc or no GPU: the variants still compare
            cpp = {"skipped": f"{type(exc).__name__}: {exc}"}
        cpp_ms = cpp["host_clock"]["ms_median"] if isinstance(cpp.get("host_clock"), dict) else cpp.get("ms_median")
        med = {key: statistics.median(v) for key, v in times.items()}
        row = {"workload": name, "iters": iters, "kernel_ms_per_MiB": per_byte * (1 << 20) * 1e3, "plans": planned,
               "median_ms": med,
               "spread_ms": {key: [min(v), max(v)] for key, v in times.items()},
               "cpp_ms_cuda_events": cpp.get("ms_median"), "cpp_ms_host_clock": cpp_ms,
               "over_cpp_host_clock": {key: v / cpp_ms for key, v in med.items()} if cpp_ms else None,
               "cpp": {k: cpp.get(k) for k in ("host_clock", "pipelined", "chunks", "streams")}}
        out["workloads"].append(row)
        print(name, iters, {k: round(v, 3) for k, v in med.items()}, "cpp", cpp_ms, flush=True)
    hb.close()
    write(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
