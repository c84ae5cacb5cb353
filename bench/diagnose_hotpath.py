"""Where a stream_map call loses time against the ideal bound, on a real GPU.

    PYTHONPATH=src python3 bench/diagnose_hotpath.py --device cuda:0 --out diag.json

Prints and writes (JSON):

* ``seed``: the 256 MiB in-place seed shape at 8/16/32 chunks, unprofiled medians, the ideal
  bound of a profiled run, and the protocol floor: the same chunks enqueued straight onto
  three streams through ringflow's device protocol with no scheduler (what the primitives
  alone reach);
* ``timeline``: one profiled 16-chunk call, per chunk the host time each stage was enqueued
  and the GPU span of each stage, relative to the call's start, plus when the call returned;
* ``setup``: cProfile of Pipeline creation and close (what the fixed per-call cost is made of);
* ``requests``: the 80%-load request run with per-request stamps of the slowest requests and
  every garbage-collector pause, to explain latency outliers.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import sys
import time

import numpy as np

import ringflow as rf
from ringflow import _testing
from ringflow._bench import kernels
from ringflow._bench.measure import fresh_random, time_calls
from ringflow._bench.runner import environment
from ringflow._bench.workloads import wait_until
from ringflow._pipeline.whole_array import stream_map_report

MiB = 1 << 20


def seed(dev, out: dict, size_mib: int = 256) -> None:
    n = (size_mib * MiB) // 4
    f = kernels.affine(64, numeric_iters=4 if dev.backend == "sim" else None)
    hb = dev.allocate_host(n * 4)
    x = hb.view(np.float32, access="rw")
    x0 = fresh_random(n, seed=1)

    def refill():
        x[:] = x0

    rows = {}
    for chunks in (8, 16, 32):
        cb = n * 4 // chunks

        def run():
            rf.stream_map(f, x, x, device=dev, chunk_bytes=cb, x_buffer=hb, out_buffer=hb, inplace=True)

        t = time_calls(lambda: dev.now, run, warmup=2, repeats=9, before=refill)
        refill()
        _, rep = stream_map_report(f, x, x, device=dev, chunk_bytes=cb, x_buffer=hb, out_buffer=hb, inplace=True)
        floor = protocol_floor(dev, hb, n, chunks, f)
        rows[chunks] = {"median_ms": t.median_ms, "p10_ms": t.p10_ms, "p90_ms": t.p90_ms,
                        "ideal_ms": rep.ideal_s * 1e3, "efficiency": rep.ideal_s * 1e3 / t.median_ms,
                        "stage_ms": {k: v * 1e3 for k, v in rep.stage_median_s.items()},
                        "protocol_floor_ms": floor.median_ms, "protocol_floor_p10_ms": floor.p10_ms,
                        "host_us_per_chunk": rep.host_overhead_per_chunk_s * 1e6}
        print(f"seed {chunks:3d} chunks: {t.median_ms:.3f} ms (p10 {t.p10_ms:.3f}) ideal {rep.ideal_s * 1e3:.3f} "
              f"protocol floor {floor.median_ms:.3f}", flush=True)
    out["seed"] = rows
    out["timeline"] = timeline(dev, hb, x, refill, f, n)
    hb.close()


def protocol_floor(dev, hb, n, chunks, f):
    """The chunks enqueued straight onto three streams: h2d / compute / d2h, events between,
    no slot reuse (a device buffer for the whole array), then one sync."""
    s_in, s_c, s_out = dev.create_stream(), dev.create_stream(), dev.create_stream()
    db = dev.allocate(n * 4, stream=s_in)
    s_in.sync()
    cb = n * 4 // chunks

    def once():
        for i in range(chunks):
            where = db.slice(i * cb, cb)
            s_in.copy(where, hb.slice(i * cb, cb))
            e = s_in.record()
            s_c.wait(e)
            a = db.array(np.float32, cb // 4, offset=i * cb)
            s_c.launch(f, a, a, writes=[a])
            e = s_c.record()
            s_out.wait(e)
            s_out.copy(hb.slice(i * cb, cb), where)
        s_out.sync()

    t = time_calls(lambda: dev.now, once, warmup=2, repeats=9)
    db.close(stream=s_in)
    s_in.sync()
    for s in (s_in, s_c, s_out):
        s.close()
    return t


def timeline(dev, hb, x, refill, f, n) -> dict:
    refill()
    cb = n * 4 // 16
    t0 = dev.now
    _, rep = stream_map_report(f, x, x, device=dev, chunk_bytes=cb, x_buffer=hb, out_buffer=hb, inplace=True)
    t_ret = dev.now
    del rep
    refill()
    got = {}
    pipe_box = {}
    t0 = dev.now
    with _testing.inject(on_engine=lambda e: pipe_box.setdefault("p", getattr(e, "pipe", e))):
        y = rf.stream_map(f, x, x, device=dev, chunk_bytes=cb, x_buffer=hb, out_buffer=hb, inplace=True, profile=True)
    t_ret = dev.now
    del y
    pipe = pipe_box["p"]
    rows = []
    timeline = getattr(pipe, "_timeline", None) or pipe._recorder.timeline
    for r in sorted(timeline.records, key=lambda r: r.index):
        row = {"chunk": r.index, "accepted_ms": (r.accepted - t0) * 1e3, "ended_ms": (r.ended - t0) * 1e3}
        for stage, (a, b) in r.stages.items():
            row[stage] = [round((a - t0) * 1e3, 4), round((b - t0) * 1e3, 4)]
        rows.append(row)
    got["chunks"] = rows
    got["returned_ms"] = (t_ret - t0) * 1e3
    got["steps"] = pipe.scheduler.steps
    got["host_ms"] = pipe.scheduler.host_seconds * 1e3
    for row in rows:
        print(row, flush=True)
    print("returned at", got["returned_ms"], "steps", got["steps"], "host ms", got["host_ms"], flush=True)
    return got


def phases(dev, out: dict, chunks: int = 16, refill_modes=(False, True)) -> None:
    """Host timestamps of an unprofiled seed call's phases, from wrappers around the scheduler
    and pipeline methods (a few microseconds each): when set-up ends, when the first copy is
    enqueued, when the last d2h is seen complete, when close starts and ends."""
    from ringflow._pipeline import api, scheduler

    n = (256 * MiB) // 4
    f = kernels.affine(64)
    hb = dev.allocate_host(n * 4)
    x = hb.view(np.float32, access="rw")
    x[:] = fresh_random(n, seed=1)
    log = []
    originals = {}

    def wrap(cls, name, label):
        fn = getattr(cls, name)
        originals[(cls, name)] = fn

        def wrapper(*a, **k):
            log.append((label + ">", time.perf_counter()))
            try:
                return fn(*a, **k)
            finally:
                log.append((label + "<", time.perf_counter()))
        setattr(cls, name, wrapper)

    from ringflow._pipeline import ring as ring_mod
    from ringflow._pipeline import stages
    from ringflow._device.cuda import device as cuda_device_mod, stream as cuda_stream_mod, memory as cuda_memory_mod

    import ringflow._pipeline.warm as warm_mod

    Sched, Pipe = scheduler.Scheduler, api.Pipeline
    Dev, Stream = cuda_device_mod.CudaDevice, cuda_stream_mod.CudaStream
    for owner, name, label in (
            (Pipe, "_build", "Pipeline._build"), (api, "resolve_slots", "resolve_slots"),
            (Sched, "__init__", "Scheduler.__init__"), (ring_mod.Ring, "__init__", "Ring.__init__"),
            (ring_mod.Ring, "close", "Ring.close"), (Dev, "create_stream", "create_stream"),
            (Dev, "allocate", "allocate"), (Dev, "create_worker_pool", "create_worker_pool"),
            (Stream, "close", "stream.close"), (cuda_memory_mod.CudaDeviceBuffer, "close", "devbuf.close"),
            (stages.StageStreams, "free_after", "order_frees"), (Sched, "accept", "accept"),
            (Sched, "step", "step"), (Pipe, "close", "Pipeline.close"), (Sched, "_release_resources", "release"),
            (Sched, "_enqueue_h2d", "enqueue_h2d"), (Sched, "_on_consumed", "on_consumed"),
            (warm_mod.WarmPipelines, "take", "warm.take"), (Pipe, "_rearm", "rearm"), (Pipe, "map", "map"),
            (Sched, "_observe", "observe"), (Sched, "_start_prepares", "start_prepares"),
            (Sched, "_wait_ready", "wait_ready"), (Stream, "copy", "stream.copy"), (Stream, "wait", "stream.wait")):
        wrap(owner, name, label)
    mark = scheduler.Scheduler._mark
    originals[(scheduler.Scheduler, "_mark")] = mark

    def marked(self, chunk, stream, stage, start=False):  # when each stage's end event is recorded
        r = mark(self, chunk, stream, stage, start)
        if not start:
            log.append((stage + "!", time.perf_counter()))
        return r
    scheduler.Scheduler._mark = marked
    runs = []
    x0 = x.copy()

    def last_of_six(engine: str, refill: bool) -> tuple[float, float]:
        """Six warm calls on ``engine``; the last one's start and end (its stamps are in ``log``)."""
        for _ in range(6):
            if refill:  # the bench's method: the CPU rewrites the 256 MiB input before each call
                x[:] = x0
            log.clear()
            t0 = time.perf_counter()
            rf.stream_map(f, x, x, device=dev, chunk_bytes=n * 4 // chunks, x_buffer=hb, out_buffer=hb, inplace=True,
                          engine=engine)
            t1 = time.perf_counter()
        return t0, t1

    try:
        for refill in refill_modes:
            t0, t1 = last_of_six("pipeline", refill)
            first = {}
            last = {}
            spent = {}
            opened = {}
            for label, t in log:
                first.setdefault(label, t)
                last[label] = t
                name, edge = label[:-1], label[-1]
                if edge == "!":
                    continue
                if edge == ">":
                    opened[name] = t
                else:
                    spent[name] = spent.get(name, 0.0) + (t - opened.pop(name, t)) * 1e6
            first_copy = next((i for i, (lb, _) in enumerate(log) if lb == "h2d!"), len(log))
            runs.append({"engine": "pipeline", "refill": refill, "total_ms": (t1 - t0) * 1e3,
                         "until_first_copy_us": [(lb, round((t - t0) * 1e6, 1)) for lb, t in log[:first_copy + 1]],
                         "enqueued_us": {st: [round((t - t0) * 1e6, 1) for lb, t in log if lb == st + "!"]
                                         for st in ("h2d", "compute", "d2h")},
                         "consumed_us": [round((t - t0) * 1e6, 1) for lb, t in log if lb == "on_consumed<"],
                         "init_us": [(first[k] - t0) * 1e6 if k in first else None
                                     for k in ("Pipeline.__init__>", "Pipeline.__init__<")],
                         "first_h2d_enqueue_us": (first["enqueue_h2d<"] - t0) * 1e6,
                         "last_consumed_ms": (last["on_consumed<"] - t0) * 1e3,
                         "closed": "Pipeline.close>" in first,  # False: kept warm
                         "returned_ms": (t1 - t0) * 1e3,
                         "us_in": {k: round(v, 1) for k, v in spent.items()},
                         "calls": {k[:-1]: sum(1 for lb, _ in log if lb == k) for k in first if k.endswith(">")}})
        # the direct engine (what stream_map runs here by default): when the first copy is
        # enqueued, when the last operation is, and when the call returns
        for refill in refill_modes:
            t0, t1 = last_of_six("direct", refill)
            copies = [t for lb, t in log if lb == "stream.copy>"]
            runs.append({"engine": "direct", "refill": refill, "total_ms": (t1 - t0) * 1e3,
                         "first_copy_us": round((copies[0] - t0) * 1e6, 1) if copies else None,
                         "last_copy_us": round((copies[-1] - t0) * 1e6, 1) if copies else None,
                         "copies": len(copies)})
    finally:
        for (cls, name), fn in originals.items():
            setattr(cls, name, fn)
        hb.close()
    for r in runs:
        print(r, flush=True)
    out["phases"] = runs


