"""Devices: the real GPU through NVIDIA's cuda.core, or the simulated one.

``ringflow.device("auto")`` gives cuda:0 when a GPU is usable and the simulated H200
otherwise (with a warning saying why); ``"cuda:N"`` insists on a GPU; ``"sim"`` builds the
simulator from a named profile, and ``"sim:N"`` is the process's N-th simulated GPU (the same
device for the same name, as ``"cuda:N"`` is the same GPU; all of them GPUs of one host, sharing
its host copy rate). ``ringflow.device()`` (or
``None``) reads the spec from the ``RINGFLOW_DEVICE`` environment variable, ``"auto"`` when it
is unset. :func:`devices` turns a list of devices or specs, or ``"cuda:all"``, into the devices
of one job spread over several GPUs.

Messages go to the ``"ringflow"`` logger, which has only a NullHandler: an application that
configures logging sees them, one that does not sees nothing.
"""

from __future__ import annotations

import inspect
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

__all__ = ["device", "devices", "device_list", "device_label", "cuda_available", "parse_spec", "Device", "Stream", "Event", "Buffer", "HostBuffer",
           "DeviceBuffer", "BufferSlice", "ArrayArg", "Capabilities", "LiveCounts", "HostTask", "WorkerPool",
           "DeviceUnavailableError", "SimulatedFallbackWarning", "ENV_VAR"]

_package_logger = logging.getLogger("ringflow")
if not any(isinstance(h, logging.NullHandler) for h in _package_logger.handlers):
    _package_logger.addHandler(logging.NullHandler())
logger = logging.getLogger(__name__)

ENV_VAR = "RINGFLOW_DEVICE"
_CUDA_SPEC = re.compile(r"cuda(?::(.*))?", re.DOTALL)
_SIM_SPEC = re.compile(r"sim:(.*)", re.DOTALL)
_FORMS = "use 'auto', 'cuda', 'cuda:N' (N = GPU index 0, 1, ...), 'sim' or 'sim:N' (the N-th simulated GPU)"
ALL_GPUS = "cuda:all"
SIM_OPTIONS = ("profile", "seed", "chaos", "checked")
CUDA_OPTIONS = ("array",)
ARRAY_KINDS = ("auto", "cupy", "torch", "dlpack")  # a CUDA device's ``array=`` (see cuda/arrays.py)

_fallback_lock = threading.Lock()
_fallback_warned = False

# "sim:N" names one simulated GPU for the life of the process, as "cuda:N" names one GPU: a job
# over ["sim:0", "sim:1"] and a later call naming "sim:0" meet the same device (its warm engines,
# its clock). Each entry is (device, the options it was made with). They are GPUs of one host:
# each has a link of its own, and all share one SimHost (the host's copy rate and pinned memory).
_named_sims: dict[int, tuple[Any, dict]] = {}
_named_host: Any = None
_named_lock = threading.Lock()


