"""``ringflow.host``: pinned arrays from the caching pool, and ``stream_map`` using them in place."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import numpy as np
import pytest

import ringflow as rf
from ringflow import _host
from ringflow._device import host_pool
from ringflow._pipeline import whole_array
from tests.helpers.hooks import engines
from tests.helpers.threads import join, start
from tests.helpers.one_side import slow_registration


def f(x, y):
    y[:] = x * 2 + 1


@pytest.fixture
def default_sim(monkeypatch):
    """A simulated GPU as the default device of ``ringflow.host``."""
    dev = rf.device("sim", chaos=True, seed=3)
    monkeypatch.setattr(_host, "_default_device", dev)
    return dev


@pytest.fixture
def layouts(monkeypatch):
    """The layout (host strategy and chunking) of every whole-array call made in the test."""
    seen = []
    plan = whole_array.MapLayout.plan

    def spy(*args, **kwargs):
        seen.append(plan(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(whole_array.MapLayout, "plan", spy)
    return seen


@pytest.fixture
def host_calls(monkeypatch):
    """Wrap a device's allocate_host and register_host to list the calls made through them."""
    calls = []

    def watch(dev):
        for name in ("allocate_host", "register_host"):
            real = getattr(dev, name)

            def wrapped(arg, _real=real, _name=name):
                calls.append(_name)
                return _real(arg)

            monkeypatch.setattr(dev, name, wrapped)
        return calls

    return watch


def test_host_is_public_and_its_arrays_are_plain_pinned_numpy(default_sim):
    assert "host" in rf.__all__ and rf.host is _host
    x = rf.host.empty((100, 3), np.float32)
    assert type(x) is np.ndarray and x.shape == (100, 3) and x.dtype == np.float32
    assert rf.host.buffer(x) is not None and rf.host.buffer(x).holds(x)
    assert host_pool.device_of(x) is default_sim  # the default device, made once and kept
    y = rf.host.empty_like(x)
    assert host_pool.device_of(y) is default_sim and y.shape == x.shape and y.dtype == x.dtype
    z = rf.host.empty_like(np.zeros((2, 2), np.int8), np.float64)
    assert z.dtype == np.float64 and rf.host.buffer(z) is not None
    s = rf.host.stats()
    assert s.in_use_bytes == 2 * host_pool.size_class(1200) + 512 and s.allocations == 3 and set(s.as_dict()) >= {
        "budget", "cached_bytes", "in_use_bytes", "pending_bytes", "allocations", "hits", "fallbacks", "held_bytes"}
    assert rf.host.buffer(np.zeros(3)) is None


def test_stream_map_uses_pooled_arrays_in_place_without_staging_or_registering(default_sim, layouts, host_calls):
    dev = default_sim
    x = rf.host.empty((999, 13), np.float32)
    x[:] = np.random.default_rng(0).uniform(0.5, 1.5, x.shape)
    out = rf.host.empty_like(x)
    calls = host_calls(dev)
    ops = []
    dev.add_op_observer(lambda op: ops.append(op.label))
    with engines() as seen:
        y = rf.stream_map(f, x, out=out, chunk_bytes=13 * 4 * 100)  # no device: x's
    assert y is out and np.array_equal(y, x * 2 + 1)
    assert [lay.strategy for lay in layouts] == ["pinned"] and layouts[0].device is dev
    assert calls == []  # no staging ring, no registration
    assert type(seen[0]).__name__ == "DirectSchedule"
    # ten chunks (too few to move in copy groups): ten copies each way, all of x's bytes
    copied = {d: [int(lbl.split()[2]) for lbl in ops if lbl.startswith(f"copy {d}")] for d in ("h2d", "d2h")}
    assert sum(copied["h2d"]) == sum(copied["d2h"]) == x.nbytes and len(copied["h2d"]) == len(copied["d2h"]) == 10
    # the call has completed every copy when it returns: the result's block is free once dropped
    out_buf = rf.host.buffer(out)
    del y, out
    assert rf.host.stats().cached_bytes == out_buf.nbytes
    again = rf.host.empty_like(x)
    assert rf.host.buffer(again) is out_buf  # checked: its hand-out is ordered after the call's copies


