"""An inference-shaped request stream: uint8 image batches in, a float16 row per image out
(``Pipeline(output=...)``), against the link's floor measured in the same run.

Each batch is ``--batch`` x 3 x 224 x 224 uint8 (9.6 MB for 64); the compute is each image's
per-channel mean in float16, so the result is ``(batch, 3)`` and the stream is bound by copying
the batches in. Items as ordinary numpy arrays (staged by the CPU workers) and as pool arrays
from ``rf.host.empty`` (read in place); and the same images as one array through
``stream_map(output=...)`` and a ``MapJob`` (ordinary numpy, and a pool array read in place).
Every result checked against numpy.

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


def whole_rate(dev, x: np.ndarray, batch: int, passes: int) -> dict:
    """The images as one array: ``stream_map`` (a warm engine after the first call) and a
    ``MapJob`` (``host="register"``: pinned once for the job's life, where ``x`` is not a pool
    array already), each a median of ``passes`` timed calls after one warm-up; batches per second."""
    spec = ((x.shape[0], 3), np.float16)
    want = expected(x)
    y = rf.stream_map(channel_means, x, device=dev, chunk_bytes=16 * MiB, output=spec)
    ok = bool(np.array_equal(y, want))
    times = []
    for _ in range(passes):
        t0 = time.perf_counter()
        rf.stream_map(channel_means, x, device=dev, chunk_bytes=16 * MiB, output=spec)
        times.append(time.perf_counter() - t0)
    job_times = []
    host = "auto" if rf.host.buffer(x) is not None else "register"
    with rf.MapJob(channel_means, x, device=dev, chunk_bytes=16 * MiB, output=spec, host=host) as job:
        ok = ok and bool(np.array_equal(job(), want))
        for _ in range(passes):
            t0 = time.perf_counter()
            job()
            job_times.append(time.perf_counter() - t0)
        strategy, engine = job.strategy, job.engine
    strategy_map = rf.MapJob(channel_means, x, device=dev, chunk_bytes=16 * MiB, output=spec)
    stream_map_strategy = strategy_map.strategy, strategy_map.engine
    strategy_map.close()
    batches = x.shape[0] / batch
    return {"stream_map_batches_per_s": batches / statistics.median(times),
            "mapjob_batches_per_s": batches / statistics.median(job_times), "stream_map_s": times,
            "mapjob_s": job_times, "mapjob_strategy": strategy, "mapjob_engine": engine,
            "stream_map_strategy": stream_map_strategy, "correct": ok}


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
    whole = np.concatenate(items)
    res["one numpy array"] = whole_rate(dev, whole, args.batch, args.passes)
    pool_whole = rf.host.empty(whole.shape, whole.dtype, device=dev)
    pool_whole[:] = whole
    res["one pool array"] = whole_rate(dev, pool_whole, args.batch, args.passes)
    del pool_whole
    try:
        from ringflow._bench import baselines

        floor = baselines.link_floor(items[0].nbytes * args.batches, res["result_bytes"] * args.batches)
        res["link_floor"] = floor
        res["link_bound_batches_per_s"] = args.batches / (floor["link_floor_ms"] / 1e3)
        bound = res["link_bound_batches_per_s"]
        for k in ("numpy items", "pool items"):
            res[k]["of_link_bound"] = res[k]["batches_per_s"] / bound
        for k in ("one numpy array", "one pool array"):
            res[k]["stream_map_of_link_bound"] = res[k]["stream_map_batches_per_s"] / bound
            res[k]["mapjob_of_link_bound"] = res[k]["mapjob_batches_per_s"] / bound
    except Exception as exc:  # noqa: BLE001 - no torch or no GPU (a dry run on the simulated GPU)
        res["link_floor"] = {"error": f"{type(exc).__name__}: {exc}"}
    for k in ("numpy items", "pool items", "one numpy array", "one pool array"):
        print(k, {kk: (round(v, 3) if isinstance(v, float) else v) for kk, v in res[k].items()
                 if kk not in ("passes", "stream_map_s", "mapjob_s")})
    print("link bound", res.get("link_bound_batches_per_s"))
    write(res, args.out)


if __name__ == "__main__":
    main()
