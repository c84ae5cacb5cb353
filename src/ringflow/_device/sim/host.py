"""The host that simulated GPUs share: its memory's copy rate, and the host memory it has pinned.

GPUs of one host each have a link of their own, but every host copy (a worker staging a chunk
into pinned memory, a thread copying an item) goes through the one host memory. The profile's
rate for host copies beside the GPU's (``HardwareProfile.staging_copy_rate``: the memcpy curve,
capped at twice the staging curve where the profile has one) is a curve of the aggregate rate
by thread count, so a device copying with ``t`` threads while the other devices of its host
copy with ``u`` in all gets its share of the rate for ``t + u`` threads:
``staging_copy_rate(t + u) * t / (t + u)``. With ``u = 0`` that is ``staging_copy_rate(t)``,
bit for bit: a device alone on its host is timed as it always was.

Which devices copy at once is *declared*, not read off the clocks. Each simulated GPU keeps a
virtual clock of its own (one clock for all would make the threads that drive different
devices take turns), so the clocks say nothing about which copies overlap. Whoever runs one
job over several devices declares each device's copy threads for the job's duration
(:meth:`SimHost.sharing`, reached through ``Device.sharing_host``); a device's copies are
charged for what the *other* devices of its host have declared when the copy's duration is
fixed (a worker pool's task when it starts, ``host_copy`` when it is called). So a
job's times depend on its calls only, as on a device alone, and they match the planner's
model of several GPUs (``ringflow._plan.predict_devices``: all the devices' workers copy
together for the whole job). docs/design.md, "One host for the simulated GPUs", has the
reasons.

Pinned memory is the host's too: a real GPU refuses to pin memory that is pinned already,
for whichever GPU of the process pinned it. The host refuses a registration that overlaps
host memory any of its devices has pinned (allocated or registered, while that buffer
lives), so no host memory is ever behind buffers of two devices, whose happens-before
checkers are separate.

``ringflow.device("sim:N")`` devices share one host per process; ``ringflow.device("sim")``
and ``SimDevice(...)`` each get a host of their own.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import weakref
from typing import TYPE_CHECKING, Iterator

from ..._errors import DeviceError

if TYPE_CHECKING:
    from .device import SimDevice
    from .memory import SimHostBuffer

# Test-only switch: False charges every device the host copy rate as if it were alone on its
# host. Tests turn it off to show that sharing the rate is what makes several devices' staged
# work agree with the planner.
_SHARE = True

_ids = itertools.count(1)


class SimHost:
    """One host's copy rate and pinned memory, shared by the simulated GPUs made on it."""

    def __init__(self) -> None:
        self.id = next(_ids)
        self._lock = threading.Lock()
        self._declared: dict["SimDevice", int] = {}  # device -> host copy threads declared for it
        self._pinned: dict[int, tuple] = {}  # buffer id -> (weak buffer, first address, end address)
        self._gone: collections.deque = collections.deque()  # ids of pinned buffers collected unclosed

    def __repr__(self) -> str:
        return f"<SimHost {self.id}: {len(self._declared)} device(s) declared copying>"

    # -- the copy rate ---------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def sharing(self, dev: "SimDevice", threads: int) -> Iterator[None]:
        """Declare that ``dev`` copies host memory with ``threads`` threads until the block ends.

        Declarations add up (two jobs on one device at once declare both). A device's own
        declaration never changes its own copies' rate, only the other devices'.

        Raises:
            ValueError: ``threads`` is not an int >= 0.
        """
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
            raise ValueError(f"sharing_host(threads): threads must be an int >= 0, got {threads!r}")
        if not threads:
            # declares nothing: an entry of 0 would be taken away by whichever declaration of
            # this device ended first, and the others' ends would find none
            yield
            return
        with self._lock:
            self._declared[dev] = self._declared.get(dev, 0) + threads
        try:
            yield
        finally:
            with self._lock:
                left = self._declared[dev] - threads
                if left:
                    self._declared[dev] = left
                else:
                    del self._declared[dev]

    def threads_besides(self, dev: "SimDevice") -> int:
        """Host copy threads the other open devices of this host have declared, in all."""
        with self._lock:
            return sum(n for other, n in self._declared.items() if other is not dev and not other.closed)

    def copy_rate(self, dev: "SimDevice", threads: int) -> float:
        """GB/s ``dev`` copies host memory at with ``threads`` threads (all of them together):
        its share of the host's rate for its threads and the other devices' declared ones
        (``HardwareProfile.staging_copy_rate``: host copies beside the GPUs' copies)."""
        others = self.threads_besides(dev) if _SHARE else 0
        total = threads + others
        return dev.profile.staging_copy_rate(total) * (threads / total)

    # -- pinned memory ---------------------------------------------------------------------------------------------
    def pin(self, buf: "SimHostBuffer") -> None:
        """Record that ``buf`` (of its device) pins its memory, until it is closed or collected.

        Raises:
            DeviceError: (not sticky) the memory overlaps host memory that a live buffer of
                an open device of this host pins (this device's included).
        """
        memory = buf._mem
        start = memory.__array_interface__["data"][0]
        end = start + memory.nbytes
        with self._lock:
            self._purge()
            for ref, a, b in self._pinned.values():
                other = ref()
                if other is None or other._closed or other._dev.closed:
                    continue
                if start < b and a < end:
                    raise DeviceError(
                        f"register_host of {memory.nbytes} bytes: bytes [{max(a, start) - start}, "
                        f"{min(b, end) - start}) of the array are pinned already, by {other!r} of "
                        f"{'this device' if other._dev is buf._dev else repr(other._dev) + ', another simulated GPU of this host'}; "
                        f"a GPU refuses to pin host memory twice (CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED): "
                        f"use the pinned buffer already behind it, close that buffer before pinning the array again, or "
                        f"copy the data into an array this device pins (rf.host.empty_like(x, device=...))")
            key, gone = buf.id, self._gone
            self._pinned[key] = (weakref.ref(buf, lambda _: gone.append(key)), start, end)

    def unpin(self, buf: "SimHostBuffer") -> None:
        """``buf`` was closed: its memory is no longer pinned."""
        with self._lock:
            self._pinned.pop(buf.id, None)
            self._purge()

    def _purge(self) -> None:
        """Forget the buffers collected unclosed. Their weak references' callbacks only queue
        them (a deque append needs no lock, and a collection may run inside this lock)."""
        while self._gone:
            self._pinned.pop(self._gone.popleft(), None)
