"""The feed workload's decode into three kinds of memory, on eight threads and on one: a new
array per batch, a pinned allocation (``allocate_host``, as a pipeline's host-in slot on threads)
and plain reused memory, each offered as a pipeline offers its slot to ``rf.host.empty_slot``.
Milliseconds per batch, printed.

    PYTHONPATH=src python3 bench/decode_into_slot_check.py --device cuda:0
"""

from __future__ import annotations

import argparse
import concurrent.futures
import time

import numpy as np

import ringflow as rf
from ringflow._bench.feed import ImageBatches
from ringflow._pipeline.slot_array import run_offering


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--size", type=int, default=224)
    args = ap.parse_args()
    dev = rf.device(args.device)
    im = ImageBatches(args.batch, args.size)
    n = im.nbytes
    pinned = [dev.allocate_host(n) for _ in range(8)]
    bufs = [p.view(np.uint8) for p in pinned]
    plain = [np.zeros(n, np.uint8) for _ in range(8)]

    def fresh(i):
        return im.decode_augment(i)

    def in_pinned(i):
        return run_offering(im.decode_augment, i, bufs[i % 8])

    def in_plain(i):
        return run_offering(im.decode_augment, i, plain[i % 8])

    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        for f in (fresh, in_pinned, in_plain, fresh, in_pinned, in_plain):
            t = time.perf_counter()
            list(ex.map(f, range(64)))
            print(f.__name__, round((time.perf_counter() - t) / 64 * 1e3, 3), "ms a batch, 8 threads", flush=True)
    for f in (fresh, in_pinned, in_plain):
        t = time.perf_counter()
        [f(i) for i in range(16)]
        print(f.__name__, round((time.perf_counter() - t) / 16 * 1e3, 3), "ms a batch, 1 thread", flush=True)
    for p in pinned:
        p.close()


if __name__ == "__main__":
    main()
