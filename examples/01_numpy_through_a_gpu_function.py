"""A numpy array through a function that runs on the GPU, with every stage overlapped.

    python examples/01_numpy_through_a_gpu_function.py

ringflow cuts ``x`` into chunks along axis 0 and, for each chunk, copies it to the device,
runs ``f`` on it there and copies the result back, while the next chunk is already on its way.
On a real GPU ``f`` receives CuPy arrays (or PyTorch tensors when CuPy is not installed); on
the simulated GPU it receives numpy arrays. Writing ``f`` with operators and ``y[...] = ...``
makes the same function right on both. RINGFLOW_DEVICE=sim forces the simulated GPU.
"""

import os

import numpy as np

import ringflow as rf


def array_module(a):
    """The array library of ``a``: CuPy for CuPy arrays, numpy otherwise."""
    if type(a).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np


def f(x, y):
    # Runs on the device, once per chunk: x is the chunk's input, y its output (same shape and
    # dtype). It must write y; it returns nothing.
    xp = array_module(x)
    y[...] = xp.sqrt(x) * 2 + 1


def main():
    dev = rf.device(os.environ.get("RINGFLOW_DEVICE", "auto"))  # the GPU if usable, else the simulated H200
    print(f"device: {dev.name}")

    x = np.random.default_rng(0).random((1 << 20, 4), dtype=np.float32)  # 16 MiB, ordinary (pageable) memory

    # chunk_bytes="auto" lets the planner pick the chunk size from the device's measured profile.
    y = rf.stream_map(f, x, device=dev, chunk_bytes="auto")

    expected = np.sqrt(x) * 2 + 1
    np.testing.assert_allclose(y, expected, rtol=1e-6)
    print(f"stream_map: {x.nbytes / 2**20:.0f} MiB through f, result matches numpy")

    # The output may also be given, and may be the input itself (in place):
    rf.stream_map(f, x, out=x, device=dev, chunk_bytes=1 << 20)
    np.testing.assert_allclose(x, expected, rtol=1e-6)
    print("in place: ok")

    rf.drop_warm_pipelines()  # stream_map keeps its engine warm for the next call; release it
    dev.close()


if __name__ == "__main__":
    main()
