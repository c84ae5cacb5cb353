"""A happens-before checker for device and host accesses, on vector clocks.

Pure Python and independent of the simulator, so it can be unit-tested with synthetic actor
and buffer ids (as PyTorch's CUDA sanitizer is). The model:

* An **actor** is anything that runs accesses in program order: a stream, a host thread, a
  pool task. Each keeps a vector clock; its own component counts its operations. Pool tasks
  reuse an actor only when the new task is truly ordered after the actor's previous one
  (:meth:`HappensBeforeChecker.restart`), so no false order arises and the number of actors
  stays bounded by how many tasks run unobserved at once.
* Every access ticks its actor and is stamped with the actor's new own component.
* **Events** snapshot the recording stream's clock; a stream that **waits** on an event and a
  host thread that **syncs** (or sees ``is_done``) merge that snapshot into their clocks.
* An earlier access ``B`` happens before a later access ``A`` exactly when ``A``'s actor clock
  has seen ``B``'s stamp: ``clock[A.actor][B.actor] >= B.seq``.
* Two accesses **conflict** when their byte ranges overlap and at least one writes. A
  **release** (freeing a buffer) conflicts with every earlier access: unlike PyTorch's
  sanitizer, history is kept until the release itself has been checked.

A conflicting pair not ordered by happens-before raises :class:`~ringflow.HazardError`
naming both accesses.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from typing import Hashable

from ..._errors import HazardError

Actor = Hashable
VectorClock = dict  # Actor -> int
SWEEP_MIN = 64  # new actors between two sweeps of retired ones, at least


class AccessKind(enum.Enum):
    READ = "read"
    WRITE = "write"
    RELEASE = "release"

    @property
    def writes(self) -> bool:
        return self is not AccessKind.READ


@dataclasses.dataclass(frozen=True)
class Access:
    actor: Actor
    actor_name: str
    seq: int
    kind: AccessKind
    buffer: Hashable
    buffer_name: str
    start: int
    end: int
    op: str

    def overlaps(self, other: "Access") -> bool:
        # an empty range touches no byte, so it overlaps nothing
        return self.start < self.end and other.start < other.end and self.start < other.end and other.start < self.end

    def describe(self) -> str:
        return (f"{self.kind.value} of {self.buffer_name} bytes [{self.start}, {self.end}) by {self.op} "
                f"on {self.actor_name} (op #{self.seq})")


def merge_into(target: VectorClock, source: VectorClock) -> None:
    for actor, n in source.items():
        if target.get(actor, 0) < n:
            target[actor] = n


class HappensBeforeChecker:
    """Tracks accesses per buffer and raises :class:`HazardError` on an unordered conflict."""

    def __init__(self) -> None:
        self._clocks: dict[Actor, VectorClock] = {}
        self._names: dict[Actor, str] = {}
        self._history: dict[Hashable, list[Access]] = {}
        self.checked = 0  # accesses checked so far (tests assert the checker actually ran)
        # Actors come and go on a long-lived device (each engine's streams, pools and threads),
        # and every clock that learns of one gains its component: without forgetting retired
        # ones, memory and the cost of each snapshot and merge grow with every actor there ever
        # was. A sweep every max(SWEEP_MIN, live actors) new actors keeps its cost per actor
        # proportional to the live clocks' size.
        self._retiring: collections.deque = collections.deque()
        self._retained: set = set()  # swept actors whose accesses are still kept
        self._added = 0
        self._sweep_after = SWEEP_MIN

    # -- actors and clocks -------------------------------------------------------------
    def add_actor(self, actor: Actor, name: str) -> None:
        if actor not in self._clocks:
            self._added += 1
            if self._added >= self._sweep_after:
                self._sweep()
        self._clocks.setdefault(actor, {actor: 0})
        self._names[actor] = name

    def _clock(self, actor: Actor) -> VectorClock:
        clock = self._clocks.get(actor)
        if clock is None:
            raise KeyError(f"unknown actor {actor!r}; call add_actor first")
        return clock

    def tick(self, actor: Actor) -> int:
        """Advance ``actor``'s own component (one operation); returns the new stamp."""
        clock = self._clock(actor)
        clock[actor] = clock.get(actor, 0) + 1
        return clock[actor]

    def snapshot(self, actor: Actor) -> VectorClock:
        """A copy of ``actor``'s clock: what an event recorded now carries."""
        return dict(self._clock(actor))

    def restart(self, actor: Actor, snapshot: VectorClock) -> None:
        """``actor`` starts a new program that knows exactly what ``snapshot`` knows (a pool task
        starting from its submitter's clock), forgetting what its earlier programs learned.
        ``snapshot`` must have seen ``actor``'s own last stamp: its earlier accesses are then
        truly ordered before the new ones, so continuing its numbering claims no false order."""
        clock = self._clock(actor)
        own = clock.get(actor, 0)
        if snapshot.get(actor, 0) < own:
            raise ValueError(f"{self._names.get(actor, actor)} cannot restart from a clock that has not seen its "
                             f"last operation (#{own}); its next program would be taken as ordered after it")
        self._clocks[actor] = {actor: max(own, snapshot.get(actor, 0))}
        self.merge(actor, snapshot)

    def has_seen(self, snapshot: VectorClock, actor: Actor) -> bool:
        """``snapshot`` has seen every operation ``actor`` has made so far."""
        return snapshot.get(actor, 0) >= self._clock(actor).get(actor, 0)

    def merge(self, actor: Actor, snapshot: VectorClock) -> None:
        """``actor`` learns of everything ``snapshot`` has seen (a wait, sync or query), except
        the components of actors swept since the snapshot was taken (no check reads them)."""
        target, clocks, retained = self._clock(actor), self._clocks, self._retained
        for other, n in snapshot.items():
            have = target.get(other)
            if have is None:
                if other in clocks or other in retained:
                    target[other] = n
            elif have < n:
                target[other] = n

    def happened_before(self, earlier: Access, later_actor: Actor) -> bool:
        return self._clock(later_actor).get(earlier.actor, 0) >= earlier.seq

    # -- accesses ----------------------------------------------------------------------
    def access(self, actor: Actor, kind: AccessKind, buffer: Hashable, buffer_name: str, start: int, end: int,
               op: str, *, tick: bool = True) -> Access:
        """Check one access and record it. ``tick=False`` stamps it with the actor's current
        operation (for the several buffers one copy or launch touches)."""
        seq = self.tick(actor) if tick else self._clock(actor).get(actor, 0)
        new = Access(actor, self._names.get(actor, str(actor)), seq, kind, buffer, buffer_name, start, end, op)
        self.checked += 1
        history = self._history.setdefault(buffer, [])
        for old in history:
            if old.actor == actor or not new.overlaps(old):
                continue
            if not (old.kind.writes or new.kind.writes):
                continue
            if not self.happened_before(old, actor):
                raise HazardError(
                    f"unordered accesses to {buffer_name}: {old.describe()} is not ordered before "
                    f"{new.describe()}; record an event after the first and wait on it (stream.wait, "
                    f"or event.sync on the host) before the second",
                    first=old, second=new)
        if kind is AccessKind.RELEASE:
            # everything before the release is ordered (checked above); the buffer is gone
            self._history.pop(buffer, None)
            return new
        # An access ordered after the ones it covers makes them irrelevant for later checks: a
        # later access unordered with a covered one is unordered with this one too. A read
        # only supersedes reads of its own actor (other readers' reads stay independent).
        history[:] = [a for a in history
                      if not (a.start >= start and a.end <= end and (kind.writes or (a.actor == actor and not a.kind.writes))
                              and self.happened_before(a, actor))]
        history.append(new)
        return new

    def forget(self, buffer: Hashable) -> None:
        """Drop a buffer's history without a check (its device context is gone)."""
        self._history.pop(buffer, None)

    def live_buffers(self) -> int:
        return len(self._history)

    def retire(self, actor: Actor) -> None:
        """``actor`` makes no more accesses (a closed stream or pool, an ended host thread): its
        clock goes at the next sweep, and so does every clock's component for it once no kept
        access is its. Only queues it, so it is safe from any thread and from a collector's
        callback."""
        self._retiring.append(actor)

    def _sweep(self) -> None:
        """Drop the retired actors' clocks, and from every clock the components of actors that
        have no clock and no kept access (the only ones a later check reads). An event's
        snapshot taken before a sweep can still carry those: :meth:`merge` leaves out the
        components of actors with neither a clock nor a kept access."""
        while self._retiring:
            actor = self._retiring.popleft()
            self._clocks.pop(actor, None)
            self._names.pop(actor, None)
        referenced = {a.actor for history in self._history.values() for a in history}
        self._retained = referenced.difference(self._clocks)
        keep = referenced.union(self._clocks)
        for clock in self._clocks.values():
            for actor in [a for a in clock if a not in keep]:
                del clock[actor]
        self._added = 0
        self._sweep_after = max(SWEEP_MIN, len(self._clocks))

    def size(self) -> tuple[int, int]:
        """(actors with a clock, components in all their clocks)."""
        return len(self._clocks), sum(len(clock) for clock in self._clocks.values())
