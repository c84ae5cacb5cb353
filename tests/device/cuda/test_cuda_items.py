"""GPU: a pipeline's items of every host kind and results of another shape and dtype, bit-exact;
results in pinned pool arrays and items read in place from them."""

from __future__ import annotations

import numpy as np
import pytest

import ringflow as rf
from tests.helpers.dlpack import DLPackOnly
from tests.helpers.dtypes import DEVICE_DTYPES, NOT_DEVICE_DTYPES, NOT_DEVICE_IDS, refusal

from .helpers_cuda import array_kinds

pytestmark = pytest.mark.gpu


def channel_means(x, y):
    n = x.shape[0]
    y[...] = (x.reshape(n, 3, -1).sum(axis=2, dtype=np.float32) / (x.shape[2] * x.shape[3])).astype(y.dtype)


def test_uint8_images_in_float16_rows_out(cuda_device):
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 256, (8, 3, 32, 32), dtype=np.uint8) for _ in range(40)]
    with rf.Pipeline(channel_means, device=cuda_device, chunk_bytes=1 << 20, output=((8, 3), np.float16)) as pipe:
        out = list(pipe.map(batches))
    for b, r in zip(batches, out):
        want = (b.reshape(8, 3, -1).sum(axis=2, dtype=np.float32) / 1024).astype(np.float16)
        assert r.dtype == np.float16 and r.shape == (8, 3)
        np.testing.assert_array_equal(r, want)
        assert rf.host.buffer(r) is not None


@pytest.mark.parametrize("host", ["stage", "register", "pool"])
def test_whole_array_uint8_in_float16_rows_out(cuda_device, host):
    """``stream_map``/``MapJob`` with ``output=``: each engine and host path, bit-exact."""
    rng = np.random.default_rng(2)
    x = rng.integers(0, 256, (500, 3, 32, 32), dtype=np.uint8)
    want = (x.reshape(500, 3, -1).sum(axis=2, dtype=np.float32) / 1024).astype(np.float16)
    if host == "pool":
        pooled = rf.host.empty(x.shape, x.dtype, device=cuda_device)
        pooled[:] = x
        x, host = pooled, "auto"
    spec = ((500, 3), np.float16)
    y = rf.stream_map(channel_means, x, device=cuda_device, chunk_bytes=1 << 18, host=host, output=spec)
    np.testing.assert_array_equal(y, want)
    with rf.MapJob(channel_means, x, device=cuda_device, chunk_bytes=1 << 18, host=host, output=spec,
                   checked=True) as job:
        np.testing.assert_array_equal(job(), want)
        np.testing.assert_array_equal(job(), want)


def scale_shift(x, y):
    y[...] = x * 2 + 1


@pytest.mark.parametrize("kind", ["numpy", "torch", "torch-pinned", "pool"])
def test_items_of_every_host_kind_bit_exact(cuda_device, kind):
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal(int(n)).astype(np.float32) for n in rng.integers(1, 300_000, 60)]
    if kind.startswith("torch"):
        torch = pytest.importorskip("torch")
        items = [torch.from_numpy(a) for a in arrays]
        if kind == "torch-pinned":
            items = [t.pin_memory() for t in items]
    elif kind == "pool":
        items = []
        for a in arrays:
            p = rf.host.empty(a.shape, a.dtype, device=cuda_device)
            p[:] = a
            items.append(p)
    else:
        items = arrays
    with rf.Pipeline(scale_shift, device=cuda_device, chunk_bytes=2 << 20, checked=True) as pipe:
        out = list(pipe.map(items))
    for a, r in zip(arrays, out):
        np.testing.assert_array_equal(r, a * np.float32(2) + np.float32(1))


