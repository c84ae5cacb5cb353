"""A caching allocator of pinned host memory whose numpy arrays return to the pool when dropped.

One :class:`HostPool` per device (:func:`pool_for`). ``pool.empty(shape, dtype)`` hands out a
numpy array over a cached pinned block (a :class:`~ringflow._device.protocol.HostBuffer` from
``device.allocate_host``); allocating and freeing pinned memory costs far more than reusing it.
The design follows PyTorch's ``CachingHostAllocator``:

* **Size classes.** A request is rounded up to its class: a multiple of 512 bytes up to 64 KiB,
  above that one of four classes per power of two (``2**k`` times 1, 1.25, 1.5 or 1.75), so a
  block is at most a quarter larger than the request. A block serves only requests of its own
  class.
* **Return on drop.** Every view of a handed-out array keeps one owner object alive; when the
  owner is collected its block goes back to the pool. The owner's ``__del__`` only queues the
  block (it may run on any thread, at any allocation); the queue is drained by the next :meth:`empty`,
  :meth:`collect` or :meth:`stats`.
* **Held while a device operation may still use it.** Whoever enqueues a copy into or out of a
  pooled array tells the pool with :meth:`HostPool.record_use` (the event recorded after the
  copy). A dropped block whose recorded events are not all done is *pending*: it is handed out
  again only once every one of them is done (queried at the next :meth:`empty` or
  :meth:`collect`; ``collect(wait=True)`` waits for them).
* **Ctrl-C.** A KeyboardInterrupt at any instruction of a hand-out leaves its block either in the
  caller's array or back in the cache (``take``'s claim list, a generation per put-back: see
  :meth:`HostPool._put_back`); one while a dropped array's block is taken back (``collect``,
  waiting or not) leaves it pending or free (:meth:`HostPool._process`); one while cached
  blocks are freed leaves each freed or back in the cache (:meth:`HostPool._restore`).
* **Budget.** The pool holds at most ``budget`` bytes of pinned memory (in use, pending and
  cached together). A request that does not fit after freeing cached blocks, or whose pinning
  the device refuses, gets an ordinary pageable numpy array instead, with one logged note per
  pool on the ``"ringflow"`` logger. Cached blocks are freed for a request only where that
  makes it fit: one larger than the budget less the memory in use and pending leaves the cache
  as it is. A budget lowered below the memory in use leaves those blocks with their arrays;
  a dropped block taken back while the pool is over its budget is freed instead of cached,
  once its recorded uses are done, like any cached block freed (:meth:`_settled`).

Ordering on the simulated GPU: every hand-out takes a fresh checked host view of the block (a
write and a read by the allocating thread), so a block handed out while a copy into it is
pending is a :class:`~ringflow.HazardError`. The thread that drops an array publishes what it
has done (:meth:`Device.publish`) and whoever takes the block next observes that, so a block
passed between threads through the pool is ordered as a queue hand-off is. The hand-out leaves a
token of its own on the block: a caller may pass the array from the thread it was handed out on
to another by its own means (a lock, a queue, a join), which the checker cannot see, so the
block's next taker observes it, and so does :func:`receive`, which whatever takes the array in
for device work calls.

Nothing here knows about pipelines; :func:`buffer_behind` lets a caller find the pinned buffer
behind a pooled array to copy it in place.
"""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import logging
import math
import operator
import os
import threading
import weakref
from typing import Any, Optional, Sequence

import numpy as np

from .._checks import as_dtype
from .._errors import DeviceError
from .protocol import BufferSlice, Device, Event, HostBuffer, LiveCounts, check_nbytes, device_names

logger = logging.getLogger(__name__)

SMALL_BYTES = 64 << 10  # up to here classes are multiples of SMALL_STEP
SMALL_STEP = 512
POISON = 0xEE  # a block returned to the cache on a checked simulated GPU is filled with this
_PRUNE_AT = 16  # events kept per block before done ones are dropped

# Test-only switch: False hands a dropped block out again at once, even while a recorded
# copy into or out of it is pending. Tests turn it off to show the checker catches the reuse.
_HOLD_UNTIL_DONE = True


def physical_memory() -> Optional[int]:
    """The host's physical memory (bytes), or None where the system does not say."""
    try:
        page, pages = os.sysconf("SC_PAGE_SIZE"), os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    return page * pages if page > 0 and pages > 0 else None  # (-1: the system does not know)


def quarter_of_memory() -> int:
    """A quarter of the host's physical memory (bytes), what pinned memory of ringflow's own may
    take by default: 4 GiB where the system does not say how much it has."""
    ram = physical_memory()
    return 4 << 30 if ram is None else ram // 4


def default_budget() -> int:
    """The pinned bytes a new pool may hold: :func:`quarter_of_memory`, at most 4 GiB."""
    return max(SMALL_BYTES, min(4 << 30, quarter_of_memory()))


