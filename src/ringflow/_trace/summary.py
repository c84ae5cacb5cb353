"""``ringflow trace FILE``: what a saved trace says, without opening a browser."""

from __future__ import annotations

import collections

import numpy as np

from .chrome import load_spans
from .timeline import STAGES


def summarise(path: str) -> dict:
    spans = load_spans(path)
    if not spans:
        return {"spans": 0}
    start = min(s.start for s in spans)
    end = max(s.end for s in spans)
    by_stage = collections.defaultdict(list)
    for s in spans:
        by_stage[s.name].append(s)
    chunks = {s.chunk for s in spans if s.chunk is not None and s.name in STAGES}
    out = {"spans": len(spans), "chunks": len(chunks), "wall_ms": (end - start) * 1e3, "stages": {}}
    for name, group in sorted(by_stage.items()):
        d = np.array([g.end - g.start for g in group])
        out["stages"][name] = {"count": len(group), "median_ms": float(np.median(d)) * 1e3,
                               "total_ms": float(d.sum()) * 1e3, "busy_fraction": float(d.sum()) / (end - start)}
    gpu = [s for s in spans if s.name in ("h2d", "compute", "d2h")]
    if gpu:
        out["gpu_busy_union_ms"] = _union(gpu) * 1e3
        out["gpu_overlap"] = sum(s.end - s.start for s in gpu) / max(1e-12, _union(gpu))
    return out


def _union(spans) -> float:
    total, cur_a, cur_b = 0.0, None, None
    for s in sorted(spans, key=lambda s: s.start):
        if cur_b is None or s.start > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = s.start, s.end
        else:
            cur_b = max(cur_b, s.end)
    return total + ((cur_b - cur_a) if cur_b is not None else 0.0)


def print_summary(path: str) -> int:
    from rich.console import Console
    from rich.table import Table

    try:
        info = summarise(path)
    except (OSError, ValueError, KeyError) as exc:
        print(f"cannot read {path} as a Chrome trace: {exc}")
        return 2
    t = Table(title=f"{path}: {info.get('chunks', 0)} chunks, {info.get('wall_ms', 0):.3f} ms, "
                    f"GPU stage overlap x{info.get('gpu_overlap', 0):.2f}")
    for col in ("span", "count", "median ms", "total ms", "busy"):
        t.add_column(col, justify="right" if col != "span" else "left")
    order = {s: i for i, s in enumerate(STAGES)}
    for name, st in sorted(info.get("stages", {}).items(), key=lambda kv: (order.get(kv[0], 99), kv[0])):
        t.add_row(name, str(st["count"]), f"{st['median_ms']:.4f}", f"{st['total_ms']:.3f}",
                  f"{st['busy_fraction'] * 100:.0f}%")
    Console().print(t)
    return 0
