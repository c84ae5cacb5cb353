"""CPU: how ``_device/cuda/_held.py`` hands a kernel its arguments (the GPU tests run the calls)."""

from __future__ import annotations

import ctypes

import numpy as np

from ringflow._device.cuda import _held


class _FakeLib:
    """Stands in for libcuda: records what cuLaunchKernel was given."""

    def __init__(self):
        self.seen = None

    def cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, shmem, stream, params, extra):
        values = []
        for i, size in enumerate(self.sizes):
            values.append(ctypes.string_at(params[i], size))
        self.seen = (function, (gx, gy, gz), (bx, by, bz), shmem, stream, values, extra)
        return 0


def test_a_launch_passes_addresses_as_64_bit_pointers_and_scalars_by_their_bytes():
    lib = _FakeLib()
    args = [0x7F00_0000_1000, np.int32(-3), np.float32(2.5), np.uint64(1 << 40)]
    lib.sizes = [8, 4, 4, 8]
    _held.launch(lib, 0xABC, 12, 256, 0x55, args, "a test launch")
    function, grid, block, shmem, stream, values, extra = lib.seen
    assert (function, grid, block, shmem, stream, extra) == (0xABC, (12, 1, 1), (256, 1, 1), 0, 0x55, None)
    assert values == [(0x7F00_0000_1000).to_bytes(8, "little"), np.int32(-3).tobytes(), np.float32(2.5).tobytes(),
                      np.uint64(1 << 40).tobytes()]


def test_without_libcuda_the_backend_falls_back():
    # this machine may or may not have a driver; either way the answer is a library or None, never an error
    assert _held.calls() is None or hasattr(_held.calls(), "cuLaunchKernel")
