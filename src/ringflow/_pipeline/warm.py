"""Finished :func:`~ringflow.stream_map` pipelines kept warm for the next call of the same shape.

Setting an engine up and tearing it down (planning its slots, three streams, the device
rings, the slot objects) costs a large share of a short call's time when paid on every call
(docs/design.md has the measurements). So ``stream_map`` parks its engine here when the
call ends cleanly, and the next call with the same device, compute function, chunk size,
host strategy and options takes it back instead of building one (as PyTorch's caching
allocator keeps freed blocks).

Lifetimes, and why:

* A parked pipeline has finished everything: no chunk in flight, every slot FREE, nothing
  failed. Its device slots may still carry a ``ready`` event (the last use, possibly still
  running); the next owner's stream waits on it as within one call.
* Parking and taking are a hand-off between host threads (the cache's lock orders them): the
  parking thread publishes what it did and the taking thread observes it, so the simulated
  GPU's checker orders the next call, on any thread, after the last.
* Parking forgets the job: the stage callbacks (closures over the caller's arrays) and the
  caller's memory behind external rings are dropped, so a parked pipeline never keeps the
  caller's arrays alive. Nor does it keep the compute (:class:`ComputeRelay`): an engine made
  for the cache calls a relay whose target is the caller's ``f`` only while a call runs, and
  once the objects ``f``'s identity names are collected, the engine is closed at the cache's
  next use.
* At exit the cache closes what it holds, each ordered after its parking thread, before the
  pipelines' own finalisers run (those know nothing of the parking thread, and the simulated
  GPU's checker would see the close unordered with that thread's last writes).
* Only a device a later call can name is parked for: one given as a device object, a pool
  array's, or a named ``"sim:N"``. Any other spec, and None, make a new device on each call,
  whose engine no later call could take (:func:`~.whole_array._named_again`).
* At most ``capacity`` pipelines are parked per device, and ``capacity * MAX_DEVICES`` in
  all (least recently used are closed first): a call spread over several GPUs parks one per
  device. They hold their streams, device rings and pinned rings, which therefore count as
  live in ``device.live()`` until :func:`drop_warm_pipelines` (or eviction) closes them.
* What the pipelines parked for one device hold is bounded in bytes too: at most a
  ``PARKED_SHARE``-th of the device's memory and of the host's (:func:`parked_bytes_bound`),
  the least recently used closed first; the one parked last stays whatever its size (its call
  held as much). A call or a ``MapJob`` that cannot build its engine for want of memory closes
  the engines parked for its device and builds it once more (:func:`with_room`), so memory the
  cache holds never makes a call fail.
* Closing a device drops its parked pipelines then: the cache registers with each device it
  parks for (:meth:`~ringflow._device.protocol.Device.on_close`, once per device, with a
  callback that holds nothing of the device), so none is kept for a closed device. A pipeline
  parked on a device closed since is discarded when found all the same (one parked while the
  device was closing is dropped by the registration, which runs at once on a closed device).
"""

from __future__ import annotations

import atexit
import collections
import os
import threading
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable, Hashable, Optional

from . import reentry  # noqa: F401 - its fork hook runs before this module's (see _forget_in_child)
from .call_memo import MEMO
from .sigint import shielded

if TYPE_CHECKING:
    from .._device.protocol import Device
    from .api import Pipeline

DEFAULT_CAPACITY = 4
MAX_DEVICES = 8  # devices kept warm at once (a host's GPUs); beyond, the least recently used go
# the parked engines of one device hold at most this share of its memory and of the host's
PARKED_SHARE = 16


def parked_bytes_bound(device: "Device") -> tuple[int, int]:
    """``(pinned, device)``: the most bytes of pinned host memory and of device memory the
    engines parked for ``device`` may hold: a :data:`PARKED_SHARE`-th of the host's physical
    memory (1 GiB where the system does not say how much it has) and of the device's
    ``total_memory``."""
    from .._device import host_pool

    return host_pool.quarter_of_memory() * 4 // PARKED_SHARE, device.hardware.total_memory // PARKED_SHARE


