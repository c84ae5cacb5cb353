"""Integration smoke on a real GPU: rf.stream_map with an rf.Kernel, staged and registered.

Prints time, effective GB/s (bytes in + bytes out over the wall time) and whether the result
is bit-exact; never raises (a failure prints its traceback), so the calling script goes on.
Usage: PYTHONPATH=src python3 bench/cuda_smoke.py [MiB]
"""

from __future__ import annotations

import sys
import time
import traceback

import numpy as np

import ringflow as rf
from ringflow._kernel import Kernel

AFFINE = Kernel(r"""
extern "C" __global__ void affine(const float* x, float* y, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        y[i] = x[i] * 2.0f + 1.0f;
}""", "affine", reference=lambda x, y: np.add(np.multiply(x, np.float32(2), out=y), np.float32(1), out=y),
    options={"fma": False})


def main() -> None:
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    x = np.random.default_rng(0).random(mib << 18, dtype=np.float32)
    expect = x * np.float32(2) + np.float32(1)
    dev = rf.device("cuda:0")
    print(f"stream_map smoke on {dev.name}, {mib} MiB float32, arrays: {dev.array_type}")
    for host in ("stage", "register"):
        for rep in range(2):
            try:
                out = np.empty_like(x)
                out[:] = 0  # touch the output so first-touch page faults stay out of the timing
                t0 = time.perf_counter()
                rf.stream_map(AFFINE, x, out, device=dev, host=host)
                t = time.perf_counter() - t0
                print(f"  host={host:8s} run {rep}: {t * 1e3:8.1f} ms  {2 * x.nbytes / t / 1e9:6.1f} GB/s  "
                      f"bit-exact={np.array_equal(out, expect)}")
            except Exception:  # noqa: BLE001 - report and go on
                print(f"  host={host} run {rep} FAILED")
                traceback.print_exc(file=sys.stdout)
    print("live after runs:", dev.live())
    dev.close()
    print("live after close:", dev.live())


if __name__ == "__main__":
    main()
