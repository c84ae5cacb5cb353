"""The compute-bound workload's kernel with no copies: where a pipelined call's time beyond the
kernel's own comes from. On one GPU in one run, the affine kernel at the compute-bound count
(three times a chunk's copy in) over 256 MiB of float32 on the device, timed with CUDA events:

* ringflow's kernel (NVRTC) in one launch, and in chunk-sized launches over 1 and 4 streams
  (round robin, as the direct engine spreads them);
* the hand-written CUDA C++ program's kernel stage (nvcc) and its best pipelined call, measured in
  the same process.

    PYTHONPATH=src python3 bench/kernel_alone.py --device cuda:0 --out kernel-alone.json
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np
from _script import header, write

import ringflow as rf
from ringflow._bench import baselines, kernels
from ringflow._bench.workloads import calibrate_iters

MiB = 1 << 20


def timed(dev, streams, launches, repeats: int) -> dict:
    """Median and spread (ms) of ``launches()`` (which enqueues on ``streams``), from an event
    before on the first stream to one after every stream has joined it."""
    first = streams[0]
    out = []
    for r in range(repeats + 2):
        for s in streams[1:]:
            s.wait(first.record())
        start = first.record(timing=True)
        launches()
        for s in streams[1:]:
            first.wait(s.record())
        end = first.record(timing=True)
        end.sync()
        if r >= 2:  # two warm-up rounds
            out.append(end.elapsed_since(start) * 1e3)
    return {"ms_median": statistics.median(out), "ms_spread": [min(out), max(out)], "runs": len(out)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--chunk-mib", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = rf.device(args.device)
    n = args.mib * MiB // 4
    iters = calibrate_iters(dev, args.mib * MiB // 32, 3.0)
    f = kernels.affine(iters)
    buf = dev.allocate(n * 4)
    x = buf.array(np.float32, (n,))
    streams = [dev.create_stream() for _ in range(4)]
    chunk = args.chunk_mib * MiB // 4
    parts = [(a, min(n, a + chunk)) for a in range(0, n, chunk)]
    xs = [buf.slice(a * 4, (b - a) * 4).array(np.float32, (b - a,)) for a, b in parts]
    result = {**header(dev.name), "iters": iters, "mib": args.mib, "chunk_mib": args.chunk_mib, "chunks": len(parts)}
    if dev.backend == "cuda":
        result["versions"] = baselines.versions()

    def one_launch():
        streams[0].launch(f, x, x)

    def chunked(k):
        def go():
            for i, xi in enumerate(xs):
                streams[i % k].launch(f, xi, xi)
        return go

    result["ringflow_kernel_one_launch"] = timed(dev, streams[:1], one_launch, args.repeats)
    result["ringflow_kernel_chunked_1_stream"] = timed(dev, streams[:1], chunked(1), args.repeats)
    result["ringflow_kernel_chunked_4_streams"] = timed(dev, streams, chunked(4), args.repeats)
    print({k: v for k, v in result.items() if k.startswith("ringflow")}, flush=True)
    if dev.backend == "cuda":
        cpp = baselines.run_or_skip(baselines.cuda_cpp_pipeline, n, iters=iters, chunks=(len(parts),), streams=(4,))
        result["cuda_cpp"] = cpp
        kern = cpp.get("stages", {}).get("kernel", {}).get("ms_median")
        result["cpp_kernel_ms"] = kern
        result["cpp_pipelined_host_clock_ms"] = cpp.get("host_clock", {}).get("ms_median")
        if kern:
            result["ringflow_one_launch_over_cpp_kernel"] = result["ringflow_kernel_one_launch"]["ms_median"] / kern
        print({k: v for k, v in result.items() if k.startswith("cpp") or k.endswith("cpp_kernel")}, flush=True)
    for s in streams:
        s.close()
    buf.close()
    write(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
