"""``stream_map(device=["cuda:0"])`` against ``stream_map(device="cuda:0")``: a list of one device
must cost nothing (it takes the single-device path). Alternates the two forms over warm calls of
the seed shape (256 MiB float32, pinned, in place) and writes medians and their ratio as JSON.

    python3 bench/device_list_cost.py --device cuda:0 --out FILE
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time

import numpy as np

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
    n = args.mib * (1 << 20) // 4
    hb = dev.allocate_host(n * 4)
    x = hb.view(np.float32, access="rw")
    x[:] = np.random.default_rng(0).uniform(0.5, 1.5, n).astype(np.float32)
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
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": dev.name, "command": "python3 " + " ".join(sys.argv), "ringflow": rf.__version__,
           "calls_each": args.calls, "mib": args.mib, "median_ms": med,
           "spread_ms": {k: [min(v), max(v)] for k, v in times.items()},
           "list_over_single": med["device_list"] / med["device"]}
    rf.drop_warm_pipelines()
    hb.close()
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
