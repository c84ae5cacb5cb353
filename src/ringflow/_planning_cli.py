"""``ringflow plan``: predicted stage times, slots, chunk size and bound for a workload."""

from __future__ import annotations

import json
import re

from . import _plan as plan

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 8MiB, 1GiB or 65536")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def plan_command(args) -> int:
    from rich.console import Console
    from rich.table import Table

    total = parse_bytes(args.bytes)
    per_byte = args.compute_ms_per_gib * 1e-3 / (1 << 30)
    if args.chunk == "auto":
        choice = plan.choose_chunk_bytes(args.profile, total, compute_s_per_byte=per_byte, workers=args.workers,
                                         host_stages=not args.pinned)
        chunk = choice.chunk_bytes
    else:
        chunk, choice = parse_bytes(args.chunk), None
    t, predicted = plan.predict_seconds(args.profile, total, chunk, compute_s_per_byte=per_byte,
                                        workers=args.workers, host_stages=not args.pinned)
    slots = plan.plan_slots(t)
    n = -(-total // chunk)
    console = Console()
    table = Table(title=f"{args.bytes} in chunks of {chunk / 2**20:g} MiB x {n} on profile {args.profile}")
    table.add_column("what")
    table.add_column("value", justify="right")
    for stage, sec in t.as_dict().items():
        table.add_row(f"{stage} per chunk", f"{sec * 1e3:.4f} ms")
    table.add_row("bottleneck", slots.bottleneck)
    for ring in ("host_in", "device_in", "device_out", "host_out"):
        table.add_row(f"slots {ring}", f"{getattr(slots.slots, ring)} (lifetime {slots.lifetimes.get(ring, 0) * 1e3:.3f} ms)")
    table.add_row("predicted total", f"{predicted * 1e3:.3f} ms")
    console.print(table)
    if choice is not None:
        console.print("candidates: " + ", ".join(f"{c / 2**20:g} MiB: {s * 1e3:.2f} ms" for c, _, s in choice.table))
    if args.compare:
        with open(args.compare) as fh:
            bench = json.load(fh)
        for name, w in bench.get("workloads", {}).items():
            for row in w.get("rows", []):
                if row.get("chunk_bytes") and row.get("predicted_ms") and row.get("ms_median"):
                    err = row["predicted_ms"] / row["ms_median"] - 1
                    console.print(f"{name} {row['name']}: predicted {row['predicted_ms']:.3f} ms, measured "
                                  f"{row['ms_median']:.3f} ms, error {err * 100:+.1f}%")
    return 0
