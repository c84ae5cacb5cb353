"""``ringflow doctor``: what this machine's GPU can do, measured.

:func:`collect` returns a JSON-ready report: the device, the software versions, the device's
capabilities and, on a real GPU, measured copy bandwidths (pinned H2D, D2H and both at once
on 256 MiB, pageable vs pinned, pinned by copy size) and whether a copy and a kernel on two
streams really overlap. The copy rates are compared with the PCIe link the GPU sits on, read
from sysfs (:func:`read_pcie_link`). Without a usable GPU it says why and reports the
simulated GPU's profile, and the link that profile models, instead. :func:`render` turns a
report into rich tables; :func:`doctor_command` is the CLI entry.

With ``--save`` it also measures launch, host copy and registration costs and the host's time
per chunk of ringflow's engines (:mod:`ringflow._chunk_host_cost`), and writes the GPU's
hardware profile (:func:`profile_from_report`), by default into the per-GPU cache that a real
GPU's ``Device.hardware`` reads; :func:`calibrate` does the same without a report.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import json
import math
import os
import platform
import re
import shlex
import sys
from typing import Any, Callable, Iterator

from ._files import controls_escaped, write_whole
from ._jsontext import plain

# Packet headers and flow control take roughly 10-15% of a PCIe link, so a healthy pinned copy
# reaches a little under the link's rate; well below these shares, bandwidth is lost elsewhere
# (a shared switch, the IOMMU, a NUMA-remote buffer). Both directions at once contend for the
# same root complex, hence the lower bar for the sum.
LINK_SHARE_OK = {"one_direction": 0.75, "both_directions": 0.65}
OVERLAP_OK = 0.8  # copy/kernel overlap fraction above which the copy engines and SMs run side by side
SYSFS = "/sys"  # where the PCIe link is read from

_PACKAGES = ("numpy", "cuda-core", "cuda-bindings", "cupy-cuda13x", "cupy-cuda12x", "cupy", "torch", "rich")


def versions() -> dict[str, Any]:
    """Python, package and driver versions; a package that is missing is left out."""
    out: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform()}
    for name in _PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    try:
        from ringflow import __version__

        out["ringflow"] = __version__
    except Exception:  # noqa: BLE001 - a partial checkout still gets a report
        pass
    out.update(_driver_versions())
    return out


def _driver_versions() -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        from cuda.bindings import driver

        err, v = driver.cuDriverGetVersion()
        if int(err) == 0:
            out["cuda_driver_api"] = f"{v // 1000}.{v % 1000 // 10}"
    except Exception:  # noqa: BLE001 - no driver here
        return out
    try:
        from cuda.core import system

        out["driver"] = ".".join(map(str, system.get_kernel_mode_driver_version()))
    except Exception:  # noqa: BLE001 - NVML missing
        pass
    try:
        from cuda.bindings import runtime

        err, v = runtime.cudaRuntimeGetVersion()
        if int(err) == 0:
            out["cuda_runtime"] = f"{v // 1000}.{v % 1000 // 10}"
    except Exception:  # noqa: BLE001 - libcudart missing
        pass
    try:
        from cuda.bindings import nvrtc

        err, major, minor = nvrtc.nvrtcVersion()
        if int(err) == 0:
            out["nvrtc"] = f"{major}.{minor}"
    except Exception:  # noqa: BLE001
        pass
    return out


# -- the PCIe link, from sysfs ----------------------------------------------------------------------------------
# Line encoding per transfer rate (GT/s per lane): 8b/10b up to Gen2, 128b/130b for Gen3-5,
# FLIT mode (242 of 256 bytes carry data) for Gen6.
_PCIE_GENERATIONS = {2.5: (1, 8 / 10), 5.0: (2, 8 / 10), 8.0: (3, 128 / 130), 16.0: (4, 128 / 130),
                     32.0: (5, 128 / 130), 64.0: (6, 242 / 256)}
_SPEED = re.compile(r"\s*(\d+(?:\.\d+)?)\s*GT/s\b.*", re.DOTALL)
_WIDTH = re.compile(r"\s*x?(\d+)\s*")
_BUS_ID = re.compile(r"\s*(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])\s*")


def link_rate(gt_per_s: float, width: int) -> dict[str, Any]:
    """The theoretical rate of a PCIe link, one direction.

    Args:
        gt_per_s: transfers per second per lane, in GT/s (e.g. 32.0 for Gen5).
        width: lanes (e.g. 16).

    Returns:
        ``{"GTps", "width", "generation", "GBps"}``: GBps = GT/s x lanes x encoding / 8, in
        GB/s (1e9 bytes/s) per direction; generation is None for a rate no generation uses.
    """
    generation, encoding = _PCIE_GENERATIONS.get(float(gt_per_s), (None, 128 / 130))
    return {"GTps": float(gt_per_s), "width": int(width), "generation": generation,
            "GBps": gt_per_s * width * encoding / 8}


def parse_link_speed(text: str) -> "float | None":
    """GT/s from a sysfs ``*_link_speed`` file ("32.0 GT/s PCIe", "8 GT/s"); None when the file
    says "Unknown" or anything else that is not a rate PCIe has."""
    from ._device.hardware import PCIE_GTPS_MAX  # (a profile holds no other)

    m = _SPEED.fullmatch(text)
    if not m:
        return None
    value = float(m.group(1))
    return value if 0 < value <= PCIE_GTPS_MAX else None


def parse_link_width(text: str) -> "int | None":
    """Lanes from a sysfs ``*_link_width`` file ("16", "x16"); None for 0 (link down), a width PCIe
    does not have, or garble."""
    from ._device.hardware import PCIE_WIDTHS  # (a profile holds no other)

    m = _WIDTH.fullmatch(text)
    if not m:
        return None
    value = int(m.group(1))
    return value if value in PCIE_WIDTHS else None


def normalise_bus_id(text: str) -> "str | None":
    """A PCI address as sysfs names it, ``dddd:bb:dd.f`` in lower-case hex ("0000:1b:00.0"),
    from the forms CUDA and NVML print ("00000000:1B:00.0", "1b:00.0"); None when it is none."""
    m = _BUS_ID.fullmatch(str(text))
    if not m:
        return None
    domain, bus, dev, fn = m.groups()
    return f"{int(domain or '0', 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{fn}"


def read_pcie_link(bus_id: str, sysfs: str = "/sys") -> dict[str, Any]:
    """The PCIe link of the device at ``bus_id``, read from sysfs; never raises.

    Reads ``<sysfs>/bus/pci/devices/<bus id>/{current,max}_link_{speed,width}``.

    Args:
        bus_id: the device's PCI address in any form :func:`normalise_bus_id` reads.
        sysfs: where sysfs is mounted (a test passes a fake tree).

    Returns:
        ``{"bus_id", "current", "max", "reason"}``: current and max are :func:`link_rate`
        dicts, or None when their files are missing or garbled; reason is None when the
        current link was read, else why it was not.
    """
    out: dict[str, Any] = {"bus_id": bus_id, "current": None, "max": None, "reason": None}
    norm = normalise_bus_id(bus_id)
    if norm is None:
        out["reason"] = f"{bus_id!r} is not a PCI address"
        return out
    out["bus_id"] = norm
    folder = os.path.join(sysfs, "bus", "pci", "devices", norm)
    problems = []
    for which in ("current", "max"):
        values = []
        for what, parse in (("speed", parse_link_speed), ("width", parse_link_width)):
            path = os.path.join(folder, f"{which}_link_{what}")
            try:
                with open(path, encoding="ascii", errors="replace") as fh:
                    text = fh.read(256)
            except OSError as exc:
                problems.append(f"cannot read {path} ({exc.strerror or type(exc).__name__})")
                break
            value = parse(text)
            if value is None:
                problems.append(f"{path} says {text.strip()[:40]!r}, not a link {what}")
                break
            values.append(value)
        if len(values) == 2:
            out[which] = link_rate(*values)
    if out["current"] is None:
        out["reason"] = "; ".join(problems) or "no current link"
    return out


def _bus_id(dev) -> "str | None":
    """The PCI address of a CudaDevice, from cuda.core's device properties."""
    try:
        p = dev._cc.properties
        return f"{int(p.pci_domain_id):04x}:{int(p.pci_bus_id):02x}:{int(p.pci_device_id):02x}.0"
    except Exception:  # noqa: BLE001 - an older cuda.core: ask the driver
        pass
    try:
        from cuda.bindings import driver

        err, text = driver.cuDeviceGetPCIBusId(32, dev.index)
        if int(err) == 0:
            raw = text.decode("ascii", "replace") if isinstance(text, (bytes, bytearray)) else str(text)
            return raw.split("\x00")[0].strip()  # a C buffer: the address, a NUL, then padding
    except Exception:  # noqa: BLE001 - no way to tell: the comparison is skipped
        pass
    return None


