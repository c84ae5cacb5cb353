"""Is a CUDA GPU usable here? Answered without creating a context or raising."""

from __future__ import annotations

import functools

MIN_CUDA_CORE = (1, 2)


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for p in text.split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


@functools.lru_cache(maxsize=1)
def probe() -> tuple[bool, str]:
    """``(usable, reason)``: True when cuda.core >= 1.2 imports, the driver loads and a GPU is
    visible. Never raises; the reason says what is missing. The answer is cached for the process."""
    try:
        import cuda.core as cc
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable"
        return False, (f"cuda.core is not installed ({type(exc).__name__}: {exc}); "
                       "install it with: pip install 'ringflow[cuda]'")
    version = getattr(cc, "__version__", "0")
    if _version_tuple(version) < MIN_CUDA_CORE:
        return False, f"cuda.core {version} is too old; ringflow needs cuda.core >= 1.2 (pip install -U cuda-core)"
    try:
        from cuda.bindings import driver
    except Exception as exc:  # noqa: BLE001
        return False, f"cuda.bindings did not import ({type(exc).__name__}: {exc})"
    try:
        (err,) = driver.cuInit(0)
        if int(err) != 0:
            return False, f"the CUDA driver did not initialise ({getattr(err, 'name', err)})"
        err, count = driver.cuDeviceGetCount()
        if int(err) != 0:
            return False, f"cuDeviceGetCount failed ({getattr(err, 'name', err)})"
    except Exception as exc:  # noqa: BLE001 - e.g. libcuda.so not found
        return False, f"no NVIDIA driver found ({type(exc).__name__}: {exc})"
    if count == 0:
        return False, "the CUDA driver sees no GPU"
    try:
        name = cc.Device(0).name
    except Exception as exc:  # noqa: BLE001
        return False, f"GPU 0 is not usable ({type(exc).__name__}: {exc})"
    return True, f"{count} CUDA GPU(s); cuda:0 is {name} (cuda.core {version})"
