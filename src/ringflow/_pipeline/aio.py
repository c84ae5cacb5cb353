"""What the asyncio face runs on the event loop's thread: awaiting a chunk's future and cancelling
chunks, neither of which may wait for the pipeline's lock.

The progress thread holds that lock through a whole step, and a step may run a compute's launch
code for as long as that takes. ``asyncio.wrap_future`` cancels the wrapped future on the loop's
thread when the awaiting task is cancelled, and :meth:`ChunkFuture.cancel` waits for the lock
and for the progress thread to carry the cancel out: the loop would stall for a step. Here a
cancel is posted to the progress thread instead (:func:`.chunk.post_cancel`), and where the
caller must know it was carried out (a map that ends has nothing of its own left running) the
coroutine awaits that, while the loop runs on.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import weakref
from typing import Any, AsyncIterator, Callable

from .chunk import NO_ROOM, ChunkFuture, cancel_unwanted, post_cancel
from .delivered import DeviceResult
from .frames import forget_own_frames
from .validate import check_iterable

logger = logging.getLogger(__name__)


def follow(fut: ChunkFuture, on_settled: "Callable[[], None] | None" = None) -> asyncio.Future:
    """An asyncio future of the running loop that ends as ``fut`` does (``asyncio.wrap_future``'s
    role). Cancelling it hands the chunk's cancel to the progress thread and returns at once.

    ``on_settled`` is called on the loop's thread in the same callback that settles the asyncio
    future, so that the futures of several chunks are seen settled in the order the chunks
    ended (a done-callback of the asyncio future would run only in a later turn of the loop: a
    task woken meanwhile could see the future done and not yet recorded)."""
    loop = asyncio.get_running_loop()
    head = loop.create_future()

    def settle(f: ChunkFuture) -> None:  # on the progress thread, or here if done already
        try:
            loop.call_soon_threadsafe(_copy_outcome, f, head, on_settled)
        except RuntimeError:
            pass  # the loop has closed: nobody awaits this any more

    def on_head_done(h: asyncio.Future) -> None:
        if h.cancelled() and not fut.done():
            try:
                post_cancel([fut])
            except Exception as exc:  # noqa: BLE001 - as cancel_unwanted: never raised into the loop
                logger.debug("a cancelled await did not cancel its chunk: %r", exc)

    head.add_done_callback(on_head_done)
    fut.add_done_callback(settle)
    return head


def _copy_outcome(fut: ChunkFuture, head: asyncio.Future, on_settled: "Callable[[], None] | None" = None) -> None:
    if head.cancelled():
        return
    if fut.cancelled():
        head.cancel()
    else:
        fut._driver.device.observe(fut.token)  # the result is taken on this thread
        error = fut.settled_error()
        if error is not None:
            head.set_exception(error)
        else:
            head.set_result(fut.settled_value())
    if on_settled is not None:
        on_settled()


async def cancel_unwanted_soon(futures: "list[ChunkFuture]") -> None:
    """:func:`.chunk.cancel_unwanted` for a coroutine: returns once the chunks are cancelled,
    without blocking the loop meanwhile; never raises but for a cancellation of the awaiting
    task (the cancels, handed over already, are still carried out). With no loop running (an
    async generator finalised outside one) it cancels as :func:`cancel_unwanted` does."""
    live = [f for f in futures if not f.done()]
    if not live:
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        cancel_unwanted(live)
        return
    done = loop.create_future()
    left = [0]

    def one_done(device: Any, command: Any) -> None:  # on a progress thread, once its part ran
        loop.call_soon_threadsafe(_count_down, left, done, device, command)

    try:
        left[0] = post_cancel(live, one_done)
    except Exception as exc:  # noqa: BLE001 - clean-up: as cancel_unwanted
        logger.debug("a map's unwanted chunks were not cancelled: %r", exc)
        return
    if left[0] and not _shutting_down(loop):
        await done


def _shutting_down(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop`` is finalising its async generators before it closes (``asyncio.run``
    ending). A map's clean-up run then, by the task the loop's finaliser made for a map dropped
    as the run ended (an error or Ctrl-C in its ``async for``), may not get another turn before
    the loop closes: it must not await the cancels it handed over (they are carried out all the
    same), or asyncio destroys it pending. The flag is CPython's (and uvloop's); a loop without
    it is taken as running on."""
    return bool(getattr(loop, "_asyncgens_shutdown_called", False))


