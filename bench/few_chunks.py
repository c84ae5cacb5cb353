"""A staged job of few chunks against the planner and the simulated GPU.

``stream_map(host="stage")`` of a fresh float32 array (y = 2x + 1, a fresh output) cut into ``n``
chunks of ``--chunk-mib`` for each ``--chunks`` count, with ``--workers`` CPU workers, in rounds
that visit every setting in turn (``--rounds``, median over them; a first round warms every
setting up and is not kept). Each row carries the planner's prediction for the job
(``_plan.predict_seconds``: the first chunk's whole latency, the scheduler's time, then one
interval a chunk) and the time the same job takes on a simulated GPU of this device's hardware
profile (virtual clock), so a GPU run says which of the two a job of few chunks is nearer.
Every result is checked against numpy.

    PYTHONPATH=src python3 bench/few_chunks.py --device cuda:0 --chunk-mib 1,8 --chunks 2,3,4,6,16,64 --out FILE
"""

from __future__ import annotations

import argparse
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


def simulated_seconds(profile, f, n_elems: int, chunk: int, workers: int) -> float:
    """The job's time on a new simulated GPU of ``profile`` (its virtual clock), after one call."""
    sim = rf.device("sim", profile=profile, checked=False)
    try:
        x = fresh_random(n_elems, seed=0)
        rf.stream_map(f, x, device=sim, host="stage", workers=workers, chunk_bytes=chunk)
        t0 = sim.now
        rf.stream_map(f, x, device=sim, host="stage", workers=workers, chunk_bytes=chunk)
        return sim.now - t0
    finally:
        sim.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="auto")
    ap.add_argument("--chunk-mib", default="1,8")
    ap.add_argument("--chunks", default="2,3,4,6,16,64")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = rf.device(args.device)
    f = kernels.scale_shift()
    profile = dev.hardware
    settings = [(int(c) * MiB, int(n)) for c in args.chunk_mib.split(",") for n in args.chunks.split(",")]
    samples: dict = {s: [] for s in settings}
    correct = True
    for r in range(args.rounds + 1):
        for chunk, n in settings:
            x = fresh_random(chunk * n // 4, seed=r)
            t0 = time.perf_counter()
            y = rf.stream_map(f, x, device=dev, host="stage", workers=args.workers, chunk_bytes=chunk)
            dt = time.perf_counter() - t0
            correct = correct and bool(np.array_equal(y, x * np.float32(2) + np.float32(1)))
            if r:
                samples[(chunk, n)].append(dt)
            del x, y
    rows = []
    for (chunk, n), s in samples.items():
        _, predicted = plan.predict_seconds(profile, chunk * n, chunk, workers=args.workers)
        simulated = simulated_seconds(profile, f, chunk * n // 4, chunk, args.workers)
        row = {"chunk_bytes": chunk, "chunks": n, "median_ms": statistics.median(s) * 1e3, "min_ms": min(s) * 1e3,
               "max_ms": max(s) * 1e3, "predicted_ms": predicted * 1e3, "simulated_ms": simulated * 1e3}
        rows.append(row)
        print(f"{chunk // MiB:3d} MiB x {n:3d}: {row['median_ms']:8.2f} ms [{row['min_ms']:.2f}, {row['max_ms']:.2f}]"
              f"  predicted {row['predicted_ms']:8.2f}  simulated {row['simulated_ms']:8.2f}", flush=True)
    out = {**header(environment(dev)), "workers": args.workers, "rounds": args.rounds, "correct": correct,
           "rows": rows}
    print("correct:", correct, flush=True)
    write(out, args.out)
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())
