"""Helpers for the GPU tests (imported by them); holds no tests."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from ringflow._kernel import Kernel

AFFINE_U32 = Kernel(r"""
extern "C" __global__ void affine_u32(const unsigned int* x, unsigned int* y, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        y[i] = x[i] * 2654435761u + 12345u;   // wraps mod 2^32, exactly as numpy does
}
""", "affine_u32", reference=lambda x, y: np.add(np.multiply(x, np.uint32(2654435761), out=y), np.uint32(12345), out=y))


def affine_u32_expected(x: np.ndarray) -> np.ndarray:
    return x * np.uint32(2654435761) + np.uint32(12345)


def array_kinds() -> list:
    """Each array type, skipped where its framework is missing."""
    out = []
    for kind in ("cupy", "torch", "dlpack"):
        missing = kind != "dlpack" and importlib.util.find_spec(kind) is None
        out.append(pytest.param(kind, marks=pytest.mark.skipif(missing, reason=f"{kind} not installed")))
    return out