def _count_down(left: list, done: asyncio.Future, device: Any, command: Any) -> None:
    """One pipeline's part of a posted cancel ran (on the loop's thread)."""
    device.observe(command.out_token)  # what the cancel did happens before the map ends
    left[0] -= 1
    if left[0] == 0 and not done.done():
        done.set_result(None)


class Source:
    """An amap's input, a sync or async iterable. An async one's next item is pulled in a task of
    its own, so that the map hands out a result that is ready while the pull waits: a source
    whose next item comes only once the last result was handed out (a client waiting for each
    reply before its next request) would otherwise wait for the map as the map waits for it.

    Args:
        items: what ``amap`` was given.

    Raises:
        TypeError: ``items`` is neither (:func:`.validate.check_iterable` says so).
    """

    __slots__ = ("iterator", "is_async", "pull")

    def __init__(self, items: Any):
        self.is_async = hasattr(items, "__aiter__")
        self.iterator = items.__aiter__() if self.is_async else check_iterable("items", items)
        self.pull: "asyncio.Task | None" = None  # an async source's pull in progress

    async def next(self, heads: "list[asyncio.Future]") -> tuple:
        """The next item: ``(True, item)``; ``(False, None)`` once the source is exhausted, or
        where one of ``heads`` (whose end hands the map's next result out: see :func:`handing_out`)
        ended first (the pull goes on, and the next call takes it up). Raises what the source
        raised."""
        if not self.is_async:
            try:
                return True, next(self.iterator)
            except StopIteration:
                return False, None
        if self.pull is None:
            self.pull = asyncio.ensure_future(_pull(self.iterator))
            # left pending only with the map (its loop stopped or closed with the map unfinished),
            # which asyncio drops without a word: so is the pull, a part of it
            self.pull._log_destroy_pending = False
        if heads and not self.pull.done():
            await asyncio.wait((self.pull, *heads), return_when=asyncio.FIRST_COMPLETED)
            if not self.pull.done():
                return False, None
        got = await self.pull  # (a cancellation of the awaiting task cancels the pull too)
        self.pull = None
        return _unwrapped(got)

    def pulling(self) -> bool:
        """Whether a pull is in progress (a ``(False, None)`` of :meth:`next` then means the head ended)."""
        return self.pull is not None

    async def stop(self) -> None:
        """The map ends: cancel a pull in progress and wait for it to end (the source's own
        clean-up runs before the map's ends), but not while the loop finalises its async
        generators (see :func:`_shutting_down`), nor where no loop runs the map (a generator
        finalised outside one). Raises a cancellation of the awaiting task, and a
        KeyboardInterrupt or SystemExit the source raised in the pull (never dropped with it)."""
        pull, self.pull = self.pull, None
        if pull is None:
            return
        if pull.get_loop().is_closed():
            return  # nothing will run the pull again: it is dropped pending, with the map
        pull.add_done_callback(retrieve)
        pull.cancel()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if not _shutting_down(loop):
            await asyncio.wait((pull,))
        if pull.done() and not pull.cancelled() and pull.exception() is None:
            _unwrapped(pull.result())


_RAISED = object()  # a pull's first value where the source raised KeyboardInterrupt or SystemExit (its second)


def _unwrapped(got: tuple) -> tuple:
    """A pull's ``(took, item)``; raises the KeyboardInterrupt or SystemExit the source raised
    in it (see :func:`_pull`)."""
    if got[0] is _RAISED:
        raise got[1]
    return got


