"""Why the staged pageable path (1 GiB ordinary numpy array in, a fresh 1 GiB out, y = 2x + 1)
runs slower than the host floor measured part by part, on a real GPU:

* ``floors``: the parts alone (``host_floor``: parallel copies into and out of pinned memory,
  first touch; ``link_floor``) and all of the path's memory work at once with no pipeline
  (``staging_floor``: CPU copies in and out and the GPU's copies together, with and without the
  GPU part) — if the parts contend for the host's memory bandwidth the second is the real floor;
* ``runs``: stream_map(host="stage") for a few worker counts, chunk sizes and host ring sizes,
  median of 5 (``--runs`` picks some by name);
* ``report``: one profiled run at the defaults (stage medians, stalls) and its trace.

    PYTHONPATH=src python3 bench/diagnose_pageable.py --device cuda:0 --out diag.json --trace trace.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys

import numpy as np

import ringflow as rf
from ringflow._bench import baselines, kernels
from ringflow._bench.measure import fresh_random, time_calls
from ringflow._bench.runner import environment
from ringflow._pipeline.whole_array import stream_map_report

MiB = 1 << 20
RUNS = [  # (name, stream_map options beyond host="stage")
    ("defaults", {}),
    ("8 workers", {"workers": 8}),
    ("12 workers", {"workers": 12}),
    ("32 MiB chunks", {"chunk_bytes": 32 * MiB}),
    ("8 MiB chunks", {"chunk_bytes": 8 * MiB}),
    ("16 MiB chunks", {"chunk_bytes": 16 * MiB}),
    ("4 MiB chunks", {"chunk_bytes": 4 * MiB}),
    # host ring sizes (host-in / host-out slots; device rings 3 each)
    ("8 MiB, 16/16 host slots", {"chunk_bytes": 8 * MiB, "slots": rf.SlotCounts(16, 3, 3, 16)}),
    ("8 MiB, 12/16 host slots", {"chunk_bytes": 8 * MiB, "slots": rf.SlotCounts(12, 3, 3, 16)}),
    ("16 MiB, 8/12 host slots", {"chunk_bytes": 16 * MiB, "slots": rf.SlotCounts(8, 3, 3, 12)}),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="auto")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--trace", default=None)
    ap.add_argument("--no-floors", action="store_true", help="skip the floors (they need torch and a GPU)")
    ap.add_argument("--runs", default=None, help="comma-separated names of RUNS to time (default: all)")
    ap.add_argument("--profile", action="store_true",
                    help="also cProfile the calling thread (the scheduler) over one staged call at the defaults")
    args = ap.parse_args(argv)
    dev = rf.device(args.device)
    if not args.no_floors:
        baselines.preload_frameworks()
    gc.collect()
    gc.freeze()
    x = fresh_random(int(args.gib * (1 << 30)) // 4, seed=2)
    expected = x * np.float32(2) + np.float32(1)
    f = kernels.scale_shift()
    res: dict = {"environment": environment(dev), "bytes": x.nbytes, "runs": []}

    wanted = set(args.runs.split(",")) if args.runs else None
    for name, opts in RUNS:
        if wanted is not None and name not in wanted:
            continue
        kw = {"chunk_bytes": "auto", "host": "stage", **opts}
        ok = bool(np.array_equal(rf.stream_map(f, x, device=dev, **kw), expected))
        t = time_calls(lambda: dev.now, lambda: rf.stream_map(f, x, device=dev, **kw), warmup=0,
                       repeats=args.repeats)
        res["runs"].append({"name": name, **t.as_dict(), "correct": ok})
        print(f"{name:20s} {t.median_ms:8.2f} ms (p10 {t.p10_ms:.2f}, p90 {t.p90_ms:.2f}) ok={ok}", flush=True)

    if args.profile:
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        rf.stream_map(f, x, device=dev, chunk_bytes="auto", host="stage")
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
        res["caller_thread_profile"] = text.getvalue()
        print(text.getvalue()[:6000], flush=True)
    y, report = stream_map_report(f, x, device=dev, chunk_bytes="auto", host="stage")
    res["report"] = report.as_dict()
    res["report_correct"] = bool(np.array_equal(y, expected))
    print(report, flush=True)
    if args.trace:
        report.save_trace(args.trace)
    del y

    if not args.no_floors:
        floors: dict = {}
        for name, call in (("host", lambda: baselines.host_floor(x.nbytes, threads=(16,), touch_threads=(16,))),
                           ("link", lambda: baselines.link_floor(x.nbytes, x.nbytes)),
                           ("together", lambda: baselines.staging_floor(x.nbytes, with_link=True)),
                           ("together_no_link", lambda: baselines.staging_floor(x.nbytes, with_link=False))):
            try:
                floors[name] = call()
            except Exception as exc:  # noqa: BLE001 - a floor that cannot be measured is reported, not fatal
                floors[name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(name, json.dumps(floors[name])[:600], flush=True)
        res["floors"] = floors
    text = json.dumps(res, indent=1, default=str)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