def compare_with_link(m: dict[str, Any], link: "dict[str, Any] | None") -> dict[str, Any]:
    """Which link rate the measured copies are compared with.

    The current link is read after the copies; a GPU lowers its link speed when idle, so when
    the measured H2D rate beats the current link's rate the link was faster while copying and
    its maximum is used. Otherwise the current link is what the copies ran on, and a current
    link below its maximum is reported (a slot or riser can cap it).

    Returns:
        ``{"basis": "current" | "max", "rate": link_rate dict, "note": str | None}``, or
        ``{"skipped": reason}`` when no link is known.
    """
    if not link or link.get("current") is None:
        return {"skipped": (link or {}).get("reason") or "no PCIe link information"}
    cur, top = link["current"], link.get("max")
    fastest = max(m["h2d_pinned"]["GBps"], m["d2h_pinned"]["GBps"])
    if top is not None and top["GBps"] > cur["GBps"]:
        if fastest > cur["GBps"]:
            return {"basis": "max", "rate": top, "note": f"the link read {_link_name(cur)} after the copies "
                    f"(idle GPUs lower it); compared with its maximum, {_link_name(top)}"}
        return {"basis": "current", "rate": cur, "note": f"the link runs at {_link_name(cur)}, below its maximum "
                f"{_link_name(top)}: check the slot, riser or BIOS link settings"}
    return {"basis": "current", "rate": cur, "note": None}


