"""One unit of work moving through the pipeline, and the future that reports its end."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from .ring import Slot
from .states import ChunkState, check_chunk_transition

if TYPE_CHECKING:
    from .scheduler import Scheduler


class ChunkFuture(concurrent.futures.Future):
    """A :class:`concurrent.futures.Future` that drives the pipeline while it is waited on.

    The pipeline makes progress inside the calls made on it (``map``, ``submit``, ``close``
    and this future's ``result``/``exception``), so waiting on a future never deadlocks even
    though no background thread runs the scheduler.
    """

    def __init__(self, scheduler: "Scheduler", index: int):
        super().__init__()
        self._scheduler = scheduler
        self.index = index

    def result(self, timeout: float | None = None) -> Any:
        self._scheduler.run_until(self.done, timeout)
        return super().result(timeout=0)

    def exception(self, timeout: float | None = None) -> Optional[BaseException]:
        self._scheduler.run_until(self.done, timeout)
        return super().exception(timeout=0)

    def cancel(self) -> bool:
        """Cancel this chunk, not only the future: a chunk not yet on the device ends CANCELLED
        at once; one whose copies or kernel are enqueued stops there and ends CANCELLED once
        that work completes (its buffers are freed only then). The future is cancelled at once
        either way. Returns False if the chunk's consumer is running or it has ended."""
        if self.done():
            return False
        if not self._scheduler.cancel_chunk(self.index):
            return self.cancelled()
        if not self.done():  # still draining: the future does not wait for that
            self._mark_cancelled()
        return True

    def _mark_cancelled(self) -> None:
        concurrent.futures.Future.cancel(self)
        self.set_running_or_notify_cancel()


@dataclasses.dataclass(eq=False)
class Chunk:
    index: int
    item: Any
    future: ChunkFuture
    state: ChunkState = ChunkState.ACCEPTED
    # what prepare wrote into the host-in slot
    shape: tuple[int, ...] = ()
    dtype: Optional[np.dtype] = None
    nbytes: int = 0
    host_in: Optional[Slot] = None
    dev_in: Optional[Slot] = None
    dev_out: Optional[Slot] = None
    host_out: Optional[Slot] = None
    prepare_task: Any = None
    consume_task: Any = None
    h2d_event: Any = None
    compute_event: Any = None
    d2h_event: Any = None
    in_map: bool = False  # a map() will hand out this chunk's result
    ending: Optional[ChunkState] = None  # FAILED or CANCELLED once draining
    error: Optional[BaseException] = None
    value: Any = None
    stamps: dict = dataclasses.field(default_factory=dict)  # stage -> (start, end) host-clock seconds
    events: dict = dataclasses.field(default_factory=dict)  # timing events when profiling

    def move(self, new: ChunkState) -> None:
        check_chunk_transition(self.index, self.state, new)
        self.state = new

    def slots(self) -> list[Slot]:
        seen, out = set(), []
        for s in (self.host_in, self.dev_in, self.dev_out, self.host_out):
            if s is not None and id(s) not in seen:
                seen.add(id(s))
                out.append(s)
        return out


Callback = Callable[[], None]