async def _pull(iterator: Any) -> tuple:
    """An async source's next item as :meth:`Source.next` gives it (StopAsyncIteration is not
    raised into a task: asyncio would take it for the end of a generator). A KeyboardInterrupt or
    SystemExit the source raised is returned as ``(_RAISED, error)``, for :meth:`Source.next` to
    raise in the task iterating the map, as iterating the source there would: raised in this task,
    asyncio lets it out of the loop at once, and that task saw only a cancellation."""
    try:
        return True, await iterator.__anext__()
    except StopAsyncIteration:
        return False, None
    except (KeyboardInterrupt, SystemExit) as exc:
        return _RAISED, exc


def retrieve(task: "asyncio.Future") -> None:
    """A task or future nobody awaits any more ended (a pull the map gave up, a close whose awaiting
    task was cancelled): what it raised is nobody's (not logged as never retrieved)."""
    if not task.cancelled():
        task.exception()


class OffLoopSubmit:
    """A submit an ``asubmit`` runs on its event loop's executor, which the awaiting task may give
    up (its await cancelled): :meth:`gave_up` is the submit's ``gave_up`` (it then accepts
    nothing), :meth:`accepted` is called on the executor's thread with the future the submit
    made, and :meth:`abandon` on the loop's thread once the await is given up. Whichever of the
    last two comes second cancels the accepted chunk, so an item accepted for nobody never runs."""

    __slots__ = ("_lock", "_abandoned", "_future", "_ending")

    def __init__(self, ending: "CancelIfDropped | None"):
        self._lock = threading.Lock()
        self._abandoned = False
        self._future: Any = None
        self._ending = ending  # the amap the item is for, told of the chunk accepted

    def gave_up(self) -> bool:
        return self._abandoned

    def accepted(self, fut: Any) -> Any:
        """On the executor's thread: ``fut`` was accepted; returns it (cancelled if the await was
        given up meanwhile)."""
        if self._ending is not None:
            self._ending.accepted(fut)
        with self._lock:
            self._future = fut
            abandoned = self._abandoned
        if abandoned:
            fut.cancel()
        return fut

    def abandon(self) -> Any:
        """On the loop's thread, the await given up: returns the future accepted already (for the
        caller to cancel without waiting for the pipeline's lock), or None (the submit, still
        waiting, accepts nothing from now on)."""
        with self._lock:
            self._abandoned = True
            return self._future


