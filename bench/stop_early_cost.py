"""How long a map or amap that its caller stops early keeps the caller's thread: the clean-up that
cancels what the map took and has not handed out (the loop's thread, for ``amap``). Run it on two
source trees (PYTHONPATH) to compare.

    python3 bench/stop_early_cost.py --device cuda:0 --window 64 --repeats 15 --out stop_early.json
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import ringflow as rf  # noqa: E402
from _script import header, write  # noqa: E402


def slow(x, y):
    # a few hundred launches a chunk: most of the window is still queued when the caller stops
    y[...] = x
    for _ in range(SLOW_LAUNCHES):
        y *= 1.0001


SLOW_LAUNCHES = 200


def one_map(pipe, items) -> float:
    """Stop a sync map after its first result; seconds its clean-up took."""
    gen = pipe.map(items)
    next(gen)
    t0 = time.perf_counter()
    gen.close()
    return time.perf_counter() - t0


def one_amap(pipe, items) -> float:
    """Stop an amap after its first result; seconds its clean-up kept the loop's thread."""
    async def main():
        agen = pipe.amap(items)
        await agen.__anext__()
        t0 = time.perf_counter()
        await agen.aclose()
        return time.perf_counter() - t0

    return asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--window", type=int, default=64, help="max_in_flight: the map's window")
    ap.add_argument("--mib", type=float, default=1.0, help="MiB an item")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = rf.device(args.device)
    n = int(args.mib * (1 << 20)) // 4
    rng = np.random.default_rng(0)
    out: dict = {**header(str(dev)), "window": args.window, "mib": args.mib, "runs": {}}
    for name, run in (("map", one_map), ("amap", one_amap)):
        times, cancelled = [], []
        for r in range(args.repeats + 2):
            items = [rng.random(n, dtype=np.float32) for _ in range(args.window * 2)]
            with rf.Pipeline(slow, device=dev, chunk_bytes=n * 4, max_in_flight=args.window) as pipe:
                t = run(pipe, items)
                c = pipe.stats().cancelled
            if r >= 2:  # two warm-ups
                times.append(t * 1e6)
                cancelled.append(c)
        out["runs"][name] = {"cleanup_us": times, "median_us": statistics.median(times),
                             "min_us": min(times), "max_us": max(times), "cancelled": cancelled}
        print(name, "clean-up median %.0f us (min %.0f, max %.0f), cancelled %s"
              % (statistics.median(times), min(times), max(times), cancelled))
    write(out, args.out)


if __name__ == "__main__":
    main()
