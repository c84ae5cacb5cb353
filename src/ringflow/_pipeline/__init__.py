"""The pipeline: ownership states, rings, admission and backpressure, the scheduler, the API."""

from .api import Pipeline
from .chunk import ChunkFuture
from .config import PipelineConfig, SlotCounts
from .job import MapJob
from .scheduler import GUARDS
from .states import ChunkState, IllegalTransition, RingKind, SlotState
from .stats import PipelineStats
from .whole_array import stream_map

__all__ = ["Pipeline", "stream_map", "MapJob", "ChunkFuture", "PipelineConfig", "SlotCounts", "GUARDS", "ChunkState",
           "SlotState", "RingKind", "IllegalTransition", "PipelineStats"]
