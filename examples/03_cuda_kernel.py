"""A CUDA C++ kernel as the compute stage, with a numpy reference for the simulated GPU.

    python examples/03_cuda_kernel.py

On a GPU, ``rf.Kernel`` compiles the source with NVRTC (through cuda.core, once per GPU, on
first use) and ringflow launches it with raw device pointers on the pipeline's compute stream.
On the simulated GPU, whose compute receives numpy arrays, the ``reference`` runs instead, so
one object serves both. RINGFLOW_DEVICE=sim forces the simulated GPU.
"""

import os

import numpy as np

import ringflow as rf

# The kernel gets a pointer per array, then each scalar by value, then size_t n (the element
# count of the first array). It is launched with ceil(n / block) blocks; a grid-stride loop
# keeps it right for any grid.
SOURCE = r"""
extern "C" __global__ void saxpb(const float* x, float* y, float a, float b, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        y[i] = a * x[i] + b;
}
"""


def saxpb_reference(x, y, a, b):
    # the same computation in numpy, writing its output in place
    np.multiply(x, a, out=y)
    y += b


saxpb = rf.Kernel(SOURCE, "saxpb", reference=saxpb_reference)


def main():
    dev = rf.device(os.environ.get("RINGFLOW_DEVICE", "auto"))
    print(f"device: {dev.name}" + (" (the numpy reference runs)" if dev.backend == "sim" else " (NVRTC-compiled)"))

    # bind() fixes the trailing scalars and gives f(x, y) for stream_map or a Pipeline.
    # Scalars are numpy scalars: their type fixes the C type (float here).
    f = saxpb.bind(np.float32(3.0), np.float32(0.5))

    x = np.arange(1 << 22, dtype=np.float32)  # 16 MiB
    y = rf.stream_map(f, x, device=dev, chunk_bytes=4 << 20)
    # allclose, not equal: the GPU compiler may fuse a * x + b into one FMA, rounded once
    np.testing.assert_allclose(y, x * np.float32(3.0) + np.float32(0.5), rtol=1e-6)
    print(f"saxpb over {x.size} floats in {x.nbytes // (4 << 20)} chunks: correct")

    rf.drop_warm_pipelines()
    dev.close()


if __name__ == "__main__":
    main()