@pytest.mark.parametrize("seed", range(3))
def test_pooled_arrays_in_place_under_chaos_checked_and_in_place(seed, layouts):
    dev = rf.device("sim", chaos=True, seed=seed)
    x = rf.host.empty(5000, np.float64, device=dev)
    x[:] = np.arange(5000)
    out = rf.host.empty_like(x)
    assert rf.stream_map(f, x, out=out, device=dev, chunk_bytes=4096, checked=True) is out
    assert np.array_equal(out, np.arange(5000) * 2 + 1)
    assert rf.stream_map(f, x, out=x, device=dev, chunk_bytes=4096, engine="pipeline") is x  # in place
    assert np.array_equal(x, np.arange(5000) * 2 + 1)
    assert [lay.strategy for lay in layouts] == ["pinned", "pinned"]
    rf.drop_warm_pipelines(dev)
    del x, out
    gc.collect()
    s = rf.host.stats(device=dev)
    block = host_pool.size_class(40000)
    assert s.in_use_bytes == 0 and s.cached_bytes == 2 * block
    assert dev.live().pooled_host_buffers == 2 and rf.host.release_cached(device=dev) == 2 * block
    assert dev.live().total == 0


@pytest.mark.parametrize("pooled", ["x", "out"])
def test_one_pooled_side_is_used_in_place_and_only_the_other_is_registered(pooled, layouts, host_calls):
    dev = rf.device("sim")
    data = np.random.default_rng(1).uniform(size=(400, 8))
    x = rf.host.empty(data.shape, device=dev) if pooled == "x" else data.copy()
    x[:] = data
    out = rf.host.empty_like(x, device=dev) if pooled == "out" else np.empty_like(x)
    calls = host_calls(dev)
    y = rf.stream_map(f, x, out=out, device=dev, chunk_bytes=4096, host="register")
    assert np.array_equal(y, data * 2 + 1)
    # the pageable side only: pinned memory cannot be pinned again (a real GPU refuses)
    assert layouts[0].strategy == "register" and calls == ["register_host"]
    assert dev.live().pooled_host_buffers == 1 and dev.live().host_buffers == 0  # the pool's block; the registration is closed
    assert rf.host.stats(device=dev).in_use_bytes == host_pool.size_class(data.nbytes)


@pytest.mark.parametrize("pooled", ["x", "out"])
@pytest.mark.parametrize("seed", range(3))
def test_one_pooled_side_is_used_in_place_and_only_the_other_is_staged(pooled, seed, layouts):
    """A pool array on one side and ordinary memory on the other: where staging beats registering
    (a host that registers slowly), only the ordinary side goes through a pinned ring and a CPU
    copy; the copy engines read or write the pool array in place. Checked under chaos."""
    dev = rf.device("sim", chaos=True, seed=seed, profile=slow_registration("h200-pcie5"))
    data = np.random.default_rng(seed).uniform(0.5, 1.5, 3 << 20).astype(np.float32)
    x = rf.host.empty_like(data, device=dev) if pooled == "x" else data.copy()
    x[:] = data
    out = rf.host.empty_like(data, device=dev) if pooled == "out" else np.empty_like(data)
    with engines() as seen:
        y = rf.stream_map(f, x, out=out, device=dev, chunk_bytes=4 << 20, workers=16, checked=True)
    assert y is out and np.array_equal(y, data * 2 + 1)
    assert layouts[0].strategy == "stage" and layouts[0].in_place == (pooled == "x", pooled == "out")
    sched = seen[0].scheduler
    assert (sched.host_in.external, sched.host_out.external) == (pooled == "x", pooled == "out")
    assert dev.live().host_buffers == 0  # the staging ring is gone with the checked call's pipeline


def test_a_mapjob_with_one_pooled_side_stages_only_the_other_call_after_call():
    dev = rf.device("sim", chaos=True, seed=6, profile=slow_registration("h200-pcie5"))
    x = np.empty(3 << 20, np.float32)
    out = rf.host.empty_like(x, device=dev)
    # a pinned budget under x's 12 MiB: host="auto" stages x rather than pin it for the job's life
    with rf.MapJob(f, x, out, device=dev, chunk_bytes=4 << 20, workers=16, pinned_budget=8 << 20) as job:
        assert (job.strategy, job.engine) == ("stage", "pipeline")
        for k in range(3):
            x[:] = np.random.default_rng(k).uniform(0.5, 1.5, x.size)
            assert job() is out and np.array_equal(out, x * 2 + 1)
    assert dev.live().host_buffers == 0


