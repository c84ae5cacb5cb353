"""``stream_map(device=["cuda:0"])`` against ``stream_map(device="cuda:0")``: a list of one device
must cost nothing (it takes the single-device path). Alternates the two forms over warm calls of
the seed shape (256 MiB float32, pinned, in place) and writes medians and their ratio as JSON.

    python3 bench/device_list_cost.py --device cuda:0 --out FILE
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from _script import header, pinned_random, write

import ringflow as rf
from ringflow._bench import kernels


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = rf.device(args.device)
    hb, x = pinned_random(dev, args.mib)
    f = kernels.scale_shift()
    forms = {"device": dev, "device_list": [dev]}  # the same device object: hb is its memory
    times: dict = {k: [] for k in forms}
    for i in range(args.calls * 2 + 4):
        name = "device" if i % 2 == 0 else "device_list"
        t0 = time.perf_counter()
        rf.stream_map(f, x, x, device=forms[name], chunk_bytes=8 << 20, x_buffer=hb, out_buffer=hb, inplace=True)
        if i >= 4:
            times[name].append((time.perf_counter() - t0) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {**header(dev.name), "calls_each": args.calls, "mib": args.mib, "median_ms": med,
           "spread_ms": {k: [min(v), max(v)] for k, v in times.items()},
           "list_over_single": med["device_list"] / med["device"]}
    rf.drop_warm_pipelines()
    hb.close()
    print(json.dumps(out, indent=1))
    write(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