def _link_name(r: dict[str, Any]) -> str:
    gen = f"Gen{r['generation']}" if r.get("generation") else f"{r['GTps']:g} GT/s"
    return f"PCIe {gen} x{r['width']} ({r['GBps']:.1f} GB/s per direction)"


def checks(m: dict[str, Any], link: "dict[str, Any] | None") -> list[dict[str, Any]]:
    """The measured copies against the PCIe link, the copy/kernel overlap, and bit-exactness.

    Args:
        m: the measurements (:func:`ringflow._device.cuda.measure.measure`).
        link: :func:`read_pcie_link`'s answer (or None when unknown).

    Returns:
        Rows ``{"what", "measured", "expected", "unit", "ok", "applies", "share"}``: share is
        measured / the link's rate; a copy row ``applies`` only when the link is known, else
        ``expected`` says why it was skipped.
    """
    basis = compare_with_link(m, link)
    rate = basis.get("rate")
    out = []
    for label, key, lanes, bar in (("pinned H2D 256 MiB", "h2d_pinned", 1, LINK_SHARE_OK["one_direction"]),
                                   ("pinned D2H 256 MiB", "d2h_pinned", 1, LINK_SHARE_OK["one_direction"]),
                                   ("pinned H2D+D2H at once (sum)", "duplex_pinned", 2,
                                    LINK_SHARE_OK["both_directions"])):
        got = float(m[key]["GBps"])
        if rate is None:
            out.append({"what": label, "measured": round(got, 1), "expected": f"skipped: {basis['skipped']}",
                        "unit": "GB/s", "ok": None, "applies": False, "share": None})
            continue
        theory = rate["GBps"] * lanes
        share = got / theory
        out.append({"what": label, "measured": round(got, 1),
                    "expected": f">= {bar:.0%} of {theory:.1f} GB/s" + (" (both directions)" if lanes == 2 else ""),
                    "unit": "GB/s", "ok": share >= bar, "applies": True, "share": round(share, 3)})
    frac = float(m["overlap"]["fraction"])
    out.append({"what": "copy/kernel overlap fraction", "measured": round(frac, 2), "expected": f"> {OVERLAP_OK}",
                "unit": "", "ok": frac > OVERLAP_OK, "applies": True, "share": None})
    exact = bool(m["roundtrip_bit_exact"] and m["pageable"]["bit_exact"])
    out.append({"what": "round trips bit-exact", "measured": exact, "expected": True, "unit": "", "ok": exact,
                "applies": True, "share": None})
    return out


# -- rounding ---------------------------------------------------------------------------------------------------
def _sig(x: float, digits: int = 3) -> float:
    """``x`` to ``digits`` significant digits."""
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, digits - 1 - int(math.floor(math.log10(abs(x)))))


def rounded(obj: Any, key: str = "") -> Any:
    """A copy of a report with its figures rounded: GB/s to 1 decimal, times and other floats to
    3 significant digits, fractions and shares to 3 decimals. Ints, strings and bools are kept."""
    if isinstance(obj, dict):
        return {k: v if k == "measured" else rounded(v, str(k)) for k, v in obj.items()}  # checks round their own
    if isinstance(obj, (list, tuple)):
        if "GBps" in key and len(obj) == 2 and all(isinstance(v, (int, float)) for v in obj):
            return [obj[0], round(float(obj[1]), 1)]  # a (size or threads, GB/s) point
        return [rounded(v, key) for v in obj]
    if isinstance(obj, float):
        if "GBps" in key:
            return round(obj, 1)
        if "fraction" in key or key in ("share",):
            return round(obj, 3)
        if key == "seconds":
            return round(obj, 1)
        return _sig(obj, 3)
    return obj


