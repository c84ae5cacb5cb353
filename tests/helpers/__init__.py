"""Shared helpers for ringflow's tests (the simulated GPU's ring loop, timelines, profiles)."""

from .ring import OBSERVE_STYLES, POINTS, SYNC_POINTS, WAIT_POINTS, RingRun, kernel, observe, reference, run_ring
from .sim import Timeline, slowed, small_memory_device, unit_device

__all__ = ["POINTS", "WAIT_POINTS", "SYNC_POINTS", "OBSERVE_STYLES", "RingRun", "run_ring", "kernel", "reference",
           "observe", "Timeline", "slowed", "small_memory_device", "unit_device"]
