"""The simulated GPU made to behave as the CUDA backend does where the two differ and the
pipeline depends on it, so that a sim test covers the real GPU's path (CI has no GPU).

Each helper takes pytest's ``monkeypatch`` and patches the simulated GPU's classes for the test.
"""

from __future__ import annotations

from typing import Any

from ringflow._device.sim.device import SimDevice
from ringflow._device.sim.stream import SimEvent, SimStream


def launch_raises_as_on_a_gpu(monkeypatch: Any, exc: BaseException, at: int) -> None:
    """The ``at``-th launch (counting from 1, on any simulated stream) raises ``exc`` from the
    launch itself, as a compute that raises does on a GPU, where it runs as it is launched (it
    enqueues its kernels then); the simulated GPU runs it when the launch completes in virtual
    time, and reports its exception through that completion. The other launches run as usual."""
    real_launch = SimStream.launch
    launches = []

    def launch(self: SimStream, fn, *args, **kwargs):
        launches.append(None)
        if len(launches) == at:
            raise exc
        return real_launch(self, fn, *args, **kwargs)

    monkeypatch.setattr(SimStream, "launch", launch)


def sticky_events_as_on_a_gpu(monkeypatch: Any) -> None:
    """Events of a broken device as the CUDA backend reports them (``CudaEvent``): once the
    context has a sticky error, a query of an event not seen done before counts it done, its
    :attr:`~SimEvent.error` the sticky :class:`~ringflow._errors.DeviceError`, and ``sync``
    raises that; ``wait_any`` over such events returns them rather than raising. The simulated
    GPU raises the sticky error from the query itself. Host tasks stay as the sim has them."""
    real_is_done, real_error, real_sync = SimEvent.is_done, SimEvent.error, SimEvent.sync
    real_wait_any = SimDevice.wait_any

    def broken(ev: SimEvent) -> bool:
        """Whether ``ev`` counts as done with the sticky error (set on first query as broken)."""
        if ev.__dict__.get("_gpu_error") is not None:
            return True
        if ev.__dict__.get("_gpu_seen_done") or ev._dev._sticky is None:
            return False
        ev._gpu_error = ev._dev._sticky_error()
        return True

    def is_done(self: SimEvent) -> bool:
        if broken(self):
            return True
        done = real_is_done.fget(self)
        if done:
            self._gpu_seen_done = True
        return done

    def error(self: SimEvent):
        gpu = self.__dict__.get("_gpu_error")
        return gpu if gpu is not None else real_error.fget(self)

    def sync(self: SimEvent) -> None:
        if broken(self):
            raise self._gpu_error
        real_sync(self)
        self._gpu_seen_done = True

    def wait_any(self: SimDevice, waitables, timeout=None, wake=None):
        if self._sticky is not None:
            done = [w for w in waitables if isinstance(w, SimEvent) and w.is_done]
            if done:
                return done
        return real_wait_any(self, waitables, timeout=timeout, wake=wake)

    monkeypatch.setattr(SimEvent, "is_done", property(is_done))
    monkeypatch.setattr(SimEvent, "error", property(error))
    monkeypatch.setattr(SimEvent, "sync", sync)
    monkeypatch.setattr(SimDevice, "wait_any", wait_any)
