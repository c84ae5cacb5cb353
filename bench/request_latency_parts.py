"""Where a loaded request's latency goes: the ``requests`` workload's items through one profiled
``Pipeline`` (``profile=True``), closed-loop capacity first, then open-loop Poisson arrivals at
``--load`` of that capacity, and for every request the parts of its latency:

* ``queue``: arrival to entering ``submit`` (the submitting thread was busy with earlier ones);
* ``submit``: inside ``submit`` (staging copy, joining or opening a chunk);
* ``open``: leaving ``submit`` to its chunk's admission by the progress thread (the chunk kept
  taking items, waited for its copies, or for the progress thread);
* ``to_h2d``: admission to the chunk's h2d being enqueued (waiting for a device slot);
* ``gpu``: h2d enqueued to the d2h's end on the GPU (stream waits, copies, computes);
* ``seen``: the d2h's end to the chunk's end on the progress thread (noticing the event);
* ``callback``: the chunk's end to the request's done-callback.

Also p50/p99 of each part over every request and over the slowest 2%, items per chunk, the
pool's pinning during the loaded level, ``submit``'s time by item size, and the garbage
collector's pauses. Variants: ``plain`` (the bench's pipeline), ``swi`` (a 0.5 ms GIL switch
interval: does waiting for the GIL make the tail), ``alone`` (``coalesce=False``), ``slotsN``
(N slots in every ring), ``hostN`` (N slots in each host ring, three in each device ring),
``stageN`` (items over N MiB left to the CPU workers, copied after ``submit`` returns, as
before: the accepting thread's seam ``Pipeline._read_in_place`` patched).

    PYTHONPATH=src python3 bench/request_latency_parts.py --device cuda:0 --out parts.json
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ringflow as rf  # noqa: E402
import ringflow._pipeline.api as api  # noqa: E402
from ringflow._bench import baselines, kernels, workloads  # noqa: E402
from pinned_results_check import request_items  # noqa: E402
from _script import header, write  # noqa: E402

MiB = 1 << 20
PARTS = ("queue", "submit", "open", "to_h2d", "gpu", "seen", "callback")


class _StampedQueue(collections.deque):
    """The scheduler's queue of admitted chunks, stamping each chunk's admission."""

    def __init__(self, items, clock):
        super().__init__(items)
        self.clock = clock

    def append(self, chunk):
        chunk.stamps["admitted"] = self.clock()
        super().append(chunk)


def _pct(values, q: float) -> float:
    v = [x for x in values if x == x]
    return 1e3 * float(np.percentile(v, q)) if v else float("nan")


def run_variant(dev, items, name: str, load: float, passes: int) -> dict:
    chunks: dict[int, dict] = {}
    record = api.record_chunk

    def recording(chunk, anchor):
        rec = record(chunk, anchor)
        members = [m.index for m in chunk.members] if chunk.members is not None else [chunk.index]
        chunks[chunk.index] = {"members": members, "stamps": dict(chunk.stamps), "stages": dict(rec.stages)}
        return rec

    api.record_chunk = recording
    interval, read_in_place = sys.getswitchinterval(), api.Pipeline._read_in_place
    if name.startswith("stage"):  # items over N MiB left to the CPU workers, as before 374fe74
        limit = int(name[5:]) * MiB
        api.Pipeline._read_in_place = lambda self, item: (
            (type(item) is np.ndarray and item.nbytes > limit) or read_in_place(self, item))
    if name == "swi":
        sys.setswitchinterval(0.0005)
    try:
        slots = None
        if name.startswith("slots"):  # every ring N slots
            slots = int(name[5:])
        elif name.startswith("host"):  # host rings N slots, device rings as planned (3)
            slots = rf.SlotCounts(host_in=int(name[4:]), device_in=3, device_out=3, host_out=int(name[4:]))
        with rf.Pipeline(kernels.scale_shift(), device=dev, chunk_bytes=8 * MiB, profile=True, slots=slots,
                         coalesce=name != "alone") as pipe:
            sched = pipe.scheduler
            sched._accepted_q = _StampedQueue(sched._accepted_q, lambda: dev.now)
            for fu in [pipe.submit(it) for it in items]:  # the pool's blocks pinned, untimed
                fu.result()
            iso = []
            for it in items:
                t0 = dev.now
                pipe.submit(it).result()
                iso.append(dev.now - t0)
            rates = []
            for _ in range(passes):
                t0 = dev.now
                futs = [pipe.submit(it) for it in items]
                for fu in futs:
                    fu.result()
                rates.append(len(items) / (dev.now - t0))
                del futs
            capacity = statistics.median(rates)
            rng = np.random.default_rng(11)
            gaps = rng.exponential(1.0 / (load * capacity), len(items))
            chunks.clear()
            n = len(items)
            returned, done, index_of = np.full(n, np.nan), np.full(n, np.nan), {}
            futs = []

            def submit(i):
                fut = pipe.submit(items[i])
                returned[i] = dev.now
                index_of[fut.index] = i
                fut.add_done_callback(lambda _f, i=i: done.__setitem__(i, dev.now))
                futs.append(fut)

            pool0 = rf.host.stats(device=dev)
            with baselines.gc_pauses() as pauses:
                arrived, submitted = baselines.open_loop(lambda: dev.now, gaps, submit,
                                                         lambda t: workloads.wait_until(pipe, dev, t))
                results = [fu.result() for fu in futs]
            deadline = time.perf_counter() + 10.0  # a result is visible a moment before its callback ran
            while np.isnan(done).any() and time.perf_counter() < deadline:
                time.sleep(0)
            pool1 = rf.host.stats(device=dev)
            correct = all(np.array_equal(r, it * np.float32(2) + np.float32(1)) for r, it in zip(results, items))
    finally:
        api.record_chunk = record
        sys.setswitchinterval(interval)
        api.Pipeline._read_in_place = read_in_place
    parts = {p: np.full(n, np.nan) for p in PARTS}
    per_chunk = []
    for c in chunks.values():
        st, stages = c["stamps"], c["stages"]
        reqs = [index_of[m] for m in c["members"] if m in index_of]
        per_chunk.append(len(reqs))
        d2h_end = stages.get("d2h", (np.nan, np.nan))[1]
        for i in reqs:
            parts["queue"][i] = submitted[i] - arrived[i]
            parts["submit"][i] = returned[i] - submitted[i]
            parts["open"][i] = st.get("admitted", np.nan) - returned[i]
            parts["to_h2d"][i] = st.get("h2d.enqueued", np.nan) - st.get("admitted", np.nan)
            parts["gpu"][i] = d2h_end - st.get("h2d.enqueued", np.nan)
            parts["seen"][i] = st.get("ended", np.nan) - d2h_end
            parts["callback"][i] = done[i] - st.get("ended", np.nan)
    lat = done - arrived
    big = np.array([int(it.nbytes > 4 * MiB) for it in items])
    slow = np.argsort(lat)[::-1][:max(1, n // 50)]
    out = {"variant": name, "capacity_per_s": capacity, "passes_per_s": rates, "load": load, "correct": correct,
           "isolated_p50_ms": _pct(iso, 50), "isolated_p99_ms": _pct(iso, 99),
           "p50_ms": _pct(lat, 50), "p99_ms": _pct(lat, 99),
           "p99_over_isolated": float(np.nanpercentile(lat, 99) / np.percentile(iso, 99)),
           "gc_pauses": len(pauses), "gc_pause_max_ms": 1e3 * max(pauses, default=0.0),
           # the pool's pinning (new blocks) and fallbacks during the loaded level
           "pool_during_level": {k: getattr(pool1, k) - getattr(pool0, k) for k in ("allocations", "hits", "fallbacks")},
           "submit_by_size": {name: {"p50_ms": _pct(parts["submit"][sel], 50), "p99_ms": _pct(parts["submit"][sel], 99),
                                     "max_ms": _pct(parts["submit"][sel], 100)}
                              for name, sel in (("up_to_4MiB", big == 0), ("over_4MiB", big == 1))},
           "items_per_chunk": {"mean": float(np.mean(per_chunk)) if per_chunk else None,
                               "max": max(per_chunk, default=0), "chunks": len(per_chunk)},
           "parts_all": {p: {"p50_ms": _pct(v, 50), "p99_ms": _pct(v, 99)} for p, v in parts.items()},
           "parts_slowest_2pct": {p: {"p50_ms": _pct(v[slow], 50), "max_ms": _pct(v[slow], 100)}
                                  for p, v in parts.items()},
           "slowest": [{"request": int(i), "latency_ms": 1e3 * float(lat[i]), "bytes": int(items[i].nbytes),
                        "arrived_ms": 1e3 * float(arrived[i] - arrived[0]),
                        **{p: round(1e3 * float(parts[p][i]), 3) for p in PARTS}} for i in slow[:8]]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--variants", default="plain,swi,alone,plain")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = rf.device(args.device)
    items = request_items(args.count, 8 * MiB)
    result = {**header(str(dev)), "count": args.count, "variants": []}
    for name in args.variants.split(","):
        v = run_variant(dev, items, name, args.load, args.passes)
        result["variants"].append(v)
        print(name, {k: v[k] for k in ("capacity_per_s", "isolated_p99_ms", "p50_ms", "p99_ms",
                                      "p99_over_isolated", "correct", "items_per_chunk", "pool_during_level",
                                      "submit_by_size")}, flush=True)
        for key in ("parts_all", "parts_slowest_2pct"):
            print(" ", key, {p: tuple(round(x, 3) for x in d.values()) for p, d in v[key].items()}, flush=True)
    write(result, args.out)


if __name__ == "__main__":
    main()
