"""What a warm :func:`~ringflow.stream_map` call may skip: the checks, layout and engine choice
of an earlier call made with the same arguments.

Note (why a warm call remembers its plan): a call's own Python (checking its arguments, laying
its chunks out, choosing its engine and the key of its warm engine) runs while the GPU idles,
between the previous call's last copy and this call's first, and right after a call the host's
caches hold the call's copies rather than that Python, so it runs several times slower than
when timed alone (docs/performance.md). A ``MapJob`` does it once; a ``stream_map`` call whose
arguments match an earlier successful one's reuses that call's outcome instead.

"The same arguments" is everything that work reads: the compute (a method such as ``model.step``,
looked up anew for each call, by its function and its object), the device (given as a device
object: a spec or None makes a new device on each call), each array's
address, shape, strides and dtype, the pinned buffers, every option (each compared with its
type, so ``8`` never stands in for ``8.0`` or ``True``), the compute's ``sim_seconds`` and the
device's hardware profile (by identity: replacing either plans anew), and the test hooks in
force. What can change without changing those is checked again on every call: whether ``x`` or
``out`` is pool memory and the bytes of the pool buffer behind each (a served call still receives
its pool arrays, ordering it after their hand-out, and uses the buffers it finds), a pinned
buffer or the device closed since. Entries hold no reference to the compute, the arrays,
the buffers, the hooks or the device (weak references confirm that an ``id`` still names the
same object), are bounded in number, and go when their device's warm engines are dropped.
"""

from __future__ import annotations

import threading
import weakref
from types import MethodType
from typing import Any, Callable, Hashable, Optional

import numpy as np

CAPACITY = 32


def compute_identity(f: Any) -> tuple:
    """``(key, objects)``: what identifies the compute ``f`` from one call to the next, and the
    objects that key names by identity. A bound method (``model.step``) is a new object each time
    it is looked up, so its function and the object it is bound to identify it; any other
    callable is itself. Whoever keeps the key keeps the objects alive, or checks them by weak
    reference, so that an identity is never another object's."""
    if type(f) is MethodType:
        func, owner = f.__func__, f.__self__
        return ("method", id(func), id(owner)), (func, owner)
    return id(f), (f,)


def tagged(value: Any) -> Any:
    """``value`` with its type beside it, tuples and lists element by element: ``1``, ``1.0``
    and ``True`` compare equal in Python but are not the same argument."""
    if type(value) in (tuple, list):
        return type(value), tuple(tagged(v) for v in value)
    return type(value), value


def array_key(arr: np.ndarray) -> tuple:
    """What a whole-array call reads of an array: its memory's address, whether it is writeable,
    its shape, strides and dtype."""
    return _address(arr), arr.flags.writeable, arr.shape, arr.strides, arr.dtype


def _interface_address(arr: np.ndarray) -> int:
    return arr.__array_interface__["data"][0]


def _address_reader() -> Callable[[np.ndarray], int]:
    """A function from a numpy array to the address of its first element, read from the array's
    C struct where this interpreter allows it (:func:`checked_reader`), else
    :func:`_interface_address`.

    Why: ``__array_interface__`` builds a dictionary of seven entries to say one number, and a warm
    ``stream_map`` call asks it for ``x`` and ``out`` while the GPU waits. numpy's C array struct
    (``PyArrayObject_fields``, public and part of numpy's ABI) keeps the address as its first field,
    right after the object header (``object.__basicsize__`` bytes), and on CPython ``id`` is the
    object's address."""
    import platform

    if platform.python_implementation() != "CPython":  # id() is no address elsewhere
        return _interface_address
    import ctypes

    at = ctypes.c_void_p.from_address
    offset = object.__basicsize__

    def reader(arr: np.ndarray) -> int:
        return at(id(arr) + offset).value or 0

    return checked_reader(reader)


def checked_reader(reader: Callable[[np.ndarray], int]) -> Callable[[np.ndarray], int]:
    """``reader`` if it gives ``__array_interface__``'s address for arrays of several kinds (owning
    their memory, views at an offset, strided, transposed, read-only, empty), else
    :func:`_interface_address`. Never raises."""
    try:
        base = np.arange(8, dtype=np.int64)
        read_only = base[1:]
        read_only.flags.writeable = False
        probes = (base, base[3:], base[::2], read_only, base.reshape(2, 4).T, np.empty((2, 0)))
        if all(reader(a) == _interface_address(a) for a in probes):
            return reader
    except Exception:  # noqa: BLE001, S110 - any surprise keeps the interface's answer
        pass
    return _interface_address


_address = _address_reader()


class CallMemo:
    """A bounded, thread-safe map from a call's key to its prepared outcome, each entry valid only
    while the objects it was made for are alive and the same (weak references) and the values it
    read are the same objects."""

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self._lock = threading.Lock()
        self._entries: dict[Hashable, tuple] = {}

    def get(self, key: Hashable, objects: tuple, values: tuple) -> Any:
        """The outcome stored under ``key`` if ``objects`` are the very objects it was stored
        with (None standing for none) and ``values`` the same objects; else None (an unhashable
        ``key`` included)."""
        try:
            entry = self._entries.get(key)  # one dict lookup: atomic, no lock needed to read
        except TypeError:  # unhashable: nothing is stored under it (put keeps none)
            return None
        if entry is None:
            return None
        refs, stored_values, outcome = entry
        for ref, obj in zip(refs, objects):
            if (obj is not None) if ref is None else ref() is not obj:
                return None
        for held, value in zip(stored_values, values):
            if (held() if type(held) is weakref.ref else held) is not value:
                return None
        return outcome

    def put(self, key: Hashable, objects: tuple, values: tuple, outcome: Any) -> None:
        """Remember ``outcome`` under ``key`` (nothing if an object cannot be weakly referenced);
        ``values`` are held weakly where they can be (a ``sim_seconds`` function may close over
        anything), else as they are (numbers). Past :attr:`capacity` entries the oldest go.
        Nothing is kept under an unhashable ``key``."""
        try:
            hash(key)
            refs = tuple(None if obj is None else weakref.ref(obj) for obj in objects)
        except TypeError:
            return
        held = tuple(_weakly(value) for value in values)
        with self._lock:
            self._entries.pop(key, None)
            self._entries[key] = (refs, held, outcome)
            while len(self._entries) > self.capacity:
                del self._entries[next(iter(self._entries))]

    def drop(self, device: Any = None, *, label: Optional[str] = None) -> None:
        """Forget the entries made with ``device`` among their objects (or the device ``label``
        names, as :func:`~ringflow._device.device_label` does), or all."""
        from .._device import device_label
        from .._device.protocol import Device

        def made_with(refs: tuple) -> bool:
            alive = [obj for obj in (ref() for ref in refs if ref is not None) if isinstance(obj, Device)]
            return any((device is None or obj is device) and (label is None or device_label(obj) == label)
                       for obj in alive)

        with self._lock:
            for key in [k for k, (refs, _, _) in self._entries.items() if made_with(refs)]:
                del self._entries[key]

    def forget(self) -> None:
        """Drop every entry and take a new lock, touching nothing (after fork(), in the child:
        a parent's thread may have held the lock)."""
        self._lock = threading.Lock()
        self._entries = {}

    def __len__(self) -> int:
        return len(self._entries)


def _weakly(value: Any) -> Any:
    """A weak reference to ``value`` where it takes one, else ``value`` (a number, None)."""
    try:
        return weakref.ref(value)
    except TypeError:
        return value


MEMO = CallMemo()
