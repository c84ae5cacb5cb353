"""Counts of chunks by how they ended."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class PipelineStats:
    """A snapshot of a pipeline's item counts (an item counts once, whether or not it shares a
    chunk). At all times ``accepted == delivered + failed + cancelled + in_flight``; after
    ``close()`` or ``cancel()`` returns, ``in_flight == 0``."""

    accepted: int
    delivered: int
    failed: int
    cancelled: int
    in_flight: int

    def balanced(self) -> bool:
        """Whether every accepted item is accounted for: ``accepted == delivered + failed +
        cancelled + in_flight`` (always True; the tests check it)."""
        return self.accepted == self.delivered + self.failed + self.cancelled + self.in_flight
