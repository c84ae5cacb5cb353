"""Who runs a scheduler's loop: the thread that waits (:class:`CallerDriver`) or a thread of the
pipeline's own (:class:`ProgressThread`).

Both share one rule: **only the driving thread changes the scheduler's state**, always with the
driver's lock held. Other threads hand work over through the scheduler's inbox (an accepted
chunk, appended under the scheduler's batch lock) or a command (cancel a chunk, stop admission,
under the driver's lock), each a single append, and wait on the lock's condition only where they
must wait (for room, for a result). The chunk in the inbox that small items share takes items
under the batch lock alone too (docs/design.md, "Accepting without the driver's lock" and "Items
sharing a chunk"), so that a request need not wait for a step. A KeyboardInterrupt raised in a user's thread therefore lands
either before the hand-off (nothing happened) or after it (the work is the driver's and is
carried out whole): no stage change is ever half made.

A :class:`~ringflow.Pipeline` gets a progress thread, so work advances while the user's own
code runs and its futures complete by themselves. A whole-array call (``stream_map``,
``MapJob``) blocks its caller until the job is done, so the caller drives: there is nothing
for another thread to overlap with.

On the simulated GPU the progress thread advances virtual time only while some thread waits on
the pipeline (``result()``, ``map()``, a full ``submit()``, ``close()``, a future someone waits on
through ``concurrent.futures`` or asyncio), and stops as soon as every wait is satisfied: with
one submitting thread the virtual timeline is the same on every run.
"""

from __future__ import annotations

import _thread
import atexit
import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Optional

from .._device import device_label
from .._device.protocol import MAX_SIM_SECONDS
from .._errors import DeviceError, HazardError
from .reentry import run_counted, stalled_stage_calls
from .sigint import ShieldedCondition, checkpoint, interrupt_pending, shielded, shielding_here

logger = logging.getLogger(__name__)

_POLL_S = 0.05  # the longest a driver waits on a real device before looking at its deadlines again
# On the simulated GPU a wait's length is virtual: simulating it costs the real time of the
# operations it runs through, however long it lasts, and no Ctrl-C or deadline comes in between
# but at the instants the wait itself reaches. Looking again every _POLL_S of virtual time
# would cost a scheduler step per 50 ms of a kernel's duration (a kernel said to take a day:
# over a million steps), so there a wait lasts until a fence completes, a deadline comes, or
# this long has passed.
_SIM_POLL_S = 3600.0
# how long interpreter exit waits, in all, for the progress threads of pipelines left open to
# cancel their work and end (seconds)
_EXIT_WAIT_S = 5.0
# how long (device host clock, seconds) a progress thread that died waits for the work its
# pipeline had enqueued to complete before it gives the memory that work may write up for lost
# (Scheduler.end_after_death): close() waits for this clean-up, so it is bounded
_DEATH_WAIT_S = 5.0
# how long a wait may find every slot a compute writes held by device results not yet released
# before the thread says so (only the results' holder can end that wait)
_HELD_WARN_S = 5.0
# how long an ending (close(), cancel(), leaving a with block) may wait while a stage call of the
# pipeline (or a done-callback of its futures) that began as long ago has not returned before it
# says so (wall-clock seconds): only the user's code returning ends that wait
_STALLED_WARN_S = 10.0


def _look_for_stalled(owner: Any, call: str, began: float, warned: set) -> None:
    """Log one warning naming the stage calls (and done-callbacks) of ``owner`` that have run for
    :data:`_STALLED_WARN_S` seconds or more, once ``call`` (an ending, which began at ``began``,
    :func:`time.monotonic`) has waited that long; ``warned``: the calls already named, skipped
    (and added to)."""
    now = time.monotonic()
    if now - began < _STALLED_WARN_S:
        return
    running = dict(getattr(owner, "running", {}))  # (copied in C: no other thread changes it meanwhile)
    stalled = sorted((since, number, stage, index) for number, (stage, index, since) in running.items()
                     if number not in warned and now - since >= _STALLED_WARN_S)
    if not stalled:
        return
    warned.update(number for _, number, _, _ in stalled)
    shown = ", ".join(f"{stage}{'' if index is None else f' of item {index}'} (running for {now - since:.0f} s)"
                      for since, _, stage, index in stalled)
    logger.warning(
        "%s has waited %.0f s for the pipeline's %s to return; the pipeline cannot end until it has, and a call "
        "running on a thread cannot be stopped (cancel() does not interrupt it, and a thread cannot be killed). "
        "To end the wait, make the stage return (a timeout on the lock or socket it waits on); with "
        "processes=True, cancel() kills the worker processes running a prepare. Ctrl-C on the main thread gets "
        "out of the wait, and the pipeline then ends as the stage returns",
        call, now - began, shown)


@contextlib.contextmanager
def warn_if_stalled(owner: Any, call: str):
    """While the block runs (``call``, an ending that waits for the pipeline's stage calls to
    return), a daemon thread looks every quarter of :data:`_STALLED_WARN_S` for calls of
    ``owner`` that do not return (:func:`_look_for_stalled`). It ends as the block is left, however
    it is left; the block's waits are not touched."""
    done = threading.Event()
    began, warned = time.monotonic(), set()

    def watch() -> None:
        while not done.wait(_STALLED_WARN_S / 4):
            _look_for_stalled(owner, call, began, warned)

    try:
        # (started inside the try: a Ctrl-C as it starts still ends it)
        threading.Thread(target=watch, name="ringflow-stall-watch", daemon=True).start()
        yield
    finally:
        done.set()


