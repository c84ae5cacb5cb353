"""Where a warm staged ``stream_map`` call of few chunks spends its time.

For each ``--shapes`` entry ``MIBxN`` (chunks of MIB MiB, N of them), warm staged calls
(``host="stage"``, ``--workers`` workers, y = 2x + 1 into a fresh output) on fresh inputs: their
wall times, then one call through ``stream_map_report`` whose report and timeline spans (track,
name, start and end on the host clock in seconds, chunk) go to the JSON, so a GPU run shows
what a short job pays besides its stages.

    PYTHONPATH=src python3 bench/diagnose_staged_call.py --device cuda:0 --shapes 1x1,1x4,8x1 --out FILE
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ringflow as rf  # noqa: E402
from ringflow._bench import kernels  # noqa: E402
from ringflow._bench.measure import fresh_random  # noqa: E402
from ringflow._bench.runner import environment  # noqa: E402
from _script import header, write  # noqa: E402

MiB = 1 << 20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="auto")
    ap.add_argument("--shapes", default="1x1,1x4,8x1")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = rf.device(args.device)
    f = kernels.scale_shift()
    rows = []
    for shape in args.shapes.split(","):
        mib, n = (int(v) for v in shape.split("x"))
        kw = dict(device=dev, host="stage", workers=args.workers, chunk_bytes=mib * MiB)
        xs = [fresh_random(mib * n * MiB // 4, seed=i) for i in range(args.calls + 2)]
        for x in xs[:2]:  # the engine made and warm
            rf.stream_map(f, x, **kw)
        walls = []
        for x in xs[2:]:
            t0 = time.perf_counter()
            rf.stream_map(f, x, **kw)
            walls.append(time.perf_counter() - t0)
        _, report = rf.stream_map_report(f, xs[0], **kw)
        spans = sorted(report.timeline.spans(), key=lambda s: s.start)
        rows.append({"chunk_bytes": mib * MiB, "chunks": n, "wall_ms": [w * 1e3 for w in walls],
                     "wall_ms_median": statistics.median(walls) * 1e3, "report": report.as_dict(),
                     "spans": [(s.track, s.name, s.start, s.end, s.chunk) for s in spans]})
        print(f"{mib} MiB x {n}: warm calls {statistics.median(walls) * 1e3:.3f} ms (median); {report.headline()}",
              flush=True)
        t0 = spans[0].start if spans else 0.0
        for s in spans:
            print(f"   {s.track:<24s} {s.name:<28s} {(s.start - t0) * 1e6:9.1f} {(s.end - s.start) * 1e6:9.1f} us",
                  flush=True)
    write({**header(environment(dev)), "workers": args.workers, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
