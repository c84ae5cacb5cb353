"""Does pinning host memory on one thread hold up another thread's device calls? One thread
enqueues small copies (64 KiB host to device, then an event recorded and polled until done) in a
loop and times each round; another pins ``--mib`` MiB (``allocate_host``, as the host pool does
for a new block) ``--pins`` times, closing each, with pauses between. Reports the copy loop's
rounds while a pin is under way against the rounds outside (median and max µs), and each pin's
time. A max near the pin's time means the driver serialises the two, so pinning a block ahead
of need on another thread would stall the progress thread as it stalls ``submit`` now.

    PYTHONPATH=src python3 bench/pin_stall_check.py --device cuda:0 --out FILE
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ringflow as rf  # noqa: E402
from _script import header, write  # noqa: E402

MiB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--mib", type=int, default=32)
    ap.add_argument("--pins", type=int, default=8)
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = rf.device(args.device)
    stream = dev.create_stream()
    src = dev.allocate_host(64 << 10)
    dst = dev.allocate(64 << 10)
    rounds: list = []  # (start, seconds)
    pins: list = []  # (start, seconds)
    stop = threading.Event()

    def copies() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            stream.copy(dst, src)
            ev = stream.record()
            while not ev.is_done:
                pass
            rounds.append((t0, time.perf_counter() - t0))

    worker = threading.Thread(target=copies)
    worker.start()
    time.sleep(0.05)
    for _ in range(args.pins):
        t0 = time.perf_counter()
        buf = dev.allocate_host(args.mib * MiB)
        pins.append((t0, time.perf_counter() - t0))
        buf.close()
        time.sleep(0.03)
    stop.set()
    worker.join()
    during = [d for t, d in rounds if any(p <= t <= p + s for p, s in pins)]
    outside = [d for t, d in rounds if not any(p - 1e-3 <= t <= p + s + 1e-3 for p, s in pins)]
    out = {**header(str(dev)), "mib": args.mib, "pin_ms": [1e3 * s for _, s in pins],
           "rounds_during_pins": len(during), "rounds_outside": len(outside),
           "during_median_us": 1e6 * float(np.median(during)) if during else None,
           "during_max_us": 1e6 * max(during, default=0.0),
           "outside_median_us": 1e6 * float(np.median(outside)) if outside else None,
           "outside_max_us": 1e6 * max(outside, default=0.0),
           # the longest a round took that began before a pin ended and ended after it began
           "longest_overlapping_round_us": 1e6 * max((d for t, d in rounds
                                                      if any(t <= p + s and t + d >= p for p, s in pins)), default=0.0)}
    print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in out.items()
           if k not in ("date", "command", "machine")}, flush=True)
    stream.sync()  # the copies seen complete on this thread too, before their memory goes
    src.close()
    dst.close()
    stream.close()
    write(out, args.out)


if __name__ == "__main__":
    main()