class WakeFlag:
    """What :class:`threading.Event` gives the driver (``set``, ``clear``, ``is_set``,
    ``wait(timeout)``, for one waiting thread at a time), with a ``set`` that takes no Python-level
    lock. A dropped device result's finaliser sets it, and the collector may run that finaliser
    on a thread that is inside this very flag's ``set``, ``clear`` or ``wait``: an Event's
    condition lock, taken again there, waited for itself for ever. Here a set is a store and the
    release of a plain C lock that the waiter blocks on."""

    __slots__ = ("_flag", "_gate")

    def __init__(self) -> None:
        self._flag = False
        self._gate = threading.Lock()
        self._gate.acquire()  # taken: nothing to wake for

    def set(self) -> None:
        self._flag = True
        try:
            self._gate.release()
        except RuntimeError:  # already released: a wake is pending
            pass

    def is_set(self) -> bool:
        return self._flag

    def clear(self) -> None:
        self._flag = False
        self._gate.acquire(blocking=False)  # consume a pending wake (a set after this re-arms it)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until set or ``timeout`` seconds pass (may return early: callers look again);
        returns whether it is set."""
        if self._flag:
            return True
        if self._gate.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            self._gate.release()  # leave the wake pending until clear(), as an Event stays set
        return self._flag


class ThreadEnded(RuntimeError):
    """A command handed to a progress thread that has ended, or a wait that only it could have
    ended: nothing will run or end it."""


class Command:
    """Work a user thread hands to the driver: run under the lock by the driving thread, which
    then calls ``then(command)`` if one was given (:meth:`ProgressThread.post`)."""

    __slots__ = ("fn", "token", "done", "value", "error", "out_token", "then")

    def __init__(self, fn: Callable[[], Any], token: Any, then: Optional[Callable[["Command"], Any]] = None):
        self.fn, self.token, self.then = fn, token, then
        self.done = False
        self.value = self.error = self.out_token = None

    def finish(self) -> None:
        """Mark it carried out (its value or error set) and tell whoever posted it."""
        self.done = True
        if self.then is not None:
            try:
                self.then(self)
            except Exception:  # noqa: BLE001 - the poster's hand-back (an event loop that closed meanwhile)
                logger.debug("a posted command's hand-back failed", exc_info=True)


def resolve(batch: list) -> None:
    """Run the done-callbacks of futures set under the lock (they run user code, so outside it).

    A callback's error is logged with its traceback and the future's later callbacks still run,
    as :class:`concurrent.futures.Future` does for an ``Exception``; here for a
    ``BaseException`` too: a KeyboardInterrupt or SystemExit raised in a callback on the
    progress thread would otherwise end the thread, and with it every later call on the
    pipeline. (A Ctrl-C itself is delivered to the main thread, never to this one.)

    Each call is counted as its pipeline's stage calls are (:func:`.reentry.run_counted`): an
    ending that Ctrl-C stopped does not wait for a callback that does not return, as it does not
    wait for such a stage (:meth:`ProgressThread.join_unless_stalled`)."""
    for fut in batch:
        callbacks = fut._done_callbacks
        if not callbacks:
            continue
        owner = fut._driver.sched.stage_owner
        for callback in callbacks:
            try:
                run_counted(owner, callback, fut, index=fut.index)
            except BaseException:  # noqa: BLE001 - the user's error, logged; the pipeline carries on
                logger.exception("a done-callback of %r raised; the pipeline carries on", fut)


# The message of a CancelledError for a chunk cancelled because its pipeline was collected
# (rf.Pipeline(f).submit(x) drops the pipeline as soon as submit returns).
DROPPED = ("the Pipeline was garbage-collected while this chunk was in flight, which cancels its work: keep a "
           "reference to the pipeline until its results are taken (with rf.Pipeline(...) as pipe: ...)")


# On the simulated GPU the progress thread keeps the driver's lock through a stage whenever a step's
# host call runs one (the device runs a host task's callable on the thread that advances it): a
# prepare that never returns kept every call on the main thread that takes that lock (close(),
# submit(), a future's result(), map, stats()) waiting for it for ever, its Ctrl-C held back.
class Hold:
    """The driver's lock as a call from a user's thread holds it: ``with driver.hold() as hold:``.
    Taken at once where it is free; else, on the main thread in a shielded call (a Ctrl-C there
    waits for a checkpoint), the take, and every wait given the hold inside the block, may give
    the lock up to a Ctrl-C that comes while another thread keeps it: KeyboardInterrupt is raised
    without the lock, :attr:`held` is False, and leaving the block lets nothing go."""

    __slots__ = ("driver", "held")

    def __init__(self, driver: "_Driver"):
        self.driver = driver
        self.held = False

    def __enter__(self) -> "Hold":
        driver = self.driver
        if not driver.lock.acquire(False):  # (free nearly always: one try, no poll)
            driver.take_lock()
        self.held = True
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self.held:
            self.held = False
            self.driver.lock.release()


class _Driver:
    """The lock, the waits and the commands both drivers share."""

    # whether a hold's take and waits on the main thread give the lock up to a Ctrl-C (another
    # thread may keep it through a stage: only a progress thread)
    interruptible = False

    def __init__(self, sched):
        self.sched = sched
        self.device = sched.device
        self.lock = threading.RLock()  # the pipeline's lock, cv's (its C methods, for a try without waiting)
        self.cv = threading.Condition(self.lock)
        # the condition of every future this driver resolves (ChunkFuture): taken under cv, never
        # the other way round, and never waited on
        self.future_condition = ShieldedCondition()
        self.commands: collections.deque[Command] = collections.deque()
        self.interest: list = []  # [predicate, deadline] of every wait in progress
        self.timed: list = []  # those of them with a deadline (few: scanned every turn)
        self.wake = WakeFlag()
        # flags of threads waiting on several pipelines at once (a submit over several devices):
        # each is set whenever this driver wakes its own waiters, as a wait on cv would be woken
        self.watchers: list = []
        self._stepper: Any = None  # the thread that last drove the scheduler, and what it had seen
        # what killed the progress thread (see died()); a caller-driven job's errors reach its caller
        self.failure: Optional[BaseException] = None
        self._stepper_token: Any = None
        self._held: tuple = ()  # the chunks whose device results held every slot, when a wait last saw them
        self._held_since: Optional[float] = None  # (monotonic) since when waits have seen them, without a break
        self._held_warned = False
        self._owed = 0.0  # real seconds waited for a release that the simulated clock has not yet passed

    def take_over(self) -> None:
        """The calling thread is about to drive the scheduler (lock held): order it after all the
        previous driving thread did and saw (its completions observed, its operations enqueued)."""
        me = threading.get_ident()
        if self._stepper != me:
            if self._stepper is not None:
                self.device.observe(self._stepper_token)
            self._stepper = me

    def hand_back(self) -> None:
        """The calling thread stops driving for now (lock held): leave a token for the next one."""
        self._stepper_token = self.device.publish()

    def notify_waiters(self) -> None:
        """Wake every thread waiting on the pipeline (lock held): those waiting on cv, and those
        watching it with a flag of their own (:meth:`watch`)."""
        self.cv.notify_all()
        if self.watchers:  # (every turn calls this; a watcher is rare)
            for flag in list(self.watchers):
                flag.set()

    # -- used by any thread ----------------------------------------------------------------
    def notify(self) -> None:
        """New work or a new wait: rouse the driver (from its lock wait or its device wait)."""
        self.wake.set()
        self.cv.notify_all()

    def watch(self, flag: WakeFlag, pred: Callable[[], bool], deadline: Optional[float]) -> list:
        """A thread that waits on several pipelines at once, without any one's lock, waits for
        ``pred`` on this one: ``flag`` is set whenever the driver wakes its waiters (a chunk
        ended, admission stopped, the driver died), and the driver advances as for a wait until
        ``pred`` holds or ``deadline`` (device clock) passes. Returns the entry to give
        :meth:`unwatch`. Takes no lock (list appends, and the wake flag)."""
        self.watchers.append(flag)
        entry = [pred, deadline]
        self.interest.append(entry)
        if deadline is not None:
            self.timed.append(entry)
        self.wake.set()
        return [flag, entry]

    def unwatch(self, watched: list) -> None:
        """Undo :meth:`watch`. Takes no lock; never raises."""
        flag, entry = watched
        for where, what in ((self.watchers, flag), (self.interest, entry), (self.timed, entry)):
            try:
                where.remove(what)
            except ValueError:
                pass

    def hold(self) -> Hold:
        """The lock, for a call from a user's thread (see :class:`Hold`)."""
        return Hold(self)

    def take_lock(self) -> None:
        """Take the lock for a :class:`Hold`. On the main thread in a shielded call, in polls: a
        Ctrl-C that comes while another thread keeps the lock is raised here, nothing taken."""
        lock = self.lock
        if not (self.interruptible and shielding_here()):
            lock.acquire()
            return
        while not lock.acquire(True, _POLL_S):
            checkpoint()

    def _wait_or_let_go(self, hold: Hold, timeout: float) -> None:
        """``cv.wait(timeout)`` for ``hold`` on the main thread in a shielded call, the lock taken
        back in polls: should a Ctrl-C come while another thread keeps it, the lock is given up
        and KeyboardInterrupt raised."""
        # Condition.wait itself takes an RLock back in C, in a wait that no signal ends, not even
        # a second Ctrl-C, whose handler raises
        cv, lock = self.cv, self.lock
        waiter = _thread.allocate_lock()
        waiter.acquire()
        cv._waiters.append(waiter)  # type: ignore[attr-defined]
        count, _owner = lock._release_save()  # type: ignore[attr-defined]
        try:
            waiter.acquire(True, timeout)  # (a notify releases it)
        finally:
            try:
                self._take_back(hold, count)
            finally:
                try:
                    cv._waiters.remove(waiter)  # type: ignore[attr-defined]
                except ValueError:  # notified: the notifier took it off
                    pass

    def _take_back(self, hold: Hold, count: int) -> None:
        """Take the lock back ``count`` deep after a wait, in polls; give it up to a Ctrl-C (and
        raise) when this thread held it once only: held deeper, an enclosing block that is not
        the hold's would let go of a lock no longer held, so there it is taken back first."""
        lock = self.lock
        may_let_go = count == 1
        raised: Optional[BaseException] = None
        while True:
            try:
                taken = lock.acquire(True, _POLL_S)
            except BaseException as exc:  # noqa: BLE001 - a second Ctrl-C, raised by the handler
                if lock._is_owned():  # type: ignore[attr-defined]  # (as the take returned: it is held)
                    raised = raised or exc
                    break
                if may_let_go:
                    hold.held = False
                    raise
                raised = raised or exc
                continue
            if taken:
                break
            if may_let_go and interrupt_pending():
                hold.held = False
                checkpoint()  # raises
        for _ in range(count - 1):
            lock.acquire()
        if raised is not None:
            raise raised

    def command(self, fn: Callable[[], Any], hold: Optional[Hold] = None) -> Any:
        """Run ``fn`` on the driving thread with the lock held; returns its value or raises its
        error. The caller must hold the lock (``hold``: as a :class:`Hold`, whose wait may give
        it up to a Ctrl-C; ``fn`` is then run all the same, on the driving thread's next turn)."""
        cmd = Command(fn, self.device.publish())
        self.commands.append(cmd)
        self.notify()
        self.wait_for(lambda: cmd.done, None, hold=hold)
        self.device.observe(cmd.out_token)
        if cmd.error is not None:
            raise cmd.error
        return cmd.value

    def run_commands(self) -> bool:
        """Carry out the commands handed over so far (driving thread, lock held)."""
        if not self.commands:
            return False
        while self.commands:
            cmd = self.commands.popleft()
            self.device.observe(cmd.token)
            try:
                cmd.value = cmd.fn()
            except BaseException as exc:  # noqa: BLE001 - handed back to the thread that asked
                cmd.error = exc
            cmd.out_token = self.device.publish()
            cmd.finish()
        self.sched.version += 1  # their callers wait on cmd.done
        self.notify_waiters()
        return True

    def deadline_of(self, timeout: Optional[float]) -> Optional[float]:
        return None if timeout is None else self.device.now + timeout

    def device_wait(self, deadline: Optional[float]) -> float:
        """How long (device clock) a wait on the device's fences may last before the driver
        looks at its deadlines and commands again: up to ``deadline``, and no longer than a
        poll (on a real device :data:`_POLL_S`, on the simulated GPU :data:`_SIM_POLL_S`)."""
        poll = _SIM_POLL_S if self.device.backend == "sim" else _POLL_S
        return poll if deadline is None else max(0.0, min(poll, deadline - self.device.now))

    def drive_here(self, pred: Callable[[], bool], timeout: Optional[float], what: str) -> None:
        """The calling thread drives the scheduler until ``pred()`` holds (lock held). Raises
        TimeoutError after ``timeout`` seconds of the device's host clock."""
        deadline = self.deadline_of(timeout)
        self.take_over()
        try:
            self._drive(pred, deadline, timeout, what)
        finally:
            self.hand_back()

    def _drive(self, pred, deadline, timeout, what) -> None:
        sched = self.sched
        while True:
            checkpoint()  # a Ctrl-C in a whole-array call stops it between two steps (sigint.py)
            self.run_commands()
            resolve(sched.take_resolved())
            if pred():
                return
            try:
                stepped = sched.step()
            except BaseException as exc:  # noqa: BLE001 - raised again, after the driver's own clean-up
                self.step_died(exc)
                raise
            if stepped:
                resolve(sched.take_resolved())
                continue
            if pred():
                return
            if deadline is not None and self.device.now >= deadline:
                raise concurrent.futures.TimeoutError(f"timed out after {timeout} s waiting for {what}")
            fences = sched.pending_fences()
            if not fences:
                held = sched.held_by_results() if sched.lent else ()
                if held:  # (a done-callback waiting on the progress thread: another thread may release)
                    self._warn_if_held(held, waiting=True)
                    waited = self._wait_for_release(self.device_wait(deadline))
                    self._pass_owed_time(waited)
                    continue
                if sched.has_queued_work():
                    continue  # a slot is free now; the next step starts it
                raise RuntimeError("the pipeline is idle but the awaited result can never arrive "
                                   "(nothing is in flight); this is a ringflow bug")
            try:
                self.device.wait_any(fences, timeout=self.device_wait(deadline))
            except DeviceError as err:
                if not err.sticky:
                    raise
                sched.break_on(err)

    def step_died(self, exc: BaseException) -> None:
        """A scheduler step this thread ran in :meth:`drive_here` raised ``exc`` (lock held).
        Here it goes on up: on the progress thread its body ends the pipeline (:func:`_run`).
        A whole-array call's driver ends it here (:meth:`CallerDriver.step_died`)."""

    def died(self) -> BaseException:
        """What a thread waiting on the pipeline raises once its driver has died of
        :attr:`failure` (the caller chains it ``from`` that error). A hazard the simulated GPU's
        checker found may be the user's own ordering (a stream of their own, a result released
        on the wrong stream), so it says what to change and stays a HazardError; so does a device
        that was closed while the pipeline ran (the caller's close, on any thread); anything else
        is a ringflow bug."""
        failure = self.failure
        if getattr(self.device, "closed", False):
            # every step after the close raises the device's own "closed" error: that is what
            # stopped the pipeline, whatever it was doing at the time
            return RuntimeError(
                f"the pipeline's device {device_label(self.device)} was closed while the pipeline ran, so the "
                f"items it had not finished failed ({failure!r}): close the pipeline (or wait for its results) "
                "before closing its device")
        if isinstance(failure, HazardError):
            return HazardError(
                f"the simulated GPU's checker stopped the pipeline: {failure}. If either access is your "
                "code's (a compute or consumer that launches on a stream of its own, or a device result "
                "released on another stream than the one that read it: pass that stream as "
                "release(stream=...)), order it as said; if both are the pipeline's own, this is a "
                "ringflow bug", failure.first, failure.second)
        who = "progress thread" if self.background else "driver (the thread of a whole-array call)"
        return RuntimeError(f"the pipeline's {who} died: {failure!r}; this is a ringflow bug")

    def die(self, exc: BaseException) -> list:
        """The driving thread dies of ``exc`` (a ringflow bug, maybe half way through a step; lock
        held): every later wait raises :meth:`died`, and the scheduler cleans up after it
        (:meth:`Scheduler.end_after_death`: its chunks end FAILED, each holding its slots and
        pooled blocks until the work enqueued on them is seen complete, or keeping them for good:
        a block handed back while a copy into it is pending would go to another taker, whose
        data the copy then overwrites). Bounded by :data:`_DEATH_WAIT_S` of the device's clock.
        Returns the futures still not done (:meth:`fail_orphans` fails them)."""
        self.failure = exc
        err = self.died()
        err.__cause__ = exc
        self.sched.end_after_death(err, _DEATH_WAIT_S)
        return self.sched.unended_futures()

    def fail_orphans(self, orphans: list) -> None:
        """Fail every future :meth:`die` left not done with the driver's death (one awaited
        through asyncio, ``concurrent.futures.wait`` or a done-callback has no waiter in the
        pipeline that would see the failure)."""
        for fut in orphans:
            err = self.died()
            err.__cause__ = self.failure
            try:
                fut._put_error(err)
            except concurrent.futures.InvalidStateError:
                pass  # done meanwhile (cancelled by its caller)

    def _warn_if_held(self, held: list, waiting: bool) -> None:
        """Log a warning, and issue it as a :class:`RuntimeWarning`, once waits have found the same
        device results holding every slot for :data:`_HELD_WARN_S` (wall-clock) seconds in a row:
        a thread that waits for more results while keeping these waits for ever unless another
        thread releases them. ``waiting``: someone waits now (the clock restarts whenever nobody
        does)."""
        key = tuple(held)
        now = time.monotonic()
        if not waiting:
            self._held_since = None
            return
        if key != self._held:
            self._held, self._held_since, self._held_warned = key, now, False
            return
        if self._held_warned:
            return
        if self._held_since is None:
            self._held_since = now
            return
        if now - self._held_since < _HELD_WARN_S:
            return
        self._held_warned = True  # once for these results
        shown = ", ".join(map(str, held[:8])) + (", ..." if len(held) > 8 else "")
        message = (f"a wait on the pipeline has found every device slot held for {_HELD_WARN_S:.0f} s by results "
                   f"delivered on the device and not yet released (chunks {shown}); nothing more can be computed "
                   f"until one is: release each result once done with it (`with res as y:`, res.release(stream), "
                   f"or drop it), or cancel() the pipeline")
        logger.warning("%s", message)
        # the library's logger has only a NullHandler: without a warning too, nobody who has not
        # set up logging would learn why the wait never ends
        try:
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        except Exception:  # noqa: BLE001 - warnings made errors (-W error): the driver must go on; the log has it
            pass

    def _wait_for_release(self, longest: float) -> float:
        """Every slot is held by device results not yet released and a wait is on: only another
        thread's release, which sets the wake flag, can end it. Wait for one for up to
        ``longest`` seconds of the device's clock (real time, at most a poll interval); returns
        the real seconds waited."""
        t0 = time.monotonic()
        self.wake.wait(max(0.0, min(longest, _POLL_S)))
        self.wake.clear()
        return time.monotonic() - t0

    def _pass_owed_time(self, seconds: float) -> None:
        """On the simulated GPU, let virtual time pass as much as real time did while a wait
        waited for a release: a release from another thread comes in real time, so a timeout
        there comes as on a GPU, neither at once (the clock jumping to the deadline) nor never
        (the clock standing still). Elsewhere the device's clock is real time already."""
        if seconds > 0 and self.device.backend == "sim":
            self.device.sleep(seconds)


