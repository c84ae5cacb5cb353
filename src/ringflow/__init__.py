"""ringflow: stream data through a GPU with every stage overlapped and every buffer owned by
exactly one stage at a time.

>>> import ringflow as rf
>>> dev = rf.device("sim")            # or "auto" / "cuda:0"
"""

from . import device  # the package is callable: rf.device("sim")
from .device import cuda_available
from .errors import DeviceError, HazardError, LaunchError, RingflowError, StageError
from .pipeline import ChunkState, MapJob, Pipeline, PipelineStats, SlotCounts, SlotState, stream_map
from .pipeline.warm import drop_warm_pipelines

__version__ = "0.1.0"
__all__ = ["Pipeline", "stream_map", "MapJob", "drop_warm_pipelines", "SlotCounts", "PipelineStats", "ChunkState", "SlotState", "device", "cuda_available", "HazardError", "StageError", "DeviceError", "LaunchError", "RingflowError"]
