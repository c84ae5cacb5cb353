"""Shared checks for the pipeline's CPU test suite (all on the simulated GPU).

The pieces:

* :class:`Item` / :func:`make_item`: an input whose payload encodes its tag, so a result that
  came from another chunk (cross-chunk contamination) or from a poisoned slot never equals
  the expected one; plus a fault marker telling the test callables where to fail.
* :class:`Harness`: builds a :class:`ringflow.Pipeline` wired to the test callables, records
  every chunk the scheduler accepts (through an instance-level wrapper of ``accept``) and
  every slot transition (through ``ringflow._testing``'s ``slot_hook``), and checks the invariants of
  docs/design.md ("Ownership rules", "Slot lifetimes") after any step: legal transitions only, a slot is reused only after its
  last owner's operations completed (a host slot goes FREE only then; a device slot may go
  FREE at enqueue but must then carry the event its next owner waits on), bounded in-flight
  work and ring occupancy,
  ``accepted == delivered + failed + cancelled + in_flight``, unique and correct deliveries,
  and, after close, every slot FREE and nothing live on the device.
* :func:`caught`: whether an outcome is one of the ways the suite catches a missing guard
  (a HazardError, a StageError caused by one, or a wrong result).

The checks read the sim's completion state through ``Event.done_at`` / ``op.done`` rather than
``is_done``: a query would order the test's thread after the event and could hide a hazard.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import threading
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

import ringflow as rf
from ringflow import _testing
from ringflow._device.sim import charge
from ringflow._errors import DeviceError, HazardError, StageError
from ringflow._pipeline.chunk import NO_ROOM
from tests.helpers.hostile import unclosed
from ringflow._pipeline.states import (
    LEGAL_SLOT_TRANSITIONS,
    ChunkState,
    RingKind,
    SlotState,
)

TAG_SHIFT = 20  # payload = tag << TAG_SHIFT | position: unique across items of < 2**20 elements
DTYPE = np.dtype(np.int64)
FAULTS = ("prepare", "compute", "consume", "oversize", "badshape")
# a KeyboardInterrupt raised by the user's own prepare, compute or consume (Ctrl-C landing in a
# callable): the chunk fails and its future raises that very KeyboardInterrupt, not a StageError
INTERRUPTS = ("interrupt-prepare", "interrupt-compute", "interrupt-consume")
# a stage that calls back into its own pipeline to wait for it (prepare submits, compute closes,
# consume maps): the call is refused, and the chunk fails with a StageError caused by that
# RuntimeError
REENTRIES = ("reenter-prepare", "reenter-compute", "reenter-consume")


class NotRefused(Exception):
    """A test stage's call back into its own pipeline returned instead of being refused."""


HOST_RINGS = (RingKind.HOST_IN, RingKind.HOST_OUT)
LAST_USES = {  # the operations of a chunk that use each kind of slot
    RingKind.HOST_IN: ("prepare_task", "h2d_event"),
    RingKind.DEVICE_IN: ("h2d_event", "compute_event"),
    RingKind.DEVICE_OUT: ("compute_event", "d2h_event"),
    RingKind.DEVICE_INPLACE: ("h2d_event", "compute_event", "d2h_event"),
    RingKind.HOST_OUT: ("d2h_event", "consume_task"),
}


class MarkedFault(Exception):
    """The exception a test callable raises for an item marked to fail."""


def interrupt_for(stage: str, tag: int) -> KeyboardInterrupt:
    """The KeyboardInterrupt a test callable raises for an item marked ``interrupt-<stage>``; its
    message names the tag, so a future that raised another chunk's interrupt is caught."""
    return KeyboardInterrupt(f"interrupt in {stage} for tag {tag}")


@dataclasses.dataclass(frozen=True, eq=False)
class Item:
    tag: int
    arr: np.ndarray
    fault: str | None = None  # one of FAULTS, or None
    consume_cost: float = 0.0  # virtual CPU seconds the consumer charges

    @property
    def expected(self) -> np.ndarray:
        return expected_of(self.arr)


