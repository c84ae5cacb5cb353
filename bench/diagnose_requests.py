"""Why request latency grows under load, on a real GPU: throughput and latency against the
number of requests in flight, and where a loaded request's time goes.

    PYTHONPATH=src python3 bench/diagnose_requests.py --device cuda:0 --out diag.json

For each pipeline variant (default workers, fewer workers, ...):

* ``isolated``: one request at a time (after a warm-up), latency p50/p99;
* ``closed``: for N in 1, 2, 4, 8, 16, 32: N requests kept in flight (a new one submitted as
  the oldest finishes): throughput, latency p50/p99, and the caller thread's CPU time per
  request (``thread_time``: the scheduler runs on the caller's thread, so when this equals
  1/throughput the scheduler thread is the bottleneck);
* ``stages`` (profiled run at one N): per request, the gap before and the length of each
  stage (accept -> prepare start, prepare, prepare end -> h2d start, ...), medians and p90;
* ``profile``: cProfile of the caller thread at one N (the scheduler's own costs).

The request sizes and kernel are the ``requests`` workload's (lognormal, median 1 MiB, capped at
an 8 MiB slot; y = x*2+1).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import io
import json
import pstats
import sys
import time

import numpy as np

import ringflow as rf
from ringflow._bench import kernels
from ringflow._bench.measure import fresh_random
from ringflow._bench.runner import environment

MiB = 1 << 20
STAGES = ("prepare", "h2d", "compute", "d2h", "consume")


def make_items(count: int, chunk_bytes: int = 8 * MiB):
    rng = np.random.default_rng(3)
    sizes = np.minimum(chunk_bytes // 4, np.maximum(1024, rng.lognormal(np.log(MiB // 4), 1.0, count).astype(int)))
    return [fresh_random(int(s), seed=i) for i, s in enumerate(sizes)]


def closed_loop(dev, pipe, items, n: int) -> dict:
    """Keep ``n`` requests in flight; the oldest is awaited before the next is submitted."""
    lat = np.zeros(len(items))
    pending = collections.deque()
    t_cpu = time.thread_time()
    t0 = dev.now
    steps0, host0 = pipe.scheduler.steps, pipe.scheduler.host_seconds
    for i, it in enumerate(items):
        if len(pending) >= n:
            pending.popleft().result()
        ts = dev.now
        fu = pipe.submit(it)
        fu.add_done_callback(lambda _f, i=i, ts=ts: lat.__setitem__(i, dev.now - ts))
        pending.append(fu)
    for fu in pending:
        fu.result()
    wall = dev.now - t0
    cpu = time.thread_time() - t_cpu
    k = len(items)
    return {"n": n, "per_s": k / wall, "p50_ms": 1e3 * float(np.percentile(lat, 50)),
            "p99_ms": 1e3 * float(np.percentile(lat, 99)), "caller_cpu_us_per_req": 1e6 * cpu / k,
            "wall_us_per_req": 1e6 * wall / k,
            "step_us_per_req": 1e6 * (pipe.scheduler.host_seconds - host0) / k,
            "steps_per_req": (pipe.scheduler.steps - steps0) / k}


def stage_breakdown(records, start_index: int, stamps: dict | None = None) -> dict:
    """Gaps before and lengths of each stage; with ``stamps`` (chunk index -> the scheduler's
    own stamps: when it submitted a CPU task and when it saw the task done) also the pool's
    dispatch delay (submitted -> a worker starts it) and the scheduler's reaction (task ends ->
    the scheduler sees it)."""
    gaps = collections.defaultdict(list)
    for r in records:
        st = (stamps or {}).get(r.index)
        if st is not None and r.index >= start_index:
            for stage in ("prepare", "consume"):
                if stage in r.stages and st.get(stage) and st[stage][1] is not None:
                    gaps[f"{stage}: submitted->worker starts"].append(r.stages[stage][0] - st[stage][0])
                    gaps[f"{stage}: worker ends->scheduler sees"].append(st[stage][1] - r.stages[stage][1])
            if "d2h" in r.stages and st.get("consume"):
                gaps["d2h gpu end->consume submitted"].append(st["consume"][0] - r.stages["d2h"][1])
            if "h2d" in r.stages and st.get("prepare") and st["prepare"][1] is not None:
                gaps["prepare seen->h2d gpu start"].append(r.stages["h2d"][0] - st["prepare"][1])
        if r.index < start_index or any(s not in r.stages for s in STAGES):
            continue
        prev_end, prev = r.accepted, "accept"
        for s in STAGES:
            a, b = r.stages[s]
            gaps[f"{prev}->{s}"].append(a - prev_end)
            gaps[s].append(b - a)
            prev_end, prev = b, s
        gaps["consume->end"].append(r.ended - prev_end)
        gaps["latency"].append(r.ended - r.accepted)
    return {k: {"p50_us": 1e6 * float(np.percentile(v, 50)), "p90_us": 1e6 * float(np.percentile(v, 90)),
                "p99_us": 1e6 * float(np.percentile(v, 99))} for k, v in gaps.items()}


def variant(dev, items, name: str, ns, stage_n: int, profile_n: int | None, **opts) -> dict:
    f = kernels.scale_shift()
    out = {"name": name, "options": {k: str(v) for k, v in opts.items()}}
    with rf.Pipeline(f, device=dev, chunk_bytes=8 * MiB, **opts) as pipe:
        out["config"] = str(pipe.config)
        for it in items[:30]:
            pipe.submit(it).result()
        iso = []
        for it in items[:300]:
            t0 = dev.now
            pipe.submit(it).result()
            iso.append(dev.now - t0)
        out["isolated"] = {"p50_ms": 1e3 * float(np.percentile(iso, 50)), "p99_ms": 1e3 * float(np.percentile(iso, 99))}
        out["closed"] = []
        for n in ns:
            if n > pipe.config.max_in_flight:
                continue
            closed_loop(dev, pipe, items[:30], n)  # warm at this depth
            row = closed_loop(dev, pipe, items, n)
            out["closed"].append(row)
            print(name, row, flush=True)
        if profile_n:
            prof = cProfile.Profile()
            prof.enable()
            closed_loop(dev, pipe, items[:300], profile_n)
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
            out["profile"] = s.getvalue()
    if stage_n:
        with rf.Pipeline(f, device=dev, chunk_bytes=8 * MiB, profile=True, **opts) as pipe:
            stamps = {}
            end = pipe._sched._on_chunk_end

            def keep_stamps(chunk, *a, **k):
                stamps[chunk.index] = {s: list(v) if isinstance(v, list) else v for s, v in chunk.stamps.items()}
                return end(chunk, *a, **k)

            pipe._sched._on_chunk_end = keep_stamps
            out["stages"] = {}
            for n in (1, stage_n):
                closed_loop(dev, pipe, items[:30], n)
                first = pipe.stats().accepted
                row = closed_loop(dev, pipe, items[:400], n)
                out["stages"][n] = {"closed": row, "breakdown": stage_breakdown(pipe._recorder.timeline.records, first, stamps)}
            print(name, "stages", json.dumps(out["stages"]), flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=None)
    ap.add_argument("--count", type=int, default=600)
    ap.add_argument("--variants", default="default,workers4,workers8")
    ap.add_argument("--open-workers", default="", help="also run the bench's open-loop requests workload "
                    "(1000 requests at 50/80/95%% load) with these worker counts, e.g. 2,4,15")
    args = ap.parse_args(argv)
    dev = rf.device(args.device)
    from ringflow._bench import baselines

    res = {"environment": environment(dev), "frameworks": baselines.preload_frameworks()}
    items = make_items(args.count)
    gc.freeze()
    table = {"default": {}, "workers4": {"workers": 4}, "workers8": {"workers": 8}, "workers2": {"workers": 2},
             "workers1": {"workers": 1},
             "workers2-slots8": {"workers": 2, "slots": rf.SlotCounts(8, 3, 3, 8), "max_in_flight": 22},
             "workers4-slots8": {"workers": 4, "slots": rf.SlotCounts(8, 3, 3, 8), "max_in_flight": 22}}
    def save():  # after every part, so a run cut short still leaves what it measured
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(res, fh, indent=1, default=str)

    res["open_loop"] = []
    for w in filter(None, args.open_workers.split(",")):
        from ringflow._bench import workloads

        r = workloads.requests(dev, count=1000, pipeline_options={"workers": int(w)})
        row = {"workers": int(w), "capacity_per_s": r["capacity_per_s"], "capacity_passes_per_s": r["capacity_passes_per_s"], "isolated_p99_ms": r["isolated_p99_ms"],
               "isolated_p50_ms": r["isolated_p50_ms"],
               "levels": [{k: lv[k] for k in ("load", "p50_ms", "p99_ms", "p99_over_isolated", "correct",
                                              "pinned_high_water_MiB")} for lv in r["levels"]]}
        res["open_loop"].append(row)
        print("open loop", json.dumps(row), flush=True)
        save()
    res["variants"] = []
    for name in filter(None, args.variants.split(",")):
        res["variants"].append(variant(dev, items, name, (1, 2, 4, 8, 16, 32), stage_n=8,
                                       profile_n=16 if name == "default" else None, **table[name]))
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