@pytest.mark.parametrize("consumer", ["cupy-default", "cupy-stream", "torch-stream", "dropped"])
def test_results_delivered_on_the_device_bit_exact(cuda_device, consumer):
    """A consumer reads each delivered result on the GPU (a copy into a buffer of its own) on
    its stream, releases, and the pipeline reuses the slot only after that read."""
    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(2)
    arrays = [rng.standard_normal(int(n)).astype(np.float32) for n in rng.integers(1000, 200_000, 40)]
    stream = None
    if consumer == "cupy-stream":
        stream = cp.cuda.Stream(non_blocking=True)
    elif consumer == "torch-stream":
        torch = pytest.importorskip("torch")
        stream = torch.cuda.Stream()
    copies = []
    with rf.Pipeline(scale_shift, device=cuda_device, chunk_bytes=1 << 20, deliver="device",
                     slots=rf.SlotCounts(host_in=2, device_in=2, device_out=2, host_out=1)) as pipe:
        for res in pipe.map(arrays):
            a = cp.asarray(res.array)  # CuPy (or DLPack) view of the slot
            if consumer == "cupy-stream":
                with stream:
                    copies.append(a * 1)
                res.release(stream=stream)
            elif consumer == "torch-stream":
                import torch

                with torch.cuda.stream(stream):
                    copies.append(cp.asarray(torch.as_tensor(a, device="cuda") * 1))
                res.release(stream=stream)
            elif consumer == "dropped":
                copies.append(a * 1)
                del a, res  # released on the default stream when collected
            else:
                copies.append(a * 1)
                res.release()
    cp.cuda.Device().synchronize()
    for x, c in zip(arrays, copies):
        np.testing.assert_array_equal(cp.asnumpy(c), x * np.float32(2) + np.float32(1))


@pytest.mark.parametrize("where", ["returned", "in-slot", "in-slot-threads"])
def test_prepare_in_worker_processes_bit_exact(cuda_device, where):
    """prepare in worker processes (its array copied into the shared pinned slot, or made there
    with rf.host.empty_slot), and made in the slot on worker threads."""
    from tests.helpers import process_prepare as pp

    prepare = pp.ramp if where == "returned" else pp.ramp_in_slot
    with rf.Pipeline(scale_shift, device=cuda_device, chunk_bytes=1 << 16, prepare=prepare,
                     processes=where != "in-slot-threads", workers=3, checked=True) as pipe:
        out = list(pipe.map(range(200)))
    for i, r in enumerate(out):
        np.testing.assert_array_equal(r, pp.ramp(i) * np.float32(2) + np.float32(1))


def test_items_of_several_arrays_bit_exact(cuda_device):
    """A dict of images and labels in, a dict of float16 means and labels out (CuPy on the device)."""
    def classify(x, y):
        n = x["images"].shape[0]
        y["means"][...] = (x["images"].reshape(n, -1).sum(axis=1, dtype=np.float32) / 192).astype(y["means"].dtype)
        y["labels"][...] = x["labels"] + 1

    rng = np.random.default_rng(5)
    batches = [{"images": rng.integers(0, 256, (16, 3, 8, 8), dtype=np.uint8),
                "labels": rng.integers(0, 10, 16).astype(np.int64)} for _ in range(50)]
    spec = {"means": ((16,), "float16"), "labels": ((16,), "int64")}
    with rf.Pipeline(classify, device=cuda_device, chunk_bytes=1 << 16, output=spec, checked=True) as pipe:
        out = list(pipe.map(batches))
    for b, r in zip(batches, out):
        want = (b["images"].reshape(16, -1).sum(axis=1, dtype=np.float32) / 192).astype(np.float16)
        np.testing.assert_array_equal(r["means"], want)
        np.testing.assert_array_equal(r["labels"], b["labels"] + 1)


@pytest.mark.parametrize("kind", ["cupy", "cupy-stream", "torch", "dlpack"])
def test_device_array_items_bit_exact(cuda_device, kind):
    """CuPy arrays, torch CUDA tensors and DLPack-only producers as items: copied device to
    device after their producer."""
    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal(int(n)).astype(np.float32) for n in rng.integers(1000, 100_000, 40)]
    if kind == "torch":
        torch = pytest.importorskip("torch")
        items = [torch.from_numpy(a).cuda() * 1 for a in arrays]
    elif kind == "cupy-stream":
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            items = [cp.asarray(a) * 1 for a in arrays]  # made on a stream of their own
    elif kind == "dlpack":
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            items = [DLPackOnly(cp.asarray(a) * 1) for a in arrays]
    else:
        items = [cp.asarray(a) * 1 for a in arrays]
    with rf.Pipeline(scale_shift, device=cuda_device, chunk_bytes=1 << 20, checked=True) as pipe:
        out = list(pipe.map(items))
    for a, r in zip(arrays, out):
        np.testing.assert_array_equal(r, a * np.float32(2) + np.float32(1))


