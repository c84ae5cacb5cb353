"""The host's staging rate as ``ringflow doctor --save`` measures it (``measure.staging_runs``),
against the bench's staging floor (``baselines.staging_floor``, torch's copies) on the same host,
and against the staged path itself: whether the profile's figure is a floor the path respects.

For each size (MiB moved each way) and split of the host's threads (in + out), the runs of
``staging_runs``; then ``staging_floor`` of 1 GiB; then ``stream_map(host="stage")`` of a fresh
float32 array of ``--path-mib`` MiB (1 GiB) with ``--workers`` workers, ``--rounds`` times
(checked against numpy); the floor and the path move as many bytes.
With ``--chunk-mib C`` also the same work with the host's copies in chunks of C MiB through a
ring of pinned slots (``staging_runs(..., chunk_bytes=C MiB)``), each thread copying its chunks
in and then out as the staged path's workers take chunk tasks: whether copying through a small
ring that stays in the caches is what lets the path beat the figure.

    PYTHONPATH=src python3 bench/staging_rate_check.py --device cuda:0 --out FILE
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ringflow as rf  # noqa: E402
from ringflow._bench import kernels  # noqa: E402
from ringflow._bench.measure import fresh_random  # noqa: E402
from ringflow._device.cuda.measure import staging_runs, staging_splits  # noqa: E402
from _script import header, write  # noqa: E402

MiB = 1 << 20


def row(mib: int, split: str, runs: list) -> dict:
    """One timed way of staging ``mib`` MiB each way (``runs`` in seconds), printed as it is made."""
    out = {"MiB_each_way": mib, "split": split, "runs_ms": [r * 1e3 for r in runs],
           "median_ms": statistics.median(runs) * 1e3, "GBps_fastest": mib * MiB / min(runs) / 1e9,
           "GBps_median": mib * MiB / statistics.median(runs) / 1e9}
    print(f"{mib:5d} MiB each way, {split}: fastest {out['GBps_fastest']:.2f} GB/s, median {out['GBps_median']:.2f} GB/s",
          flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--sizes-mib", default="128,512", help="MiB each way, comma-separated")
    ap.add_argument("--threads", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--path-mib", type=int, default=1024, help="MiB of the staged path's array (and the floor's)")
    ap.add_argument("--chunk-mib", type=int, default=0, help="also the same work with the host's copies in chunks of this many MiB through a ring")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = rf.device(args.device)
    t = args.threads
    splits = staging_splits(t)
    out = header(f"{dev.name}, {os.cpu_count()} CPU cores")
    out.update({"threads": t, "repeats": args.repeats, "rows": []})
    executor = concurrent.futures.ThreadPoolExecutor(t)
    try:
        for mib in (int(m) for m in args.sizes_mib.split(",")):
            nbytes = 2 * mib * MiB
            s_in, s_out = dev.create_stream(), dev.create_stream()
            d_a, d_b = dev.allocate(nbytes, stream=s_in), dev.allocate(nbytes, stream=s_in)
            h_in, h_out = dev.allocate_host(nbytes), dev.allocate_host(nbytes)
            src = np.empty(nbytes, np.uint8)
            src.fill(0x5A)
            try:
                for t_in in splits:
                    runs = staging_runs(s_in, s_out, d_a, d_b, h_in, h_out, src, executor, t_in, t - t_in,
                                        args.repeats)
                    out["rows"].append(row(mib, f"{t_in}+{t - t_in}", runs))
                if args.chunk_mib:
                    runs = staging_runs(s_in, s_out, d_a, d_b, h_in, h_out, src, executor, t, 0, args.repeats,
                                        chunk_bytes=args.chunk_mib * MiB)
                    out["rows"].append(row(mib, f"{t} threads, {args.chunk_mib} MiB chunks through a ring", runs))
            finally:
                s_in.sync()
                s_out.sync()
                for obj in (d_a, d_b, h_in, h_out, s_in, s_out):
                    obj.close()
                del src
    finally:
        executor.shutdown(wait=True)
    from ringflow._bench import baselines

    path_bytes = args.path_mib * MiB
    try:
        floor = baselines.staging_floor(path_bytes)
    except baselines.BaselineUnavailable as exc:  # no torch (the simulated GPU's machine)
        floor = {"skipped": str(exc)}
        print(f"bench floor skipped: {exc}", flush=True)
    else:
        print(f"bench floor {args.path_mib} MiB: best median {floor['staging_together_best_ms']:.1f} ms "
              f"({path_bytes / floor['staging_together_best_ms'] / 1e6:.2f} GB/s), fastest "
              f"{floor['staging_together_fastest_ms']:.1f} ms", flush=True)
    out["bench_staging_floor"] = floor
    f = kernels.scale_shift()
    times, correct = [], True
    for r in range(args.rounds + 1):
        x = fresh_random(path_bytes // 4, seed=r)
        t0 = time.perf_counter()
        y = rf.stream_map(f, x, device=dev, host="stage", workers=args.workers, chunk_bytes=8 * MiB)
        dt = time.perf_counter() - t0
        correct = correct and bool(np.array_equal(y, x * np.float32(2) + np.float32(1)))
        if r:
            times.append(dt * 1e3)
        del x, y
    out["path_bytes"] = path_bytes
    out["staged_ms"] = times
    out["staged_correct"] = correct
    print(f"staged {args.path_mib} MiB, {args.workers} workers: {min(times):.1f}..{max(times):.1f} ms "
          f"(median {statistics.median(times):.1f}); correct {correct}", flush=True)
    write(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