def payload(tag: int, n: int) -> np.ndarray:
    return (np.int64(tag) << TAG_SHIFT) + np.arange(n, dtype=np.int64)


def make_item(tag: int, n: int, fault: str | None = None, consume_cost: float = 0.0) -> Item:
    return Item(tag, payload(tag, n), fault, consume_cost)


def compute_f(x, y) -> None:
    """The device function of the tests: elementwise, so f(chunk) == f(whole)[chunk]."""
    y[...] = x * 3 + 1


def expected_of(arr: np.ndarray) -> np.ndarray:
    out = np.empty_like(arr)
    compute_f(arr, out)
    return out


def tag_of(x: np.ndarray) -> int | None:
    return int(x.reshape(-1)[0]) >> TAG_SHIFT if x.size else None


class Callables:
    """prepare / compute / consume for :class:`Item` inputs, failing where an item is marked."""

    def __init__(self, chunk_bytes: int, compute_seconds: float = 5e-6):
        self.chunk_bytes = chunk_bytes
        self.compute_faults: set[int] = set()
        self.badshape: set[int] = set()
        self.compute_interrupts: set[int] = set()
        self.compute_reentries: set[int] = set()
        self.compute_calls = 0
        self.pipe: Any = None  # the pipeline these stages belong to, for the reentry faults

        def compute(x, y):
            self.compute_calls += 1
            tag = tag_of(x)
            if tag in self.compute_faults:
                raise MarkedFault(f"compute fault for tag {tag}")
            if tag in self.compute_interrupts:
                raise interrupt_for("compute", tag)
            if tag in self.compute_reentries:
                self.pipe.close()
                raise NotRefused(f"compute of tag {tag} closed its own pipeline")
            if tag in self.badshape:
                y[...] = np.zeros(x.shape[0] + 1, x.dtype)  # wrong shape: broadcast fails
                return
            compute_f(x, y)

        compute.sim_seconds = compute_seconds
        self.compute = compute

    def register(self, item: Item) -> Item:
        if item.fault == "compute":
            self.compute_faults.add(item.tag)
        elif item.fault == "badshape":
            self.badshape.add(item.tag)
        elif item.fault == "interrupt-compute":
            self.compute_interrupts.add(item.tag)
        elif item.fault == "reenter-compute":
            self.compute_reentries.add(item.tag)
        return item

    def prepare(self, item: Item) -> np.ndarray:
        if item.fault == "prepare":
            raise MarkedFault(f"prepare fault for tag {item.tag}")
        if item.fault == "interrupt-prepare":
            raise interrupt_for("prepare", item.tag)
        if item.fault == "reenter-prepare":
            self.pipe.submit(item.arr)
            raise NotRefused(f"prepare of tag {item.tag} submitted to its own pipeline")
        if item.fault == "oversize":  # more bytes than a slot holds
            return np.zeros(self.chunk_bytes // DTYPE.itemsize + 1, DTYPE)
        return item.arr

    def consume(self, index: int, item: Item, view: np.ndarray) -> Result:
        if item.consume_cost:
            charge(item.consume_cost)
        if item.fault == "consume":
            raise MarkedFault(f"consume fault for tag {item.tag}")
        if item.fault == "interrupt-consume":
            raise interrupt_for("consume", item.tag)
        if item.fault == "reenter-consume":
            list(self.pipe.map([item.arr]))
            raise NotRefused(f"consume of tag {item.tag} mapped on its own pipeline")
        assert not view.flags.writeable, "the consumer must get a read-only view"
        return Result(index, item.tag, np.array(view, copy=True))


@dataclasses.dataclass(frozen=True)
class Result:
    index: int  # the chunk index the pipeline passed to consume
    tag: int  # the tag of the item the pipeline passed to consume
    data: np.ndarray


def expected_error(item: Item) -> tuple[str, type]:
    """(stage, type of __cause__) of the StageError a marked item must end with."""
    return {
        "prepare": ("prepare", MarkedFault),
        "compute": ("compute", MarkedFault),
        "consume": ("consume", MarkedFault),
        "oversize": ("prepare", ValueError),
        "badshape": ("compute", ValueError),
        "interrupt-prepare": ("prepare", KeyboardInterrupt),
        "interrupt-compute": ("compute", KeyboardInterrupt),
        "interrupt-consume": ("consume", KeyboardInterrupt),
        "reenter-prepare": ("prepare", RuntimeError),
        "reenter-compute": ("compute", RuntimeError),
        "reenter-consume": ("consume", RuntimeError),
    }[item.fault]


# -- outcome classification for guard tests -------------------------------------------------------
def caused_by_hazard(exc: BaseException) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, HazardError):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def caught(outcome: BaseException | bool | None) -> bool:
    """A missing guard is caught when the run raised a HazardError (directly or as the cause of
    a StageError), or its output was wrong (``outcome is False``)."""
    if outcome is False:
        return True
    if isinstance(outcome, BaseException):
        return caused_by_hazard(outcome)
    return False


