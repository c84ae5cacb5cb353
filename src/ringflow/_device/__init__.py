"""Devices: the real GPU through NVIDIA's cuda.core, or the simulated one.

``ringflow.device("auto")`` gives cuda:0 when a GPU is usable and the simulated H200
otherwise; ``"cuda:N"`` insists on a GPU; ``"sim"`` builds the simulator from a named profile.
"""

from __future__ import annotations

import re

from .protocol import (ArrayArg, Buffer, BufferSlice, Capabilities, Device, DeviceBuffer, Event, HostBuffer,
                       HostTask, LiveCounts, Stream, WorkerPool)

__all__ = ["device", "cuda_available", "Device", "Stream", "Event", "Buffer", "HostBuffer", "DeviceBuffer",
           "BufferSlice", "ArrayArg", "Capabilities", "LiveCounts", "HostTask", "WorkerPool"]

_CUDA_SPEC = re.compile(r"^cuda(?::(\d+))?$")


def cuda_available() -> tuple[bool, str]:
    """(usable, reason): whether cuda.core imports and sees at least one GPU."""
    try:
        from .cuda import probe
    except Exception as exc:  # noqa: BLE001 - any import failure means no CUDA here
        return False, f"the CUDA backend did not import ({type(exc).__name__}: {exc})"
    return probe()


def device(spec: str = "auto", **options) -> Device:
    """Make a device.

    ``spec`` is ``"auto"``, ``"cuda"``, ``"cuda:N"`` or ``"sim"``. Options for ``"sim"``:
    ``profile`` (default ``"h200-pcie5"``), ``seed``, ``chaos``, ``checked``; for ``"cuda"``:
    ``array`` (``"cupy"``, ``"torch"`` or ``"dlpack"``).
    """
    if not isinstance(spec, str):
        raise TypeError(f"device spec must be a string such as 'auto', 'cuda:0' or 'sim', got {type(spec).__name__}")
    if spec == "sim":
        from .sim import SimDevice

        return SimDevice(**options)
    if spec == "auto":
        ok, _ = cuda_available()
        if ok:
            from .cuda import CudaDevice

            return CudaDevice(0, **{k: v for k, v in options.items() if k == "array"})
        from .sim import SimDevice

        return SimDevice(**{k: v for k, v in options.items() if k != "array"})
    m = _CUDA_SPEC.match(spec)
    if m:
        ok, reason = cuda_available()
        if not ok:
            raise RuntimeError(f"device {spec!r} is not usable: {reason}. Use device('sim') or device('auto') instead")
        from .cuda import CudaDevice

        return CudaDevice(int(m.group(1) or 0), **options)
    raise ValueError(f"unknown device {spec!r}; use 'auto', 'cuda', 'cuda:N' (N = GPU index) or 'sim'")
