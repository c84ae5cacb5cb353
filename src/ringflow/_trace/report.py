"""The report of one profiled run: where the time went, against the ideal bound.

* **stage times**: per-chunk duration of each stage, median and spread (p10..p90);
* **bottleneck** and **ideal bound**: from the medians, ``sum + (n - 1) * max`` over n chunks
  (:func:`ringflow._plan.ideal_total`), the CPU stages counted as ``(prepare + consume) / workers``;
  copies measured under load already run at the concurrent H2D/D2H bandwidth. The first chunk's
  ``sum`` takes each stage's fastest observed time: medians under load include contention
  (workers sharing memory bandwidth) that a lone first chunk does not meet, and with them the
  bound overshot a CPU-bound run (efficiency 1.19 in the H200 demo);
* **measured** time (first accepted chunk to last ended) and **efficiency** = ideal / measured;
* request **latency** p50/p95/p99 (accepted to ended), **loaded throughput**;
* **stall** totals and pinned/device memory high-water marks; scheduler host time per chunk.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np

from .._plan import StageTimes, ideal_total
from .chrome import save_chrome
from .timeline import STAGES, Timeline


def _pct(values, q) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


@dataclasses.dataclass
class Report:
    timeline: Timeline
    chunks: int
    bytes_in: int
    measured_s: float
    stage_median_s: dict
    stage_spread_s: dict  # stage -> (p10, p90)
    workers: int
    bottleneck: str
    ideal_s: float
    efficiency: float
    latency_s: dict  # p50/p95/p99
    throughput_GBps: float
    stall_s: dict
    memory: dict
    host_overhead_per_chunk_s: float

    @classmethod
    def build(cls, timeline: Timeline, *, workers: int, memory: dict, host_seconds: float) -> "Report":
        recs = [r for r in timeline.records if r.final == "delivered"]
        n = len(recs)
        med, spread, fastest = {}, {}, {}
        for stage in STAGES:
            d = [r.stages[stage][1] - r.stages[stage][0] for r in recs if stage in r.stages]
            med[stage] = _pct(d, 50) if d else 0.0
            spread[stage] = (_pct(d, 10), _pct(d, 90)) if d else (0.0, 0.0)
            fastest[stage] = min(d) if d else 0.0
        times = StageTimes(workers=workers, **med)
        ideal = ideal_total(times, n, first_chunk_s=sum(fastest.values()))
        measured = (max(r.ended for r in recs) - min(r.accepted for r in recs)) if recs else 0.0
        lat = [r.latency for r in recs]
        stalls: dict[str, float] = {}
        for s in timeline.stalls:
            stalls[s.name] = stalls.get(s.name, 0.0) + s.duration
        nbytes = sum(r.nbytes for r in recs)
        return cls(timeline=timeline, chunks=n, bytes_in=nbytes, measured_s=measured, stage_median_s=med,
                   stage_spread_s=spread, workers=workers, bottleneck=times.bottleneck, ideal_s=ideal,
                   efficiency=(ideal / measured) if measured > 0 else float("nan"),
                   latency_s={"p50": _pct(lat, 50), "p95": _pct(lat, 95), "p99": _pct(lat, 99)},
                   throughput_GBps=(nbytes / measured / 1e9) if measured > 0 else 0.0, stall_s=stalls,
                   memory=memory, host_overhead_per_chunk_s=host_seconds / max(1, len(timeline.records)))

    # -- output ------------------------------------------------------------------------------------
    def save_trace(self, path: str) -> str:
        """Chrome/Perfetto JSON: open it in ui.perfetto.dev."""
        return save_chrome(self.timeline, path)

    def plot(self, path: str) -> str:
        """A PNG Gantt chart of the run (needs matplotlib)."""
        from .plot import plot_gantt

        return plot_gantt(self.timeline, path, title=self.headline())

    def headline(self) -> str:
        return (f"{self.chunks} chunks, {self.bytes_in / 1e6:.1f} MB in {self.measured_s * 1e3:.3f} ms "
                f"(ideal {self.ideal_s * 1e3:.3f} ms, efficiency {self.efficiency:.2f}, bottleneck {self.bottleneck})")

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("timeline")
        return d

    def table(self):
        from rich.table import Table

        t = Table(title=self.headline(), show_lines=False)
        t.add_column("stage")
        t.add_column("median ms", justify="right")
        t.add_column("p10..p90 ms", justify="right")
        for stage in STAGES:
            lo, hi = self.stage_spread_s[stage]
            t.add_row(stage, f"{self.stage_median_s[stage] * 1e3:.4f}", f"{lo * 1e3:.4f}..{hi * 1e3:.4f}")
        t.add_section()
        t.add_row("latency p50/p95/p99", "/".join(f"{self.latency_s[k] * 1e3:.3f}" for k in ("p50", "p95", "p99")), "ms")
        t.add_row("loaded throughput", f"{self.throughput_GBps:.2f}", "GB/s in")
        for name, s in sorted(self.stall_s.items()):
            t.add_row(f"stall: {name}", f"{s * 1e3:.3f}", "ms total")
        for name, v in self.memory.items():
            t.add_row(name, f"{v / 2**20:.1f}", "MiB")
        t.add_row("scheduler host time", f"{self.host_overhead_per_chunk_s * 1e6:.1f}", "us per chunk")
        return t

    def __str__(self) -> str:
        from rich.console import Console

        console = Console(width=100, record=True, file=open("/dev/null", "w"))
        console.print(self.table())
        return console.export_text()


def memory_of(scheduler) -> dict[str, int]:
    """Pinned and device bytes allocated by the rings, and their high-water marks in use."""
    pinned = device = pinned_hw = device_hw = 0
    for ring in scheduler.rings:
        if ring.external:  # the caller's registered memory, not ours
            continue
        size = len(ring) * ring.chunk_bytes
        hw = ring.high_water * ring.chunk_bytes
        if ring.buffer.is_host:
            pinned, pinned_hw = pinned + size, pinned_hw + hw
        else:
            device, device_hw = device + size, device_hw + hw
    return {"pinned allocated": pinned, "pinned high-water": pinned_hw, "device allocated": device,
            "device high-water": device_hw}


def report_or_none(timeline: Optional[Timeline], **kw) -> Optional[Report]:
    return Report.build(timeline, **kw) if timeline is not None else None
