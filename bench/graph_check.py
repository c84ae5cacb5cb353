"""``MapJob`` with and without ``graph=True`` at every chunk size, on one machine in one run: the
in-place pinned workloads (256 MiB float32, the affine kernel at the seed's 64 iterations and at
the balanced count), warm calls on fresh random input, each configuration's calls interleaved with
the other's; beside them the hand-written CUDA C++ pipeline and the link's floor, measured in the
same process. Per chunk size: median and spread of a call, the host time a call spends enqueueing
(per chunk), and each mode's time at that size over its best; a replayed call is checked against
an ordinary one on the same input, bit for bit.

    python3 bench/graph_check.py --device cuda:0 --out FILE [--mib 256] [--calls 9] [--slots 4,16,64]

``--slots``: also sweep the device ring's slot count at each chunk size (planned when not given).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
from _script import header, pinned_random, write

import ringflow as rf
from ringflow._bench import baselines, kernels
from ringflow._bench.workloads import calibrate_iters

KiB, MiB = 1 << 10, 1 << 20
RATIOS = {"balanced": 1.0, "compute-bound": 3.0}  # kernel time over a chunk's copy in, as the bench's
SIZES = (256 * KiB, 512 * KiB, 1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB, 32 * MiB)


def time_pair(jobs: dict, x: np.ndarray, calls: int, refill: bool = True) -> dict:
    """Interleaved warm calls of each job (mode -> job) on fresh input each call (``refill``;
    else back to back on whatever the last call left, as the C++ program times itself): per mode
    the call times (ms) and the host seconds each call spent enqueueing."""
    rng = np.random.default_rng(5)
    out = {mode: {"ms": [], "enqueue_s": []} for mode in jobs}
    for mode, job in jobs.items():  # the first call warms the compute; the second captures
        job()
        job()
    for _ in range(calls):
        for mode, job in jobs.items():
            if refill:
                x[:] = rng.uniform(0.5, 1.5, x.size).astype(np.float32)
            t0 = time.perf_counter()
            job()
            out[mode]["ms"].append((time.perf_counter() - t0) * 1e3)
            out[mode]["enqueue_s"].append(job.enqueue_seconds)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--calls", type=int, default=9)
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES))
    ap.add_argument("--workloads", default="seed,balanced")
    ap.add_argument("--slots", default="", help="device slot counts to sweep, comma-separated (planned if empty)")
    ap.add_argument("--compute-streams", type=int, default=None, help="None: planned")
    ap.add_argument("--no-refill", action="store_true",
                    help="time calls back to back without rewriting x between them (the C++ program's method)")
    ap.add_argument("--no-baselines", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = rf.device(args.device)
    sizes = [int(s) for s in args.sizes.split(",")]
    slot_counts = [int(s) for s in args.slots.split(",")] if args.slots else [None]
    hb, x = pinned_random(dev, args.mib)
    n = x.size
    result = {**header(dev.name), "mib": args.mib, "calls_each": args.calls,
              "compute_streams": args.compute_streams, "refill": not args.no_refill, "workloads": {}}
    if dev.backend == "cuda":
        result["versions"] = baselines.versions()
    for name in args.workloads.split(","):
        iters = 64 if name == "seed" else calibrate_iters(dev, args.mib * MiB // 32, RATIOS[name])
        f = kernels.affine(iters, numeric_iters=min(iters, 16) if dev.backend == "sim" else None)
        rows = []
        for size, slots in [(size, slots) for size in sizes for slots in slot_counts]:
            jobs = {mode: rf.MapJob(f, x, x, device=dev, chunk_bytes=size, x_buffer=hb, out_buffer=hb, inplace=True,
                                    graph=mode == "graph", slots=slots, compute_streams=args.compute_streams)
                    for mode in ("ordinary", "graph")}
            try:
                x0 = np.random.default_rng(11).uniform(0.5, 1.5, n).astype(np.float32)
                x[:] = x0
                jobs["ordinary"]()
                ordinary = x.copy()
                timed = time_pair(jobs, x, args.calls, refill=not args.no_refill)
                x[:] = x0
                jobs["graph"]()
                bit_exact = bool(np.array_equal(x, ordinary)) and jobs["graph"].replays_graph
                chunks = jobs["graph"].chunks
                ring = len(jobs["graph"]._held.engine._in_ready)
                row = {"chunk_bytes": size, "chunks": chunks, "slots": ring, "bit_exact": bit_exact}
                for mode, t in timed.items():
                    row[mode] = {"ms_median": statistics.median(t["ms"]), "ms_spread": [min(t["ms"]), max(t["ms"])],
                                 "enqueue_us_per_chunk": 1e6 * statistics.median(t["enqueue_s"]) / chunks}
                row["graph_replayed"] = jobs["graph"].replays_graph
            finally:
                for job in jobs.values():
                    job.close()
            rows.append(row)
            print(name, size, ring, row, flush=True)
        for mode in ("ordinary", "graph"):
            best = min(r[mode]["ms_median"] for r in rows)
            for r in rows:
                r[mode]["best_over_this"] = best / r[mode]["ms_median"]
        entry = {"iters": iters, "rows": rows,
                 "best_ms": {m: min(r[m]["ms_median"] for r in rows) for m in ("ordinary", "graph")}}
        if dev.backend == "cuda" and not args.no_baselines:
            entry["cuda_cpp"] = baselines.run_or_skip(baselines.cuda_cpp_pipeline, n, iters=iters,
                                                      chunks=(8, 16, 32, 64, 128), streams=(4, 1))
            cpp = entry["cuda_cpp"].get("host_clock", {}).get("ms_median")
            if cpp:
                entry["graph_best_over_cpp_host_clock"] = entry["best_ms"]["graph"] / cpp
                entry["ordinary_best_over_cpp_host_clock"] = entry["best_ms"]["ordinary"] / cpp
        result["workloads"][name] = entry
        print(name, {k: v for k, v in entry.items() if k != "rows" and k != "cuda_cpp"}, flush=True)
    if dev.backend == "cuda" and not args.no_baselines:
        result["link"] = baselines.run_or_skip(baselines.link_floor, n * 4, n * 4)
    hb.close()
    write(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