def size_class(nbytes: int) -> int:
    """The block size (bytes) that serves a request of ``nbytes`` (> 0) bytes."""
    if nbytes <= SMALL_BYTES:
        return -(-nbytes // SMALL_STEP) * SMALL_STEP
    k = (nbytes - 1).bit_length() - 1  # 2**k < nbytes <= 2**(k + 1)
    step = 1 << (k - 2)
    return -(-nbytes // step) * step


@dataclasses.dataclass(frozen=True)
class HostPoolStats:
    """A pool's counters at one moment.

    Attributes:
        budget: bytes of pinned memory the pool may hold (in use, pending and cached).
        cached_bytes: bytes in free blocks, ready to be handed out again.
        in_use_bytes: bytes in blocks behind live arrays.
        pending_bytes: bytes in blocks whose arrays were dropped while a recorded device
            operation on them was not yet known to be done.
        allocations: pinned allocations the pool made (``device.allocate_host`` calls).
        hits: requests served from the cache.
        fallbacks: requests answered with pageable memory (over budget, or pinning refused).
        releases: blocks the pool freed to keep within its budget or when asked to.
    """

    budget: int
    cached_bytes: int
    in_use_bytes: int
    pending_bytes: int
    allocations: int
    hits: int
    fallbacks: int
    releases: int

    @property
    def held_bytes(self) -> int:
        """Pinned bytes the pool holds: cached, in use and pending."""
        return self.cached_bytes + self.in_use_bytes + self.pending_bytes

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "held_bytes": self.held_bytes}


_NEW, _FREE, _IN_USE, _PENDING, _CHECKING, _RELEASED = "new", "free", "in use", "pending", "checking", "released"


class _Block:
    """One pinned allocation and what the pool knows of its use."""

    __slots__ = ("buffer", "key", "size", "state", "events", "tokens", "generation")

    def __init__(self, buffer: HostBuffer, size: int):
        self.buffer = buffer
        self.key = id(buffer)  # in the pool's books (read where no call may come between changes)
        self.size = size
        self.state = _NEW  # pinned, not yet in the pool's books
        self.generation = 0  # of hand-outs put back unfinished (_put_back): older owners' returns are stale
        self.events: list = []  # recorded uses not yet known to be done
        self.tokens: list = []  # hand-off tokens whoever takes the block next must observe

    def __repr__(self) -> str:
        return f"<pooled block {self.size} B {self.state} {self.buffer!r}>"


class _Owner:
    """What every view of a handed-out array keeps alive: its bytes (exposed to numpy through
    ``__array_interface__``) and its block. Collected once the last view is gone, on the thread
    that dropped it: its ``__del__`` gives the block back. A ``__del__`` rather than a
    ``weakref.finalize``: one array a request is handed out in a request server's loop, and a
    finalizer would add five objects the cyclic collector tracks (and time) to each."""

    __slots__ = ("__array_interface__", "_memory", "block", "generation", "pool")

    def __del__(self) -> None:
        pool = getattr(self, "pool", None)  # a hand-out that failed before it was tied to a pool
        if pool is not None:
            _on_owner_collected(pool, self.block, self.generation)


class HostPool:
    """Cached pinned blocks of one device, handed out as numpy arrays. Thread-safe.

    Args:
        device: the device whose ``allocate_host`` makes the blocks.
        budget: bytes of pinned memory the pool may hold; None for :func:`default_budget`.
    """

    def __init__(self, device: Device, budget: Optional[int] = None):
        if not isinstance(device, Device):
            raise TypeError(f"HostPool needs a ringflow Device, got {type(device).__name__}")
        self._device = device
        self._budget = default_budget() if budget is None else check_nbytes(budget, "budget")
        self._lock = threading.Lock()
        # pool threads pin and free one at a time: allocation is slow and serialised by the OS
        # anyway, and a backend's own cache of freed pinned memory need not be thread-safe
        self._device_lock = threading.Lock()
        # size -> free blocks; a defaultdict, so that a block is listed with no call (see _settled)
        self._free: collections.defaultdict[int, list[_Block]] = collections.defaultdict(list)
        self._blocks: dict[int, _Block] = {}  # id(buffer) -> block, every block not yet released
        self._pending: dict[_Block, None] = {}  # blocks of dropped arrays, pending or being checked
        # (block, token, generation) from owners' __del__
        self._returned: collections.deque = collections.deque()
        self._bytes = {_FREE: 0, _IN_USE: 0, _PENDING: 0}
        self._reserved = 0  # bytes of allocations under way outside the lock
        self._counts = {"allocations": 0, "hits": 0, "fallbacks": 0, "releases": 0}
        self._noted = False
        with _pools_lock:
            _all_pools.add(self)

    def __repr__(self) -> str:
        return f"<HostPool of {self._device!r}: {self.stats().held_bytes} B held, budget {self._budget} B>"

    @property
    def device(self) -> Device:
        return self._device

    @property
    def budget(self) -> int:
        """Bytes of pinned memory the pool may hold."""
        return self._budget

    # -- handing out ---------------------------------------------------------------------------
    def empty(self, shape: "int | Sequence[int]", dtype: Any = np.float64) -> np.ndarray:
        """A C-contiguous array of uninitialised pinned memory from the pool.

        Its block returns to the pool once the array and every view of it are collected, and
        is handed out again only after every use recorded with :meth:`record_use` is done.

        Args:
            shape: the array's shape (an int or a sequence of ints, each >= 0).
            dtype: any numpy dtype without Python objects.

        Returns:
            A plain ``numpy.ndarray``. Pinned unless the request did not fit the budget or the
            device refused to pin it: then ordinary pageable memory (:meth:`stats` counts it as
            a fallback). An array of 0 bytes is never pinned.

        Raises:
            TypeError: ``shape`` is not an int or a sequence of ints, or ``dtype`` holds objects.
            ValueError: a negative dimension, more than 64 dimensions, or a shape numpy cannot index.
            MemoryError: more bytes than the pool's budget and than the process can allocate.
            HazardError: (simulated GPU) the block's previous use is not ordered before this
                thread: a missing :meth:`record_use`, or a pool bug.
        """
        shape, dtype = check_shape_dtype(shape, dtype)
        refused: list = []
        pinned = self._take_pinned(shape, dtype, True, refused)
        if pinned is not None:
            return pinned
        try:
            pageable = np.empty(shape, dtype)
        except (ValueError, MemoryError) as exc:  # numpy's words name neither the call nor the argument
            raise MemoryError(f"host.empty(shape={shape}, dtype={dtype}) cannot be allocated "
                              f"({math.prod(shape) * dtype.itemsize} bytes, over the pool's budget and then "
                              f"refused by numpy: {exc}); ask for a smaller shape") from None
        # counted and noted only now: a request that raised got no pageable memory, and the one
        # note per pool is kept for the first that does
        if refused:
            self._fallback(*refused)
        return pageable

    def take(self, shape: tuple, dtype: np.dtype, *, allocate: bool = True) -> Optional[np.ndarray]:
        """As :meth:`empty` for a checked ``shape`` (a tuple of ints >= 0) and ``dtype`` (a numpy
        dtype), but None where :meth:`empty` would fall back to pageable memory (a pipeline then
        uses its own staging ring); 0 bytes are never pinned (None). ``allocate=False`` takes only
        a cached block: no pinning or freeing (which may wait for the whole device) on the
        caller's thread."""
        refused: list = []
        pinned = self._take_pinned(shape, dtype, allocate, refused)
        if refused:
            self._fallback(*refused)
        return pinned

    def _take_pinned(self, shape: tuple, dtype: np.dtype, allocate: bool, refused: list) -> Optional[np.ndarray]:
        """:meth:`take`, where a request the budget or the device refuses puts ``(size, why)``
        into ``refused`` for the caller to count (:meth:`_fallback`) instead of counting it."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return None
        self._process(release=allocate)
        size = size_class(nbytes)
        # the block this hand-out holds, from the moment it leaves the cache (or is pinned) until
        # the caller has the array: a KeyboardInterrupt at any instruction in between puts it
        # back, once (see _put_back), instead of leaking it
        claim: list[_Block] = []
        try:
            self._take(size, claim)
            if not claim and allocate:
                self._allocate(size, claim, refused)
            if not claim:
                return None
            return self._hand_out(claim[0], nbytes, shape, dtype)
        except BaseException:
            while claim:
                try:
                    self._put_back(claim[0])
                    break
                except KeyboardInterrupt:  # Ctrl-C again: put it back all the same (it is idempotent)
                    continue
            raise

    def _put_back(self, block: _Block) -> None:
        """A hand-out that failed or was interrupted: its block is free again as it was. A new
        generation makes the return of the hand-out's owner, if it got one, a stale one that
        :meth:`_process` ignores: the block is never freed twice. Idempotent (booking is, and
        the block's own changes are made with no call between the first and the last, where a
        KeyboardInterrupt could stop them half done): called again after an interrupt, it
        finishes the job or finds it done."""
        with self._lock:
            state = block.state
            if state == _NEW or state == _IN_USE:
                self._book(block)  # (a block pinned, but interrupted before it was booked)
                block.generation += 1
                if state == _IN_USE:
                    self._bytes[_IN_USE] -= block.size
                self._bytes[_FREE] += block.size
                block.state = _FREE
                self._free[block.size] += [block]

    def _book(self, block: _Block) -> None:
        """Enter a newly pinned block in the pool's books (once). Under the lock."""
        key = block.key
        if key not in self._blocks:
            self._blocks[key] = block
            self._counts["allocations"] += 1

    def _take(self, size: int, claim: list) -> None:
        """A free block of ``size`` into ``claim``, if the cache has one."""
        with self._lock:
            bucket = self._free.get(size)
            if bucket:
                # the most recently used block (its pages are the warmest), moved into the claim
                # and counted in use with no call in between, where a KeyboardInterrupt could
                # leave it out of the cache yet counted there
                claim[:], bucket[-1:] = bucket[-1:], []
                block = claim[0]
                self._bytes[_FREE] -= block.size
                self._bytes[_IN_USE] += block.size
                block.state = _IN_USE
                self._counts["hits"] += 1

    def _make_room(self, size: int, dropped: list[_Block]) -> None:
        """Move cached blocks (largest first) into ``dropped`` until ``size`` more bytes fit the
        budget or none is left. ``dropped`` is the caller's, which frees them
        (:meth:`_release_blocks`) and puts back those a KeyboardInterrupt left open
        (:meth:`_restore`). Under the lock."""
        if self._held() + size <= self._budget:
            return
        for cls in sorted(self._free, reverse=True):
            bucket = self._free[cls]
            while bucket and self._held() + size > self._budget:
                self._uncache_last(bucket, dropped)

    def _uncache_last(self, bucket: list[_Block], dropped: list[_Block]) -> None:
        """The last block of ``bucket`` (a list of the cache) into ``dropped``, no longer counted.
        No call in between, where a KeyboardInterrupt could leave a block counted but listed
        nowhere, or uncounted and never freed. Under the lock."""
        block = bucket[-1]
        self._bytes[_FREE] -= block.size
        block.state = _RELEASED
        dropped += [block]
        del bucket[-1]

    def _allocate(self, size: int, claim: list, refused: list) -> None:
        """A new block of ``size`` bytes into ``claim``, cached blocks freed to make room for it
        where that makes it fit; nothing where it does not fit the budget even with the cache
        freed (the cache then stays as it is), or the device refuses to pin it: ``(size, why)``
        into ``refused`` then."""
        reserved = False
        to_release: list[_Block] = []
        try:
            with self._lock:
                # a block that would not fit even with the whole cache freed falls back all the
                # same: freeing the cache for it would only cost the requests its classes serve
                if self._held() - self._bytes[_FREE] + size <= self._budget:
                    self._make_room(size, to_release)
                if self._held() + size <= self._budget:
                    self._reserved += size
                    reserved = True
            if to_release:
                self._release_blocks(to_release)
            if not reserved:
                refused[:] = [size, f"the pool's budget of {self._budget} bytes is taken"]
                return
            try:
                with self._device_lock:
                    buffer = self._device.allocate_host(size)
            except (MemoryError, DeviceError) as exc:
                if isinstance(exc, DeviceError) and exc.sticky:
                    raise
                # pinned memory may be short because the cache holds it: free the cache and retry
                self.release_cached()
                try:
                    with self._device_lock:
                        buffer = self._device.allocate_host(size)
                except (MemoryError, DeviceError) as exc2:
                    if isinstance(exc2, DeviceError) and exc2.sticky:
                        raise
                    refused[:] = [size, f"the device refused to pin {size} bytes ({type(exc2).__name__}: {exc2})"]
                    return
            block = _Block(buffer, size)
            claim[:] = [block]  # no call in between: the claim holds it from here on
            with self._lock:
                self._book(block)
                self._move(block, _IN_USE)
        finally:
            while to_release:  # interrupted before they were all freed
                try:
                    self._restore(to_release)
                except KeyboardInterrupt:  # Ctrl-C again: it goes on with the blocks left
                    pass
            if reserved:
                with self._lock:
                    self._reserved -= size

    def _fallback(self, size: int, why: str) -> None:
        """Count a request answered without pinned memory (``why``: the budget or the device
        refused a ``size``-byte block); the pool's first is noted on the logger."""
        with self._lock:
            self._counts["fallbacks"] += 1
            note, self._noted = not self._noted, True
        if note:
            logger.warning("ringflow.host: %s; a request for a %d-byte block gets ordinary pageable memory "
                           "instead (noted once per device; raise the budget with "
                           "ringflow.host.set_budget(nbytes))", why, size)

    def _hand_out(self, block: _Block, nbytes: int, shape: tuple, dtype: np.dtype) -> np.ndarray:
        """The array over ``block``'s first ``nbytes``: ordered after its previous use, checked
        as a host access (simulated GPU), and tied to a new owner whose collection returns it."""
        self._observe(block)
        memory = block.buffer.view(np.uint8, count=nbytes, access="rw")
        # the hand-out's access comes before anything done with the array, on whichever thread
        # the caller passes it to: that thread (receive) and the block's next taker observe it
        token = self._device.publish()
        with self._lock:
            block.tokens = self._device.fold_tokens([token])
        owner = _Owner()
        owner._memory = memory
        owner.block = block
        owner.generation = block.generation
        owner.pool = self  # from here on, dropping the owner gives the block back
        owner.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "version": 3,
                                     "data": (memory.__array_interface__["data"][0], False)}
        return np.asarray(owner).view(dtype).reshape(shape)

    # -- giving back ---------------------------------------------------------------------------
    def _give_back(self, block: _Block, token: Any, generation: int) -> None:
        """Called by an owner's ``__del__``, on whatever thread dropped the last view: only
        queues the block (deque appends need no lock, so a collection inside a pool call on
        this thread cannot deadlock)."""
        self._returned.append((block, token, generation))

    def record_use(self, obj: "np.ndarray | HostBuffer", event: Any) -> bool:
        """Tell the pool that a device operation using ``obj``'s memory completes at ``event``:
        once ``obj`` is dropped, its block is not handed out again before ``event`` is done.

        Call it for every copy into or out of a pooled array that may still be pending when
        the array could be dropped (an event recorded on the copy's stream after the copy).

        Args:
            obj: an array (or a view of one) from this pool, or a pooled block's buffer.
            event: an :class:`~ringflow._device.protocol.Event` or host task (anything with
                ``is_done``) of this pool's device.

        Returns:
            True if recorded; False if ``obj`` is not memory from this pool (a pageable fallback
            or any other array), which needs nothing held.

        Raises:
            TypeError: ``obj`` is neither a numpy array nor a host buffer, or ``event`` has no
                ``is_done``.
            ValueError: ``obj`` is a pooled buffer already back in the cache (no live array), or
                ``event`` was recorded on another device than this pool's.
        """
        if not hasattr(event, "is_done"):
            raise TypeError(f"record_use needs an event (or host task) with is_done, got {type(event).__name__}")
        block = self._block_of(obj)
        if block is None:
            return False
        recorded_on = event.owner if isinstance(event, Event) else None
        if recorded_on is not None and recorded_on is not self._device:
            # its being done says nothing of this device's copy, which may still run when the
            # block is handed out again
            here, there = device_names(self._device, recorded_on)
            raise ValueError(f"record_use(event=...): {event!r} was recorded on {there}, but the array's memory is "
                             f"in the host pool of {here}; record the event on a stream of {here}, the device whose "
                             "stream copies the array, after the copy")
        with self._lock:
            if block.state not in (_IN_USE, _PENDING, _CHECKING):
                raise ValueError(f"record_use: {block.buffer!r} is {block.state}, not behind a live array; record "
                                 "uses while an array from the pool holds it")
            block.events.append(event)
            events = list(block.events) if len(block.events) > _PRUNE_AT else None
        if events is not None:
            done = [e for e in events if _is_done(e)]
            if done:
                token = self._device.publish()  # this thread saw them done: whoever takes the block next must too
                with self._lock:
                    block.events = [e for e in block.events if not any(e is d for d in done)]
                    self._add_token(block, token)
        return True

    def collect(self, *, wait: bool = False) -> int:
        """Return dropped arrays' blocks to the cache: those whose recorded uses are all done
        (with ``wait``, after waiting for the rest).

        Returns:
            Bytes that became free for reuse by this call.

        Raises:
            HazardError: (simulated GPU, checked) poisoning a returned block was not ordered after
                its last use.
        """
        return self._process(wait=wait)

    def _process(self, *, wait: bool = False, release: bool = True) -> int:
        """Queue dropped arrays' blocks as pending and free those whose uses are done (waiting
        with ``wait``); returns the bytes freed for reuse. While the pool is over its budget a
        block whose uses are done is released to the device instead (:meth:`_settled`); with
        ``release=False`` (a caller that must not wait for a device free) such a block stays
        pending for a later call. A KeyboardInterrupt at any instruction (Ctrl-C while
        ``collect(wait=True)`` waits, say) leaves every block it reached pending or free,
        never stranded: a return is taken off its queue only once it is booked (booking one
        twice changes nothing), every block this call claimed is pending again unless freed
        or released, and a released block it did not get to close goes back to the cache
        (:meth:`_restore`)."""
        if getattr(self._device, "closed", False):
            self._forget_closed()
            return 0
        # the blocks this call has marked checking and not freed: only these are its to mark
        # pending again (one it freed may be handed out, dropped and claimed by another thread
        # by then, checking again, but that thread's)
        claimed: dict[_Block, None] = {}
        released: list[_Block] = []  # taken back over the budget: closed here, not cached
        freed = 0
        try:
            with self._lock:
                while self._returned:
                    block, token, generation = self._returned[0]
                    # put back already (_put_back), or booked by an interrupted earlier pass: skip
                    if block.state == _IN_USE and block.generation == generation:
                        self._add_token(block, token)
                        self._pending[block] = None
                        self._move(block, _PENDING)
                    self._returned.popleft()
                for block in self._pending:
                    if block.state == _PENDING:
                        claimed[block] = None  # before it is marked: the finally sees every mark
                        block.state = _CHECKING  # bytes stay counted as pending; another thread skips it
            for block in list(claimed):
                if self._settled(block, wait, claimed, released if release else None):
                    freed += block.size
            self._release_blocks(released)
        finally:
            if claimed:
                with self._lock:
                    for block in claimed:
                        if block.state == _CHECKING:  # not freed: pending again, for the next pass
                            block.state = _PENDING
            while released:  # interrupted before they were all closed
                try:
                    self._restore(released)
                except KeyboardInterrupt:  # Ctrl-C again: it goes on with the blocks left
                    pass
        return freed

    def _forget_closed(self) -> None:
        """The device is closed and took every block's memory with it: nothing can be checked,
        reused or freed, so dropped arrays' blocks, cached ones and pending ones leave the books
        (with no device call). Blocks behind live arrays stay counted in use until dropped.
        Idempotent: a KeyboardInterrupt part way leaves the rest for the next call."""
        with self._lock:
            while self._returned:
                block, _, generation = self._returned[0]
                if block.state == _IN_USE and block.generation == generation:
                    self._forget(block)
                self._returned.popleft()
            for bucket in self._free.values():
                while bucket:
                    self._forget(bucket[-1])
                    del bucket[-1]
            for block in [b for b in self._pending if b.state == _PENDING]:  # checking: another call's
                self._forget(block)
                del self._pending[block]

    def _forget(self, block: _Block) -> None:
        """Take a block of a closed device out of the books. Under the lock."""
        self._move(block, _RELEASED)
        self._blocks.pop(block.key, None)

    def _settled(self, block: _Block, wait: bool, claimed: dict, released: Optional[list]) -> bool:
        """Move a claimed (checking) pending block to the cache, and out of ``claimed``, if its
        recorded uses are all done (waiting for them with ``wait``); left checking and claimed
        otherwise, for :meth:`_process` to mark pending again. Outside the lock: event queries
        are device calls.

        A block whose uses are done while the pool holds more than its budget (a budget lowered
        below the memory in use) is not cached: it goes, uncounted, into ``released`` for the
        caller to close (:meth:`_release_blocks`, ordered after those uses as every free is),
        and True is not returned, since nothing became free for reuse. Where ``released`` is
        None the caller may not free, and such a block stays claimed, pending until a call that
        may."""
        with self._lock:
            events = list(block.events)
        if _HOLD_UNTIL_DONE:
            for ev in events:
                if wait:
                    _wait(ev)
                elif not _is_done(ev):
                    return False
        with self._lock:
            if self._over_budget(block, claimed, released):
                return False
        self._observe(block)
        if getattr(self._device, "poison", False):
            # a checked simulated GPU: stale bytes read through a later array show up as 0xEE,
            # and this write is itself checked against the block's last device use
            block.buffer.view(np.uint8, access="w").fill(POISON)
        token = self._device.publish()
        with self._lock:
            # asked again: the budget may have been lowered by another thread since
            if self._over_budget(block, claimed, released):
                return False
            block.events.clear()
            block.tokens = self._device.fold_tokens([token])
            # from pending to the cache with no call in between, where a KeyboardInterrupt could
            # leave the block counted in one place and listed in another (or in neither)
            self._bytes[_PENDING] -= block.size
            self._bytes[_FREE] += block.size
            block.state = _FREE
            self._free[block.size] += [block]
            del self._pending[block]
            del claimed[block]
        return True

    def _over_budget(self, block: _Block, claimed: dict, released: Optional[list]) -> bool:
        """Whether the pool holds more than its budget (``block``, a claimed pending one whose
        uses are done, counted): then it must not be cached, and goes out of pending, uncounted,
        into ``released`` (left claimed where ``released`` is None). Under the lock."""
        if self._held() <= self._budget:
            return False
        if released is not None:
            # out of pending and into the caller's list with no call in between, where a
            # KeyboardInterrupt could leave it counted but listed nowhere, or listed twice
            self._bytes[_PENDING] -= block.size
            block.state = _RELEASED
            released += [block]
            del self._pending[block]
            del claimed[block]
        return True

    def _add_token(self, block: _Block, token: Any) -> None:
        """Keep ``token`` with the block's others, folded (:meth:`Device.fold_tokens`): a block
        used again and again keeps a few. Under the lock."""
        block.tokens = self._device.fold_tokens([*block.tokens, token])

    def _observe(self, block: _Block) -> None:
        """Order this thread after the block's previous holders (their hand-off tokens)."""
        with self._lock:
            tokens = list(block.tokens)
        for token in tokens:
            self._device.observe(token)

    # -- budget and release --------------------------------------------------------------------
    def set_budget(self, nbytes: int) -> None:
        """Let the pool hold at most ``nbytes`` of pinned memory; cached blocks beyond it are
        freed now. Blocks in use stay; later requests fall back until they fit.

        Raises:
            TypeError, ValueError: ``nbytes`` is not a positive int.
        """
        nbytes = check_nbytes(nbytes, "ringflow.host.set_budget(nbytes)")
        self._process()
        dropped: list[_Block] = []
        try:
            with self._lock:
                self._budget = nbytes
                if getattr(self._device, "closed", False):
                    return  # its blocks went with the device
                self._make_room(0, dropped)
            self._release_blocks(dropped)
        finally:
            while dropped:  # interrupted before they were all freed
                try:
                    self._restore(dropped)
                except KeyboardInterrupt:  # Ctrl-C again: it goes on with the blocks left
                    pass

    def release_cached(self) -> int:
        """Free every cached block back to the device (blocks in use and pending stay).

        Returns:
            Bytes freed.
        """
        self._process()
        dropped: list[_Block] = []
        try:
            with self._lock:
                for bucket in self._free.values():
                    while bucket:
                        self._uncache_last(bucket, dropped)
            freed = sum(b.size for b in dropped)
            self._release_blocks(dropped)
        finally:
            while dropped:  # interrupted before they were all freed
                try:
                    self._restore(dropped)
                except KeyboardInterrupt:  # Ctrl-C again: it goes on with the blocks left
                    pass
        return freed

    def _release_blocks(self, blocks: list[_Block]) -> None:
        """Close released blocks' buffers, ordered after their last use (outside the lock),
        taking each off ``blocks`` once it is closed (or its close failed): those a
        KeyboardInterrupt leaves there are still open, for :meth:`_restore`."""
        while blocks:
            block = blocks[-1]
            self._observe(block)
            try:
                with self._device_lock:
                    block.buffer.close()
            except Exception as exc:  # noqa: BLE001 - a failed free must not fail an allocation
                logger.warning("ringflow.host: freeing %r failed: %s: %s", block.buffer, type(exc).__name__, exc)
            key = block.key
            with self._lock:  # no call before the last step, where an interrupt would book it twice
                self._counts["releases"] += 1
                del blocks[-1]
                self._blocks.pop(key, None)

    def _restore(self, blocks: list[_Block]) -> None:
        """Released blocks an interrupted :meth:`_release_blocks` did not get to: the closed
        ones leave the books, the open ones go back to the cache (counted again: a later request
        or budget change frees them), so the bytes counted stay the bytes held. Each block's
        changes are made with no call in between and end with taking it off ``blocks``: called
        again after a KeyboardInterrupt, it goes on with the blocks left."""
        with self._lock:
            while blocks:
                block = blocks[-1]
                if block.buffer.closed:
                    self._counts["releases"] += 1
                    if block.key in self._blocks:
                        del self._blocks[block.key]
                else:
                    self._bytes[_FREE] += block.size
                    block.state = _FREE
                    self._free[block.size] += [block]
                del blocks[-1]

    # -- queries -------------------------------------------------------------------------------
    def stats(self) -> HostPoolStats:
        """The pool's counters (dropped arrays' blocks are taken back first)."""
        self._process()
        with self._lock:
            return HostPoolStats(budget=self._budget, cached_bytes=self._bytes[_FREE],
                                 in_use_bytes=self._bytes[_IN_USE], pending_bytes=self._bytes[_PENDING],
                                 **self._counts)

    def buffer_of(self, obj: Any) -> Optional[HostBuffer]:
        """The pinned buffer behind a pooled array of this pool (or a view of one), or None."""
        block = self._block_of(obj) if isinstance(obj, np.ndarray) else None
        return block.buffer if block is not None else None

    def _block_of(self, obj: Any) -> Optional[_Block]:
        if isinstance(obj, HostBuffer):
            with self._lock:
                return self._blocks.get(id(obj))
        if not isinstance(obj, np.ndarray):
            raise TypeError(f"expected a numpy array from ringflow.host or a pooled host buffer, "
                            f"got {type(obj).__name__}")
        owner = owner_of(obj)
        return owner.block if owner is not None and owner.pool is self else None

    # -- internals -----------------------------------------------------------------------------
    def _held(self) -> int:
        return self._bytes[_FREE] + self._bytes[_IN_USE] + self._bytes[_PENDING] + self._reserved

    def _move(self, block: _Block, state: str) -> None:
        """Change a block's state, keeping the byte counts. Under the lock."""
        old = _PENDING if block.state == _CHECKING else block.state
        if old in self._bytes:
            self._bytes[old] -= block.size
        if state in self._bytes:
            self._bytes[state] += block.size
        block.state = state