def test_like_torch_on_the_host_and_on_the_device(cuda_device):
    torch = pytest.importorskip("torch")
    a = np.arange(1000, dtype=np.float32)
    with rf.Pipeline(scale_shift, device=cuda_device, chunk_bytes=1 << 16, like="torch") as pipe:
        r = pipe.submit(a).result()
    assert isinstance(r, torch.Tensor) and r.device.type == "cpu"
    np.testing.assert_array_equal(r.numpy(), a * 2 + 1)
    with rf.Pipeline(scale_shift, device=cuda_device, chunk_bytes=1 << 16, like="torch", deliver="device") as pipe:
        res = pipe.submit(a).result()
        t = res.array
        assert isinstance(t, torch.Tensor) and t.device.type == "cuda"
        got = t.cpu().numpy()
        res.release()
    np.testing.assert_array_equal(got, a * 2 + 1)


def test_fill_rows_brings_back_only_what_compute_filled(cuda_device):
    def positives(x, y):
        keep = x[x > 0]  # CuPy: the count is known on the host once this returns
        y[:keep.size] = keep
        return int(keep.size)

    rng = np.random.default_rng(4)
    items = [rng.standard_normal(int(n)).astype(np.float32) for n in rng.integers(0, 50_000, 40)]
    with rf.Pipeline(positives, device=cuda_device, chunk_bytes=1 << 18, fill="rows", checked=True) as pipe:
        out = list(pipe.map(items))
    for a, r in zip(items, out):
        np.testing.assert_array_equal(r, a[a > 0])


def test_a_device_result_released_on_a_stream_of_the_device_is_ordered_and_one_of_another_refused(cuda_device):
    cp = pytest.importorskip("cupy")
    other = rf.device("cuda:0")  # another device object of the same GPU: its streams are not this one's
    assert other is not cuda_device
    own = cuda_device.create_stream()
    assert own.owner is cuda_device and not own.closed
    arrays = [np.arange(1 << 12, dtype=np.float32) + k for k in range(6)]
    with rf.Pipeline(scale_shift, device=cuda_device, chunk_bytes=1 << 20, deliver="device", slots=1) as pipe:
        for x, res in zip(arrays, pipe.map(arrays)):
            with pytest.raises(TypeError, match="another device's stream"):
                res.release(stream=other.create_stream())
            got = cp.asnumpy(cp.asarray(res.array))
            res.release(stream=own)
            np.testing.assert_array_equal(got, x * 2 + 1)
    own.close()
    assert own.closed
    other.close()


def test_a_wait_only_a_release_can_end_times_out_and_names_the_results_to_release(cuda_device, monkeypatch, caplog):
    from ringflow._pipeline import driver

    monkeypatch.setattr(driver, "_HELD_WARN_S", 0.2)
    a = np.arange(1 << 10, dtype=np.float32)
    with rf.Pipeline(scale_shift, device=cuda_device, chunk_bytes=1 << 16, deliver="device",
                     slots=rf.SlotCounts(host_in=1, device_in=1, device_out=1, host_out=1)) as pipe:
        held = pipe.submit(a).result(timeout=30)
        nxt = pipe.submit(a)
        with caplog.at_level("WARNING", logger=driver.logger.name):
            with pytest.raises(TimeoutError, match="chunk 1"):
                nxt.result(timeout=1.0)
        assert any("not yet released (chunks 0)" in r.getMessage() for r in caplog.records), caplog.text
        held.release()
        with nxt.result(timeout=30) as y:
            np.testing.assert_array_equal(y.get() if hasattr(y, "get") else np.asarray(y.cpu()), a * 2 + 1)