def setup_profile(dev, out: dict) -> None:
    from ringflow._pipeline import sizing

    f = kernels.affine(64)

    def whole_array_pipeline(f, **kw):  # a whole-array job's pipeline over the caller's pinned memory
        return rf.Pipeline._for_whole_array(f, prepare=lambda item, raw: ((0,), np.uint8),
                                            consume=lambda *a: None, item_nbytes=lambda item: 0, max_chunks=None,
                                            **kw)

    hb = dev.allocate_host(64 * MiB)
    x = hb.view(np.float32, access="rw")
    x[:] = 1.0
    kw = dict(device=dev, chunk_bytes=4 * MiB, host_in_buffer=hb, host_out_buffer=hb, inplace=True)
    whole_array_pipeline(f, **kw).close()
    times = {"create": [], "close": []}
    for _ in range(20):
        t0 = time.perf_counter()
        p = whole_array_pipeline(f, **kw)
        t1 = time.perf_counter()
        p.close()
        t2 = time.perf_counter()
        times["create"].append(t1 - t0)
        times["close"].append(t2 - t1)
    parts = {}

    def per_call_us(name, fn, n=50):
        fn()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        parts[name] = (time.perf_counter() - t0) / n * 1e6

    per_call_us("create_stream+close", lambda: dev.create_stream().close())
    s0 = dev.create_stream()
    per_call_us("allocate 48 MiB on a stream + close", lambda: dev.allocate(48 * MiB, stream=s0).close(stream=s0))
    per_call_us("create_worker_pool+close", lambda: dev.create_worker_pool(16).close())
    from ringflow._pipeline.ring import Ring
    from ringflow._pipeline.states import RingKind
    per_call_us("Ring of 16 external slots", lambda: Ring(RingKind.HOST_IN, hb, 16, 4 * MiB, external=True))
    big = dev.allocate_host(256 * MiB)
    kw16 = dict(device=dev, chunk_bytes=16 * MiB, host_in_buffer=big, host_out_buffer=big, inplace=True)
    per_call_us("Pipeline seed shape create+close", lambda: whole_array_pipeline(f, **kw16).close(), n=20)
    per_call_us("resolve_slots", lambda: sizing.resolve_slots(dev, None, 16 * MiB, True, 16, f, external=(True, True)))
    s0.sync()
    s0.close()
    big.close()
    print(parts, flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        whole_array_pipeline(f, **kw).close()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(30)
    out["setup"] = {"parts_us": parts, "create_ms_median": float(np.median(times["create"])) * 1e3,
                    "close_ms_median": float(np.median(times["close"])) * 1e3, "cprofile": text.getvalue()}
    print(out["setup"]["create_ms_median"], out["setup"]["close_ms_median"])
    print(text.getvalue()[:5000], flush=True)
    hb.close()


def requests(dev, out: dict, count: int = 300, load: float = 0.8) -> None:
    rng = np.random.default_rng(3)
    chunk_bytes = 8 * MiB
    sizes = np.minimum(chunk_bytes // 4, np.maximum(1024, rng.lognormal(np.log(MiB // 4), 1.0, count).astype(int)))
    items = [fresh_random(int(s), seed=i) for i, s in enumerate(sizes)]
    f = kernels.scale_shift()
    with rf.Pipeline(f, device=dev, chunk_bytes=chunk_bytes) as pipe:
        iso = np.zeros(count)
        for i, it in enumerate(items):
            t0 = dev.now
            pipe.submit(it).result()
            iso[i] = dev.now - t0
        t0 = dev.now
        for fu in [pipe.submit(it) for it in items]:
            fu.result()
        capacity = count / (dev.now - t0)
        slots = pipe.config.slots.__dict__
    print("isolated p50/p99 ms", np.percentile(iso, 50) * 1e3, np.percentile(iso, 99) * 1e3, "capacity", capacity,
          "slots", slots, flush=True)
    pauses = []
    gc_start = {}

    def on_gc(phase, info):
        if phase == "start":
            gc_start["t"] = time.perf_counter()
        else:
            pauses.append({"at": time.perf_counter(), "ms": (time.perf_counter() - gc_start.get("t", 0)) * 1e3,
                           "generation": info.get("generation")})

    gc.callbacks.append(on_gc)
    long_steps = []
    try:
        gaps = rng.exponential(1.0 / (load * capacity), count)
        with rf.Pipeline(f, device=dev, chunk_bytes=chunk_bytes, profile=True) as pipe:
            s = pipe.scheduler
            orig_step = s.step

            def timed_step():
                a = time.perf_counter()
                r = orig_step()
                d = time.perf_counter() - a
                if d > 2e-3:
                    long_steps.append({"at": a, "ms": d * 1e3, "in_flight": len(s.chunks)})
                return r

            s.step = timed_step
            start = arrival = dev.now
            lat = np.zeros(count)
            futs = []
            submitted = []
            for i, (it, gap) in enumerate(zip(items, gaps)):
                arrival += gap
                wait_until(pipe, dev, arrival)
                t_sub = dev.now
                submitted.append(t_sub)
                fu = pipe.submit(it)
                fu.add_done_callback(lambda _f, i=i, t=t_sub: lat.__setitem__(i, dev.now - t))
                futs.append(fu)
            for fu in futs:
                fu.result()
            records = {r.index: r for r in pipe._recorder.timeline.records}
    finally:
        gc.callbacks.remove(on_gc)
    worst = np.argsort(lat)[::-1][:8]
    rows = []
    for i in worst:
        r = records.get(int(i))
        row = {"request": int(i), "latency_ms": lat[i] * 1e3, "bytes": int(sizes[i] * 4),
               "submitted_ms": (submitted[i] - start) * 1e3}
        if r is not None:
            row["accepted_ms"] = (r.accepted - start) * 1e3
            row["stages"] = {k: [round((a - start) * 1e3, 3), round((b - start) * 1e3, 3)] for k, (a, b) in r.stages.items()}
            row["ended_ms"] = (r.ended - start) * 1e3
        rows.append(row)
        print(row, flush=True)
    out["requests"] = {"load": load, "capacity_per_s": capacity, "slots": slots,
                       "isolated_p50_ms": float(np.percentile(iso, 50)) * 1e3,
                       "isolated_p99_ms": float(np.percentile(iso, 99)) * 1e3, "p50_ms": float(np.percentile(lat, 50)) * 1e3,
                       "p99_ms": float(np.percentile(lat, 99)) * 1e3, "worst": rows,
                       "gc_pauses": [{**p, "at_ms": (p["at"] - start) * 1e3} for p in pauses if p["ms"] > 0.5],
                       "long_steps": [{**ls, "at_ms": (ls["at"] - start) * 1e3} for ls in long_steps]}
    print({k: v for k, v in out["requests"].items() if k != "worst"}, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=None)
    ap.add_argument("--parts", default="seed,setup,requests")
    ap.add_argument("--seed-mib", type=int, default=256)
    ap.add_argument("--requests", type=int, default=300, help="requests in the requests part")
    ap.add_argument("--preload", action="store_true", help="import torch and CuPy first, as the bench does")
    args = ap.parse_args(argv)
    dev = rf.device(args.device)
    out = {"environment": environment(dev)}
    if args.preload:
        from ringflow._bench import baselines

        out["frameworks"] = baselines.preload_frameworks()
    gc.freeze()
    for part in args.parts.split(","):
        try:
            if part == "seed":
                seed(dev, out, args.seed_mib)
            elif part == "requests":
                requests(dev, out, count=args.requests)
            else:
                {"setup": setup_profile, "phases": phases}[part](dev, out)
        except Exception as exc:  # noqa: BLE001 - report and go on to the next part
            import traceback

            traceback.print_exc()
            out[part + "_error"] = f"{type(exc).__name__}: {exc}"
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
