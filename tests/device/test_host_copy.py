"""``Device.host_copy``: large copies split over threads give the same bytes."""

from __future__ import annotations

import numpy as np
import pytest

import ringflow as rf
from ringflow._device import protocol


@pytest.mark.parametrize("nbytes", [0, 1, 4097, (1 << 20) + 3, (3 << 20) + 5, 9 << 20])
@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_parallel_copy_gives_the_same_bytes(nbytes, threads):
    src = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    protocol.parallel_copy(dst, src, threads)
    assert np.array_equal(dst, src)


def test_shapes_and_dtypes_other_than_bytes():
    src = np.random.default_rng(0).standard_normal((513, 1025)).astype(np.float32)
    dst = np.empty_like(src)
    protocol.parallel_copy(dst, src, 4)
    assert np.array_equal(dst, src)
    with pytest.raises(TypeError):  # what np.copyto(casting="no") refuses is refused
        protocol.parallel_copy(np.empty((4,), np.float64), np.ones(4, np.float32), 4)


def test_python_copy_threads_grow_with_size():
    split = protocol.SPLIT_COPY_BYTES
    assert [protocol.python_copy_threads(n * split) for n in (0, 1, 2, 3, 4, 64)] == [1, 1, 2, 3, 4, 4]
    assert protocol.python_copy_threads(split - 1) == 1


def test_without_native_copies_a_staged_item_is_copied_by_the_accepting_thread_alone(monkeypatch):
    """Python threads split only copies of two SPLIT_COPY_BYTES and more: a request-sized copy
    (up to 4 MiB, or any under 8 MiB) stays on the accepting thread."""
    from ringflow._device import native_copy

    monkeypatch.setattr(native_copy, "_loaded", False)  # as where no compiler works
    assert protocol.copy_threads(4 << 20) == 1
    assert protocol.copy_threads(2 * protocol.SPLIT_COPY_BYTES - 1) == 1
    assert protocol.copy_threads(64 * protocol.SPLIT_COPY_BYTES) == protocol.MAX_COPY_THREADS


def test_native_copies_split_from_their_own_size_over_at_most_their_own_threads(monkeypatch):
    from ringflow._device import native_copy

    if native_copy.copier() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setattr(protocol, "NATIVE_MAX_THREADS", 8)
    split = protocol.NATIVE_SPLIT_BYTES
    assert [protocol.copy_threads(n * split) for n in (0, 1, 2, 5, 8, 64)] == [1, 1, 2, 5, 8, 8]


def test_the_simulated_gpu_charges_a_copy_alike_on_every_machine(monkeypatch):
    """Native copy threads (their count follows this machine's CPUs) do not change a simulated
    timeline: the copy is charged at the Python threads' split."""
    from ringflow._device import native_copy

    src = np.ones(2 << 20, np.uint8)
    took = []
    for loaded, threads in ((False, 1), (None, 8)):
        monkeypatch.setattr(native_copy, "_loaded", loaded)
        monkeypatch.setattr(protocol, "NATIVE_MAX_THREADS", threads)
        dev = rf.device("sim", profile="unit")
        dst = np.empty_like(src)
        t0 = dev.now
        dev.host_copy(dst, src)
        assert np.array_equal(dst, src)
        took.append(dev.now - t0)
    assert took[0] == took[1]


def test_the_simulated_gpu_charges_a_split_copy_at_its_threads_rate():
    dev = rf.device("sim", profile="unit")
    src = np.ones(4 * protocol.SPLIT_COPY_BYTES, np.uint8)
    dst = np.empty_like(src)
    t0 = dev.now
    dev.host_copy(dst, src)
    assert np.array_equal(dst, src)
    assert dev.now - t0 == pytest.approx(src.nbytes / (dev.hardware.host_copy_rate(4) * 1e9))