def _on_owner_collected(pool: HostPool, block: _Block, generation: int) -> None:
    """An owner's ``__del__``: publish what this thread did, then queue the block. Never raises
    (at interpreter exit the device, or this module, may already be gone: nothing to give back
    then)."""
    try:
        try:
            token = pool._device.publish()
        except Exception:  # noqa: BLE001 - a finalizer must not raise
            token = None
        pool._give_back(block, token, generation)
    except Exception:  # noqa: BLE001 - see above
        pass


def _is_done(event: Any) -> bool:
    """Whether a recorded use is done. A query that fails (a closed device, which completed its
    work when it closed; a broken one, where nothing will run again) counts as done."""
    try:
        return bool(event.is_done)
    except Exception:  # noqa: BLE001 - see above
        return True


def _wait(event: Any) -> None:
    try:
        event.sync()
    except Exception:  # noqa: BLE001 - a failed operation before the event: the event is done anyway
        pass


def check_shape_dtype(shape: Any, dtype: Any) -> tuple[tuple[int, ...], np.dtype]:
    """``shape`` as a tuple of ints and ``dtype`` as a numpy dtype (a subarray dtype's shape
    appended, and a string dtype without a length one character long, as ``np.empty`` does);
    refuses what cannot be pinned.

    Raises:
        TypeError: a shape that is not an int or a sequence of ints, a dtype numpy does not
            know, or one holding Python objects.
        ValueError: a negative dimension, more than :data:`MAX_DIMS` dimensions, or an empty
            shape whose other dimensions numpy cannot index.
    """
    bad = f"shape must be an int or a sequence of ints, got {shape!r}"
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, (bool, np.bool_)):
        shape = (shape,)
    elif isinstance(shape, np.ndarray) and shape.ndim == 0 and shape.dtype.kind in "iu":
        # an int to numpy.empty (it has __index__), though a sequence by its type: iterating fails
        shape = (operator.index(shape),)
    if isinstance(shape, (str, bytes, bool, np.bool_)):
        raise TypeError(bad)
    # a sequence, as numpy.empty takes: a set iterates in its hashes' order, not the one written,
    # and a dict over its keys
    if isinstance(shape, collections.abc.Mapping) or not hasattr(type(shape), "__getitem__"):
        raise TypeError(bad)
    try:
        items = tuple(shape)
    except TypeError:
        raise TypeError(bad) from None
    dims = []
    for d in items:
        if isinstance(d, (bool, np.bool_)):
            raise TypeError(bad)
        try:
            dims.append(operator.index(d))
        except TypeError:
            raise TypeError(bad) from None
    if any(d < 0 for d in dims):
        raise ValueError(f"shape {tuple(dims)} has a negative dimension; every dimension must be >= 0")
    dt = as_dtype(dtype)
    if dt.hasobject:
        raise TypeError(f"dtype {dt} holds Python objects, which cannot live in pinned memory; use a numeric dtype")
    if dt.itemsize == 0 and dt.kind in "SU":
        # np.empty makes a string dtype without a length ("S", "U") one character long: taken as
        # 0 bytes, the request would get a pageable array that the pool never counted
        dt = np.empty(0, dt).dtype
    if dt.subdtype is not None:  # np.empty((n,), (np.float32, 3)) is an (n, 3) float32 array
        dt, sub = dt.subdtype
        dims.extend(sub)
    if len(dims) > MAX_DIMS:
        raise ValueError(f"shape {tuple(dims)} has {len(dims)} dimensions; numpy arrays have at most {MAX_DIMS}")
    # numpy refuses an empty array too where its other dimensions come to more bytes than it can
    # index; such an array has no bytes to pin or move, so only the numpy call that made it would
    # fail, far from the request. A non-empty one that large is refused as too large by the caller.
    if 0 in dims and math.prod(d for d in dims if d) * max(dt.itemsize, 1) > _MAX_INDEX:
        raise ValueError(f"shape {tuple(dims)} has more elements than numpy can index: its dimensions other than "
                         f"0 come to more than {_MAX_INDEX} bytes of {dt}, though the array is empty; use "
                         "smaller dimensions")
    return tuple(dims), dt


