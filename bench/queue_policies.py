"""Whether any order of serving requests brings the ``requests`` workload's p99 at 80% load to
2x its isolated p99: one server of a measured capacity, the workload's request sizes, Poisson
arrivals, three orders.

* ``fifo``: first come, first served (``queue_floor``'s queue in ``ringflow._bench.baselines``,
  and what one pipeline fed by one thread does);
* ``shortest-first``: the waiting request of fewest bytes next, none interrupted;
* ``largest-first``: the waiting request of most bytes next (the p99 is the large requests'
  latency: they wait least), none interrupted;
* ``shortest-remaining``: the request with the fewest bytes left runs, a new smaller one
  interrupting it (a pipeline could do this at chunk boundaries).

Each request holds the server for ``1 / capacity`` (``alike``) or in proportion to its bytes
(``by-bytes``, the same mean), and its isolated latency is ``a + b * bytes``, fitted to a
measured run's isolated p50 and p99 (``--isolated-p50-ms``, ``--isolated-p99-ms``) at the sizes
of those percentiles; a request's latency is its wait plus that isolated latency (for the
interrupting order: the time from its arrival to its last service, less its own service time,
plus its isolated latency). The ratio is the p99 of the latencies over the p99 of the isolated
latencies, as ``ringflow bench requests`` reports it: for ``--seeds`` draws of ``--count``
arrivals (the bench's count), and once for ``--long`` arrivals (where the p99 settles). Pure
arithmetic: no device.

    PYTHONPATH=src python3 bench/queue_policies.py --out FILE
"""

from __future__ import annotations

import argparse
import heapq
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ringflow._bench.baselines import fifo_waits, request_holds  # noqa: E402
from ringflow._bench.workloads import request_sizes  # noqa: E402
from _script import header, write  # noqa: E402

MiB = 1 << 20
POLICIES = ("fifo", "shortest-first", "largest-first", "shortest-remaining")


def serve(policy: str, arrived: np.ndarray, hold: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Seconds from each request's arrival to the start of its service (``fifo``,
    ``shortest-first``) or to its end less its own ``hold`` (``shortest-remaining``): the time
    it waited, under ``policy``; the size orders go by ``nbytes`` (left)."""
    if policy == "fifo":
        return fifo_waits(arrived, hold)
    n = len(arrived)
    waited = np.zeros(n)
    t, i, queue = 0.0, 0, []
    if policy in ("shortest-first", "largest-first"):
        sign = 1 if policy == "shortest-first" else -1
        while i < n or queue:
            if not queue:
                t = max(t, arrived[i])
            while i < n and arrived[i] <= t:
                heapq.heappush(queue, (sign * nbytes[i], i))
                i += 1
            _, j = heapq.heappop(queue)
            waited[j] = t - arrived[j]
            t += hold[j]
        return waited
    if policy == "shortest-remaining":
        while i < n or queue:
            if not queue:
                t = max(t, arrived[i])
            while i < n and arrived[i] <= t:
                heapq.heappush(queue, (nbytes[i], i))
                i += 1
            bytes_left, j = heapq.heappop(queue)
            left = hold[j] * bytes_left / nbytes[j]
            next_arrival = arrived[i] if i < n else np.inf
            if t + left <= next_arrival:
                t += left
                waited[j] = t - arrived[j] - hold[j]
            else:  # interrupted by the next arrival, which may be smaller
                heapq.heappush(queue, (nbytes[j] * (left - (next_arrival - t)) / hold[j], j))
                t = next_arrival
        return waited
    raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")


def ratio(policy: str, nbytes: np.ndarray, isolated: np.ndarray, capacity: float, load: float, by_bytes: bool,
          rng: np.random.Generator) -> float:
    """p99 latency over p99 isolated latency for one draw of Poisson arrivals at ``load``."""
    n = len(nbytes)
    arrived = np.cumsum(rng.exponential(1.0 / (load * capacity), n))
    hold = request_holds(nbytes, capacity)[1 if by_bytes else 0]
    latency = serve(policy, arrived, hold, nbytes) + isolated
    return float(np.percentile(latency, 99) / np.percentile(isolated, 99))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capacity", type=float, default=6184.0, help="requests/s of the measured run")
    ap.add_argument("--isolated-p50-ms", type=float, default=0.414)
    ap.add_argument("--isolated-p99-ms", type=float, default=0.821)
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--count", type=int, default=200)
    ap.add_argument("--seeds", type=int, default=300)
    ap.add_argument("--long", type=int, default=20000)
    ap.add_argument("--device", default=None, help="ignored: pure arithmetic (the bench scripts' common flag)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    out = {**header("arithmetic only"), "capacity_per_s": args.capacity, "isolated_p50_ms": args.isolated_p50_ms,
           "isolated_p99_ms": args.isolated_p99_ms, "load": args.load, "count": args.count, "seeds": args.seeds,
           "long": args.long, "rows": []}
    for count in (args.count, args.long):
        nbytes = request_sizes(count, 8 * MiB).astype(np.float64) * 4
        # isolated latency a + b * bytes through the measured p50 and p99 at those sizes' percentiles
        s50, s99 = np.percentile(nbytes, 50), np.percentile(nbytes, 99)
        b = (args.isolated_p99_ms - args.isolated_p50_ms) / 1e3 / max(s99 - s50, 1.0)
        isolated = args.isolated_p50_ms / 1e3 + b * (nbytes - s50)
        draws = args.seeds if count == args.count else 1
        for by_bytes in (False, True):
            for policy in POLICIES:
                ratios = [ratio(policy, nbytes, isolated, args.capacity, args.load, by_bytes,
                                np.random.default_rng(seed)) for seed in range(draws)]
                row = {"requests": count, "hold": "by-bytes" if by_bytes else "alike", "policy": policy,
                       "draws": draws, "p99_over_isolated_median": float(np.median(ratios)),
                       "p99_over_isolated_p10": float(np.percentile(ratios, 10)),
                       "p99_over_isolated_p90": float(np.percentile(ratios, 90)),
                       "share_at_or_under_2x": float(np.mean(np.array(ratios) <= 2.0))}
                out["rows"].append(row)
                print(f"{count:6d} requests, hold {row['hold']:8s} {policy:18s}: p99 over isolated median "
                      f"{row['p99_over_isolated_median']:.2f} (p10 {row['p99_over_isolated_p10']:.2f}, "
                      f"p90 {row['p99_over_isolated_p90']:.2f}; <= 2x in {100 * row['share_at_or_under_2x']:.0f}% "
                      f"of {draws})", flush=True)
    write(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
