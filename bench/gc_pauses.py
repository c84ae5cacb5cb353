"""Whether the cyclic garbage collector's pauses set the request stream's loaded p99: the
``requests`` workload (ringflow alone, no torch baselines) with every collection timed
(``gc.callbacks``: generation, start, duration), optionally after ``gc.freeze()`` (the objects
alive once the process has imported everything and opened the device go to the permanent
generation, which a full collection does not traverse: what a latency-minded service does after
start-up). Run it once with ``--freeze`` and once without, in separate processes, interleaved:

    PYTHONPATH=src python3 bench/gc_pauses.py --device cuda:0 --out gc.json
    PYTHONPATH=src python3 bench/gc_pauses.py --device cuda:0 --freeze --out gc-frozen.json
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ringflow as rf  # noqa: E402
from ringflow._bench import kernels, workloads  # noqa: E402
from _script import header, write  # noqa: E402


class Pauses:
    """Every collection while installed: (generation, start in perf_counter seconds, duration ms)."""

    def __init__(self) -> None:
        self.seen: list = []
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seen.append((info["generation"], self._t0, 1e3 * (time.perf_counter() - self._t0)))

    def summary(self, since: float) -> dict:
        out = {}
        for g in (0, 1, 2):
            ms = sorted(d for gen, _, d in self.seen if gen == g)
            out[f"gen{g}"] = {"count": len(ms), "max_ms": ms[-1] if ms else 0.0, "sum_ms": sum(ms),
                              "median_ms": ms[len(ms) // 2] if ms else 0.0}
        out["gen1_and_2_over_1ms"] = [{"gen": gen, "at_s": t - since, "ms": d}
                                      for gen, t, d in self.seen if gen >= 1 and d >= 1.0]
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--freeze", action="store_true", help="gc.freeze() once the device is open")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = rf.device(args.device)
    kernels.scale_shift()  # (what the workload compiles or imports, before a freeze)
    gc.collect()
    if args.freeze:
        gc.freeze()
    heap = {"tracked_objects": len(gc.get_objects()), "frozen_objects": gc.get_freeze_count()}
    pauses = Pauses()
    gc.callbacks.append(pauses)
    t0 = time.perf_counter()
    try:
        r = workloads.requests(dev, count=args.count, loads=(0.8,), baselines=False)
    finally:
        gc.callbacks.remove(pauses)
    wall = time.perf_counter() - t0
    lv = r["levels"][0]
    out = {**header(str(dev)), "freeze": args.freeze, "heap": heap,
           "wall_s": wall, "capacity_per_s": r["capacity_per_s"], "isolated_p99_ms": r["isolated_p99_ms"],
           "p99_80_ms": lv["p99_ms"], "p99_80_over_isolated": r["p99_80_over_isolated"],
           "p99_80_perfect_fifo_over_isolated": r["p99_80_perfect_fifo_over_isolated"], "correct": r["correct"],
           "gc": pauses.summary(t0)}
    g = out["gc"]
    print(f"freeze={args.freeze} tracked {heap['tracked_objects']} frozen {heap['frozen_objects']}: "
          f"{out['capacity_per_s']:.0f}/s, p99 at 80% {out['p99_80_ms']:.2f} ms = {out['p99_80_over_isolated']:.2f}x "
          f"isolated; gc gen2 {g['gen2']['count']} (max {g['gen2']['max_ms']:.1f} ms), gen1 {g['gen1']['count']} "
          f"(max {g['gen1']['max_ms']:.1f}), gen0 {g['gen0']['count']} (max {g['gen0']['max_ms']:.2f})", flush=True)
    write(out, args.out)


if __name__ == "__main__":
    main()