MAX_DIMS = 64  # numpy's limit on an array's dimensions
_MAX_INDEX = int(np.iinfo(np.intp).max)


# -- which pool, which array -------------------------------------------------------------------
_pools_lock = threading.RLock()  # pool_for holds it while a new pool registers itself
_all_pools: "weakref.WeakSet[HostPool]" = weakref.WeakSet()
_ATTR = "_ringflow_host_pool"  # the pool lives on its device: it is collected with it


def _forget_pools_in_child() -> None:
    """After fork(), in the child: the pools alive are the parent's devices' (whose calls the
    child's are refused), so a budget set for every pool is set for the child's own only; the
    registry's lock may have been held by a parent's thread that is not in the child."""
    global _all_pools, _pools_lock, _budget_lock
    _all_pools = weakref.WeakSet()
    _pools_lock = threading.RLock()
    _budget_lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork()
    os.register_at_fork(after_in_child=_forget_pools_in_child)


def pool_for(device: Device, *, create: bool = True) -> Optional[HostPool]:
    """The host pool of ``device`` (made on first use when ``create``; else None if none yet)."""
    if not isinstance(device, Device):
        raise TypeError(f"expected a ringflow Device (ringflow.device(...)), got {type(device).__name__}")
    pool = device.__dict__.get(_ATTR)
    if pool is None and create:
        with _pools_lock:
            pool = device.__dict__.get(_ATTR)
            if pool is None:
                pool = HostPool(device, _default_budget)
                setattr(device, _ATTR, pool)
    return pool


