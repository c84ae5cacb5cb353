"""Whole-array jobs that stage one side: one array pinned in ringflow.host memory (used in place), the other
ordinary numpy memory (staged through a pinned ring)."""

from __future__ import annotations

import dataclasses

import numpy as np

import ringflow as rf
from ringflow import _plan as plan

# (input staged, result staged) of a job whose other side is pinned
SIDES = {"x": (False, True), "out": (True, False)}


def one_side_profile(staged_s: "float | None" = 1e-3, scheduled_s: "float | None" = 2e-4):
    """The h200-pcie5 profile with the scheduler's host time per chunk measured, staged
    (``staged_chunk_host_s``) and unstaged (``scheduled_chunk_host_s``); None leaves one to the fit."""
    return dataclasses.replace(plan.get_profile("h200-pcie5"), name="one-side-host", staged_chunk_host_s=staged_s,
                               scheduled_chunk_host_s=scheduled_s)


def slow_registration(profile):
    """``profile`` on a host whose registering and unregistering run at 0.5 GB/s (an IOMMU or a
    virtual machine's): there the planner stages an ordinary side rather than registering it,
    even for jobs of a few chunks, where on the built-in profiles registering is predicted faster."""
    return dataclasses.replace(plan.get_profile(profile), name=f"{plan.get_profile(profile).name}-slow-registration",
                               register_GBps=0.5, unregister_GBps=0.5)


def one_side_arrays(dev, data: np.ndarray, pinned: str) -> tuple[np.ndarray, np.ndarray]:
    """``(x, out)`` holding ``data`` in and room for a result of its shape out, the side named
    ``pinned`` (``"x"`` or ``"out"``) an array from ``rf.host.empty_like`` on ``dev``, the other
    ordinary memory."""
    x = rf.host.empty_like(data, device=dev) if pinned == "x" else np.empty_like(data)
    x[...] = data
    out = rf.host.empty_like(data, device=dev) if pinned == "out" else np.empty_like(data)
    return x, out
