"""Ownership states of slots and chunks, and the only transitions allowed between them.

A slot is owned by exactly one stage at a time. Each ring kind has its own path through the
states, because each buffer's lifetime ends at a different operation:

* host-in:    FREE -> FILLING (prepare on a CPU worker) -> FILLED -> COPYING_IN (H2D) -> FREE
  (free once the H2D has completed: nothing else reads it)
* device-in:  FREE -> COPYING_IN -> COMPUTING -> FREE (free once the compute has completed)
* device-out: FREE -> COMPUTING -> COPYING_OUT (D2H) -> FREE (free once the D2H has completed)
* host-out:   FREE -> COPYING_OUT -> CONSUMING (CPU consumer) -> FREE (free once it returns)
* device in-place (device-in aliases device-out): FREE -> COPYING_IN -> COMPUTING ->
  COPYING_OUT -> FREE
* with results delivered on the device, the slot the compute wrote goes COMPUTING -> LENT (the
  consumer owns it) -> FREE once the consumer releases it; its next owner's stream waits for
  the event the release recorded on the consumer's stream

Every ring also allows ``X -> DRAINING -> FREE`` from any busy state: the chunk was cancelled or
failed, and the slot waits for the events of operations already enqueued on it before it is
free (work on a stream cannot be recalled). An illegal transition raises
:class:`IllegalTransition` at once: it is a bug in the scheduler, never a user error.
"""

from __future__ import annotations

import enum


class IllegalTransition(AssertionError):
    """The scheduler tried to move a slot or chunk along a transition its table forbids."""


class SlotState(enum.Enum):
    """Where a ring's slot (one chunk's buffer in one stage) is: FREE, then the states of its
    ring's path (filled on the host, copied in, computed into, copied out, consumed, or lent to
    a consumer as a device result), DRAINING while a cancelled or failed chunk's last operation
    completes, and FREE again."""

    # members are singletons compared by identity: hash them by identity too (Enum's own hash is
    # Python code, and the scheduler checks a transition table on every move)
    __hash__ = object.__hash__

    FREE = "free"
    FILLING = "filling"
    FILLED = "filled"
    COPYING_IN = "copying_in"
    COMPUTING = "computing"
    COPYING_OUT = "copying_out"
    CONSUMING = "consuming"
    LENT = "lent"
    DRAINING = "draining"


class RingKind(enum.Enum):
    __hash__ = object.__hash__

    HOST_IN = "host-in"
    DEVICE_IN = "device-in"
    DEVICE_OUT = "device-out"
    HOST_OUT = "host-out"
    DEVICE_INPLACE = "device-inplace"


S = SlotState
_PATHS: dict[RingKind, tuple[SlotState, ...]] = {
    RingKind.HOST_IN: (S.FREE, S.FILLING, S.FILLED, S.COPYING_IN, S.FREE),
    RingKind.DEVICE_IN: (S.FREE, S.COPYING_IN, S.COMPUTING, S.FREE),
    RingKind.DEVICE_OUT: (S.FREE, S.COMPUTING, S.COPYING_OUT, S.FREE),
    RingKind.HOST_OUT: (S.FREE, S.COPYING_OUT, S.CONSUMING, S.FREE),
    RingKind.DEVICE_INPLACE: (S.FREE, S.COPYING_IN, S.COMPUTING, S.COPYING_OUT, S.FREE),
}


# a result delivered on the device: the slot the compute wrote is lent to the consumer
_LENDING = {RingKind.DEVICE_OUT: ((S.COMPUTING, S.LENT), (S.LENT, S.FREE)),
            RingKind.DEVICE_INPLACE: ((S.COMPUTING, S.LENT), (S.LENT, S.FREE))}


def _table(path: tuple[SlotState, ...], extra=()) -> frozenset[tuple[SlotState, SlotState]]:
    edges = set(zip(path, path[1:])) | set(extra)
    path = tuple(path) + tuple(b for _, b in extra)
    busy = set(path) - {S.FREE}
    edges |= {(b, S.DRAINING) for b in busy} | {(S.DRAINING, S.FREE)}
    return frozenset(edges)


LEGAL_SLOT_TRANSITIONS: dict[RingKind, frozenset[tuple[SlotState, SlotState]]] = {
    kind: _table(path, _LENDING.get(kind, ())) for kind, path in _PATHS.items()}


class ChunkState(enum.Enum):
    """Where a chunk is. The three final states are DELIVERED, FAILED and CANCELLED."""

    __hash__ = object.__hash__

    ACCEPTED = "accepted"
    PREPARING = "preparing"
    PREPARED = "prepared"
    ON_DEVICE = "on_device"  # H2D, compute and D2H enqueued (as far as slots allowed)
    CONSUMING = "consuming"
    DRAINING = "draining"  # failed or cancelled; waiting for enqueued work before its end
    DELIVERED = "delivered"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def final(self) -> bool:
        """Whether the chunk has ended: delivered, failed or cancelled."""
        return self in (ChunkState.DELIVERED, ChunkState.FAILED, ChunkState.CANCELLED)


C = ChunkState
_CHUNK_PATH = (C.ACCEPTED, C.PREPARING, C.PREPARED, C.ON_DEVICE, C.CONSUMING, C.DELIVERED)
LEGAL_CHUNK_TRANSITIONS: frozenset[tuple[ChunkState, ChunkState]] = frozenset(
    set(zip(_CHUNK_PATH, _CHUNK_PATH[1:]))
    | {(c, C.DRAINING) for c in _CHUNK_PATH[:-1]}
    | {(c, C.CANCELLED) for c in _CHUNK_PATH[:-1]}
    | {(c, C.FAILED) for c in _CHUNK_PATH[:-1]}
    | {(C.DRAINING, C.FAILED), (C.DRAINING, C.CANCELLED)}
    | {(C.ON_DEVICE, C.DELIVERED)}  # a result delivered on the device: no copy back, no consumer
)


def check_chunk_transition(index: int, old: ChunkState, new: ChunkState) -> None:
    if (old, new) not in LEGAL_CHUNK_TRANSITIONS:
        raise IllegalTransition(f"chunk {index}: illegal transition {old.name} -> {new.name}")
