"""Host copies split over native threads (``ringflow._device.native_copy``), and the numpy
copy that replaces them wherever they cannot be built."""

from __future__ import annotations

import logging
import multiprocessing
import os
import pathlib
import subprocess
import sysconfig
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringflow._device import native_copy, protocol

needs_native = pytest.mark.skipif(native_copy.copier() is None, reason="no C compiler here")


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    """The loader as on first use, building into an empty cache directory."""
    monkeypatch.setattr(native_copy, "_loaded", None)
    monkeypatch.setenv("RINGFLOW_CACHE_DIR", str(tmp_path))
    return tmp_path


@needs_native
@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 3 << 20), src_off=st.integers(0, 63), dst_off=st.integers(0, 63),
       threads=st.integers(1, 9), seed=st.integers(0, 2**32 - 1))
def test_a_split_copy_is_the_bytes_of_the_source(n, src_off, dst_off, threads, seed):
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, n + src_off, dtype=np.uint8)[src_off:]  # misaligned starts too
    dst = np.zeros(n + dst_off + 64, np.uint8)
    assert native_copy.copy(dst[dst_off:dst_off + n], src, threads)
    assert np.array_equal(dst[dst_off:dst_off + n], src)
    assert not dst[:dst_off].any() and not dst[dst_off + n:].any()  # nothing written outside


@needs_native
@pytest.mark.parametrize("threads", range(2, 10))
def test_every_byte_is_copied_where_the_parts_do_not_divide_it(threads):
    """``threads`` parts of a size one to ``threads - 1`` bytes past a multiple of 64 bytes a
    part: the parts must still cover the last bytes (a part size rounded down left them)."""
    native_copy.copy(np.empty(1 << 20, np.uint8), np.ones(1 << 20, np.uint8), 9)  # more helpers than asked
    for per_part in (64, 4096, 159104):
        for tail in sorted({1, threads - 1}):
            n = per_part * threads + tail
            src = np.random.default_rng(n).integers(1, 256, n, dtype=np.uint8)
            dst = np.zeros(n, np.uint8)
            assert native_copy.copy(dst, src, threads)
            assert np.array_equal(dst, src), (threads, n)


@needs_native
def test_copies_from_several_threads_at_once_are_each_right():
    """One copy uses the pool at a time; the others copy on their own thread meanwhile."""
    rng = np.random.default_rng(7)
    sources = [rng.random(300_000 + 1000 * i) for i in range(8)]
    wrong = []

    def run(i):
        for k in range(30):
            dst = np.empty_like(sources[i])
            protocol.parallel_copy(dst, sources[i], 6)
            if not np.array_equal(dst, sources[i]):
                wrong.append((i, k))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads) and wrong == []


def _copy_in_child(queue):
    src = np.arange(1 << 20, dtype=np.float32)
    dst = np.empty_like(src)
    native_copy.copy(dst, src, 4)
    queue.put(bool(np.array_equal(dst, src)))


@needs_native
def test_a_forked_child_starts_its_own_copy_threads():
    """The parent's copy threads do not exist in a forked child: it copies on a new pool
    instead of waiting forever for the parent's."""
    native_copy.copy(np.empty(1 << 20, np.uint8), np.ones(1 << 20, np.uint8), 4)  # the parent's pool runs
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_copy_in_child, args=(queue,))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0 and queue.get(timeout=5) is True


def test_switched_off_copies_fall_back_to_numpy(fresh_loader, monkeypatch, caplog):
    monkeypatch.setenv("RINGFLOW_NATIVE_COPY", "0")
    with caplog.at_level(logging.INFO, logger="ringflow._device.native_copy"):
        assert native_copy.copier() is None
    assert "native copies off" in caplog.text
    src = np.random.default_rng(1).random(1 << 20)
    dst = np.empty_like(src)
    assert native_copy.copy(dst, src, 4) is False and not list(fresh_loader.iterdir())
    assert protocol.copy_threads(64 << 20) == min(protocol.MAX_COPY_THREADS, 16)  # the Python threads' policy
    protocol.parallel_copy(dst, src, 4)
    assert np.array_equal(dst, src)