# -- the harness ---------------------------------------------------------------------------------
class InvariantError(AssertionError):
    pass


class Harness:
    """A pipeline under observation. Every check raises :class:`InvariantError` (an
    AssertionError) naming what broke."""

    def __init__(self, *, seed: int = 0, chaos: bool = True, slots: int | rf.SlotCounts = 2,
                 chunk_bytes: int = 1024, max_in_flight: int | None = None, ordered: bool = True,
                 on_error: str = "raise", inplace: bool = False, workers: int = 2, checked: bool = True,
                 compute_seconds: float = 5e-6, device=None, disabled_guards: Iterable[str] = (),
                 on_transition: Callable | None = None, check_fences: bool = True):
        self.dev = device if device is not None else rf.device("sim", seed=seed, chaos=chaos)
        self.calls = Callables(chunk_bytes, compute_seconds)
        self.transitions: list[tuple[RingKind, int, SlotState, SlotState]] = []
        self.illegal: list[str] = []
        self.early_release: list[str] = []
        self._last_owner: dict = {}  # (ring kind, slot index) -> the chunk that last held a device slot
        self.on_transition = on_transition
        self.check_fences = check_fences and not disabled_guards
        self.chunks: dict[int, Any] = {}  # every chunk ever accepted, by index
        self.items: dict[int, Item] = {}  # tag -> item
        self.verified: set[int] = set()
        with _testing.inject(guards_off=disabled_guards, slot_hook=self._hook):
            self.pipe = rf.Pipeline(self.calls.compute, device=self.dev, prepare=self.calls.prepare,
                                    consume=self.calls.consume, slots=slots, chunk_bytes=chunk_bytes,
                                    max_in_flight=max_in_flight, ordered=ordered, on_error=on_error,
                                    inplace=inplace, workers=workers, checked=checked)
        self.calls.pipe = self.pipe
        self.sched = self.pipe.scheduler
        accept = self.sched.accept
        # an accept takes the scheduler's batch lock, not the driver's: reentrant here, so that a
        # chunk is recorded below in the same critical section that puts it in the inbox, and
        # check() (which holds it too) never counts a chunk accepted but not yet recorded
        self.sched.batch_lock = threading.RLock()

        def recording_accept(item, *args, **kw):
            with self.sched.batch_lock:
                chunk = accept(item, *args, **kw)
                if chunk is NO_ROOM:  # nothing accepted
                    return chunk
                if chunk.index in self.chunks:
                    raise InvariantError(f"chunk index {chunk.index} handed out twice")
                self.chunks[chunk.index] = chunk
            return chunk

        self.sched.accept = recording_accept  # instance attribute: map() and submit() call it
        self.closed = False
        self.final: dict[int, ChunkState] | None = None  # set once closed and checked

    # -- items --------------------------------------------------------------------------------
    def item(self, tag: int, n: int, fault: str | None = None, consume_cost: float = 0.0) -> Item:
        if n == 0 and fault in ("compute", "badshape"):
            fault = None  # a zero-length chunk runs no compute, so it cannot fail there
        it = self.calls.register(make_item(tag, n, fault, consume_cost))
        self.items[tag] = it
        return it

    # -- the slot hook ------------------------------------------------------------------------
    def _hook(self, kind: RingKind, slot, old: SlotState, new: SlotState) -> None:
        self.transitions.append((kind, slot.index, old, new))
        if (old, new) not in LEGAL_SLOT_TRANSITIONS[kind]:
            self.illegal.append(f"{kind.value} slot {slot.index}: {old.name} -> {new.name}")
        if self.check_fences and self.sched.broken is None:
            self._check_reuse(kind, slot, old, new)
        if self.on_transition is not None:
            self.on_transition(kind, slot, old, new)

    def _check_reuse(self, kind: RingKind, slot, old: SlotState, new: SlotState) -> None:
        """A slot is reused only after every operation of its last owner completed.

        A host slot (the CPU fills or reads it) goes FREE only once those have completed. A
        device slot may go FREE as soon as its last operation is enqueued, provided it carries
        an event (``Slot.ready``) that its next owner's stream waits on: so when it is taken
        again, either the last owner's operations have completed or such an event is pending.
        (That the wait really orders the reuse is the sim checker's part.)"""
        key = (kind, slot.index)
        if new is SlotState.FREE:
            if kind in HOST_RINGS:
                self._check_done(kind, slot, slot.owner, "went FREE")
            else:
                self._last_owner[key] = slot.owner
        elif old is SlotState.FREE and kind not in HOST_RINGS:
            previous = self._last_owner.get(key)
            if previous is not None and slot.ready is None:
                self._check_done(kind, slot, previous, f"was taken by chunk {slot.owner} with no ready event")

    def _check_done(self, kind: RingKind, slot, owner: int | None, what: str) -> None:
        chunk = self.chunks.get(owner)
        if chunk is None:
            return
        for name in LAST_USES[kind]:
            w = getattr(chunk, name)
            if w is not None and not _done(w):
                self.early_release.append(f"{kind.value} slot {slot.index} of chunk {chunk.index} {what} "
                                          f"before its {name} completed")

    # -- invariants ---------------------------------------------------------------------------
    def check(self) -> None:
        """The invariants that hold after every step. Holds the pipeline's lock, so other threads
        (submitters, the progress thread) cannot change the state half way through."""
        with self.pipe._driver.cv, self.sched.batch_lock:  # (no accept half recorded meanwhile)
            self._check()

    def _check(self) -> None:
        if self.illegal:
            raise InvariantError(f"illegal slot transitions: {self.illegal[:5]}")
        if self.early_release:
            raise InvariantError(f"slots released early: {self.early_release[:5]}")
        s = self.pipe.stats()
        if not s.balanced():
            raise InvariantError(f"stats unbalanced: {s}")
        cfg = self.pipe.config
        if s.in_flight > cfg.max_in_flight:
            raise InvariantError(f"{s.in_flight} chunks in flight, bound {cfg.max_in_flight}")
        if s.in_flight + self.sched.unclaimed > cfg.max_in_flight:
            raise InvariantError(f"{s.in_flight} in flight + {self.sched.unclaimed} unclaimed > {cfg.max_in_flight}")
        handed_out = len(self.final) if self.final is not None else len(self.chunks)
        if s.accepted != handed_out:
            raise InvariantError(f"stats say {s.accepted} accepted, {handed_out} were handed out")
        if self.final is not None:  # closed and checked; the chunk objects are gone
            return
        if not self.closed:
            live = self.sched.chunks
            for ring in self.sched.rings:
                if ring.busy_count > len(ring):
                    raise InvariantError(f"{ring.kind.value}: {ring.busy_count} busy of {len(ring)}")
                free_ids = {id(x) for x in ring._free}
                if len(free_ids) != ring.free_count:
                    raise InvariantError(f"{ring.kind.value}: a slot is on the free list twice")
                for slot in ring.slots:
                    if (slot.state is SlotState.FREE) != (id(slot) in free_ids):
                        raise InvariantError(f"{slot!r}: state and free list disagree")
                    if slot.state is SlotState.FREE:
                        if slot.owner is not None or slot.fence is not None:
                            raise InvariantError(f"{slot!r} is FREE but has an owner or a fence")
                    elif not self.sched._guard_off:
                        owner = live.get(slot.owner)
                        if owner is None:
                            # a chunk cancelled while its prepare runs ends at once; its host-in
                            # slot drains until the prepare task returns
                            if slot.state is not SlotState.DRAINING or slot.fence is None:
                                raise InvariantError(f"{slot!r} is busy but its chunk has ended")
                            continue
                        if not any(x is slot for x in owner.slots()):
                            raise InvariantError(f"{slot!r} is owned by chunk {slot.owner}, which does not hold it")
            for index, chunk in live.items():
                if chunk.state.final:
                    raise InvariantError(f"chunk {index} is final but still in flight")
        counts = {st: 0 for st in (ChunkState.DELIVERED, ChunkState.FAILED, ChunkState.CANCELLED)}
        waiting = {c.index for c in self.sched.inbox}  # accepted, handed over, not yet admitted
        for index, chunk in self.chunks.items():
            final = chunk.state.final
            if final == (index in self.sched.chunks or index in waiting):
                raise InvariantError(f"chunk {index} in state {chunk.state.name} is "
                                     f"{'still' if final else 'not'} in flight")
            if final:
                counts[chunk.state] += 1
                if not chunk.future.done():
                    raise InvariantError(f"chunk {index} ended {chunk.state.name} but its future is pending")
                if index not in self.verified:
                    self._verify_final(chunk)
                    self.verified.add(index)
        if (counts[ChunkState.DELIVERED], counts[ChunkState.FAILED], counts[ChunkState.CANCELLED]) != \
                (s.delivered, s.failed, s.cancelled):
            raise InvariantError(f"chunk states {counts} disagree with {s}")

    def _verify_final(self, chunk) -> None:
        item: Item = chunk.item
        fut = chunk.future
        if chunk.state is ChunkState.DELIVERED:
            if item.fault is not None:
                raise InvariantError(f"chunk {chunk.index} (fault {item.fault}) was delivered")
            check_result(chunk.value, item, chunk.index)
            kind, value = future_outcome(fut)
            if kind != "value" or value is not chunk.value:
                raise InvariantError(f"chunk {chunk.index} delivered but its future disagrees")
        elif chunk.state is ChunkState.FAILED:
            kind, err = future_outcome(fut)
            if kind != "error" or err is not chunk.error:
                raise InvariantError(f"chunk {chunk.index}: future holds {err!r}, chunk {chunk.error!r}")
            if isinstance(err, DeviceError) and err.sticky:
                return
            check_chunk_error(err, item, chunk.index)
        else:
            if not fut.cancelled():
                raise InvariantError(f"chunk {chunk.index} CANCELLED but its future is not")

    def final_states(self) -> dict[int, ChunkState]:
        if self.final is not None:
            return dict(self.final)
        return {i: c.state for i, c in self.chunks.items()}

    # -- ending -------------------------------------------------------------------------------
    def close(self) -> list:
        """Close, then check every slot is FREE and nothing is live on the device. Returns the
        warnings raised while closing (a HazardError swallowed by a close is a failure)."""
        with warnings.catch_warnings(record=True) as caught_warnings:
            warnings.simplefilter("always")
            self.pipe.close()
        self.closed = True
        broken = self.sched.broken is not None or getattr(self.dev, "_sticky", None) is not None
        bad = [str(w.message) for w in caught_warnings if "HazardError" in str(w.message)]
        if bad and not broken:
            raise InvariantError(f"close hid a hazard: {bad}")
        self.check_closed()
        return caught_warnings

    def check_closed(self) -> None:
        s = self.pipe.stats()
        if s.in_flight != 0 or self.sched.chunks:
            raise InvariantError(f"in flight after close: {s}")
        for kind, state in self._slot_states().items():
            if state is not SlotState.FREE:
                raise InvariantError(f"{kind} is {state.name} after close")
        self._check()
        # the recorded chunks hold their events; keep only their final states from here on
        self.final = self.final_states()
        errors = [c.error for c in self.chunks.values()] + self.pipe.failures + [self.sched.first_error,
                                                                                 self.sched.broken]
        # a failed launch's error also stays on the sim's ops (its event's, and its stream's last)
        errors += [getattr(getattr(e, "_op", None), "error", None)
                   for c in self.chunks.values() for e in (c.h2d_event, c.compute_event, c.d2h_event)]
        # and a host task keeps its callable's exception (a cancelled chunk's prepare, say)
        errors += [getattr(t, "_exc", None) for c in self.chunks.values() for t in (c.prepare_task, c.consume_task)]
        for stream in (self.sched.streams.h2d, self.sched.streams.compute, self.sched.streams.d2h):
            errors.append(getattr(getattr(getattr(stream, "_queue", None), "last", None), "error", None))
        self.chunks = {}
        drop_tracebacks(errors)
        del errors
        live = self.dev.live()
        for _ in range(3):  # objects in reference cycles need the collector (a full pass is slow:
            if not live.total or not gc.collect():  # only when something is still live)
                break
            live = self.dev.live()
        if self.sched.broken is None and getattr(self.dev, "_sticky", None) is None:
            if live.total != 0:
                raise InvariantError(f"live after close: {live} (events are freed with the objects holding them: "
                                     "a test that keeps an exception or its traceback keeps chunks alive)")
            if unclosed(self.dev):  # released, but by the collector: a close missed on some path
                raise InvariantError(f"collected unclosed: {self.dev.collected_unclosed()}")
        elif live.streams:
            # a dead context cannot run the work that would let buffers go (poison fills never
            # complete), so only the streams are sure to be gone
            raise InvariantError(f"live after close (broken pipeline): {live}")

    def _slot_states(self) -> dict[str, SlotState]:
        # the rings are dropped from the scheduler on close; the transitions say where each ended
        last: dict[str, SlotState] = {}
        for kind, index, _old, new in self.transitions:
            last[f"{kind.value} slot {index}"] = new
        return last


