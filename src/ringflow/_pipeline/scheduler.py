"""The scheduler: moves chunks through prepare -> h2d -> compute -> d2h -> consume.

Its driver (:mod:`.driver`: a pipeline's progress thread, or a whole-array call's caller) calls
:meth:`Scheduler.step` and waits on :meth:`Scheduler.pending_fences`; CPU stages run on a worker
pool and GPU stages on three streams. Two rules make it correct:

* **Hand-offs by events.** After each GPU operation an event is recorded; the next stage's
  stream waits on it (never the device); the CPU learns of completion only by querying that
  event (or the host task), never by time or a successful enqueue.
* **A slot is reused only after its last use completed.** A host slot (which the CPU fills or
  reads) holds the event or host task after which its owner is done with it (``Slot.fence``);
  one polling loop (:meth:`Scheduler._observe`) finds completed fences and calls the handler
  for the slot's ring and state: only there do host slots go back to FREE, on success,
  failure and cancellation alike. A device slot goes back to FREE when its last operation is
  *enqueued*, carrying that operation's event as ``Slot.ready``; the next owner's stream
  waits on it before touching the slot, so the GPU orders the reuse without a host round trip.

The GPU chain of a chunk is enqueued as early as slots allow (h2d, then compute as soon as a
device-out slot is free, then d2h as soon as a host-out slot is free), so the streams stay
fed without the CPU in the loop between stages. Stages are enqueued in admission order, so
each stream runs chunks in order.

``GUARDS`` names every wait and release guard. A test can switch one off through
``ringflow._testing.inject(guards_off=...)`` to show that the checks catch its absence.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import itertools
import logging
import math
import operator
import threading
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import numpy as np

from .._device.host_pool import buffer_behind, hand_off, slice_behind
from .._device.protocol import BufferSlice, Device
from .._errors import DeviceError, PrepareStopped, StageError, describe, shown
from .._plan import SLOT_ALIGN, aligned, host_in_slot, host_out_slot, scheduler_slot
from .._testing import current as current_hooks
from .batch_space import BatchSpace
from .chunk import MAX_MEMBERS, NO_ROOM, Chunk, ChunkFuture, Member
from .config import PipelineConfig, refuse_unknown_guards
from .frames import forget_frames
from .pointwise_check import checked_pointwise
from .reentry import StageOwner, generation, marked, run_stage
from .ring import Ring, Slot, allocate_ring
from .states import ChunkState, RingKind, SlotState
from .stages import POISON_BYTE, StageStreams, launch_compute, mark, poison_after, sim_seconds_for, writes_into_y
from .stats import PipelineStats
from .like import convert_tree
from .trees import LEAF, Packed, device_args, host_views

if TYPE_CHECKING:
    from .processes import ProcessPrepare

logger = logging.getLogger(__name__)

# Memory a pipeline whose driver died could not see its enqueued work finish with: pooled arrays
# (never handed out again while referenced here) and host ring buffers (never freed). A copy
# still pending may write into it at any time, so it is kept for the life of the process.
KEPT: list = []

GUARDS = (
    "h2d.wait_slot_ready",  # h2d waits until the device-in slot's poison fill is done
    "compute.wait_h2d",  # compute waits for the chunk's h2d
    "compute.wait_slot_ready",  # compute waits until the device-out slot's poison fill is done
    "d2h.wait_compute",  # d2h waits for the chunk's compute
    "host_in.release_after_h2d",  # host-in goes FREE only after its h2d event completes
    "device_in.release_after_compute",  # device-in goes FREE only after its compute completes
    "device_out.release_after_d2h",  # device-out goes FREE only after its d2h completes
    "consume.after_d2h",  # the consumer starts only after the d2h event completes
    "host_out.release_after_consume",  # host-out goes FREE only after the consumer returns
    "device_out.release_after_consumer",  # a lent slot's next compute waits for the consumer's release event
    "admit.after_copies",  # a shared chunk goes to the device only once every copy into it has ended
)

# Slot states whose fences, within one ring, are events of a single stream recorded in the
# order the slots were acquired: h2d events (host-in, device-in/in-place COPYING_IN), compute
# events (COMPUTING), d2h events (host-out COPYING_OUT). FILLING and CONSUMING fences are host
# tasks, which finish in any order; DRAINING slots wait on whatever their stage left.
_STREAM_ORDERED = frozenset({SlotState.COPYING_IN, SlotState.COMPUTING, SlotState.COPYING_OUT})

# The most bytes item_nbytes may say one item's prepare copies (a pebibyte: more than any host
# holds); the simulated GPU charges the prepare for them, and a copy of 1e30 bytes would take
# longer than virtual time can count.
MAX_ITEM_BYTES = 1 << 50

# The scheduler's stage callbacks: prepare writes the chunk into its host-in slot (or, for the
# caller's own pinned memory, only describes it) and says what it wrote; consume turns the
# chunk's result, a read-only view valid during the call, into the value delivered.
Prepare = Callable[[Any, Optional[np.ndarray]], tuple]  # (item, writable uint8 view or None) -> (shape, dtype)
Consume = Callable[[int, Any, np.ndarray], Any]  # (index, item, read-only typed view) -> value
# Where an item already is in pinned memory the copy engine can read: (its bytes, shape, dtype)
# or None (the item is prepared into a host-in slot).
SourceOf = Callable[[Any], Optional[tuple]]


class Scheduler:
    def __init__(self, device: Device, compute: Callable, prepare: Prepare, consume: Optional[Consume],
                 config: PipelineConfig, *, item_nbytes: Callable[[Any], int] = lambda item: 0,
                 on_chunk_end: Optional[Callable[[Chunk], None]] = None, host_in_buffer=None, host_out_buffer=None,
                 results=None, source_of: Optional[SourceOf] = None, host_in_memory=None,
                 convert: Optional[Callable[[Any], Any]] = None, host_strides: tuple = (None, None),
                 procs: Optional[ProcessPrepare] = None, host_s_per_chunk: Optional[float] = None):
        """``host_in_buffer``/``host_out_buffer``: the caller's pinned or registered memory holding
        every chunk's input / receiving every chunk's output back to back (chunk i at
        ``i * stride``: ``host_strides`` for input and output, each ``chunk_bytes`` when None).
        The copy engines then read and write it in place: no staging ring, and prepare/consume
        only describe the chunk.

        ``consume`` None delivers the result itself. ``results``: a host pool
        (:class:`~ringflow._device.host_pool.HostPool`) whose pinned arrays receive the results:
        each chunk's d2h writes straight into an array taken for it, which the consumer gets (and
        a None consume delivers) with no copy; where the pool has no room, the chunk goes through
        its host-out slot as without a pool. ``source_of``: finds items already in pinned memory,
        which the h2d then reads in place (their prepare is skipped).

        Host-out and host-in slots stay the tickets of those chunks (acquired, fenced and freed
        as for any chunk), so the bounds on chunks in each stage do not change; their own bytes
        are then unused.

        ``host_in_memory``: a host buffer to carve the host-in ring from instead of a new pinned
        allocation (shared memory that worker processes write), or a callable that makes it
        when the host-in ring is made, after the device rings; the ring closes it. ``convert``:
        applied to every array of a result delivered without a consumer (another framework's
        array over the same memory). ``procs``: with ``processes=True``, the prepare processes
        (:class:`~.processes.ProcessPrepare`, which ``prepare`` calls): a cancel of a chunk
        kills the worker running its prepare (:meth:`stop_prepare`), and the scheduler owns
        them: they close once the rings are released (never raising).

        ``host_s_per_chunk``: the host seconds the planner charges the scheduler for each chunk
        of a whole-array job (``_plan.host_seconds_per_chunk``, staged or not): each chunk's, from
        its admission, is host work of the pool's submitter (``WorkerPool.host_work``) that the
        chunk's last pool task (its consume, or its prepare where the result is not staged) comes
        after; a chunk with no pool task (neither side staged: its prepare only describes it and
        its consume does nothing, both inline) has its copy in wait for it instead, as a real
        scheduler enqueues that copy only once it has done the chunk's host work. The simulated
        GPU runs it on a lane of its own, one chunk's after another's, as the planner counts it:
        a resource beside the stages, one chunk at a time, which bounds a run only where it is
        the slowest (a staged run's first tasks are not held back by it, so the workers start
        together, as the planner has them). A real GPU's host spends its own time. None: no such
        work."""
        hooks = current_hooks()
        guard_off = refuse_unknown_guards(hooks.guards_off, GUARDS)
        slot_hook = hooks.slot_hook
        self.device = device
        # the fork generation it was made in (reentry.py): its pipeline's and its futures' calls
        # in a child forked since are refused
        self.made_in = generation()
        # the user's calls run marked as this scheduler's stages: one that calls back into its
        # own pipeline to wait for it is refused (reentry.py). The mark is a token, not the
        # scheduler: the marked compute it keeps would otherwise close over the scheduler, a
        # cycle that kept a closed pipeline's stages (and the caller's arrays they hold) alive
        # until the collector ran
        self.stage_owner = StageOwner()
        compute = marked(self.stage_owner, "compute", compute)
        self.compute = writes_into_y(compute)
        self._raw_compute = compute  # fill="rows": its return value is the rows it filled
        # a compute that says each output element depends only on the same element of the
        # input runs once over all the items of a shared chunk (see _launch_members)
        self._pointwise = getattr(compute, "pointwise", False) is True
        self.prepare = prepare
        self.consume = consume
        self.results = results
        self.source_of = source_of
        self.convert = convert
        self.config = config
        self.item_nbytes = item_nbytes
        self._guard_off = guard_off
        self._on_chunk_end = on_chunk_end
        self._sim_compute = getattr(compute, "sim_seconds", None)
        self._host_s_per_chunk = host_s_per_chunk
        self._profile = config.profile  # timing events recorded (start marks are recorded only then)

        self._rings: list[Ring] = []
        self._kept_rings: list[Ring] = []  # host rings a dead driver's pending work may still use: never freed
        self.pool = None
        # processes=True: the prepare processes, whose worker running a chunk's prepare a cancel
        # of that chunk kills (stop_prepare)
        self._procs = procs
        self._host_in_memory = host_in_memory
        self._host_strides = host_strides
        self.streams = StageStreams(device, checked=config.checked)
        try:
            c = config.slots
            # the device rings first: a ring the GPU has no room for fails before any host memory
            # is pinned for a pipeline that cannot run
            if config.inplace:  # its slots hold a chunk's input and then its result: a chunk's bytes
                self.dev_in = self._device_ring(RingKind.DEVICE_INPLACE, c.device_in, slot_hook, None)
                self.dev_out = None
            else:  # nothing but the h2d writes a device-in slot, nothing but the compute a device-out one
                self.dev_in = self._device_ring(RingKind.DEVICE_IN, c.device_in, slot_hook, config.in_bytes)
                self.dev_out = self._device_ring(RingKind.DEVICE_OUT, c.device_out, slot_hook, config.out_bytes)
            self.host_in = self._host_ring(RingKind.HOST_IN, host_in_buffer, c.host_in, slot_hook)
            self.host_out = self._host_ring(RingKind.HOST_OUT, host_out_buffer, c.host_out, slot_hook)
            # listed in a chunk's order through them, as fences are observed and slots drained
            self._rings = [ring for ring in (self.host_in, self.dev_in, self.dev_out, self.host_out)
                           if ring is not None]
            self.pool = device.create_worker_pool(config.workers)
            if not self.pool.models_host_work:  # a real host spends the time itself: nothing to ask per chunk
                self._host_s_per_chunk = None
        except BaseException:
            self._release_resources()
            raise

        self.chunks: dict[int, Chunk] = {}  # not yet final
        self._accepted_q: collections.deque[Chunk] = collections.deque()
        self._h2d_q: collections.deque[Chunk] = collections.deque()
        self._compute_q: collections.deque[Chunk] = collections.deque()
        self._d2h_q: collections.deque[Chunk] = collections.deque()
        self.accepting = True
        self.broken: Optional[DeviceError] = None
        self.stopped_by: Optional[BaseException] = None  # what ended the driver (end_after_death)
        # what stopped admission at the caller's word: "cancelled" (a cancel, which outranks a
        # close begun before it: it cancels what the close would have finished) or "closed"
        self.stopped_how: Optional[str] = None
        self.closed_by: Optional[threading.Thread] = None  # the thread whose close() stopped admission
        self.first_error: Optional[BaseException] = None
        # called once a failure first stops the pipeline (on_error="raise"), on the progress thread
        # with its lock held: a pipeline over several devices stops its other parts then
        self.on_failure_stop: Optional[Callable[[], None]] = None
        # the most recent failures (a long run keeps a bounded number: memory stays flat)
        self.failures: collections.deque[StageError] = collections.deque(maxlen=MAX_KEPT_FAILURES)
        self.inbox: collections.deque[Chunk] = collections.deque()  # accepted by any thread, not yet admitted
        self.resolved: list = []  # futures whose done-callbacks run once the driver lets go of its lock
        self.version = 0  # bumped whenever a waiter's condition may have changed (a chunk ended, admission stopped)
        self._indices = itertools.count()
        self.counts = collections.Counter()
        self._loose_tasks: list[Chunk] = []  # consumers whose slot a disabled guard freed early
        # results delivered on the device: (ring, slot, lending number) by slot, and the
        # releases handed back by any thread (ring, slot, lending, event, token), taken at a step
        self.lent: dict[int, int] = {}  # id(slot) -> its current lending number
        self._lendings = itertools.count()
        self.returns: collections.deque = collections.deque()
        self._closed = False
        self._lend_lock = threading.Lock()  # releases after close, with no driver left
        self._lend_holder: Optional[int] = None  # the thread inside _lend_lock (see _wake)
        self._close_token: Any = None
        self.wake_driver: Optional[Callable[[], None]] = None  # set by the driver: a release is waiting
        self.unclaimed = 0  # final chunks whose result a map() has not handed out yet
        self.steps = 0
        self.host_seconds = 0.0  # CPU time spent in scheduling steps (host overhead per chunk)
        self._forget_again: list = []  # failures whose traceback's frames were still running
        # items sharing a chunk: the chunk in the inbox still taking items (None: none), and the
        # chunk of every such item not yet ended, by the item's index
        # (guarded by batch_lock: docs/design.md, "Items sharing a chunk")
        self.open_batch: Optional[Chunk] = None
        self._members: dict[int, Chunk] = {}
        self.space = BatchSpace(config.chunk_bytes)  # the pinned blocks of shared chunks (batch_lock)
        self.batch_lock = threading.Lock()  # taken after the driver's lock, never before it
        # chunks put in the inbox and copies into shared chunks ended, by any thread (batch_lock
        # held): news for the driver's admission, which another thread brings without its lock
        self.inbox_news = 0
        # items of inbox chunks whose submit raised and whose take-back waits for the progress
        # thread (batch_lock held): counted out of stats() meanwhile
        self.withdrawn = 0
        self._inbox_news_seen = 0  # inbox_news as the driver's last admission found it
        self._cancel_admitted = False  # set by cancel_pending: chunks admitted later end CANCELLED
        self._cancel_after_step = False  # cancel_pending once this step's enqueues are made
        self.chunks_admitted = 0  # items sharing a chunk count once
        # why chunks cancelled from now on were (the message of their futures' CancelledError), or None
        self.cancel_reason: Optional[str] = None

    # -- set-up and tear-down ------------------------------------------------------------------
    def _ring(self, kind, buffer, count, hook, external: bool = False, stride: Optional[int] = None,
              slot_bytes: Optional[int] = None) -> Ring:
        ring = Ring(kind, buffer, count, slot_bytes or self.config.chunk_bytes, hook, external=external, stride=stride)
        self._rings.append(ring)
        return ring

    def _device_ring(self, kind, count, hook, nbytes: Optional[int]) -> Ring:
        # a slot holds what every chunk puts in this ring where that is known up front (nbytes: a
        # reduction's results take a small part of a chunk's bytes), else a chunk's bytes.
        # Each device slot starts on a SLOT_ALIGN boundary whatever its bytes are: a slot at
        # i * 1001 bytes would hand compute float32 arrays at odd addresses, which numpy reads
        # and a GPU kernel cannot (a misaligned-address error breaks the device)
        n = scheduler_slot(self.config.chunk_bytes, nbytes)
        stride = aligned(n)
        return self._ring(kind, allocate_ring(self.device.allocate, kind, n, count, stride), count, hook,
                          stride=stride, slot_bytes=n)

    def _host_ring(self, kind, external_buffer, count, hook) -> Ring:
        n = self.config.chunk_bytes
        if kind is RingKind.HOST_IN and self._host_in_memory is not None:
            memory, self._host_in_memory = self._host_in_memory, None
            if callable(memory):  # made now, after the device rings (ProcessPrepare.open)
                memory = memory()
            return self._ring(kind, memory, count, hook)
        if external_buffer is None:
            # a ring holds only what goes in it where its bytes are known up front: the result in
            # host-out, and in host-in the input alone unless the compute is in place (the D2H
            # then writes host-out, never host-in, so a wider result needs no room there)
            if kind is RingKind.HOST_OUT:
                n, stride = host_out_slot(n, self.config.out_bytes)
            else:
                n, stride = host_in_slot(n, self.config.in_bytes, self.config.inplace)
            return self._ring(kind, allocate_ring(self.device.allocate_host, kind, n, count, stride), count, hook,
                              stride=stride, slot_bytes=n)
        stride = self._host_strides[0 if kind is RingKind.HOST_IN else 1] or n
        ring = Ring(kind, external_buffer, -(-external_buffer.nbytes // stride), stride, hook, external=True)
        self._rings.append(ring)
        return ring

    def _release_resources(self) -> None:
        if getattr(self.device, "closed", False):
            # the device went first and took every stream, buffer and pool with it (a pipeline
            # collected after its device was closed): nothing is left to release or warn about
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._release_on_live_device()
            return
        self._release_on_live_device()

    def _release_on_live_device(self) -> None:
        from .._device.protocol import close_quietly

        if self.pool is not None:
            close_quietly(self.pool, "worker pool")
        # A device slot's ``ready`` event (its last use or poison fill) may still be pending: the
        # stream-ordered free below comes after every stream of the pipeline and after these
        # events, so it needs no host wait (and a launch that failed there was already reported
        # by its chunk). A result released on the consumer's stream (deliver="device") made its
        # slot's ``ready`` an event on that stream, which is none of the pipeline's.
        pending = []
        for ring in self._rings:
            for slot in ring.slots:
                if slot.ready is not None:
                    pending.append(slot.ready)
                slot.ready = None
        free_on = self.streams.free_after()
        if free_on is not None:
            try:
                for event in pending:
                    free_on.wait(event)
            except Exception:  # noqa: BLE001 - a broken device: free after a device-wide wait instead
                free_on = None
        # rings with results on the device that are still the consumer's: freed when the last comes back
        lent = [ring for ring in self._rings if any(s.state is SlotState.LENT for s in ring.busy.values())]
        if lent:
            # that free is on the host, after these streams are gone: it must come after all they
            # were given (checked mode's poison fills of the ring's other slots), so the host
            # waits for it now
            self.streams.settle()
        for ring in self._rings:
            if ring in lent:
                continue
            if ring in self._kept_rings:
                continue  # work a dead driver never saw complete may still use it (end_after_death)
            ring.close(stream=free_on)
        self.streams.close()
        if self._host_in_memory is not None and not callable(self._host_in_memory):
            # made, but no ring took it (set-up failed first); one never made needs nothing
            close_quietly(self._host_in_memory, "host-in memory")
            self._host_in_memory = None
        procs, self._procs = self._procs, None
        if procs is not None:
            close_quietly(procs, repr(procs))
        # the ring objects stay for introspection (states, high-water marks); their memory is gone

    @property
    def rings(self) -> list[Ring]:
        return list(self._rings)

    # -- admission -----------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return len(self.chunks)

    def load(self) -> int:
        """The unfinished chunks, admitted or in the inbox, and the results delivered on the device
        that are not yet released (each holds a slot the compute writes): a look without the
        driver's lock, for a dispatcher choosing where to send work (exact only at an instant it
        cannot hold)."""
        return len(self.chunks) + len(self.inbox) + max(0, len(self.lent) - len(self.returns))

    def has_capacity(self) -> bool:
        return (self.accepting and len(self.chunks) + len(self.inbox) + self.unclaimed
                < self.config.max_in_flight)

    def accept(self, item: Any, driver: Any, *, if_room: bool = False, in_map: bool = False,
               staged: Optional[np.ndarray] = None,
               staged_at: Optional[tuple] = None, out_spec: Any = None,
               result: Optional[np.ndarray] = None, in_tree: Optional[Packed] = None, on_device: Any = None,
               source_ready: Any = None) -> "Chunk | object":
        """Accept ``item`` from any thread, the driver's lock held or not: under the batch lock,
        the capacity is checked and the chunk goes into the inbox (one append: the commit point);
        the driving thread admits it at its next step (a caller without the driver's lock wakes
        it after: ``driver.wake.set()``). Every change to the inbox's length and to whether the
        pipeline accepts is made under the batch lock too, so two accepting threads never take
        one place and no chunk enters the inbox after admission stopped (docs/design.md,
        "Accepting without the driver's lock").
        ``if_room``: return :data:`NO_ROOM`, accepting nothing, where there is no room (the
        pipeline is full, or takes no more work: the caller finds out why under the driver's lock).
        ``staged``: a pinned pool array holding the item's bytes (made by the accepting thread),
        which the h2d reads and, for a result of the same shape and dtype, the d2h writes;
        ``staged_at``: when that copy started and ended (host clock), the chunk's prepare span.
        ``out_spec``: the result's ``(shape, dtype)`` (or packed layout) when it is not the
        prepared input's; ``result``: a pinned pool array of that spec for the d2h to write;
        ``in_tree``: the packed layout of a staged item of several arrays. ``on_device``: a device
        array item's ``(BufferSlice, shape, dtype)``, copied device to device in the h2d stage
        after ``source_ready`` (an event after its producer's work, or None).

        Raises:
            DeviceError: the device is broken.
            RuntimeError: the pipeline takes no more work, or is full (without ``if_room``).
        """
        # this thread's work on the item (its staging copy) comes before the chunk's admission
        token = self.device.publish()
        now = self.device.now
        with self.batch_lock:
            if self._finds_no_room(if_room):
                return NO_ROOM
            index = next(self._indices)  # under the lock: chunks enter the inbox in index order
            chunk = Chunk(index, item, ChunkFuture(driver, index), in_map=in_map, token=token,
                          staged=staged, out_spec=out_spec, result=result, in_tree=in_tree, on_device=on_device,
                          source_ready=source_ready)
            chunk.stamps["accepted"] = now
            if staged_at is not None:  # its prepare was the copy the accepting thread just made
                chunk.stamps["accepted"] = staged_at[0]
                chunk.stamps["prepare"] = list(staged_at)
            self.open_batch = None  # items accepted later go after this one: none joins a chunk before it
            self.inbox.append(chunk)
            self.inbox_news += 1
        return chunk

    # -- items sharing a chunk -------------------------------------------------------------------
    def join_open_batch(self, driver: Any, spec: tuple, claim: list) -> Optional[tuple]:
        """Room in the chunk still taking items (any thread, the driver's lock held or not) for an
        item of ``spec`` (its shape, dtype and bytes), whose result comes back into the same
        bytes of the chunk's block: ``(chunk, member)`` with the member registered (its future is
        the item's) and its copy into the chunk counted as being made; None when no chunk takes
        items or its room is too small. ``(chunk, member)`` goes into ``claim`` before anything
        of it is registered, so that an interrupt anywhere in here leaves the caller what to take
        back. The caller copies the item to ``chunk.batch`` at the member's offset, then calls
        :meth:`member_written` whatever happens (see "Ctrl-C in a shared submit" in
        docs/design.md)."""
        with self.batch_lock:
            chunk = self.open_batch
            if chunk is None or not self.accepting or self.broken is not None or len(chunk.members) >= MAX_MEMBERS:
                return None
            offset = aligned(chunk.used)
            if offset + spec[2] > chunk.batch.nbytes:
                return None
            return chunk, self._add_member(chunk, driver, offset, spec, claim)

    def open_new_batch(self, driver: Any, spec: tuple, claim: list, *, if_room: bool = False) -> "tuple | object":
        """A new chunk, its block a part of the current slab (:class:`~.batch_space.BatchSpace`),
        in the inbox and taking items until the driver admits it, with a first member as
        :meth:`join_open_batch` makes, ``claim`` too (any thread, the driver's lock held or not:
        capacity is taken under the batch lock, as by :meth:`accept`). Returns
        ``(chunk, member)``, or None when the slab has no room for the item (give it a new one
        with :meth:`add_slab`), or, with ``if_room``, :data:`NO_ROOM` where there is no room (as
        :meth:`accept`; nothing taken).

        Raises:
            DeviceError: the device is broken.
            RuntimeError: the pipeline takes no more work, or is full (without ``if_room``).
        """
        with self.batch_lock:
            if self._finds_no_room(if_room):
                return NO_ROOM
            # the chunk open before, if any, takes no more items from here on, whether or not the
            # slab has room for the new one: reserving shrinks its part to what it holds
            self.open_batch = None
            batch = self.space.reserve(spec[2])
            if batch is None:
                return None
            index = next(self._indices)
            chunk = Chunk(index, None, ChunkFuture(driver, index), members=[], batch=batch, tokens=[])
            self.space.claimed(chunk)
            chunk.stamps["accepted"] = self.device.now
            member = self._add_member(chunk, driver, 0, spec, claim, index=index)
            self.inbox.append(chunk)
            self.inbox_news += 1
            self.open_batch = chunk
        return chunk, member

    def add_slab(self, slab: np.ndarray, need: int) -> None:
        """A new slab (a uint8 pool array of ``space.slab_bytes``) for shared chunks, taken by a
        submitting thread that found no room for an item of ``need`` bytes (any thread)."""
        with self.batch_lock:
            self.space.install(slab, need)

    def _add_member(self, chunk: Chunk, driver: Any, offset: int, spec: tuple, claim: list,
                    index: Optional[int] = None) -> Member:
        index = next(self._indices) if index is None else index
        member = Member(index, ChunkFuture(driver, index), offset, *spec)
        # from here on each step is one operation, and the member counts as copying before it is
        # one of the chunk's: an interrupt between two steps leaves a member that claim names and
        # that keeps the chunk from being admitted, which the caller takes back
        claim.append((chunk, member))
        chunk.copying.add(member)
        chunk.members.append(member)
        self._members[index] = chunk
        chunk.used = offset + member.nbytes
        return member

    def member_written(self, chunk: Chunk, member: Member, span: Optional[tuple]) -> None:
        """The copy of ``member``'s item into ``chunk`` ended (any thread): made, in host-clock
        ``span``, and ordered before the chunk's copy to the device (the driver's lock need not be
        held; wake the driver after). The item is accepted at the last step, which is one
        operation. With ``span`` None the copy failed or was interrupted, maybe before the member
        was wholly registered: the item is taken back unless its copy had already ended (its
        bytes in the chunk are not used; the driver's lock must be held: the inbox may change).
        Safe to call again for the same member."""
        token = self.device.publish()  # the thread's use of the chunk's block (a failed copy too) comes first
        with self.batch_lock:
            if member not in chunk.copying:
                return  # already ended (or taken back)
            if chunk.tokens is not None:
                chunk.tokens.append(token)
            self.inbox_news += 1
            if span is None:
                self._take_back(chunk, member)
                return
            prep = chunk.stamps.get("prepare")
            chunk.stamps["prepare"] = [span[0] if prep is None else min(prep[0], span[0]),
                                       span[1] if prep is None else max(prep[1], span[1])]
            chunk.copying.discard(member)  # the commit point: the driver may admit the chunk now

    def withdraw(self, chunk: Chunk, member: Member) -> None:
        """``member``'s submit raised before its copy ended, and its take-back
        (:meth:`member_written` with no span) is left to the progress thread's next turn (any
        thread; the driver's lock need not be held): :meth:`stats` counts it out from now on,
        since its caller got an error, not a future, and it never runs. Safe to call again."""
        with self.batch_lock:
            if not member.withdrawn and member in chunk.copying and member in chunk.members and chunk in self.inbox:
                member.withdrawn = True
                self.withdrawn += 1

    def _take_back(self, chunk: Chunk, member: Member) -> None:
        """Un-accept a member whose copy did not end (batch lock and driver's lock held). The bytes
        it may have written are zeroed: they lie between its neighbours, inside a pointwise
        compute's span (the copy is over: it failed or was interrupted on this thread)."""
        if member.withdrawn:
            member.withdrawn = False
            self.withdrawn -= 1
        if chunk.batch is not None:
            chunk.batch[member.offset:member.offset + aligned(member.nbytes)] = 0
        if member in chunk.members:
            chunk.members.remove(member)
        self._members.pop(member.index, None)
        chunk.copying.discard(member)
        if not chunk.members and not chunk.copying and chunk in self.inbox:
            # no item of it is left: it goes now, and its pinned block back to the pool
            self.inbox.remove(chunk)
            if self.open_batch is chunk:
                self.open_batch = None
            # its block is part of a slab that others' chunks and results keep alive: whoever
            # takes the slab next comes after every copy made into this part (each a token here)
            for token in chunk.tokens:
                hand_off(chunk.batch, token)
            chunk.batch = None
            chunk.tokens = None

    def inbox_news_unseen(self) -> bool:
        """Whether a chunk entered the inbox, or a copy into a shared chunk ended, after the last
        admission looked (any thread, no lock: the driver asks once it has cleared its wake flag,
        so news that came after the look is either counted here or sets the flag again; an accept
        without the driver's lock can land while a step that found the inbox empty is still
        running)."""
        return self.inbox_news != self._inbox_news_seen

    def count_with(self, indices: "Iterator[int]") -> None:
        """Number chunks from ``indices`` (shared by the parts of a pipeline over several devices)
        instead of from 0; before any is accepted."""
        self._indices = indices

    def _finds_no_room(self, if_room: bool) -> bool:
        """Whether an accept finds no room (the pipeline is full or takes no more work) and may
        say so (``if_room``) rather than raise (batch lock held).

        Raises:
            DeviceError, RuntimeError: as :meth:`_check_accepting`, without ``if_room``.
        """
        if if_room and not self.has_capacity():
            return True
        self._check_accepting()
        return False

    def _check_accepting(self) -> None:
        if self.broken is not None:
            raise self.broken
        if not self.accepting:
            raise self.refusal()
        if not self.has_capacity():
            raise RuntimeError("admission is full; wait for capacity before accepting")

    def refusal(self) -> RuntimeError:
        """The error for work offered once the pipeline takes no more, saying why."""
        if self.stopped_by is not None:
            return RuntimeError(f"the pipeline no longer accepts work: {self.stopped_by}")
        err = self.first_error
        if err is not None and self.config.on_error == "raise":
            return RuntimeError(
                f"the pipeline no longer accepts work: a failure stopped it, as on_error='raise' says "
                f"({describe(err)}); create a new Pipeline, or pass on_error='continue' to go on "
                "past failed items")
        return RuntimeError("the pipeline no longer accepts work (it was closed or cancelled); create a new Pipeline")

    def _admit(self) -> bool:
        """Take the inbox's chunks in (driving thread). A chunk taking items waits there while a
        copy into it is being made, and, while earlier chunks wait for a slot, keeps taking items
        (it could not start sooner anyway)."""
        admitted = False
        inbox = self.inbox
        self._inbox_news_seen = self.inbox_news
        while inbox:
            chunk = inbox[0]
            members = chunk.members
            if members is not None:
                with self.batch_lock:  # no item joins it, and no copy into it is being made, from here on
                    if chunk.copying and "admit.after_copies" not in self._guard_off:
                        break
                    if chunk is self.open_batch:
                        if self._accepted_q and self.accepting and not self._cancel_admitted:
                            break
                        self.open_batch = None
            # a chunk that goes on is counted among the admitted before it leaves the inbox: an
            # accepting thread (no driver's lock) must never see room that is not there
            self.chunks_admitted += 1
            if members is not None:
                for token in chunk.tokens:
                    self.device.observe(token)
                chunk.tokens = None
                if not members:  # every item's copy failed: nothing of it was accepted
                    inbox.popleft()
                    self._finish(chunk)
                    continue
                chunk.staged = chunk.batch[:chunk.used]
                chunk.batch = None
                self.counts["accepted"] += len(members)
                cancelled = self._cancel_admitted or all(m.future.done() for m in members)
            else:
                self.device.observe(chunk.token)
                chunk.token = None
                self.counts["accepted"] += 1
                cancelled = self._cancel_admitted or chunk.future.done()
            if cancelled:  # cancelled by its caller (every item of it) before it was admitted
                inbox.popleft()
                # or, for a chunk of its own, failed as the driver died while it waited in the
                # inbox behind a chunk still being copied into (admit_after_death): it ends FAILED
                failed = members is None and chunk.future.done() and not chunk.future.cancelled()
                chunk.move(ChunkState.FAILED if failed else ChunkState.CANCELLED)
                if members is None:
                    self.counts["failed" if failed else "cancelled"] += 1
                    if chunk.in_map:  # a map hands this outcome out too (as _end counts one)
                        self.unclaimed += 1
                    if not chunk.future.done():
                        chunk.future._mark_cancelled()
                else:
                    token = self.device.publish()
                    # the slab lives on in others' chunks and results: its next taker comes
                    # after every copy into this part (the copying threads' tokens, observed above)
                    hand_off(chunk.staged, token)
                    self._end_members(chunk, ChunkState.CANCELLED, token)
                self.version += 1
                self._finish(chunk)
                continue
            self.chunks[chunk.index] = chunk
            inbox.popleft()
            if self.broken is not None:  # accepted before the device broke: nothing can run it
                chunk.error = self.broken
                self._end(chunk, ChunkState.FAILED)
                continue
            self._accepted_q.append(chunk)
            if self._host_s_per_chunk is not None:
                chunk.host_work = self.pool.host_work(self._host_s_per_chunk)
            admitted = True
        return admitted

    def has_queued_work(self) -> bool:
        """Chunks wait for a slot while no fence is pending (the next step can start one)."""
        return bool(self.inbox or self._accepted_q) and self.broken is None

    def held_by_results(self) -> list:
        """With results delivered on the device: the indices of the chunks whose results, not yet
        released, hold every slot a compute writes, so that no further chunk can be computed
        until one of them is released. Empty otherwise (a release already waiting counts as
        given back)."""
        if not self.lent or self.returns:
            return []
        ring = self.dev_in if self.dev_out is None else self.dev_out
        if ring.free_count or any(slot.state is not SlotState.LENT for slot in ring.slots):
            return []
        return sorted(slot.owner for slot in ring.slots)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has released the rings, streams and workers."""
        return self._closed

    def finished(self) -> bool:
        """Nothing accepted is unfinished and no operation is pending: safe to stop driving."""
        return not self.chunks and not self.inbox and not self.pending_fences()

    def stats(self) -> PipelineStats:
        """Counts of items (an item sharing a chunk counts as one, as a chunk of one item does)."""
        c = self.counts
        with self.batch_lock:  # (threads without the driver's lock append to the inbox, and join its chunks)
            waiting = sum(1 if chunk.members is None else len(chunk.members) for chunk in self.inbox)
            accepted = c["accepted"] + waiting - self.withdrawn
        ended = c["delivered"] + c["failed"] + c["cancelled"]
        return PipelineStats(accepted=accepted, delivered=c["delivered"], failed=c["failed"],
                             cancelled=c["cancelled"], in_flight=accepted - ended)

    # -- the loop ------------------------------------------------------------------------------
    def step(self) -> bool:
        """One pass: observe completions, then start whatever the free slots allow."""
        t0 = time.perf_counter()
        self.steps += 1
        self._forget_finished_frames()
        try:
            progressed = self._admit()
            progressed = self._take_returns() or progressed
            progressed = self._observe() or progressed
            # chunk by chunk rather than stage by stage: the first chunk's copy is enqueued
            # before the next chunk is prepared, and a chunk's d2h (which hands its device slot
            # to a later chunk's h2d) before the next chunk's h2d
            while self.broken is None:
                # each stage is called only when a chunk waits for it and the ring it takes a
                # slot from has one free (a full ring frees slots only in _observe)
                moved = False
                if self._accepted_q and self.host_in.free_count:
                    moved = self._start_prepares(1)
                if self._h2d_q and self.dev_in.free_count:
                    moved = self._enqueue_h2d(1) or moved
                if self._compute_q and (self.dev_out is None or self.dev_out.free_count):
                    moved = self._enqueue_compute(1) or moved
                if self._d2h_q and self.host_out.free_count:
                    moved = self._enqueue_d2h(1) or moved
                if not moved:
                    break
                progressed = True
            if self._cancel_after_step:  # an item's compute failed while enqueued, on_error="raise"
                self._cancel_after_step = False
                self.cancel_pending()
        except DeviceError as err:
            if not err.sticky:
                raise
            self.break_on(err)
            progressed = True
        self.host_seconds += time.perf_counter() - t0
        return progressed

    def pending_fences(self) -> list:
        """The fences worth waiting on: every pending one except those queued behind an earlier
        pending event of the same stream (see :meth:`_observe`). Empty only when no fence is
        pending at all."""
        fences = []
        for ring in self._rings:
            seen = set()
            for slot in ring.busy.values():
                fence = slot.fence
                if fence is None:
                    continue
                state = slot.state
                if state in _STREAM_ORDERED:
                    if state in seen:
                        continue
                    seen.add(state)
                fences.append(fence)
        return fences + [c.consume_task for c in self._loose_tasks]

    # -- observing fences ----------------------------------------------------------------------
    def _observe(self) -> bool:
        """Handle every completed fence. In a stream-ordered state (``_STREAM_ORDERED``) a ring's
        fences are events of one stream recorded in the order the slots were acquired (the
        order of ``ring.busy``), so they complete in that order: after the first pending one,
        the rest of that state are pending too and are not queried (a query costs a few
        microseconds of driver time, and a ring can hold dozens of chunks)."""
        progressed = False
        for ring in self._rings:
            if not ring.busy:
                continue
            stalled = ()
            for slot in list(ring.busy.values()):
                fence = slot.fence
                if fence is None:
                    continue
                state = slot.state
                if state in stalled:
                    continue
                if not fence.is_done:
                    if state in _STREAM_ORDERED:
                        stalled = (*stalled, state)
                    continue
                _raise_if_broken(fence)
                slot.fence = None
                progressed = True
                self._on_fence_done(ring, slot)
        for chunk in list(self._loose_tasks) if self._loose_tasks else ():
            if chunk.consume_task.is_done:
                self._loose_tasks.remove(chunk)
                self._on_consumed(chunk)
                progressed = True
        return progressed

    def _on_fence_done(self, ring: Ring, slot: Slot) -> None:
        state, kind = slot.state, ring.kind
        chunk = self.chunks.get(slot.owner)
        if state is SlotState.DRAINING or chunk is None:
            # draining, or (only with a guard switched off) its chunk already ended: the slot's
            # last operation is complete, so it can go
            self._free(ring, slot)
            if chunk is not None:
                self._maybe_end(chunk)
            return
        if kind is RingKind.HOST_IN and state is SlotState.FILLING:
            self._on_prepared(chunk)
        elif kind is RingKind.HOST_IN and state is SlotState.COPYING_IN:
            self._free(ring, slot)
        elif kind in (RingKind.DEVICE_OUT, RingKind.DEVICE_INPLACE) and state is SlotState.COMPUTING:
            # fail early; the slot itself is handed back at d2h enqueue (or lent, on the device)
            if not self._compute_failed(chunk):
                if self.config.fill == "rows" and not self._take_fill(chunk):
                    return
                if self.config.deliver == "device":
                    self._lend(ring, slot, chunk)
                elif self.config.fill == "rows":
                    self._d2h_q.append(chunk)
        elif kind is RingKind.HOST_OUT and state is SlotState.COPYING_OUT:
            if not self._compute_failed(chunk):
                self._start_consume(chunk)
        elif kind is RingKind.HOST_OUT and state is SlotState.CONSUMING:
            self._on_consumed(chunk)
        # other (ring, state) pairs: the op finished but a later stage already owns the next
        # fence or has not been enqueued yet; nothing to do

    def _free(self, ring: Ring, slot: Slot) -> None:
        """Return a slot to FREE; in checked mode poison it first so a reuse fault is visible."""
        if self.config.checked:
            if slot.state is not SlotState.DRAINING:
                ring.move(slot, SlotState.DRAINING)
            self._poison(ring, slot)
        ring.release(slot)

    def _poison(self, ring: Ring, slot: Slot) -> None:
        if ring.external:  # the caller's own input or result: never overwrite it
            return
        where = slot.where
        if ring.buffer.is_host:
            where.buffer.view(np.uint8, offset=where.offset, count=where.nbytes, access="w").fill(POISON_BYTE)
        else:
            slot.ready = poison_after(self.streams.poison, where, None)

    def _release_on_device(self, ring: Ring, slot: Slot, last_use, guard: str) -> None:
        """Hand a device slot back as soon as its last operation is enqueued.

        The slot's next owner does not wait for the host to see ``last_use`` complete: its first
        stream operation waits on the slot's ``ready`` event (``last_use``, or the poison fill
        ordered after it in checked mode), so the GPU orders the reuse and the host stays out
        of the loop between chunks, as the stream-ordered allocator does. With ``guard``
        switched off (tests only) the slot is handed back with no ordering: the poison fill
        and the next owner may then overwrite it while ``last_use`` still reads it."""
        ordered = guard not in self._guard_off
        if self.config.checked:
            ring.move(slot, SlotState.DRAINING)
            ready = poison_after(self.streams.poison, slot.where, last_use if ordered else None)
        else:
            ready = last_use if ordered else None
        ring.release(slot)
        slot.ready = ready

    def _wait_ready(self, stream, slot: Slot, guard: str) -> None:
        ready = slot.ready
        if ready is not None:
            if guard not in self._guard_off:
                stream.wait(ready)
            slot.ready = None

    # -- CPU stages ----------------------------------------------------------------------------
    def _start_prepares(self, limit: int) -> bool:
        progressed = False
        # describing chunks of an external ring is inline work: describe no further ahead than
        # the device can take now (the rest are described as device slots come free)
        budget = min(limit, self.dev_in.free_count + 1) if self.host_in.external else limit
        while self._accepted_q and budget > 0:
            budget -= 1
            chunk = self._accepted_q[0]
            slot = self.host_in.acquire(chunk.index, SlotState.FILLING)
            if slot is None:
                break
            self._accepted_q.popleft()
            chunk.host_in = slot
            chunk.move(ChunkState.PREPARING)
            if chunk.staged is None:
                chunk.stamps["prepare"] = [self.device.now, None]
            found = self._found(chunk)
            if self.host_in.external or found is not None:
                # the caller's pinned memory already holds the chunk: describing it is a few
                # microseconds of Python, cheaper inline than a round trip through the pool
                if found is not None:
                    chunk.source, shape, dtype = found
                    chunk.prepare_task = _InlineTask(self.device, _described, shape, dtype)
                    if chunk.staged is not None:  # the accepting thread's copy was its prepare
                        chunk.prepare_task.span = tuple(chunk.stamps["prepare"])
                else:
                    chunk.prepare_task = _InlineTask(self.device, self._run_prepare, chunk, slot.where)
                self._h2d_q.append(chunk)
                self._on_prepared(chunk)
                progressed = True
                continue
            nbytes = self._item_bytes(chunk.item, chunk.index)
            if isinstance(nbytes, BaseException):  # ends the chunk FAILED at once, naming item_nbytes
                chunk.prepare_task = _InlineTask(self.device, _reraise, nbytes)
                self._h2d_q.append(chunk)
                self._on_prepared(chunk, failing="item_nbytes")
                progressed = True
                continue
            # (the scheduler's host work for the chunk comes before its last pool task: see __init__)
            chunk.prepare_task = self.pool.submit(self._run_prepare, chunk, slot.where, nbytes=nbytes,
                                                  after=chunk.host_work if self.host_out.external else None)
            slot.fence = chunk.prepare_task
            self._h2d_q.append(chunk)
            progressed = True
        return progressed

    def _item_bytes(self, item: Any, index: int) -> "int | BaseException":
        """The bytes ``item_nbytes`` says the prepare of ``item`` copies (what the simulated GPU
        charges for it), or the error to fail its chunk with: ``item_nbytes`` is the user's code
        on the driving thread, and its error, or a value that is no byte count, must end that
        item, not the thread (a StageError naming ``"item_nbytes"``: the prepare never ran)."""
        try:
            nbytes = run_stage(self.stage_owner, "item_nbytes", self.item_nbytes, item, index=index)
        except BaseException as exc:  # noqa: BLE001 - delivered as the chunk's prepare failure
            return exc
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)):
            return TypeError(f"item_nbytes must return the bytes prepare copies for the item, an int >= 0; "
                             f"it returned {nbytes!r} ({type(nbytes).__name__})")
        if not 0 <= nbytes <= MAX_ITEM_BYTES:
            return ValueError(f"item_nbytes must return the bytes prepare copies for the item, an int from 0 to "
                              f"2**{MAX_ITEM_BYTES.bit_length() - 1}; it returned {nbytes}")
        return int(nbytes)

    def _found(self, chunk: Chunk) -> Optional[tuple]:
        """Where ``chunk``'s input already is in pinned memory: (its bytes, shape, dtype), or None."""
        staged = chunk.staged
        if staged is not None:
            return slice_behind(staged), staged.shape, staged.dtype
        if chunk.on_device is not None:
            return chunk.on_device
        return self.source_of(chunk.item) if self.source_of is not None else None

    def _run_prepare(self, chunk: Chunk, where: BufferSlice) -> tuple:
        # an external host-in ring already holds the chunk: prepare only describes it
        raw = None if self.host_in.external else \
            where.buffer.view(np.uint8, offset=where.offset, count=where.nbytes, access="w")
        procs = self._procs
        if procs is not None:
            procs.name_task(chunk)  # (cancelling the chunk kills its worker, or keeps it from being sent)
        try:
            # named first, then looked at: a stop_prepare that found no name had set this before
            if procs is not None and chunk.stop_prepare:
                raise PrepareStopped("this item's future was cancelled before its prepare started")
            described = run_stage(self.stage_owner, "prepare", self.prepare, chunk.item, raw,  # (shape, dtype)[, packed layout]
                                  index=chunk.index)
        finally:
            if procs is not None:
                procs.unname_task()
        shape, dtype = described[0], np.dtype(described[1])
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > where.nbytes:
            raise ValueError(f"prepare produced {nbytes} bytes but a slot holds {where.nbytes}; "
                             f"raise chunk_bytes to at least {nbytes} or split the item")
        tree = described[2] if len(described) > 2 else None
        if self.config.fill == "rows":
            check_fill_rows(tree is not None, len(shape), "prepare's result")
        return tuple(shape), dtype, nbytes, tree

    def _on_prepared(self, chunk: Chunk, failing: str = "prepare") -> None:
        """``chunk``'s prepare task has ended: the chunk moves on, or ends FAILED as a StageError
        naming ``failing``, the user's callable that failed (``"item_nbytes"`` when it was the
        one that raised, the prepare never having run)."""
        if chunk.staged is None:
            chunk.stamps["prepare"][1] = self.device.now
        try:
            chunk.shape, chunk.dtype, chunk.nbytes, tree = chunk.prepare_task.result()
        except PrepareStopped as exc:  # cancel() ended its worker process (processes.py) before cancelling the chunk
            # kept by its task as a failure is (_fail): the task and its exception form a cycle
            # that would keep this step's frames (chunks, slots, events) until the collector ran
            self._forget(exc)
            self._drain(chunk, ChunkState.CANCELLED)
            return
        except BaseException as exc:  # noqa: BLE001 - the user's prepare failed for this chunk (Ctrl-C too)
            self._fail(chunk, failing, exc)
            return
        if tree is not None:
            chunk.in_tree = tree
        spec = chunk.out_spec
        if spec is None:
            chunk.out_shape, chunk.out_dtype, chunk.out_nbytes = chunk.shape, chunk.dtype, chunk.nbytes
            chunk.out_tree = chunk.in_tree
        elif isinstance(spec, Packed):
            chunk.out_tree = spec
            chunk.out_shape, chunk.out_dtype, chunk.out_nbytes = (spec.nbytes,), np.dtype(np.uint8), spec.nbytes
        else:
            chunk.out_shape, chunk.out_dtype = spec
            chunk.out_nbytes = math.prod(chunk.out_shape) * chunk.out_dtype.itemsize
        self.host_in.move(chunk.host_in, SlotState.FILLED)
        chunk.move(ChunkState.PREPARED)

    def _start_consume(self, chunk: Chunk) -> None:
        slot = chunk.host_out
        self.host_out.move(slot, SlotState.CONSUMING)
        chunk.move(ChunkState.CONSUMING)
        chunk.stamps["consume"] = [self.device.now, None]
        if (self.host_out.external or chunk.members is not None or (chunk.result is not None and self.consume is None)) \
                and "host_out.release_after_consume" not in self._guard_off:
            # the result is already in the caller's memory or in a pooled array of its own:
            # the consumer copies nothing
            chunk.consume_task = _InlineTask(self.device, self._run_consume, chunk, slot.where)
            self._on_consumed(chunk)
            return
        chunk.consume_task = self.pool.submit(self._run_consume, chunk, slot.where, nbytes=chunk.out_nbytes,
                                              after=chunk.host_work)
        if "host_out.release_after_consume" in self._guard_off:
            self._free(self.host_out, slot)  # the fault under test: freed (poisoned) while the consumer reads
            chunk.host_out = None
            self._loose_tasks.append(chunk)
        else:
            slot.fence = chunk.consume_task

    def _run_consume(self, chunk: Chunk, where: BufferSlice) -> Any:
        if chunk.members is not None:
            return None  # each item gets its own bytes of the block when the chunk ends
        result = chunk.result
        if result is not None:  # the d2h wrote a pooled array of the chunk's own
            buffer = chunk.result_buffer  # found at the d2h; none moved no bytes (an empty fill)
            where = BufferSlice(buffer if buffer is not None else buffer_behind(result), 0, chunk.out_nbytes)
        count = math.prod(chunk.out_shape)
        # a checked read (simulated GPU): the consumer reads the result now, ordered after its d2h
        view = where.buffer.view(chunk.out_dtype, offset=where.offset, count=count,
                                 access="r").reshape(chunk.out_shape)
        if result is not None:
            if self.consume is None:
                return self._delivered(chunk, result)
            view = result.view()  # a view of the pooled array holds its block: one kept stays valid
            view.flags.writeable = False
        elif self.consume is None:
            return self._delivered(chunk, np.array(view, copy=True))
        if chunk.out_tree is not None:
            view = host_views(chunk.out_tree, view)
        return run_stage(self.stage_owner, "consume", self.consume, chunk.index, chunk.item, view, index=chunk.index)

    def _delivered(self, chunk: Chunk, result: np.ndarray) -> Any:
        """The value a chunk without a consumer delivers: its result (the arrays of a packed one),
        converted when asked."""
        value = result if chunk.out_tree is None else host_views(chunk.out_tree, result)
        return value if self.convert is None else convert_tree(value, self.convert)

    def _on_consumed(self, chunk: Chunk) -> None:
        task = chunk.consume_task
        chunk.stamps["consume"][1] = self.device.now
        try:
            value = task.result()
        except BaseException as exc:  # noqa: BLE001 - the user's consumer failed for this chunk (Ctrl-C too)
            self._fail(chunk, "consume", exc)
            return
        if chunk.host_out is not None:
            self._free(self.host_out, chunk.host_out)
            chunk.host_out = None
        chunk.value = value
        self._end(chunk, ChunkState.DELIVERED)

    # -- GPU stages ----------------------------------------------------------------------------
    def _enqueue_h2d(self, limit: int) -> bool:
        progressed = False
        while limit and self._h2d_q and self._h2d_q[0].state is ChunkState.PREPARED:
            limit -= 1
            chunk = self._h2d_q[0]
            slot = self.dev_in.acquire(chunk.index, SlotState.COPYING_IN)
            if slot is None:
                break
            self._h2d_q.popleft()
            chunk.dev_in = slot
            s = self.streams.h2d
            self._wait_ready(s, slot, "h2d.wait_slot_ready")
            if chunk.source_ready is not None:  # a device array item: after its producer's work
                s.wait(chunk.source_ready)
            if chunk.host_work is not None and self.host_in.external and self.host_out.external:
                # no pool task of the chunk can come after the scheduler's host work for it (its
                # prepare and consume run inline): its copy in does, as a real scheduler enqueues
                # that copy only once it has done that work (see __init__)
                s.wait(chunk.host_work)
            n = chunk.nbytes
            if self._profile:
                self._mark(chunk, s, "h2d", start=True)
            if n:  # a zero-length item moves no bytes (a copy needs at least one)
                s.copy(_head(slot.where, n), _head(chunk.source or chunk.host_in.where, n), n)
            event = self._mark(chunk, s, "h2d")
            chunk.stamps["h2d.enqueued"] = self.device.now
            self.host_in.move(chunk.host_in, SlotState.COPYING_IN)
            chunk.h2d_event = event
            if "host_in.release_after_h2d" in self._guard_off:
                self._free(self.host_in, chunk.host_in)  # the fault under test: freed before its H2D ran
            else:
                chunk.host_in.fence = event
            slot.fence = event
            chunk.move(ChunkState.ON_DEVICE)
            self._compute_q.append(chunk)
            progressed = True
        return progressed

    def _enqueue_compute(self, limit: int) -> bool:
        progressed = False
        while limit and self._compute_q:
            limit -= 1
            chunk = self._compute_q[0]
            if self.dev_out is not None:
                out_slot = self.dev_out.acquire(chunk.index, SlotState.COMPUTING)
                if out_slot is None:
                    break
            else:
                out_slot = chunk.dev_in
            self._compute_q.popleft()
            chunk.dev_out = out_slot
            s = self.streams.compute
            if "compute.wait_h2d" not in self._guard_off:
                s.wait(chunk.h2d_event)
            if self.dev_out is not None:
                self._wait_ready(s, out_slot, "compute.wait_slot_ready")
            self.dev_in.move(chunk.dev_in, SlotState.COMPUTING)
            trees = None
            compute = self.compute
            if self.config.fill == "rows":
                chunk.filled = []
                compute = _returning(self._raw_compute, chunk.filled)
            if chunk.in_tree is None and chunk.out_tree is None:
                x = chunk.dev_in.where.array(chunk.dtype, chunk.shape)
                y = out_slot.where.array(chunk.out_dtype, chunk.out_shape)
            else:  # several arrays: compute gets each structure back, leaf by leaf
                (x_tree, x), (y_tree, y) = (_leaves(chunk.in_tree, chunk.dev_in.where, chunk.dtype, chunk.shape),
                                            _leaves(chunk.out_tree, out_slot.where, chunk.out_dtype, chunk.out_shape))
                trees = (x_tree, y_tree)
            if self._profile:
                self._mark(chunk, s, "compute", start=True)
            if chunk.members is not None:
                self._launch_members(chunk, s, out_slot, compute)
            elif chunk.out_nbytes:  # a zero-length result has nothing to compute
                try:
                    launch_compute(s, compute, x, y, inplace=self.dev_out is None,
                                   sim_seconds=self._compute_seconds(chunk.nbytes, chunk.index), index=chunk.index,
                                   trees=trees)
                except StageError as err:
                    self._fail(chunk, "compute", err.__cause__)
                    progressed = True
                    continue
            event = self._mark(chunk, s, "compute")
            chunk.stamps["compute.enqueued"] = self.device.now
            chunk.compute_event = event
            if self.dev_out is not None:
                self._release_on_device(self.dev_in, chunk.dev_in, event, "device_in.release_after_compute")
            out_slot.fence = event
            if self.config.deliver != "device" and self.config.fill is None:
                self._d2h_q.append(chunk)  # (with fill="rows": once the compute said how much it filled)
            progressed = True
        return progressed

    def _compute_seconds(self, nbytes: int, index: int) -> Optional[float]:
        """The compute's ``sim_seconds`` for a launch over ``nbytes`` (:func:`sim_seconds_for`). The
        planner checked it for ``chunk_bytes`` only: items come in other sizes.

        Raises:
            StageError: the compute of chunk (or item) ``index`` fails, as its launch would: the cost
                is not seconds for ``nbytes``, or its function raised (``__cause__`` says which;
                a KeyboardInterrupt or SystemExit it raised is the cause itself).
        """
        try:
            return sim_seconds_for(self._sim_compute, nbytes)
        except BaseException as err:  # noqa: BLE001 - a ValueError naming sim_seconds, or an interrupt it raised
            raise StageError("compute", index, err) from err

    def _launch_members(self, chunk: Chunk, stream, out_slot: Slot, compute: Callable) -> None:
        """The compute of a shared chunk's items that their callers have not cancelled: a launch
        for each group of :meth:`_launch_groups` (an item alone, or for a pointwise compute all of
        them at once) on its part of the slots, each followed (where the device reports a
        launch's errors on its events) by an event that carries its errors alone. A group whose
        compute raises while being enqueued fails, and only its items."""
        din, dout = chunk.dev_in.where, out_slot.where
        inplace = self.dev_out is None
        per_item_events = self.device.launch_errors_on_events
        failed = False
        for group, offset, nbytes, dtype, shape in self._launch_groups(chunk):
            x = BufferSlice(din.buffer, din.offset + offset, nbytes).array(dtype, shape)
            y = x if inplace else BufferSlice(dout.buffer, dout.offset + offset, nbytes).array(dtype, shape)
            launched = compute
            if self.config.checked and len(group) > 1:  # one launch over several items: its promise is tested
                size = dtype.itemsize
                launched = checked_pointwise(compute, [(m.index, (m.offset - offset) // size,
                                                        (m.offset - offset + m.nbytes) // size) for m in group],
                                             inplace=inplace, broken=_mark_broken(group))
            try:
                launch_compute(stream, launched, x, y, inplace=inplace,
                               sim_seconds=self._compute_seconds(nbytes, group[0].index), index=group[0].index)
            except StageError as err:
                for m in group:
                    self._member_failed(m, err.__cause__)
                failed = True
                continue
            if per_item_events:
                event = stream.record()
                for m in group:
                    m.event = event
        if failed and self.config.on_error == "raise":
            self._cancel_after_step = True

    def _launch_groups(self, chunk: Chunk) -> list:
        """``(items, offset, nbytes, dtype, shape)`` a launch, over the chunk's items not
        cancelled: one an item, in its own shape; or, for a pointwise compute and at least two
        items of one dtype whose size divides :data:`SLOT_ALIGN`, one over them all, a flat
        array from the lowest offset to the highest item's end.

        That span covers the gaps between items (alignment, cancelled items): a pointwise
        compute writes each element from the same element alone, so no item's result depends on
        them, and no result is taken from them (they hold zeros or an item's own bytes: see
        docs/design.md, "Items sharing a chunk"). Its items share the launch's fate."""
        live = [m for m in chunk.members if not m.future.done()]
        if self._pointwise and len(live) > 1:
            dtype = live[0].dtype
            if all(m.dtype == dtype for m in live) and SLOT_ALIGN % dtype.itemsize == 0:
                start, end = min(m.offset for m in live), max(m.offset + m.nbytes for m in live)
                return [(live, start, end - start, dtype, ((end - start) // dtype.itemsize,))]
        return [([m], m.offset, m.nbytes, m.dtype, m.shape) for m in live]

    def _member_failed(self, m: Member, exc: BaseException, stage: str = "compute") -> None:
        """An item of a shared chunk failed in its compute (or, ``stage="consume"``, as its
        result was converted for ``like``): it alone ends FAILED (its future raises as
        :meth:`_fail` says); the chunk goes on for the others."""
        self._forget(exc)
        err = StageError(stage, m.index, exc)
        m.error = err if isinstance(exc, Exception) else exc
        self.failures.append(err)
        self._first_failure(m.error)

    def _members_failed(self, chunk: Chunk) -> None:
        """Each item of a shared chunk whose compute event carries an error fails alone (the
        chunk's compute has completed, so every item's event has). An item its caller cancelled
        once its compute was enqueued has ended CANCELLED: what its compute raised is no failure,
        as for a chunk of its own cancelled while it drains."""
        failed = False
        for m in chunk.members:
            if m.future.done():
                continue
            ev = m.event
            if ev is not None and m.error is None and ev.is_done and ev.error is not None:
                self._member_failed(m, ev.error.__cause__ or ev.error)
                failed = True
            elif m.broken is not None and m.error is None and (ev is None or ev.is_done):
                # checked mode's pointwise test found this item's result in the shared launch
                # not its result alone: it fails alone, the launch's other items stand
                self._member_failed(m, m.broken)
                failed = True
        if failed and self.config.on_error == "raise":
            self.cancel_pending()

    def _enqueue_d2h(self, limit: int) -> bool:
        progressed = False
        while limit and self._d2h_q:
            limit -= 1
            chunk = self._d2h_q[0]
            slot = self.host_out.acquire(chunk.index, SlotState.COPYING_OUT)
            if slot is None:
                break
            self._d2h_q.popleft()
            chunk.host_out = slot
            s = self.streams.d2h
            if "d2h.wait_compute" not in self._guard_off:
                s.wait(chunk.compute_event)
            ring_out = self.dev_out or self.dev_in
            ring_out.move(chunk.dev_out, SlotState.COPYING_OUT)
            n = chunk.out_nbytes
            dest = slot.where
            if self.results is not None and n and chunk.members is None:
                dest = self._result_for(chunk) or dest
            if self._profile:
                self._mark(chunk, s, "d2h", start=True)
            if chunk.members is not None:
                # every item's result over its input in the chunk's block, which the h2d has
                # read (the d2h waits for the compute, which waited for the h2d): one copy
                used = chunk.staged.nbytes
                s.copy(_head(chunk.source, used), _head(chunk.dev_out.where, used), used)
            elif n:
                s.copy(_head(dest, n), _head(chunk.dev_out.where, n), n)
            event = self._mark(chunk, s, "d2h")
            chunk.stamps["d2h.enqueued"] = self.device.now
            chunk.d2h_event = event
            self._release_on_device(ring_out, chunk.dev_out, event, "device_out.release_after_d2h")
            if "consume.after_d2h" in self._guard_off:
                self._start_consume(chunk)
            else:
                slot.fence = event
            progressed = True
        return progressed

    def _take_fill(self, chunk: Chunk) -> bool:
        """``fill="rows"``: the compute (complete) returned how many rows of its result it filled;
        the chunk's result shrinks to them, so the d2h moves only those. False when the chunk
        failed instead (the compute did not return a row count)."""
        got = chunk.filled[0] if chunk.filled else (0 if chunk.out_nbytes == 0 else None)  # nothing to compute: none
        rows_max = chunk.out_shape[0] if chunk.out_shape else 0
        rows = _row_count(got)
        if rows is None or not 0 <= rows <= rows_max:
            # a count summed on the device (CuPy, torch) is a 0-d array: int() of it, in the compute,
            # waits for the kernel there rather than on the progress thread
            hint = "; a 0-d array is not a count: return int(...) of it" if rows is None and _zero_d(got) else ""
            self._fail(chunk, "compute", ValueError(
                f"with fill='rows' compute must return how many rows of y it filled, an int from 0 to {rows_max}; "
                f"it returned {shown(got)}{hint}"))
            return False
        chunk.out_shape = (rows,) + tuple(chunk.out_shape[1:])
        chunk.out_nbytes = math.prod(chunk.out_shape) * chunk.out_dtype.itemsize
        if chunk.result is not None:  # the pinned array taken for the largest result: its first rows
            chunk.result = chunk.result[:rows]
        return True

    # -- results delivered on the device ---------------------------------------------------------
    def _lend(self, ring: Ring, slot: Slot, chunk: Chunk) -> None:
        """The compute of ``chunk`` is complete: its device slot goes to the consumer (LENT) as a
        :class:`~.delivered.DeviceResult`, and the chunk ends DELIVERED."""
        from .delivered import DeviceResult

        ring.move(slot, SlotState.LENT)
        lending = next(self._lendings)
        self.lent[id(slot)] = lending
        arg = slot.where.array(chunk.out_dtype, chunk.out_shape) if chunk.out_tree is None else \
            _leaves(chunk.out_tree, slot.where, chunk.out_dtype, chunk.out_shape)
        returns = self.returns
        wake = self._wake

        def give_back(event, token, _ring=ring, _slot=slot, _lending=lending):
            returns.append((_ring, _slot, _lending, event, token))  # any thread, a finaliser too
            wake()

        chunk.dev_out = None
        chunk.value = DeviceResult._lent(chunk.index, arg, self.device, give_back, self.device.publish(),
                                         convert=self.convert)
        self._end(chunk, ChunkState.DELIVERED)

    def _wake(self) -> None:
        """Let the driver know a release is waiting; once the scheduler is closed (no driver
        left) take it at once. The lock orders this against :meth:`close`: a release either
        comes before close takes the waiting ones, or sees the scheduler closed."""
        if self._lend_holder == threading.get_ident():
            # a dropped result's finaliser, run by the collector inside this thread's own section
            # under the lock (a close, or a release after it): that section takes it before it
            # lets go (_lend_section); taking the lock again here would wait for ever
            return
        with self._lend_section():
            if self._closed:
                self._take_returns()
                return
        if self.wake_driver is not None:
            self.wake_driver()

    @contextlib.contextmanager
    def _lend_section(self):
        """:attr:`_lend_lock` held by this thread, which, once closed, takes every release queued
        meanwhile (by a finaliser the collector ran inside the section) before it lets go."""
        with self._lend_lock:
            self._lend_holder = threading.get_ident()
            try:
                yield
                while self._closed and self.returns:
                    self._take_returns()
            finally:
                self._lend_holder = None

    def _take_returns(self) -> bool:
        """Hand back the lent slots whose results were released: each one's next compute waits
        for the event recorded on the consumer's stream (without this guard: for nothing)."""
        progressed = False
        while self.returns:
            ring, slot, lending, event, token = self.returns.popleft()
            self.device.observe(token)
            if slot.state is not SlotState.LENT or self.lent.get(id(slot)) != lending:
                continue  # the context broke meanwhile and every slot was taken back
            del self.lent[id(slot)]
            progressed = True
            if self._closed:  # the streams are gone: free the ring once its last lent slot is back
                self.device.observe(self._close_token)
                if event is not None:
                    event.sync()
                ring.move(slot, SlotState.DRAINING)
                ring.release(slot)
                if not ring.busy:
                    ring.close()
                continue
            self._release_on_device(ring, slot, event, "device_out.release_after_consumer")
        return progressed

    def _result_for(self, chunk: Chunk) -> Optional[BufferSlice]:
        """A pinned pool array for ``chunk``'s result; its bytes, or None (no cached block).

        A chunk staged at acceptance gets its result back in its own staging array: the d2h
        waits for the compute, which waited for the h2d that read it. Any other chunk takes a
        cached block only (pinning new memory can wait for the whole device: not on the thread
        that drives the streams). The chunk holds the array until it ends, and a chunk ends only
        after its d2h completed (a cancelled or failed one drains first), so the pool never gets
        the block back while the copy into it may be pending; a dead context (sticky error) runs
        nothing more."""
        staged = chunk.staged
        if chunk.result is not None:  # taken for the output spec at acceptance
            arr = chunk.result
        elif staged is not None and staged.shape == chunk.out_shape and staged.dtype == chunk.out_dtype:
            arr = staged
        else:
            arr = self.results.take(chunk.out_shape, chunk.out_dtype, allocate=False)
            if arr is None:
                return None
        chunk.result = arr
        # the staged block's buffer was found for the h2d already; the consumer reads this one
        chunk.result_buffer = chunk.source.buffer if arr is staged else buffer_behind(arr)
        return BufferSlice(chunk.result_buffer, 0, chunk.out_nbytes)

    def _mark(self, chunk: Chunk, stream, stage: str, start: bool = False):
        """:func:`~.stages.mark` for ``chunk``: its timing events are kept only when profiling."""
        return mark(stream, stage, chunk.events if self._profile else None, start=start,
                    device=self.device)

    # -- failure, cancellation, the end of a chunk ----------------------------------------------
    def _compute_failed(self, chunk: Chunk) -> bool:
        """Check the compute event's error once (the sim reports a failed launch there).

        Raises:
            DeviceError: the event carries the device's sticky error (:func:`_raise_if_broken`).
        """
        if chunk.state in (ChunkState.DRAINING,) or chunk.state.final:
            return True
        if chunk.members:
            self._members_failed(chunk)  # may cancel the rest (on_error="raise"), this chunk too
            if chunk.state is ChunkState.DRAINING or chunk.state.final:
                return True
        event = chunk.compute_event
        err = event.error if event is not None and event.is_done else None
        if err is None:
            return False
        _raise_if_broken(event)
        self._fail(chunk, "compute", err.__cause__ or err)
        return True

    def _fail(self, chunk: Chunk, stage: str, exc: BaseException) -> None:
        """End ``chunk`` FAILED: its future raises a StageError naming the stage (the original as
        ``__cause__``), or, for a BaseException that is not an Exception (KeyboardInterrupt,
        SystemExit), the original itself, so an interrupt stays an interrupt for the caller."""
        self._forget(exc)
        err = StageError(stage, chunk.index, exc)
        chunk.error = err if isinstance(exc, Exception) else exc
        self.failures.append(err)
        self._first_failure(chunk.error)
        self._drain(chunk, ChunkState.FAILED)
        if self.config.on_error == "raise":
            self.cancel_pending()

    def _first_failure(self, err: BaseException) -> None:
        """Record ``err`` as :attr:`first_error` if none is yet; with ``on_error="raise"`` the first
        one also calls :attr:`on_failure_stop` (the caller cancels this pipeline's pending work)."""
        if self.first_error is not None:
            return
        self.first_error = err
        if self.config.on_error == "raise" and self.on_failure_stop is not None:
            try:
                self.on_failure_stop()
            except Exception:  # noqa: BLE001 - the other parts' cancel is best effort; this part stops all the same
                logger.debug("stopping the other parts after a failure failed", exc_info=True)

    def _drain(self, chunk: Chunk, ending: ChunkState) -> None:
        """End ``chunk`` as ``ending`` once every slot it holds has seen its fence complete."""
        for q in (self._accepted_q, self._h2d_q, self._compute_q, self._d2h_q):
            if chunk in q:
                q.remove(chunk)
        chunk.ending = ending
        if chunk.state is not ChunkState.DRAINING:
            chunk.move(ChunkState.DRAINING)
        self._drain_slots(chunk)
        self._maybe_end(chunk)

    def _drain_slots(self, chunk: Chunk) -> None:
        """Every busy slot of ``chunk`` to DRAINING: freed now if no operation is pending on it,
        else once its fence completes (work enqueued on a stream cannot be recalled)."""
        for ring in self._rings:
            for slot in list(ring.busy.values()):
                if slot.owner != chunk.index or slot.state is SlotState.DRAINING:
                    continue
                ring.move(slot, SlotState.DRAINING)
                if slot.fence is None:
                    self._free(ring, slot)

    def _maybe_end(self, chunk: Chunk) -> None:
        if chunk.state is not ChunkState.DRAINING:
            return
        if any(s.owner == chunk.index for r in self._rings for s in r.busy.values()):
            return
        self._end(chunk, chunk.ending)

    def _end(self, chunk: Chunk, final: ChunkState) -> None:
        chunk.move(final)
        chunk.stamps["ended"] = self.device.now
        if chunk.in_map:
            # a map() hands it out; it holds capacity until then (counted before the chunk
            # leaves: an accepting thread without the driver's lock must never see room that is
            # not there)
            self.unclaimed += 1
        del self.chunks[chunk.index]
        if chunk.members is None:
            self.counts[final.value] += 1
        self.version += 1
        if self._on_chunk_end is not None:
            self._on_chunk_end(chunk)
        fut = chunk.future
        fut.token = self.device.publish()  # the thread that takes the result is ordered after this
        # the pool arrays the chunk's copies used (its staged copy and result, a caller's pool
        # array read in place): whoever drops one last, on whatever thread, the next taker of its
        # block is ordered after this thread, which saw every copy of the chunk complete
        for arr in (chunk.staged, chunk.result, chunk.item if chunk.source is not None else None):
            if arr is not None:
                hand_off(arr, fut.token)
        if fut.done():  # cancelled by its caller while its enqueued work drained
            pass
        elif final is ChunkState.DELIVERED:
            fut._put_result(chunk.value)
        elif final is ChunkState.FAILED:
            fut._put_error(chunk.error)
        else:
            fut._mark_cancelled()
        if chunk.members is not None:
            self._end_members(chunk, final, fut.token)
        self._finish(chunk)

    def _end_members(self, chunk: Chunk, final: ChunkState, token: Any) -> None:
        """Settle the future of every item of a shared chunk that ended ``final``: a delivered
        chunk gives each item its own part of the result (or the error its compute raised), a
        failed one its error; an item its caller cancelled stays cancelled. Counts each item. The
        caller has left ``token`` on the chunk's block (the part of a slab that holds the
        results)."""
        block = chunk.staged
        for m in chunk.members:
            self._members.pop(m.index, None)
            fut = m.future
            fut.token = token
            value = None
            if final is ChunkState.DELIVERED and m.error is None and not fut.done():
                value = self._member_result(block, m)  # (fails the item where like= cannot convert it)
            if fut.done():
                # cancelled by its caller while the chunk went on for the others, or failed as
                # the driver died while the chunk waited in the inbox (admit_after_death)
                self.counts["cancelled" if fut.cancelled() else "failed"] += 1
            elif m.error is not None:  # its own compute (or conversion) failed: its own error
                self.counts["failed"] += 1
                fut._put_error(m.error)
            elif final is ChunkState.DELIVERED:
                self.counts["delivered"] += 1
                fut._put_result(value)
            elif final is ChunkState.FAILED:
                self.counts["failed"] += 1
                fut._put_error(chunk.error)
            else:
                self.counts["cancelled"] += 1
                fut._mark_cancelled()
            m.event = None
        chunk.members = []  # the futures hold the results; the ended chunk holds none of them

    def _member_result(self, block: np.ndarray, m: Member) -> Any:
        """An item's result in a delivered shared chunk: its own bytes of the block (the view
        holds the slab, not the chunk), converted for ``like``. An item whose result has no such
        array fails alone (``m.error``; with ``on_error="raise"`` the rest are cancelled once this
        step is done, as for a failed compute) and gets None."""
        value = block[m.offset:m.offset + m.nbytes].view(m.dtype).reshape(m.shape)
        if self.convert is None:
            return value
        try:
            return convert_tree(value, self.convert)
        except Exception as exc:  # noqa: BLE001 - like=: this item's result has no such array
            self._member_failed(m, exc, "consume")
            if self.config.on_error == "raise":
                self._cancel_after_step = True
            return None

    def take_resolved(self) -> list:
        """Futures set since the last call whose done-callbacks wait to run outside the lock."""
        out, self.resolved = self.resolved, []
        return out

    @staticmethod
    def _finish(chunk: Chunk) -> None:
        """Drop what an ended chunk no longer needs (events, tasks, slots): a result held by a map
        must not pin them."""
        chunk.host_in = chunk.dev_in = chunk.dev_out = chunk.host_out = None
        chunk.staged = chunk.source = chunk.result = chunk.result_buffer = chunk.on_device = None
        chunk.source_ready = None
        chunk.prepare_task = chunk.consume_task = None
        chunk.h2d_event = chunk.compute_event = chunk.d2h_event = None
        chunk.events = {}
        chunk.batch = None

    def unended_futures(self) -> list:
        """The futures of every accepted item not yet done (lock held): chunks admitted or in the
        inbox, and the items of shared chunks (the open one included)."""
        chunks = list(self.chunks.values()) + list(self.inbox) + list(self._members.values())
        if self.open_batch is not None:
            chunks.append(self.open_batch)
        futures, seen = [], set()
        with self.batch_lock:  # (items may be joining a shared chunk)
            for chunk in chunks:
                if id(chunk) not in seen:
                    seen.add(id(chunk))
                    futures.append(chunk.future)
                    futures.extend(m.future for m in chunk.members or ())
        return [f for f in futures if f is not None and not f.done()]

    def stop_admission(self) -> None:
        """Take no more work; what was accepted (the inbox too) still runs to its end."""
        if self.stopped_how is None:
            self.stopped_how = "closed"
        self._refuse_more()

    def _refuse_more(self, broken: Optional[DeviceError] = None) -> None:
        """Accept nothing from now on (``broken``: the device broke). Under the batch lock, which
        every accept holds while it checks and appends (:meth:`accept`): once this returns, no
        chunk enters the inbox, so one the driver has seen empty stays empty."""
        with self.batch_lock:
            if broken is not None:
                self.broken = broken
            self.accepting = False
        self.version += 1

    def cancel_pending(self) -> None:
        """Stop admission; end not-yet-enqueued chunks CANCELLED at once; drain the rest."""
        self.stopped_how = "cancelled"
        self._refuse_more()
        try:
            self._cancel_pending()
        except DeviceError as err:  # a poison fill found the context dead: break, as step() does
            if not err.sticky:
                raise
            self.break_on(err)

    def _cancel_pending(self) -> None:
        self._cancel_admitted = True  # a chunk whose items are still being copied in ends at admission
        self._admit()  # handed over before the cancel: admitted, then ended CANCELLED with the rest
        for chunk in sorted(self.chunks.values(), key=lambda c: c.index):
            self._cancel_chunk(chunk)

    def _cancel_chunk(self, chunk: Chunk) -> bool:
        """End ``chunk`` CANCELLED: at once if nothing of it is on a stream, else once the work
        already enqueued completes. False for a chunk already consuming, draining or ended."""
        if chunk.state in (ChunkState.DRAINING, ChunkState.CONSUMING) or chunk.state.final:
            return False
        if chunk.state in (ChunkState.ACCEPTED, ChunkState.PREPARING, ChunkState.PREPARED):
            # nothing of it is on a stream: it ends now; a running prepare keeps its
            # host-in slot DRAINING until the task returns
            for q in (self._accepted_q, self._h2d_q):
                if chunk in q:
                    q.remove(chunk)
            self._drain_slots(chunk)
            self._end(chunk, ChunkState.CANCELLED)
        else:
            self._drain(chunk, ChunkState.CANCELLED)
        return True

    def stop_prepare(self, index: int) -> bool:
        """With ``processes=True``: kill the worker process running the prepare of chunk ``index``
        (about to be cancelled), so that its prepare ends (PrepareStopped, the chunk CANCELLED)
        rather than run to its end, for ever for one that never returns. Called before the
        driver's lock is taken, as ``Pipeline.cancel`` stops every prepare: on the simulated GPU a
        prepare runs on the thread that advances the device, holding its lock. Reads the chunk
        without the lock: a worker is killed only while its task is this chunk's
        (:meth:`.ProcessPrepare.stop_task`). A prepare of the chunk not yet started (queued, or
        the chunk still in the inbox) never starts: it raises PrepareStopped instead. Returns
        whether a worker was killed; never raises."""
        procs = self._procs
        if procs is None:
            return False
        chunk = self.chunks.get(index)
        if chunk is None:  # (still in the inbox: admitted, it may start its prepare before the cancel)
            with self.batch_lock:
                chunk = next((c for c in self.inbox if c.index == index and c.members is None), None)
        if chunk is None or chunk.state.final:
            return False
        # set before the pool is asked: a prepare not yet named there (queued, or about to start
        # on the thread driving the simulated GPU, which the cancel waits for) sees it and never
        # starts (_run_prepare)
        chunk.stop_prepare = True
        return chunk.state is ChunkState.PREPARING and procs.stop_task(chunk)

    def cancel_chunk(self, index: int) -> bool:
        """Cancel one accepted chunk (its future's ``cancel``); the rest go on. Returns False if
        it can no longer be cancelled (its consumer is running, or it has ended)."""
        self._admit()  # it may still be in the inbox
        shared = self._members.get(index)
        if shared is not None:
            return self._cancel_member(shared, index)
        chunk = self.chunks.get(index)
        if chunk is None:
            # still in the inbox, behind a chunk that items are being copied into: nothing of it
            # has run, and admission ends it CANCELLED once the caller has marked its future so
            with self.batch_lock:  # (accepting threads append to the inbox meanwhile)
                return any(c.index == index and c.members is None for c in self.inbox)
        try:
            return self._cancel_chunk(chunk)
        except DeviceError as err:  # a poison fill found the context dead: break, as step() does
            if not err.sticky:
                raise
            self.break_on(err)
            return False

    def _cancel_member(self, chunk: Chunk, index: int) -> bool:
        """Cancel one item of a shared chunk: the chunk itself is cancelled once no other item of it
        is still wanted; otherwise it goes on, and this item's part is not computed (if not yet
        enqueued) and not delivered. False once the chunk is consuming, draining or ended, and
        for an item whose own compute has failed already: it ends FAILED, its error among the
        pipeline's failures (as a chunk of its own that failed cannot be cancelled)."""
        if chunk.state in (ChunkState.DRAINING, ChunkState.CONSUMING) or chunk.state.final:
            return False
        with self.batch_lock:  # an item may be joining it
            if any(m.index == index and m.error is not None for m in chunk.members):
                return False
            others_wanted = any(not m.future.done() for m in chunk.members if m.index != index)
        if others_wanted:
            return True  # the caller marks this item's future cancelled
        if chunk.index not in self.chunks:
            return True  # still in the inbox: ends CANCELLED at admission, every item being cancelled
        try:
            return self._cancel_chunk(chunk)
        except DeviceError as err:
            if not err.sticky:
                raise
            self.break_on(err)
            return False

    def break_on(self, err: DeviceError) -> None:
        """A sticky device error: nothing on the device will complete; end everything FAILED."""
        self._refuse_more(err)
        self._end_all(err, keep_lent=False)  # the context is dead: no operation can still touch a slot

    def _end_all(self, err: BaseException, *, keep_lent: bool) -> None:
        """End every admitted chunk FAILED with ``err`` (one already draining keeps its own
        ending) and release every busy slot now: only once no operation can still touch them.
        Each chunk's end hands its pooled blocks back ordered after this thread, as a drained
        chunk's does. ``keep_lent``: slots lent out as results on the device stay the
        consumer's (their memory still works)."""
        for chunk in sorted(self.chunks.values(), key=lambda c: c.index):
            if chunk.state is ChunkState.DRAINING:
                continue  # already failing (its own StageError) or cancelled: it keeps that ending
            chunk.error = err
            chunk.ending = ChunkState.FAILED
            chunk.move(ChunkState.DRAINING)
        for ring in self._rings:
            for slot in ring.slots:
                if keep_lent and slot.state is SlotState.LENT:
                    continue
                slot.fence = None
                if slot.state is not SlotState.FREE:
                    if slot.state is not SlotState.DRAINING:
                        ring.move(slot, SlotState.DRAINING)
                    ring.release(slot)
        for q in (self._accepted_q, self._h2d_q, self._compute_q, self._d2h_q):
            q.clear()
        for chunk in sorted(self.chunks.values(), key=lambda c: c.index):
            self._end(chunk, chunk.ending)

    def end_after_death(self, err: BaseException, timeout: float) -> bool:
        """Clean up after the driver died of a ringflow bug, maybe half way through a step (lock
        held, on the dead driver's thread): take no more work (an offer is refused with ``err``'s
        words); admit what the inbox holds; wait up to ``timeout`` seconds of the device's host
        clock for everything enqueued on the pipeline's streams, and every pending host task, to
        complete; then end every admitted chunk FAILED with ``err`` (:meth:`_end_all`), which
        hands its pooled blocks back ordered after their last copy, as a chunk drained after a
        cancel does. The wait covers the streams, not only the fences the scheduler recorded: a
        step that died may have enqueued a copy before it recorded its fence.

        Returns True if the work was seen complete, or the device was closed (its close ran
        that work to completion). False if not (the wait timed out or the device failed): the
        pooled arrays of the chunks not yet ended, and the host rings with a busy slot, may
        still be written by that work, so they are kept in :data:`KEPT` for good, never handed
        out again nor freed, and a warning is logged. Never raises an ``Exception``."""
        self.stopped_by = err
        self._refuse_more()
        try:
            # (a shared chunk whose items are still being copied in stays, and the chunks behind
            # it: no device work is on them; the last copy to end ends them, admit_after_death)
            self._admit()
        except Exception:  # noqa: BLE001 - the state the bug left: its chunks end below all the same
            logger.debug("admitting the inbox after the driver died failed", exc_info=True)
        try:
            complete = self._wait_enqueued(timeout)
        except Exception:  # noqa: BLE001 - a broken device: its work was not seen complete
            logger.debug("waiting for the work of a pipeline whose driver died failed", exc_info=True)
            # a device closed (by another thread, under a whole-array call) ran every operation
            # and host task to completion as it closed and runs none after: nothing can still
            # write this memory, and keeping it would keep the host rings until the process ends
            complete = getattr(self.device, "closed", False)
        if not complete:
            self._keep_for_good(timeout)
        try:
            self._end_all(err, keep_lent=True)
        except Exception:  # noqa: BLE001 - the futures left pending are failed by the driver
            logger.debug("ending the chunks of a pipeline whose driver died failed", exc_info=True)
        return complete

    def admit_after_death(self) -> None:
        """Once :meth:`end_after_death` has run (lock held; else nothing): admit what the inbox
        holds and end it FAILED with the error that stopped the driver. The dying thread left
        there a chunk that small items share while a copy into it was still being made, and every
        chunk behind it; the thread whose copy ends last calls this (its submit's clean-up too),
        so each of their items is counted ended and the chunk's block goes back to the pool
        ordered after the copies. No work of these chunks is on a stream. Never raises an
        ``Exception``."""
        err = self.stopped_by
        if err is None:
            return
        try:
            self._admit()  # (stops again at a chunk another thread is still copying into: that thread comes here next)
            self._end_all(err, keep_lent=True)
        except Exception:  # noqa: BLE001 - their futures were failed as the driver died
            logger.debug("ending the inbox of a pipeline whose driver died failed", exc_info=True)

    def _wait_enqueued(self, timeout: float) -> bool:
        """Wait (device host clock, at most ``timeout`` seconds) for an event recorded now on every
        stream of the pipeline and for every host task still pending; returns whether all were
        seen complete (this thread is then ordered after them).

        Raises:
            DeviceError: the device is broken.
        """
        found = [stream.record() for stream in self.streams.all]
        found += [slot.fence for ring in self._rings for slot in ring.busy.values() if slot.fence is not None]
        for chunk in list(self.chunks.values()) + self._loose_tasks:
            found += [t for t in (chunk.prepare_task, chunk.consume_task) if t is not None]
        waits, seen = [], set()
        for w in found:
            if id(w) not in seen and not isinstance(w, _InlineTask):  # (one ran on this thread: done)
                seen.add(id(w))
                waits.append(w)
        deadline = self.device.now + timeout
        while waits:
            left = deadline - self.device.now
            if left <= 0:
                return False
            done = self.device.wait_any(waits, timeout=left)  # observes (orders this thread after) each one done
            waits = [w for w in waits if not any(w is d for d in done)]
        return True

    def _keep_for_good(self, timeout: float) -> None:
        """Keep the memory the work of a dead driver may still use (see :meth:`end_after_death`)
        and say so."""
        arrays = []
        for chunk in self.chunks.values():
            in_place = chunk.item if chunk.source is not None else None
            arrays += [a for a in (chunk.staged, chunk.result, chunk.batch, in_place) if a is not None]
        rings = [ring for ring in self._rings if ring.buffer.is_host and not ring.external and ring.busy]
        KEPT.extend(arrays)
        KEPT.extend(ring.buffer for ring in rings)
        self._kept_rings.extend(rings)
        if arrays or rings:
            logger.warning(
                "ringflow: a pipeline's progress thread died and the work it had enqueued was not seen complete "
                "within %g s (or the device failed): %d pooled host arrays (%d B) and %d host ring buffers it may "
                "still write are never handed back to the pool nor freed (kept until the process ends)",
                timeout, len(arrays), sum(a.nbytes for a in arrays), len(rings))

    def close(self) -> None:
        self._forget_finished_frames()
        with self.batch_lock:
            self.space.release()  # the slab goes back to the pool once its chunks and results are gone
        with self._lend_section():
            self._take_returns()
            self._closed = True
            self._release_resources()
            # a result released after this, on any thread, frees its slot there (_take_returns):
            # that thread takes this lock after us, so it has seen all we saw (every completion,
            # the wait for the streams a ring kept for such a result included)
            self._close_token = self.device.publish()
        # a closed scheduler is still reachable from the frames of an error raised by its job,
        # which a caller may keep: it keeps nothing of the caller's (the arrays its stages close
        # over, the memory behind its external rings)
        self._forget_job()

    def forget_failures(self) -> None:
        """Drop the failures kept for inspection (:attr:`failures`, :attr:`first_error`): for a
        closed scheduler nobody can inspect (a whole-array call's), whose failure has been raised
        to the caller. The frames of that raise hold this scheduler, so a failure kept here would
        keep them, and they it, until the cyclic collector runs."""
        self.failures.clear()
        self.first_error = None
        self._forget_again = []

    def _forget(self, exc: BaseException) -> None:
        """Clear the frames of a failure the pipeline keeps (:func:`forget_frames`): those that
        have returned now, and the scheduler's own that are still running (the call that saw the
        failure, holding the chunk) once they have returned (:meth:`_forget_finished_frames`):
        always looked at again, since :func:`forget_frames` reports only other threads' frames."""
        forget_frames(exc)
        self._forget_again.append(exc)

    def _forget_finished_frames(self) -> None:
        """:func:`forget_frames` again for the failures of earlier steps (those steps have returned).
        A failure whose stage ran inside another thread's call (on the simulated GPU, a caller's
        staging copy or wait advanced virtual time) is looked at again at every step until that
        call has returned, and once more at close."""
        if self._forget_again:  # (every step: a new list only where there is something to look at)
            self._forget_again = [exc for exc in self._forget_again if forget_frames(exc)]

    # -- reuse by a later job (see ringflow._pipeline.warm) ---------------------------------------
    def idle(self) -> bool:
        """Nothing accepted is unfinished, every slot is FREE, nothing failed and the device
        works: the rings, streams and workers could serve another job as they are."""
        return (self.broken is None and self.accepting and not self.chunks and not self.failures
                and not self._loose_tasks and self.unclaimed == 0
                and not any(ring.busy for ring in self._rings)
                and not (self._accepted_q or self._h2d_q or self._compute_q or self._d2h_q))

    def park(self) -> None:
        """Forget the finished job: its stage callbacks and the caller's memory behind
        external rings (so a kept scheduler keeps none of the caller's arrays alive)."""
        self._forget_job()

    def _forget_job(self) -> None:
        """:meth:`park`'s work, also done on :meth:`close`."""
        self.prepare = self.consume = _no_job
        self.item_nbytes = lambda item: 0
        for ring in (self.host_in, self.host_out):
            if ring.external:
                ring.rebind(None)

    def rearm(self, prepare: Prepare, consume: Consume, item_nbytes: Callable[[Any], int], *,
              host_in_buffer=None, host_out_buffer=None) -> None:
        """Take a new job on an idle, parked scheduler: new stage callbacks, the new caller
        buffers behind external rings (laid out as the old ones), counters from zero. Device
        slots keep their ``ready`` events: the next owner waits on them as within one job."""
        if not self.idle():
            raise RuntimeError("only an idle scheduler can take a new job")
        if self.host_in.external != (host_in_buffer is not None) or \
                self.host_out.external != (host_out_buffer is not None):
            raise ValueError("rearm needs caller buffers exactly where this scheduler has external rings")
        if host_in_buffer is not None:
            self.host_in.rebind(host_in_buffer)
        if host_out_buffer is not None:
            self.host_out.rebind(host_out_buffer)
        self.prepare, self.consume, self.item_nbytes = prepare, consume, item_nbytes
        self.counts.clear()
        self._indices = itertools.count()  # a new job's chunks count from 0 (a StageError's index)
        self.first_error = None
        self.steps = 0
        self.host_seconds = 0.0
        for ring in self._rings:
            ring.high_water = 0


MAX_KEPT_FAILURES = 1024


def map_cut_short(call: str, scheds: "list[Scheduler]", handed_out: int,
                  own_close: bool = False) -> concurrent.futures.CancelledError:
    """The error a map (``call``: "map()" or "amap()") raises when the pipeline stopped taking work
    (``scheds``: its schedulers, one a device) while the map still had input left or items of its
    own pending, once it has handed out the ``handed_out`` results that had ended: its caller
    must not take the results it got for all of them. A concurrent.futures.CancelledError, as a
    cancelled future's ``result()`` raises (not asyncio's, which an ``amap`` caller would take
    for its own task's cancellation).

    Called on the map's consumer thread: a close is said to be another caller's unless
    ``own_close`` (the map's own consumer closed it: an amap's window given up for it) or the
    close() that stopped one of ``scheds`` ran on this thread (the loop over the map called it)."""
    stopped_by = next((s.stopped_by for s in scheds if s.stopped_by is not None), None)
    if stopped_by is not None:
        why = f"the pipeline stopped ({stopped_by})"
    elif any(s.stopped_how == "cancelled" for s in scheds):
        why = "the pipeline was cancelled (cancel(), or a with block left by an error)"
    else:
        here = threading.current_thread()
        own = own_close or any(s.closed_by is here for s in scheds)
        by = "" if own else " by another caller"
        why = f"the pipeline was closed{by} (close() takes no more of a running map's input)"
    results = "result" if handed_out == 1 else "results"
    return concurrent.futures.CancelledError(
        f"{call} was cut short after handing out {handed_out} {results}: {why}. The items it had not run "
        "were not run: submit them to a new Pipeline. To stop a map of your own, break out of its loop "
        "(or close its iterator) instead of cancelling the pipeline.")


def check_fill_rows(several: bool, ndim: int, what: str) -> None:
    """Refuse, for ``fill="rows"``, an item the compute could not fill by rows.

    Raises:
        ValueError: ``what`` is several arrays (``several``), or has no rows (``ndim`` 0).
    """
    if several:
        raise ValueError(f"fill='rows' needs items of one array (the rows filled are counted along its first "
                         f"axis); {what} is several arrays (a tuple, list or dict): pass them as one array, or "
                         "drop fill='rows'")
    if ndim == 0:
        raise ValueError(f"fill='rows' needs items with rows (the first axis); {what} is a 0-d array")


def _no_job(*args: Any) -> Any:
    raise RuntimeError("this scheduler is parked between jobs; rearm() it first")


class _InlineTask:
    """A host stage run at once on the scheduler's thread, shaped like a finished HostTask."""

    is_done = True

    def __init__(self, device, fn, *args):
        start = device.now
        self._value = self._exc = None
        try:
            self._value = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - delivered by result(), as a pool task's would be
            self._exc = exc
        self.span = (start, device.now)

    def result(self):
        if self._exc is not None:
            raise self._exc
        return self._value


def _reraise(exc: BaseException) -> None:
    raise exc


def _row_count(got: Any) -> Optional[int]:
    """What a ``fill="rows"`` compute returned as a plain int, or None where it is no integer (a
    bool, another type, or an integer that cannot say its value). A plain int: comparing the
    compute's own object, an int subclass, would run its code on the progress thread."""
    if isinstance(got, (bool, np.bool_)) or not isinstance(got, (int, np.integer)):
        return None
    try:
        return operator.index(got)
    except Exception:  # noqa: BLE001 - whatever an integer subclass's __index__ raises: not a count
        return None


def _zero_d(got: Any) -> bool:
    """Whether the compute's return value is a 0-d array (its ``shape`` an empty tuple); False
    for anything whose ``shape`` cannot be read, which runs none of its code past that."""
    try:
        shape = getattr(got, "shape", None)
    except Exception:  # noqa: BLE001 - the user's object: a property that raises is no shape
        return False
    return type(shape) is tuple and not shape


def _mark_broken(group: list) -> Callable[[int, Exception], None]:
    """The ``broken`` callback of :func:`checked_pointwise` for a launch over ``group``: it keeps
    the error on the item of that index, which :meth:`Scheduler._members_failed` fails with once
    the launch's event is done (the check runs inside the launch, on the simulated GPU's clock,
    where the scheduler's state is not changed)."""
    by_index = {m.index: m for m in group}

    def broken(index: int, error: Exception) -> None:
        by_index[index].broken = error

    return broken


def _raise_if_broken(event: Any) -> None:
    """Raise the sticky device error that ``event`` (an event or host task seen done) carries.
    A real GPU counts an event done once its context has broken, its :attr:`~Event.error` the
    sticky error, though the work before it never ran (the simulated GPU raises from the query
    instead): the fence's slot must not be taken as done with, nor its chunk as failed alone.

    Raises:
        DeviceError: the sticky error, as a new one naming the same failure (the event keeps
            its own: raising that would tie this thread's frames to the event through its
            traceback).
    """
    err = getattr(event, "error", None)
    if isinstance(err, DeviceError) and err.sticky:
        raise DeviceError(str(err), sticky=True) from err.__cause__


def _returning(compute: Callable, box: list) -> Callable:
    """``compute`` whose return value goes into ``box`` (it runs when the launch runs: at enqueue
    on a real GPU, when the kernel runs on the simulated one; either way before the compute's
    event is seen complete)."""
    def run(x: Any, y: Any) -> None:
        box.append(compute(x, y))

    run.sim_seconds = getattr(compute, "sim_seconds", None)  # type: ignore[attr-defined]
    return run


def _described(shape: tuple, dtype: np.dtype) -> tuple:
    """The prepare of an item already in pinned memory: only what it is (a packed one's layout
    came with it at acceptance)."""
    return shape, dtype, math.prod(shape) * dtype.itemsize, None


def _leaves(layout: Optional[Packed], where: BufferSlice, dtype: np.dtype, shape: tuple) -> tuple:
    """``(tree, leaf arguments)`` of a slot: the packed layout's leaves, or the one array."""
    if layout is None:
        return LEAF, [where.array(dtype, shape)]
    return layout.tree, device_args(layout, where)


def _head(where: BufferSlice, nbytes: int) -> BufferSlice:
    return BufferSlice(where.buffer, where.offset, nbytes)