def _awaited(sched) -> bool:
    """Whether a future of an unended chunk has a done-callback or a waiter (an asyncio await, an
    ``asubmit`` or ``amap``, ``concurrent.futures.wait``): someone waits through it. A real GPU's
    progress thread keeps no record of such waits (:meth:`ChunkFuture.add_done_callback`), so
    while device results hold every slot it looks at the futures (few: at most the chunks in
    flight), for the warning that only a release can end those waits. Lock held."""
    return any(fut._done_callbacks or fut._waiters for fut in sched.unended_futures())


class CallerDriver(_Driver):
    """The waiting thread drives: each wait runs the scheduler until its condition holds."""

    background = False

    def wait_for(self, pred: Callable[[], bool], timeout: Optional[float], what: str = "the pipeline",
                 hold: Optional[Hold] = None) -> None:
        """Drive until ``pred()`` holds (lock held). Raises TimeoutError after ``timeout`` seconds
        of the device's host clock; once a step has raised (:meth:`step_died`), the error
        :meth:`died` gives, at once. (``hold``: no other thread takes this driver's lock, so it
        is never given up.)"""
        if self.failure is not None:
            raise self.died() from self.failure
        self.drive_here(pred, timeout, what)

    def step_died(self, exc: BaseException) -> None:
        """A step raised ``exc`` (lock held): the scheduler's state is whatever the step left, so
        it is not stepped again. Cleans up as a progress thread that died does (:meth:`die`), on
        this thread, before the call sees the error: once it raises, nothing enqueued still
        writes the memory its chunks handed back. The call then raises ``exc`` itself: it may
        be ringflow's own failure or the caller's (a device closed under the call)."""
        self.fail_orphans(self.die(exc))

    def close(self) -> None:
        pass


