"""The public API on the simulated GPU: stream_map and Pipeline round trips (dtypes, shapes,
variable sizes, zero-length and non-contiguous input), bad input, and backpressure."""

from __future__ import annotations

import copy
import dataclasses
import gc
import pickle
import threading
import warnings

import numpy as np
import pytest

import ringflow as rf
from ringflow import _testing
from ringflow._device.sim import charge
from tests.helpers.threads import JOIN_S
from tests.helpers.pipeline_checks import (
    Harness,
    check_result,
    random_costs,
    random_sizes,
    run_map,
)

CHUNK = 1 << 12


def f_affine(x, y):
    y[...] = x * 3 + 1


def f_copy(x, y):
    y[...] = x


def sim(seed=0, **kw):
    return rf.device("sim", seed=seed, chaos=True, **kw)


def expected(f, x):
    out = np.empty_like(x)
    f(x, out)
    return out


# -- stream_map --------------------------------------------------------------------------------
NUMERIC = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
           "float32", "float64", "complex64", "complex128"]
OTHER = [np.dtype([("a", "<i4"), ("b", "<f8"), ("c", "S3")]), np.dtype("M8[s]"), np.dtype("S5"), np.dtype("V7")]


def random_array(rng, shape, dtype):
    dtype = np.dtype(dtype)
    raw = rng.integers(0, 256, int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    arr = raw.view(dtype).reshape(shape)
    if dtype.kind in "fc":  # small finite values so equality is meaningful (NaN != NaN)
        arr = (rng.standard_normal(arr.shape) * 100).astype(dtype)
    return np.ascontiguousarray(arr)


HOSTS = ["stage", "register"]


@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("dtype", NUMERIC)
def test_stream_map_numeric_dtypes(dtype, host):
    rng = np.random.default_rng(1)
    x = random_array(rng, (5000,), dtype)
    if x.dtype.kind == "b":
        x = rng.random(5000) < 0.5
    f = f_copy if x.dtype.kind == "b" else f_affine
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # float16 overflow is the same on both sides
        want = expected(f, x)
        y = rf.stream_map(f, x, device=sim(), chunk_bytes=CHUNK, slots=2, checked=True, host=host)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert y.tobytes() == want.tobytes()


@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("dtype", OTHER, ids=str)
def test_stream_map_refuses_non_numeric_dtypes_before_any_device_work(dtype, host):
    """The simulated GPU moved and computed on these (numpy holds them); no GPU array type
    does, so a GPU failed the same call in the framework at the first chunk's compute."""
    x = random_array(np.random.default_rng(2), (777,), dtype) if dtype.kind != "M" else \
        np.arange(777).astype("M8[s]")
    dev = sim()
    ops = []
    dev.add_op_observer(ops.append)
    with pytest.raises(TypeError, match=r"^x: dtype .* cannot be an array on a GPU"):
        rf.stream_map(f_copy, x, device=dev, chunk_bytes=CHUNK, slots=1, checked=True, host=host)
    assert ops == []


@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("shape", [(1,), (4097,), (300, 7), (64, 3, 5), (2, 2, 2, 2, 2, 2), (1000, 1)])
def test_stream_map_shapes(shape, host):
    x = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    y = rf.stream_map(f_affine, x, device=sim(), chunk_bytes=CHUNK, slots=2, checked=True, host=host)
    assert y.shape == shape and np.array_equal(y, expected(f_affine, x))


def test_stream_map_row_exactly_one_slot():
    x = np.arange(64 * 1024, dtype=np.int32).reshape(64, 1024)  # one row == one 4 KiB slot
    y = rf.stream_map(f_affine, x, device=sim(), chunk_bytes=CHUNK, slots=1, checked=True)
    assert np.array_equal(y, x * 3 + 1)


@pytest.mark.parametrize("make", [
    lambda a: a[::3],  # strided
    lambda a: a.reshape(400, 50).T,  # transposed
    lambda a: np.asfortranarray(a.reshape(400, 50)),  # Fortran order
    lambda a: a.reshape(400, 50)[:, ::7],  # strided inner axis
    lambda a: a[::-1],  # negative stride
], ids=["strided", "transposed", "fortran", "inner-stride", "reversed"])
def test_stream_map_non_contiguous_input(make):
    x = make(np.arange(20000, dtype=np.float64))
    assert not x.flags.c_contiguous
    y = rf.stream_map(f_affine, x, device=sim(), chunk_bytes=CHUNK, slots=2, checked=True)
    assert y.shape == x.shape and np.array_equal(y, x * 3 + 1)


def test_stream_map_into_non_contiguous_out():
    x = np.arange(6000, dtype=np.int64).reshape(3000, 2)
    big = np.zeros((3000, 4), np.int64)
    out = big[:, ::2]
    ret = rf.stream_map(f_affine, x, out=out, device=sim(), chunk_bytes=CHUNK, slots=2, checked=True)
    assert ret is out and np.array_equal(out, x * 3 + 1) and np.all(big[:, 1::2] == 0)


@pytest.mark.parametrize("shape", [(0,), (0, 3), (5, 0), (0, 0, 2)])
def test_stream_map_empty_input_gives_empty_result(shape):
    dev = sim()
    x = np.empty(shape, np.float32)
    y = rf.stream_map(f_affine, x, device=dev, chunk_bytes=CHUNK)
    assert y.shape == shape and y.dtype == x.dtype
    out = np.empty(shape, np.float32)
    assert rf.stream_map(f_affine, x, out=out, device=dev, chunk_bytes=CHUNK) is out
    assert dev.live().total == 0


def test_stream_map_in_place_and_few_slots():
    x = np.arange(50000, dtype=np.float32)
    for kw in ({"inplace": True, "slots": rf.SlotCounts(2, 2, 0, 2)}, {"slots": 2},
               {"inplace": True, "slots": 1}):
        y = rf.stream_map(f_affine, x, device=sim(), chunk_bytes=CHUNK, checked=True, **kw)
        assert np.array_equal(y, x * 3 + 1), kw


def test_stream_map_writes_into_given_out_and_leaves_device_clean():
    dev = sim(4)
    x = np.arange(30000, dtype=np.uint16)
    out = np.zeros_like(x)
    assert rf.stream_map(f_affine, x, out=out, device=dev, chunk_bytes=CHUNK, slots=2, checked=True) is out
    assert np.array_equal(out, expected(f_affine, x))
    import gc
    gc.collect()
    assert dev.live().total == 0


# -- stream_map bad input ------------------------------------------------------------------------
@pytest.mark.parametrize("out", [np.zeros(99, np.float32), np.zeros(100, np.float64), np.zeros((100, 1), np.float32),
                                 [0.0] * 100], ids=["shape", "dtype", "ndim", "list"])
def test_stream_map_out_mismatch(out):
    x = np.zeros(100, np.float32)
    with pytest.raises(ValueError, match=r"out must be a numpy array of shape \(100,\) and dtype float32"):
        rf.stream_map(f_affine, x, out=out, device=sim(), chunk_bytes=CHUNK)


def test_stream_map_row_larger_than_chunk():
    x = np.zeros((10, 2000), np.float32)  # 8000-byte rows
    with pytest.raises(ValueError, match=r"8000 bytes but chunk_bytes is 4096.*chunk_bytes to at least 8000"):
        rf.stream_map(f_affine, x, device=sim(), chunk_bytes=CHUNK)


def test_stream_map_rejects_non_arrays_and_scalars():
    with pytest.raises(TypeError, match="numpy array"):
        rf.stream_map(f_affine, [1, 2, 3], device=sim())
    with pytest.raises(ValueError, match="at least one dimension"):
        rf.stream_map(f_affine, np.array(3.0, np.float32), device=sim())


# -- Pipeline round trips --------------------------------------------------------------------------
@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("slots", [1, 2, rf.SlotCounts(1, 2, 1, 3)], ids=str)
def test_pipeline_map_variable_sizes(ordered, slots):
    h = Harness(seed=5, slots=slots, chunk_bytes=2048, ordered=ordered, workers=3)
    rng = np.random.default_rng(5)
    run_map(h, random_sizes(rng, 200, 256, zero_frac=0.1), costs=random_costs(rng, 200))
    h.close()


def test_pipeline_map_in_place():
    h = Harness(seed=6, slots=rf.SlotCounts(2, 3, 0, 2), chunk_bytes=2048, inplace=True)
    run_map(h, random_sizes(np.random.default_rng(6), 200, 256))
    h.close()


def test_pipeline_default_prepare_and_consume_many_items():
    rng = np.random.default_rng(7)
    items = []
    for k in range(120):
        dtype = [np.float32, np.int16, np.complex128, np.uint8][k % 4]
        n = int(rng.integers(0, 200))
        shape = [(n,), (n, 2), (0, 3), (n // 4, 2, 2)][k % 4]
        a = (np.arange(int(np.prod(shape))) + 1000 * k).astype(dtype).reshape(shape)
        items.append(a if k % 3 else a[::-1])  # some negative-stride items
    dev = sim(7)
    with rf.Pipeline(f_affine, device=dev, chunk_bytes=4096, slots=2, checked=True) as pipe:
        outs = list(pipe.map(items))
    assert len(outs) == len(items)
    for a, y in zip(items, outs):
        assert y.shape == a.shape and y.dtype == a.dtype and np.array_equal(y, expected(f_affine, a))
    assert pipe.stats() == rf.PipelineStats(120, 120, 0, 0, 0)
    import gc
    gc.collect()
    assert dev.live().total == 0


def test_zero_length_items_pass_through():
    # a zero-length item used to make the scheduler enqueue a 0-byte copy (ValueError) and a
    # launch on empty, read-only views; it must simply come back empty
    calls = []

    def f(x, y):
        calls.append(x.shape)
        y[...] = x + 1

    with rf.Pipeline(f, device=sim(), chunk_bytes=256, slots=1, checked=True) as pipe:
        outs = list(pipe.map([np.zeros(0, np.float32), np.ones(3, np.float32), np.zeros((0, 4), np.int8)]))
        fut = pipe.submit(np.zeros(0, np.float64))
        assert fut.result().shape == (0,)
    assert [o.shape for o in outs] == [(0,), (3,), (0, 4)] and outs[2].dtype == np.int8
    assert np.array_equal(outs[1], np.full(3, 2, np.float32))
    assert calls == [(3,)]  # nothing to compute for an empty chunk


def test_slots_derived_by_the_planner():
    def f(x, y):
        y[...] = x * 3 + 1

    f.sim_seconds = 50e-6
    dev = sim(9)
    with rf.Pipeline(f, device=dev, chunk_bytes=1 << 16, checked=True) as pipe:
        counts = pipe.config.slots
        assert counts.host_in >= 1 and counts.device_in >= 1 and counts.device_out >= 1 and counts.host_out >= 1
        assert pipe.config.max_in_flight >= 1
        xs = [np.arange(1000, dtype=np.float64) + k for k in range(40)]
        for x, y in zip(xs, pipe.map(xs), strict=True):
            assert np.array_equal(y, x * 3 + 1)


def test_submit_futures_and_results():
    h = Harness(seed=8, slots=2, chunk_bytes=1024)
    items = [h.item(t, n) for t, n in enumerate([5, 0, 128, 1, 77, 128, 3], start=1)]
    futs = [h.pipe.submit(it) for it in items]
    for fut, it in zip(reversed(futs), reversed(items)):  # waiting on any future drives the pipeline
        check_result(fut.result(), it, fut.index)
        h.check()
    assert [f.index for f in futs] == list(range(len(items)))
    h.close()


def test_context_manager_error_cancels_and_closes():
    dev = sim()
    with pytest.raises(KeyError):
        with rf.Pipeline(f_affine, device=dev, chunk_bytes=1024, slots=1, checked=True) as pipe:
            futs = [pipe.submit(np.arange(10.0) + i) for i in range(3)]
            raise KeyError("user error")
    assert pipe.stats().in_flight == 0 and pipe.stats().balanced()
    assert all(f.done() for f in futs)
    with pytest.raises(RuntimeError, match="closed"):
        pipe.submit(np.arange(3.0))
    import gc
    gc.collect()
    assert dev.live().total == 0


# -- Pipeline bad input ----------------------------------------------------------------------------
@pytest.mark.parametrize("bad,exc,match", [(0, ValueError, "between 1 and"), (-1, ValueError, "between 1 and"),
                                           (True, TypeError, "integer"), (1.5, TypeError, "integer")])
def test_max_in_flight_must_be_positive_int(bad, exc, match):
    with pytest.raises(exc, match=rf"max_in_flight must be .*{match}"):
        rf.Pipeline(f_affine, device=sim(), chunk_bytes=1024, slots=1, max_in_flight=bad)


@pytest.mark.parametrize("bad,chunk_bytes", [(10 ** 18, 1024), (2 ** 63, 1024), (2 ** 40 + 1, 1024),
                                             (2 ** 27 + 1, None)], ids=["10**18", "2**63", "2**40+1", "default chunk"])
def test_max_in_flight_whose_chunks_no_host_could_hold_is_refused(bad, chunk_bytes):
    """max_in_flight bounds the chunks accepted and unfinished, max_in_flight * chunk_bytes bytes
    of items and results: a bound no host's memory could reach (above 2**50 bytes) bounds nothing
    and is refused, naming the largest accepted and what to give."""
    with pytest.raises(ValueError) as info:
        rf.Pipeline(f_affine, device=sim(), chunk_bytes=chunk_bytes, slots=1, max_in_flight=bad)
    text = str(info.value)
    most = (1 << 50) // (chunk_bytes or 8 << 20)
    assert text.startswith(f"max_in_flight must be between 1 and {most}, got {bad}; "), text
    assert "chunk_bytes" in text and "None" in text, text


@pytest.mark.parametrize("most,chunk_bytes", [(2 ** 40, 1024), (2 ** 27, None)])
def test_max_in_flight_up_to_what_a_host_could_hold_is_taken(most, chunk_bytes):
    with rf.Pipeline(f_affine, device=sim(), chunk_bytes=chunk_bytes, slots=1, max_in_flight=most) as pipe:
        assert pipe.config.max_in_flight == most
        assert np.array_equal(pipe.submit(np.arange(4.0)).result(), expected(f_affine, np.arange(4.0)))


def test_max_in_flight_of_infinity_is_refused_as_no_integer():
    with pytest.raises(TypeError, match=r"max_in_flight must be an integer, got inf \(float\)"):
        rf.Pipeline(f_affine, device=sim(), chunk_bytes=1024, slots=1, max_in_flight=float("inf"))


@pytest.mark.parametrize("kw,exc,match", [
    ({"chunk_bytes": 0}, ValueError, "chunk_bytes"),
    ({"on_error": "ignore"}, ValueError, "on_error"),
    ({"slots": 0}, ValueError, "slots must be between 1"),
    ({"slots": "2"}, TypeError, "slots"),
    ({"slots": True}, TypeError, "slots"),
    ({"slots": rf.SlotCounts(1, 1, 1, 1), "inplace": True}, ValueError, "device_out"),
    ({"slots": rf.SlotCounts(1, 1, 0, 1)}, ValueError, "device_out"),
])
def test_bad_options(kw, exc, match):
    dev = sim()
    with pytest.raises(exc, match=match):
        rf.Pipeline(f_affine, device=dev, **{"chunk_bytes": 1024, "slots": 1, **kw})
    assert dev.live().total == 0  # nothing leaked by a refused construction


def test_compute_must_be_callable():
    with pytest.raises(TypeError, match="callable"):
        rf.Pipeline("f", device=sim())


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex128])
@pytest.mark.parametrize("inplace", [False, True])
def test_slots_of_an_odd_size_still_hand_compute_aligned_arrays(dtype, inplace):
    """chunk_bytes=1001 once put device slot i at byte i * 1001: numpy computed right on the
    misaligned arrays there, a GPU kernel would stop with a misaligned-address error (a launch
    argument at such an offset is refused now). Every device slot starts on a 256-byte boundary."""
    offsets = []

    def f(x, y):
        offsets.extend(a.__array_interface__["data"][0] % 256 for a in (x, y))
        y[...] = x * 2

    item = np.arange(1001 // np.dtype(dtype).itemsize, dtype=dtype)
    with rf.Pipeline(f, device=sim(), chunk_bytes=1001, slots=3, checked=True, inplace=inplace) as pipe:
        futures = [pipe.submit(item) for _ in range(6)]
        assert all(np.array_equal(fut.result(), item * 2) for fut in futures)
    assert len(offsets) == 12 and set(offsets) == {0}


def test_item_larger_than_slot_refused_before_acceptance():
    dev = sim()
    pipe = rf.Pipeline(f_affine, device=dev, chunk_bytes=1024, slots=1, checked=True)
    ok = pipe.submit(np.zeros(10, np.float32))
    with pytest.raises(ValueError, match=r"2000 bytes .*slot of 1024 bytes; raise chunk_bytes to at least 2000"):
        pipe.submit(np.zeros(500, np.float32))
    assert pipe.stats().accepted == 1
    assert np.array_equal(ok.result(), np.ones(10, np.float32))
    with pytest.raises(TypeError, match="numpy arrays"):
        pipe.submit([1, 2, 3])
    pipe.close()


def test_item_larger_than_slot_in_map_ends_accepted_chunks():
    dev = sim()
    pipe = rf.Pipeline(f_affine, device=dev, chunk_bytes=1024, slots=1, checked=True)
    items = [np.arange(8, dtype=np.float64) + i for i in range(5)] + [np.zeros(200, np.float64)]
    got = []
    with pytest.raises(ValueError, match=r"1600 bytes .*raise chunk_bytes to at least 1600"):
        for y in pipe.map(items):
            got.append(y)
    s = pipe.stats()
    assert s.in_flight == 0 and s.balanced() and s.accepted == 5
    for y, x in zip(got, items):
        assert np.array_equal(y, x * 3 + 1)
    pipe.close()


def test_map_rejects_non_array_items():
    pipe = rf.Pipeline(f_affine, device=sim(), chunk_bytes=1024, slots=1)
    with pytest.raises(TypeError, match="numpy arrays"):
        list(pipe.map([np.zeros(3), "nope"]))
    assert pipe.stats().in_flight == 0 and pipe.stats().balanced()
    pipe.close()


# -- backpressure --------------------------------------------------------------------------------
class Counting:
    """An input generator that records, at each pull, how many results the caller had taken."""

    def __init__(self, items):
        self.items = items
        self.pulls = 0
        self.taken = 0
        self.gaps = []

    def __iter__(self):
        for item in self.items:
            self.gaps.append(self.pulls - self.taken)
            self.pulls += 1
            yield item


def stalled_consumer(seconds):
    def consume(index, item, view):
        charge(seconds)
        return np.array(view, copy=True)
    return consume


@pytest.mark.parametrize("max_in_flight", [1, 3, None])
def test_map_pulls_input_only_as_capacity_frees(max_in_flight):
    dev = sim(1)
    pipe = rf.Pipeline(f_affine, device=dev, chunk_bytes=1024, slots=rf.SlotCounts(1, 1, 1, 2),
                       max_in_flight=max_in_flight, consume=stalled_consumer(0.5), checked=True)
    bound = pipe.config.max_in_flight
    src = Counting([np.arange(16.0) + i for i in range(40)])
    gen = pipe.map(src)
    for k, y in enumerate(gen):
        assert np.array_equal(y, (np.arange(16.0) + k) * 3 + 1)
        src.taken += 1
        # never more accepted and not yet handed out than the bound
        assert src.pulls - src.taken <= bound
        assert pipe.stats().in_flight <= bound
    assert src.pulls == 40
    assert max(src.gaps) <= bound - 1  # at each pull fewer than `bound` items were outstanding
    assert max(src.gaps) == bound - 1  # and the bound was actually reached (the consumer is slow)
    pipe.close()


def test_stalled_consumer_stops_intake_and_memory_stays_bounded():
    dev = sim(2)
    counts = rf.SlotCounts(2, 1, 1, 2)
    chunk = 2048
    samples = []
    with _testing.inject(slot_hook=lambda *a: samples.append(dev.live())):
        pipe = rf.Pipeline(f_affine, device=dev, chunk_bytes=chunk, slots=counts, max_in_flight=6,
                           consume=stalled_consumer(1.0), checked=True)
    rings = pipe.scheduler.rings
    pinned = sum(r.buffer.nbytes for r in rings if r.buffer.is_host)
    assert pinned == counts.pinned_slots * chunk == (counts.host_in + counts.host_out) * chunk
    futs = []
    for i in range(6):
        futs.append(pipe.submit(np.arange(100.0) + i, timeout=0))
    # full: nothing can finish within a non-blocking pass while the consumer stalls
    for _ in range(3):
        with pytest.raises(TimeoutError):
            pipe.submit(np.arange(3.0), timeout=0)
        for _ in range(50):
            pipe._step()
        assert pipe.stats().accepted == 6 and pipe.stats().in_flight == 6
    # the chunks that cannot advance wait without taking memory: pinned and device allocations
    # never grow beyond the rings made at construction
    assert all(s.host_buffers == 2 and s.device_buffers == 2 for s in samples)
    for i, fut in enumerate(futs):
        assert np.array_equal(fut.result(), (np.arange(100.0) + i) * 3 + 1)
    pipe.close()


def test_submit_timeout_when_full():
    # timeouts count on the device's host clock: virtual seconds on the sim
    dev = sim(3)
    pipe = rf.Pipeline(f_affine, device=dev, chunk_bytes=1024, slots=1, max_in_flight=2,
                       consume=stalled_consumer(2.0), checked=True)
    a = pipe.submit(np.arange(4.0))
    b = pipe.submit(np.arange(4.0) + 1)
    t0 = dev.now
    with pytest.raises(TimeoutError, match="timed out after 0.5 s"):
        pipe.submit(np.arange(4.0) + 2, timeout=0.5)
    assert 0.5 <= dev.now - t0 < 0.7
    assert pipe.stats().accepted == 2 and not a.done()
    # with a long enough timeout the submit waits for the first consumer, then is accepted
    c = pipe.submit(np.arange(4.0) + 2, timeout=5.0)
    assert a.done() and dev.now - t0 >= 2.0 * 0.75  # chaos varies durations by up to 25%
    for k, fut in enumerate((a, b, c)):
        assert np.array_equal(fut.result(), (np.arange(4.0) + k) * 3 + 1)
    pipe.close()


def test_future_result_timeout():
    dev = sim(3)
    pipe = rf.Pipeline(f_affine, device=dev, chunk_bytes=1024, slots=1, consume=stalled_consumer(1.0))
    fut = pipe.submit(np.arange(4.0))
    with pytest.raises(TimeoutError):
        fut.result(timeout=0.2)
    assert np.array_equal(fut.result(timeout=2.0), np.arange(4.0) * 3 + 1)
    pipe.close()


def test_submit_blocks_until_capacity_then_accepts():
    pipe = rf.Pipeline(f_affine, device=sim(4), chunk_bytes=1024, slots=1, max_in_flight=1,
                       consume=stalled_consumer(0.01))
    futs = [pipe.submit(np.arange(4.0) + i) for i in range(5)]  # each waits for the one before
    assert [f.done() for f in futs] == [True] * 4 + [False]
    assert np.array_equal(futs[-1].result(), (np.arange(4.0) + 4) * 3 + 1)
    pipe.close()


def test_default_workers_request_streams_get_few_bulk_jobs_get_a_core_each(monkeypatch):
    """Whole-array jobs split one copy over many chunks (a worker per core but one); request
    streams keep at most 4 busy threads, which contend with the scheduler for the GIL."""
    import types

    from ringflow._pipeline import sizing

    gpu = types.SimpleNamespace(backend="cuda")
    monkeypatch.setattr(sizing, "host_cpus", lambda: 16)
    assert sizing.default_workers(gpu, bulk=True) == 15
    assert sizing.default_workers(gpu, bulk=False) == 4
    monkeypatch.setattr(sizing, "host_cpus", lambda: 3)
    assert sizing.default_workers(gpu, bulk=True) == 2
    assert sizing.default_workers(gpu, bulk=False) == 2
    monkeypatch.setattr(sizing, "host_cpus", lambda: 64)
    assert sizing.default_workers(gpu, bulk=True) == 16
    assert sizing.default_workers(types.SimpleNamespace(backend="sim"), bulk=False) == 4


def test_the_module_examples_run():
    import doctest

    from ringflow._pipeline import api as api_module, whole_array

    for module in (api_module, whole_array):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals reach the main thread")
@pytest.mark.parametrize("devices", [1, 2])
def test_a_ctrl_c_anywhere_in_a_pipelines_set_up_leaves_no_progress_thread_running(devices):
    """A Ctrl-C at any instruction of ``Pipeline(...)`` where CPython raises it: the pipeline is
    not made, and what its set-up had made is released at once. Between its progress thread's
    start and the pipeline's finaliser (or, over several devices, once a part was made and
    before the dispatcher was whole) a Ctrl-C left a progress thread running that nothing could
    reach or end, and the parts' device memory with it."""
    from tests.helpers.interrupts import InterruptAt

    files = ["/ringflow/_pipeline/api.py", "/ringflow/_pipeline/driver.py", "/ringflow/_pipeline/spread.py"]
    n, fired = 0, 0
    while True:
        devs = [rf.device("sim", seed=70 + k) for k in range(devices)]
        before = {t for t in threading.enumerate() if t.name.startswith("ringflow-progress")}
        with warnings.catch_warnings():
            warnings.simplefilter("error", ResourceWarning)
            with InterruptAt(n, ["__init__"], files=files, sigint=True) as at:
                try:
                    pipe = rf.Pipeline(lambda x, y: np.multiply(x, 2, out=y), device=devs if devices > 1 else devs[0],
                                       chunk_bytes=4096)
                except KeyboardInterrupt:
                    pipe = None
            if pipe is not None:
                assert not at.fired
                np.testing.assert_array_equal(pipe.submit(np.arange(8.0)).result(), np.arange(8.0) * 2)
                pipe.close()
            gc.collect()
        left = [t for t in threading.enumerate() if t.name.startswith("ringflow-progress") and t not in before]
        for t in left:
            t.join(JOIN_S)
        assert not [t for t in left if t.is_alive()], (n, at.functions[n:n + 1])
        for dev in devs:
            assert dev.live().total == 0, (n, at.functions[n:n + 1], dev.live())
        if not at.fired:
            break
        fired += 1
        n += 1
    assert fired > 5  # the sweep reached the set-up's steps


@pytest.mark.parametrize("devices", [1, 2], ids=["one device", "two devices"])
def test_a_report_that_resets_starts_a_new_window_so_a_long_lived_profile_stays_bounded(devices):
    """``report(reset=True)`` reports the chunks ended since the last reset and forgets them: a
    profiled pipeline that serves for hours keeps only the records of its current window, and
    each window's report covers its own chunks (its measured time and host time per chunk too)."""
    devs = [sim(seed=k) for k in range(devices)]
    rows = 1 << 12
    with rf.Pipeline(f_copy, device=devs[0] if devices == 1 else devs, chunk_bytes=rows * 4, profile=True) as pipe:
        ended = [0.0] * devices
        for window in range(3):
            x = np.arange(8 * rows, dtype=np.float32) + window
            items = [x[i:i + rows] for i in range(0, x.size, rows)]
            assert all(np.array_equal(got, want) for got, want in zip(pipe.map(items), items, strict=True))
            report = pipe.report(reset=True)
            assert report.chunks == 8, f"window {window} reports its own chunks"
            parts = report.reports if devices > 1 else [report]
            assert all(part.timeline.start >= ended[k] for k, part in enumerate(parts) if part.chunks), \
                "and no earlier window's (on each device's clock)"
            ended = [max(ended[k], part.timeline.end) for k, part in enumerate(parts)]
        left = pipe.report()
        assert left.chunks == 0, "a reset forgets what it reported"
        parts = left.reports if devices > 1 else [left]
        assert not any(part.stall_s for part in parts), "and the stalls of that window"
        with pytest.raises(TypeError, match="reset must be True or False"):
            pipe.report(reset="yes")


def test_a_reports_timeline_is_its_own_so_editing_it_changes_neither_the_pipeline_nor_later_reports():
    """A report's timeline meta held the pipeline's own slot counts (the SlotCounts' attributes):
    annotating a report changed ``pipe.config.slots`` and every later report."""
    with rf.Pipeline(f_copy, device=sim(), chunk_bytes=CHUNK, profile=True) as pipe:
        slots = dataclasses.replace(pipe.config.slots)
        list(pipe.map([np.arange(64.0)] * 4))
        report = pipe.report(reset=True)
        want = dict(report.timeline.meta["slots"])
        report.timeline.meta["slots"]["device_in"] = 99
        report.timeline.meta["workers"] = -1
        assert pipe.config.slots == slots
        later = pipe.report()
        assert later.timeline.meta["slots"] == want and later.timeline.meta["workers"] == pipe.config.workers


@pytest.mark.parametrize("door", ["submit", "map"])
def test_a_device_closed_under_an_idle_pipeline_is_named_by_the_next_call(door):
    """The next call raised the device's own "this simulated device is closed; create a new
    one", which does not say it is the pipeline's device; the pipeline still closes."""
    dev = rf.device("sim")
    pipe = rf.Pipeline(lambda x, y: np.multiply(x, 2, out=y), device=dev)
    x = np.ones(256, np.float32)
    assert np.array_equal(pipe.submit(x).result(), 2 * x)
    dev.close()
    with pytest.raises(RuntimeError, match=r"the pipeline's device \(.*\) is closed.*close the pipeline before"):
        if door == "submit":
            pipe.submit(x)
        else:
            next(iter(pipe.map([x])))
    pipe.close()


@pytest.mark.parametrize("how", [pickle.dumps, copy.copy, copy.deepcopy], ids=["pickle", "copy", "deepcopy"])
@pytest.mark.parametrize("devices", [1, 2], ids=["one device", "two devices"])
def test_a_pipeline_refuses_to_be_pickled_or_copied_and_says_what_to_do(how, devices):
    """A Pipeline owns a progress thread, streams and pinned memory: a copy was a second face on
    the same scheduler (closing it closed the original, whose own close() then raised the
    driver's ThreadEnded), and pickling failed on a lock with no word of the pipeline. Both are
    refused with a TypeError that names the pipeline and what to do; the original works on."""
    device = [sim(40), sim(41)] if devices == 2 else sim(40)
    pipe = rf.Pipeline(f_affine, device=device, chunk_bytes=CHUNK)
    with pytest.raises(TypeError, match="a Pipeline cannot be (pickled|copied).*any thread.*new Pipeline"):
        how(pipe)
    x = np.arange(16.0)
    assert np.array_equal(pipe.submit(x).result(timeout=JOIN_S), x * 3 + 1)
    pipe.close()
    pipe.close()
    assert pipe.stats().delivered == 1
