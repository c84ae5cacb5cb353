"""What ``chunk_bytes="auto"`` costs a ``stream_map`` call on a GPU, whose device plans with its
measured profile object.

Three settings, in rounds that visit each in turn (``--rounds``, medians over them), for each
``--mib`` size of float32 input into a result, both arrays of ``rf.host``'s pinned pool (y =
2x + 1): ``auto`` (the
planner's answer remembered from an earlier call), ``auto, planned afresh`` (the planner's
memory cleared before each call: what every call paid while a profile object was not
remembered) and the chunk size that ``auto`` chooses, given explicitly. Also the planner's own
call, remembered and afresh. Every result is checked against numpy.

    PYTHONPATH=src python3 bench/auto_chunk_cost.py --device cuda:0 --out FILE
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
from ringflow import _plan as plan  # noqa: E402
from ringflow._bench import kernels  # noqa: E402
from ringflow._bench.runner import environment  # noqa: E402
from _script import header, write  # noqa: E402

MiB = 1 << 20


def forget_plans() -> None:
    """Clear the planner's memory of chunk sizes (what an unremembered profile costs a call)."""
    plan._choose_chunk_bytes.cache_clear()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="auto")
    ap.add_argument("--mib", default="16,256")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = rf.device(args.device)
    f = kernels.scale_shift()
    rows, correct = [], True
    for mib in (int(m) for m in args.mib.split(",")):
        n = mib * MiB // 4
        x = rf.host.empty(n, np.float32, device=dev)  # pool arrays: read and written in place
        x[:] = np.random.default_rng(0).uniform(0.5, 1.5, n).astype(np.float32)
        y = rf.host.empty(n, np.float32, device=dev)
        expected = x * np.float32(2) + np.float32(1)
        chosen = plan.choose_chunk_bytes(dev.hardware, x.nbytes, host_stages=False, align=4).chunk_bytes
        settings = {"auto": ("auto", False), "auto, planned afresh": ("auto", True),
                    f"explicit {chosen} bytes": (chosen, False)}
        samples: dict = {name: [] for name in settings}
        for r in range(args.rounds + 1):  # round 0 warms every setting up and is not kept
            for name, (chunk, afresh) in settings.items():
                if afresh:
                    forget_plans()
                t0 = time.perf_counter()
                rf.stream_map(f, x, out=y, device=dev, chunk_bytes=chunk)
                dt = time.perf_counter() - t0
                correct = correct and bool(np.array_equal(y, expected))
                y[:] = 0
                if r:
                    samples[name].append(dt)
        for name, s in samples.items():
            row = {"mib": mib, "setting": name, "median_ms": statistics.median(s) * 1e3,
                   "min_ms": min(s) * 1e3, "max_ms": max(s) * 1e3}
            rows.append(row)
            print(f"{mib:5d} MiB  {name:28s} {row['median_ms']:8.3f} ms [{row['min_ms']:.3f}, {row['max_ms']:.3f}]",
                  flush=True)
        del x, y
    planner = {}
    for name, afresh in (("remembered", False), ("afresh", True)):
        times = []
        for _ in range(50):
            if afresh:
                forget_plans()
            t0 = time.perf_counter()
            plan.choose_chunk_bytes(dev.hardware, 1 << 30, workers=15, align=4)
            times.append(time.perf_counter() - t0)
        planner[f"choose_chunk_bytes_{name}_us"] = statistics.median(times) * 1e6
    print(planner, "correct:", correct, flush=True)
    out = {**header(environment(dev)), "rounds": args.rounds, "correct": correct, "rows": rows, **planner}
    write(out, args.out)
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())