def test_one_pooled_side_with_a_strided_input_a_failing_chunk_and_ctrl_c():
    """The pooled result used in place while the other side is staged: a strided input is
    staged row by row; with on_error="continue" the other chunks land and the call raises the
    failed chunk's error; a KeyboardInterrupt in the compute reaches the caller and leaves
    nothing of the call alive."""
    dev = rf.device("sim", chaos=True, seed=2)
    data = np.random.default_rng(0).uniform(0.5, 1.5, 6 << 20).astype(np.float32)
    x = data[::2]
    out = rf.host.empty(x.shape, np.float32, device=dev)
    assert np.array_equal(rf.stream_map(f, x, out=out, device=dev, chunk_bytes=4 << 20, workers=16, checked=True),
                          x * 2 + 1)

    def negative_fails(a, b):
        if a.reshape(-1)[0] < 0:
            raise ValueError("negative")
        b[...] = a * 2 + 1

    x2 = data[:3 << 20].copy()
    x2[1 << 20] = -1  # the first row of chunk 1
    with pytest.raises(rf.StageError) as info:
        rf.stream_map(negative_fails, x2, out=out, device=dev, chunk_bytes=4 << 20, workers=16,
                      on_error="continue", checked=True)
    assert (info.value.stage, info.value.index) == ("compute", 1)
    assert np.array_equal(out[:1 << 20], x2[:1 << 20] * 2 + 1) and np.array_equal(out[2 << 20:], x2[2 << 20:] * 2 + 1)

    def interrupted(a, b):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        rf.stream_map(interrupted, x2, out=out, device=dev, chunk_bytes=4 << 20, workers=16)
    rf.drop_warm_pipelines(dev)
    assert dev.live().total == 0


def test_warm_pipelines_keep_apart_a_pooled_and_an_ordinary_result():
    """Two calls of one shape, one writing a pool array in place and one staging an ordinary
    result, are different pipelines in the warm cache: each call gets the right rings."""
    dev = rf.device("sim", chaos=True, seed=4)
    data = np.random.default_rng(4).uniform(0.5, 1.5, 3 << 20).astype(np.float32)
    pooled = rf.host.empty_like(data, device=dev)
    for k in range(2):
        for out in (pooled, np.empty_like(data)):
            y = rf.stream_map(f, data + k, out=out, device=dev, chunk_bytes=4 << 20, workers=16)
            assert y is out and np.array_equal(y, (data + k) * 2 + 1)
    rf.drop_warm_pipelines(dev)


def test_a_pooled_x_with_a_fresh_out_and_explicit_staging(layouts, host_calls):
    dev = rf.device("sim")
    x = rf.host.empty(1 << 14, np.float32, device=dev)
    x[:] = 1
    y = rf.stream_map(f, x, device=dev, chunk_bytes=1 << 13)  # out allocated as before: pageable
    assert rf.host.buffer(y) is None and (y == 3).all()
    out = rf.host.empty_like(x)
    z = rf.stream_map(f, x, out=out, device=dev, chunk_bytes=1 << 13, host="stage")
    assert (z == 3).all() and layouts[-1].strategy == "stage"  # asked for: honoured


def test_arrays_of_another_devices_pool_are_not_used_in_place(layouts):
    d1, d2 = rf.device("sim"), rf.device("sim")
    x = rf.host.empty(4096, np.float32, device=d1)
    x[:] = 2
    out = rf.host.empty_like(x)
    y = rf.stream_map(f, x, out=out, device=d2, chunk_bytes=4096)
    assert (y == 5).all() and layouts[0].strategy != "pinned"
    assert rf.host.stats(device=d2).allocations == 0


def test_mapjob_takes_the_pool_buffers():
    dev = rf.device("sim")
    x = rf.host.empty(2048, np.float32, device=dev)
    out = rf.host.empty_like(x)
    with rf.MapJob(f, x, out, device=dev, chunk_bytes=2048, x_buffer=rf.host.buffer(x),
                   out_buffer=rf.host.buffer(out)) as job:
        assert job.strategy == "pinned"
        for k in range(3):
            x[:] = k
            assert (job() == 2 * k + 1).all()


def copy_pending_into_a_pooled_array(dev):
    """A 1 MiB pool array of ``dev`` with a d2h into it enqueued behind a one-second kernel and
    recorded with ``record_use``: ``(array, its buffer, the copy's stream, its event)``."""
    stream = dev.create_stream()
    d = dev.allocate(1 << 20)
    stream.launch(lambda a: a.fill(9), d.array(np.uint8, 1 << 20), sim_seconds=1.0)
    result = rf.host.empty(1 << 20, np.uint8, device=dev)
    buf = rf.host.buffer(result)
    stream.copy(buf, d)
    ev = stream.record()
    assert rf.host.record_use(result, ev) is True
    return result, buf, stream, ev


