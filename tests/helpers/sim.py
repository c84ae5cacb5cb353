"""Small helpers for tests of the simulated GPU: devices, timelines, profiles."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

import numpy as np

import ringflow as rf
from ringflow._device.hardware import UNIT_TEST, HardwareProfile


def read_on(stream, res, seconds: float = 50e-6):
    """Read a result delivered on the simulated GPU (``deliver="device"``) as a consumer's model
    step would: a kernel on ``stream`` naming it in ``reads``; returns the host array that kernel
    fills (valid once ``stream`` has run it)."""
    out = np.empty(res.shape, res.dtype)

    def read(a):
        out[...] = a

    read.sim_seconds = seconds
    stream.launch(read, res.array, reads=[res.array])
    return out


def unit_device(**options: Any):
    """A sim device on the ``unit`` profile: 1 GB/s copies, 10 GB/s device memory, no host
    overheads, so expected virtual times can be computed by hand."""
    return rf.device("sim", profile="unit", **options)


def small_memory_device(total_memory: int, **options: Any):
    """A sim device on the ``unit`` profile with only ``total_memory`` bytes of device memory, so
    a test can run it out of memory without holding gigabytes."""
    profile = dataclasses.replace(UNIT_TEST, name=f"unit-{total_memory}B", total_memory=total_memory)
    return rf.device("sim", profile=profile, **options)


def slowed(stage: str, factor: float = 4.0, base: HardwareProfile = UNIT_TEST) -> HardwareProfile:
    """``base`` with one copy direction ``factor`` times slower ('h2d' or 'd2h'), for tests that
    need that stage to be the bottleneck."""
    if stage not in ("h2d", "d2h"):
        raise ValueError(f"slowed() slows 'h2d' or 'd2h', got {stage!r}")
    curve = getattr(base, f"{stage}_curve")
    return dataclasses.replace(base, name=f"{base.name}-slow-{stage}",
                               **{f"{stage}_curve": tuple((n, gbps / factor) for n, gbps in curve)})


class Timeline:
    """Collects every op as it completes (``dev.add_op_observer``)."""

    def __init__(self, dev: Any):
        self.ops: list = []
        dev.add_op_observer(self.ops.append)

    def rows(self) -> list[tuple[int, str, float, float]]:
        """(queue, label, started_at, done_at) of each completed op, in completion order. Queues are
        numbered by first appearance, so two devices' runs compare equal whatever their stream ids."""
        number: dict = {}
        return [(number.setdefault(op.queue, len(number)), op.label, op.started_at, op.done_at) for op in self.ops]

    def of(self, prefix: str) -> list:
        return [op for op in self.ops if op.label.startswith(prefix)]


@contextlib.contextmanager
def named_sims(*indices: int, **options: Any) -> Iterator[list]:
    """Fresh ``"sim:N"`` devices for these ``indices`` (GPUs of the process's one simulated host),
    made with ``options``; an earlier test's device of that name is closed first (its name then
    makes a new one), and these are closed afterwards, so no test meets another's clock."""
    from ringflow import _device

    for i in indices:
        entry = _device._named_sims.get(i)
        if entry is not None:
            entry[0].close()
    devs = [rf.device(f"sim:{i}", **options) for i in indices]
    try:
        yield devs
    finally:
        for dev in devs:
            dev.close()


def hold_copy(dev, item: np.ndarray) -> "tuple[Any, Any]":
    """Hold ``dev``'s host copy out of ``item`` (a staging copy into a shared chunk) until the test
    says so: returns ``(started, release)``, two ``threading.Event``: ``started`` is set once
    the copy has begun, and it completes once ``release`` is set (within 30 real seconds)."""
    import threading

    started, release = threading.Event(), threading.Event()
    real = dev.host_copy

    def held(dst, src):
        if src is item:
            started.set()
            assert release.wait(30), "the held copy was never released"
        real(dst, src)

    dev.host_copy = held
    return started, release


def counting_allocations(monkeypatch, dev, method: str = "allocate") -> list:
    """The bytes of each allocation ``dev`` makes from here on through ``method`` (``"allocate"``:
    device memory; ``"allocate_host"``: pinned host memory), in order."""
    asked = []
    allocate = getattr(dev, method)

    def counted(nbytes, *args, **kwargs):
        asked.append(nbytes)
        return allocate(nbytes, *args, **kwargs)

    monkeypatch.setattr(dev, method, counted)
    return asked
