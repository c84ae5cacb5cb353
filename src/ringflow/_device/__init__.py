"""Devices: the real GPU through NVIDIA's cuda.core, or the simulated one.

``ringflow.device("auto")`` gives cuda:0 when a GPU is usable and the simulated H200
otherwise (with a warning saying why); ``"cuda:N"`` insists on a GPU; ``"sim"`` builds the
simulator from a named profile. ``ringflow.device()`` (or ``None``) reads the spec from the
``RINGFLOW_DEVICE`` environment variable, ``"auto"`` when it is unset.

Messages go to the ``"ringflow"`` logger, which has only a NullHandler: an application that
configures logging sees them, one that does not sees nothing.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import warnings
from typing import Any

from .._errors import RingflowError
from .protocol import (ArrayArg, Buffer, BufferSlice, Capabilities, Device, DeviceBuffer, Event, HostBuffer,
                       HostTask, LiveCounts, Stream, WorkerPool)

__all__ = ["device", "cuda_available", "parse_spec", "Device", "Stream", "Event", "Buffer", "HostBuffer",
           "DeviceBuffer", "BufferSlice", "ArrayArg", "Capabilities", "LiveCounts", "HostTask", "WorkerPool",
           "DeviceUnavailableError", "SimulatedFallbackWarning", "ENV_VAR"]

_package_logger = logging.getLogger("ringflow")
if not any(isinstance(h, logging.NullHandler) for h in _package_logger.handlers):
    _package_logger.addHandler(logging.NullHandler())
logger = logging.getLogger(__name__)

ENV_VAR = "RINGFLOW_DEVICE"
_CUDA_SPEC = re.compile(r"cuda(?::(.*))?", re.DOTALL)
_FORMS = "use 'auto', 'cuda', 'cuda:N' (N = GPU index 0, 1, ...) or 'sim'"
SIM_OPTIONS = ("profile", "seed", "chaos", "checked")
CUDA_OPTIONS = ("array",)

_fallback_lock = threading.Lock()
_fallback_warned = False


class DeviceUnavailableError(RingflowError, RuntimeError):
    """The device asked for cannot be used on this machine (no driver, no cuda.core, no GPU).

    A :class:`RuntimeError` too, so ``except RuntimeError`` keeps working."""


class SimulatedFallbackWarning(RuntimeWarning):
    """``device("auto")`` found no usable GPU and returned the simulated one."""


def cuda_available() -> tuple[bool, str]:
    """(usable, reason): whether cuda.core imports and sees at least one GPU. Never raises."""
    try:
        from .cuda import probe
    except Exception as exc:  # noqa: BLE001 - any import failure means no CUDA here
        return False, f"the CUDA backend did not import ({type(exc).__name__}: {exc})"
    return probe()


def _gpu_count() -> int:
    """How many CUDA GPUs the driver sees (0 when CUDA is not usable here)."""
    try:
        from .cuda.probe import gpu_count
    except Exception:  # noqa: BLE001 - no CUDA backend, no GPUs
        return 0
    return gpu_count()


def parse_spec(spec: "str | None" = None) -> tuple[str, "int | None"]:
    """Check a device spec's spelling without touching any device.

    Args:
        spec: ``"auto"``, ``"sim"``, ``"cuda"`` or ``"cuda:N"``; None reads the
            ``RINGFLOW_DEVICE`` environment variable (``"auto"`` when unset or empty).

    Returns:
        ``(kind, index)``: kind is ``"auto"``, ``"sim"`` or ``"cuda"``; index is the GPU index
        for ``"cuda:N"`` (0 for plain ``"cuda"``) and None otherwise.

    Raises:
        TypeError: ``spec`` is not a string or None.
        ValueError: ``spec`` is none of the accepted forms (the message names them).
    """
    where = "the spec argument of ringflow.device"
    if spec is None:
        spec = os.environ.get(ENV_VAR, "").strip() or "auto"
        where = f"from the {ENV_VAR} environment variable"
    if not isinstance(spec, str):
        raise TypeError(f"ringflow.device(spec): spec must be a string such as 'auto', 'cuda:0' or 'sim', "
                        f"got {type(spec).__name__} {spec!r}")
    if spec in ("auto", "sim"):
        return spec, None
    m = _CUDA_SPEC.fullmatch(spec)
    if m:
        index = m.group(1)
        if index is None:
            return "cuda", 0
        if index.isascii() and index.isdigit():
            return "cuda", int(index)
        raise ValueError(f"unknown device {spec!r} ({where}): the GPU index after 'cuda:' must be a whole "
                         f"number >= 0, got {index!r}; {_FORMS}")
    if spec.startswith("sim"):
        raise ValueError(f"unknown device {spec!r} ({where}): 'sim' takes no suffix; pass its options as "
                         f"keywords, e.g. device('sim', profile='h200-pcie5'); {_FORMS}")
    empty = ", an empty string" if not spec.strip() else ""
    raise ValueError(f"unknown device {spec!r} ({where}{empty}); {_FORMS}")


def _check_options(kind: str, options: dict, accepted: tuple[str, ...]) -> None:
    bad = sorted(set(options) - set(accepted))
    if bad:
        names = ", ".join(repr(b) for b in bad)
        raise TypeError(f"ringflow.device({kind!r}) got unexpected keyword argument(s) {names}; "
                        f"it accepts {', '.join(accepted)}")


def _warn_fallback(reason: str) -> None:
    global _fallback_warned
    message = (f"ringflow.device('auto'): no usable CUDA GPU ({reason}); using the simulated GPU, whose times "
               f"are virtual. To choose it without this warning, call ringflow.device('sim') or set "
               f"{ENV_VAR}=sim")
    logger.info("%s", message)
    with _fallback_lock:
        if _fallback_warned:
            return
        _fallback_warned = True
    warnings.warn(message, SimulatedFallbackWarning, stacklevel=_caller_stacklevel())


def _caller_stacklevel() -> int:
    """The warnings stacklevel of the first frame outside ringflow, so the warning points at the
    user's line whether they called device() or Pipeline/stream_map."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "ringflow":
        frame = frame.f_back
        level += 1
    return level