def test_record_use_holds_memory_for_your_own_copies():
    dev = rf.device("sim")
    result, buf, stream, _ = copy_pending_into_a_pooled_array(dev)
    del result
    assert rf.host.stats(device=dev).pending_bytes == 1 << 20
    other = rf.host.empty(1 << 20, np.uint8, device=dev)
    assert rf.host.buffer(other) is not buf
    assert rf.host.collect(device=dev, wait=True) == 1 << 20
    assert rf.host.record_use(np.zeros(3), stream.record()) is False
    with pytest.raises(TypeError, match="event"):
        rf.host.record_use(np.zeros(3), "not an event")
    with pytest.raises(TypeError, match="numpy array"):
        rf.host.record_use([0], stream.record())


def test_set_budget_applies_to_every_pool_and_empty_falls_back(monkeypatch):
    monkeypatch.setattr(host_pool, "_default_budget", None)
    d1 = rf.device("sim")
    a = rf.host.empty(1 << 20, np.uint8, device=d1)
    rf.host.set_budget(1 << 20)
    try:
        assert rf.host.stats(device=d1).budget == 1 << 20
        d2 = rf.device("sim")
        assert rf.host.stats(device=d2).budget == 1 << 20  # and pools made later
        b = rf.host.empty(1 << 20, np.uint8, device=d1)
        assert rf.host.buffer(b) is None and rf.host.stats(device=d1).fallbacks == 1
        rf.host.set_budget(8 << 20, device=d2)
        assert (rf.host.stats(device=d1).budget, rf.host.stats(device=d2).budget) == (1 << 20, 8 << 20)
    finally:
        for pool in host_pool.pools():
            pool.set_budget(host_pool.default_budget())
    del a


@pytest.mark.parametrize("view", [False, True], ids=["array", "view"])
def test_a_buffer_taken_on_another_thread_than_the_hand_out_is_ordered_after_it(view):
    """Copies of your own on a device's streams (as the record_use example makes them) of an array
    handed out on another thread and passed on by a join, which the checker cannot see:
    ``buffer`` orders the taking thread after the hand-out, as stream_map taking the array in
    does; the copy was a HazardError on the simulated GPU."""
    dev = rf.device("sim", checked=True)
    (a,) = join([start(lambda: rf.host.empty(1 << 16, np.uint8, device=dev))])
    if view:
        a = a[4096:]  # a view from another byte: the buffer is still its block's
    stream = dev.create_stream()
    d = dev.allocate(1 << 16)
    buf = rf.host.buffer(a)
    stream.copy(d, buf)
    assert rf.host.record_use(a, stream.record())
    stream.copy(buf, d)
    stream.sync()


