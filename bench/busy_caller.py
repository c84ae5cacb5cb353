"""A pipeline whose caller runs Python between results: ``for r in pipe.map(items)`` with a
pure-Python loop body of ``--work-us`` microseconds, the per-chunk driver calls keeping the GIL
(the default) against letting go of it around each call (as cuda.bindings does), in one process,
interleaved. The progress thread must take the GIL back from the busy caller after every call
that let go of it.

    PYTHONPATH=src python3 bench/busy_caller.py --device cuda:0 --out busy-caller.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
from _script import driver_calls_release_the_gil, header, write

import ringflow as rf
from ringflow._bench import kernels

MiB = 1 << 20


def busy(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def one_pass(dev, items, work_us: float) -> float:
    f = kernels.scale_shift()
    with rf.Pipeline(f, device=dev, chunk_bytes=MiB) as pipe:
        for _ in pipe.map(items[:20]):  # warm-up
            pass
        t0 = time.perf_counter()
        for r, it in zip(pipe.map(items), items):
            busy(work_us)
        wall = time.perf_counter() - t0
        assert np.array_equal(r, it * np.float32(2) + np.float32(1))
    return len(items) / wall


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--items", type=int, default=400)
    ap.add_argument("--work-us", type=float, default=200.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = rf.device(args.device)
    rng = np.random.default_rng(0)
    items = []
    for _ in range(args.items):
        a = rf.host.empty((MiB // 4,), np.float32, device=dev)
        a[:] = rng.uniform(0.5, 1.5, a.size).astype(np.float32)
        items.append(a)
    rates = {"held": [], "released": []}
    for _ in range(args.rounds):
        for mode in rates:
            with driver_calls_release_the_gil(mode == "released"):
                rates[mode].append(one_pass(dev, items, args.work_us))
    result = {**header(dev.name), "items": args.items, "item_bytes": MiB, "work_us": args.work_us,
              "switch_interval_s": sys.getswitchinterval(), "items_per_s": rates,
              "ideal_items_per_s": 1e6 / args.work_us,
              "held_over_released": statistics.median(rates["held"]) / statistics.median(rates["released"])}
    print({k: v for k, v in result.items() if k not in ("command",)}, flush=True)
    write(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