class CancelIfDropped:
    """Cancels the chunks of an async map's window should the map be dropped without its clean-up,
    or be left where its event loop cannot run while the pipeline closes.

    An event loop closed without ``loop.shutdown_asyncgens()`` never finalises an async
    generator: its ``finally`` does not run, and the chunks it took would hold the pipeline's
    capacity (and delivered device results their slots) until ``close()`` waited for them for
    ever. Collected, the map cancels its window here. Still referenced, it is not collected, so
    ``close()`` gives its window up (:func:`give_up_stranded`) when its loop cannot run while
    ``close()`` waits: the loop is closed, or it is the loop of the thread calling ``close()``.
    ``window``: the map's chunk futures, each mapped to its asyncio future, in the order they were
    accepted (an ``OrderedDict``: a result handed out, the window's first or, unordered, any, goes
    in constant time), ended by :meth:`end`. An entry is a ``(chunk future, asyncio future)`` pair.

    An item whose accepting waits on the loop's executor is accepted on another thread, and the
    map puts its chunk in the window only once the loop runs it again: between the two the chunk
    is the map's all the same (:meth:`accepting`, :meth:`accepted`, :meth:`hold`)."""

    __slots__ = ("window", "ordered", "ended", "waiter", "loop", "thread", "given_up", "took", "lock", "accepting_by",
                 "unheld", "puller", "__weakref__")

    def __init__(self, window: Any, ordered: bool = True):
        self.window = window
        self.ordered = ordered  # False: results handed out as they end (see next_out)
        self.ended: collections.deque = collections.deque()  # unordered: entries in the order they ended
        self.waiter: "asyncio.Future | None" = None  # unordered: ends as the next entry ends (see handing_out)
        try:
            self.loop = asyncio.get_running_loop()
        except RuntimeError:  # driven by hand, outside any loop: nothing for close() to judge by
            self.loop = None
        self.thread = threading.get_ident()  # the loop's thread (an async generator runs on it)
        self.given_up = False  # close() took the window (the map ends at its next step)
        self.took = False  # the give-up took chunks of the map's: it is cut short (see amap_window)
        # the accepting thread and a give-up meet here: the one that comes second gives the chunk up
        self.lock = threading.Lock()
        self.accepting_by = None  # the driver accepting the map's next item off the loop's thread
        self.unheld = None  # the future of a chunk accepted for the map and not yet in its window
        self.puller: "weakref.ref | None" = None  # the task that ran the map's last step (see pulled)
        self.pulled()
        with _LIVE_LOCK:
            _LIVE.add(self)

    def pulled(self) -> None:
        """On the loop's thread, as the map starts a step: the task running it is the map's consumer
        (weakly: a task that ended pulls no more), which :func:`give_up_pulled_by` judges by."""
        try:
            task = asyncio.current_task()
        except RuntimeError:  # driven by hand, outside any loop
            task = None
        self.puller = None if task is None else weakref.ref(task)

    def left_to(self, task: "asyncio.Task | None") -> bool:
        """Whether nobody but ``task`` pulls the map: ``task`` ran its last step, or the task that did
        has ended (or none did: it was driven outside a task)."""
        puller = None if self.puller is None else self.puller()
        return puller is None or puller is task or puller.done()

    def accepting(self, driver: Any) -> None:
        """On the loop's thread: the map's next item is being accepted off it, by ``driver``'s
        pipeline (its accepting waits on the loop's executor). Until the map holds the chunk, a
        give-up of the window for that pipeline gives the chunk up too. ``driver`` None: the item
        was not accepted after all (that pipeline had no room), and is no longer being accepted;
        a tuple of drivers: by whichever of their pipelines has room first (a pipeline over
        several devices)."""
        with self.lock:
            self.accepting_by = driver

    def accepted(self, fut: ChunkFuture) -> None:
        """On the thread that accepted it: ``fut``'s chunk is the map's. Given up at once where the
        window was given up meanwhile; otherwise kept until :meth:`hold`. A map that ended meanwhile
        (its task cancelled) is left to cancel the chunk itself."""
        with self.lock:
            if self.window is None:
                return
            if not self.given_up:
                self.unheld = fut
                return
            self.took = True
        _give_up_chunks([fut])

    def hold(self, fut: ChunkFuture) -> bool:
        """On the loop's thread: put ``fut``'s chunk, accepted for the map, in its window. Returns
        False where the window was given up before (the chunk with it: see :meth:`accepted`)."""
        with self.lock:
            self.accepting_by = self.unheld = None
            given_up = self.given_up
        if not given_up:  # (a give-up waits for this thread's loop: it cannot come in between)
            # unordered, the entry is recorded as ended in the very callback that settles its head
            # (follow), so the heads end on this thread in the order their chunks ended, and no
            # head is ever seen done without its entry in ``ended`` (see next_out)
            on_settled = None if self.ordered else (lambda: self._ended(entry))
            entry = (fut, follow(fut, on_settled))
            self.window[fut] = entry[1]
        return not given_up

    def _ended(self, entry: tuple) -> None:
        """Unordered, on the loop's thread: ``entry``'s chunk ended (recorded in the callback that
        settles its head); a wait for the next to end is over."""
        self.ended.append(entry)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def handing_out(self) -> "list[asyncio.Future]":
        """The asyncio futures whose end hands a result out: the window's first's, or, unordered
        (results as they end, as ``map`` gives them), one that ends as soon as any entry has ended
        (the window may hold many entries: none is looked at one by one)."""
        window = self.window
        if not window:
            return []
        if self.ordered:
            return [next(iter(window.values()))]
        if self.ended:
            return [self.ended[0][1]]
        if self.waiter is None or self.waiter.done():
            self.waiter = asyncio.get_running_loop().create_future()
        return [self.waiter]

    def ready(self) -> bool:
        """Whether the map has a result to hand out now: one of :meth:`handing_out`'s entries has
        ended. Its chunk's future is looked at too: the asyncio future ends only at the loop's
        next turn, which a source that keeps the loop busy (a sync one, or an async one that never
        waits) may not give until the map has taken its whole window."""
        window = self.window
        if not window:
            return False
        fut, head = next(iter(window.items()))
        # (unordered: the first accepted, whose chunk mostly ends first, stands for the others)
        return fut.done() or head.done() or bool(self.ended)

    async def next_out(self) -> "tuple | None":
        """The window's entry to hand out next: ordered, its first (the caller awaits its end);
        unordered, the first to end, awaited here. None where the window was emptied meanwhile
        (given up: see :meth:`give_up`). Raises only a cancellation of the awaiting task, which
        cancels none of the futures."""
        window = self.window
        if self.ordered or not window:
            return next(iter(window.items())) if window else None
        if not self.ended:
            await asyncio.wait(self.handing_out())
        while self.ended:
            entry = self.ended.popleft()
            if window.get(entry[0]) is entry[1]:  # (one skipped or given up is gone)
                return entry
        # not reached while the window's heads end only through follow (each is in ``ended`` as
        # soon as it is done); kept for a head ended otherwise
        return next((entry for entry in window.items() if entry[1].done()), None)

    def holds(self, driver: Any) -> bool:
        """Whether the map holds chunks of ``driver``'s pipeline, or may be about to: in its
        window, accepted for it and not held yet, or being accepted off the loop's thread."""
        with self.lock:
            unheld, by = self.unheld, self.accepting_by
            return (by is driver or (isinstance(by, tuple) and any(d is driver for d in by))
                    or (unheld is not None and unheld._driver is driver)
                    or any(fut._driver is driver for fut in self.window or ()))

    async def end(self) -> None:
        """The map's clean-up: cancel what it took and has not handed out (awaited, without
        blocking the loop: see :func:`cancel_unwanted_soon`), and drop the asyncio futures."""
        # taken before the wait: the cancels are handed over before it, and are carried out even
        # if the wait is cancelled (as asyncio.run cancels a finalising generator's task), so the
        # finaliser must not hand them over a second time. A chunk accepted for the map and not
        # held is cancelled where it was accepted (the awaiting task was cancelled: see asubmit)
        with self.lock:
            window, self.window = self.window, None
            self.accepting_by = self.unheld = None
        self.ended.clear()  # (unordered: entries that ended and were not handed out)
        try:
            await cancel_unwanted_soon(list(window or ()))
        finally:
            for head in (window or {}).values():
                if not head.get_loop().is_closed():  # (a clean-up the closing loop cut short: see _shutting_down)
                    head.cancel()  # (nobody awaits it: its outcome is not to be logged as unretrieved)

    def stranded(self) -> bool:
        """Whether the map's loop cannot run while the calling thread waits: it is closed, or it is
        this thread's: running (the caller is inside one of its callbacks), or idle on the thread
        that ran the map (which would run it again, once the call returns)."""
        loop = self.loop
        if loop is None:
            return False
        if loop.is_closed():
            return True
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        return running is loop or (not loop.is_running() and self.thread == threading.get_ident())

    def give_up(self) -> None:
        """Take the window from a map that cannot run (:meth:`stranded`: it does not run now
        either): its chunks not ended are cancelled, and results delivered into it are dropped,
        device ones released, as each ends. The map, should its loop run it again, hands out
        nothing more: it ends at its next step, cut short (``concurrent.futures.CancelledError``)
        where this took items of its or its input was left (see :func:`amap_window`). A chunk
        accepted for it and not yet in the window goes with it, now or as it is accepted
        (:meth:`accepted`)."""
        with self.lock:
            window = self.window
            if window is None:
                return
            taken = list(window.items())
            window.clear()
            unheld, self.unheld = self.unheld, None
            self.given_up = True
            self.took = self.took or bool(taken) or unheld is not None
        _give_up_chunks([fut for fut, _ in taken] + ([unheld] if unheld is not None else []))
        for _, head in taken:
            if not head.get_loop().is_closed():  # (this is the loop's thread: see stranded)
                head.cancel()
        waiter = self.waiter
        if waiter is not None and not waiter.done() and not waiter.get_loop().is_closed():
            waiter.set_result(None)  # (an unordered map waiting for an entry to end goes on: none will)

    def __del__(self) -> None:
        window, self.window = self.window, None
        futures = list(window or ()) + ([self.unheld] if self.unheld is not None else [])
        if futures:
            try:
                post_cancel(futures)  # (never waits: this may run on any thread)
            except Exception:  # noqa: BLE001 - a finaliser never raises
                pass


