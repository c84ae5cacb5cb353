"""The real GPU backend, on NVIDIA's cuda.core (>= 1.2), with cuda.bindings only for calls
cuda.core lacks: byte-range copies and fills (cuMemcpyAsync, cuMemsetD8Async), host
registration (cuMemHostRegister/Unregister), the pool's release threshold
(cuMemPoolSetAttribute), the stream-priority range and total memory; the doctor also uses
cuMemcpy (synchronous pageable copies) and cuDriverGetVersion.

Importing this package needs neither cuda.core nor a driver: they are imported on first use,
and :func:`probe` says whether a GPU is usable here.
"""

from __future__ import annotations

from .arrays import ARRAY_KINDS, current_stream
from .device import CudaDevice
from .probe import probe

__all__ = ["probe", "CudaDevice", "current_stream", "ARRAY_KINDS"]