def device(spec: "str | None" = None, **options: Any) -> Device:
    """Make a device.

    Args:
        spec: ``"auto"`` (cuda:0 when a GPU is usable, else the simulated GPU with a
            :class:`SimulatedFallbackWarning` once per process and a log record on the
            ``"ringflow"`` logger each time), ``"cuda"`` / ``"cuda:N"`` (GPU N, counted from 0),
            or ``"sim"``. None (the default) reads the ``RINGFLOW_DEVICE`` environment variable,
            ``"auto"`` when it is unset.
        **options: for ``"sim"``: ``profile`` (default ``"h200-pcie5"``), ``seed``, ``chaos``,
            ``checked``; for ``"cuda"``: ``array`` (``"cupy"``, ``"torch"`` or ``"dlpack"``);
            ``"auto"`` takes both sets and passes each backend its own.

    Returns:
        A :class:`~ringflow.Device`.

    Raises:
        TypeError: ``spec`` is not a string, or an option is not one the backend accepts.
        ValueError: ``spec`` is not an accepted form, or ``cuda:N`` names a GPU this machine
            does not have (the message gives the count).
        DeviceUnavailableError: ``cuda``/``cuda:N`` was asked for and CUDA is not usable here
            (also a RuntimeError).
    """
    kind, index = parse_spec(spec)
    if kind == "sim":
        _check_options("sim", options, SIM_OPTIONS)
        from .sim import SimDevice

        return SimDevice(**options)
    if kind == "auto":
        _check_options("auto", options, SIM_OPTIONS + CUDA_OPTIONS)
        ok, reason = cuda_available()
        if ok:
            from .cuda import CudaDevice

            return CudaDevice(0, **{k: v for k, v in options.items() if k in CUDA_OPTIONS})
        _warn_fallback(reason)
        from .sim import SimDevice

        return SimDevice(**{k: v for k, v in options.items() if k in SIM_OPTIONS})
    _check_options("cuda", options, CUDA_OPTIONS)
    name = spec if isinstance(spec, str) else f"cuda:{index}"
    ok, reason = cuda_available()
    if not ok:
        raise DeviceUnavailableError(f"device {name!r} is not usable: {reason}. "
                                     f"Use device('sim') or device('auto') instead")
    count = _gpu_count()
    if index >= count:
        raise ValueError(f"device {name!r}: there is no GPU {index}; this machine has {count} CUDA GPU(s), "
                         f"so use cuda:0..cuda:{count - 1}")
    from .cuda import CudaDevice

    return CudaDevice(index, **options)
