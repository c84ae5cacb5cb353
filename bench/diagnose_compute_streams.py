"""One compute stream against several, on one machine in one run: warm ``MapJob`` calls of the
in-place pinned workloads (256 MiB float32, the affine kernel at the seed's 64 iterations and at
the balanced and compute-bound bench's counts), alternating the direct engine's compute streams
between 1 and ``--streams`` on the same job (made with that many). Writes medians, spreads and their ratio as JSON.

    python3 bench/diagnose_compute_streams.py --device cuda:0 --out FILE [--iters 64,1838,7966]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from _script import header, pinned_random, write

import ringflow as rf
from ringflow._bench import kernels


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--iters", default="64,1838,7966", help="kernel iterations per workload, comma-separated")
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument("--streams", type=int, default=4, help="compute streams to compare with one")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = rf.device(args.device)
    hb, x = pinned_random(dev, args.mib)
    rows = []
    for iters in (int(v) for v in args.iters.split(",")):
        f = kernels.affine(iters, numeric_iters=min(iters, 16) if dev.backend == "sim" else None)
        with rf.MapJob(f, x, x, device=dev, chunk_bytes=8 << 20, x_buffer=hb, out_buffer=hb, inplace=True,
                       compute_streams=args.streams) as job:
            engine = job._held.engine
            default = engine.compute_streams
            times: dict = {1: [], default: []}
            for i in range(2 * args.calls + 4):
                k = 1 if i % 2 else default
                engine.compute_streams = k  # the streams exist; chunks use the first k of them
                t0 = time.perf_counter()
                job()
                if i >= 4:
                    times[k].append((time.perf_counter() - t0) * 1e3)
            engine.compute_streams = default
        med = {str(k): statistics.median(v) for k, v in times.items()}
        rows.append({"iters": iters, "compute_streams_default": default, "median_ms": med,
                     "spread_ms": {str(k): [min(v), max(v)] for k, v in times.items()},
                     "default_over_one": med[str(default)] / med["1"]})
        print(rows[-1], flush=True)
    out = {**header(dev.name), "mib": args.mib, "chunk_bytes": 8 << 20, "calls_each": args.calls, "rows": rows}
    hb.close()
    write(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
