"""The host time a warm ``stream_map`` call spends outside its engine, against a ``MapJob`` call
of the same job: the engine's ``run`` is replaced by a no-op, so what is timed is the call's
own Python (checks, layout plan, warm-cache lookup). 64 MiB float32 in pinned memory, 8 MiB
chunks, in place; medians and p10 of ``--calls`` calls, in µs, and with nothing before each call
the least mean of nine blocks of a ninth of them (``least_block_us``). With ``--before``, each call
follows something that a real call's wait for the GPU may look like to the CPU: nothing
(``none``), 5 ms asleep (``sleep``), 5 ms spinning (``spin``), or 16 MiB read through the caches
(``touch``, as the copies' traffic may evict the caller's working set). ``--memory``: the array
is a registered buffer passed as ``x_buffer`` (``pinned``), or an array from ``ringflow.host``
found behind the array on every call (``pool``: rows named ``pool stream_map``, ``pool MapJob``).

    python3 bench/stream_map_overhead.py --device sim --out FILE [--calls 2000] [--before none,sleep,spin,touch]
        [--memory pinned,pool]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import numpy as np

from _script import header, pinned_random, write

import ringflow as rf
from ringflow._pipeline import direct


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _block_mean(call, n: int) -> float:
    """Seconds a call, the mean of ``n`` calls made back to back."""
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - t0) / n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="sim")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--before", default="none")
    ap.add_argument("--memory", default="pinned")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = rf.device(args.device)
    rows = {}
    for memory in args.memory.split(","):
        _time_calls(dev, memory, args, rows)
    write({**header(dev.name), "calls": args.calls, "rows": rows}, args.out)
    return 0


def _time_calls(dev, memory: str, args, rows: dict) -> None:
    """Time both faces' calls on 64 MiB of ``memory`` (``pinned`` or ``pool``) into ``rows``."""
    if memory == "pinned":
        hb, x = pinned_random(dev, 64)
        kw = dict(device=dev, chunk_bytes=8 << 20, x_buffer=hb, out_buffer=hb, inplace=True)
    elif memory == "pool":
        hb, x = None, rf.host.empty(16 << 20, np.float32, device=dev)
        x[:] = np.random.default_rng(0).random(x.size, dtype=np.float32)
        kw = dict(device=dev, chunk_bytes=8 << 20, inplace=True)
    else:
        raise SystemExit(f"--memory takes pinned and pool, got {memory!r}")
    prefix = "" if memory == "pinned" else f"{memory} "

    def f(a, b):
        b[...] = a

    f.sim_seconds = 1e-6
    rf.stream_map(f, x, x, **kw)  # the engine made and parked warm
    job = rf.MapJob(f, x, x, **kw)
    job()
    run = direct.DirectSchedule.run
    direct.DirectSchedule.run = lambda self, arrays=None, *, profile=False: None
    gc.freeze()
    befores = {"none": lambda: None, "sleep": lambda: time.sleep(5e-3), "spin": lambda: _spin(5e-3),
               "touch": lambda: int(big.sum())}
    big = np.ones(16 << 20, np.uint8)
    try:
        for before in args.before.split(","):
            calls = args.calls if before == "none" else max(1, args.calls // 10)
            for name, call in (("stream_map", lambda: rf.stream_map(f, x, x, **kw)), ("MapJob", job)):
                for _ in range(50):
                    call()
                times = []
                for _ in range(calls):
                    befores[before]()
                    t0 = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - t0)
                times.sort()
                key = prefix + (name if before == "none" else f"{name} after {before}")
                rows[key] = {"median_us": times[len(times) // 2] * 1e6, "p10_us": times[len(times) // 10] * 1e6}
                if before == "none":  # the least of nine blocks' mean: what a busy machine's spikes leave alone
                    rows[key]["least_block_us"] = min(_block_mean(call, max(1, calls // 9)) for _ in range(9)) * 1e6
                print(key, rows[key], flush=True)
    finally:
        direct.DirectSchedule.run = run
        gc.unfreeze()
    job.close()
    if hb is not None:
        hb.close()


if __name__ == "__main__":
    sys.exit(main())