def test_slots_of_an_odd_size_compute_right_with_a_kernel(cuda_device):
    """chunk_bytes=1001 once put device slot i at byte i * 1001, where the kernel's uint32 loads
    were misaligned (an error that breaks the device); each slot now starts on 256 bytes."""
    from tests.device.cuda.helpers_cuda import AFFINE_U32, affine_u32_expected

    rng = np.random.default_rng(3)
    items = [rng.integers(0, 2**32, 250, dtype=np.uint32) for _ in range(12)]
    with rf.Pipeline(AFFINE_U32, device=cuda_device, chunk_bytes=1001, slots=3, coalesce=False) as pipe:
        out = list(pipe.map(items))
    assert all(np.array_equal(r, affine_u32_expected(x)) for x, r in zip(items, out))


@pytest.mark.parametrize("dtype,advice", NOT_DEVICE_DTYPES, ids=NOT_DEVICE_IDS)
def test_a_dtype_no_gpu_array_holds_is_refused_as_on_the_simulated_gpu(cuda_device, dtype, advice):
    """x, output and items of such a dtype are refused before any device work, in the words the
    simulated GPU uses (tests/pipeline/test_bad_input.py): before, CuPy failed the first kernel
    on the chunk and PyTorch the launch's conversion, each with its own error, inside the run."""
    says = refusal(dtype, advice)
    x = np.zeros(64, dtype)
    with pytest.raises(TypeError, match=r"^x: " + says):
        rf.stream_map(_copy, x, device=cuda_device, chunk_bytes=1 << 12)
    with pytest.raises(TypeError, match=r"^output: " + says):
        rf.stream_map(_copy, np.zeros(64, np.float32), device=cuda_device, chunk_bytes=1 << 12,
                      output=((64,), dtype))
    with rf.Pipeline(_copy, device=cuda_device, chunk_bytes=1 << 12) as pipe:
        for item in (x, {"a": x, "b": np.ones(3, np.float32)}):
            with pytest.raises(TypeError, match=r"^items.*: " + says):
                pipe.submit(item)
        assert pipe.stats().accepted == 0
        np.testing.assert_array_equal(pipe.submit(np.arange(8, dtype=np.float32)).result(timeout=30),
                                      np.arange(8, dtype=np.float32))


def _copy(x, y):
    y[...] = x


def _torch_copy(x, y):
    """``y[...] = x`` through same-sized signed integers where this PyTorch has few operations on
    a dtype (unsigned 16, 32 and 64 bits): the bytes are what is checked."""
    import torch

    if x.dtype in (getattr(torch, "uint16", None), getattr(torch, "uint32", None), getattr(torch, "uint64", None)):
        y.view(getattr(torch, f"int{8 * x.element_size()}")).copy_(x.view(getattr(torch, f"int{8 * x.element_size()}")))
    else:
        y.copy_(x)


@pytest.mark.parametrize("dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("kind", [p for p in array_kinds() if p.values[0] != "dlpack"])
def test_every_device_dtype_moves_bit_exact_on_each_framework(kind, dtype):
    """Each dtype the simulated GPU takes makes the same round trip on a GPU (PyTorch: each this
    PyTorch has; the rest are refused by name, not failed in the framework)."""
    from ringflow._device.cuda import CudaDevice

    x = np.random.default_rng(4).integers(0, 256, 4096 * np.dtype(dtype).itemsize, dtype=np.uint8).view(dtype)
    if x.dtype.kind == "b":
        x = x.view(np.uint8) % 2 == 1
    elif x.dtype.kind in "fc":
        x = np.arange(x.size).astype(dtype)  # no NaN payloads: their bits may change in a float copy
    with CudaDevice(0, array=kind) as dev:
        f = _torch_copy if kind == "torch" else _copy
        if kind == "torch" and x.dtype in dev._adapter.unheld:
            with pytest.raises(Exception) as info:  # a chunk's failure, caused by the refusal
                rf.stream_map(f, x, device=dev, chunk_bytes=1 << 12)
            chain, error = [], info.value
            while error is not None:
                chain.append(str(error))
                error = error.__cause__ or error.__context__
            assert any(f"dtype {x.dtype} cannot be a tensor of PyTorch" in text for text in chain), chain
            return
        y = rf.stream_map(f, x, device=dev, chunk_bytes=1 << 12)
        assert y.dtype == x.dtype and y.tobytes() == x.tobytes()
