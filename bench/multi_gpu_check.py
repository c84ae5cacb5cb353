"""Whole arrays over two GPUs against one, in one run: warm ``MapJob`` calls of the seed shape
(float32 in place, registered once, the affine kernel at 64 iterations; 256 MiB per GPU), the
same with ``graph=True`` (each shard's call one graph launch: no Python per chunk), and
staged ``stream_map`` calls of a fresh 1 GiB pageable array, on ``[dev0]`` and on ``[dev0, dev1]``
alternately; and the simulated GPUs' prediction of the same two jobs (``sim_prediction``: the
seed shape, ``sim_prediction_pageable``: the staged job; ``bench/multi_gpu_predict.py`` has
those and more rows alone). Writes medians, spreads and the ratios as JSON.

    python3 bench/multi_gpu_check.py --devices cuda:0,cuda:1 --out FILE
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import multi_gpu_predict as predict
from _script import header, write

import numpy as np

import ringflow as rf
from ringflow._bench import kernels

MiB = 1 << 20


def timed(fn, calls: int, warmup: int = 2) -> list:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def seed_like(devs, mib_per_gpu: int, calls: int, sim: bool, graph: bool = False) -> dict:
    n = mib_per_gpu * len(devs) * MiB // 4
    x = np.random.default_rng(0).uniform(0.5, 1.5, n).astype(np.float32)
    f = kernels.affine(predict.SEED_ITERS, numeric_iters=4 if sim else None)
    with rf.MapJob(f, x, x, device=devs, chunk_bytes=8 * MiB, host="register", inplace=True, graph=graph) as job:
        t = timed(job, calls)  # the warm-up's two calls: an ordinary one, then the capture
        replayed = job.replays_graph
    return {"median_ms": statistics.median(t), "spread_ms": [min(t), max(t)], "bytes_in": x.nbytes,
            "replays_graph": replayed}


def seed_like_graph(devs, mib_per_gpu: int, calls: int, sim: bool) -> dict:
    return seed_like(devs, mib_per_gpu, calls, sim, graph=True)


def pageable(devs, mib: int, calls: int, sim: bool) -> dict:
    x = np.random.default_rng(1).uniform(0.5, 1.5, mib * MiB // 4).astype(np.float32)
    f = kernels.affine(predict.PAGEABLE_ITERS, numeric_iters=1)
    t = timed(lambda: rf.stream_map(f, x, device=devs, chunk_bytes=predict.PAGEABLE_CHUNK, host="stage"), calls,
              warmup=1)
    return {"median_ms": statistics.median(t), "spread_ms": [min(t), max(t)], "bytes_in": x.nbytes}


def predicted(mib_per_gpu: int, pageable_mib: int, n_dev: int) -> dict:
    """The simulated GPUs' prediction (``"sim:0"`` ... of one simulated host, warm calls) of both
    jobs on one device and on ``n_dev``: ``seed_like`` as bytes a second of ``n_dev`` over one's,
    ``pageable`` as one's time over ``n_dev``'s."""
    f = kernels.affine(predict.SEED_ITERS, numeric_iters=1)
    s1, sn = (predict.in_place_ms(f, mib_per_gpu, k, 8 * MiB) for k in (1, n_dev))
    p1, pn = (predict.pageable_ms(pageable_mib, k) for k in (1, n_dev))
    return {"seed_like": {"one_ms": s1["wall_ms"], "all_ms": sn["wall_ms"],
                          "throughput_scaling": (sn["bytes_in"] / sn["wall_ms"]) / (s1["bytes_in"] / s1["wall_ms"])},
            "pageable": {"one_ms": p1["wall_ms"], "all_ms": pn["wall_ms"], "speedup": p1["wall_ms"] / pn["wall_ms"]}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", default="cuda:0,cuda:1")
    ap.add_argument("--mib-per-gpu", type=int, default=256)
    ap.add_argument("--pageable-mib", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    devs = [rf.device(s) for s in args.devices.split(",")]
    sim = devs[0].backend == "sim"
    out = header([d.name for d in devs])
    for name, run, size in (("seed_like", seed_like, args.mib_per_gpu), ("seed_like_graph", seed_like_graph,
                                                                          args.mib_per_gpu),
                            ("pageable", pageable, args.pageable_mib)):
        row = {}
        for label, use in (("one", devs[:1]), ("all", devs)):
            try:
                # seed_like: size is per GPU, so N devices move N times the bytes of one
                row[label] = run(use, size, args.calls, sim)
            except Exception as exc:  # noqa: BLE001 - record what a GPU refused (e.g. a registration)
                row[label] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        one, alln = row["one"].get("median_ms"), row["all"].get("median_ms")
        if name.startswith("seed_like") and one and alln:
            # each device gets mib_per_gpu: one device moves 1/N of the bytes of N devices
            row["throughput_scaling"] = (row["all"]["bytes_in"] / alln) / (row["one"]["bytes_in"] / one)
        elif one and alln:
            row["speedup"] = one / alln
        out[name] = row
        print(name, row, flush=True)
    try:
        sim = predicted(args.mib_per_gpu, args.pageable_mib, len(devs))
        out["sim_prediction"], out["sim_prediction_pageable"] = sim["seed_like"], sim["pageable"]
    except Exception as exc:  # noqa: BLE001
        out["sim_prediction"] = out["sim_prediction_pageable"] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
    print("sim", out["sim_prediction"], out["sim_prediction_pageable"], flush=True)
    rf.drop_warm_pipelines()
    write(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
