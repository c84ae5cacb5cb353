"""Host worker pools on the simulated clock.

A pool of ``workers`` lanes is a resource of the engine: a submitted task waits for a free
lane, runs its callable at the instant it starts (as a checker actor of its own that starts
from its submitter's clock, so its host views are ordered after what the submitter had seen and
after nothing else), and completes after its virtual duration: the
``sim_seconds`` given, else the time to copy ``nbytes`` at its share of the host copy rate for
the pool's tasks running at that instant, itself included (the device's share of its host's
rate, :class:`~.host.SimHost`; fixed when the task starts), plus whatever the callable charged
with :func:`charge`. A worker with nothing to do takes no share: a pool larger than the work
offered to it copies as fast as the tasks it actually runs allow, as real threads do.

:meth:`SimWorkerPool.host_work` stands for host work of the pool's submitter that a model
counts (the scheduler's time per chunk, a resource of its own beside the stages in the
planner's model): an op of that many seconds on a lane of the pool's own, one after another,
which the submitting thread does not wait for; a task submitted ``after`` it, or a stream's
later work once the stream waits for it (:meth:`SimStream.wait <.stream.SimStream.wait>`),
starts once it is done.
"""

from __future__ import annotations

import itertools
import threading
from typing import TYPE_CHECKING, Any, Callable

from ..protocol import HostTask, WorkerPool, check_seconds, check_workers
from .engine import Op

if TYPE_CHECKING:
    from .device import SimDevice

_ids = itertools.count(1)
_current = threading.local()  # the sim task running on this thread, if any


def charge(seconds: float) -> None:
    """Add ``seconds`` of virtual CPU time to the sim host task running now.

    Lets a test's prepare or consume callable stand for slow CPU work without sleeping; a
    no-op outside a simulated host task (so the same callable runs on a real GPU)."""
    seconds = check_seconds(seconds, "charge(seconds)")
    task = getattr(_current, "task", None)
    if task is not None:
        task._charged += seconds


class SimHostWork:
    """Host work of a pool's submitter on the simulated clock (:meth:`SimWorkerPool.host_work`)."""

    __slots__ = ("op", "dev")

    def __init__(self, op: Op, dev: "SimDevice"):
        self.op = op
        self.dev = dev

    @property
    def span(self) -> "tuple[float, float] | None":
        """(start, end) of its virtual time once done, else None."""
        op = self.op
        return None if op.done_at is None else (op.started_at, op.done_at)


class SimHostTask(HostTask):
    def __init__(self, pool: "SimWorkerPool", fn: Callable[..., Any], args: tuple, seconds: float | None,
                 nbytes: int, snapshot: dict):
        self._pool = pool
        self._fn = fn
        self._args = args
        self._seconds = seconds  # None: copying nbytes, timed when the task starts
        self._nbytes = nbytes
        self._submit_clock = snapshot
        self._end_clock: dict | None = None
        self._charged = 0.0
        self._value: Any = None
        self._exc: BaseException | None = None
        self.op: Op | None = None

    def __repr__(self) -> str:
        name = getattr(self._fn, "__name__", "task")
        return f"<SimHostTask {name} {'done' if self.op and self.op.done else 'pending'}>"

    def _run(self, op: Op) -> None:
        pool, dev = self._pool, self._pool._dev
        op.lane = pool._free_lanes.pop()  # the worker thread, for timing; the checker's actor is separate
        if self._seconds is None:
            busy = pool.workers - len(pool._free_lanes)
            per_thread = dev.host.copy_rate(dev, busy) / busy * 1e9
            self._seconds = dev.profile.host_task_overhead_s + self._nbytes / per_thread
        actor = None
        previous_actor = dev._tls_actor_override()
        try:
            actor = pool._take_actor(self._submit_clock)
            dev._checker.restart(actor, self._submit_clock)
            dev._set_actor_override(actor)
            _current.task = self
            self._value = self._fn(*self._args)
        except BaseException as exc:  # noqa: BLE001 - delivered by result()
            # the callable's own error, a hazard found in its accesses, or a fault of the sim
            # itself: each becomes the task's result, and the task still completes (an op that
            # never completes would leave every later wait, close included, hanging)
            self._exc = exc
        finally:
            _current.task = None
            dev._set_actor_override(previous_actor)
            if actor is not None:
                dev._checker.tick(actor)
                self._end_clock = dev._checker.snapshot(actor)
                pool._running_actors.discard(actor)
            else:
                self._end_clock = dict(self._submit_clock)
            op.remaining = dev._engine._jitter(self._seconds + self._charged)
            self._fn = self._args = None  # drop references once run

    def _done(self, op: Op) -> None:
        self._pool._free_lanes.append(op.lane)

    @property
    def is_done(self) -> bool:
        dev = self._pool._dev
        with dev._lock:
            dev._host_api(dev.profile.event_overhead_s)  # a query costs host time, so polling progresses
            if self.op.done:
                dev._checker_merge(self._end_clock)
                return True
            return False

    def sync(self) -> None:
        dev = self._pool._dev
        with dev._lock:
            dev._block_until(lambda: self.op.done, what=repr(self))
            dev._checker_merge(self._end_clock)

    @property
    def span(self):
        op = self.op
        return None if op is None or op.started_at is None else (op.started_at, op.done_at)

    def result(self) -> Any:
        if not self.op.done:
            raise RuntimeError(f"{self!r} is not done; wait for it (sync or wait_any) before asking its result")
        if self._exc is not None:
            raise self._exc
        return self._value


