"""Is a CUDA GPU usable here, and how many are there? Answered without creating a context or
raising."""

from __future__ import annotations

import functools

MIN_CUDA_CORE = (1, 2)
INSTALL_HINT = "pip install 'ringflow[cuda]'"


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for p in text.split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


@functools.lru_cache(maxsize=1)
def _probe() -> tuple[bool, str, int]:
    """``(usable, reason, gpu_count)``, cached for the process; the count is 0 when unusable."""
    try:
        import cuda.core as cc
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable"
        return False, (f"cuda.core is not installed ({type(exc).__name__}: {exc}); "
                       f"install it with: {INSTALL_HINT}"), 0
    version = getattr(cc, "__version__", "0")
    if _version_tuple(version) < MIN_CUDA_CORE:
        return False, f"cuda.core {version} is too old; ringflow needs cuda.core >= 1.2 (pip install -U cuda-core)", 0
    try:
        from cuda.bindings import driver
    except Exception as exc:  # noqa: BLE001
        return False, f"cuda.bindings did not import ({type(exc).__name__}: {exc})", 0
    try:
        (err,) = driver.cuInit(0)
        if int(err) != 0:
            return False, f"the CUDA driver did not initialise ({getattr(err, 'name', err)})", 0
        err, count = driver.cuDeviceGetCount()
        if int(err) != 0:
            return False, f"cuDeviceGetCount failed ({getattr(err, 'name', err)})", 0
    except Exception as exc:  # noqa: BLE001 - e.g. libcuda.so not found
        return False, f"no NVIDIA driver found ({type(exc).__name__}: {exc})", 0
    if count == 0:
        return False, "the CUDA driver sees no GPU", 0
    try:
        name = cc.Device(0).name
    except Exception as exc:  # noqa: BLE001
        return False, f"GPU 0 is not usable ({type(exc).__name__}: {exc})", 0
    return True, f"{count} CUDA GPU(s); cuda:0 is {name} (cuda.core {version})", int(count)


def probe() -> tuple[bool, str]:
    """``(usable, reason)``: True when cuda.core >= 1.2 imports, the driver loads and a GPU is
    visible. Never raises; the reason says what is missing (and how to install it). The answer
    is cached for the process."""
    ok, reason, _ = _probe()
    return ok, reason


def gpu_count() -> int:
    """How many CUDA GPUs the driver sees; 0 when :func:`probe` says CUDA is not usable here.
    Never raises; cached for the process like :func:`probe`."""
    return _probe()[2]