def test_a_compiler_that_fails_falls_back_to_numpy(fresh_loader, monkeypatch, caplog):
    monkeypatch.setattr(native_copy.sysconfig, "get_config_var", lambda name: "ringflow-no-such-compiler")
    with caplog.at_level(logging.INFO, logger="ringflow._device.native_copy"):
        assert native_copy.copier() is None
        assert native_copy.copier() is None  # tried once, remembered
    assert caplog.text.count("native copies unavailable") == 1
    src = np.arange(100_000, dtype=np.int64)
    dst = np.empty_like(src)
    protocol.parallel_copy(dst, src, 4)
    assert np.array_equal(dst, src)


@needs_native
def test_the_library_is_built_once_into_the_cache(fresh_loader):
    assert native_copy.copier() is not None
    built = list(fresh_loader.iterdir())
    assert len(built) == 1 and built[0].name.startswith("native_copy-") and built[0].suffix == ".so"


def test_arrays_it_cannot_copy_are_left_to_numpy():
    a = np.arange(1 << 20, dtype=np.float64)
    out = np.zeros((1 << 19,), np.float64)
    assert native_copy.copy(out, a[::2], 4) is False and not out.any()  # a strided source
    assert native_copy.copy(np.zeros(10), np.zeros(11), 4) is False  # unequal bytes
    protocol.parallel_copy(out, a[::2], 4)
    assert np.array_equal(out, a[::2])


@needs_native
@pytest.mark.parametrize("spin", [0.0, 50e-6, 2e-3])
def test_copies_are_right_whether_the_helpers_poll_or_sleep_between_them(spin):
    """Helpers that sleep at once (0), poll a while, or poll across consecutive copies all take
    each part exactly once: many copies with varying splits, each checked, none hanging."""
    rng = np.random.default_rng(int(spin * 1e6))
    try:
        native_copy.set_spin(spin)
        for k in range(300):
            n = int(rng.integers(0, 600_000))
            src = rng.integers(0, 256, n, dtype=np.uint8)
            dst = np.zeros(n, np.uint8)
            assert native_copy.copy(dst, src, int(rng.integers(1, 10)))
            assert np.array_equal(dst, src), (k, n)
    finally:
        native_copy.set_spin(native_copy.SPIN_SECONDS)


def test_the_polling_time_is_checked(monkeypatch, caplog):
    with pytest.raises(ValueError, match="seconds must be a number from 0 to 1"):
        native_copy.set_spin(-1)
    with pytest.raises(ValueError, match="seconds must be a number from 0 to 1"):
        native_copy.set_spin("fast")
    with pytest.raises(ValueError, match="seconds must be a number from 0 to 1"):
        native_copy.set_spin(True)  # not a second of polling
    monkeypatch.setenv("RINGFLOW_COPY_SPIN_US", "50")
    assert native_copy._spin_from_env() == pytest.approx(50e-6)
    for bad in ("nan", "-3", "soon", "1e9"):
        monkeypatch.setenv("RINGFLOW_COPY_SPIN_US", bad)
        with caplog.at_level(logging.WARNING, logger="ringflow._device.native_copy"):
            assert native_copy._spin_from_env() == native_copy.SPIN_SECONDS
        assert "RINGFLOW_COPY_SPIN_US" in caplog.text
    monkeypatch.delenv("RINGFLOW_COPY_SPIN_US")
    assert native_copy._spin_from_env() == native_copy.SPIN_SECONDS


@needs_native
@pytest.mark.parametrize("streaming", [True, False])
def test_long_parts_are_right_with_streaming_stores_or_without(streaming):
    """Parts around the streaming threshold (16 KiB), each destination and source misaligned
    by 0-63 bytes and lengths not a multiple of 64: the head before the first 16-byte boundary,
    the 64-byte body and the tail are all copied, and nothing outside the destination."""
    rng = np.random.default_rng(int(streaming))
    try:
        native_copy.set_streaming(streaming)
        for n in (16 * 1024 - 1, 16 * 1024, 16 * 1024 + 77, 100_003, 1 << 20):
            for threads in (1, 3, 8):
                src_off, dst_off = (int(v) for v in rng.integers(0, 64, 2))
                src = rng.integers(0, 256, n + src_off, dtype=np.uint8)[src_off:]
                dst = np.zeros(n + dst_off + 64, np.uint8)
                assert native_copy.copy(dst[dst_off:dst_off + n], src, threads)
                assert np.array_equal(dst[dst_off:dst_off + n], src), (n, threads, src_off, dst_off)
                assert not dst[:dst_off].any() and not dst[dst_off + n:].any()
    finally:
        native_copy.set_streaming(True)


