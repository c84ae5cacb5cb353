"""Where a warm ``stream_map`` call loses time against the same job's ``MapJob`` call, on one
machine in one run: the in-place pinned workloads (256 MiB float32, the affine kernel at the
seed's 64 iterations and at the compute-bound count), calls interleaved with the input
untouched. For each: the call's wall time, the direct engine's ``run`` within it, and the host
time ``run`` spent enqueueing (``enqueue_seconds``); medians in ms.

    python3 bench/diagnose_stream_map_gap.py --device cuda:0 --out FILE [--chunk-mib 4,8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from _script import header, pinned_random, write

import ringflow as rf
from ringflow._bench import kernels
from ringflow._bench.gpu_calibrate import kernel_seconds
from ringflow._bench.workloads import calibrate_iters
from ringflow._pipeline import direct


def profile_outside_run(call, n: int) -> str:
    """cProfile of ``n`` calls with the engine's ``run`` left out of the profile (its own
    device work dominates otherwise): the 30 functions with the most time of their own."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    run = direct.DirectSchedule.run

    def unprofiled(self, *a, **k):
        prof.disable()
        try:
            return run(self, *a, **k)
        finally:
            prof.enable()

    direct.DirectSchedule.run = unprofiled
    try:
        prof.enable()
        for _ in range(n):
            call()
        prof.disable()
    finally:
        direct.DirectSchedule.run = run
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    return text.getvalue()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--chunk-mib", default="4,8")
    ap.add_argument("--workloads", default="seed,compute-bound")
    ap.add_argument("--calls", type=int, default=21)
    ap.add_argument("--profile", type=int, default=0,
                    help="also cProfile this many warm stream_map calls of the last job (outside the engine's run)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = rf.device(args.device)
    hb, x = pinned_random(dev, args.mib)
    inner: list = []
    run = direct.DirectSchedule.run

    def timed_run(self, arrays=None, *, profile=False):
        t0 = time.perf_counter()
        try:
            return run(self, arrays, profile=profile)
        finally:
            inner.append((time.perf_counter() - t0, self.enqueue_seconds))

    direct.DirectSchedule.run = timed_run
    out = {**header(dev.name), "mib": args.mib, "rows": []}
    for name in args.workloads.split(","):
        iters = 64 if name == "seed" else calibrate_iters(dev, args.mib * (1 << 20) // 32, 3.0)
        f = kernels.affine(iters)
        per_byte = kernel_seconds(dev, f, 16 << 20) / (16 << 20)
        f.sim_seconds = lambda nbytes, per_byte=per_byte: per_byte * nbytes
        for cmib in (int(v) for v in args.chunk_mib.split(",")):
            kw = dict(device=dev, chunk_bytes=cmib << 20, x_buffer=hb, out_buffer=hb, inplace=True)
            job = rf.MapJob(f, x, x, **kw)
            calls = {"MapJob": job, "stream_map": lambda kw=kw: rf.stream_map(f, x, x, **kw)}
            got: dict = {k: [] for k in calls}
            for i in range(args.calls + 3):
                for key, call in calls.items():
                    inner.clear()
                    t0 = time.perf_counter()
                    call()
                    wall = time.perf_counter() - t0
                    if i >= 3:
                        got[key].append((wall, *inner[-1]))
            job.close()
            if args.profile:
                out["profile"] = profile_outside_run(lambda kw=kw: rf.stream_map(f, x, x, **kw), args.profile)
            row = {"workload": name, "chunk_mib": cmib, "iters": iters}
            for key, v in got.items():
                row[key] = {"call_ms": statistics.median(a for a, _, _ in v) * 1e3,
                            "run_ms": statistics.median(b for _, b, _ in v) * 1e3,
                            "outside_run_ms": statistics.median(a - b for a, b, _ in v) * 1e3,
                            "enqueue_ms": statistics.median(c for _, _, c in v) * 1e3}
            out["rows"].append(row)
            print(row, flush=True)
    direct.DirectSchedule.run = run
    hb.close()
    write(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
