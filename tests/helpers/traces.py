"""Chrome traces for ``ringflow trace``: a long run's, written by ringflow's own writer, and the
summary as the command computed it from every event read into memory (the reference its
streaming reader must match)."""

from __future__ import annotations

import collections
import random

import numpy as np

from ringflow._trace.chrome import save_chrome
from ringflow._trace.summary import LEGEND, read_process_spans
from ringflow._trace.timeline import STAGES, ChunkRecord, Span, Timeline


def write_long_trace(path: str, chunks: int, *, seed: int = 0) -> str:
    """Write the trace of a run of ``chunks`` chunks (five stages each, jittered so spans of a
    stage overlap, and a slot stall every third chunk) with :func:`save_chrome`; returns ``path``."""
    rng = random.Random(seed)
    records, stalls = [], []
    for i in range(chunks):
        accepted = at = i * 1e-3
        stages = {}
        for stage, took in zip(STAGES, (1e-3, 1e-3, 0.5e-3, 1e-3, 1e-3)):
            took *= 1 + 0.3 * rng.random()
            stages[stage] = (at, at + took)
            at += took + 1e-5 * rng.random()
        records.append(ChunkRecord(index=i, nbytes=1 << 20, final="delivered", accepted=accepted, ended=at,
                                   stages=stages))
        if i % 3 == 0:
            stalls.append(Span("stall: slots", "wait device-in slot", accepted, accepted + 2e-4, i))
    return save_chrome(Timeline(records=records, stalls=stalls, meta={"device": "sim"}), path)


def reference_summary(path: str) -> dict:
    """The summary of the trace at ``path`` as ``ringflow trace`` computed it with every span in
    a list (:func:`read_process_spans`), the figures added up in the same order."""
    pairs = read_process_spans(path)
    spans = [s for _, s in pairs]
    out = {"file": path, "spans": len(spans), "chunks": 0, "wall_ms": 0.0, "stages": {}, "legend": dict(LEGEND)}
    if not spans:
        return out
    start = min(s.start for s in spans)
    wall = max(s.end for s in spans) - start
    by_name = collections.defaultdict(list)
    for s in spans:
        by_name[s.name].append(s)
    out["chunks"] = len({(pid, s.chunk) for pid, s in pairs if s.chunk is not None and s.name in STAGES})
    out["wall_ms"] = wall * 1e3
    order = {s: i for i, s in enumerate(STAGES)}
    for name, group in sorted(by_name.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])):
        d = np.array([g.end - g.start for g in group])
        tracks = max(len({g.track for g in group}), _most_at_once(group))
        total = float(d.sum())
        out["stages"][name] = {
            "count": len(group), "tracks": tracks, "median_ms": float(np.median(d)) * 1e3, "total_ms": total * 1e3,
            "busy_fraction": _union(group) / wall if wall > 0 else 0.0,
            "per_track_fraction": total / (tracks * wall) if wall > 0 else 0.0}
    gpu = [s for s in spans if s.name in ("h2d", "compute", "d2h")]
    if gpu:
        union = _union(gpu)
        out["gpu_busy_union_ms"] = union * 1e3
        out["gpu_overlap"] = sum(s.end - s.start for s in gpu) / union if union > 0 else 1.0
    return out


def _most_at_once(spans) -> int:
    times = np.array([s.start for s in spans] + [s.end for s in spans])
    steps = np.repeat(np.array([1, -1], dtype=np.int64), len(spans))
    order = np.lexsort((steps, times))
    return int(max(0, np.cumsum(steps[order]).max()))


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