def drop_tracebacks(errors: Iterable[BaseException | None]) -> None:
    """Forget the tracebacks of ``errors`` and their causes.

    The sim runs host tasks and kernels inside the caller's own stack (in virtual time), so an
    exception raised there keeps every frame below it alive through its traceback: the
    scheduler's frames, the chunks in their locals, and those chunks' events. (A real worker
    thread's traceback ends at the thread, not in the scheduler.) Dropping the tracebacks lets
    the live-object count after close mean what it should."""
    seen = set()
    stack = [e for e in errors if e is not None]
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        stack.extend(x for x in (e.__cause__, e.__context__) if x is not None)


def _done(w) -> bool:
    op = getattr(w, "_op", None) or getattr(w, "op", None)
    if op is not None:
        return op.done
    return bool(w.is_done)


def check_result(value: Any, item: Item, index: int | None = None) -> None:
    if not isinstance(value, Result):
        raise InvariantError(f"chunk {index}: consumer value {value!r} is not a Result")
    if index is not None and value.index != index:
        raise InvariantError(f"chunk {index}: consume got index {value.index}")
    if value.tag != item.tag:
        raise InvariantError(f"chunk {index}: consume got item {value.tag}, expected {item.tag}")
    exp = item.expected
    if value.data.shape != exp.shape or value.data.dtype != exp.dtype or not np.array_equal(value.data, exp):
        raise InvariantError(f"chunk {index} (tag {item.tag}, {item.arr.size} elements): wrong payload; "
                             f"first bad element at {_first_diff(value.data, exp)}")


