"""The pageable path's knobs on a real GPU: host ring sizes, chunk size and CPU workers, for
1 GiB in and a fresh 1 GiB out (``y = 2x + 1``), against the host floor measured in the same run.

    PYTHONPATH=src python3 bench/tune_pageable.py --device cuda:0 --out tune.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys

import numpy as np

import ringflow as rf
from ringflow.benchmarks import kernels
from ringflow.benchmarks.measure import fresh_random, time_calls
from ringflow.benchmarks.runner import environment

MiB = 1 << 20
CONFIGS = [  # (name, chunk MiB, slots or None for planned, workers or None for the default)
    ("planned (auto chunk)", None, None, None),
    ("8 MiB, 5/11 host slots, 15 workers", 8, (5, 3, 3, 11), 15),
    ("8 MiB, 16/16 host slots, 15 workers", 8, (16, 3, 3, 16), 15),
    ("8 MiB, 16/16 host slots, 14 workers", 8, (16, 3, 3, 16), 14),
    ("8 MiB, 12/16 host slots, 15 workers", 8, (12, 3, 3, 16), 15),
    ("16 MiB, 16/16 host slots, 15 workers", 16, (16, 3, 3, 16), 15),
    ("16 MiB, 8/12 host slots, 15 workers", 16, (8, 3, 3, 12), 15),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="auto")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = rf.device(args.device)
    gc.collect()
    gc.freeze()
    n = int(args.gib * (1 << 30)) // 4
    x = fresh_random(n, seed=2)
    expected = x * np.float32(2) + np.float32(1)
    f = kernels.scale_shift()
    out = {"environment": environment(dev), "bytes": x.nbytes, "rows": []}
    for name, chunk, slots, workers in CONFIGS:
        kw = {"chunk_bytes": "auto" if chunk is None else chunk * MiB, "host": "stage"}
        if slots is not None:
            kw["slots"] = rf.SlotCounts(*slots)
        if workers is not None:
            kw["workers"] = workers
        y = rf.stream_map(f, x, device=dev, **kw)
        ok = bool(np.array_equal(y, expected))
        del y
        t = time_calls(lambda: dev.now, lambda: rf.stream_map(f, x, device=dev, **kw), warmup=0, repeats=args.repeats)
        row = {"name": name, **t.as_dict(), "correct": ok}
        out["rows"].append(row)
        print(f"{name:40s} {t.median_ms:8.2f} ms (p10 {t.p10_ms:.2f}, p90 {t.p90_ms:.2f}) ok={ok}", flush=True)
        rf.drop_warm_pipelines(dev)
    if dev.backend == "cuda":
        from ringflow.benchmarks import baselines

        fl = baselines.host_floor(x.nbytes, threads=(16,), touch_threads=(16,))
        out["host_floor"] = fl
        floor = fl.get("host_staging_ms_estimate")
        out["floor_ms"] = floor
        print("host staging floor", floor, "ms;", {k: v for k, v in fl.items() if "GBps" in k}, flush=True)
        for row in out["rows"]:
            row["fraction_of_floor"] = floor / row["ms_median"]
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
