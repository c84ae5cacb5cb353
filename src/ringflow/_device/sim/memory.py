"""Host and device buffers of the simulated GPU.

Both hold their bytes in a numpy uint8 array. Device memory is not reachable from the host
except through copies. Every host view and every release goes through the device's
happens-before checker. In checked mode a fresh device allocation is filled with 0xCD and a
released pinned buffer with 0xEE, so a read of never-written or already-released bytes shows
up as a wrong result.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import numpy as np

from ..._errors import OutOfMemoryError
from ..protocol import DeviceBuffer, HostBuffer, typed_view
from .hazard import AccessKind

if TYPE_CHECKING:
    from .device import SimDevice
    from .stream import SimStream

UNINITIALISED = 0xCD
RELEASED = 0xEE
DEVICE_ALIGN = 256  # bytes: where a CUDA allocation starts, at the least
_ids = itertools.count(1)


def _device_bytes(nbytes: int) -> np.ndarray:
    """``nbytes`` of uint8 starting on a :data:`DEVICE_ALIGN` boundary, as a GPU's allocation
    does: the arrays a launch hands ``fn`` then sit at the addresses, modulo that boundary, that
    they have on a GPU (numpy's own allocations are aligned to 16 bytes or so)."""
    raw = np.empty(nbytes + DEVICE_ALIGN - 1, np.uint8)
    start = -raw.ctypes.data % DEVICE_ALIGN
    return raw[start:start + nbytes]


class _SimBufferMixin:
    _dev: "SimDevice"
    _mem: np.ndarray
    label: str

    @property
    def owner(self) -> "SimDevice":
        return self._dev

    def _access(self, kind: AccessKind, start: int, end: int, op: str, actor=None, tick: bool = True) -> None:
        self._dev._check_access(self, kind, start, end, op, actor=actor, tick=tick)


class SimHostBuffer(_SimBufferMixin, HostBuffer):
    def __init__(self, dev: "SimDevice", nbytes: int, array: np.ndarray | None = None):
        super().__init__(nbytes)
        self._dev = dev
        self.id = next(_ids)
        self.registered = array is not None
        self.label = f"{'registered' if self.registered else 'pinned'} host buffer #{self.id}"
        if array is None:
            try:
                self._mem = np.empty(nbytes, np.uint8)
            except (MemoryError, ValueError) as exc:  # numpy's ValueError: more than an array may hold
                raise OutOfMemoryError(f"allocate_host(nbytes) asks for {nbytes} bytes of pinned host memory, more "
                                       f"than this host can give ({exc}); ask for fewer bytes") from None
            self._mem.fill(UNINITIALISED if dev.poison else 0)
        else:
            self._mem = array.reshape(-1).view(np.uint8)

    def __repr__(self) -> str:
        return f"<{self.label} {self.nbytes} B{' closed' if self._closed else ''}>"

    def _memory(self) -> np.ndarray:
        return self._mem

    def view(self, dtype: Any = np.uint8, *, offset: int = 0, count: int | None = None, access: str = "rw"):
        self._check_open()
        out = typed_view(self._mem, dtype, offset, count, access)
        with self._dev._lock:
            if self._dev._sticky is not None:
                # pinned memory is still host memory on a dead context (a GPU's pinned buffer is
                # viewed without a CUDA call), and nothing runs on the device again to race with it
                return out
            self._dev._host_api()
            end = offset + out.nbytes
            if "r" in access:
                self._access(AccessKind.READ, offset, end, f"host view ({access})")
            if "w" in access:
                self._access(AccessKind.WRITE, offset, end, f"host view ({access})", tick="r" not in access)
        return out

    def close(self) -> None:
        if self._closed:
            return
        with self._dev._lock:
            # check the release first: a refused close (HazardError) leaves the buffer open and counted
            self._access(AccessKind.RELEASE, 0, self.nbytes, "host buffer close")
            self._closed = True
            self._dev.host.unpin(self)
            self._dev._release("host_buffers", self.id)
            if self._dev.poison and not self.registered:
                self._mem.fill(RELEASED)
            if self.registered and self._dev._sticky is None and not self._dev.closed:
                # (a broken context's unpinning is not on the clock)
                self._dev._host_api(self._dev.profile.unregister_seconds(self.nbytes))


class SimDeviceBuffer(_SimBufferMixin, DeviceBuffer):
    def __init__(self, dev: "SimDevice", nbytes: int):
        super().__init__(nbytes)
        self._dev = dev
        self.id = next(_ids)
        self.label = f"device buffer #{self.id}"
        self._mem = _device_bytes(nbytes)
        self._mem.fill(UNINITIALISED if dev.poison else 0)

    def __repr__(self) -> str:
        return f"<{self.label} {self.nbytes} B{' closed' if self._closed else ''}>"

    def close(self, stream: "SimStream | None" = None) -> None:
        if self._closed:
            return
        with self._dev._lock:
            actor = None
            if stream is not None:
                if getattr(stream, "_dev", None) is not self._dev:
                    raise ValueError(f"close(stream=...) needs a stream of this buffer's device, got {stream!r}")
                stream._begin(0.0)
                actor = stream.actor
            # check the release first: a refused free (HazardError) leaves the buffer open and counted
            op = "stream-ordered device buffer free" if stream is not None else "device buffer free"
            self._access(AccessKind.RELEASE, 0, self.nbytes, op, actor=actor)
            self._closed = True
            self._dev._release("device_buffers", self.id)