def check_stage_error(err: BaseException, item: Item, index: int) -> None:
    if not isinstance(err, StageError):
        raise InvariantError(f"chunk {index} failed with {err!r}, not a StageError")
    if caused_by_hazard(err):
        raise InvariantError(f"chunk {index} failed with a hazard: {err!r}")
    if item.fault is None:
        raise InvariantError(f"chunk {index} (no fault) failed: {err!r}")
    stage, cause = expected_error(item)
    if err.stage != stage or err.index != index or not isinstance(err.__cause__, cause):
        raise InvariantError(f"chunk {index} (fault {item.fault}): expected StageError({stage}, {index}) caused "
                             f"by {cause.__name__}, got stage={err.stage} index={err.index} "
                             f"cause={err.__cause__!r}")


def check_chunk_error(err: BaseException, item: Item, index: int) -> None:
    """What a failed chunk's future raises: the original KeyboardInterrupt for an item marked
    ``interrupt-<stage>`` (that item's own, by its message), a StageError otherwise."""
    if item.fault in INTERRUPTS:
        stage = item.fault.split("-", 1)[1]
        if type(err) is not KeyboardInterrupt or str(err) != str(interrupt_for(stage, item.tag)):
            raise InvariantError(f"chunk {index} (fault {item.fault}, tag {item.tag}) raised {err!r}, "
                                 f"not its own KeyboardInterrupt")
        return
    check_stage_error(err, item, index)


