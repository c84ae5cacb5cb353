"""The scheduler's host time per staged chunk, by chunk size and CPU worker count.

``doctor --save`` measures the host's time per staged chunk with 64 KiB chunks, where the host
alone bounds the run. This asks whether a chunk costs the scheduler the same when its workers
are busy copying large chunks: for each ``--chunks-kib`` size and ``--workers`` count, 128 chunks
of a fresh float32 array through ``stream_map(host="stage")`` (y = 2x + 1, a fresh output), in
rounds that visit every setting in turn. Each row gives the wall time of plain calls, and of
profiled calls (``stream_map_report``) the scheduler's own time per chunk: its scheduling steps
timed on its thread (``Report.host_overhead_per_chunk_s``), waits for the GIL inside them
included. Every result is checked against numpy.

    PYTHONPATH=src python3 bench/scheduler_load.py --device cuda:0 --workers 1,4,16 --chunks-kib 64,8192 --out FILE
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

CHUNKS = 128


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="auto")
    ap.add_argument("--workers", default="1,4,16")
    ap.add_argument("--chunks-kib", default="64,8192")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = rf.device(args.device)
    f = kernels.scale_shift()
    settings = [(w, int(c) << 10) for c in args.chunks_kib.split(",") for w in map(int, args.workers.split(","))]
    wall: dict = {s: [] for s in settings}
    host: dict = {s: [] for s in settings}
    correct = True
    for r in range(args.rounds + 1):  # round 0 warms every setting up and is not kept
        for w, c in settings:
            x = fresh_random(CHUNKS * c // 4, seed=r)
            t0 = time.perf_counter()
            y = rf.stream_map(f, x, device=dev, host="stage", workers=w, chunk_bytes=c)
            dt = time.perf_counter() - t0
            y2, rep = rf.stream_map_report(f, x, device=dev, host="stage", workers=w, chunk_bytes=c)
            expected = x * np.float32(2) + np.float32(1)
            correct = correct and bool(np.array_equal(y, expected) and np.array_equal(y2, expected))
            if r:
                wall[(w, c)].append(dt)
                host[(w, c)].append(rep.host_overhead_per_chunk_s)
            del x, y, y2
    profile = dev.hardware
    rows = []
    for w, c in settings:
        _, predicted = plan.predict_seconds(profile, CHUNKS * c, c, workers=w)
        row = {"workers": w, "chunk_bytes": c, "chunks": CHUNKS,
               "wall_ms_median": statistics.median(wall[(w, c)]) * 1e3,
               "wall_us_per_chunk_median": statistics.median(wall[(w, c)]) / CHUNKS * 1e6,
               "scheduler_us_per_chunk": [s * 1e6 for s in host[(w, c)]],
               "scheduler_us_per_chunk_median": statistics.median(host[(w, c)]) * 1e6,
               "planned_host_us_per_chunk": plan.host_seconds_per_chunk(profile, True) * 1e6,
               "predicted_ms": predicted * 1e3}
        rows.append(row)
        print(f"workers {w:3d} chunk {c >> 10:6d} KiB: wall {row['wall_ms_median']:8.2f} ms "
              f"({row['wall_us_per_chunk_median']:7.1f} us a chunk), scheduler "
              f"{row['scheduler_us_per_chunk_median']:7.1f} us a chunk (planned {row['planned_host_us_per_chunk']:.1f}), "
              f"predicted {row['predicted_ms']:8.2f} ms", flush=True)
    out = {**header(environment(dev)), "rounds": args.rounds, "correct": correct, "rows": rows}
    print("correct:", correct, flush=True)
    write(out, args.out)
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())