@pytest.mark.parametrize("call, error, match", [
    (lambda: rf.host.empty(4, device="sim"), TypeError, "takes a Device, not the spec 'sim'"),
    (lambda: rf.host.empty(4, device=3), TypeError, "Device or None"),
    (lambda: rf.host.empty_like([1, 2]), TypeError, "numpy array"),
    (lambda: rf.host.buffer("x"), TypeError, "numpy array"),
    (lambda: rf.host.set_budget(0), ValueError, "positive"),
    (lambda: rf.host.set_budget(2.5), TypeError, "int"),
    (lambda: rf.host.empty(-2, device=rf.device("sim")), ValueError, "negative"),
    (lambda: rf.host.empty(3, object, device=rf.device("sim")), TypeError, "Python objects"),
    # strings numpy parses as a structure and refuses with a SyntaxError of its own
    (lambda: rf.host.empty(3, ",", device=rf.device("sim")), TypeError, "is not a numpy dtype"),
    (lambda: rf.host.empty(3, b"i4,(2", device=rf.device("sim")), TypeError, "is not a numpy dtype"),
    (lambda: rf.host.empty((2**40, 2**40), device=rf.device("sim")), MemoryError, r"host\.empty\(shape=.*smaller shape"),
    (lambda: rf.host.set_budget("lots"), TypeError, r"set_budget\(nbytes\)"),
    # the message shows the value, not only its type: a NaN and a float of whole bytes read alike
    (lambda: rf.host.set_budget(float("nan")), TypeError,
     r"ringflow\.host\.set_budget\(nbytes\) must be an int number of bytes, got nan \(float\); give a whole number"),
    (lambda: rf.host.set_budget(4e9, device=rf.device("sim")), TypeError,
     r"ringflow\.host\.set_budget\(nbytes\) must be an int number of bytes, got 4000000000\.0 \(float\); give a whole"),
    (lambda: rf.host.set_budget(-1, device=rf.device("sim")), ValueError,
     r"ringflow\.host\.set_budget\(nbytes\) must be a positive number of bytes, got -1"),
    (lambda: rf.host.collect(wait="no", device=rf.device("sim")), TypeError, "wait must be True or False"),
    (lambda: rf.host.collect(wait=float("nan"), device=rf.device("sim")), TypeError, "wait must be True or False"),
])
def test_hostile_input_is_refused_by_name(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("budget", [None, 1024])
def test_the_pooled_default_out_switch(monkeypatch, layouts, budget):
    """``whole_array.POOLED_OUT`` (off by default) makes a missing ``out`` a pool array that the
    copy engines write in place; a request the pool cannot serve still gets an ordinary array."""
    dev = rf.device("sim")
    x = rf.host.empty((300, 5), np.float32, device=dev)
    x[:] = 4
    if budget is not None:  # x's block stays; nothing more fits
        rf.host.set_budget(budget, device=dev)
    y = rf.stream_map(f, x, chunk_bytes=2000)
    assert rf.host.buffer(y) is None and layouts[-1].strategy != "pinned"  # off: as before
    monkeypatch.setattr(whole_array, "POOLED_OUT", True)
    y = rf.stream_map(f, x, chunk_bytes=2000)
    assert (y == 9).all() and y.shape == x.shape and y.dtype == x.dtype
    if budget is None:
        assert rf.host.buffer(y) is not None and layouts[-1].strategy == "pinned"
        assert rf.stream_map(f, np.ones(10), device=dev).flags.c_contiguous  # a pageable x: out pooled
    else:
        assert rf.host.buffer(y) is None and rf.host.stats(device=dev).fallbacks == 1


@pytest.mark.parametrize("call", [
    lambda: rf.host.empty(3, object),
    lambda: rf.host.empty(-2, np.float32),
    lambda: rf.host.empty("3", np.float32),
    lambda: rf.host.empty_like(np.zeros(3), object),
], ids=["dtype", "negative", "shape", "empty_like dtype"])
def test_a_refused_shape_or_dtype_makes_no_default_device(monkeypatch, call):
    """A call refused for its own arguments has no side effect: the default device (made once and
    kept for the process) is not made for it."""
    monkeypatch.setattr(_host, "_default_device", None)
    monkeypatch.setenv("RINGFLOW_DEVICE", "sim")
    with pytest.raises((TypeError, ValueError)):
        call()
    assert _host._default_device is None


@pytest.mark.parametrize("shape, expect", [
    (np.array(3), (3,)), (np.array(0, np.uint8), (0,)), (np.int64(3), (3,)), ((np.array(2), 3), (2, 3)),
])
def test_a_shape_numpy_empty_takes_as_an_int_is_taken(shape, expect):
    """A 0-d integer array is an int to ``numpy.empty`` (it has ``__index__``), alone as well as
    in a sequence."""
    a = rf.host.empty(shape, np.float32, device=rf.device("sim"))
    assert a.shape == expect == np.empty(shape, np.float32).shape


def test_a_0d_array_that_is_no_int_is_still_refused_as_a_shape():
    for shape in (np.array(2.0), np.array(True)):
        with pytest.raises(TypeError, match="shape must be an int or a sequence of ints"):
            rf.host.empty(shape, device=rf.device("sim"))


_FORK_CHILD = """
import os, sys, numpy as np, ringflow as rf
from tests.helpers.forks import leave_child
os.environ["RINGFLOW_DEVICE"] = "sim"
a = rf.host.empty(1000, np.float32)  # the default device's pool
dev = rf.device("sim")
b = rf.host.empty(1000, np.float32, device=dev)
del b  # its return is queued, to be taken back at the pool's next call
pid = os.fork()
if pid == 0:
    lines = []
    for name, call in (("default empty", lambda: rf.host.empty(10, np.float32).shape),
                       ("set_budget", lambda: rf.host.set_budget(1 << 20)),
                       ("own device", lambda: rf.host.empty(10, np.float32, device=rf.device("sim")).shape)):
        try:
            lines.append(f"{name}: {call()}")
        except Exception as exc:
            lines.append(f"{name}: {type(exc).__name__}: {exc}")
    leave_child(lines)
_, status = os.waitpid(pid, 0)
print("child status", status)
print("parent", rf.host.empty(10, np.float32).shape, rf.host.stats(device=dev).cached_bytes)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
@pytest.mark.parametrize("call, expect", [
    ("default empty", "default empty: (10,)"),
    ("set_budget", "set_budget: None"),
    ("own device", "own device: (10,)"),
])
def test_a_forked_child_uses_rf_host_with_devices_of_its_own(call, expect):
    """The parent's devices refuse the forked child's calls. ``rf.host.empty()`` there used the
    parent's default device, and ``rf.host.set_budget(n)`` the parent's pools, so both raised the
    parent device's fork error; the child now gets a default device of its own, and a budget
    for every pool of its own."""
    run = subprocess.run([sys.executable, "-c", _FORK_CHILD], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONWARNINGS": "ignore::DeprecationWarning"})
    out = run.stdout
    assert run.returncode == 0 and "child status 0" in out, out + run.stderr[-2000:]
    assert f"{expect}\n" in out, out
    assert "parent (10,) 4096" in out, out  # the parent's pools are as they were


def test_arrays_dropped_after_the_budget_is_lowered_below_in_use_are_freed_not_cached():
    """``set_budget`` below the bytes in use leaves those blocks in use; dropping them must not
    cache them above the budget: the pool holds at most its budget once they are taken back."""
    dev = rf.device("sim")
    arrays = [rf.host.empty(1 << 20, np.uint8, device=dev) for _ in range(4)]
    rf.host.set_budget(3 << 19, device=dev)  # room for one of the four blocks
    st = rf.host.stats(device=dev)
    assert (st.in_use_bytes, st.cached_bytes) == (4 << 20, 0)
    del arrays
    st = rf.host.stats(device=dev)
    assert st.in_use_bytes == 0 and st.pending_bytes == 0
    assert st.cached_bytes + st.in_use_bytes + st.pending_bytes <= st.budget, st
    assert st.cached_bytes == 1 << 20 and st.releases == 3  # the first one back fits; the rest are freed
    assert dev.live().pooled_host_buffers == 1
    again = rf.host.empty(1 << 20, np.uint8, device=dev)  # served from the block kept
    assert rf.host.buffer(again) is not None and rf.host.stats(device=dev).hits == 1


def test_a_block_dropped_over_the_budget_with_its_copy_pending_is_freed_only_once_the_copy_is_done():
    """Over the budget, a dropped block whose device copy is still pending stays pending (neither
    freed nor handed out) until the copy is done, and is freed then: the simulated GPU's checker
    sees the free ordered after the copy."""
    dev = rf.device("sim")
    result, buf, _, ev = copy_pending_into_a_pooled_array(dev)
    rf.host.set_budget(4096, device=dev)  # below the block in use
    del result
    st = rf.host.stats(device=dev)
    assert (st.pending_bytes, st.cached_bytes, st.releases) == (1 << 20, 0, 0) and not buf.closed
    assert rf.host.collect(device=dev) == 0 and not ev.is_done and not buf.closed
    other = rf.host.empty(1 << 20, np.uint8, device=dev)  # over the budget: pageable, not the pending block
    assert rf.host.buffer(other) is None
    assert rf.host.collect(device=dev, wait=True) == 0  # freed, not made ready for reuse
    st = rf.host.stats(device=dev)
    assert ev.is_done and buf.closed
    assert (st.pending_bytes, st.cached_bytes, st.in_use_bytes, st.releases) == (0, 0, 0, 1)
    assert dev.live().pooled_host_buffers == 0


def test_empty_like_of_an_array_whose_device_closed_names_that_device_and_what_to_pass():
    """``empty_like(a)`` takes ``a``'s device: once that device is closed the error says it is
    ``a``'s, and that ``device=`` picks another (the device's own message named neither)."""
    dev = rf.device("sim")
    a = rf.host.empty(1024, np.float32, device=dev)
    dev.close()
    with pytest.raises(RuntimeError, match=r"empty_like: the device of `a` .* is closed; pass device="):
        rf.host.empty_like(a)
    other = rf.device("sim")
    b = rf.host.empty_like(a, device=other)
    assert (b.shape, b.dtype) == (a.shape, a.dtype) and rf.host.buffer(b) is not None
    with pytest.raises(RuntimeError, match="closed"):
        rf.host.empty(4, device=dev)  # (as documented: a closed device is refused)
