"""Timing helpers: warm-up, repeats, median and spread, on the device's host clock.

Every ringflow call returns only after its last result is on the host, so the host clock
around it (``Device.now``: perf_counter on a GPU, virtual time on the simulator) measures
the whole call, transfers included.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np


@dataclasses.dataclass
class Timing:
    samples_s: list

    @property
    def median_ms(self) -> float:
        return float(np.median(self.samples_s)) * 1e3

    @property
    def p10_ms(self) -> float:
        return float(np.percentile(self.samples_s, 10)) * 1e3

    @property
    def p90_ms(self) -> float:
        return float(np.percentile(self.samples_s, 90)) * 1e3

    def as_dict(self) -> dict[str, Any]:
        return {"ms_median": self.median_ms, "ms_p10": self.p10_ms, "ms_p90": self.p90_ms,
                "runs": len(self.samples_s)}


def time_calls(clock: Callable[[], float], fn: Callable[[], Any], *, warmup: int = 1, repeats: int = 5,
               before: Callable[[], Any] | None = None) -> Timing:
    """Call ``fn`` ``warmup`` times untimed, then ``repeats`` times timed by ``clock``; ``before``
    runs untimed ahead of every call (fresh inputs, say)."""
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    samples = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = clock()
        fn()
        samples.append(clock() - t0)
    return Timing(samples)


def fresh_random(shape, dtype=np.float32, seed: int | None = None, low: float = 0.5, high: float = 1.5) -> np.ndarray:
    """Random values away from zero (a zero hides unwritten outputs)."""
    rng = np.random.default_rng(seed)
    return rng.uniform(low, high, size=shape).astype(dtype)
