"""A stream of variable-size requests through a Pipeline: backpressure, results, stats, latency.

    python examples/02_request_stream.py

A Pipeline keeps five stages busy at once (prepare on the CPU, copy in, compute on the
device, copy out, consume on the CPU) over a bounded set of pinned and device buffers, so
memory stays fixed however many requests arrive. ``map`` pulls requests only as capacity frees
up; ``submit`` blocks while ``max_in_flight`` requests are unfinished. RINGFLOW_DEVICE=sim
forces the simulated GPU (its clock is virtual: the latencies below are simulated H200 times).
"""

import os

import numpy as np

import ringflow as rf


def f(x, y):
    # runs on the device once per request; numpy arrays on the sim, CuPy/PyTorch on a GPU
    y[...] = x * 2 + 1


def main():
    dev = rf.device(os.environ.get("RINGFLOW_DEVICE", "auto"))
    rng = np.random.default_rng(1)
    # requests of 1 KiB to 1 MiB: each must fit one slot of chunk_bytes
    requests = [rng.random(int(n), dtype=np.float32) for n in rng.integers(256, 1 << 18, size=200)]

    with rf.Pipeline(f, device=dev, chunk_bytes=1 << 20, max_in_flight=16) as pipe:
        # 1. map: results in order, input pulled lazily (a generator works as well as a list)
        for req, result in zip(requests[:100], pipe.map(requests[:100])):
            np.testing.assert_array_equal(result, req * 2 + 1)
        print("map: 100 results, in order, all correct")

        # 2. submit: one future per request, stamped with the device's host clock (seconds)
        latencies = []

        def submit(req):
            start = dev.now
            fut = pipe.submit(req, timeout=10.0)  # blocks while 16 requests are unfinished
            fut.add_done_callback(lambda _: latencies.append(dev.now - start))
            return fut

        futures = [submit(req) for req in requests[100:]]
        for req, fut in zip(requests[100:], futures):
            np.testing.assert_array_equal(fut.result(), req * 2 + 1)
        print(f"submit: {len(futures)} futures resolved, all correct")

        stats = pipe.stats()  # accepted == delivered + failed + cancelled + in_flight
        print(f"stats: accepted={stats.accepted} delivered={stats.delivered} failed={stats.failed} "
              f"cancelled={stats.cancelled} in_flight={stats.in_flight}")
        p50, p99 = np.percentile(latencies, [50, 99]) * 1e3
        print(f"latency (submit to result): p50 {p50:.3f} ms, p99 {p99:.3f} ms")
    dev.close()


if __name__ == "__main__":
    main()
