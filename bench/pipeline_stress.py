"""Pipeline stress on a real GPU (or the sim): >= 10,000 chunks of random sizes and dtypes
through tight rings in checked mode (every released slot poisoned: host slots on the CPU,
device slots by a memset on a separate stream), with injected exceptions and cancellations,
every output compared with numpy bit for bit.

    PYTHONPATH=src python3 bench/pipeline_stress.py --device cuda:0 --chunks 10000 --out summary.json

Also runs a few pipelines with one guard switched off (a test-only seam) to show that the
poison turns a premature reuse into a wrong result on the real device.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import platform
import sys
import time

import numpy as np

import ringflow as rf
from ringflow import _testing
from ringflow._pipeline import GUARDS, SlotCounts
from ringflow._pipeline.direct import GUARDS as DIRECT_GUARDS

DTYPES = [np.float32, np.float64, np.int32, np.int16, np.uint8, np.complex64]


def twice_plus_one(x, y):
    """Works on numpy (sim) and CuPy/torch arrays (GPU, on the current stream)."""
    y[...] = x * 2 + 1


def expected(a: np.ndarray) -> np.ndarray:
    return (a * 2 + 1).astype(a.dtype)


class Marked(Exception):
    pass


def make_items(rng, count, max_elems):
    items = []
    for i in range(count):
        dt = DTYPES[rng.integers(len(DTYPES))]
        n = int(rng.integers(1, max_elems))
        if np.issubdtype(dt, np.integer):
            a = rng.integers(1, 100, n).astype(dt)
        elif np.issubdtype(dt, np.complexfloating):
            a = (rng.uniform(0.5, 1.5, n) + 1j * rng.uniform(0.5, 1.5, n)).astype(dt)
        else:
            a = rng.uniform(0.5, 1.5, n).astype(dt)
        items.append(a)
    return items


def run_map(dev, items, *, slots, fail_every, on_error, seed):
    """map() with injected prepare/compute/consume failures; returns counts and mismatches."""
    bad_prepare = set(range(3, len(items), fail_every * 3)) if fail_every else set()
    bad_compute = set(range(5, len(items), fail_every * 3)) if fail_every else set()
    bad_consume = set(range(7, len(items), fail_every * 3)) if fail_every else set()
    ids = {id(a): i for i, a in enumerate(items)}

    def prepare(a):
        if ids[id(a)] in bad_prepare:
            raise Marked("prepare")
        return a

    marked_size = max(a.size for a in items) + 1  # make_items never produces this size

    def compute(x, y):
        # a marked chunk (by its size, known on the host: no sync) raises while enqueueing
        if x.size == marked_size:
            raise Marked("compute")
        twice_plus_one(x, y)

    def consume(index, item, view):
        if ids[id(item)] in bad_consume:
            raise Marked("consume")
        return np.array(view, copy=True)

    for i in bad_compute:
        items[i] = np.full(marked_size, 7, np.uint8)
        ids[id(items[i])] = i
    with rf.Pipeline(compute, device=dev, prepare=prepare, consume=consume, slots=slots, chunk_bytes=max(a.nbytes for a in items),
                     checked=True, on_error=on_error, ordered=True) as pipe:
        got = list(pipe.map(items))
        stats = pipe.stats()
        failures = pipe.failures
    ok_items = [a for i, a in enumerate(items) if i not in bad_prepare | bad_compute | bad_consume]
    mismatches = sum(1 for g, a in zip(got, ok_items) if not (g.dtype == a.dtype and np.array_equal(g, expected(a))))
    return {"items": len(items), "delivered": stats.delivered, "failed": stats.failed, "cancelled": stats.cancelled,
            "in_flight": stats.in_flight, "mismatches": mismatches + abs(len(got) - len(ok_items)),
            "failures_by_stage": {s: sum(1 for e in failures if e.stage == s) for s in ("prepare", "compute", "consume")},
            "expected_failures": len(bad_prepare | bad_compute | bad_consume)}


def run_cancel(dev, items, slots, cancel_after):
    pipe = rf.Pipeline(twice_plus_one, device=dev, slots=slots, chunk_bytes=max(a.nbytes for a in items), checked=True)
    futs = [pipe.submit(a) for a in items[:cancel_after]]
    for _ in range(cancel_after // 3):
        pipe._step()
    pipe.cancel()
    st = pipe.stats()
    pipe.close()
    wrong = 0
    for fu, a in zip(futs, items):
        if fu.cancelled():
            continue
        try:
            r = fu.result()
        except concurrent.futures.CancelledError:
            continue
        wrong += int(not np.array_equal(r, expected(a)))
    return {"submitted": len(futs), "delivered": st.delivered, "cancelled": st.cancelled, "failed": st.failed,
            "in_flight": st.in_flight, "balanced": st.balanced(), "wrong": wrong}


def run_guard_off(dev, guard, seed):
    """A pipeline with one guard off: does the poison make a premature reuse visible? The
    kernel spins ~0.2 ms (2e5 cycles at ~2 GHz) so the GPU lags the host, as under load."""
    from ringflow._bench.kernels import slow_scale_shift

    rng = np.random.default_rng(seed)
    x = rng.uniform(0.5, 1.5, 1 << 20).astype(np.float32)
    f = slow_scale_shift(400_000, 200e-6)
    try:
        with _testing.inject(guards_off=[guard]):
            y = rf.stream_map(f, x, device=dev, chunk_bytes=1 << 16, slots=2, checked=True, host="stage")
        wrong = int(np.count_nonzero(y != expected(x)))
        return {"guard": guard, "wrong_elements": wrong, "caught": wrong > 0}
    except Exception as exc:  # noqa: BLE001
        return {"guard": guard, "error": f"{type(exc).__name__}: {exc}"[:300], "caught": True}


def run_direct(dev, *, calls, seed):
    """MapJob's direct engine (one pass, no scheduler) over registered memory in checked mode,
    tight device rings, in place and not, a fresh random x before every call, every result
    compared bit for bit. Returns chunks run and wrong results."""
    rng = np.random.default_rng(seed)
    chunks = wrong = 0
    for slots, inplace, dt in ((1, False, np.float32), (2, True, np.int32), (1, True, np.float64),
                               (2, False, np.complex64), (3, False, np.uint8)):
        x = np.empty((int(rng.integers(2000, 6000)), 33), dt)
        out = x if inplace else None
        with rf.MapJob(twice_plus_one, x, out, device=dev, chunk_bytes=33 * x.itemsize * 40, host="register",
                       slots=slots, inplace=inplace, checked=True) as job:
            assert job.engine == "direct"
            for _ in range(calls):
                x[...] = rng.integers(1, 100, x.shape).astype(dt)
                want = expected(x)
                wrong += int(not np.array_equal(job(), want))
                chunks += job.chunks
    return {"chunks": chunks, "wrong_calls": wrong}


def run_direct_guard_off(dev, guard, seed):
    """The direct engine with one wait switched off, checked mode: a wrong result expected."""
    from ringflow._bench.kernels import slow_scale_shift

    x = np.random.default_rng(seed).uniform(0.5, 1.5, 1 << 20).astype(np.float32)
    f = slow_scale_shift(400_000, 200e-6)
    try:
        with _testing.inject(guards_off=[guard]), \
                rf.MapJob(f, x, device=dev, chunk_bytes=1 << 16, host="register", slots=2, checked=True,
                          engine="direct") as job:
            wrong = sum(int(np.count_nonzero(job() != expected(x))) for _ in range(3))
        return {"guard": guard, "engine": "direct", "wrong_elements": wrong, "caught": wrong > 0}
    except Exception as exc:  # noqa: BLE001
        return {"guard": guard, "engine": "direct", "error": f"{type(exc).__name__}: {exc}"[:300], "caught": True}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="auto")
    ap.add_argument("--chunks", type=int, default=10000)
    ap.add_argument("--max-elems", type=int, default=1 << 15)
    ap.add_argument("--out", default=None)
    ap.add_argument("--guards", action="store_true", help="also run the guard-off pipelines")
    args = ap.parse_args(argv)
    dev = rf.device(args.device)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    summary = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "device": dev.name, "command": " ".join(["python3"] + sys.argv), "python": platform.python_version(),
               "numpy": np.__version__, "runs": []}
    per_run = max(200, args.chunks // 8)
    configs = [(SlotCounts(1, 1, 1, 1), 0, "raise"), (SlotCounts(2, 2, 2, 2), 0, "raise"),
               (SlotCounts(3, 2, 3, 2), 40, "continue"), (SlotCounts(2, 3, 2, 3), 25, "continue"),
               (4, 0, "raise"), (SlotCounts(1, 2, 1, 2), 50, "continue"), (3, 30, "continue"), (2, 0, "raise")]
    total = 0
    while total < args.chunks:
        for slots, fail_every, on_error in configs:
            items = make_items(rng, per_run, args.max_elems)
            r = run_map(dev, items, slots=slots, fail_every=fail_every, on_error=on_error, seed=total)
            r.update(slots=str(slots), on_error=on_error)
            summary["runs"].append(r)
            total += len(items)
            print(json.dumps(r), flush=True)
            if total >= args.chunks:
                break
    summary["cancel_runs"] = []
    for k in (1, 3, 7, 20, 50):
        items = make_items(rng, 60, args.max_elems)
        summary["cancel_runs"].append(run_cancel(dev, items, SlotCounts(2, 2, 2, 2), min(60, k * 3)))
    x = rng.uniform(0.5, 1.5, (12345, 7)).astype(np.float32)
    big = rf.stream_map(twice_plus_one, x[:, ::2], device=dev, chunk_bytes=4096, checked=True)
    summary["stream_map_strided_ok"] = bool(np.array_equal(big, expected(x[:, ::2])))
    summary["direct"] = run_direct(dev, calls=max(4, args.chunks // 2000), seed=1)
    summary["live_after"] = dev.live().__dict__
    if args.guards:
        summary["guard_off"] = [run_guard_off(dev, g, 1) for g in GUARDS]
        summary["guard_off"] += [run_direct_guard_off(dev, g, 1) for g in DIRECT_GUARDS]
    summary["chunks_total"] = total
    summary["mismatches_total"] = sum(r["mismatches"] for r in summary["runs"])
    summary["cancel_wrong_total"] = sum(r["wrong"] for r in summary["cancel_runs"])
    summary["all_balanced"] = all(r["balanced"] and r["in_flight"] == 0 for r in summary["cancel_runs"]) and all(
        r["in_flight"] == 0 for r in summary["runs"])
    summary["seconds"] = time.perf_counter() - t0
    ok = summary["mismatches_total"] == 0 and summary["cancel_wrong_total"] == 0 and summary["all_balanced"] \
        and summary["stream_map_strided_ok"] and summary["direct"]["wrong_calls"] == 0
    summary["ok"] = ok
    text = json.dumps(summary, indent=1)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("runs", "cancel_runs")}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
