"""Many small arrays through ``Pipeline.map``: items sharing chunks against each item in a chunk of
its own (``coalesce=False``, how ``map`` ran before it shared), with ``submit`` of every item
and its futures read in order, and a naive torch loop (``.cuda()``, compute, ``.cpu()`` per
item) on a GPU, all in one process on the same items, interleaved over ``--rounds`` rounds.

Per item size: items per second and GB/s in (median over rounds, and every round), the chunks
each variant used, and whether every result was bit-exact (``2x + 1`` in float32).

    PYTHONPATH=src python3 bench/map_small_items.py --device cuda:0 --out map-small-items.json
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
from ringflow._bench import kernels  # noqa: E402
from _script import header, write  # noqa: E402
from threads_check import versions  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20


def make_items(item_bytes: int, count: int, seed: int) -> tuple:
    rng = np.random.default_rng(seed)
    xs = [rng.uniform(0.5, 1.5, item_bytes // 4).astype(np.float32) for _ in range(count)]
    return xs, [x * np.float32(2) + np.float32(1) for x in xs]


def run_pipeline(dev, xs, expected, chunk_bytes: int, variant: str) -> dict:
    coalesce = variant != "map-alone"
    with rf.Pipeline(kernels.scale_shift(), device=dev, chunk_bytes=chunk_bytes, coalesce=coalesce) as pipe:
        list(pipe.map(xs[:64]))  # pool blocks for these sizes, the kernel compiled
        before = pipe.scheduler.chunks_admitted
        t0 = time.perf_counter()
        if variant == "submit":
            results = [fut.result() for fut in [pipe.submit(x) for x in xs]]
        else:
            results = list(pipe.map(xs))
        seconds = time.perf_counter() - t0
        chunks = pipe.scheduler.chunks_admitted - before
    ok = len(results) == len(xs) and all(np.array_equal(r, e) for r, e in zip(results, expected))
    return {"seconds": seconds, "chunks": chunks, "correct": ok}


def run_torch_naive(xs, expected) -> dict:
    import torch

    def call(a):
        return torch.add(1, torch.from_numpy(a).cuda(), alpha=2).cpu().numpy()

    for a in xs[:64]:
        call(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    results = [call(a) for a in xs]
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "chunks": None, "correct": all(np.array_equal(r, e) for r, e in zip(results, expected))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--sizes-kib", default="16,64,256,1024")
    ap.add_argument("--total-mib", type=int, default=96, help="bytes in per size and variant")
    ap.add_argument("--max-items", type=int, default=4096)
    ap.add_argument("--chunk-mib", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = rf.device(args.device)
    variants = ["map", "map-alone", "submit"] + (["torch-naive"] if dev.backend == "cuda" else [])
    out = {**header(str(dev)), "versions": versions(), "chunk_bytes": args.chunk_mib * MiB, "rounds": args.rounds,
           "sizes": {}}
    for kib in (int(s) for s in args.sizes_kib.split(",")):
        count = min(args.max_items, args.total_mib * MiB // (kib * KiB))
        xs, expected = make_items(kib * KiB, count, seed=kib)
        runs: dict = {v: [] for v in variants}
        for _ in range(args.rounds):
            for v in variants:
                r = run_torch_naive(xs, expected) if v == "torch-naive" else \
                    run_pipeline(dev, xs, expected, args.chunk_mib * MiB, v)
                runs[v].append(r)
        row: dict = {"items": count, "item_bytes": kib * KiB}
        for v, rs in runs.items():
            rates = [count / r["seconds"] for r in rs]
            row[v] = {"items_per_s": statistics.median(rates), "rounds_items_per_s": rates,
                      "GBps_in": statistics.median(rates) * kib * KiB / 1e9, "chunks": rs[-1]["chunks"],
                      "correct": all(r["correct"] for r in rs)}
        row["map_over_alone"] = row["map"]["items_per_s"] / row["map-alone"]["items_per_s"]
        if "torch-naive" in row:
            row["map_over_torch_naive"] = row["map"]["items_per_s"] / row["torch-naive"]["items_per_s"]
        out["sizes"][f"{kib}KiB"] = row
        print(f"{kib:>5} KiB x {count}: " + ", ".join(f"{v} {row[v]['items_per_s']:.0f}/s ({row[v]['chunks']} chunks)"
                                                      for v in variants)
              + f"; map/alone {row['map_over_alone']:.2f}", flush=True)
    out["correct"] = all(row[v]["correct"] for row in out["sizes"].values() for v in variants)
    write(out, args.out)
    print("correct:", out["correct"])


if __name__ == "__main__":
    main()