class ComputeRelay:
    """The compute as an engine made for the cache calls it: ``target(x, y)``.

    Note (why a parked engine holds no compute): an engine built on the caller's ``f`` would
    keep ``f`` alive for as long as it is parked, and with it whatever ``f`` holds: the object
    of a bound method (``model.step``'s model, its weights on the GPU), a closure's variables.
    The engine calls this relay instead. Its ``target`` is the caller's compute while a call
    runs, and None while the engine is parked; the call that takes the engine back sets it to its
    own ``f``, which the cache's key says is the same object. While parked, the relay watches
    the objects of ``f``'s identity (:func:`~.call_memo.compute_identity`) by weak reference:
    once one is collected, a new object may take its identity, so the engine serves no later
    call and the cache closes it at its next use. An object that cannot be weakly referenced
    (a numpy ufunc) is held instead, as a module holds it anyway.

    What the engine reads of a compute is read through the relay: ``sim_seconds`` and
    ``pointwise`` from the target of the moment; a kernel's fast launch path
    (``__ringflow_launch__``), where the compute has one when the engine is made, calls the
    target's.
    """

    def __init__(self, f: Callable):
        self.target: Optional[Callable] = f
        self.__name__ = getattr(f, "__name__", type(f).__name__)
        self.__qualname__ = getattr(f, "__qualname__", self.__name__)
        if getattr(f, "_ringflow_writes_into_y", False):
            self._ringflow_writes_into_y = True
        if getattr(f, "__ringflow_launch__", None) is not None:
            self.__ringflow_launch__ = self._launch
        self._held: tuple = ()  # while parked: weak references to f's identity, or the objects

    def __call__(self, x: Any, y: Any) -> Any:
        return self.target(x, y)

    def _launch(self, *args: Any, **kwargs: Any) -> Any:
        return self.target.__ringflow_launch__(*args, **kwargs)

    @property
    def sim_seconds(self) -> Any:
        return getattr(self.target, "sim_seconds", None)

    @property
    def pointwise(self) -> Any:
        return getattr(self.target, "pointwise", False)

    def park(self, identity: tuple, collected: Callable[[], None]) -> None:
        """Let go of the target, watching the objects ``identity`` names: ``collected()`` is
        called (from the collector, on any thread: it must take no lock) when one of them goes."""
        held = []
        for obj in identity:
            try:
                held.append(weakref.ref(obj, lambda _ref: collected()))
            except TypeError:
                held.append(obj)
        self._held, self.target = tuple(held), None

    def bind(self, f: Callable) -> None:
        """Call ``f`` from now on (a call took the engine)."""
        self.target, self._held = f, ()

    def collected(self) -> bool:
        """Whether an object the parked relay watches has been collected."""
        return any(type(h) is weakref.ref and h() is None for h in self._held)


