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
