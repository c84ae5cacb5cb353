"""The discrete-event core of the simulated GPU: queues, resources and virtual time.

An :class:`Op` sits in a FIFO queue (a stream, or a host worker pool); it starts once the op
before it in its queue is done, every op it depends on is done, and its resource has a free
unit. Copies are fluid: an active copy moves bytes at a rate read from the profile, and the
H2D and D2H copies running at once share the link (their rates are scaled so the sum stays
within the duplex bandwidth), so rates are recomputed whenever the set of running copies
changes. Everything else takes a fixed duration. An op's effect (``on_start`` for host tasks,
``on_complete`` for device work) runs at that instant of virtual time, so data moves when an
operation completes, never when it is enqueued.

Virtual time only moves when the host lets it: :meth:`Engine.advance` (host overhead, a
sync, a wait). With ``chaos`` a seeded generator stretches or shrinks every duration, which
reorders completions only where no dependency forbids it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections import deque
from typing import Callable, Optional


EPS = 1e-15


@dataclasses.dataclass(eq=False)
class Op:
    queue: "Queue"
    label: str
    resource: Optional[str] = None  # None: no resource, completes at start
    seconds: float = 0.0  # fixed duration (non-copy ops)
    nbytes: int = 0  # copies: bytes to move on the link
    direction: Optional[str] = None  # 'h2d' | 'd2h' for link copies
    deps: list = dataclasses.field(default_factory=list)
    on_start: Optional[Callable[["Op"], None]] = None
    on_complete: Optional[Callable[["Op"], None]] = None
    seq: int = 0
    enqueued_at: float = 0.0
    started_at: Optional[float] = None
    done_at: Optional[float] = None
    remaining: float = 0.0  # bytes (copies) or seconds left
    rate: float = 0.0
    error: Optional[BaseException] = None
    speed: float = 1.0  # chaos factor on a copy's rate

    @property
    def done(self) -> bool:
        return self.done_at is not None


class Queue:
    """A FIFO of ops: a stream, or one host worker pool (whose ops share ``lanes`` units)."""

    def __init__(self, name: str):
        self.name = name
        self.priority = 0  # a stream's priority: lower runs its kernels first (as in CUDA)
        self.pending: deque[Op] = deque()
        self.last: Optional[Op] = None  # most recently enqueued op (for stream order)
        self.resource: Optional[str] = None  # the lanes its ops share (a worker pool's), if its own

    def __repr__(self) -> str:
        return f"Queue({self.name})"


class Engine:
    def __init__(self, profile, *, seed: int = 0, chaos: bool = False):
        self.profile = profile
        self.now = 0.0
        self.chaos = chaos
        self.rng = random.Random(seed)
        self._seq = itertools.count()
        self._capacity: dict[str, int] = {"h2d": 1, "d2h": 1, "d2d": 1, "compute": 1}
        self._busy: dict[str, int] = {k: 0 for k in self._capacity}
        self._queues: list[Queue] = []
        self._running: list[Op] = []
        self._unordered_queues: set[Queue] = set()  # queues whose ops need not start in order
        self.completed = 0
        self.on_op_done: list[Callable[[Op], None]] = []  # observers (the tracer)

    # -- set-up --------------------------------------------------------------------------
    def add_queue(self, name: str, *, resource: Optional[str] = None, lanes: int = 0) -> Queue:
        q = Queue(name)
        self._queues.append(q)
        if resource is not None:
            self._capacity[resource] = lanes
            self._busy[resource] = 0
            self._unordered_queues.add(q)
            q.resource = resource
        return q

    def remove_queue(self, q: Queue) -> None:
        if q in self._queues and not q.pending:
            self._queues.remove(q)
            self._unordered_queues.discard(q)
            # a long-lived device makes a pool per engine it builds: its lanes go with its queue
            # (kept while an op of it still runs, whose end counts its lane free)
            if q.resource is not None and not self._busy.get(q.resource):
                self._capacity.pop(q.resource, None)
                self._busy.pop(q.resource, None)

    # -- enqueue -------------------------------------------------------------------------
    def enqueue(self, op: Op) -> Op:
        q = op.queue
        if q not in self._unordered_queues and q.last is not None and not q.last.done:
            op.deps.append(q.last)  # stream order: start after the op before it
        op.seq = next(self._seq)
        op.enqueued_at = self.now
        if op.nbytes:
            op.remaining = float(op.nbytes)
            if self.chaos:
                s = self.profile.chaos_spread
                op.speed = 1.0 / (1.0 + self.rng.uniform(-s, s))
        else:
            op.remaining = self._jitter(op.seconds)
        q.pending.append(op)
        q.last = op
        return op

    def _jitter(self, seconds: float) -> float:
        if not self.chaos or seconds <= 0:
            return seconds
        s = self.profile.chaos_spread
        return seconds * (1.0 + self.rng.uniform(-s, s))

    # -- time ------------------------------------------------------------------------------
    def idle(self) -> bool:
        return not self._running and not any(q.pending for q in self._queues)

    def advance(self, until: float, stop: Optional[Callable[[], bool]] = None) -> bool:
        """Run the device up to virtual time ``until`` (``math.inf``: until ``stop`` or idle).

        Returns True as soon as ``stop()`` holds (time stops at that instant), else False
        with ``now == until``. Raises RuntimeError if ``until`` is infinite and nothing can
        ever make ``stop`` true.
        """
        while True:
            self._start_ready()
            if stop is not None and stop():
                return True
            t_next = self._next_completion()
            if t_next > until or math.isinf(t_next):  # inf > inf is False: nothing running is caught here too
                if math.isinf(until):
                    raise RuntimeError(
                        "the simulated device is idle and the awaited work can never complete: "
                        "something waits on an event or task that nothing will finish")
                self._progress(until - self.now)
                self.now = until
                return False
            self._progress(t_next - self.now)
            self.now = t_next
            self._complete_finished()

    def _next_completion(self) -> float:
        best = math.inf
        for op in self._running:
            if op.rate > 0:
                best = min(best, self.now + op.remaining / op.rate)
        return best

    def _progress(self, dt: float) -> None:
        if dt <= 0:
            return
        for op in self._running:
            op.remaining -= op.rate * dt

    def _complete_finished(self) -> None:
        finished = [op for op in self._running if op.remaining <= max(EPS, 1e-12 * (op.nbytes or 1))]
        if not finished:
            # guard against float drift: finish the op closest to done
            finished = [min(self._running, key=lambda o: o.remaining / o.rate)]
        for op in sorted(finished, key=lambda o: o.seq):
            self._running.remove(op)
            if op.resource is not None:
                self._busy[op.resource] -= 1
            self._finish(op)
        self._recompute_rates()

    def _finish(self, op: Op) -> None:
        op.done_at = self.now
        op.remaining = 0.0
        self.completed += 1
        if op.on_complete is not None:
            op.on_complete(op)
        for observer in self.on_op_done:
            observer(op)
        # A done op orders nothing and runs nothing again: drop what it reaches (the ops before
        # it, the closures over buffers), so an event kept for ordering (a slot's ``ready``)
        # does not keep the whole history of the stream, and its memory, alive.
        op.deps = []
        op.on_start = op.on_complete = None
        if op.queue.last is op:
            op.queue.last = None

    def _start_ready(self) -> None:
        progressed = True
        while progressed:
            progressed = False
            candidates = []
            for q in self._queues:
                if not q.pending:
                    continue
                ops = list(q.pending) if q in self._unordered_queues else [q.pending[0]]
                for op in ops:
                    if all(d.done for d in op.deps) and (op.resource is None or
                                                         self._busy[op.resource] < self._capacity[op.resource]):
                        candidates.append(op)
                        if q in self._unordered_queues:
                            break  # a pool starts its tasks in submission order
            if not candidates:
                break
            if self.chaos:
                self.rng.shuffle(candidates)
            else:
                candidates.sort(key=lambda o: o.seq)
            # among ready kernels the higher-priority stream's goes first (a stable sort keeps the
            # order above within one priority); copy engines take no notice of priority, as in CUDA
            candidates.sort(key=lambda o: o.queue.priority if o.resource == "compute" else 0)
            for op in candidates:
                if op.resource is not None and self._busy[op.resource] >= self._capacity[op.resource]:
                    continue
                self._start(op)
                progressed = True
        self._recompute_rates()

    def _start(self, op: Op) -> None:
        op.queue.pending.remove(op)
        op.started_at = self.now
        if op.on_start is not None:
            op.on_start(op)  # may change op.remaining (a host task charging its cost)
        if op.resource is None or (op.remaining <= 0 and not op.nbytes):
            self._finish(op)
            return
        self._busy[op.resource] += 1
        self._running.append(op)

    def _recompute_rates(self) -> None:
        p = self.profile
        copies = [op for op in self._running if op.direction in ("h2d", "d2h")]
        alone = {id(op): p.copy_GBps(op.direction, op.nbytes) * 1e9 for op in copies}
        directions = {op.direction for op in copies}
        scale = 1.0
        if len(directions) == 2:
            total = sum(alone.values())
            scale = min(1.0, p.duplex_GBps * 1e9 / total)
        for op in self._running:
            if op.direction in ("h2d", "d2h"):
                op.rate = alone[id(op)] * scale * op.speed
            elif op.nbytes:
                op.rate = p.device_GBps * 1e9 / 2 * op.speed  # device-to-device: read + write
            else:
                op.rate = 1.0  # seconds of work per second