class WarmPipelines:
    """A small LRU of parked pipelines, keyed by everything that shapes one."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self.capacity = capacity
        self._lock = threading.Lock()
        # key -> (pipeline, the parking thread's hand-off token, its compute relay)
        self._parked: collections.OrderedDict[Hashable, tuple["Pipeline", Any, ComputeRelay]] = (
            collections.OrderedDict())
        # keys whose compute was collected while parked (appended by the collector, which must
        # not take the lock: it may run inside it)
        self._collected: collections.deque = collections.deque()
        self._drop_at_exit = False
        # devices whose close drops their parked pipelines (registered once each, see park)
        self._watched: "weakref.WeakSet[Device]" = weakref.WeakSet()

    def take(self, key: Hashable, f: Callable) -> "Optional[tuple[Pipeline, ComputeRelay]]":
        """The pipeline parked under ``key`` (removed from the cache) and its relay, now calling
        ``f``; or None. The calling thread is ordered after the thread that parked it."""
        with self._lock:
            gone = self._forget_collected()
            pipe, token, relay = self._parked.pop(key, (None, None, None))
        for entry in gone:
            _close(*entry[:2])
        if pipe is None:
            return None
        if pipe.device.closed:
            _close(pipe, token)
            return None
        pipe.device.observe(token)
        relay.bind(f)
        return pipe, relay

    def _forget_collected(self) -> list:
        """Take out the entries whose compute was collected (under the lock); returns them."""
        gone = []
        while self._collected:
            key = self._collected.popleft()
            entry = self._parked.get(key)
            if entry is not None and entry[2].collected():  # (not an entry parked since, under the key)
                gone.append(self._parked.pop(key))
        return gone

    def park(self, key: Hashable, pipe: "Pipeline", relay: ComputeRelay, identity: tuple) -> None:
        """Keep ``pipe`` (idle, already forgotten its job) for a later :meth:`take`; its
        ``relay`` lets go of the compute and watches the objects of its ``identity``."""
        token = pipe.device.publish()
        collected = self._collected
        relay.park(identity, lambda: collected.append(key))
        with self._lock:
            if not self._drop_at_exit:
                # registered after the first pipeline's finaliser, so it runs before them all
                # (atexit runs the last registered first)
                atexit.register(self.drop)
                self._drop_at_exit = True
            evicted = self._forget_collected()
            old = self._parked.pop(key, None)
            self._parked[key] = (pipe, token, relay)
            evicted += [old] if old is not None else []
            if len(self._parked) > 1:  # (else the newest, which stays, is all there is)
                evicted += self._over_bounds(pipe.device)
            while len(self._parked) > self.capacity * MAX_DEVICES:
                evicted.append(self._parked.popitem(last=False)[1])
            watch = pipe.device not in self._watched
            if watch:
                self._watched.add(pipe.device)
        for p, t, *_ in evicted:
            _close(p, t)
        if watch:
            # after the pipeline is parked and outside the lock: on a device closed meanwhile the
            # callback runs at once, here, and drops it (taking the lock)
            pipe.device.on_close(_device_closed)

    def _over_bounds(self, device: "Device") -> list:
        """Take out the least recently used entries of ``device`` while it has more than
        :attr:`capacity` or they hold more bytes than :func:`parked_bytes_bound`, keeping the
        newest; returns them. Under the lock."""
        same = [k for k, (p, *_) in self._parked.items() if p.device is device]  # oldest first
        if len(same) < 2:  # (the newest stays: no bound to read)
            return []
        bound = parked_bytes_bound(device)
        held = [self._parked[k][0].held_bytes() for k in same]  # (what a parked engine holds stays)
        pinned, device_bytes = sum(h[0] for h in held), sum(h[1] for h in held)
        gone = []
        while len(same) > 1 and (len(same) > self.capacity or pinned > bound[0] or device_bytes > bound[1]):
            gone.append(self._parked.pop(same.pop(0)))
            pinned, device_bytes = pinned - held[0][0], device_bytes - held[0][1]
            del held[0]
        return gone

    def drop(self, device: "Device | None" = None, *, label: Optional[str] = None) -> int:
        """Close the parked pipelines (of ``device`` only, or of the device ``label`` names as
        :func:`~ringflow._device.device_label` does, if given), and those of closed devices;
        returns how many."""
        from .._device import device_label

        # shielded (sigint.py): a Ctrl-C between taking the engines out and closing the last
        # would leave the rest to the garbage collector; it is raised once they are all closed
        with shielded() as shield:
            MEMO.drop(device, label=label)  # the plans remembered for its calls go with them (call_memo.py)
            with self._lock:
                # engines of a closed device serve no call (and a name such as "sim:N" names a
                # new device once it is closed): they go whatever is named
                gone = self._forget_collected()  # (closed too, but not counted: no one named them)
                keys = [k for k, (p, *_) in self._parked.items() if p.device.closed or (
                        (device is None or p.device is device) and (label is None or device_label(p.device) == label))]
                dropped = [self._parked.pop(k) for k in keys]
            if shield is not None:
                shield.settle()
            for p, t, *_ in gone + dropped:
                _close(p, t)
        return len(dropped)

    def __len__(self) -> int:
        return len(self._parked)


def with_room(device: "Device", build: Callable[[], Any]) -> Any:
    """``build()`` (an engine for ``device``); where the device has no memory left for it, once
    more after closing the engines kept for the device: what the cache holds never makes a call
    or a job fail.

    Raises:
        OutOfMemoryError: no memory for it even with none kept for the device.
    """
    from .._errors import OutOfMemoryError

    try:
        return build()
    except OutOfMemoryError:
        if not WARM.drop(device):
            raise
    return build()


def _device_closed(device: "Device") -> None:
    """A device closed: close what the cache keeps for it (its close callback; a module function,
    so the device's list of callbacks holds nothing of the cache's but this)."""
    WARM.drop(device)


def _close(pipe: "Pipeline", token: Any) -> None:
    """Close a pipeline taken out of the cache, on this thread (ordered after the parking one)."""
    try:
        with warnings.catch_warnings():
            if pipe.device.closed:  # its resources went with the device
                warnings.simplefilter("ignore")
            else:
                pipe.device.observe(token)
            pipe.close()
    except Exception as exc:  # noqa: BLE001 - dropping a cache entry never raises
        warnings.warn(f"closing a warm pipeline failed: {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2)


WARM = WarmPipelines()


def _forget_in_child() -> None:
    """After fork(), in the child: the parked engines are the parent's (their threads are not
    in the child, their device refuses it), so each is forgotten, touching nothing (dropped
    unforgotten, the collector would close the parent's pipelines from the child); the cache's
    lock may have been held by a parent's thread that is not in the child either. (Registered
    after :mod:`.reentry`'s count of forks, which each pipeline's forgetting reads.)"""
    WARM._lock = threading.Lock()
    WARM._watched = weakref.WeakSet()  # the parent's devices, which the child's calls cannot use
    MEMO.forget()  # its entries name the parent's devices
    parked, WARM._parked = WARM._parked, collections.OrderedDict()
    WARM._collected = collections.deque()
    for engine, *_ in parked.values():
        engine.forget_forked()


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork()
    os.register_at_fork(after_in_child=_forget_in_child)


def drop_warm_pipelines(device: "Device | str | None" = None) -> int:
    """Close the pipelines :func:`~ringflow.stream_map` keeps warm (for ``device``, or all; those
    of devices closed since go whatever is named) and release their streams and memory; returns
    how many were closed. Call it before checking
    ``device.live()`` for leaks, or to hand their memory back early.

    ``device`` may be a device, or a spec naming one device for the whole process: ``"sim:N"``
    (none is made where there is none yet) or ``"cuda:N"`` (the pipelines on GPU N).

    Raises:
        TypeError: ``device`` is neither None, a device nor such a spec (``"sim"`` and
            ``"auto"`` name no device whose pipelines are kept: each makes a new one).
    """
    from .._device import parse_spec
    from .._device.protocol import Device  # at call time: only a type name for this module otherwise

    if device is None or isinstance(device, Device):
        return WARM.drop(device)
    if isinstance(device, str):
        try:
            kind, index = parse_spec(device)
        except ValueError:
            kind, index = "", None
        if index is not None:  # "sim:N" is one device per process, "cuda:N" one GPU
            return WARM.drop(label=f"{kind}:{index}")
    # what is left of the specs, "sim" and "auto", make a new device each
    spec = (f"; a spec such as {device!r} makes a new device, which has none: pass the device object the "
            "calls ran on, or a named one such as 'sim:0' or 'cuda:0'") if isinstance(device, str) and kind else ""
    raise TypeError(f"drop_warm_pipelines(device=...) takes a ringflow Device, a spec naming one ('sim:N', "
                    f"'cuda:N') or None (every device), got {type(device).__name__} {device!r:.60}{spec}")


def options_key(options: dict[str, Any]) -> Optional[Hashable]:
    """A hashable form of the pipeline options, or None when they cannot be keyed (then the
    pipeline is not kept)."""
    try:
        key = tuple(sorted(options.items()))
        hash(key)
    except TypeError:
        return None
    return key