def test_the_streaming_switch_takes_a_bool():
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match="on must be True or False"):
            native_copy.set_streaming(bad)


def test_the_streaming_switch_takes_a_numpy_bool():
    """As every flag of the library does."""
    try:
        native_copy.set_streaming(np.bool_(False))
    finally:
        native_copy.set_streaming(True)


STRESS = pathlib.Path(__file__).parent.parent / "helpers" / "native_copy_stress.c"
# a helper counting its part done: with release order its bytes are visible to the caller that
# sees the count reach zero; relaxed, nothing orders them
PART_DONE = "__atomic_fetch_sub(&remaining, 1, __ATOMIC_ACQ_REL)"


def _stress(tmp_path, source: str, rounds: int, *, halt_on_error: bool = False) -> subprocess.CompletedProcess:
    """The stress driver built with ``source`` under ThreadSanitizer and run; skips where the
    compiler cannot build with it. ``halt_on_error``: stop at the first report (a run that must
    find a race need not run its remaining rounds once it has; one that must find none runs all)."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()
    (tmp_path / "copy.c").write_text(source)
    exe = tmp_path / "stress"
    built = subprocess.run([*cc, "-O1", "-g", "-fsanitize=thread", "-pthread", "-o", str(exe), str(STRESS),
                            str(tmp_path / "copy.c")], capture_output=True, text=True, timeout=120)
    if built.returncode != 0:
        pytest.skip(f"no ThreadSanitizer build here: {built.stderr.strip()[:200]}")
    return subprocess.run([str(exe), str(rounds)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TSAN_OPTIONS": f"halt_on_error={int(halt_on_error)} exitcode=66"})


@needs_native
def test_copies_from_several_threads_are_right_and_nothing_races(tmp_path):
    """Three threads copy (random lengths, every other one short; misalignments; thread counts;
    the polling time changing): every byte right, nothing written around the destination, and
    ThreadSanitizer finds no access to shared state that nothing orders."""
    run = _stress(tmp_path, native_copy._SOURCE, rounds=400)
    assert run.returncode == 0 and "ThreadSanitizer" not in run.stderr, run.stdout + run.stderr[-3000:]
    assert run.stdout.startswith("ok")


@needs_native
def test_the_stress_catches_a_part_counted_done_before_its_bytes_are_seen(tmp_path):
    """The stress above is the check on the hand-off's memory order: with a helper counting its
    part done without release order, the caller's reading of the copied bytes races with the
    helper's writing of them, and it says so."""
    assert PART_DONE in native_copy._SOURCE
    reports = ""
    for _ in range(3):  # the race needs a helper to copy a part (not the caller alone)
        reports = _stress(tmp_path, native_copy._SOURCE.replace(PART_DONE, PART_DONE.replace("ACQ_REL", "RELAXED")),
                          rounds=200, halt_on_error=True).stderr
        if "ThreadSanitizer: data race" in reports:
            break
    assert "ThreadSanitizer: data race" in reports


@needs_native
def test_split_copies_and_their_parts_are_counted():
    try:
        native_copy.set_spin(0.0)  # helpers asleep when handed a part, as between spaced requests
        src = np.random.default_rng(5).integers(0, 256, 1 << 20, dtype=np.uint8)
        for _ in range(20):
            dst = np.zeros_like(src)
            before = native_copy.counters()
            assert native_copy.copy(dst, src, 4) and np.array_equal(dst, src)
            after = native_copy.counters()
            assert after["split_copies"] == before["split_copies"] + 1
            assert after["helper_parts"] - before["helper_parts"] == 3  # the caller copies the fourth
            assert 0 <= after["sleeping_helpers_called"] - before["sleeping_helpers_called"] <= 3
            assert after["caller_wait_ns"] >= before["caller_wait_ns"]
    finally:
        native_copy.set_spin(native_copy.SPIN_SECONDS)


def test_counters_name_every_value_and_are_numbers():
    values = native_copy.counters()
    assert tuple(values) == native_copy.COUNTER_NAMES
    assert all(isinstance(v, int) and v >= 0 for v in values.values())