def without_pooled(device: Device, counts: "LiveCounts") -> "LiveCounts":
    """``counts`` (a device's live objects) with the blocks of ``device``'s host pools moved from
    ``host_buffers`` to ``pooled_host_buffers``."""
    n = 0
    for pool in pools():
        if pool._device is device:
            with pool._lock:
                n += len(pool._blocks)
    if not n:
        return counts
    return dataclasses.replace(counts, host_buffers=counts.host_buffers - n, pooled_host_buffers=n)


def pools() -> list[HostPool]:
    """Every host pool alive now."""
    with _pools_lock:
        return list(_all_pools)


_default_budget: Optional[int] = None  # None: default_budget(); set_default_budget changes it
# one set_default_budget at a time, from setting the default to the last pool's budget: two at
# once could each set the default and then the pools in either order, leaving the pools a budget
# other than the default that pools made later get
_budget_lock = threading.Lock()


def set_default_budget(nbytes: int) -> None:
    """The budget of pools made from now on, and of every pool alive now. Calls from several
    threads take effect one at a time, the pools left at the default of the last.

    Raises:
        TypeError, ValueError: ``nbytes`` is not a positive int.
    """
    global _default_budget
    nbytes = check_nbytes(nbytes, "ringflow.host.set_budget(nbytes)")  # called by ringflow.host.set_budget
    with _budget_lock:
        with _pools_lock:
            _default_budget = nbytes
            alive = list(_all_pools)
        for pool in alive:
            pool.set_budget(nbytes)


