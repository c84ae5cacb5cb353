"""GPU: copies, launches and events across three streams give bit-exact results."""

from __future__ import annotations

import numpy as np
import pytest

from ringflow._device.cuda import CudaDevice

from .helpers_cuda import AFFINE_U32, affine_u32_expected, array_kinds

pytestmark = pytest.mark.gpu

N = 1 << 20  # uint32 elements per chunk (4 MiB): copies long enough for a missing wait to show


def _three_stream_run(dev, host_in, host_out, compute, expected, slots=3, iters=24, seed=0):
    """H2D on one stream, compute on a second after a wait, D2H on a third after a wait; a ring
    of ``slots`` chunks in flight; every chunk checked bit-exact against fresh random input."""
    rng = np.random.default_rng(seed)
    s_in, s_comp, s_out = dev.create_stream(), dev.create_stream(), dev.create_stream()
    d_in = [dev.allocate(4 * N, stream=s_in) for _ in range(slots)]
    d_out = [dev.allocate(4 * N, stream=s_in) for _ in range(slots)]
    s_comp.wait(s_in.record())
    s_out.wait(s_in.record())
    done = [None] * slots  # the D2H event of the chunk last in each slot
    inputs = [None] * slots
    checked = 0
    try:
        for it in range(iters + slots):
            k = it % slots
            if done[k] is not None:  # slot k's previous chunk: wait for it, then check it
                done[k].sync()
                got = host_out[k].view(np.uint32)
                np.testing.assert_array_equal(got, expected(inputs[k]))
                checked += 1
            if it >= iters:
                continue
            inputs[k] = rng.integers(0, 2**32, N, dtype=np.uint32)
            host_in[k].view(np.uint32)[:] = inputs[k]
            host_out[k].view(np.uint8).fill(0xAB)  # poison: an unwritten result cannot pass
            s_in.copy(d_in[k], host_in[k])
            s_comp.wait(s_in.record())
            s_comp.fill(d_out[k], 0xCD)
            s_comp.launch(compute, d_in[k].array(np.uint32, N), d_out[k].array(np.uint32, N),
                          reads=[d_in[k]], writes=[d_out[k]])
            s_out.wait(s_comp.record())
            s_out.copy(host_out[k], d_out[k])
            done[k] = s_out.record()
    finally:
        for s in (s_in, s_comp, s_out):
            s.sync()
        for b in d_in + d_out:
            b.close()
        for s in (s_in, s_comp, s_out):
            s.close()
    assert checked == iters


@pytest.mark.parametrize("kind", array_kinds())
def test_three_streams_pinned_kernel(kind):
    with CudaDevice(0, array=kind) as dev:
        host_in = [dev.allocate_host(4 * N) for _ in range(3)]
        host_out = [dev.allocate_host(4 * N) for _ in range(3)]
        _three_stream_run(dev, host_in, host_out, AFFINE_U32, affine_u32_expected)
        for b in host_in + host_out:
            b.close()
        assert dev.live().total == 0, dev.live()


def test_three_streams_registered_host_memory(cuda_device):
    dev = cuda_device
    arrays_in = [np.empty(N, np.uint32) for _ in range(3)]
    arrays_out = [np.empty(N, np.uint32) for _ in range(3)]
    host_in = [dev.register_host(a) for a in arrays_in]
    host_out = [dev.register_host(a) for a in arrays_out]
    assert all(h.registered for h in host_in + host_out)
    _three_stream_run(dev, host_in, host_out, AFFINE_U32, affine_u32_expected, seed=1)
    np.testing.assert_array_equal(arrays_out[0], host_out[0].view(np.uint32))  # views are the arrays
    for b in host_in + host_out:
        b.close()
    assert dev.live().total == 0, dev.live()


def _framework_affine(kind):
    """x * 2 + 1 in float32 through the framework itself (two ops: no fused multiply-add)."""
    if kind == "cupy":
        import cupy

        def fn(x, y):
            assert cupy.cuda.get_current_stream().ptr == fn.stream.handle
            cupy.multiply(x, np.float32(2), out=y)
            y += np.float32(1)
    else:
        import torch

        def fn(x, y):
            assert torch.cuda.current_stream().cuda_stream == fn.stream.handle
            torch.mul(x, 2, out=y)
            y.add_(1)
    return fn


@pytest.mark.parametrize("kind", [p for p in array_kinds() if p.values[0] != "dlpack"])
def test_framework_runs_on_the_launch_stream(kind):
    with CudaDevice(0, array=kind) as dev:
        assert dev.array_type == kind
        n = 1 << 18
        s = dev.create_stream()
        h_in, h_out = dev.allocate_host(4 * n), dev.allocate_host(4 * n)
        d_in, d_out = dev.allocate(4 * n, stream=s), dev.allocate(4 * n, stream=s)
        fn = _framework_affine(kind)
        fn.stream = s
        x = np.random.default_rng(2).random(n, dtype=np.float32)
        h_in.view(np.float32)[:] = x
        s.copy(d_in, h_in)
        s.launch(fn, d_in.array(np.float32, (n // 4, 4)), d_out.array(np.float32, (n // 4, 4)))
        s.copy(h_out, d_out)
        s.sync()
        np.testing.assert_array_equal(h_out.view(np.float32), x * np.float32(2) + np.float32(1))
        for b in (d_in, d_out):
            b.close(stream=s)
        s.close()
        for b in (h_in, h_out):
            b.close()
        assert dev.live().total == 0, dev.live()