# what a pipeline's _amap_failed makes of a result that raised: skip it and go on, end the map
# as cut short (see _amap_stopped), or raise what the result raised
SKIP, STOP, RAISE = "skip", "stop", "raise"


async def amap_window(pipe: Any, items: Any) -> AsyncIterator[Any]:
    """``pipe.amap(items)``: the loop of an async map, for a pipeline on one device or on several.
    At most ``pipe._amap_limit()`` items are taken ahead of the results handed out; while the
    window holds results not handed out, an item is submitted only where there is room now, and
    a ready result is handed out before the next pull. What differs between the pipelines is
    asked of ``pipe``:

    * ``_amap_begin()``: the checks made as the map starts (it may raise);
    * ``_amap_limit()``, ``_amap_room()``, ``_amap_takes_more()``: the window's size in items of
      chunks of their own, whether there is room now, whether the pipeline still takes work
      (looks, without its lock);
    * ``_amap_byte_limit()``, ``_amap_shared_bytes(item)``: an ordered window's bound on the bytes
      of its items that share chunks, and the bytes ``item`` holds there (0: a chunk of its own);
    * ``await _amap_submit(item, started, ending, wait)``: the item's future, :data:`NO_ROOM`,
      or None once the pipeline takes no more work (the map takes no more items);
    * ``_amap_out_of_work(exhausted, started)``, called once the window is empty and nothing
      more can be taken (and the window was not given up): True where the map ended with its
      input, False where it stopped before (it may raise instead): cut short;
    * ``await _amap_failed(fut, err)``: :data:`SKIP`, :data:`STOP` or :data:`RAISE` for the
      head's chunk ``fut`` that raised ``err`` (it may raise instead);
    * ``_amap_stopped(cut_short, handed_out, own_close)``: called after the clean-up of a map
      that stopped (``cut_short``: by a cancel or a close, with input left or results of its
      own cancelled, after handing out ``handed_out`` results; ``own_close``: a close by the
      map's own consumer gave its window up): the error to raise then, or None.

    A map whose window ``close()`` gave up while it could not run (:func:`give_up_stranded`,
    :func:`give_up_pulled_by`) hands out nothing more: it is cut short where the give-up took
    items of its (in its window, or accepted for it), or its input was left (an item carried or
    refused, a pull in progress, or, where it had not reached the end of its input, one more
    item pulled, which is not run); otherwise it ends as its input did.

    The clean-up, whatever ends the map: a pull in progress is stopped, and every chunk taken and
    not handed out is cancelled (awaited without blocking the loop: :meth:`CancelIfDropped.end`).
    """
    pipe._amap_begin()
    window: collections.OrderedDict = collections.OrderedDict()  # chunk future -> its asyncio future, in order
    ending = CancelIfDropped(window, pipe.config.ordered)
    limit = pipe._amap_limit()
    # items sharing chunks hold no capacity once their chunk ended: the map bounds the bytes of
    # those it holds (accepted, not handed out) instead, as map does, so that they fill chunks
    byte_limit = pipe._amap_byte_limit()
    held = 0  # the bytes of the window's items that share chunks
    shared: dict = {}  # their chunk futures -> their bytes (the rest count against ``limit``)
    source = Source(items)
    carried: list = []  # an item pulled that found no room: submitted before any other
    exhausted = refused = started = cut_short = False
    handed_out = 0
    try:
        while True:
            while ((carried or not exhausted) and not refused and len(window) - len(shared) < limit
                   and (not shared or held < byte_limit) and pipe._amap_takes_more()):
                if window and (ending.ready() or (not carried and not pipe._amap_room())):
                    # hand the head out before waiting for room: with results on the device, room
                    # comes only once results are released, and a result still in a window (this
                    # map's, or another's on the same pipeline) never is
                    break
                if not carried:
                    # an async source's pull is raced with the head: a ready result is handed out
                    # while the pull goes on (see Source)
                    took, item = await source.next(ending.handing_out())
                    if not took:
                        exhausted = not source.pulling()
                        break
                    carried.append(item)
                nbytes = pipe._amap_shared_bytes(carried[0]) if byte_limit else 0
                if nbytes and held and held + nbytes > byte_limit:
                    # (held: a result is in the window; its chunk ends before later ones) the
                    # item stays carried while a result is handed out
                    break
                # with results in the window, only where there is room now: the room seen before
                # the pull may have been taken since by another thread's submit, and a wait for it
                # could last until this map's results were released
                fut = await pipe._amap_submit(carried[0], started, ending, not window)
                if fut is NO_ROOM:
                    break  # the item stays carried while a result is handed out
                carried.clear()
                if fut is None:
                    refused = True  # stopped meanwhile (cancelled, closed, a failure): as map, take no more
                    break
                started = True
                if not ending.hold(fut):
                    break  # the window was given up while the item was accepted off this loop
                if nbytes:
                    shared[fut] = nbytes
                    held += nbytes
            if not window:
                if ending.given_up:
                    break  # close() took the window while this map could not run (give_up_stranded)
                if pipe._amap_out_of_work(exhausted, started):
                    return
                if (not (carried or refused or source.pulling())
                        and pipe._amap_stopped(False, handed_out) is None):
                    # the pipeline takes no more work (and no failure of it is to be raised): the
                    # map ends as its input does where that is used up, and is cut short
                    # otherwise (an item still there is not run; a pull in progress is not
                    # waited for, but stopped)
                    if not (await source.next([]))[0]:
                        return
                cut_short = True
                break
            entry = await ending.next_out()
            if entry is None:
                break  # close() took the window while this map could not run (give_up_stranded)
            fut, head = entry
            if not head.done():
                # waited for without taking its outcome: a CancelledError raised here is always
                # the awaiting task's own, and leaves the map (finally cancels the window). Awaited
                # through asyncio.shield, a task cancelled in the turn its head's chunk was (a
                # cancel() of the pipeline just before) got one CancelledError for both, which the
                # map took for the chunk's: it ended quietly, or went on, and the task's
                # cancellation was lost
                await asyncio.wait((head,))
            try:
                value = head.result()
            except BaseException as err:
                if ending.given_up:
                    break  # close() took the window while this map could not run (give_up_stranded)
                verdict = await pipe._amap_failed(fut, err)
                if verdict is SKIP:
                    del window[fut]
                    held -= shared.pop(fut, 0)
                    continue
                if verdict is STOP:
                    cut_short = True
                    break
                raise  # the chunk's failure (finally cancels the rest of the window)
            if ending.given_up:
                break  # close() took the window while this map could not run (give_up_stranded)
            del window[fut]
            held -= shared.pop(fut, 0)
            handed_out += 1
            yield value
            ending.pulled()
        if ending.given_up and not cut_short:
            # close() took the window while this map could not run: cut short where that took
            # items of the map's or input was left, as a map whose pipeline stopped under it is
            cut_short = (ending.took or bool(carried) or refused or source.pulling()
                         or (not exhausted and (await source.next([]))[0]))
    except BaseException as err:
        # what this raises may be kept by the caller, and with it this frame: not the pipeline,
        # nor in the frames of the steps that raised it (they have returned)
        pipe = None  # noqa: F841 - dropped, not read again
        forget_own_frames(err)
        raise
    finally:
        # awaited: the loop runs on while the progress thread cancels them, and the map ends with
        # nothing of its own left running
        try:
            try:
                await source.stop()
            finally:
                await ending.end()
        finally:
            # this generator's frame stays in the traceback of what it raised (a chunk's failure,
            # which the pipeline keeps among its failures): its locals must not keep the results
            # it did not hand out (a device result's slot, a pinned block), nor a chunk holding
            # that failure, which would form a cycle through it
            window.clear()
            entry = fut = head = value = None  # noqa: F841 - dropped, not read again
            items = source = item = carried = None  # noqa: F841 - nor the caller's items
    # a window given up was given up for the map's own consumer: its loop's thread closed the
    # pipeline, or the task that pulls it left an async with block (give_up_pulled_by)
    stopped_by = pipe._amap_stopped(cut_short, handed_out, ending.given_up)
    pipe = None  # (as above: the frame of this raise)
    if stopped_by is not None:
        raise stopped_by


