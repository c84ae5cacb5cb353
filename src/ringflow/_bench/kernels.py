"""The compute functions the workloads use: one CUDA C++ source per kernel, a numpy reference
for the simulated GPU, and a simulated duration so the sim's timeline has the right shape."""

from __future__ import annotations

from typing import Callable

import numpy as np

from .._kernel import Kernel

AFFINE_ITER_SRC = r"""
extern "C" __global__ void affine_iter(const float* x, float* y, int iters, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float v = x[i];
        for (int k = 0; k < iters; ++k) v = v * 0.999f + 0.001f;
        y[i] = v;
    }
}
"""

SCALE_SHIFT_SRC = r"""
extern "C" __global__ void scale_shift(const float* x, float* y, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        y[i] = x[i] * 2.0f + 1.0f;
}
"""

SLOW_SCALE_SHIFT_SRC = r"""
extern "C" __global__ void slow_scale_shift(const float* x, float* y, long long spin, size_t n) {
    long long start = clock64();
    while (clock64() - start < spin) { }
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        y[i] = x[i] * 2.0f + 1.0f;
}
"""

# Simulated kernel cost on the H200 profile: a pass over input and output at device bandwidth,
# plus ~2.7e-14 s per byte per iteration (the tutorial's 64-iteration kernel on 256 MiB ~0.47 ms).
_DEVICE_BPS = 4.3e12
_ITER_S_PER_BYTE = 2.7e-14


def affine_reference(x: np.ndarray, y: np.ndarray, iters) -> None:
    v = np.array(x, copy=True)  # float32 on the sim; float64 for a reference
    a, b = v.dtype.type(0.999), v.dtype.type(0.001)
    for _ in range(int(iters)):
        v *= a
        v += b
    y[...] = v


def scale_shift_reference(x: np.ndarray, y: np.ndarray) -> None:
    np.multiply(x, np.float32(2.0), out=y)
    y += np.float32(1.0)


SLOW_SCALE_SHIFT = Kernel(SLOW_SCALE_SHIFT_SRC, "slow_scale_shift",
                          reference=lambda x, y, spin: scale_shift_reference(x, y))
AFFINE_ITER = Kernel(AFFINE_ITER_SRC, "affine_iter", reference=affine_reference)
SCALE_SHIFT = Kernel(SCALE_SHIFT_SRC, "scale_shift", reference=scale_shift_reference, pointwise=True)


def affine(iters: int, numeric_iters: int | None = None) -> Callable:
    """``f(x, y)``: ``iters`` times ``v = v*0.999 + 0.001`` (the tutorial's kernel at 64).

    ``numeric_iters`` (simulated GPU only) computes fewer iterations in numpy while the sim
    still charges the duration of ``iters``: virtual time does not depend on the numbers, and
    hundreds of numpy passes per chunk would make a sim benchmark take minutes."""
    n = iters if numeric_iters is None else numeric_iters
    f = AFFINE_ITER.bind(np.int32(n), name=f"affine_iter_{iters}")
    f.sim_seconds = lambda nbytes: 2 * nbytes / _DEVICE_BPS + iters * nbytes * _ITER_S_PER_BYTE
    f.iters = iters
    f.numeric_iters = n
    return f


def scale_shift() -> Callable:
    """``f(x, y)``: ``y = 2x + 1`` (bit-exact between the GPU and numpy)."""
    f = SCALE_SHIFT.bind(name="scale_shift")
    f.sim_seconds = lambda nbytes: 2 * nbytes / _DEVICE_BPS
    return f


def affine_expected(x: np.ndarray, iters: int) -> np.ndarray:
    """The reference in x's own precision (pass float64 for an accurate one)."""
    y = np.empty_like(x)
    affine_reference(x, y, iters)
    return y


def slow_scale_shift(spin_cycles: int, sim_seconds: float) -> Callable:
    """``y = 2x + 1`` after every thread spins ``spin_cycles`` clocks: a kernel slow enough that
    the GPU lags the host, so a missing wait or an early release shows up on a real device."""
    f = SLOW_SCALE_SHIFT.bind(np.int64(spin_cycles), name="slow_scale_shift")
    f.sim_seconds = sim_seconds
    return f