class ProgressThread(_Driver):
    """A daemon thread that runs the scheduler whenever there is work, and sleeps otherwise.

    It holds no reference to the pipeline object, only to the scheduler: a pipeline dropped
    without ``close()`` is collected, and its finaliser sets :attr:`abandoned`; the thread then
    cancels what is left, releases the scheduler's resources and ends."""

    background = True
    interruptible = True

    def __init__(self, sched, *, name: str):
        super().__init__(sched)
        self.gated = self.device.backend == "sim"  # see the module's doc
        self.stopping = False
        self.abandoned = False
        # the pipeline's end was handed to this thread (hand_over): it cancels what is left (once:
        # cancel_handed_over), closes the scheduler once the rest has ended, and ends
        self.handed_over = False
        self.cancel_handed_over = False
        self.ended = False  # the thread has run its last turn: posted commands are refused
        self.gone = threading.Event()  # set as the thread's body returns (see _join)
        self._seen_version = -1
        self._unstepped = False  # the last turn did not step: nobody waited on the simulated GPU
        self.final_token: Any = None
        # a step that raised in a done-callback's wait on this thread (step_died): the thread
        # dies of it once the callbacks have returned
        self.step_failure: Optional[BaseException] = None
        sched.wake_driver = self.wake.set  # a result released on the device: its slot is waiting
        self.thread = threading.Thread(target=_run, args=(self,), name=name, daemon=True)
        self.thread.start()
        _RUNNING.add(self)

    def step_died(self, exc: BaseException) -> None:
        """A step raised ``exc`` (a ringflow bug) in a done-callback's wait on this thread: the
        error goes up through the callback, which may swallow it (its errors are only logged), so
        it is kept, every later wait on this thread refuses, and the thread dies of it as soon
        as the callbacks have returned (:meth:`step_once`), as of a step of its own."""
        if self.step_failure is None:
            self.step_failure = exc

    # -- waits, from user threads ------------------------------------------------------------
    def wait_for(self, pred: Callable[[], bool], timeout: Optional[float], what: str = "the pipeline",
                 hold: Optional[Hold] = None) -> None:
        """Block (lock held, released while waiting) until ``pred()`` holds; on the progress
        thread itself (a done-callback waiting on the pipeline) drive the scheduler here instead.
        Raises TimeoutError after ``timeout`` seconds of the device's host clock (virtual on the
        sim). ``hold``: the caller holds the lock as that :class:`Hold`, which the wait may give
        up to a Ctrl-C. On the main thread in a shielded call each wait lasts at most a poll."""
        if pred():
            return
        if threading.current_thread() is self.thread:
            # a done-callback (they run on this thread) waits for the pipeline: submit() on a
            # full pipeline, result() of a pending chunk, cancel(), close(). No other thread
            # would advance it, so this one drives it here, as a whole-array call's caller does
            if self.step_failure is not None:  # a step died in an earlier wait: never step again
                raise RuntimeError(f"the pipeline's progress thread is dying: {self.step_failure!r}; this is a "
                                   "ringflow bug") from self.step_failure
            self.drive_here(pred, timeout, what)
            return
        deadline = self.deadline_of(timeout)
        # a Ctrl-C on a shielded main thread is only recorded, and raised at the next turn's
        # checkpoint: a wait for a notify that never comes (the progress thread in a stage that
        # does not return) would never reach it, on the simulated GPU too
        shielding = shielding_here()
        entry = [pred, deadline]
        self.interest.append(entry)
        if deadline is not None:
            self.timed.append(entry)
        self.notify()
        try:
            while not pred():
                checkpoint()  # a Ctrl-C on the main thread is taken here, between two waits (sigint.py)
                if self.failure is not None:
                    raise self.died() from self.failure
                if self.gone.is_set():
                    # the thread has ended: a command handed over since is refused, and any other
                    # wait can only be for what it will never do
                    self.refuse_commands()
                    if not pred():
                        raise ThreadEnded(f"the pipeline's progress thread has ended; nothing will end the "
                                          f"wait for {what}")
                    break
                if deadline is not None and self.device.now >= deadline:
                    raise concurrent.futures.TimeoutError(f"timed out after {timeout} s waiting for {what}")
                if deadline is None or self.gated:
                    wait = _POLL_S if shielding or not self.gated else None
                else:
                    wait = max(0.0, min(_POLL_S, deadline - self.device.now))
                if hold is not None and shielding:
                    self._wait_or_let_go(hold, wait)
                else:
                    self.cv.wait(wait)
        finally:
            self.interest.remove(entry)
            if deadline is not None:
                self.timed.remove(entry)
        # and once more as the wait ends: a Ctrl-C that came while the last wait ran is raised
        # before the caller takes what it waited for (a map's next result stays in the pipeline
        # rather than being taken and then lost to the interrupt)
        checkpoint()

    def post(self, fn: Callable[[], Any], then: Callable[[Command], Any]) -> None:
        """Hand ``fn`` over as :meth:`command` does, but without the lock and without waiting: for
        a thread that must not wait for a step (an event loop's). ``then(command)`` is called on
        the progress thread, lock held, once ``fn`` ran (its value or error set); if the thread has
        ended, with ``fn`` not run and a RuntimeError as its error, on whichever thread sees that
        (without the lock)."""
        with shielded():  # Event.set runs threading code: a Ctrl-C there would leave its lock taken
            self.commands.append(Command(fn, self.device.publish(), then))
            self.wake.set()
        if self.ended:  # (set before the thread's last look at the commands: none is left behind)
            self.refuse_commands()

    def refuse_commands(self) -> None:
        """Once the thread has ended: hand back every command still posted, not run."""
        while True:
            try:
                cmd = self.commands.popleft()
            except IndexError:
                return
            cmd.error = ThreadEnded("the pipeline's progress thread has ended")
            cmd.finish()

    def add_interest(self, pred: Callable[[], bool]) -> list:
        """Someone waits for ``pred`` outside the pipeline's own calls (a future's waiter or
        done-callback): the thread may advance until it holds (on the simulated GPU, which
        alone asks: see :attr:`gated`). Returns the entry to drop.
        Takes no lock (it runs under a future's lock, which the progress thread takes while
        holding its own): a list append, and the wake flag."""
        entry = [pred, None]
        self.interest.append(entry)
        self.wake.set()
        return entry

    def drop_interest(self, entry: list) -> None:
        try:
            self.interest.remove(entry)
        except ValueError:
            pass

    def someone_waits(self) -> bool:
        now = None
        for pred, deadline in list(self.interest):
            if pred():
                continue
            if deadline is not None:
                now = self.device.now if now is None else now
                if now >= deadline:
                    continue
            return True
        return False

    def _deadline_passed(self) -> bool:
        deadline = self.next_deadline()
        return deadline is not None and self.device.now >= deadline

    def next_deadline(self) -> Optional[float]:
        timed = self.timed
        if not timed:  # (asked twice a turn, and most waits have no deadline)
            return None
        return min((d for _, d in list(timed)), default=None)

    def abandon(self) -> None:
        """The pipeline was dropped without ``close()``: have the thread cancel, drain, release and
        end. Never blocks (a finaliser may run on any thread, this one included)."""
        self.abandoned = True
        self.wake.set()

    def hand_over(self) -> None:
        """The pipeline's end is this thread's from now on (an ending that Ctrl-C stopped will not
        wait for it): the thread cancels what is left, closes the scheduler once the rest has
        ended, and ends. Takes no lock: the caller may have given it up to the Ctrl-C while this
        thread kept it through a stage. Never raises."""
        self.cancel_handed_over = True  # (before stopping: a turn reads stopping first, so sees these)
        self.handed_over = True
        self.stopping = True
        self.wake.set()

    def join_unless_stalled(self) -> bool:
        """After :meth:`hand_over`: wait for the thread to end, unless a stage call of the pipeline,
        or a done-callback of its futures, runs through a whole poll of the wait. Returns whether
        it ended; if so, the caller is ordered after all the thread did. Lock not held."""
        # a stage or callback on a thread cannot be stopped, and the thread ends only once they
        # have returned: one that does not return would keep this waiting, the interrupt held back
        if self.thread is threading.current_thread():
            return False  # (a done-callback's ending: the thread ends once its callbacks return)
        owner, seen = self.sched.stage_owner, None
        while True:
            if self._join(_POLL_S):
                self.device.observe(self.final_token)
                return True
            seen, stalled = stalled_stage_calls(owner, seen)
            if stalled:
                return False

    def join_handed_over(self) -> None:
        """After :meth:`hand_over`, for a later ``close()``: wait for the thread to end (for as
        long as a stage does not return), a Ctrl-C meanwhile raised within a poll and leaving the
        end handed over; then the caller is ordered after all the thread did. Lock not held."""
        if self.thread is threading.current_thread():
            return
        while not self._join(_POLL_S):
            checkpoint()
        self.device.observe(self.final_token)

    def close(self) -> None:
        """Stop the thread once the scheduler has nothing left to do; join it. Lock NOT held."""
        with self.cv:
            self.stopping = True
            self.notify()
        if self.thread is not threading.current_thread():
            self._join(None)
        self.device.observe(self.final_token)

    def _join(self, timeout: Optional[float]) -> bool:
        """Wait up to ``timeout`` seconds (None: for as long as it takes) for the thread to end;
        returns whether it has. Not on the thread itself."""
        # not Thread.join alone: on CPython 3.11 an exception that a signal handler raises inside
        # join() marks the thread stopped although it runs on (is_alive() is False from then on),
        # and the caller would free what the thread still uses. An Event's wait has no such flaw
        if not self.gone.wait(timeout):
            return False
        self.thread.join()  # (its body has returned: only the interpreter's end of the thread is left)
        return True

    # -- the thread ------------------------------------------------------------------------------
    def step_once(self) -> bool:
        """One turn of the loop; False when the thread should end."""
        sched, cv = self.sched, self.cv
        with cv:
            self.take_over()
            try:
                plan = self._plan_turn(sched)
                if plan is not None and plan[0] == "sleep":  # the sim: let virtual time reach a deadline
                    self.device.sleep(plan[1])
                    plan = (None, None, None)
            finally:
                self.hand_back()
            batch = sched.take_resolved()
            # wake the waiting threads only when what they wait for may have changed: a wake-up
            # that finds nothing costs a GIL hand-off (on the sim every step may matter to a test)
            if self.gated or plan is None or sched.version != self._seen_version or self._deadline_passed():
                self._seen_version = sched.version
                self.notify_waiters()
            if plan is None:
                return False
            idle, fences, wait = plan
            if idle is not None or fences:
                self.wake.clear()
                if (self.commands or (self._unstepped and self.someone_waits())
                        or (not self._unstepped and (sched.returns or sched.inbox_news_unseen()))):
                    # released, a chunk accepted without the lock, a copy into a shared chunk
                    # ended, a command posted, or (the simulated GPU, whose thread steps only
                    # while someone waits) a waiter registered, after this turn looked (their
                    # wake-up may have come before the clear):
                    # take it now. A turn that did not step (the simulated GPU with nobody
                    # waiting) would not take a release or a copy now either: turning again at
                    # once only spun, holding the GIL, until someone waited
                    idle, fences = None, None
        if batch:
            resolve(batch)
            if self.step_failure is not None:  # whatever the callback made of the error
                raise self.step_failure
        if idle == "release":  # device results hold every slot: wait for a release
            self._owed += self._wait_for_release(wait)
        elif idle is not None:
            self.wake.wait(idle)
        elif fences:
            try:
                self.device.wait_any(fences, timeout=wait, wake=self.wake)
            except DeviceError as err:
                if not err.sticky:
                    raise
                with cv:
                    sched.break_on(err)
        return True

    def _plan_turn(self, sched) -> "tuple | None":
        """Under the lock: run commands and one step; returns what to wait on next as
        ``(idle seconds or None, fences or None, device wait timeout)`` (idle ``"release"``: for
        a release of a device result, up to that timeout), or None to end."""
        if self._owed:
            owed, self._owed = self._owed, 0.0
            self._pass_owed_time(owed)
        self.run_commands()
        if self.abandoned and not self.stopping:
            self.stopping = True
            sched.cancel_reason = DROPPED
            sched.cancel_pending()
        # stopping is read before cancel_handed_over: hand_over() (no lock) sets them in the
        # other order, so a turn that sees stopping from it sees its cancel too, and the thread
        # never ends with admission still open
        stopping = self.stopping
        if self.cancel_handed_over:
            self.cancel_handed_over = False
            sched.cancel_pending()
        if stopping and sched.finished() and not sched.resolved:
            if self.abandoned or self.handed_over:
                sched.close()
            return None
        if self.gated and not (self.someone_waits() or self.stopping or sched.resolved):
            self._unstepped = True
            return 0.25, None, None
        self._unstepped = False
        if sched.step() or sched.resolved:
            return None, None, None
        fences = sched.pending_fences()
        deadline = self.next_deadline()
        now = self.device.now
        if not fences:
            held = sched.held_by_results() if sched.lent else ()
            if held:
                # only another thread's release can let a chunk on (it wakes the thread): no poll
                waiting = self.someone_waits() or (not self.gated and _awaited(sched))
                self._warn_if_held(held, waiting)
                if waiting or not self.gated:
                    return "release", None, self.device_wait(deadline)
            elif sched.has_queued_work():
                return 0.001, None, None
            if self.gated and deadline is not None and now < deadline and self.someone_waits():
                # nothing in flight: only time can pass, at most as long as one sleep may last
                # (a later turn sleeps on to a deadline further off)
                return "sleep", min(deadline - now, MAX_SIM_SECONDS)
            return (0.25 if self.gated else _POLL_S), None, None
        if deadline is not None and now >= deadline and self.gated and not self.someone_waits():
            return 0.25, None, None  # the only waits left have timed out
        return None, fences, self.device_wait(deadline)


