"""A ``Pipeline`` request stream on one GPU and spread over several, in one run.

The ``requests`` workload's items (lognormal sizes, median 1 MiB) through ``Pipeline(f,
device=...)`` with one device and with the list given: closed-loop capacity (median of the
rounds, interleaved), latency at 80% of each one's capacity against its isolated latency (open
loop, Poisson arrivals), every result checked; the simulated GPUs' prediction for the same runs;
and a profiled run's timeline PNG with a track group per device.

    PYTHONPATH=src python3 bench/multi_gpu_requests.py --devices cuda:0,cuda:1 --out multi-requests.json --png two.png
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
from pinned_results_check import MiB, request_items  # noqa: E402


def expected(items):
    return [it * np.float32(2) + np.float32(1) for it in items]


def capacity(device, items, want) -> dict:
    """Closed loop: every item submitted as fast as admission allows, three passes (median)."""
    rates = []
    with rf.Pipeline(kernels.scale_shift(), device=device, chunk_bytes=8 * MiB) as pipe:
        for fu in [pipe.submit(it) for it in items[:30]]:
            fu.result()
        ok = True
        for p in range(3):
            t0 = time.perf_counter()
            futs = [pipe.submit(it) for it in items]
            results = [fu.result() for fu in futs]
            rates.append(len(items) / (time.perf_counter() - t0))
            if p == 0:
                ok = all(np.array_equal(r, e) for r, e in zip(results, want))
            del results, futs
    return {"capacity_per_s": statistics.median(rates), "passes_per_s": rates, "correct": ok}


def latency(device, items, want, rate: float, seed: int = 0) -> dict:
    """Open loop at ``rate`` requests/s (Poisson arrivals) and one at a time: p50/p99 in ms."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, len(items))
    with rf.Pipeline(kernels.scale_shift(), device=device, chunk_bytes=8 * MiB) as pipe:
        for fu in [pipe.submit(it) for it in items[:30]]:
            fu.result()
        iso = []
        for it in items[:300]:
            t0 = time.perf_counter()
            pipe.submit(it).result()
            iso.append(time.perf_counter() - t0)
        done = np.zeros(len(items))
        futs = []
        start = time.perf_counter()
        arrive = start + np.cumsum(gaps)
        for i, it in enumerate(items):
            while time.perf_counter() < arrive[i]:
                pass
            fu = pipe.submit(it)
            fu.add_done_callback(lambda _f, i=i: done.__setitem__(i, time.perf_counter()))
            futs.append(fu)
        results = [fu.result() for fu in futs]
        ok = all(np.array_equal(r, e) for r, e in zip(results, want))
    lat = done - arrive
    p99_iso = float(np.percentile(iso, 99))
    return {"offered_per_s": rate, "p50_ms": 1e3 * float(np.percentile(lat, 50)),
            "p99_ms": 1e3 * float(np.percentile(lat, 99)), "isolated_p99_ms": 1e3 * p99_iso,
            "p99_over_isolated": float(np.percentile(lat, 99)) / p99_iso, "correct": ok}


def simulated_capacity(devs, items, warmup: int = 30) -> float:
    """Closed-loop capacity (requests a second of virtual time) of a ``Pipeline`` over the simulated
    GPUs ``devs``: ``warmup`` items untimed (as :func:`capacity`), then every item submitted as
    fast as admission allows; the time is the largest advance of a device's clock."""
    dev = devs if len(devs) > 1 else devs[0]
    with rf.Pipeline(kernels.scale_shift(), device=dev, chunk_bytes=8 * MiB) as pipe:
        for fu in [pipe.submit(it) for it in items[:warmup]]:
            fu.result()
        t0 = [d.now for d in devs]
        futs = [pipe.submit(it) for it in items]
        for fu in futs:
            fu.result()
        return len(items) / max(d.now - a for d, a in zip(devs, t0))


def predicted(n: int, items) -> dict:
    """The simulated GPUs' capacity for one and for ``n`` devices of one simulated host
    (``"sim:0"`` ..., sharing its host copy rate; virtual time)."""
    out = {k: simulated_capacity([rf.device(f"sim:{i}") for i in range(k)], items) for k in (1, n)}
    return {"capacity_per_s": out, "ratio": out[n] / out[1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", default="cuda:0,cuda:1")
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--png")
    ap.add_argument("--out")
    args = ap.parse_args()
    names = args.devices.split(",")
    devs = [rf.device(n) for n in names]
    items = request_items(args.count, 8 * MiB)
    want = expected(items)
    res = {**header(", ".join(str(d) for d in devs)), "devices": names, "count": args.count}
    runs: dict = {"one": [], "all": []}
    for _ in range(args.rounds):
        runs["one"].append(capacity(devs[0], items, want))
        runs["all"].append(capacity(devs, items, want))
    cap = {k: statistics.median(r["capacity_per_s"] for r in v) for k, v in runs.items()}
    res["capacity"] = {"one_per_s": cap["one"], "all_per_s": cap["all"], "ratio": cap["all"] / cap["one"],
                       "correct": all(r["correct"] for v in runs.values() for r in v), "runs": runs}
    print(f"capacity: one {cap['one']:.0f}/s, {len(devs)} devices {cap['all']:.0f}/s "
          f"({cap['all'] / cap['one']:.2f}x)", flush=True)
    res["latency_80"] = {"one": latency(devs[0], items, want, 0.8 * cap["one"]),
                         "all": latency(devs, items, want, 0.8 * cap["all"])}
    for k, v in res["latency_80"].items():
        print(f"80% load, {k}: p99 {v['p99_ms']:.2f} ms, {v['p99_over_isolated']:.2f}x isolated, "
              f"correct={v['correct']}", flush=True)
    res["simulated"] = predicted(len(devs), items)
    print(f"simulated: {res['simulated']['ratio']:.2f}x", flush=True)
    if args.png:
        with rf.Pipeline(kernels.scale_shift(), device=devs, chunk_bytes=8 * MiB, profile=True) as pipe:
            list(pipe.map(items[:200]))
        pipe.report().plot(args.png)
        res["png"] = os.path.basename(args.png)
    write(res, args.out)


if __name__ == "__main__":
    main()