class SimWorkerPool(WorkerPool):
    models_host_work = True  # (host_work runs on the virtual clock)

    def __init__(self, dev: "SimDevice", workers: int):
        workers = check_workers(workers)
        self._dev = dev
        self.workers = workers
        self.id = next(_ids)
        self.actor_prefix = f"pool{self.id}"
        self._resource = f"host pool {self.id}"
        self._queue = dev._engine.add_queue(self._resource, resource=self._resource, lanes=workers)
        # the submitter's host work (host_work): one lane, in the order it is given
        self._host_resource = f"{self._resource} submitter"
        self._host_queue = dev._engine.add_queue(self._host_resource, resource=self._host_resource, lanes=1)
        self._free_lanes = list(range(workers - 1, -1, -1))
        # The checker's actors for this pool's tasks. A task takes one whose previous task its
        # submitter has seen finish (so the two really are ordered), else a new one: a task
        # never inherits the order of an unrelated task that happened to run on the same
        # thread before it, and the actors number at most the tasks ever unobserved at once.
        self._actors: list = []
        self._running_actors: set = set()
        self._closed = False

    def _take_actor(self, submit_clock: dict):
        checker = self._dev._checker
        for actor in self._actors:
            if actor not in self._running_actors and checker.has_seen(submit_clock, actor):
                break
        else:
            actor = (self.actor_prefix, len(self._actors))
            checker.add_actor(actor, f"host worker {len(self._actors)} of pool {self.id}")
            self._actors.append(actor)
        self._running_actors.add(actor)
        return actor

    def host_work(self, seconds: float) -> SimHostWork:
        seconds = check_seconds(seconds, "host_work(seconds)")
        with self._dev._lock:
            if self._closed:
                raise RuntimeError("this worker pool is closed; create a new one")
            return SimHostWork(self._dev._engine.enqueue(Op(self._host_queue, "submitter's host work",
                                                            resource=self._host_resource, seconds=seconds)),
                               self._dev)

    def submit(self, fn: Callable[..., Any], *args: Any, nbytes: int = 0, sim_seconds: float | None = None,
               after: "SimHostWork | None" = None) -> SimHostTask:
        dev = self._dev
        with dev._lock:
            if self._closed:
                raise RuntimeError("this worker pool is closed; create a new one")
            if not callable(fn):
                raise TypeError(f"submit needs a callable, got {type(fn).__name__}")
            if isinstance(nbytes, bool) or not hasattr(nbytes, "__index__") or nbytes < 0:
                raise ValueError(f"submit nbytes is the bytes the task copies: an int >= 0, got {nbytes!r}")
            nbytes = int(nbytes)
            if sim_seconds is not None:
                sim_seconds = check_seconds(sim_seconds, "submit sim_seconds")
            if after is not None and not (isinstance(after, SimHostWork) and after.op.queue is self._host_queue):
                raise ValueError(f"submit after= takes what this pool's host_work returned, got {after!r}")
            dev._host_api()
            snapshot = dev._checker.snapshot(dev._actor())
            dev._checker.tick(dev._actor())
            task = SimHostTask(self, fn, args, sim_seconds, nbytes, snapshot)
            task.op = dev._engine.enqueue(Op(self._queue, f"host task {getattr(fn, '__name__', 'fn')}",
                                             resource=self._resource, seconds=0.0,
                                             deps=[] if after is None or after.op.done else [after.op],
                                             on_start=task._run, on_complete=task._done))
            return task

    def close(self) -> None:
        if self._closed:
            return
        dev = self._dev
        with dev._lock:
            self._closed = True
            # a dead context runs nothing more, and a closed device completed every task as it closed
            if dev._sticky is not None or dev.closed:
                dev._engine.remove_queue(self._queue)
                dev._engine.remove_queue(self._host_queue)
                self._retire_actors()
                return
            busy = dev._engine._busy
            dev._block_until(lambda: not self._queue.pending and not busy[self._resource] and not
                             self._host_queue.pending and not busy[self._host_resource], what="worker pool drain")
            dev._engine.remove_queue(self._queue)
            dev._engine.remove_queue(self._host_queue)
            self._retire_actors()

    def _retire_actors(self) -> None:
        """Its tasks have all run: their checker actors make no more accesses."""
        for actor in self._actors:
            self._dev._checker.retire(actor)
        self._actors = []
