"""Results in pinned pool memory, measured against the paths they replace, in one run.

* ``requests``: the full workload (capacity, latency under load, both torch baselines), then
  capacity alone, interleaved over rounds, for each way of moving a request's bytes: staged into
  a pool array by ``submit`` (the default), through the host
  rings and CPU workers (the pool's budget too small for any item), staged by ``submit`` at any
  size, staged by the workers with results in cached pool blocks, and items that are pool arrays
  themselves (read in place). Host time the progress thread spends in scheduling steps per
  request is reported for each.
* ``pageable``: a fresh 1 GiB float32 array through ``stream_map`` with a new ordinary result
  (the default) and with a pool result (``whole_array.POOLED_OUT``), and a pool array in with a
  pool result, against the link floor measured in the same run.

    PYTHONPATH=src python3 bench/pinned_results_check.py --device cuda:0 --out pinned.json
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ringflow as rf  # noqa: E402
from ringflow._bench import kernels, workloads  # noqa: E402
from ringflow._bench.runner import environment  # noqa: E402
from ringflow._device import host_pool  # noqa: E402
from ringflow._pipeline import whole_array  # noqa: E402
from _script import header, write  # noqa: E402

MiB = 1 << 20


def request_items(count: int, chunk_bytes: int) -> list:
    """The requests workload's items (same sizes and seeds)."""
    rng = np.random.default_rng(3)
    sizes = np.minimum(chunk_bytes // 4, np.maximum(1024, rng.lognormal(np.log(MiB // 4), 1.0, count).astype(int)))
    return [workloads.fresh_random(int(s), seed=i) for i, s in enumerate(sizes)]


def pooled_copies(dev, items: list) -> list:
    """Copies of ``items`` in pinned pool arrays of ``dev`` (``ringflow.host``): request items
    a pipeline reads in place."""
    out = []
    for it in items:
        p = rf.host.empty(it.shape, it.dtype, device=dev)
        p[:] = it
        out.append(p)
    return out


def capacity(dev, items, passes: int = 3, chunk_bytes: int = 8 * MiB, **options) -> dict:
    """Closed-loop capacity (requests/s, median of ``passes``) of a fresh pipeline over ``items``
    (``options``: more keyword arguments of the pipeline), every result of the first pass
    checked; host time per request in the progress thread's steps."""
    f = kernels.scale_shift()
    rates = []
    with rf.Pipeline(f, device=dev, chunk_bytes=chunk_bytes, **options) as pipe:
        for fu in [pipe.submit(it) for it in items[:30]]:  # warm-up
            fu.result()
        s0, h0 = pipe.scheduler.steps, pipe.scheduler.host_seconds
        ok = True
        for p in range(passes):
            t0 = time.perf_counter()
            futs = [pipe.submit(it) for it in items]
            results = [fu.result() for fu in futs]
            rates.append(len(items) / (time.perf_counter() - t0))
            if p == 0:
                ok = all(np.array_equal(r, it * np.float32(2) + np.float32(1)) for r, it in zip(results, items))
            pooled = sum(rf.host.buffer(r) is not None for r in results)
            del results, futs
        n = passes * len(items)
        host_us = 1e6 * (pipe.scheduler.host_seconds - h0) / n
        steps = (pipe.scheduler.steps - s0) / n
        slots = pipe.config.slots
    return {"capacity_per_s": statistics.median(rates), "passes_per_s": rates, "correct": ok,
            "slots": [slots.host_in, slots.device_in, slots.device_out, slots.host_out],
            "max_in_flight": pipe.config.max_in_flight,
            "results_pooled": pooled, "step_host_us_per_request": host_us, "steps_per_request": steps}


def requests_ab(dev, count: int, rounds: int) -> dict:
    """Capacity of the request stream under each way of moving its bytes, interleaved over
    ``rounds``; ratios against the host-rings path (the pool too small for any item)."""
    from ringflow._pipeline import api

    items = request_items(count, 8 * MiB)
    pooled_items = pooled_copies(dev, items)
    budget = host_pool.pool_for(dev).budget
    read_in_place = api.Pipeline._read_in_place

    def with_budget(nbytes):
        return lambda: rf.host.set_budget(nbytes, device=dev), lambda: rf.host.set_budget(budget, device=dev)

    def with_threshold(nbytes):  # items over nbytes left to the CPU workers (results from the accepting thread)
        def on():
            api.Pipeline._read_in_place = lambda self, item: (
                (type(item) is np.ndarray and item.nbytes > nbytes) or read_in_place(self, item))

        def off():
            api.Pipeline._read_in_place = read_in_place
        return on, off

    nothing = (lambda: None, lambda: None)
    from ringflow._device import protocol

    split = protocol.SPLIT_COPY_BYTES

    def one_thread():
        protocol.SPLIT_COPY_BYTES = 1 << 62

    def restore():
        protocol.SPLIT_COPY_BYTES = split

    variants = {
        "staged at acceptance (default)": (items, nothing),
        "host rings and workers (pool budget 4 KiB)": (items, with_budget(4096)),
        "staged at acceptance, each copy on one thread": (items, (one_thread, restore)),
        "workers stage, results from cached pool blocks": (items, with_threshold(0)),
        "items already pool arrays (read in place)": (pooled_items, nothing),
    }
    runs: dict = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (its, (on, off)) in variants.items():
            gc.collect()
            on()
            try:
                runs[name].append(capacity(dev, its))
            finally:
                off()
    summary = {name: {"capacity_per_s_median": statistics.median(r["capacity_per_s"] for r in rs),
                      "step_host_us_per_request_median": statistics.median(r["step_host_us_per_request"] for r in rs),
                      "correct": all(r["correct"] for r in rs), "runs": rs}
               for name, rs in runs.items()}
    base = summary["host rings and workers (pool budget 4 KiB)"]["capacity_per_s_median"]
    for s in summary.values():
        s["over_host_rings"] = s["capacity_per_s_median"] / base
    return summary


def slots_ab(dev, count: int, rounds: int) -> dict:
    """Capacity of the staged request stream with the planned slots and with more, interleaved
    over ``rounds``: whether chunks in flight (Little's law), not host time, bound it."""
    items = request_items(count, 8 * MiB)
    variants = {"planned": {}, "slots=6": {"slots": 6}, "slots=12": {"slots": 12}, "slots=24": {"slots": 24}}
    runs: dict = {name: [] for name in variants}
    for _ in range(rounds):
        for name, options in variants.items():
            gc.collect()
            runs[name].append(capacity(dev, items, **options))
    return {name: {"capacity_per_s_median": statistics.median(r["capacity_per_s"] for r in rs),
                   "slots": rs[0]["slots"], "max_in_flight": rs[0]["max_in_flight"],
                   "correct": all(r["correct"] for r in rs), "runs": rs} for name, rs in runs.items()}


def pageable_ab(dev, mib: int, repeats: int) -> dict:
    from ringflow._bench import baselines

    f = kernels.scale_shift()
    x = workloads.fresh_random(mib * MiB // 4, seed=2)
    expected = x * np.float32(2) + np.float32(1)
    xp = rf.host.empty(x.shape, x.dtype, device=dev)
    xp[:] = x
    out: dict = {"size_bytes": x.nbytes}
    cases = {"pageable in, new ordinary out": (x, False), "pageable in, pool out": (x, True),
             "pool in, pool out": (xp, True)}
    times: dict = {name: [] for name in cases}
    correct = {}
    for name, (xin, pooled) in cases.items():  # untimed first call: pins, allocates, warms
        whole_array.POOLED_OUT = pooled
        y = rf.stream_map(f, xin, device=dev)
        correct[name] = bool(np.array_equal(y, expected))
        del y
    for _ in range(repeats):  # interleaved: a slow moment of the host hits every case alike
        for name, (xin, pooled) in cases.items():
            whole_array.POOLED_OUT = pooled
            gc.collect()
            t0 = time.perf_counter()
            y = rf.stream_map(f, xin, device=dev)
            times[name].append(1e3 * (time.perf_counter() - t0))
            del y
    whole_array.POOLED_OUT = False
    try:
        floors = baselines.link_floor(x.nbytes, x.nbytes)
    except Exception as exc:  # noqa: BLE001 - no torch or no GPU (a dry run on the simulated GPU)
        floors = {"error": f"{type(exc).__name__}: {exc}"}
    out["floors"] = floors
    for name in cases:
        ms = statistics.median(times[name])
        out[name] = {"ms_median": ms, "ms_min": min(times[name]), "ms_max": max(times[name]), "correct": correct[name],
                     "over_link_floor": ms / floors["link_floor_ms"] if "link_floor_ms" in floors else None}
    base = out["pageable in, new ordinary out"]["ms_median"]
    for name in cases:
        out[name]["over_new_ordinary_out"] = out[name]["ms_median"] / base
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: requests, ab, slots, pageable")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = rf.device(args.device)
    skip = set(filter(None, args.skip.split(",")))
    res = {**header(str(dev)), "environment": environment(dev)}
    if "requests" not in skip:
        print("requests workload", flush=True)
        res["requests"] = workloads.requests(dev, count=args.count)
        r = res["requests"]
        print(f"  capacity {r['capacity_per_s']:.0f}/s, vs torch ring {r.get('ringflow_vs_torch_ring')}, "
              f"vs naive {r.get('ringflow_vs_torch_naive')}, p99@80 {r.get('p99_80_over_isolated')}", flush=True)
    if "ab" not in skip:
        print("requests capacity A/B", flush=True)
        res["requests_ab"] = requests_ab(dev, args.count, args.rounds)
        for name, s in res["requests_ab"].items():
            print(f"  {name}: {s['capacity_per_s_median']:.0f}/s ({s['over_host_rings']:.2f}x host rings), "
                  f"{s['step_host_us_per_request_median']:.0f} us/request in steps, correct={s['correct']}", flush=True)
    if "slots" not in skip:
        print("requests capacity by slots", flush=True)
        res["slots_ab"] = slots_ab(dev, args.count, args.rounds)
        for name, v in res["slots_ab"].items():
            print(f"  {name} {v['slots']} in flight {v['max_in_flight']}: {v['capacity_per_s_median']:.0f}/s, "
                  f"correct={v['correct']}", flush=True)
    if "pageable" not in skip:
        print("pageable A/B", flush=True)
        res["pageable_ab"] = p = pageable_ab(dev, args.mib, args.repeats)
        for name, v in p.items():
            if isinstance(v, dict) and "ms_median" in v:
                print(f"  {name}: {v['ms_median']:.1f} ms ({v['over_new_ordinary_out']:.2f}x default, "
                      f"{v['over_link_floor']}x link floor), correct={v['correct']}", flush=True)
    res["pool"] = rf.host.stats(device=dev).as_dict()
    write(res, args.out)


if __name__ == "__main__":
    main()
