"""The ``requests`` workload with the arrivals handed to 1, 2, 4, ... handler threads, each of
which calls ``Pipeline.submit`` (as a threaded server runs each request on a free handler), and
under other GIL switch intervals, interleaved over rounds in one process; then the torch
baselines once on the same requests.

    PYTHONPATH=src python3 bench/requests_handlers.py --device cuda:0 --variants h1,h2,h4,h8 --rounds 2 \\
        --count 1000 --out requests-handlers.json

A variant is ``h<threads>`` with an optional ``s<ms>`` and ``p<us>``: ``h1s0.2`` is one handler
(the arrival thread itself) with ``sys.setswitchinterval(0.2e-3)`` for the run, ``h1p0`` one
whose native copy threads poll 0 µs for their next part before they sleep, ``k<KiB>`` a copy
split into a thread per that many KiB (each restored after the run).

Per run: capacity (requests/s, the median of three closed-loop passes and each pass), isolated
p50/p99, p50/p99 at each load and its p99 over the isolated p99, the p99 a perfect FIFO server of
the measured capacity would give the same arrivals (every request alike, by bytes), every result
bit-exact (``correct``). ``--count`` requests a level: the p99 of 200 is the second slowest.
"""

from __future__ import annotations

import argparse
import platform
import sys

import _script

import ringflow as rf
from ringflow._device import native_copy, protocol
from ringflow._bench import workloads

KEEP = ("handler_threads", "count", "capacity_per_s", "capacity_passes_per_s", "isolated_p50_ms", "isolated_p99_ms",
        "p99_80_over_isolated", "p99_80_perfect_fifo_over_isolated", "p99_80_over_perfect_fifo", "correct",
        "pinned_high_water_MiB")


def summary(r: dict) -> dict:
    out = {k: r[k] for k in KEEP}
    out["levels"] = [{k: lv[k] for k in ("load", "p50_ms", "p99_ms", "p99_over_isolated", "p50_from_submit_ms",
                                         "p99_from_submit_ms", "perfect_fifo_p99_over_isolated", "gc_pauses")}
                     for lv in r["levels"]]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--variants", default="h1,h2,h4,h8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    dev = rf.device(a.device)
    runs = []
    default_switch = sys.getswitchinterval()
    default_split = protocol.NATIVE_SPLIT_BYTES
    for rnd in range(a.rounds):
        for v in a.variants.split(","):
            rest, _, kib = v.lstrip("h").partition("k")
            rest, _, us = rest.partition("p")
            h, _, ms = rest.partition("s")
            split = int(kib) << 10 if kib else default_split
            switch = float(ms) * 1e-3 if ms else default_switch
            spin = float(us) * 1e-6 if us else native_copy.SPIN_SECONDS
            sys.setswitchinterval(switch)
            native_copy.set_spin(spin)
            protocol.NATIVE_SPLIT_BYTES = split
            try:
                r = summary(workloads.requests(dev, count=a.count, handlers=int(h), baselines=False))
            finally:
                sys.setswitchinterval(default_switch)
                native_copy.set_spin(native_copy.SPIN_SECONDS)
                protocol.NATIVE_SPLIT_BYTES = default_split
            r.update(round=rnd, variant=v, switch_interval_s=switch, copy_spin_s=spin, copy_split_bytes=split)
            runs.append(r)
            print(f"round {rnd} {v}: {r['capacity_per_s']:.0f}/s "
                  f"{[round(x) for x in r['capacity_passes_per_s']]} iso p99 {r['isolated_p99_ms']:.2f} ms "
                  f"p99@80 {r['p99_80_over_isolated']:.2f}x (perfect fifo "
                  f"{[round(f, 2) for f in r['p99_80_perfect_fifo_over_isolated']]}) "
                  f"p99@50 {r['levels'][0]['p99_over_isolated']:.2f}x p99@95 {r['levels'][2]['p99_over_isolated']:.2f}x "
                  f"correct {r['correct']}", flush=True)
    torch_rows = []
    if not a.no_torch:
        items, expected = workloads.request_items(a.count, 8 << 20)
        torch_rows = workloads._torch_request_baselines(dev, items, expected, chunk_bytes=8 << 20, warmup=30)
        for row in torch_rows:
            print(row.get("name"), row.get("capacity_per_s"), row.get("skipped", ""), flush=True)
    out = {**_script.header({"device": dev.name, "node": platform.node()}), "runs": runs,
           "torch": [{k: v for k, v in row.items() if k not in ("requests",)} for row in torch_rows]}
    _script.write(out, a.out)
    return 0 if all(r["correct"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