def owner_of(array: np.ndarray) -> Optional[_Owner]:
    """The pool owner behind ``array`` (an array from a pool or any view of one), or None."""
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    return base if isinstance(base, _Owner) else None


def hand_off(array: Any, token: Any) -> None:
    """Order whoever takes ``array``'s block next after ``token`` (a :meth:`Device.publish` of the
    thread that saw the block's last device use complete), whichever thread drops the array last
    (the GIL orders the drops; the simulated GPU's checker sees only tokens). Nothing for an
    array from no pool."""
    if token is None:  # a real GPU's: nothing to order (Device.fold_tokens drops it)
        return
    owner = owner_of(array) if isinstance(array, np.ndarray) else None
    if owner is not None:
        with owner.pool._lock:
            owner.pool._add_token(owner.block, token)


def buffer_behind(array: Any, device: Optional[Device] = None) -> Optional[HostBuffer]:
    """The pinned buffer whose bytes ``array`` is, from the buffer's first byte (what a copy
    engine can use in place: ``buffer.holds(array)``), if ``array`` came from a host pool (of
    ``device``, when given); else None. No device work is checked or ordered by this query."""
    where = slice_behind(array, device)
    return where.buffer if where is not None and where.offset == 0 else None


def slice_behind(array: Any, device: Optional[Device] = None) -> Optional[BufferSlice]:
    """The pinned bytes ``array`` is, at whatever offset in its block (a C-contiguous array or
    view from a host pool, of ``device`` when given), which a copy engine can use in place; else
    None. No device work is checked or ordered by this query."""
    owner = owner_of(array) if isinstance(array, np.ndarray) else None
    if owner is None or (device is not None and owner.pool.device is not device):
        return None
    return _bytes_of(owner, array)


