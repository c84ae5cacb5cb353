"""Where a request stream's host time goes, without a tracing profiler's distortion: the
``requests`` workload's items through one ``Pipeline``, closed loop, with

* the CPU time of the progress thread and of the submitting thread per request (each thread's
  own CPU clock, read from outside it), against the wall time per request;
* a sampling profile of both threads (their Python stacks read ``--hz`` times a second from a
  third thread): where each spends its time, by function (self) and by caller chain (inclusive);
* the hand-written torch pinned ring on the same items, for the ratio.

Variants: ``staged`` (plain numpy items, staged into pool arrays by ``submit``, the default
path), ``pooled`` (items that are pool arrays already), then any of these suffixes:
``-split256k`` and ``-split1`` split staging copies from 256 KiB a thread, or never; ``-swi``
runs with a 0.2 ms GIL switch interval (a diagnosis: does the GIL's hand-off delay bound the
run); ``-alone`` gives every item a chunk of its own (``coalesce=False``); ``-numpy`` copies with
numpy on the calling thread (native copy threads off).

With ``--load``, each variant is also measured open loop: the items' isolated latency (each
alone), then Poisson arrivals at that fraction of the variant's capacity, latency from arrival
(p50/p99, the p99 over the isolated p99) and how far ``submit`` fell behind the arrivals, with
the arrival thread spinning for the last 0.2 ms before each arrival (``--arrival spin``, the
``requests`` workload's way) or sleeping (``sleep``), or both.

    PYTHONPATH=src python3 bench/request_costs.py --device cuda:0 --out request-costs.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import os
import statistics
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ringflow as rf  # noqa: E402
from ringflow._bench import baselines, kernels, workloads  # noqa: E402
from ringflow._bench.stacks import current_frames  # noqa: E402
from ringflow._device import native_copy, protocol  # noqa: E402
from pinned_results_check import pooled_copies, request_items  # noqa: E402
from _script import header, write  # noqa: E402

MiB = 1 << 20


class Sampler:
    """Samples the Python stacks of the given threads ``hz`` times a second."""

    def __init__(self, idents: dict, hz: float):
        self.idents, self.period = idents, (1.0 / hz if hz > 0 else 0.0)
        self.self_counts = {name: collections.Counter() for name in idents}
        self.incl_counts = {name: collections.Counter() for name in idents}
        self.samples = collections.Counter()
        self._stop = threading.Event()

    @contextlib.contextmanager
    def running(self):
        if self.period <= 0:  # --hz 0: no sampling
            yield self
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join()

    def _run(self):
        while not self._stop.wait(self.period):
            frames = current_frames()
            for name, ident in self.idents.items():
                f = frames.get(ident)
                if f is None:
                    continue
                self.samples[name] += 1
                key = lambda fr: f"{os.path.basename(fr.f_code.co_filename)}:{fr.f_code.co_name}"  # noqa: E731
                self.self_counts[name][f"{key(f)}:{f.f_lineno}"] += 1
                seen = set()
                while f is not None:
                    k = key(f)
                    if k not in seen:
                        seen.add(k)
                        self.incl_counts[name][k] += 1
                    f = f.f_back

    def report(self, top: int = 30) -> dict:
        out = {}
        for name in self.idents:
            n = max(1, self.samples[name])
            out[name] = {"samples": self.samples[name],
                         "self": [(k, round(v / n, 4)) for k, v in self.self_counts[name].most_common(top)],
                         "inclusive": [(k, round(v / n, 4)) for k, v in self.incl_counts[name].most_common(top)]}
        return out


def cpu_seconds(ident: int) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


def run_variant(dev, items, passes: int, hz: float, coalesce: bool = True) -> dict:
    """One warm-up pass (the pool's blocks pinned, untimed), then ``passes`` timed closed-loop
    passes, each checked and its results dropped before the next (a server hands them on)."""
    f = kernels.scale_shift()
    with rf.Pipeline(f, device=dev, chunk_bytes=8 * MiB, coalesce=coalesce) as pipe:
        for fu in [pipe.submit(it) for it in items]:
            fu.result()
        progress = pipe._driver.thread.ident
        me = threading.get_ident()
        rates, cpu_p, cpu_s, walls = [], [], [], []
        ok = True
        sampler = Sampler({"progress": progress, "submit": me}, hz)
        for p in range(passes):
            with sampler.running():
                p0, s0, t0 = cpu_seconds(progress), cpu_seconds(me), time.perf_counter()
                futs = [pipe.submit(it) for it in items]
                results = [fu.result() for fu in futs]
                wall = time.perf_counter() - t0
                cpu_p.append(cpu_seconds(progress) - p0)
                cpu_s.append(cpu_seconds(me) - s0)
            walls.append(wall)
            rates.append(len(items) / wall)
            ok = ok and all(np.array_equal(r, np.asarray(it) * np.float32(2) + np.float32(1))
                            for r, it in zip(results, items))
            del results, futs
        n = len(items)
        return {"capacity_per_s": statistics.median(rates), "passes_per_s": rates, "correct": ok,
                "wall_us_per_request": 1e6 * statistics.median(walls) / n,
                "progress_cpu_us_per_request": 1e6 * statistics.median(cpu_p) / n,
                "submit_cpu_us_per_request": 1e6 * statistics.median(cpu_s) / n,
                "pool": dataclasses.asdict(rf.host.stats(device=dev)),
                "steps": pipe.scheduler.steps, "profile": sampler.report()}


def stamped_open_loop(pipe, dev, items, gaps, spin: bool = True) -> tuple:
    """``items`` submitted to ``pipe`` at open-loop arrivals ``gaps`` apart (seconds), each
    result's landing stamped by a done-callback; returns ``(arrived, submitted, done)`` (host
    clock seconds) once every result has landed."""
    done = np.full(len(items), np.nan)
    futs = []

    def submit(i):
        fut = pipe.submit(items[i])
        fut.add_done_callback(lambda _f, i=i: done.__setitem__(i, dev.now))
        futs.append(fut)

    arrived, submitted = baselines.open_loop(lambda: dev.now, gaps, submit,
                                             lambda t: workloads.wait_until(pipe, dev, t, spin=spin))
    for fu in futs:
        fu.result()
    deadline = time.perf_counter() + 10  # a result is visible a moment before its callbacks run
    while np.isnan(done).any() and time.perf_counter() < deadline:
        time.sleep(0)
    return arrived, submitted, done


def open_loop_level(dev, items, rate: float, arrival: str, warmup: int = 30, coalesce: bool = True) -> dict:
    """Isolated latency, then open-loop arrivals at ``rate`` requests/s through a new pipeline."""
    f = kernels.scale_shift()
    rng = np.random.default_rng(7)
    gaps = rng.exponential(1.0 / rate, len(items))
    with rf.Pipeline(f, device=dev, chunk_bytes=8 * MiB, coalesce=coalesce) as pipe:
        for fu in [pipe.submit(it) for it in items[:warmup]]:
            fu.result()
        iso = np.zeros(len(items))
        for i, it in enumerate(items):
            t0 = dev.now
            pipe.submit(it).result()
            iso[i] = dev.now - t0
        arrived, submitted, done = stamped_open_loop(pipe, dev, items, gaps, spin=arrival == "spin")
    lat = done - arrived
    return {"arrival": arrival, "offered_per_s": rate, "isolated_p50_ms": 1e3 * float(np.percentile(iso, 50)),
            "isolated_p99_ms": 1e3 * float(np.percentile(iso, 99)),
            "p50_ms": 1e3 * float(np.percentile(lat, 50)), "p99_ms": 1e3 * float(np.percentile(lat, 99)),
            "p99_over_isolated": float(np.percentile(lat, 99) / np.percentile(iso, 99)),
            "submit_lag_p50_ms": 1e3 * float(np.percentile(submitted - arrived, 50)),
            "submit_lag_max_ms": 1e3 * float(np.max(submitted - arrived))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--count", type=int, default=300)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--hz", type=float, default=2000.0)
    ap.add_argument("--variants", default="staged,pooled")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--load", type=float, default=0.0, help="also measure open loop at this fraction of capacity")
    ap.add_argument("--arrival", choices=("spin", "sleep", "both"), default="both")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = rf.device(args.device)
    items = request_items(args.count, 8 * MiB)
    result = {**header(str(dev)), "count": args.count, "passes": args.passes, "variants": {}}
    default_split = protocol.SPLIT_COPY_BYTES
    for name in args.variants.split(","):
        its = items
        flags = name.split("-")[1:]
        for flag in flags:
            if flag not in ("split256k", "split1", "swi", "alone", "numpy"):
                raise SystemExit(f"unknown variant suffix -{flag} in {name!r}")
        protocol.SPLIT_COPY_BYTES = {"split256k": 256 << 10, "split1": 1 << 40}.get(
            next((f for f in flags if f.startswith("split")), ""), default_split)
        interval = sys.getswitchinterval()
        if "swi" in flags:
            sys.setswitchinterval(0.0002)
        if name.startswith("pooled"):
            its = pooled_copies(dev, items)
        native = native_copy._loaded
        if "numpy" in flags:
            native_copy._loaded = False  # as where no compiler works
        try:
            coalesce = "alone" not in flags
            v = run_variant(dev, its, args.passes, args.hz, coalesce)
            if args.load > 0:
                arrivals = ("spin", "sleep") if args.arrival == "both" else (args.arrival,)
                v["open_loop"] = [open_loop_level(dev, its, args.load * v["capacity_per_s"], a, coalesce=coalesce)
                                  for a in arrivals]
        finally:
            sys.setswitchinterval(interval)
            protocol.SPLIT_COPY_BYTES = default_split
            native_copy._loaded = native
        key, n = name, 2
        while key in result["variants"]:  # a repeated variant keeps every measurement
            key, n = f"{name}#{n}", n + 1
        result["variants"][key] = v
        print(name, {k: val for k, val in v.items() if k != "profile"}, flush=True)
        for thread, prof in v["profile"].items():
            print(f"  {thread} ({prof['samples']} samples) self:", prof["self"][:12], flush=True)
            print(f"  {thread} inclusive:", prof["inclusive"][:16], flush=True)
    if dev.backend == "cuda" and not args.no_torch:
        expected = [it * np.float32(2) + np.float32(1) for it in items]
        ring = baselines.run_or_skip(baselines.torch_requests_ring, items, expected, loads=(0.8,))
        result["torch_ring"] = ring
        cap = ring.get("capacity_per_s")
        if cap:
            for name, v in result["variants"].items():
                v["over_torch_ring"] = v["capacity_per_s"] / cap
        print("torch ring", cap, {n: v.get("over_torch_ring") for n, v in result["variants"].items()}, flush=True)
    write(result, args.out)


if __name__ == "__main__":
    main()
