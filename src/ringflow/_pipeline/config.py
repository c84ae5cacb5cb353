"""The resolved settings of one pipeline (options as a frozen dataclass, as in cuda.core)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from .._plan import SlotCounts

__all__ = ["PipelineConfig", "SlotCounts", "refuse_unknown_guards"]


def refuse_unknown_guards(disabled, known) -> frozenset:
    """The test-only set of switched-off guards, checked against the engine's ``known`` names."""
    unknown = set(disabled) - set(known)
    if unknown:
        raise ValueError(f"unknown guards {sorted(unknown)}; known: {known}")
    return frozenset(disabled)


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    chunk_bytes: int
    slots: SlotCounts
    max_in_flight: int
    workers: int
    inplace: bool = False
    ordered: bool = True
    on_error: str = "raise"  # "raise": cancel the rest and raise; "continue": the others complete
    profile: bool = False
    checked: bool = False  # poison every released slot so a premature reuse gives a wrong result
    deliver: str = "host"  # "device": results stay in their device slot, lent to the consumer
    fill: Optional[str] = None  # "rows": compute returns how many rows of y it filled
    # a chunk's result bytes at most, where known before the first item (a fixed output spec, a
    # whole-array job): the host-out and device-out slots are sized by them (_plan.host_out_slot,
    # _plan.scheduler_slot); None: chunk_bytes
    out_bytes: Optional[int] = None
    # a chunk's input bytes at most, where known before the first item (a whole-array job): the
    # device-in and host-in slots of a compute not in place are sized by them (_plan.scheduler_slot,
    # _plan.host_in_slot); None: chunk_bytes
    in_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        if self.on_error not in ("raise", "continue"):
            raise ValueError(f"on_error must be 'raise' or 'continue', got {self.on_error!r}")
        if isinstance(self.max_in_flight, bool) or not isinstance(self.max_in_flight, int) or self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be an int >= 1, got {self.max_in_flight!r}; "
                             "it bounds how many accepted chunks may be unfinished at once")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {self.chunk_bytes}")
        if self.out_bytes is not None and self.out_bytes < 0:
            raise ValueError(f"out_bytes must be None or >= 0, got {self.out_bytes}")
        if self.in_bytes is not None and self.in_bytes < 0:
            raise ValueError(f"in_bytes must be None or >= 0, got {self.in_bytes}")
        if self.inplace and self.slots.device_out != 0:
            raise ValueError("in-place compute uses no device-out ring; leave slots.device_out at 0")
        if not self.inplace and self.slots.device_out < 1:
            raise ValueError("slots.device_out must be at least 1 unless compute is in place")
