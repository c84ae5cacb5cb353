"""The same arrays again and again (new contents each time): rf.MapJob.

    python examples/05_mapjob.py

``stream_map`` works out on every call how to cut the arrays and how host memory reaches the
copy engines. A ``MapJob`` does that once: its streams and rings stay set up, and with
``host="register"`` the arrays stay pinned for the job's life, so each call only moves data.
Only the contents of ``x`` may change between calls; ``x`` and ``out`` themselves are fixed.
With ``graph=True`` every call after the first is one CUDA graph launch, so small chunks cost
the host almost nothing; ``f`` must then write only into ``y`` and allocate nothing.
RINGFLOW_DEVICE=sim forces the simulated GPU (its clock is virtual: simulated H200 times).
"""

import os

import numpy as np

import ringflow as rf


def f(x, y):
    # no temporaries (numpy on the simulated GPU, CuPy on a real one): a graph can capture it
    np.multiply(x, 2, out=y)
    y += 1


def main():
    dev = rf.device(os.environ.get("RINGFLOW_DEVICE", "auto"))
    x = np.zeros((1 << 20, 4), np.float32)  # 16 MiB, refilled before every call
    out = np.empty_like(x)

    with rf.MapJob(f, x, out, device=dev, chunk_bytes=2 << 20, host="register") as job:
        print(job)  # chunks, host strategy ("register": pinned in place) and engine ("direct")
        for step in range(5):
            x[...] = step  # new contents, same array
            start = dev.now
            y = job()  # returns `out` once every chunk's result is in it
            assert y is out
            np.testing.assert_array_equal(y, 2 * step + 1)
            print(f"call {step}: {(dev.now - start) * 1e3:.3f} ms, out == {2 * step + 1}")

        # One call profiled: the report of that call (stage times, ideal bound, trace, plot).
        job(profile=True)
        print(job.report().headline())

    # Many calls in small chunks: the first call runs as usual, the second is captured as one
    # graph, and every later call launches it.
    with rf.MapJob(f, x, out, device=dev, chunk_bytes=256 << 10, host="register", graph=True) as job:
        for step in range(4):
            x[...] = step
            start = dev.now
            np.testing.assert_array_equal(job(), 2 * step + 1)
        print(f"graph: {job.chunks} chunks of 256 KiB, the last call {(dev.now - start) * 1e3:.3f} ms, "
              f"replayed as one graph: {job.replays_graph}")
    dev.close()


if __name__ == "__main__":
    main()
