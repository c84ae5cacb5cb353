"""Test access to engine internals through ``ringflow._testing`` (the one seam for it)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from ringflow import _testing


def pipeline_of(engine: Any) -> Any:
    """The ``Pipeline`` behind a scheduled engine, or the engine itself (a direct schedule)."""
    return getattr(engine, "pipe", engine)


@contextlib.contextmanager
def engines(on: Callable[[Any], Any] | None = None) -> Iterator[list]:
    """Collect the engine (its pipeline, for the scheduler's) of every whole-array call made
    inside the block, in call order; ``on`` is also called with each."""
    seen: list = []

    def hook(engine: Any) -> None:
        seen.append(pipeline_of(engine))
        if on is not None:
            on(seen[-1])

    with _testing.inject(on_engine=hook):
        yield seen
