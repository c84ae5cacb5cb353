"""Shared test setup: ``gpu``-marked tests are skipped where no CUDA GPU is usable."""

from __future__ import annotations

import pytest


def _cuda() -> tuple[bool, str]:
    from ringflow._device import cuda_available

    return cuda_available()


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    ok, reason = _cuda()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"no usable CUDA GPU: {reason}")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture
def cuda_device():
    """A fresh ``CudaDevice`` (cuda:0); closed after the test, which must leave nothing live."""
    ok, reason = _cuda()
    if not ok:
        pytest.skip(f"no usable CUDA GPU: {reason}")
    from ringflow._device.cuda import CudaDevice

    dev = CudaDevice(0)
    yield dev
    dev.close()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Once pytest-timeout has cancelled a test's timer, drop its handle from the item. Its
    thread method leaves ``item.cancel_timeout`` (a closure over the test's ``threading.Timer``)
    on every item, and the items live until the run ends: some 3000 Timer threads' objects kept
    for the cyclic collector to walk on every full pass, which made the suite's many
    ``gc.collect()`` calls (a step of several interrupt sweeps) markedly slower."""
    yield
    item.__dict__.pop("cancel_timeout", None)
