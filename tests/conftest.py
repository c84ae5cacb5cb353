"""Shared test setup: ``gpu``-marked tests are skipped where no CUDA GPU is usable."""

from __future__ import annotations

import pytest


def _cuda() -> tuple[bool, str]:
    from ringflow._device import cuda_available

    return cuda_available()


def pytest_collection_modifyitems(config, items):
    _group_for_workers(items)
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    ok, reason = _cuda()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"no usable CUDA GPU: {reason}")
    for item in gpu_items:
        item.add_marker(skip)


# Tests that must not run beside one another when pytest-xdist spreads the suite over processes
# (``-n auto --dist loadgroup``, the README's command): each group runs on one worker, in order.
# GPU tests share the one GPU and some time it; Ray tests each start a local Ray instance, and two
# at once on a small machine starve both.
_SERIAL_GROUPS = (
    ("gpu", lambda item: "gpu" in item.keywords),
    ("ray", lambda item: item.path.name == "test_ray.py" or "_ray_" in item.name),  # the Ray example too
)


def _group_for_workers(items) -> None:
    """Give each test of a serial group pytest-xdist's ``xdist_group`` marker (harmless without
    pytest-xdist, and with it under any other ``--dist``)."""
    for item in items:
        for name, member in _SERIAL_GROUPS:
            if member(item):
                item.add_marker(pytest.mark.xdist_group(name))
                break


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


def pytest_configure(config):
    """Python's own SIGINT handler for the run, whatever the process inherited. A shell starts
    background commands (``cmd &`` without job control, ``nohup``) with SIGINT ignored, and
    Python then leaves it ignored: every test that sends SIGINT saw no KeyboardInterrupt and
    failed. The tests need the handler a user's interactive process has."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _sigint_handler_left_as_found():
    """Every test leaves the process's SIGINT handler as it found it: one left changed (a shield's
    handler that a test's interrupt stranded, say) made later tests that send SIGINT see no
    KeyboardInterrupt at all, far from the test at fault. Restored, and the test fails."""
    import signal

    before = signal.getsignal(signal.SIGINT)
    yield
    after = signal.getsignal(signal.SIGINT)
    if after is not before and after != before:
        signal.signal(signal.SIGINT, before)
        pytest.fail(f"the test left SIGINT's handler changed: {before!r} -> {after!r}")
