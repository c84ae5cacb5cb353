"""Where the scheduler's host time goes on a real GPU: per-primitive costs and a cProfile of
stream_map runs.

    PYTHONPATH=src python3 bench/profile_host.py --device cuda:0 --out profile.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import numpy as np

import ringflow as rf
from ringflow._bench import kernels


def per_call_us(fn, n=200) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def primitives(dev) -> dict:
    s = dev.create_stream()
    hb = dev.allocate_host(1 << 20)
    db = dev.allocate(1 << 20, stream=s)
    arr = db.array(np.float32, 1 << 18)
    pool = dev.create_worker_pool(4)
    f = kernels.scale_shift()
    ev = s.record()
    ev.sync()
    out = {
        "record": per_call_us(lambda: s.record()),
        "record_timing": per_call_us(lambda: s.record(timing=True)),
        "is_done (done event)": per_call_us(lambda: ev.is_done),
        "is_done (fresh event)": per_call_us(lambda: s.record().is_done),
        "wait": per_call_us(lambda: s.wait(ev)),
        "copy h2d 4 KiB": per_call_us(lambda: s.copy(db.slice(0, 4096), hb.slice(0, 4096))),
        "launch noop fn": per_call_us(lambda: s.launch(lambda x, y: None, arr, arr, writes=[arr])),
        "launch rf.Kernel": per_call_us(lambda: s.launch(f, arr, arr, writes=[arr])),
        "host view": per_call_us(lambda: hb.view(np.uint8, offset=0, count=4096, access="r")),
        "pool submit+wait": per_call_us(lambda: pool.submit(lambda: None).sync(), n=100),
        "device.now": per_call_us(lambda: dev.now),
    }
    s.sync()
    pool.close()
    db.close(stream=s)
    s.sync()
    hb.close()
    s.close()
    return out


def pipeline_setup(dev) -> dict:
    x = np.ones(1 << 20, np.float32)
    t0 = time.perf_counter()
    p = rf.Pipeline(kernels.scale_shift(), device=dev, chunk_bytes=16 << 20, slots=3)
    t1 = time.perf_counter()
    list(p.map([x]))
    t2 = time.perf_counter()
    p.close()
    t3 = time.perf_counter()
    return {"create_ms": (t1 - t0) * 1e3, "one_chunk_ms": (t2 - t1) * 1e3, "close_ms": (t3 - t2) * 1e3}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = rf.device(args.device)
    text = io.StringIO()
    prim = primitives(dev)
    print("per-call microseconds:", file=text)
    for k, v in prim.items():
        print(f"  {k:28s} {v:9.1f}", file=text)
    for _ in range(2):
        setup = pipeline_setup(dev)
    print("pipeline set-up:", setup, file=text)
    n = (256 << 20) // 4
    hb = dev.allocate_host(n * 4)
    x = hb.view(np.float32)
    x[:] = 1.0
    f = kernels.affine(64)

    def seed():
        rf.stream_map(f, x, x, device=dev, chunk_bytes=16 << 20, x_buffer=hb, out_buffer=hb, inplace=True)

    seed()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(5):
        seed()
    prof.disable()
    print(f"seed 16 x 16 MiB: {(time.perf_counter() - t0) / 5 * 1e3:.2f} ms per call (under cProfile)", file=text)
    for key in ("tottime", "cumulative"):
        st = pstats.Stats(prof, stream=text)
        st.sort_stats(key).print_stats(35)
    hb.close()
    y = np.random.default_rng(0).uniform(0.5, 1.5, (256 << 20) // 4).astype(np.float32)
    prof = cProfile.Profile()
    prof.enable()
    t0 = time.perf_counter()
    rf.stream_map(kernels.scale_shift(), y, device=dev, chunk_bytes=8 << 20, host="stage")
    t1 = time.perf_counter()
    prof.disable()
    print(f"pageable 256 MiB staged: {(t1 - t0) * 1e3:.1f} ms (under cProfile)", file=text)
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(25)
    result = text.getvalue()
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(result)
    print(result[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
