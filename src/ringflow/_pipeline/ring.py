"""Rings of equally sized slots, one ring per kind of buffer.

A ring owns one allocation carved into ``count`` slots of ``chunk_bytes``, one every ``stride``
bytes (``chunk_bytes`` unless the ring was made with a larger one); each :class:`Slot`
records its state, the chunk that owns it, and the event (or host task) whose completion
lets it go back to FREE. Slots are handed out oldest-freed first so reuse rotates through
the ring (a reuse fault then shows up within one wrap-around instead of hiding).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Optional

from .._device.protocol import Buffer, BufferSlice, close_quietly, free_quietly
from .._errors import OutOfMemoryError
from .states import LEGAL_SLOT_TRANSITIONS, IllegalTransition, RingKind, SlotState

# Called as hook(ring_kind, slot, old_state, new_state) on every transition (tests, tracer).
TransitionHook = Callable[[RingKind, "Slot", SlotState, SlotState], None]


@dataclasses.dataclass(eq=False)
class Slot:
    ring: "Ring"
    index: int
    where: Optional[BufferSlice]  # None only for an external ring's slot not taken yet
    state: SlotState = SlotState.FREE
    owner: Optional[int] = None  # chunk index
    fence: Any = None  # the event / host task that must complete before the slot is free
    ready: Any = None  # event a new owner's stream must wait on first (a poison fill), or None

    def __repr__(self) -> str:
        return f"<{self.ring.kind.value} slot {self.index} {self.state.name} owner={self.owner}>"


def allocate_ring(allocate: Callable[[int], Buffer], kind: RingKind, chunk_bytes: int, count: int,
                  stride: Optional[int] = None) -> Buffer:
    """The memory of a ``kind`` ring of ``count`` slots of ``chunk_bytes``, one every ``stride``
    bytes (default ``chunk_bytes``): ``allocate`` (a device's ``allocate`` or ``allocate_host``)
    of their total.

    Raises:
        OutOfMemoryError: the memory is not there (the device's refusal, or numpy's
            ``MemoryError`` for the simulated GPU's host memory, as its cause); the message
            names chunk_bytes, the slots and the bytes asked for.
    """
    total = (stride or chunk_bytes) * (count - 1) + chunk_bytes
    try:
        return allocate(total)
    except MemoryError as exc:  # the device's words name neither the ring nor the options that sized it
        # chained: the device's own words (how much is in use, the driver's error) stay in the traceback
        raise OutOfMemoryError(f"cannot allocate the {kind.value} ring: {count} slots of chunk_bytes={chunk_bytes} "
                               f"bytes, {total} bytes ({total / (1 << 30):.3g} GiB) in all, more than there is free; "
                               "give a smaller chunk_bytes or fewer slots") from exc


class Ring:
    def __init__(self, kind: RingKind, buffer: Buffer, count: int, chunk_bytes: int,
                 hook: Optional[TransitionHook] = None, *, external: bool = False, stride: Optional[int] = None):
        """``external``: ``buffer`` is the caller's own (pinned or registered) memory, one slot per
        chunk in order; the ring neither poisons nor closes it, and the last slot may be short.
        ``stride``: the bytes from one slot's start to the next's (at least ``chunk_bytes``, which
        it is by default; an external ring's slots are ``chunk_bytes`` apart)."""
        if count < 1:
            raise ValueError(f"a {kind.value} ring needs at least 1 slot, got {count}")
        self.kind = kind
        self.buffer = buffer
        self.chunk_bytes = chunk_bytes
        stride = chunk_bytes if stride is None else stride
        if stride < chunk_bytes or (external and stride != chunk_bytes):
            raise ValueError(f"a {kind.value} ring's stride ({stride}) must be at least its chunk_bytes "
                             f"({chunk_bytes}), and equal to it for an external ring")
        self.stride = stride
        self.external = external
        # an external ring has a slot per chunk of the caller's array: its byte range is made
        # when the slot is first taken (a call's start-up should not pay for all of them)
        self.slots = [Slot(self, i, None if external else
                           buffer.slice(i * stride, min(chunk_bytes, buffer.nbytes - i * stride)))
                      for i in range(count)]
        self._free: collections.deque[Slot] = collections.deque(self.slots)
        self.busy: dict[int, Slot] = {}  # slot index -> slot, for the slots not FREE
        self._legal = LEGAL_SLOT_TRANSITIONS[kind]
        self.high_water = 0  # most slots busy at once
        self._hook = hook

    def rebind(self, buffer: Optional[Buffer]) -> None:
        """An idle external ring takes over another caller buffer laid out the same way (slot i
        at ``i * chunk_bytes``); None forgets the buffer. Slots are handed out in index order
        again, as external rings need (chunk i in slot i)."""
        if not self.external or self.busy:
            raise RuntimeError(f"only an idle external ring can be rebound ({self.kind.value}: "
                               f"external={self.external}, {len(self.busy)} slots busy)")
        if buffer is not None and -(-buffer.nbytes // self.chunk_bytes) != len(self.slots):
            raise ValueError(f"a buffer of {buffer.nbytes} bytes does not give this ring's {len(self.slots)} slots "
                             f"of {self.chunk_bytes} bytes")
        if self.buffer is not None:  # ranges of the old buffer go (made again when taken)
            for slot in self.slots:
                slot.where = None
        self.buffer = buffer
        self._free = collections.deque(self.slots)

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def busy_count(self) -> int:
        return len(self.slots) - len(self._free)

    def acquire(self, owner: int, state: SlotState) -> Optional[Slot]:
        """Take the longest-free slot for chunk ``owner`` into ``state``; None if none is free."""
        if not self._free:
            return None
        slot = self._free.popleft()
        if slot.where is None:  # external: the slot's range of the caller's buffer
            off = slot.index * self.chunk_bytes
            slot.where = BufferSlice(self.buffer, off, min(self.chunk_bytes, self.buffer.nbytes - off))
        busy = self.busy
        busy[slot.index] = slot
        if len(busy) > self.high_water:
            self.high_water = len(busy)
        slot.owner = owner
        self.move(slot, state)
        return slot

    def move(self, slot: Slot, new: SlotState) -> None:
        old = slot.state
        if (old, new) not in self._legal:
            raise IllegalTransition(f"{self.kind.value} slot {slot.index} (chunk {slot.owner}): "
                                    f"illegal transition {old.name} -> {new.name}")
        slot.state = new
        if self._hook is not None:
            self._hook(self.kind, slot, old, new)

    def release(self, slot: Slot) -> None:
        """Back to FREE. The caller has observed every event that used the slot complete."""
        self.move(slot, SlotState.FREE)
        del self.busy[slot.index]
        slot.owner = None
        slot.fence = None
        self._free.append(slot)

    def close(self, stream=None) -> None:
        """Release the ring's memory (never the caller's, for an external ring). A device ring
        with ``stream`` is freed in that stream's order: the caller has ordered every other
        stream's use of it before that point."""
        if self.external:
            return
        what = f"{self.kind.value} ring buffer"
        if self.buffer.is_host:
            close_quietly(self.buffer, what)
        else:
            free_quietly(self.buffer, stream, what)

