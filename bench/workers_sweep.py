"""The staged pageable path by CPU worker count, against the planner's two models of the pool.

``stream_map(host="stage")`` of a fresh 1 GiB float32 array (y = 2x + 1, a fresh output) for each
``--workers`` count, in rounds that visit every count in turn (``--rounds``, median over them), at
a fixed chunk size (``--chunk-mib``) and at ``chunk_bytes="auto"``. Each row carries the
planner's prediction for that count (``_plan.predict_seconds``: only the workers that the rest of
the pipeline keeps busy copy at once, ``copying_threads``) and what counting every worker as
copying at once predicts (each copy at ``1/workers`` of the host's rate for that many threads).
Every result is checked against numpy.

    PYTHONPATH=src python3 bench/workers_sweep.py --device cuda:0 --workers 4,8,16,32,64,256 --out FILE
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ringflow as rf  # noqa: E402
from ringflow import _plan as plan  # noqa: E402
from ringflow._bench import kernels  # noqa: E402
from ringflow._bench.measure import fresh_random  # noqa: E402
from ringflow._bench.runner import environment  # noqa: E402
from _script import header, write  # noqa: E402

MiB = 1 << 20


def every_worker_copying(profile, total: int, chunk: int, workers: int) -> float:
    """The prediction of a model in which all ``workers`` copy at once (seconds)."""
    t, _ = plan.predict_seconds(profile, total, chunk, workers=workers)
    copy = plan.host_stage_seconds(profile, chunk, workers)
    t = dataclasses.replace(t, prepare=copy, consume=copy, workers=workers)
    return plan.predicted_total(t, -(-total // chunk))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="auto")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--workers", default="4,8,16,32,64,256")
    ap.add_argument("--chunk-mib", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = rf.device(args.device)
    counts = [int(w) for w in args.workers.split(",")]
    f = kernels.scale_shift()
    n = int(args.gib * (1 << 30)) // 4
    chunk = args.chunk_mib * MiB
    profile = dev.hardware
    settings = [(w, c) for w in counts for c in (chunk, "auto")]
    samples: dict = {s: [] for s in settings}
    correct = True
    for r in range(args.rounds + 1):  # round 0 warms every setting up and is not kept
        for w, c in settings:
            x = fresh_random(n, seed=r)
            t0 = time.perf_counter()
            y = rf.stream_map(f, x, device=dev, host="stage", workers=w, chunk_bytes=c)
            dt = time.perf_counter() - t0
            correct = correct and bool(np.array_equal(y, x * np.float32(2) + np.float32(1)))
            if r:
                samples[(w, c)].append(dt)
            del x, y
    rows = []
    for (w, c), s in samples.items():
        size = c if c != "auto" else plan.choose_chunk_bytes(profile, n * 4, workers=w, align=4).chunk_bytes
        _, predicted = plan.predict_seconds(profile, n * 4, size, workers=w)
        row = {"workers": w, "chunk_bytes": c, "planned_chunk_bytes": size,
               "median_ms": statistics.median(s) * 1e3, "min_ms": min(s) * 1e3, "max_ms": max(s) * 1e3,
               "predicted_ms": predicted * 1e3,
               "predicted_every_worker_copying_ms": every_worker_copying(profile, n * 4, size, w) * 1e3,
               "copying_threads": plan.copying_threads(profile, size, size, w, plan.host_seconds_per_chunk(profile, True))}
        rows.append(row)
        print(f"workers {w:4d} chunk {str(c):>8s} ({size // MiB} MiB): {row['median_ms']:7.2f} ms "
              f"[{row['min_ms']:.2f}, {row['max_ms']:.2f}]  predicted {row['predicted_ms']:7.2f}, "
              f"every worker copying {row['predicted_every_worker_copying_ms']:7.2f}", flush=True)
    out = {**header(environment(dev)), "bytes": n * 4, "rounds": args.rounds, "correct": correct, "rows": rows}
    print("correct:", correct, flush=True)
    write(out, args.out)
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())