def _first_diff(a: np.ndarray, b: np.ndarray):
    if a.shape != b.shape:
        return f"shape {a.shape} vs {b.shape}"
    bad = np.flatnonzero(a.reshape(-1) != b.reshape(-1))
    return f"{bad[0]} ({a.reshape(-1)[bad[0]]} != {b.reshape(-1)[bad[0]]})" if bad.size else "none"


def future_outcome(fut: concurrent.futures.Future):
    """('value', v) / ('error', e) / ('cancelled', None) of a done future, read without driving
    the pipeline (a ChunkFuture's own result() would step the scheduler)."""
    if fut.cancelled():
        return "cancelled", None
    err = concurrent.futures.Future.exception(fut, timeout=0)
    return ("error", err) if err is not None else ("value", concurrent.futures.Future.result(fut, timeout=0))


# -- a whole run, for sweeps and guard tests -------------------------------------------------------
def random_costs(rng: np.random.Generator, n: int, choices=(0.0, 0.0, 5e-6, 40e-6)) -> list[float]:
    return [float(c) for c in rng.choice(choices, n)]


def random_sizes(rng: np.random.Generator, n: int, max_elems: int, zero_frac: float = 0.05) -> list[int]:
    sizes = rng.integers(1, max_elems + 1, n)
    sizes[rng.random(n) < zero_frac] = 0
    return [int(s) for s in sizes]