# every async map not yet collected (weakly: a dropped one cancels its window in __del__)
_LIVE: "weakref.WeakSet[CancelIfDropped]" = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


def give_up_stranded(driver: Any) -> None:
    """For a pipeline's ``close()``: give up the window of every async map holding chunks of
    ``driver``'s whose event loop cannot run while the caller waits (:meth:`CancelIfDropped.stranded`),
    so that close() never waits for results only that loop could hand out."""
    with _LIVE_LOCK:
        maps = list(_LIVE)
    for ending in maps:
        # stranded first: a map that can run may change its window meanwhile
        if ending.stranded() and ending.holds(driver):
            ending.give_up()


def give_up_pulled_by(task: "asyncio.Task | None", drivers: "list[Any]") -> None:
    """For an awaited ending of a pipeline (``__aexit__``), on the loop's thread, before its close
    waits off that thread: give up the window of every async map of this loop holding chunks of
    one of ``drivers`` that only ``task``, the task awaiting the ending, could pull
    (:meth:`CancelIfDropped.left_to`). That task waits for the close, so such a map cannot run
    meanwhile, as a map whose loop is the closing thread's cannot (:func:`give_up_stranded`); a
    map another task pulls runs on, and the close waits for it."""
    loop = asyncio.get_running_loop()
    with _LIVE_LOCK:
        maps = list(_LIVE)
    for ending in maps:
        if ending.loop is loop and ending.left_to(task) and any(ending.holds(d) for d in drivers):
            ending.give_up()


def _give_up_chunks(futures: "list[ChunkFuture]") -> None:
    """Give up chunks nobody will take: those not ended are cancelled, and a device result
    delivered into one is released as it ends. Never waits (the caller may hold the pipeline's
    lock) and never raises."""
    for fut in futures:
        fut.add_done_callback(_drop_result)  # (at once for one that has ended)
    try:
        post_cancel(futures)
    except Exception as exc:  # noqa: BLE001 - as cancel_unwanted: chunks not cancelled end by themselves
        logger.debug("an abandoned amap's chunks were not cancelled: %r", exc)


def _drop_result(fut: ChunkFuture) -> None:
    """A given-up map's chunk ended: a device result delivered into it goes back to its slot."""
    if fut.cancelled() or fut.settled_error() is not None:
        return
    value = fut.settled_value()
    if isinstance(value, DeviceResult):
        value.release()