_RUNNING: "weakref.WeakSet[ProgressThread]" = weakref.WeakSet()


@atexit.register
def _end_at_exit() -> None:
    """At interpreter exit, cancel the work of every pipeline left open and give its progress
    thread up to :data:`_EXIT_WAIT_S` (in all) to end. A daemon thread still running when the
    interpreter finalises is frozen where it stands, holding whatever lock it held then; the
    collector, running on the main thread afterwards (a pinned result's finaliser, say), would
    wait for that lock for ever. Never raises."""
    try:
        drivers = [d for d in list(_RUNNING) if d.thread.is_alive()]
        for d in drivers:
            d.abandon()
        deadline = time.monotonic() + _EXIT_WAIT_S
        for d in drivers:
            d.thread.join(max(0.0, deadline - time.monotonic()))
    except BaseException:  # noqa: BLE001 - exit goes on whatever happens here
        pass


def _run(driver: "ProgressThread") -> None:
    """The progress thread's body."""
    try:
        while driver.step_once():
            pass
        driver.final_token = driver.device.publish()
    except BaseException as exc:  # noqa: BLE001 - a ringflow bug: make every waiter raise it
        with driver.cv:
            # close() joins this thread: it returns after die()'s bounded wait
            orphans: list = []
            try:
                orphans = driver.die(exc)
            finally:
                driver.final_token = driver.device.publish()
                driver.notify_waiters()
        driver.fail_orphans(orphans)  # (outside the lock: their done-callbacks run here)
        resolve(driver.sched.take_resolved())
    finally:
        driver.ended = True
        try:
            driver.refuse_commands()
        finally:
            driver.gone.set()

