"""NVTX ranges, so Nsight Systems shows the pipeline's CPU stages by name.

Uses NVIDIA's ``nvtx`` package when it is installed; otherwise every range is a no-op."""

from __future__ import annotations

import functools
from typing import Callable

try:  # optional: part of the 'cuda' extra
    import nvtx as _nvtx
except Exception:  # noqa: BLE001 - any import problem just disables the ranges
    _nvtx = None

COLOURS = {"prepare": "blue", "consume": "purple"}


def available() -> bool:
    return _nvtx is not None


def ranged(fn: Callable, stage: str) -> Callable:
    """``fn`` wrapped in an NVTX range named after the stage (domain 'ringflow')."""
    if _nvtx is None:
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _nvtx.annotate(stage, color=COLOURS.get(stage, "green"), domain="ringflow"):
            return fn(*args, **kwargs)

    return wrapper