# -- collecting --------------------------------------------------------------------------------------------------
def collect(device_spec: "str | None" = None, *, repeats: int = 10,
            progress: "Callable[[str], None] | None" = None, model: bool = False) -> dict[str, Any]:
    """Everything the doctor knows about a device.

    Args:
        device_spec: ``"auto"``, ``"cuda"``, ``"cuda:N"`` or ``"sim"``; None reads
            ``RINGFLOW_DEVICE`` (``"auto"`` when unset), as :func:`ringflow.device` does.
        repeats: timed repeats of each measurement on a real GPU.
        progress: called with a short description before each slow step (on a real GPU).
        model: on a real GPU, also measure what a hardware profile needs beyond the copies
            (:func:`ringflow._device.cuda.measure.measure_model`, a few seconds more), under
            ``model_measurements``.

    Returns:
        The JSON-ready report, figures rounded (:func:`rounded`). Without a usable GPU (or for
        ``"sim"``) it describes the simulated GPU's profile and says why.

    Raises:
        TypeError, ValueError: ``device_spec`` is not a device spec, or names a GPU this
            machine does not have.
    """
    return rounded(_collect(device_spec, repeats=repeats, progress=progress, model=model))


def _collect(device_spec: "str | None", *, repeats: int, progress: "Callable[[str], None] | None",
             model: bool) -> dict[str, Any]:
    """:func:`collect`'s report before rounding (a profile is built from these figures)."""
    from ._device import _gpu_count, cuda_available, parse_spec

    kind, index = parse_spec(device_spec)
    say = progress or (lambda text: None)
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["ringflow", "doctor", *sys.argv[2:]]) if sys.argv[1:2] == ["doctor"] else None,
        "device_spec": device_spec if device_spec is not None else (f"cuda:{index}" if kind == "cuda" else kind),
        "versions": versions(),
    }
    ok, reason = cuda_available()
    report["cuda_usable"], report["cuda_reason"] = ok, reason
    if kind == "sim" or not ok:
        return _simulated(report, kind, reason)
    index = index or 0
    count = _gpu_count()
    if index >= count:
        raise ValueError(f"device 'cuda:{index}': there is no GPU {index}; this machine has {count} CUDA GPU(s), "
                         f"so use cuda:0..cuda:{count - 1}")
    from ._device.cuda import CudaDevice

    say(f"opening cuda:{index}")
    dev = CudaDevice(index)
    try:
        report.update(_measure_gpu(dev, repeats=repeats, say=say, model=model))
    finally:
        dev.close()
    return report


