"""ringflow against the hand-written CUDA C++ pipeline in interleaved rounds, on one machine in one
run. Each round times, for each workload, ``MapJob`` and ``stream_map`` at every chunk count given
(input untouched between calls, as the C++ program repeats; the two faces' calls alternate) and
runs the C++ program over the same chunk counts on four streams; the rounds alternate which side
goes first, so a machine that drifts over a minute slows both alike. Per round: each face's best median over the C++ program's
best median on the host clock (enqueue to synchronize, as ringflow's calls are timed); over the
rounds: the median ratio, its range, and how many rounds were at or below 1.00. Every face's
result is checked against numpy on a sample of elements before it is timed.

    python3 bench/cpp_rounds.py --device cuda:0 --out FILE [--workloads seed,balanced,compute-bound]
        [--rounds 7] [--calls 10] [--mib 256]

Without a GPU (``--device sim``) the C++ program cannot run: its rows say why and the ratios are
None, the ringflow side runs on virtual time.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np

from _script import header, pinned_random, write

import ringflow as rf
from ringflow._bench import kernels
from ringflow._bench.baselines import BaselineUnavailable, cuda_cpp_pipeline
from ringflow._bench.workloads import affine_tolerance, calibrate_iters

MiB = 1 << 20
COUNTS = {"seed": (8, 16, 32, 64), "balanced": (16, 32), "compute-bound": (16, 32)}
RATIO = {"balanced": 1.0, "compute-bound": 3.0}  # the kernel over one chunk's copy, as `ringflow bench`


def kernel_for(dev, name: str, nbytes: int):
    """The workload's kernel as `ringflow bench` makes it: its iterations, and on a GPU its
    measured time per byte given to the planner as ``sim_seconds``."""
    iters = 64 if name == "seed" else calibrate_iters(dev, nbytes // 32, RATIO[name])
    f = kernels.affine(iters, numeric_iters=min(iters, 16) if dev.backend == "sim" else None)
    if dev.backend == "cuda":
        from ringflow._bench.gpu_calibrate import kernel_seconds

        per_byte = kernel_seconds(dev, f, 16 * MiB) / (16 * MiB)
        f.sim_seconds = lambda b, per_byte=per_byte: per_byte * b
    return f, iters


def checked(dev, f, hb, x, call) -> bool:
    """One call on fresh input, compared with numpy on a sample of elements (every chunk hit)."""
    x0 = np.random.default_rng(7).uniform(0.5, 1.5, x.size).astype(np.float32)
    sample = np.sort(np.random.default_rng(9).choice(x.size, size=min(x.size, 1 << 16), replace=False))
    x[:] = x0
    call()
    tol = affine_tolerance(f.numeric_iters)
    return bool(np.allclose(x[sample], kernels.affine_expected(x0[sample].astype(np.float64), f.numeric_iters),
                            rtol=tol, atol=tol))


def ringflow_side(dev, f, hb, x, counts, calls: int, jobs: dict) -> dict:
    """Each face's median ms at every chunk count (input untouched between calls) and its best.
    At each count the two faces' calls alternate, one of each in turn after one untimed call
    each, so the machine's drift within a round falls on both alike."""
    samples: dict = {"MapJob": {}, "stream_map": {}}
    for c in counts:
        faces = {"MapJob": jobs[c],
                 "stream_map": lambda c=c: rf.stream_map(f, x, x, device=dev, chunk_bytes=x.nbytes // c, x_buffer=hb,
                                                         out_buffer=hb, inplace=True)}
        for face, call in faces.items():
            call()
            samples[face][c] = []
        for _ in range(calls):
            for face, call in faces.items():
                t0 = dev.now
                call()
                samples[face][c].append(dev.now - t0)
    out = {}
    for face, by_count in samples.items():
        ms = {c: statistics.median(v) * 1e3 for c, v in by_count.items()}
        best = min(ms, key=ms.get)
        out[face] = {"ms_by_chunks": ms, "best_ms": ms[best], "best_chunks": best}
    return out


def cpp_side(n: int, counts, iters: int, calls: int) -> dict:
    """The C++ program's best median over ``counts`` on four streams, on the host clock."""
    try:
        r = cuda_cpp_pipeline(n, chunks=list(counts), streams=4, iters=iters, repeats=calls)
    except BaselineUnavailable as exc:
        return {"skipped": str(exc)}
    return {"best_ms": r["host_clock"]["ms_median"], "best_chunks": r["host_clock"]["chunks"],
            "best_ms_cuda_events": r["ms_median"], "correct": r["correct"]}


def summary(ratios: list) -> dict:
    if not ratios or None in ratios:
        return {"median": None}
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
            "rounds_at_or_below_1": sum(r <= 1.0 for r in ratios), "rounds": len(ratios)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--workloads", default="seed,balanced,compute-bound")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    names = args.workloads.split(",")
    unknown = sorted(set(names) - set(COUNTS))
    if unknown or args.rounds < 1 or args.calls < 1:
        ap.error(f"workloads from {sorted(COUNTS)}, rounds and calls >= 1 (got {unknown or ''} "
                 f"rounds={args.rounds} calls={args.calls})")
    dev = rf.device(args.device)
    hb, x = pinned_random(dev, args.mib)
    out = {**header(dev.name), "mib": args.mib, "calls": args.calls, "rounds": args.rounds, "workloads": []}
    try:
        for name in names:
            f, iters = kernel_for(dev, name, x.nbytes)
            counts = COUNTS[name]
            kw = dict(device=dev, x_buffer=hb, out_buffer=hb, inplace=True)
            jobs = {c: rf.MapJob(f, x, x, chunk_bytes=x.nbytes // c, **kw) for c in counts}
            try:
                correct = {"MapJob": checked(dev, f, hb, x, jobs[counts[0]]),
                           "stream_map": checked(dev, f, hb, x, lambda: rf.stream_map(
                               f, x, x, chunk_bytes=x.nbytes // counts[0], **kw))}
                rounds = []
                for i in range(args.rounds):
                    first_cpp = i % 2 == 1
                    cpp = cpp_side(x.size, counts, iters, args.calls) if first_cpp else None
                    ours = ringflow_side(dev, f, hb, x, counts, args.calls, jobs)
                    cpp = cpp if first_cpp else cpp_side(x.size, counts, iters, args.calls)
                    ratio = {face: (ours[face]["best_ms"] / cpp["best_ms"] if "best_ms" in cpp else None)
                             for face in ours}
                    rounds.append({"cpp_first": first_cpp, "ringflow": ours, "cpp": cpp, "ratio": ratio})
                    print(name, i, {k: v and round(v, 4) for k, v in ratio.items()}, flush=True)
            finally:
                for job in jobs.values():
                    job.close()
            out["workloads"].append({
                "workload": name, "iters": iters, "chunk_counts": list(counts), "correct": correct, "rounds": rounds,
                "ratio": {face: summary([r["ratio"][face] for r in rounds]) for face in ("MapJob", "stream_map")}})
    finally:
        hb.close()
    write(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
