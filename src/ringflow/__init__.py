"""ringflow: stream data through a GPU with every stage overlapped and every buffer owned by
exactly one stage at a time.

>>> import ringflow as rf
>>> dev = rf.device("sim")            # or "auto" / "cuda:0"

The public surface is exactly :data:`__all__`; every other module is private (``_``-prefixed)
and may change without notice.
"""

try:
    from ._device import cuda_available, device
    from ._device.protocol import Device
    from . import _host as host
    from ._errors import DeviceError, HazardError, LaunchError, OutOfMemoryError, RingflowError, StageError
    from ._kernel import Kernel
    from ._pipeline import ChunkState, MapJob, Pipeline, PipelineStats, SlotCounts, SlotState, stream_map
    from ._pipeline.delivered import DeviceResult
    from ._pipeline.warm import drop_warm_pipelines
    from ._pipeline.whole_array import stream_map_report
    from ._ray import RayMapper  # imports no Ray: Ray constructs and calls it
    from ._trace.report import Report
    from ._version import __version__
except KeyboardInterrupt:
    # ``python -m ringflow`` imports this package before ringflow.__main__ can catch anything,
    # and the command never shows a traceback: it exits as for any Ctrl-C (_ringflow_entry).
    # Anything else that imports ringflow gets its KeyboardInterrupt.
    import sys as _sys

    if _sys.argv[:1] == ["-m"]:  # (set while ``-m`` locates its module)
        from _ringflow_entry import exit_if_starting

        exit_if_starting()
    raise

__all__ = [
    "Pipeline", "DeviceResult", "stream_map", "stream_map_report", "MapJob", "Kernel", "drop_warm_pipelines",
    "RayMapper",
    "device", "cuda_available", "Device", "host",
    "Report", "PipelineStats", "SlotCounts", "ChunkState", "SlotState",
    "RingflowError", "StageError", "HazardError", "DeviceError", "LaunchError", "OutOfMemoryError",
    "__version__",
]
