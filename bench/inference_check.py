"""An inference-shaped request stream: uint8 image batches in, a float16 row per image out
(``Pipeline(output=...)``), against the link's floor measured in the same run.

Each batch is ``--batch`` x 3 x 224 x 224 uint8 (9.6 MB for 64); the compute is each image's
per-channel mean in float16, so the result is ``(batch, 3)`` and the stream is bound by copying
the batches in. Items as ordinary numpy arrays (staged by the CPU workers) and as pool arrays
from ``rf.host.empty`` (read in place); every result checked against numpy.

    PYTHONPATH=src python3 bench/inference_check.py --device cuda:0 --out inference.json
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
from ringflow._bench.runner import environment  # noqa: E402
from _script import header, write  # noqa: E402

MiB = 1 << 20


def channel_means(x, y):
    n = x.shape[0]
    y[...] = (x.reshape(n, 3, -1).sum(axis=2, dtype=np.float32) / (x.shape[2] * x.shape[3])).astype(y.dtype)


def expected(batch: np.ndarray) -> np.ndarray:
    n = batch.shape[0]
    return (batch.reshape(n, 3, -1).sum(axis=2, dtype=np.float32) / (batch.shape[2] * batch.shape[3])).astype(np.float16)


def rate(dev, items, passes: int) -> dict:
    n = items[0].shape[0]
    with rf.Pipeline(channel_means, device=dev, chunk_bytes=16 * MiB, output=((n, 3), np.float16)) as pipe:
        out = list(pipe.map(items[:8]))  # warm-up
        ok = all(np.array_equal(r, expected(b)) for r, b in zip(out, items))
        rates = []
        for _ in range(passes):
            t0 = time.perf_counter()
            for _r in pipe.map(items):
                pass
            rates.append(len(items) / (time.perf_counter() - t0))
    return {"batches_per_s": statistics.median(rates), "passes": rates, "correct": ok}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--batches", type=int, default=48)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = rf.device(args.device)
    rng = np.random.default_rng(0)
    items = [rng.integers(0, 256, (args.batch, 3, 224, 224), dtype=np.uint8) for _ in range(args.batches)]
    pooled = []
    for b in items:
        p = rf.host.empty(b.shape, b.dtype, device=dev)
        p[:] = b
        pooled.append(p)
    res = {**header(str(dev)), "environment": environment(dev), "batch_bytes": items[0].nbytes,
           "result_bytes": args.batch * 3 * 2}
    res["numpy items"] = rate(dev, items, args.passes)
    res["pool items"] = rate(dev, pooled, args.passes)
    try:
        from ringflow._bench import baselines

        floor = baselines.link_floor(items[0].nbytes * args.batches, res["result_bytes"] * args.batches)
        res["link_floor"] = floor
        res["link_bound_batches_per_s"] = args.batches / (floor["link_floor_ms"] / 1e3)
        for k in ("numpy items", "pool items"):
            res[k]["of_link_bound"] = res[k]["batches_per_s"] / res["link_bound_batches_per_s"]
    except Exception as exc:  # noqa: BLE001 - no torch or no GPU (a dry run on the simulated GPU)
        res["link_floor"] = {"error": f"{type(exc).__name__}: {exc}"}
    for k in ("numpy items", "pool items"):
        print(k, {kk: (round(v, 3) if isinstance(v, float) else v) for kk, v in res[k].items() if kk != "passes"})
    print("link bound", res.get("link_bound_batches_per_s"))
    write(res, args.out)


if __name__ == "__main__":
    main()