def _forget_named_in_child() -> None:
    """After fork(), in the child: the named simulated GPUs are the parent's (each refuses the
    child's calls), so the child's names start again with devices of its own; the registry's
    lock may have been held by a parent's thread that is not in the child."""
    global _named_host, _named_lock
    _named_sims.clear()
    _named_host = None
    _named_lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork()
    os.register_at_fork(after_in_child=_forget_named_in_child)


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
        spec: ``"auto"``, ``"sim"``, ``"sim:N"``, ``"cuda"`` or ``"cuda:N"``, spaces around it
            dropped; None reads the ``RINGFLOW_DEVICE`` environment variable (``"auto"`` when
            unset, empty or only spaces).

    Returns:
        ``(kind, index)``: kind is ``"auto"``, ``"sim"`` or ``"cuda"``; index is the GPU index
        for ``"cuda:N"`` (0 for plain ``"cuda"``), N for ``"sim:N"``, and None otherwise.

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
    # spaces around a spec are dropped wherever it comes from: the environment variable always
    # dropped them, and an argument or --device that refused what the variable takes is one
    # spec with two answers
    given, spec = spec, spec.strip()
    if spec in ("auto", "sim"):
        return spec, None
    if spec == ALL_GPUS:
        raise ValueError(f"unknown device {spec!r} ({where}): 'cuda:all' names every GPU, and a device is one; "
                         f"pass 'cuda:all' as the device= of stream_map or MapJob, which spread a job over "
                         f"several GPUs; {_FORMS}")
    m = _CUDA_SPEC.fullmatch(spec)
    if m:
        index = m.group(1)
        if index is None:
            return "cuda", 0
        if index.isascii() and index.isdigit():
            return "cuda", int(index)
        raise ValueError(f"unknown device {spec!r} ({where}): the GPU index after 'cuda:' must be a whole "
                         f"number >= 0, got {index!r}; {_FORMS}")
    m = _SIM_SPEC.fullmatch(spec)
    if m:
        index = m.group(1)
        if index.isascii() and index.isdigit():
            return "sim", int(index)
        raise ValueError(f"unknown device {spec!r} ({where}): the number after 'sim:' must be a whole number "
                         f">= 0, got {index!r}; pass the simulator's options as keywords, e.g. "
                         f"device('sim', profile='h200-pcie5'); {_FORMS}")
    if spec.startswith("sim"):
        raise ValueError(f"unknown device {spec!r} ({where}): 'sim' takes no suffix but ':N'; pass its options as "
                         f"keywords, e.g. device('sim', profile='h200-pcie5'); {_FORMS}")
    empty = ", an empty string" if not spec else ""
    raise ValueError(f"unknown device {given!r} ({where}{empty}); {_FORMS}")


def _check_options(kind: str, options: dict, accepted: tuple[str, ...]) -> None:
    bad = sorted(set(options) - set(accepted))
    if bad:
        names = ", ".join(repr(b) for b in bad)
        raise TypeError(f"ringflow.device({kind!r}) got unexpected keyword argument(s) {names}; "
                        f"it accepts {', '.join(accepted)}")