def map_skipping_faults(h: Harness, items: list[Item]) -> list[Item]:
    """Map ``items`` through a pipeline made with ``on_error="continue"`` and check the outcome:
    the items without a fault come back in order, each right, and every faulty item left exactly
    one StageError naming its stage and index. Returns the good items."""
    got = list(h.pipe.map(items))
    good = [it for it in items if it.fault is None]
    assert [v.tag for v in got] == [it.tag for it in good]
    for value in got:
        check_result(value, h.items[value.tag])
    assert len(h.pipe.failures) == len(items) - len(good)
    for err in h.pipe.failures:
        check_stage_error(err, items[err.index], err.index)
    return good


def run_map(h: Harness, sizes: list[int], *, start_tag: int = 1, costs: list[float] | None = None) -> list:
    """Run ``sizes`` through ``h.pipe.map`` and verify every result (order too when ordered).
    ``costs``: virtual seconds each item's consumer charges (varied costs make consumers finish
    out of order). Returns the results; raises InvariantError on any wrong one."""
    costs = costs if costs is not None else [0.0] * len(sizes)
    items = [h.item(start_tag + i, n, consume_cost=c) for i, (n, c) in enumerate(zip(sizes, costs))]
    out = []
    for k, value in enumerate(h.pipe.map(items)):
        if h.pipe.config.ordered:
            check_result(value, items[k])
        else:
            check_result(value, h.items[value.tag])
        out.append(value)
    if len(out) != len(items):
        raise InvariantError(f"{len(out)} results for {len(items)} items")
    if not h.pipe.config.ordered and sorted(r.tag for r in out) != [it.tag for it in items]:
        raise InvariantError("unordered map lost or duplicated results")
    return out