def _bytes_of(owner: _Owner, array: np.ndarray) -> Optional[BufferSlice]:
    buffer = owner.block.buffer
    offset = buffer.offset_of(array)
    return None if offset is None else BufferSlice(buffer, offset, array.nbytes)


def receive(array: Any, device: Device) -> Optional[HostBuffer]:
    """:func:`buffer_behind` for an array a caller hands to ``device``'s work, ordering the
    calling thread after the pool's hand-out of it and after every device use of it seen
    complete since (the tokens the hand-out and :func:`hand_off` left on its block, a pipeline's
    d2h into a result among them), for any array over ``device``'s pool memory (a view from
    another byte too, which then has no buffer to return). The caller may have got the array on
    another thread and passed it on by a lock, queue or join of its own, which the simulated
    GPU's checker cannot see; without these edges the device's next copy of it, or a checked
    host copy of it, would look unordered."""
    where = receive_slice(array, device)
    return where.buffer if where is not None and where.offset == 0 else None


def receive_slice(array: Any, device: Device) -> Optional[BufferSlice]:
    """:func:`receive`, for the array's bytes at whatever offset in its block
    (:func:`slice_behind`)."""
    owner = _taken_in(array, device)
    return _bytes_of(owner, array) if owner is not None else None


def block_buffer_taken_in(array: Any) -> Optional[HostBuffer]:
    """The pinned buffer of the block behind ``array`` (an array from a pool or any view of one,
    at whatever offset in it), for device work of the caller's own, ordering the calling thread
    after the block's hand-out and every device use of it seen complete since, as
    :func:`receive` does; None for any other array."""
    owner = _taken_in(array)
    return owner.block.buffer if owner is not None else None


def _taken_in(array: Any, device: Optional[Device] = None) -> Any:
    """The pool's record of the array ``array``'s memory is from (of ``device``'s pool, where
    given), the calling thread ordered after its block's hand-out and every device use of it seen
    complete since; None for any other array."""
    owner = owner_of(array) if isinstance(array, np.ndarray) else None
    if owner is None or (device is not None and owner.pool.device is not device):
        return None
    owner.pool._observe(owner.block)
    return owner


def device_of(array: Any) -> Optional[Device]:
    """The device whose pool ``array``'s memory came from, or None."""
    owner = owner_of(array) if isinstance(array, np.ndarray) else None
    return owner.pool.device if owner is not None else None
