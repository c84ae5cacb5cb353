"""Where the time goes: a profiled run's report, a Perfetto trace and a Gantt chart.

    python examples/04_profile_and_trace.py [OUTPUT_FOLDER]

``rf.stream_map_report`` runs ``stream_map`` with profiling on and returns the report with the
result: every stage's median time, the bottleneck, the ideal bound for this many chunks (what
perfect overlap would take) and the efficiency (ideal / measured). ``report.save_trace`` writes
Chrome/Perfetto JSON: open it at https://ui.perfetto.dev. ``report.plot`` draws a PNG (needs
matplotlib). A ``Pipeline(..., profile=True)`` gives the same through ``pipe.report()``.
RINGFLOW_DEVICE=sim forces the simulated GPU.
"""

import os
import sys

import numpy as np

import ringflow as rf


def f(x, y):
    y[...] = x * 2 + 1


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "ringflow-example-trace"
    os.makedirs(out_dir, exist_ok=True)
    dev = rf.device(os.environ.get("RINGFLOW_DEVICE", "auto"))

    # A whole array: an ordinary numpy array is staged through pinned buffers by CPU workers.
    x = np.random.default_rng(2).random(1 << 22, dtype=np.float32)  # 16 MiB
    y, report = rf.stream_map_report(f, x, device=dev, chunk_bytes=1 << 20)
    np.testing.assert_array_equal(y, x * 2 + 1)
    print(report.headline())
    print(f"bottleneck: {report.bottleneck}; efficiency {report.efficiency:.2f} "
          f"(ideal {report.ideal_s * 1e3:.3f} ms, measured {report.measured_s * 1e3:.3f} ms)")
    print(report)  # the full table: stage medians and spreads, latency, stalls, memory

    trace = report.save_trace(os.path.join(out_dir, "trace.json"))
    print(f"trace: {trace} (open at https://ui.perfetto.dev)")
    try:
        png = os.path.join(out_dir, "timeline.png")
        report.plot(png)  # returns the matplotlib Figure; with a path it also saves it there
        print(f"timeline: {png}")
    except (ImportError, RuntimeError) as exc:  # matplotlib is the `plot` extra
        print(f"no timeline PNG: {exc}")

    # A stream of requests: profile=True on the pipeline, then pipe.report().
    requests = [np.full(n, 1.0, np.float32) for n in (1000, 50_000, 200_000, 7, 120_000)]
    with rf.Pipeline(f, device=dev, chunk_bytes=1 << 20, profile=True) as pipe:
        results = list(pipe.map(requests))
    assert all((r == 3).all() for r in results)
    rep = pipe.report()
    # small requests share chunks while the pipeline is busy: the report's figures are per chunk
    print(f"pipeline: {len(results)} requests in {rep.chunks} chunks, chunk latency p50 "
          f"{rep.latency_s['p50'] * 1e3:.3f} ms, p99 {rep.latency_s['p99'] * 1e3:.3f} ms")
    dev.close()


if __name__ == "__main__":
    main()