def guard_outcome(run: Callable[[], bool]) -> BaseException | bool:
    """Run ``run`` (True: every output right) and classify: True, False (wrong data) or the
    exception it raised."""
    with warnings.catch_warnings():
        # a run stopped by a hazard leaves its pipeline unsettled: closing it finds the same
        # hazard again and warns. Collect it here, under this filter, rather than in whichever
        # later test the garbage collector happens to run
        warnings.simplefilter("ignore")
        try:
            return bool(run())
        except InvariantError:
            return False
        except Exception as exc:  # noqa: BLE001 - classified by the caller
            e: BaseException | None = exc
            seen = set()
            while e is not None and id(e) not in seen:  # the tracebacks hold the run's frames, and so its pipeline
                seen.add(id(e))
                e.__traceback__ = None
                e = e.__cause__ or e.__context__
            return exc
        finally:
            gc.collect()


def copy_failing_on_call(n: int, exc: BaseException) -> Callable:
    """A compute ``f(x, y)`` that copies ``x`` into ``y`` and raises a new exception like ``exc``
    (same type and arguments: one raised object would keep its traceback, and so the frames and
    events of the failed call, alive) on its ``n``-th call, counting every chunk of every job."""
    calls = []

    def f(x, y):
        calls.append(1)
        if len(calls) == n:
            raise type(exc)(*exc.args)
        y[...] = x

    return f


def check_map_refuses_not_iterable(pipe: Any, items: Any) -> None:
    """``pipe.map(items)`` raises at the call, and ``pipe.amap(items)`` at its first step, the
    TypeError that names ``items``; nothing of either is left running."""
    import asyncio

    import pytest

    with pytest.raises(TypeError, match="items must be an iterable of items"):
        pipe.map(items)  # at the call, not at the first next()

    async def first():
        async for r in pipe.amap(items):
            return r

    with pytest.raises(TypeError, match="items must be an iterable of items"):
        asyncio.run(first())


def closed_clean(devices: Iterable[Any], pipe: Any) -> None:
    """Close ``pipe`` (bounded) and check that every accepted chunk ended (stats balanced,
    nothing in flight) and that nothing is left live on any of ``devices`` once the failures'
    tracebacks are dropped."""
    from tests.helpers.threads import bounded

    bounded(pipe.close)
    s = pipe.stats()
    assert s.in_flight == 0 and s.balanced(), s
    drop_tracebacks(pipe.failures)
    gc.collect()
    for dev in devices:
        assert dev.live().total == 0, dev.live()
        assert unclosed(dev) == 0, dev.collected_unclosed()  # none left to the collector


def take_all(pipe: Any, items: Any, face: str) -> list:
    """Every result of ``items`` through ``pipe``'s ``face``: ``"map"``, or ``"amap"`` in an
    event loop of its own."""
    if face == "map":
        return list(pipe.map(items))
    if face != "amap":
        raise ValueError(f"face must be 'map' or 'amap', got {face!r}")

    async def main() -> list:
        return [r async for r in pipe.amap(items)]
    return asyncio.run(main())


def check_kept_slot_items(pipe: Any, count: int, check_result: Callable[[int, Any], None]) -> None:
    """Submit items ``0..count-1`` to ``pipe`` (``on_error="continue"``), whose prepare returns
    an ``empty_slot`` array it kept from its first call: every item that failed must have failed
    with the ValueError naming another item's slot and ``empty_slot``; every other one (it landed
    in that same slot again) must pass ``check_result(i, result)``; some must have failed."""
    futs = [pipe.submit(i) for i in range(count)]
    outcomes = [fu.exception(timeout=30) for fu in futs]
    failures = {e.index: e.__cause__ for e in pipe.failures}
    assert set(failures) == {i for i, o in enumerate(outcomes) if o is not None}
    for i, fu in enumerate(futs):
        if i in failures:
            assert type(failures[i]) is ValueError, repr(failures[i])
            assert "another item's slot" in str(failures[i]) and "empty_slot" in str(failures[i]), str(failures[i])
        else:
            check_result(i, fu.result())
    assert failures, "every item landed in the first one's slot: the test needs items in other slots"