def _measure_gpu(dev, *, repeats: int, say: Callable[[str], None], model: bool) -> dict[str, Any]:
    """The GPU parts of a report, measured on the open CudaDevice ``dev`` (unrounded)."""
    from ._device.cuda.measure import measure, measure_model
    from ._device.hardware import gpu_driver_version

    out: dict[str, Any] = {}
    caps = dev.capabilities
    out["device"] = {"backend": "cuda", "index": dev.index, "name": dev.name, "array_type": dev.array_type,
                     "driver": gpu_driver_version()}
    out["capabilities"] = caps.as_dict()
    say(f"measuring copy bandwidth and copy/kernel overlap on {dev.name}")
    out["measurements"] = measure(dev, repeats=repeats)
    bus = _bus_id(dev)
    # read right after the copies, while the link is still at the speed they ran at
    out["link"] = read_pcie_link(bus, SYSFS) if bus else {"bus_id": None, "current": None, "max": None,
                                                           "reason": "the GPU's PCI address is unknown"}
    out["link"]["source"] = "sysfs"
    out["link"]["comparison"] = _comparison_summary(out["measurements"], out["link"])
    out["checks"] = checks(out["measurements"], out["link"])
    if model:
        from ._chunk_host_cost import chunk_host_seconds

        say(f"measuring launch, host copy and registration costs on {dev.name}")
        out["model_measurements"] = mm = measure_model(dev, repeats=max(3, repeats // 2))
        say(f"measuring the host's time per chunk of ringflow's engines on {dev.name}")
        per_chunk = chunk_host_seconds(dev, repeats=max(3, repeats // 2))
        mm["staged_chunk_host_s"], mm["direct_chunk_host_s"] = per_chunk["staged"], per_chunk["direct"]
        mm["scheduled_chunk_host_s"] = per_chunk["scheduled"]
        mm["one_side_chunk_host_s"] = per_chunk["one_side"]
    return out


# -- hardware profiles -----------------------------------------------------------------------------------------
def profile_from_report(report: dict[str, Any]):
    """The hardware profile that a real GPU's report (measured with ``model=True``) describes.

    Copy curves from the pinned copies by size, both directions at once from the 256 MiB duplex
    copy, pageable rates from the asynchronous pageable copies, the PCIe link the copies ran on
    (:func:`compare_with_link`'s basis), the counts from the capabilities, and the rest from
    ``model_measurements``.

    Returns:
        a :class:`~ringflow._device.hardware.HardwareProfile` named ``<gpu>-<driver>``, with the
        GPU's name, its driver and the report's date.

    Raises:
        ValueError: the report is not a real GPU's, or lacks the model measurements (measure
            with ``ringflow doctor --save``); ProfileError (a ValueError) when a figure is out of
            range (a failed measurement), naming it.
    """
    from ._device.hardware import HardwareProfile, ProfileError, slug

    dev = report.get("device") or {}
    if dev.get("backend") != "cuda":
        raise ValueError("a hardware profile is measured on a real GPU, and this report is of "
                         f"{dev.get('name') or 'no GPU'}; run ringflow doctor --save where the GPU is")
    m, mm = report.get("measurements"), report.get("model_measurements")
    if not m or not mm:
        raise ValueError("this report lacks the measurements a hardware profile needs; measure with "
                         "ringflow doctor --save")
    basis = compare_with_link(m, report.get("link"))
    rate = basis.get("rate")
    caps = report.get("capabilities") or {}
    name, driver = dev["name"], dev.get("driver")
    try:
        return HardwareProfile(
            name=f"{slug(name)}-{slug(driver or 'unknown-driver')}",
            h2d_curve=tuple((r["bytes"], r["GBps"]) for r in m["pinned_h2d_by_size"]),
            d2h_curve=tuple((r["bytes"], r["GBps"]) for r in m["pinned_d2h_by_size"]),
            duplex_GBps=m["duplex_pinned"]["GBps"],
            pageable_h2d_GBps=m["pageable"]["h2d"]["GBps"],
            pageable_d2h_GBps=m["pageable"]["d2h"]["GBps"],
            device_GBps=mm["device_GBps"],
            kernel_min_s=mm["kernel_min_s"],
            launch_overhead_s=mm["launch_overhead_s"],
            copy_overhead_s=mm["copy_overhead_s"],
            event_overhead_s=mm["event_overhead_s"],
            host_copy_GBps=tuple(tuple(p) for p in mm["host_copy_GBps"]),
            host_task_overhead_s=mm["host_task_overhead_s"],
            register_GBps=mm["register_GBps"],
            register_fresh_GBps=mm["register_fresh_GBps"],
            unregister_GBps=mm["unregister_GBps"],
            first_touch_GBps=tuple(tuple(p) for p in mm["first_touch_GBps"]),
            staging_GBps=mm["staging_GBps"],
            staged_chunk_host_s=mm["staged_chunk_host_s"],
            direct_chunk_host_s=mm["direct_chunk_host_s"],
            scheduled_chunk_host_s=mm["scheduled_chunk_host_s"],
            register_call_s=mm.get("register_call_s"),
            one_side_chunk_host_s=mm.get("one_side_chunk_host_s"),
            async_engine_count=caps["async_engine_count"],
            sm_count=caps["sm_count"],
            compute_capability=tuple(caps["compute_capability"]),
            total_memory=caps["total_memory"],
            pcie_link=None if rate is None else (rate["GTps"], rate["width"]),
            gpu_name=name, driver=driver, measured_at=report.get("date"))
    except ProfileError as exc:
        raise ProfileError(f"the measurements do not make a valid hardware profile ({exc}); run ringflow doctor "
                           "--save again") from None
    except KeyError as exc:
        raise ValueError(f"this report lacks {exc.args[0]!r}, which a hardware profile needs; measure with "
                         "ringflow doctor --save") from None


def calibrate(dev, path: "str | None" = None, *, repeats: int = 6):
    """Measure the open CudaDevice ``dev`` and save its hardware profile (what ``ringflow doctor
    --save`` does, without the report): seconds of copies, launches and host work.

    Args:
        dev: a :class:`~ringflow._device.cuda.CudaDevice`.
        path: where to write the profile; None is the per-GPU cache file
            (:func:`ringflow._device.hardware.cached_profile_path`), its folder made if missing.
        repeats: timed repeats of each copy measurement.

    Returns:
        the profile.

    Raises:
        OSError: the file cannot be written.
    """
    from ._device.hardware import cached_profile_path

    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    report.update(_measure_gpu(dev, repeats=repeats, say=lambda text: None, model=True))
    profile = profile_from_report(report)
    save_to(profile, path if path is not None else cached_profile_path(profile.gpu_name, profile.driver))
    return profile


def save_to(profile, path: str) -> str:
    """Write ``profile`` to ``path``, making the per-GPU cache folder if ``path`` is inside it.

    Raises:
        OSError: the file cannot be written (the error names it).
    """
    from ._device.hardware import cache_dir

    folder = os.path.dirname(os.path.abspath(path))
    if os.path.abspath(folder) == os.path.abspath(cache_dir()):
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, folder) from None
    return profile.save(path)


def _comparison_summary(m: dict[str, Any], link: dict[str, Any]) -> dict[str, Any]:
    basis = compare_with_link(m, link)
    if "skipped" in basis:
        return {"skipped": basis["skipped"]}
    theory = basis["rate"]["GBps"]
    return {"basis": basis["basis"], "GBps_per_direction": theory, "note": basis["note"],
            "h2d_share": m["h2d_pinned"]["GBps"] / theory, "d2h_share": m["d2h_pinned"]["GBps"] / theory,
            "duplex_share": m["duplex_pinned"]["GBps"] / (2 * theory)}


def _simulated(report: dict[str, Any], kind: str, reason: str) -> dict[str, Any]:
    from ._device.hardware import get_profile

    profile = get_profile("h200-pcie5")
    if kind != "sim":
        report["note"] = f"no usable GPU ({reason}); showing the simulated GPU's profile instead"
    report["device"] = {"backend": "sim", "name": f"simulated {profile.name}"}
    report["sim_profile"] = profile.as_dict()
    if profile.pcie_link is not None:
        rate = link_rate(*profile.pcie_link)
        big = profile.h2d_curve[-1][0]
        report["link"] = {"source": f"profile {profile.name}", "current": rate, "max": rate, "reason": None,
                          "comparison": {"basis": "profile", "GBps_per_direction": rate["GBps"], "note": None,
                                         "h2d_share": profile.copy_GBps("h2d", big) / rate["GBps"],
                                         "d2h_share": profile.copy_GBps("d2h", big) / rate["GBps"],
                                         "duplex_share": profile.duplex_GBps / (2 * rate["GBps"])}}
    else:
        report["link"] = {"source": f"profile {profile.name}", "current": None, "max": None,
                          "reason": f"profile {profile.name} models no PCIe link"}
    return report


# -- rendering ---------------------------------------------------------------------------------------------------
def _kv_table(title: str, rows: dict[str, Any]):
    from rich.table import Table

    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    for k, v in rows.items():
        t.add_row(str(k), str(v))
    return t


def _ms(x: float) -> str:
    """Milliseconds to 3 significant digits (0.0123 ms, 1.23 ms, 123 ms)."""
    return f"{_sig(float(x), 3):g} ms"


def _duration(seconds: float) -> str:
    """Seconds in the unit that reads best, 3 significant digits (2 µs, 11 µs, 1.5 ms, 2.3 s)."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(seconds) >= scale:
            return f"{_sig(seconds / scale, 3):g} {unit}"
    return f"{_sig(seconds / 1e-9, 3):g} ns"


def _profile_rows(prof: dict[str, Any]) -> dict[str, Any]:
    """A sim profile's figures with their units; the by-size curves are left out."""
    rows: dict[str, Any] = {}
    for k, v in prof.items():
        if k.endswith("curve") or v is None:
            continue
        if k.endswith("_s") and isinstance(v, (int, float)):
            v = _duration(v)
        elif k.endswith("GBps") and isinstance(v, (int, float)):
            v = f"{v:.1f} GB/s"
        elif k.endswith("GBps") and isinstance(v, (list, tuple)):
            v = ", ".join(f"{n} thread{'s' if n != 1 else ''}: {r:.1f} GB/s" for n, r in v)
        elif k == "total_memory":
            v = f"{v / 1e9:.1f} GB"
        elif k == "pcie_link" and v:
            v = _link_name(link_rate(*v))
        rows[k] = v
    return rows


def _bw(x: dict[str, Any]) -> str:
    return f"{x['GBps']:.1f} GB/s  ({x['GBps_min']:.1f}..{x['GBps_max']:.1f}, n={x['repeats']})"


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _link_rows(link: dict[str, Any]) -> dict[str, Any]:
    rows: dict[str, Any] = {"source": link.get("source", "?")}
    if link.get("bus_id"):
        rows["PCI address"] = link["bus_id"]
    if link.get("current") is None:
        rows["link"] = f"unknown: {link.get('reason')}; the copies are not compared with a link"
        return rows
    rows["current link"] = _link_name(link["current"])
    if link.get("max") and link["max"] != link["current"]:
        rows["maximum link"] = _link_name(link["max"])
    c = link.get("comparison") or {}
    if "skipped" not in c and c:
        rows["pinned H2D / link"] = f"{c['h2d_share']:.0%}"
        rows["pinned D2H / link"] = f"{c['d2h_share']:.0%}"
        rows["H2D+D2H at once / both directions"] = f"{c['duplex_share']:.0%}"
        if c.get("note"):
            rows["note"] = c["note"]
    return rows


def render(report: dict[str, Any]):
    """A rich renderable of a :func:`collect` report."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = []
    dev = report["device"]
    head = f"ringflow doctor — {dev['name']} ({dev['backend']})"
    parts.append(Text(head, style="bold"))
    if report.get("note"):
        parts.append(Text(report["note"], style="yellow"))
    parts.append(_kv_table("Versions", report["versions"]))
    if dev["backend"] == "sim":
        parts.append(_kv_table("Simulated profile", _profile_rows(report["sim_profile"])))
        if report.get("link"):
            parts.append(_kv_table("PCIe link the profile models", _link_rows(report["link"])))
        return Group(*parts)
    parts.append(_kv_table("Capabilities", report["capabilities"]))
    m = report["measurements"]
    parts.append(_kv_table("Copy bandwidth, 256 MiB", {
        "pinned H2D": _bw(m["h2d_pinned"]), "pinned D2H": _bw(m["d2h_pinned"]),
        "pinned H2D + D2H at once (sum)": _bw(m["duplex_pinned"]),
        "pageable H2D (async / sync copy)": _bw(m["pageable"]["h2d"]) + "  /  " + _bw(m["pageable"]["h2d_sync"]),
        "pageable D2H (async / sync copy)": _bw(m["pageable"]["d2h"]) + "  /  " + _bw(m["pageable"]["d2h_sync"])}))
    if report.get("link"):
        parts.append(_kv_table("PCIe link", _link_rows(report["link"])))
    t = Table(title="Pinned copy bandwidth by size (GB/s, median)", title_justify="left")
    t.add_column("size", justify="right")
    t.add_column("H2D", justify="right")
    t.add_column("D2H", justify="right")
    for a, b in zip(m["pinned_h2d_by_size"], m["pinned_d2h_by_size"]):
        t.add_row(_size(a["bytes"]), f"{a['GBps']:.1f}", f"{b['GBps']:.1f}")
    parts.append(t)
    o = m["overlap"]
    parts.append(_kv_table("Copy / kernel overlap on two streams", {
        "copy alone": _ms(o["t_copy_ms"]), "kernel alone": _ms(o["t_kernel_ms"]),
        "both at once": _ms(o["t_both_ms"]), "overlap fraction": f"{o['fraction']:.2f}"}))
    if report.get("model_measurements"):
        parts.append(_kv_table("Launch, host copy, registration and per-chunk host costs (for the hardware profile)",
                               _profile_rows({k: v for k, v in report["model_measurements"].items()
                                              if k not in ("bytes", "threads", "seconds")})))
    c = Table(title="Checks", title_justify="left")
    for col in ("what", "measured", "expected", "result"):
        c.add_column(col)
    for row in report["checks"]:
        result = ("[green]ok[/]" if row["ok"] else "[red]low[/]") if row["applies"] else "[dim]n/a[/]"
        share = f" ({row['share']:.0%} of the link)" if row.get("share") is not None else ""
        c.add_row(row["what"], f"{row['measured']} {row['unit']}".strip() + share, str(row["expected"]), result)
    parts.append(c)
    return Group(*parts)


@contextlib.contextmanager
def _status(enabled: bool) -> Iterator[Callable[[str], None]]:
    """A spinner on stderr showing the step under way, when ``enabled``; else a no-op."""
    if not enabled:
        yield lambda text: None
        return
    from rich.console import Console

    with Console(stderr=True).status("starting") as status:
        yield lambda text: status.update(text + " ...")


def show_progress(json_out: bool, stream=None) -> bool:
    """Whether to show progress: not for --json, and only on a terminal (stderr by default)."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return not json_out and callable(isatty) and bool(isatty())


def doctor_command(json_out: bool = False, device: "str | None" = None, output: "str | None" = None,
                   save: "str | bool | None" = None) -> int:
    """Print the report (rich tables, or JSON with ``json_out``), with progress on stderr when it
    is a terminal and ``json_out`` is off; optionally save the JSON to ``output``, and the
    hardware profile to ``save``.

    Args:
        json_out: print JSON instead of tables.
        device: the device spec (None reads ``RINGFLOW_DEVICE``).
        output: also write the JSON report to this file.
        save: also measure what a hardware profile needs and write the profile: True writes
            it to the per-GPU cache file (:func:`ringflow._device.hardware.cached_profile_path`),
            which this GPU model and driver then plan with; a string writes it there. On the
            simulated GPU (``device="sim"``) a string path gets the simulated profile (a
            starting point to edit), and True is refused.

    Returns:
        The exit status: 1 when a CUDA device was asked for and CUDA is not usable here, or a
        profile was asked for and none could be measured or written (the report still prints,
        and one stderr line says why), else 0.

    Raises:
        TypeError, ValueError: ``device`` is not a device spec or names a missing GPU, or
            ``save`` is True for the simulated GPU (:func:`save_without_path_problem`); both
            before any work.
        OSError: ``output`` cannot be written.
    """
    from ._device import parse_spec

    kind, index = parse_spec(device)
    if save is True:
        problem = save_without_path_problem(device)
        if problem is not None:
            raise ValueError(f"--save: {problem}")
    with _status(show_progress(json_out)) as say:
        raw = _collect(device, repeats=10, progress=say, model=bool(save))
    problem = None
    if save:
        try:
            raw["profile"] = _save_profile(raw, kind, save)
        except (ValueError, OSError) as exc:
            problem = _describe_error(exc)
    report = rounded(raw)
    # a figure that is not a number (a copy timed at zero) is null: strict JSON readers refuse NaN
    text = json.dumps(plain(report), indent=2, default=str, allow_nan=False)
    if output:
        write_whole(output, text + "\n")
    if json_out:
        print(text)
    else:
        from rich.console import Console

        Console().print(render(report))
    if kind == "cuda" and not report["cuda_usable"]:
        print(f"ringflow doctor: error: device 'cuda:{index}' is not usable: {report['cuda_reason']}",
              file=sys.stderr)
        return 1
    if problem is not None:
        print(f"ringflow doctor: error: --save: {problem}", file=sys.stderr)
        return 1
    if save:
        saved = raw["profile"]
        # the file's name (and the profile's) is the user's text: a control character in it would
        # reach the terminal as a control sequence or a line break
        print(controls_escaped(f"ringflow doctor: saved hardware profile {saved['name']} to {saved['path']}; "
                               f"{saved['use']}"), file=sys.stderr if json_out else sys.stdout)
    return 0


def save_without_path_problem(device: "str | None") -> "str | None":
    """Why ``--save`` without a file name cannot be done on ``device``, or None where it can.

    It fills the per-GPU cache with a measured GPU's profile, so it is refused where ``device``
    (or, for None, ``RINGFLOW_DEVICE``) names the simulated GPU. Where ``"auto"`` falls back to
    the simulated GPU is found only by looking for a GPU, and the report says why.

    Returns:
        The reason, naming the device setting and saying to give a file name; None otherwise.

    Raises:
        TypeError, ValueError: ``device`` (or ``RINGFLOW_DEVICE``) is not a device spec.
    """
    from ._device import ENV_VAR, parse_spec

    kind, _ = parse_spec(device)
    if kind != "sim":
        return None
    named = f"--device {device}" if device is not None else f"{ENV_VAR}={os.environ.get(ENV_VAR, '')}"
    return (f"the device is the simulated GPU ({named}); give a file name (--save FILE): it writes the simulated "
            "profile there, a starting point to edit; the per-GPU cache is for measured GPUs")


def _profile_argument(path: str) -> str:
    """``path`` as ``ringflow plan --profile`` takes it to mean that file, quoted for a shell: a
    bare file name gets ``./`` (``--profile unit`` names the built-in profile, and a name without
    a separator is a file only while it exists in the folder the command runs in)."""
    from ._device.hardware import PROFILES

    if os.path.dirname(path) == "" or path in PROFILES:
        path = os.path.join(os.curdir, path)
    return shlex.quote(path)


def _describe_error(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    return str(exc)


def _save_profile(raw: dict[str, Any], kind: str, save: "str | bool") -> dict[str, Any]:
    """Build and write the profile of a collected (unrounded) report; returns where and how to
    use it. Raises ValueError when there is nothing to measure, OSError when it cannot be written."""
    from ._device.hardware import cached_profile_path, get_profile

    if raw["device"]["backend"] == "sim":
        if kind != "sim":
            raise ValueError(f"no usable GPU to measure ({raw['cuda_reason']}); run it where the GPU is, or pass "
                             "--device sim --save FILE to write the simulated profile as a starting point")
        profile = get_profile(raw["sim_profile"]["name"])
        path = save_to(profile, save)  # a file name: doctor_command refused True for the simulated GPU
        return {"name": profile.name, "path": path,
                "use": f"plan with it: ringflow plan --profile {_profile_argument(path)}, or "
                       "ringflow.device('sim', profile=...)"}
    profile = profile_from_report(raw)
    cache = cached_profile_path(profile.gpu_name, profile.driver)
    path = save_to(profile, cache if save is True else save)
    if os.path.abspath(path) == os.path.abspath(cache):
        use = f"ringflow now plans with it on {profile.gpu_name} under driver {profile.driver}"
    else:
        use = (f"plan with it: ringflow plan --profile {_profile_argument(path)}; for this GPU to use it by itself, "
               f"save it to {cache} (ringflow doctor --save with no file name)")
    return {"name": profile.name, "path": path, "use": use}
