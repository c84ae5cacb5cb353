"""``ringflow doctor``: what this machine's GPU can do, measured.

:func:`collect` returns a JSON-ready report: the device, the software versions, the device's
capabilities and, on a real GPU, measured copy bandwidths (pinned H2D, D2H and both at once
on 256 MiB, pageable vs pinned, pinned by copy size) and whether a copy and a kernel on two
streams really overlap. Without a usable GPU it says why and reports the simulated GPU's
profile instead. :func:`render` turns a report into rich tables; :func:`doctor_command` is
the CLI entry.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import platform
import sys
from typing import Any

# DESIGN.md section 6 (H200, PCIe Gen5 x16): the figures a healthy H200 should reach.
REFERENCE = {"h2d_GBps": 54.8, "d2h_GBps": 54.7, "duplex_GBps": 98.4, "overlap_fraction": 0.8, "tolerance": 0.10}

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


def collect(device_spec: str = "auto", *, repeats: int = 10) -> dict[str, Any]:
    """Everything the doctor knows about ``device_spec`` ("auto", "cuda[:N]" or "sim")."""
    from ._device import cuda_available

    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["ringflow", "doctor", *sys.argv[2:]]) if sys.argv[1:2] == ["doctor"] else None,
        "device_spec": device_spec, "versions": versions(), "reference": dict(REFERENCE),
    }
    ok, reason = cuda_available()
    report["cuda_usable"], report["cuda_reason"] = ok, reason
    if device_spec == "sim" or not ok:
        return _simulated(report, device_spec, ok, reason)
    from ._device.cuda import CudaDevice
    from ._device.cuda.measure import measure

    index = int(device_spec.split(":")[1]) if ":" in device_spec else 0
    dev = CudaDevice(index)
    try:
        caps = dev.capabilities
        report["device"] = {"backend": "cuda", "index": index, "name": dev.name, "array_type": dev.array_type}
        report["capabilities"] = caps.as_dict()
        report["measurements"] = measure(dev, repeats=repeats)
        report["checks"] = checks(report["measurements"], dev.name)
    finally:
        dev.close()
    return report


def _simulated(report: dict[str, Any], spec: str, ok: bool, reason: str) -> dict[str, Any]:
    from ._device.hardware import get_profile

    profile = get_profile("h200-pcie5")
    if spec != "sim":
        report["note"] = f"no usable GPU ({reason}); showing the simulated GPU's profile instead"
    report["device"] = {"backend": "sim", "name": f"simulated {profile.name}"}
    report["sim_profile"] = profile.as_dict()
    return report


def checks(m: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """The issue's goals: copies within 10% of DESIGN.md's H200 figures, overlap > 0.8."""
    tol = REFERENCE["tolerance"]
    out = []
    for label, key, ref in (("pinned H2D 256 MiB", "h2d_pinned", REFERENCE["h2d_GBps"]),
                            ("pinned D2H 256 MiB", "d2h_pinned", REFERENCE["d2h_GBps"]),
                            ("pinned H2D+D2H at once", "duplex_pinned", REFERENCE["duplex_GBps"])):
        got = m[key]["GBps"]
        out.append({"what": label, "measured": round(got, 2), "expected": ref, "unit": "GB/s",
                    "ok": abs(got - ref) <= tol * ref, "applies": "H200" in name})
    frac = m["overlap"]["fraction"]
    out.append({"what": "copy/kernel overlap fraction", "measured": round(frac, 3), "expected": "> 0.8",
                "unit": "", "ok": frac > REFERENCE["overlap_fraction"], "applies": True})
    out.append({"what": "round trips bit-exact", "measured": m["roundtrip_bit_exact"] and m["pageable"]["bit_exact"],
                "expected": True, "unit": "", "ok": m["roundtrip_bit_exact"] and m["pageable"]["bit_exact"],
                "applies": True})
    return out


# -- rendering ---------------------------------------------------------------------------------
def _kv_table(title: str, rows: dict[str, Any]):
    from rich.table import Table

    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    for k, v in rows.items():
        t.add_row(str(k), str(v))
    return t


def _bw(x: dict[str, Any]) -> str:
    return f"{x['GBps']:.1f} GB/s  ({x['GBps_min']:.1f}..{x['GBps_max']:.1f}, n={x['repeats']})"


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


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
        prof = {k: v for k, v in report["sim_profile"].items() if not k.endswith("curve")}
        parts.append(_kv_table("Simulated profile (DESIGN.md section 6)", prof))
        return Group(*parts)
    parts.append(_kv_table("Capabilities", report["capabilities"]))
    m = report["measurements"]
    parts.append(_kv_table("Copy bandwidth, 256 MiB", {
        "pinned H2D": _bw(m["h2d_pinned"]), "pinned D2H": _bw(m["d2h_pinned"]),
        "pinned H2D + D2H at once (sum)": _bw(m["duplex_pinned"]),
        "pageable H2D (async / sync copy)": _bw(m["pageable"]["h2d"]) + "  /  " + _bw(m["pageable"]["h2d_sync"]),
        "pageable D2H (async / sync copy)": _bw(m["pageable"]["d2h"]) + "  /  " + _bw(m["pageable"]["d2h_sync"])}))
    t = Table(title="Pinned copy bandwidth by size (GB/s, median)", title_justify="left")
    t.add_column("size", justify="right")
    t.add_column("H2D", justify="right")
    t.add_column("D2H", justify="right")
    for a, b in zip(m["pinned_h2d_by_size"], m["pinned_d2h_by_size"]):
        t.add_row(_size(a["bytes"]), f"{a['GBps']:.1f}", f"{b['GBps']:.1f}")
    parts.append(t)
    o = m["overlap"]
    parts.append(_kv_table("Copy / kernel overlap on two streams", {
        "copy alone": f"{o['t_copy_ms']:.3f} ms", "kernel alone": f"{o['t_kernel_ms']:.3f} ms",
        "both at once": f"{o['t_both_ms']:.3f} ms", "overlap fraction": f"{o['fraction']:.3f}"}))
    c = Table(title="Checks", title_justify="left")
    for col in ("what", "measured", "expected", "result"):
        c.add_column(col)
    for row in report["checks"]:
        result = ("[green]ok[/]" if row["ok"] else "[red]off[/]") if row["applies"] else "[dim]n/a (not an H200)[/]"
        c.add_row(row["what"], f"{row['measured']} {row['unit']}".strip(), str(row["expected"]), result)
    parts.append(c)
    return Group(*parts)


def doctor_command(json_out: bool = False, device: str = "auto", output: str | None = None) -> int:
    """Print the report (rich tables, or JSON with ``json_out``); optionally save the JSON to
    ``output``. Returns the exit status: 1 when a CUDA device was asked for and is unusable."""
    report = collect(device)
    text = json.dumps(report, indent=2, default=str)
    if output:
        with open(output, "w") as f:
            f.write(text + "\n")
    if json_out:
        print(text)
    else:
        from rich.console import Console

        Console().print(render(report))
    return 1 if device.startswith("cuda") and not report["cuda_usable"] else 0
