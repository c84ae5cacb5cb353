"""How long a map or amap that its caller stops early keeps the caller's thread: the clean-up that
cancels what the map took and has not handed out. For ``amap`` the clean-up is awaited, so what
matters is how long the loop's thread is kept: the longest gap between two turns of a task
ticking on the loop meanwhile. Run it on two source trees (PYTHONPATH) to compare.

    python3 bench/stop_early_cost.py --device cuda:0 --window 64 --mib 16 --repeats 15 --out stop_early.json
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


def one_map(pipe, items) -> tuple:
    """Stop a sync map after its first result; seconds its clean-up took (twice: the caller's
    thread is kept throughout)."""
    gen = pipe.map(items)
    next(gen)
    t0 = time.perf_counter()
    gen.close()
    t = time.perf_counter() - t0
    return t, t


def one_amap(pipe, items, ticking: bool = True) -> tuple:
    """Stop an amap after its first result; seconds its clean-up took, and the longest the loop's
    thread was kept meanwhile (a gap between two turns of a ticking task). ``ticking=False``: no
    ticking task (which holds the GIL between its turns, and so slows the progress thread the
    clean-up waits for); the time kept is then the clean-up's."""
    async def main():
        agen = pipe.amap(items)
        await agen.__anext__()
        gaps: list = []
        stop = asyncio.Event()

        async def ticks():
            last = time.perf_counter()
            while not stop.is_set():
                await asyncio.sleep(0)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(ticks()) if ticking else None
        await asyncio.sleep(0)  # the ticker is running
        t0 = time.perf_counter()
        await agen.aclose()
        t = time.perf_counter() - t0
        stop.set()
        if ticker is not None:
            await ticker
        return t, max(gaps, default=t)

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
    runs = (("map", one_map), ("amap", one_amap), ("amap, no ticking task", lambda p, i: one_amap(p, i, ticking=False)))
    for name, run in runs:
        times, kept, cancelled = [], [], []
        for r in range(args.repeats + 2):
            items = [rng.random(n, dtype=np.float32) for _ in range(args.window * 2)]
            with rf.Pipeline(slow, device=dev, chunk_bytes=n * 4, max_in_flight=args.window) as pipe:
                t, k = run(pipe, items)
                c = pipe.stats().cancelled
            if r >= 2:  # two warm-ups
                times.append(t * 1e6)
                kept.append(k * 1e6)
                cancelled.append(c)
        out["runs"][name] = {"cleanup_us": times, "median_us": statistics.median(times),
                             "min_us": min(times), "max_us": max(times),
                             "thread_kept_us": kept, "thread_kept_median_us": statistics.median(kept),
                             "thread_kept_max_us": max(kept), "cancelled": cancelled}
        print(name, "clean-up median %.0f us (min %.0f, max %.0f); caller's thread kept median %.0f us "
              "(max %.0f); cancelled %s" % (statistics.median(times), min(times), max(times),
                                            statistics.median(kept), max(kept), cancelled))
    write(out, args.out)


if __name__ == "__main__":
    main()