def _warn_fallback(reason: str) -> None:
    global _fallback_warned
    message = (f"ringflow.device('auto'): no usable CUDA GPU ({reason}); using the simulated GPU, whose times "
               f"are virtual. To choose it without this warning, call ringflow.device('sim'), or "
               f"ringflow.device() with {ENV_VAR}=sim set")
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
            ``"sim"`` (a new simulated GPU, independent of every other), or ``"sim:N"`` (the
            process's N-th simulated GPU: made on first use, the same device for every later
            ``"sim:N"``; a closed one is replaced by a new one; the ``"sim:N"`` devices are GPUs of
            one host and share its host copy rate). Spaces around the spec are dropped. None
            (the default) reads the ``RINGFLOW_DEVICE`` environment variable, ``"auto"`` when it
            is unset.
        **options: for ``"sim"``: ``profile`` (default ``"h200-pcie5"``), ``seed``, ``chaos``,
            ``checked``; for ``"cuda"``: ``array`` (``"cupy"``, ``"torch"`` or ``"dlpack"``);
            ``"auto"`` takes both sets and passes each backend its own.

    Returns:
        A :class:`~ringflow.Device`.

    Raises:
        TypeError: ``spec`` is not a string, or an option is not one the backend accepts.
        ValueError: ``spec`` is not an accepted form, ``cuda:N`` names a GPU this machine
            does not have (the message gives the count), ``sim:N`` exists already with other
            options (a named simulated GPU's options are fixed when it is made), or an option's
            value is out of range (a negative ``seed``, an unknown ``profile``).
        DeviceUnavailableError: ``cuda``/``cuda:N`` was asked for and CUDA is not usable here
            (also a RuntimeError).
    """
    kind, index = parse_spec(spec)
    if kind == "sim":
        _check_options("sim", options, SIM_OPTIONS)
        if index is not None:
            return _named_sim(index, options)
        from .sim import SimDevice

        return SimDevice(**options)
    if kind == "auto":
        _check_options("auto", options, SIM_OPTIONS + CUDA_OPTIONS)
        ok, reason = cuda_available()
        if ok:
            from .cuda import CudaDevice

            return CudaDevice(0, **{k: v for k, v in options.items() if k in CUDA_OPTIONS})
        # checked here as the GPU would check it: a script that falls back must not pass here
        # what a GPU machine refuses
        if "array" in options and options["array"] not in ARRAY_KINDS:
            raise ValueError(f"unknown array type {options['array']!r} (array=); choose one of "
                             f"{', '.join(map(repr, ARRAY_KINDS))}")
        _warn_fallback(reason)
        from .sim import SimDevice

        return SimDevice(**{k: v for k, v in options.items() if k in SIM_OPTIONS})
    _check_options("cuda", options, CUDA_OPTIONS)
    name = spec.strip() if isinstance(spec, str) else f"cuda:{index}"
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


def _named_sim(index: int, options: dict) -> Device:
    """The process's ``index``-th simulated GPU, made with ``options`` on first use, on the host
    the process's named simulated GPUs share."""
    global _named_host
    from .sim import SimDevice
    from .sim.host import SimHost

    with _named_lock:
        entry = _named_sims.get(index)
        if entry is not None and not entry[0].closed:
            dev, made_with = entry
            # compared with the profile it was made with, not a profile file's contents now
            made = {**_sim_settings({k: v for k, v in made_with.items() if k != "profile"}), "profile": dev.profile}
            if options and _sim_settings(options) != made:
                note = ""
                if isinstance(options.get("profile"), str) and made_with.get("profile") == options["profile"]:
                    note = f" (the profile {dev.profile.name!r} that file held then; it holds another now)"
                raise ValueError(f"device 'sim:{index}' exists already, made with options {made_with or 'none'}{note}; "
                                 f"a named simulated GPU keeps the options it was made with: pass none (or the same), "
                                 f"or make an independent one with device('sim', **options)")
            return dev
        if _named_host is None:
            _named_host = SimHost()
        dev = SimDevice(**options, host=_named_host)
        _named_sims[index] = (dev, dict(options))
        return dev


def _sim_settings(options: dict) -> dict:
    """What a simulated GPU made with ``options`` is made with: every option, a default where
    ``options`` has none, and the profile as the :class:`~.hardware.HardwareProfile` it names
    (so a profile's name and the profile itself compare equal).

    Raises:
        ValueError, TypeError: an option no simulated GPU takes (as :class:`~.sim.SimDevice`
            refuses it): ``profile`` names no profile, ``seed`` is not an int >= 0, ``chaos``
            or ``checked`` is not a bool.
    """
    from .hardware import get_profile
    from .sim import SimDevice
    from .sim.device import check_sim_flags

    defaults = inspect.signature(SimDevice.__init__).parameters
    settings = {name: options[name] if name in options else defaults[name].default for name in SIM_OPTIONS}
    settings["seed"], settings["chaos"], settings["checked"] = check_sim_flags(
        settings["seed"], settings["chaos"], settings["checked"])
    settings["profile"] = get_profile(settings["profile"])
    return settings


def device_label(dev: Any) -> str:
    """A short name for ``dev`` in messages and traces: ``"cuda:N"``, ``"sim:N"`` for a named
    simulated GPU, else its repr."""
    if getattr(dev, "backend", None) == "cuda" and isinstance(getattr(dev, "index", None), int):
        return f"cuda:{dev.index}"
    with _named_lock:
        for index, (named, _) in _named_sims.items():
            if named is dev:
                return f"sim:{index}"
    return repr(dev)


def named_device(dev: Any) -> bool:
    """Whether ``dev`` is a device the process keeps for every spec naming it (``"sim:N"``)."""
    with _named_lock:
        return any(named is dev for named, _ in _named_sims.values())


def _is_many(value: Any) -> bool:
    return isinstance(value, (list, tuple)) or (isinstance(value, str) and value.strip() == ALL_GPUS)


def device_list(value: Any, *, name: str = "device") -> "list[Device] | None":
    """The devices a job's ``device=`` argument names when it names a list of them (a list or
    tuple, ``"cuda:all"``, or None with ``RINGFLOW_DEVICE=cuda:all``); None when it names one
    device (a :class:`Device`, a single spec, or None otherwise).

    Raises:
        TypeError: ``value`` is none of these.
        others: as :func:`devices`.
    """
    if value is None:
        env = os.environ.get(ENV_VAR, "").strip()
        return devices(env, name=f"{name} (from the {ENV_VAR} environment variable)") if env == ALL_GPUS else None
    if _is_many(value):
        return devices(value, name=name)
    if not isinstance(value, (str, Device)):
        raise TypeError(f"{name} must be a device, a device spec such as 'cuda:0' or 'sim', a list or tuple of "
                        f"them, or 'cuda:all'; got {type(value).__name__} {value!r}")
    return None


def devices(spec: Any, *, name: str = "device") -> list[Device]:
    """The devices of one job spread over several GPUs.

    Args:
        spec: ``"cuda:all"`` (every GPU this machine has, in index order), or a list or tuple
            whose items are each a :class:`Device` or a spec naming one device (``"cuda:N"``,
            ``"sim:N"``, ``"sim"``); all of one backend, none twice.
        name: the argument's name in error messages.

    Returns:
        The devices, in the order given.

    Raises:
        TypeError: ``spec`` is not a list, tuple or ``"cuda:all"``, or an item is neither a
            device nor a string.
        ValueError: an empty list, an item that is no device spec (``"auto"`` too: name each
            GPU), the same device twice, or simulated and real GPUs mixed.
        RuntimeError: an item is a device closed already (named by its place).
        DeviceUnavailableError: ``"cuda:all"`` or ``"cuda:N"`` where CUDA is not usable.
    """
    if isinstance(spec, str) and spec.strip() == ALL_GPUS:
        ok, reason = cuda_available()
        if not ok:
            raise DeviceUnavailableError(f"{name}='cuda:all' is not usable: {reason}. Use a list of simulated GPUs "
                                         f"such as ['sim:0', 'sim:1'] instead")
        count = _gpu_count()
        if count < 1:
            raise DeviceUnavailableError(f"{name}='cuda:all': the driver sees no GPU")
        from .cuda import CudaDevice

        return [CudaDevice(i) for i in range(count)]
    if not isinstance(spec, (list, tuple)):
        raise TypeError(f"{name} must be a device, a device spec, a list or tuple of them, or 'cuda:all'; "
                        f"got {type(spec).__name__} {spec!r}")
    if not spec:
        raise ValueError(f"{name} is an empty {type(spec).__name__}: it names no device; pass at least one, "
                         f"e.g. ['cuda:0', 'cuda:1'] or ['sim:0', 'sim:1']")
    out: list[Device] = []
    for i, item in enumerate(spec):
        if isinstance(item, Device):
            dev = item
        elif isinstance(item, str):
            if item.strip() in ("auto", ALL_GPUS):
                raise ValueError(f"{name}[{i}] is {item!r}; in a list name each device: 'cuda:N' or 'sim:N'")
            try:
                dev = device(item)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{name}[{i}]: {exc}") from None
        else:
            raise TypeError(f"{name}[{i}] must be a device or a device spec such as 'cuda:1' or 'sim:1', "
                            f"got {type(item).__name__} {item!r}")
        if getattr(dev, "closed", False):  # (a device of another make may not say)
            # refused before any device's work starts: a shard on an open device would run to its end
            # first, then the call raise this device's own words, which name no item
            raise RuntimeError(f"{name}[{i}] ({device_label(dev)}) is closed, and a closed device runs nothing: "
                               f"pass an open device in its place (a new rf.device('sim'), or 'cuda:N' / 'sim:N')")
        for j, other in enumerate(out):
            if other is dev or (dev.backend == "cuda" and other.backend == "cuda"
                                and getattr(dev, "index", None) == getattr(other, "index", -1)):
                raise ValueError(f"{name}[{j}] and {name}[{i}] are the same device ({device_label(dev)}); "
                                 f"name each device once")
        if out and dev.backend != out[0].backend:
            raise ValueError(f"{name} mixes a {out[0].backend} device ({name}[0]) with a {dev.backend} one "
                             f"({name}[{i}]): use devices of one kind, all 'cuda:N' or all simulated")
        out.append(dev)
    return out
