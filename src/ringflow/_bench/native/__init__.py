"""Build and run the hand-written CUDA C++ pipeline baseline (``overlap_pipeline.cu``) with nvcc.

The source ships as package data beside this module. :func:`build` compiles it once per process
(``nvcc -O3 -arch=sm_90``) into a temporary directory removed at exit; :func:`run` runs the
program and returns the JSON it prints. :func:`kernel_source` is the block of kernels every
baseline launches (the Python baselines compile it with NVRTC through CuPy), so all of them
run the same code.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

__all__ = ["SOURCE_NAME", "source_text", "kernel_source", "find_nvcc", "nvcc_version", "build", "run"]

SOURCE_NAME = "overlap_pipeline.cu"
KERNELS_BEGIN = "// ---- ringflow-kernels-begin"
KERNELS_END = "// ---- ringflow-kernels-end"
DEFAULT_ARCH = "sm_90"

_lock = threading.Lock()
_builds: dict[tuple[str, str, str], dict[str, Any]] = {}
_tmpdirs: list[str] = []


def source_text() -> str:
    """The CUDA C++ source of the pipeline program (package data)."""
    return resources.files(__name__).joinpath(SOURCE_NAME).read_text(encoding="utf-8")


def kernel_source() -> str:
    """The kernels block of the source: ``affine_iter(x, y, iters, n)`` and ``scale_shift(x, y, n)``."""
    text = source_text()
    try:
        start = text.index(KERNELS_BEGIN) + len(KERNELS_BEGIN)
        end = text.index(KERNELS_END, start)
    except ValueError as exc:
        raise RuntimeError(f"{SOURCE_NAME} lost its kernel markers ({KERNELS_BEGIN!r} ... {KERNELS_END!r})") from exc
    return text[start:end].strip() + "\n"


def find_nvcc() -> str | None:
    """Path of nvcc: on PATH, else under $CUDA_HOME / $CUDA_PATH, else /usr/local/cuda; None if absent."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.access(os.path.join(root, "bin", "nvcc"), os.X_OK):
            return os.path.join(root, "bin", "nvcc")
    return None


def nvcc_version(nvcc: str | None = None) -> str | None:
    """``"13.0.88"``-style version of nvcc (None if it is missing or says nothing parseable)."""
    nvcc = nvcc or find_nvcc()
    if not nvcc:
        return None
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"V(\d+\.\d+\.\d+)", out) or re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else None


def _unavailable(reason: str) -> Exception:
    from ..baselines import BaselineUnavailable

    return BaselineUnavailable(reason)


def _cleanup() -> None:
    for d in _tmpdirs:
        shutil.rmtree(d, ignore_errors=True)


atexit.register(_cleanup)


def build(arch: str = DEFAULT_ARCH, *, nvcc: str | None = None, flags: Sequence[str] = ()) -> dict[str, Any]:
    """Compile the program (once per nvcc, arch, flags and source); returns ``{"exe", "command",
    "build_s", "nvcc", "nvcc_version", "arch", "cached"}``.

    Raises ``BaselineUnavailable`` when nvcc is missing and ``RuntimeError`` (with nvcc's
    messages) when the compile fails.
    """
    nvcc = nvcc or find_nvcc()
    if not nvcc:
        raise _unavailable("nvcc not found (not on PATH, $CUDA_HOME or /usr/local/cuda): the CUDA C++ baseline needs it")
    src = source_text()
    key = (nvcc, arch + " " + " ".join(flags), hashlib.sha256(src.encode()).hexdigest())
    with _lock:
        if key in _builds and Path(_builds[key]["exe"]).exists():
            return {**_builds[key], "cached": True}
        tmp = tempfile.mkdtemp(prefix="ringflow-native-")
        _tmpdirs.append(tmp)
        src_path = Path(tmp) / SOURCE_NAME
        src_path.write_text(src, encoding="utf-8")
        exe = Path(tmp) / "overlap_pipeline"
        cmd = [nvcc, "-O3", f"-arch={arch}", *flags, str(src_path), "-o", str(exe)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"nvcc took over {exc.timeout} s: {shlex.join(cmd)}") from None
        build_s = time.perf_counter() - t0
        if proc.returncode != 0 or not exe.exists():
            raise RuntimeError(f"nvcc failed (exit {proc.returncode}): {shlex.join(cmd)}\n{proc.stderr.strip()}")
        info = {"exe": str(exe), "command": shlex.join(cmd), "build_s": build_s, "nvcc": nvcc,
                "nvcc_version": nvcc_version(nvcc), "arch": arch}
        _builds[key] = info
        return {**info, "cached": False}


def _csv(v: int | Sequence[int]) -> str:
    vals = [v] if isinstance(v, int) else list(v)
    if not vals or any(isinstance(x, bool) or int(x) < 1 for x in vals):
        raise ValueError(f"counts must be positive integers, got {v!r}")
    return ",".join(str(int(x)) for x in vals)


def run(exe: str, *, n_floats: int, chunks: int | Sequence[int] = (8, 16, 32, 64),
        streams: int | Sequence[int] = (4, 1), iters: int = 64, kernel: str = "seed", repeats: int = 10,
        warmup: int = 3, seed: int = 12345, timeout: float = 300, refill: bool = False) -> dict[str, Any]:
    """Run the built program; returns its JSON plus ``"command"``, ``"returncode"`` and ``"wall_s"``.
    With ``refill`` each pipelined configuration is also timed with its input rewritten by the
    CPU before every repeat (``"refilled"``), as ringflow's in-place bench runs are.

    Raises ``BaselineUnavailable`` when the program finds no GPU, ``RuntimeError`` on a CUDA or
    argument error. A wrong result is not raised: the dict says ``"correct": false``.
    """
    if int(n_floats) < 1:
        raise ValueError(f"n_floats must be >= 1, got {n_floats!r}")
    cmd = [str(exe), "--n", str(int(n_floats)), "--chunks", _csv(chunks), "--streams", _csv(streams),
           "--iters", str(int(iters)), "--kernel", kernel, "--repeats", str(int(repeats)),
           "--warmup", str(int(warmup)), "--seed", str(int(seed))] + (["--refill", "1"] if refill else [])
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the CUDA C++ baseline ran over {timeout} s: {shlex.join(cmd)}") from None
    wall_s = time.perf_counter() - t0
    out = proc.stdout.strip()
    try:
        result = json.loads(out)
    except json.JSONDecodeError:
        raise RuntimeError(f"the CUDA C++ baseline printed no JSON (exit {proc.returncode}): {shlex.join(cmd)}\n"
                           f"stdout: {out[-2000:]}\nstderr: {proc.stderr.strip()[-2000:]}") from None
    if result.get("unavailable") or proc.returncode == 3:
        raise _unavailable(f"the CUDA C++ baseline found no usable GPU: {result.get('error', 'exit 3')}")
    if "error" in result:
        raise RuntimeError(f"the CUDA C++ baseline failed: {result['error']} ({shlex.join(cmd)})")
    result.update(command=shlex.join(cmd), returncode=proc.returncode, wall_s=wall_s)
    return result
