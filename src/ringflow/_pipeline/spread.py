"""A :class:`~ringflow.Pipeline` over several devices: one pipeline per device, items spread by load.

``Pipeline(f, device=["cuda:0", "cuda:1"])`` (or ``"cuda:all"``, or ``["sim:0", "sim:1"]``) makes a
:class:`SpreadPipeline`: an ordinary pipeline on each device (its own streams, rings, pinned
memory and progress thread) and a dispatcher that sends each item to the one with the fewest
unfinished chunks (and results delivered on the device not yet released), skipping any whose
device broke, and any whose every slot is held by such results while another has a slot free.
``map`` hands results back in submission order (``ordered=False``: as they finish) whichever
device ran them; ``stats`` adds the parts up; ``report`` gives one report with a trace per
device.

A device that breaks (a sticky error) fails its own unfinished chunks; with
``on_error="continue"`` the others go on and new items go to the devices that still work; with
``"raise"`` the first failure cancels every part, as on one device. A device that breaks while it
has no chunks is found by the first submit offered to it, whose accepting thread hands the error
to that part's progress thread (:meth:`Pipeline._break_on_sticky`); later items pass it over.

While it is open, each part's device is declared copying host memory with the part's CPU workers
(``Device.sharing_host``): simulated GPUs of one host then share its copy rate, as a loaded
pipeline's parts would (an idle part is counted too).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import itertools
import threading
import weakref
from typing import Any, AsyncIterator, Callable, Iterable, Iterator, Optional

from .._device import device_label, device_list
from .._errors import DeviceError, StageError
from .api import Pipeline, _GaveUp
from .aio import NO_ROOM, RAISE, SKIP, STOP, CancelIfDropped, OffLoopSubmit, amap_window, follow
from .chunk import cancel_unwanted, post_cancel
from .driver import _POLL_S, WakeFlag
from .frames import forget_own_frames
from .scheduler import map_cut_short
from .sigint import checkpoint, shielded_call
from .stats import PipelineStats
from .validate import check_flag, check_iterable, check_timeout, warn_if_elements_as_items


class SpreadPipeline(Pipeline):
    """A pipeline over several devices (made by :class:`~ringflow.Pipeline` for a list of them).

    Attributes:
        parts: the pipeline of each device, in the order given.
        devices: each part's device.
    """

    def __init__(self, compute: Callable, *, device: Any = None, **options: Any):
        self._closed = True
        devices = device_list(device)
        self.parts: list[Pipeline] = []
        try:
            for dev in devices:
                self.parts.append(Pipeline(compute, device=dev, **options))
        except BaseException:
            for part in self.parts:
                part.close()
            raise
        # one count of chunks for every part: a StageError's or DeviceResult's index is the item's
        # submission index across the devices, as on one
        indices = itertools.count()
        for part in self.parts:
            part._sched.count_with(indices)
            if part.config.on_error == "raise":
                # the first failure of any part stops them all, as it stops one device, whatever
                # took the item (a submit too, not only a map, which cancels the pipeline itself)
                others = [weakref.ref(p) for p in self.parts if p is not part]
                part._sched.on_failure_stop = functools.partial(_stop_parts, others)
        self.devices = list(devices)
        self.device = self.devices[0]
        self.config = self.parts[0].config
        sharing = contextlib.ExitStack()
        for dev, part in zip(self.devices, self.parts):
            sharing.enter_context(dev.sharing_host(part.config.workers))
        self._unshare = weakref.finalize(self, sharing.close)  # at close, or when dropped unclosed
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self._closed = False

    # -- dispatch -------------------------------------------------------------------------------
    def _pick(self, skip: tuple = ()) -> Pipeline:
        """The first of :meth:`_ranked` (the least loaded working part), other than ``skip``."""
        return self._ranked(skip)[0]

    def _ranked(self, skip: tuple = ()) -> list[Pipeline]:
        """The working parts other than ``skip``, those with the fewest unfinished chunks and
        unreleased results delivered on the device first (ties: in turn); a part whose every slot
        the compute writes is held by such results is left out while another is not.

        Raises:
            DeviceError: no part works, and one's device broke.
            RuntimeError: no part works (each takes no more work).
        """
        with self._lock:
            turn = next(self._turn)
        working = ([] if self._stopped_by_failure() else
                   [p for p in self.parts if p._sched.broken is None and p._sched.accepting and p not in skip])
        if not working:
            broken = next((p._sched.broken for p in self.parts if p._sched.broken is not None), None)
            if broken is not None:
                raise broken
            stopped = next((p for p in self.parts if p._sched.first_error is not None), self.parts[0])
            raise stopped._sched.refusal()
        # a part whose every slot the compute writes is held by results not yet released is left
        # out while another works: an item sent there waits for a release, which may never come
        # while its consumer waits for that item (the item waits for room on the others instead)
        free = [p for p in working if not p._sched.held_by_results()]
        working = free or working
        n = len(working)
        # (a look at each part's load without its lock, which its progress thread holds for a step;
        # sorted is stable: parts equally loaded stay in turn)
        return sorted((working[(turn + k) % n] for k in range(n)), key=lambda p: p._sched.load())

    def _accepting(self) -> bool:
        return not self._stopped_by_failure() and any(p._sched.broken is None and p._sched.accepting
                                                      for p in self.parts)

    def _stopped_by_failure(self) -> bool:
        """Whether a part's failure stopped the pipeline (``on_error="raise"``): no part takes work
        from then on, even one whose progress thread has not yet carried out the cancel the failure
        handed it (:func:`_stop_parts`)."""
        return self.config.on_error == "raise" and self._part_failure() is not None

    def _has_room(self) -> bool:
        """Whether a working part has room for another chunk now (a look without the parts' locks,
        as :meth:`_pick`'s, which only decides whether a map pulls its next item: the item then
        goes where a part has room under that part's lock, see :meth:`_submit_if_room`)."""
        return any(p._sched.broken is None and p._sched.has_capacity() for p in self.parts)

    def _takes_no_more(self) -> bool:
        """Whether the pipeline takes no more work: no part accepts (cancelled, stopped by a
        failure), or a close() has begun. That close stops the parts' admission one after another,
        so a part it has not reached yet still accepts; on one device close() stops admission at
        once."""
        return self._closed or not self._accepting()

    def _submit_more(self, item: Any, started: bool, wait: bool) -> "concurrent.futures.Future | object | None":
        """A map's next submit: with ``wait`` False, :meth:`_submit_if_room` (:data:`NO_ROOM` where
        no part has room). None once the pipeline takes no more work (:meth:`_takes_no_more`)
        after the map had started: it then ends with what it has, as a single device's map does."""
        try:
            return self.submit(item) if wait else self._submit_if_room(item)
        except RuntimeError:
            if started and self._takes_no_more():
                return None
            raise

    async def _amap_submit(self, item: Any, started: bool, ending: CancelIfDropped,
                           wait: bool) -> "concurrent.futures.Future | object | None":
        """:meth:`_submit_more` for ``amap`` (``ending``: its own), without blocking the event loop (a
        step of :func:`~.aio.amap_window`)."""
        try:
            # (the parts do not know of a close() begun on the pipeline until it reaches each)
            self._check_open()
            return await self._asubmit_future(item, ending=ending, wait=wait)
        except RuntimeError:
            if started and self._takes_no_more():
                return None
            raise

    def _submit_if_room(self, item: Any) -> "concurrent.futures.Future | object":
        """Submit ``item`` to a working part that has room for it now, never waiting for room: the
        parts are tried least loaded first, each deciding under its own lock, so that the room
        found is the room taken (another thread's submit between a look and the submit cannot
        make the caller wait). Returns the item's future, or :data:`NO_ROOM` where no part had
        room (nothing of the item was accepted).

        Raises:
            as :meth:`submit`.
        """
        self._check_caller("submit()")
        tried: tuple = ()
        for part in self._ranked():
            try:
                fut = part._submit_if_room(item)
            except (DeviceError, RuntimeError) as err:
                tried = _passed_over(part, err, tried)
                continue
            if fut is not NO_ROOM:
                return fut
        return self._no_room_left(tried)

    def _no_room_left(self, tried: tuple) -> object:
        """:data:`NO_ROOM` once every working part was offered an item without room for it, or,
        where each was found broken or stopped on the way (``tried``), the error :meth:`submit`
        raises then."""
        self._pick(tried)  # (raises where no other part works; none starts working again)
        return NO_ROOM

    def submit(self, item: Any, timeout: Optional[float] = None) -> concurrent.futures.Future:
        """As :meth:`Pipeline.submit`, over every device: the item goes to the least loaded working
        device with room (a device found broken or stopped on the way is passed over for the
        next); where none has room, it waits for room on every working device at once and goes
        to the first that has some (accepted there once, under that device's lock).

        Raises:
            TimeoutError: no device had room within ``timeout`` seconds (each device's host
                clock, virtual on the simulated GPU: the wait ends once any device's has passed).
            as :meth:`Pipeline.submit` otherwise.
        """
        timeout = check_timeout(timeout)
        self._check_caller("submit()")
        return self._submit_waiting(item, timeout)

    @shielded_call
    def _submit_waiting(self, item: Any, timeout: Optional[float],
                        gave_up: Optional[Callable[[], bool]] = None,
                        flag: Optional[WakeFlag] = None) -> concurrent.futures.Future:
        """:meth:`submit`'s accepting: :meth:`_submit_if_room` again each time a part may have
        room, until one accepts the item.

        While no part has room, the caller watches every part (:meth:`_Driver.watch`), holding
        none of their locks: each part's driver sets one flag whenever it wakes its own waiters,
        and advances as for a wait (on the simulated GPU, a part advances only while someone
        waits on it). The flag's wait also lasts at most :data:`_POLL_S` real seconds, so that a
        Ctrl-C on the main thread, a timeout and ``gave_up`` are looked at that often even if no
        part wakes it.

        Args:
            gave_up: for an asubmit's accepting on the loop's executor: whether the task awaiting
                it gave up, which ends the wait (nothing accepted).
            flag: the flag the parts set (``flag.set()`` from another thread also wakes the wait,
                to look at ``gave_up`` again); a new one where None.

        Raises:
            _GaveUp: ``gave_up()`` held before the item was accepted.
            TimeoutError: as :meth:`submit`.
            as :meth:`_submit_if_room` otherwise.
        """
        flag = flag or WakeFlag()
        watched: list = []
        try:
            while True:
                flag.clear()  # (before the look: a wake that comes after it ends the wait below)
                if gave_up is not None and gave_up():
                    raise _GaveUp()
                fut = self._submit_if_room(item)
                if fut is not NO_ROOM:
                    return fut
                if not watched:
                    # the deadlines start with the first wait, on each part's own clock
                    for part in self.parts:
                        d, s = part._driver, part._sched
                        watched.append((d, d.watch(
                            flag, lambda s=s: s.has_capacity() or not s.accepting or s.broken is not None,
                            d.deadline_of(timeout))))
                    continue  # room that came before the watch began has woken nobody: look again
                for d, (_flag, entry) in watched:
                    if entry[1] is not None and d.device.now >= entry[1]:
                        raise concurrent.futures.TimeoutError(
                            f"timed out after {timeout} s waiting for capacity on any of the pipeline's devices")
                flag.wait(_POLL_S)
                checkpoint()  # a Ctrl-C the shield of a part's call recorded, raised between two looks
        finally:
            for d, entry in watched:
                d.unwatch(entry)

    async def asubmit(self, item: Any, timeout: Optional[float] = None) -> Any:
        """As :meth:`Pipeline.asubmit`, over every device: the item goes where :meth:`submit`
        would send it, waiting for room on every working device at once (on the loop's executor)
        where none has room; a cancelled await ends that wait, nothing accepted."""
        self._check_caller("asubmit()", awaited=True)
        return await follow(await self._asubmit_future(item, timeout))

    async def _asubmit_future(self, item: Any, timeout: Optional[float] = None,
                              ending: Optional[CancelIfDropped] = None,
                              wait: bool = True) -> "concurrent.futures.Future | object":
        """:meth:`asubmit`'s accepting; with ``wait`` False, as :meth:`_submit_if_room`."""
        timeout = check_timeout(timeout)
        tried: tuple = ()
        # first where there is room now, on the loop's thread (no part's driver lock is taken there)
        for part in self._ranked():
            try:
                fut = await part._asubmit_future(item, timeout, ending, wait=False)
            except (DeviceError, RuntimeError) as err:
                tried = _passed_over(part, err, tried)
                continue
            if fut is not NO_ROOM:
                return fut
        if not wait:
            return self._no_room_left(tried)
        self._no_room_left(tried)  # (raises where no part works)
        # then a wait for room on every part (_submit_waiting), on the loop's executor; a
        # cancelled await ends it (gave_up, and the flag set to look at it now)
        off, flag = OffLoopSubmit(ending), WakeFlag()

        def submit() -> "concurrent.futures.Future | None":
            try:
                fut = self._submit_waiting(item, timeout, off.gave_up, flag)
            except _GaveUp:
                return None  # (nobody awaits this any more)
            return off.accepted(fut)

        if ending is not None:
            ending.accepting(tuple(part._driver for part in self.parts))
        try:
            return await asyncio.get_running_loop().run_in_executor(None, submit)
        except BaseException:  # CancelledError mostly: the task awaiting asubmit gave up
            fut = off.abandon()
            if fut is not None:
                post_cancel([fut])  # (the loop's thread does not wait for a part's lock)
            else:
                flag.set()  # the executor's wait looks at gave_up now, and ends
            raise

    def map(self, items: Iterable[Any]) -> Iterator[Any]:
        """As :meth:`Pipeline.map`, over every device: at most the parts' ``max_in_flight`` added
        up are taken ahead of the results handed out. While it holds results not handed out it
        never waits for room: an item it pulled that no device has room for by the time it is
        submitted (another thread took the room) is submitted after a result is handed out.

        Raises:
            RuntimeError: at once (not when iterated) on a closed pipeline.
            TypeError: at once, where ``items`` is not iterable.
            concurrent.futures.CancelledError: when iterated, the map cut short by a cancel or a
                close, as on one device.
        """
        self._check_caller("map()")
        if self.parts[0]._items_are_arrays:
            warn_if_elements_as_items(items, "Pipeline.map()")
        return self._map(check_iterable("items", items))

    def _map(self, items: Iterable[Any]) -> Iterator[Any]:
        limit = sum(p.config.max_in_flight for p in self.parts)
        source = iter(items)
        window: collections.deque = collections.deque()
        carried: list = []  # an item pulled that no part had room for: submitted before any other
        exhausted = started = interrupted = cut_short = False
        handed_out = 0  # results handed out (told by the error of a map cut short)
        try:
            while True:
                while (carried or not exhausted) and len(window) < limit:
                    if window and (_head_ended(window, self.config.ordered)
                                   or (not carried and not self._has_room())):
                        # hand a ready result out before taking more, and never wait for room
                        # while the window holds results: with results on the device, room comes
                        # only once results are released, and one still in a window (this map's,
                        # or another's on the same pipeline) never is
                        break
                    if not carried:
                        try:
                            carried.append(next(source))
                        except StopIteration:
                            exhausted = True
                            break
                    # with results in the window the item goes only where there is room now: the
                    # room seen before the pull may have been taken since by another thread's
                    # submit (another map's, on the same pipeline), and a wait for it could last
                    # until this map's own results were released, for ever
                    fut = self._submit_more(carried[0], started, wait=not window)
                    if fut is NO_ROOM:
                        break  # the item stays carried while a result is handed out
                    carried.clear()
                    if fut is None:  # input is left: the map is cut short once its window is handed out
                        exhausted = cut_short = True
                        break
                    window.append(fut)
                    started = True
                if not window:
                    if cut_short:
                        err = self._stopped("map()", handed_out)
                        raise err from err.__cause__
                    return
                fut = window[0] if self.config.ordered else next(iter(concurrent.futures.wait(
                    window, return_when=concurrent.futures.FIRST_COMPLETED).done))
                try:
                    value = fut.result()
                except concurrent.futures.CancelledError:
                    window.remove(fut)
                    if self.config.on_error == "continue":
                        continue
                    # the pipeline was cancelled under this map, or a part's failure stopped it
                    # (and cancelled that part's other chunks): that failure is raised, as on one
                    # device, from its own cause ('from None' would clear the StageError's
                    # __cause__, the user's exception, for every reader of the part's failures)
                    err = self._stopped("map()", handed_out)
                    if not isinstance(err, concurrent.futures.CancelledError):
                        self.cancel()
                    raise err from err.__cause__
                except BaseException as err:
                    if not fut.failed_with(err):
                        raise  # this caller's own (a Ctrl-C in its wait): finally cancels the window
                    window.remove(fut)
                    if self.config.on_error == "continue":
                        continue  # a failed item (whatever its stage raised, or its device's) is skipped
                    self.cancel()
                    raise
                window.remove(fut)
                handed_out += 1
                yield value
        except BaseException as err:
            interrupted = isinstance(err, KeyboardInterrupt)
            forget_own_frames(err)  # (as Pipeline._map: the steps that raised it have returned)
            raise
        finally:
            # the caller stopped early: the rest are not wanted (after a Ctrl-C, not waited for:
            # see Pipeline._drop_unwanted)
            try:
                cancel_unwanted(list(window), wait=not interrupted)
            finally:
                # this generator's frame stays in the traceback of what it raised (a part's
                # failure, which the part keeps among its failures): as Pipeline._map's, its
                # locals must not keep the results it did not hand out (a device result's slot, a
                # pinned block), nor a future or failure that would form a cycle with it
                window.clear()
                fut = value = failure = None  # noqa: F841 - dropped, not read again
                self = source = items = carried = None  # noqa: F841 - nor the pipeline, nor the caller's items

    def amap(self, items: Any) -> AsyncIterator[Any]:
        """As :meth:`Pipeline.amap`, over every device, in submission order (``ordered=False``: as
        they end, whichever device ran them), taking items and waiting for room as :meth:`map`
        does; a chunk cancelled
        under it (the pipeline cancelled, or stopped by a failure) ends it as it ends :meth:`map`.

        Raises:
            concurrent.futures.CancelledError: the amap cut short by a cancel or a close, as
                :meth:`map` (and as on one device).
        """
        if self.parts[0]._items_are_arrays:
            warn_if_elements_as_items(items, "Pipeline.amap()")  # (at the line that called amap)
        return amap_window(self, items)

    # the steps of amap_window that are this pipeline's own (see there)
    def _amap_begin(self) -> None:
        self._check_caller("amap()", awaited=True)

    def _amap_limit(self) -> int:
        return sum(p.config.max_in_flight for p in self.parts)

    def _amap_byte_limit(self) -> int:
        return sum(p._amap_byte_limit() for p in self.parts)

    def _amap_shared_bytes(self, item: Any) -> int:
        return self.parts[0]._amap_shared_bytes(item)  # (the parts share their options)

    def _amap_room(self) -> bool:
        return self._has_room()

    def _amap_takes_more(self) -> bool:
        return True  # (a part that stopped refuses the submit: see _amap_submit)

    def _amap_out_of_work(self, exhausted: bool, started: bool) -> bool:
        return exhausted  # (input left: the pipeline took no more, see _amap_submit)

    async def _amap_failed(self, fut: Any, err: BaseException) -> str:
        if not (fut.cancelled() or fut.failed_with(err)):
            # not the chunk's own outcome (amap_window raises the awaiting task's cancellation
            # before it gets here): raised as it is; the map's clean-up cancels its window
            return RAISE
        if self.config.on_error == "continue":
            return SKIP  # a failed item (whatever its stage raised, or its device's) is skipped
        # a chunk cancelled under this amap: the pipeline was cancelled, or a part's failure
        # stopped it (and cancelled that part's other chunks)
        failure = err if fut.failed_with(err) else self._part_failure()
        if failure is None:
            return STOP  # cancelled
        # every part stops, as on one device (the cancel, which waits, off the loop)
        await asyncio.get_running_loop().run_in_executor(None, self.cancel)
        if failure is err:
            return RAISE
        # this coroutine's frame stays in the traceback of what it raises, which the caller may keep
        self = fut = None  # noqa: F841 - dropped, not read again
        raise failure from failure.__cause__  # (as map: keep the user's exception)

    def _amap_stopped(self, cut_short: bool, handed_out: int, own_close: bool = False) -> Optional[BaseException]:
        return self._stopped("amap()", handed_out, own_close) if cut_short or self._stopped_by_failure() else None

    def _stopped(self, call: str, handed_out: int, own_close: bool = False) -> BaseException:
        """What a map (``call``) that the pipeline stopped under raises: the failure that stopped
        a part (with ``on_error="raise"``), as on one device; else that it was cut short by a
        cancel or a close (:func:`.scheduler.map_cut_short`)."""
        if self._stopped_by_failure():
            return self._part_failure()
        return map_cut_short(call, [part._sched for part in self.parts], handed_out, own_close)

    def _part_failure(self) -> Optional[BaseException]:
        """The failure that stopped a part (with ``on_error="raise"``), if one did."""
        return next((p._sched.first_error for p in self.parts if p._sched.first_error is not None), None)

    # -- ending and inspection -----------------------------------------------------------------
    def cancel(self) -> None:
        """Cancel every part (see :meth:`Pipeline.cancel`: a map or amap running meanwhile is cut
        short, raising ``concurrent.futures.CancelledError``)."""
        self._check_caller("cancel()", opened=False)
        for part in self.parts:
            part.cancel()

    def close(self) -> None:
        """Close every part (each finishes what it accepted first); harmless twice. Ctrl-C while a
        part's close waits ends that part as on one device (:meth:`Pipeline.close`: its end is
        handed to its progress thread) and the parts not closed yet likewise, without waiting for
        their work; KeyboardInterrupt is raised once every part was gone through. A later close()
        goes through every part again, so it waits for each part whose end was handed over, as a
        second close() of one device does."""
        if self._forget_if_forked():
            return
        self._check_caller("close()", opened=False)
        self._closed = True
        errors = self._end_parts(Pipeline.close)
        self._unshare()
        if errors:
            raise errors[0]

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._exit_at_once(exc_type):
            return
        self._check_caller("__exit__", opened=False)
        self._closed = True
        try:
            # an error left the block: each part cancels and closes, masking nothing (a Ctrl-C
            # meanwhile ends the rest as close() does; a later close() waits for them)
            errors = self._end_parts(lambda part: part.__exit__(exc_type, exc, tb))
        finally:
            self._unshare()
        if errors:
            raise errors[0]

    def _end_parts(self, end: Callable[[Pipeline], Any]) -> list:
        """``end(part)`` for every part, in order; once one raised an interrupt (Ctrl-C, not an
        Exception), each later part is ended as an interrupted ending ends one
        (:meth:`Pipeline._end_interrupted`: cancelled, its end handed to its progress thread,
        waited for only while no stage of it stalls). Returns what each call raised, in order."""
        errors: list = []
        for part in self.parts:
            try:
                if any(not isinstance(err, Exception) for err in errors):
                    part._end_interrupted()
                else:
                    end(part)
            except BaseException as exc:  # noqa: BLE001 - every part is ended; the first error is raised
                errors.append(exc)
        return errors

    def _each(self) -> list[Pipeline]:
        return self.parts

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this pipeline is closed; create a new one")
        closed = next((i for i, dev in enumerate(self.devices) if getattr(dev, "closed", False)), None)
        if closed is not None:
            # a part whose device is closed fails whatever it is given, with that device's own words
            raise RuntimeError(f"device {closed} ({device_label(self.devices[closed])}) of this pipeline is closed, "
                               f"and a pipeline runs its work on every one of its devices until it is closed: close "
                               f"the pipeline before its devices, or make a new pipeline on open devices")

    def _check_caller(self, call: str, opened: bool = True, awaited: bool = False) -> None:
        """As :meth:`Pipeline._check_caller`, from a stage or the progress thread of any part: a
        stage of one device's part waits on the whole pipeline as much as on its own part, and an
        await may land on that part."""
        for part in self.parts:
            part._check_caller(call, opened=False, awaited=awaited)
        if opened:
            self._check_open()

    def _forget_if_forked(self) -> bool:
        """As :meth:`Pipeline._forget_if_forked`, for every part."""
        forgotten = [part._forget_if_forked() for part in self.parts]
        if not any(forgotten):
            return False
        self._closed = True
        self._unshare.detach()
        return True

    def stats(self) -> PipelineStats:
        """The parts' counts added up."""
        parts = [p.stats() for p in self.parts]
        return PipelineStats(**{k: sum(getattr(s, k) for s in parts)
                                for k in ("accepted", "delivered", "failed", "cancelled", "in_flight")})

    @property
    def failures(self) -> list[StageError]:
        return [f for p in self.parts for f in p.failures]

    def report(self, reset: bool = False):
        """A :class:`~ringflow._pipeline.sharded.ShardedReport`: each device's report (one trace
        with a process per device); its ``rows`` are ``(0, chunks)`` of each device.

        Args:
            reset: as :meth:`Pipeline.report`, on every device.

        Raises:
            RuntimeError: the pipeline was not made with ``profile=True``.
            TypeError: ``reset`` is not a bool.
        """
        from .sharded import ShardedReport

        reset = check_flag("reset", reset)
        reports = [p.report(reset) for p in self.parts]
        start = min((r.timeline.start for r in reports if r.chunks), default=0.0)
        return ShardedReport(reports=tuple(reports), devices=tuple(device_label(d) for d in self.devices),
                             rows=tuple((0, r.chunks) for r in reports),
                             elapsed_s=tuple(max(0.0, r.timeline.end - start) for r in reports),
                             lead_s=tuple(max(0.0, r.timeline.start - start) for r in reports),
                             simulated=all(getattr(d, "backend", None) == "sim" for d in self.devices))

    @property
    def scheduler(self):
        raise AttributeError("a pipeline over several devices has a scheduler per part: see .parts")

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<Pipeline {state} over {', '.join(device_label(d) for d in self.devices)}>"


def _stop_parts(parts: "list[weakref.ref]") -> None:
    """A part's failure stopped it (``on_error="raise"``; on its progress thread, its lock held):
    hand a cancel of their pending work to each of the other ``parts`` (weakly held: a part's
    scheduler does not keep the others alive), without waiting for their locks."""
    for ref in parts:
        part = ref()
        if part is not None:
            part._driver.post(part._sched.cancel_pending, _ignore)


def _ignore(_command: Any) -> None:
    """What is done once a part ran the cancel :func:`_stop_parts` handed it: nothing more (a part
    that had ended ran none, having nothing left to cancel)."""


def _head_ended(window: "collections.deque", ordered: bool) -> bool:
    """Whether a map's window has a result to hand out: its first chunk ended, or (unordered) any."""
    return window[0].done() if ordered else any(fut.done() for fut in window)


def _passed_over(part: Pipeline, err: Exception, tried: tuple) -> tuple:
    """``tried`` and ``part`` after a submit to ``part`` raised ``err``, where the item goes to the
    next device: ``part``'s device broke (its progress thread may not know yet), or it stopped
    taking work meanwhile.

    Raises:
        DeviceError, RuntimeError: ``err``, where it is the submit's own error to raise.
    """
    passed = err.sticky if isinstance(err, DeviceError) else not part._sched.accepting
    if not passed:
        raise err
    return tried + (part,)
