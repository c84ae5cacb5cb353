"""Running a pipeline's ``map`` or ``amap`` alike from a test."""

from __future__ import annotations

import asyncio
from typing import Any, Callable


def take_each(pipe: Any, face: str, items: list, take: Callable[[Any], None]) -> None:
    """Call ``take`` on each result of ``pipe``'s ``face`` ("map" or "amap", run to its end on
    a loop of its own) over ``items``; raises what the map raises."""
    if face == "map":
        for result in pipe.map(items):
            take(result)
        return

    async def consume() -> None:
        async for result in pipe.amap(items):
            take(result)

    asyncio.run(consume())
