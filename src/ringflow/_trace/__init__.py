"""One timeline for CPU and GPU work, Chrome/Perfetto export, NVTX ranges, the report, plots."""

from .chrome import load_spans, save_chrome, to_chrome
from .report import Report
from .timeline import STAGES, ChunkRecord, Span, Timeline

__all__ = ["Report", "Timeline", "Span", "ChunkRecord", "STAGES", "to_chrome", "save_chrome", "load_spans"]
