"""Results that stay on the GPU: :class:`DeviceResult`, what ``Pipeline(deliver="device")`` hands out.

A delivered result owns the device slot the compute wrote (the slot is LENT) until the consumer
releases it. The release records an event on the consumer's stream and hands the slot back with
that event as its ``ready`` event: the next compute into the slot waits for it on the GPU, so the
slot is reused only after the consumer's work on it, without the host waiting. The release is
queued (a deque append: safe from any thread and from a finaliser) and carried out by the
pipeline's driver at its next step.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from .sigint import shielded_call
from .uncopyable import Uncopyable


class DeviceResult(Uncopyable):
    """One result left on the device (``Pipeline(deliver="device")``).

    ``array`` is the result as ``compute`` wrote it: a CuPy or PyTorch array on a CUDA GPU (the
    framework the device uses), a launch argument on the simulated GPU; a tuple, list or dict
    of them for a result of several arrays (``shape`` and ``dtype`` are then None). It is valid until
    :meth:`release`, or until its device is closed (its memory goes with it); use it as a
    context manager (``with res as y:``) to release on exit, or drop it: a collected result
    releases itself on the default stream. It cannot be pickled or
    copied (TypeError): copy its ``array`` instead.

    Attributes:
        index: the chunk's index (submission order).
        shape, dtype: the result's shape and numpy dtype.
    """

    __slots__ = ("index", "shape", "dtype", "_arg", "_array", "_device", "_give_back", "_lock", "_released",
                 "_finalizer", "_convert", "_token", "__weakref__")

    def __init__(self, *args: Any, **kwargs: Any):
        raise TypeError("DeviceResult objects are made by a Pipeline(deliver='device'), not directly")

    @classmethod
    def _lent(cls, index: int, arg: Any, device: Any, give_back, token: Any, convert=None) -> "DeviceResult":
        """The result of chunk ``index`` in the slot ``arg`` describes, lent to the consumer;
        ``give_back(event, token)`` hands the slot back; ``token``: published by the thread that
        saw the compute complete, observed by whichever thread takes :attr:`array`."""
        self = object.__new__(cls)
        self._token = token
        self._convert = convert  # another framework's array over the same memory (like=), or None
        self.index = index
        # one array's launch argument, or (tree, leaf arguments) for several (.trees)
        self.shape = getattr(arg, "shape", None)
        self.dtype = getattr(arg, "dtype", None)
        self._arg = arg
        self._array = None
        self._device = device
        self._give_back = give_back  # give_back(event_or_None, token): hands the slot back
        self._lock = threading.Lock()
        self._released = False
        self._finalizer = weakref.finalize(self, _release_dropped, device, give_back)
        self._finalizer.atexit = False
        return self

    @property
    def array(self) -> Any:
        """The device array; raises RuntimeError once released (the slot may hold another result)
        or once its device is closed (its memory went with it). The calling thread is ordered
        after the compute that wrote it, whichever thread got the result from its future (the
        caller may pass it on by means the simulated GPU's checker cannot see)."""
        if self._released:
            raise RuntimeError(f"result {self.index} was released: its device memory now belongs to the pipeline "
                               "again; keep the result until your work on it is enqueued, then release it")
        if self._device.closed:
            # the close freed every buffer of the device, this slot's ring too: an array made
            # now (or kept from before) would view memory a later allocation may hold
            raise RuntimeError(f"result {self.index}'s device {self._device!r} was closed: its device memory went "
                               "with it; use the result before closing its device")
        self._device.observe(self._token)
        if self._array is None:
            if isinstance(self._arg, tuple):
                from .trees import unflatten

                tree, args = self._arg
                self._array = unflatten(tree, [self._device.device_array(a) for a in args])
            else:
                self._array = self._device.device_array(self._arg)
            if self._convert is not None:
                from .like import convert_tree

                self._array = convert_tree(self._array, self._convert)
        return self._array

    @property
    def released(self) -> bool:
        """Whether :meth:`release` has run (then, or once its device is closed, ``array`` raises)."""
        return self._released

    @shielded_call  # a Ctrl-C waits until the slot is handed back (raised as the call returns)
    def release(self, stream: Any = None) -> None:
        """Hand the slot back once the work enqueued on ``stream`` so far is done (the GPU orders
        the reuse: this call does not wait). ``stream``: the stream the consumer's work on
        ``array`` runs on; None for the device's default stream (CuPy's and PyTorch's unless told
        otherwise; on the simulated GPU, None orders after nothing). A second call does nothing;
        neither does ``stream`` once the device is closed (nothing runs on it any more).

        Raises:
            TypeError: ``stream`` is not a stream the device can record on.
        """
        with self._lock:
            if self._released:
                return
            # a closed device runs nothing more, so there is no work to order after (and no
            # stream left to record on: recording raised, and the result stayed held)
            event = None if self._device.closed else self._device.record_on(stream)
            self._released = True
            self._array = None
            self._finalizer.detach()
        self._give_back(event, self._device.publish())

    def __enter__(self) -> Any:
        return self.array

    def __exit__(self, *exc_info: Any) -> None:
        self.release()

    def _not_copied(self, what: str) -> str:
        # a copy would be a second handle on the one lent slot (released twice, read after the
        # other's release), and a pickle cannot carry device memory to another process
        return (f"a DeviceResult cannot be {what}: it is the pipeline's device slot, lent until release(), not an "
                f"array of its own; copy its .array instead (on the device with CuPy's .copy() or torch's .clone(), "
                f"to the host with .get() or .cpu(); each array of a tuple, list or dict) before releasing it, or "
                f"make the pipeline with deliver='host' to get results in host memory")

    def __repr__(self) -> str:
        state = "released" if self._released else "on the device"
        return f"<DeviceResult {self.index} {self.dtype} {self.shape} {state}>"


def _release_dropped(device: Any, give_back) -> None:
    """A collected result's release on the default stream. Never raises (a finaliser)."""
    try:
        event = device.record_on(None)
    except Exception:  # noqa: BLE001 - a dead device: nothing runs on it any more
        event = None
    try:
        give_back(event, device.publish())
    except Exception:  # noqa: BLE001 - a finaliser must not raise
        pass
