"""Whole-array jobs (stream_map, MapJob) on arrays whose memory something else pins already."""

import gc
import re
import warnings

import numpy as np
import pytest

import ringflow as rf
from tests.helpers.threads import bounded


def f(x, y):
    y[...] = x * 2 + 1


def arrays(n: int = 1 << 16) -> tuple:
    x = np.arange(n, dtype=np.float32)
    return x, np.empty_like(x)


def test_auto_registers_these_arrays_when_nothing_pins_them():
    # the precondition of the tests below: with one worker and a given out, "auto" registers
    dev = rf.device("sim")
    x, out = arrays()
    with rf.MapJob(f, x, out, device=dev, workers=1) as job:
        assert job.strategy == "register"


@pytest.mark.parametrize("pinned_by", ["job", "register_host"])
@pytest.mark.parametrize("side", ["x", "out"])
def test_auto_stages_an_array_that_is_pinned_already(pinned_by, side):
    dev = rf.device("sim")
    x, out = arrays()
    target = x if side == "x" else out
    holder = (rf.MapJob(f, target, device=dev, host="register") if pinned_by == "job"
              else dev.register_host(target))
    try:
        y = rf.stream_map(f, x, out, device=dev, workers=1)
        assert y is out and np.array_equal(out, x * 2 + 1)
        out[...] = 0
        with rf.MapJob(f, x, out, device=dev, workers=1) as job:
            assert job.strategy == "stage"
            assert np.array_equal(job(), x * 2 + 1)
    finally:
        holder.close()


@pytest.mark.parametrize("door", ["stream_map", "MapJob"])
@pytest.mark.parametrize("side", ["x", "out"])
def test_register_refuses_an_array_pinned_already_by_name(door, side):
    dev = rf.device("sim")
    x, out = arrays()
    holder = dev.register_host(x if side == "x" else out)
    try:
        with pytest.raises(ValueError, match=rf"host='register' cannot pin {side}: .*pinned already.*"
                                             rf"{side}_buffer=.*host='stage'"):
            if door == "stream_map":
                rf.stream_map(f, x, out, device=dev, host="register")
            else:
                rf.MapJob(f, x, out, device=dev, host="register")
        # nothing of the refused call is left pinned: the other side can be pinned again
        other = dev.register_host(out if side == "x" else x)
        other.close()
    finally:
        holder.close()


def test_a_repeated_call_stages_an_array_pinned_since_the_call_before():
    # the second call has the first one's arguments, so it reuses the first call's plan (register)
    dev = rf.device("sim")
    x, out = arrays()
    rf.stream_map(f, x, out, device=dev, workers=1)
    with rf.MapJob(f, x, device=dev, host="register"):
        out[...] = 0
        assert np.array_equal(rf.stream_map(f, x, out, device=dev, workers=1), x * 2 + 1)
        with pytest.raises(ValueError, match="host='register' cannot pin x"):
            rf.stream_map(f, x, out, device=dev, workers=1, host="register")
    out[...] = 0
    assert np.array_equal(rf.stream_map(f, x, out, device=dev, workers=1), x * 2 + 1)


def test_shards_stage_an_array_pinned_already():
    from tests.helpers.sim import named_sims

    with named_sims(0, 1) as devs:
        x, out = arrays()
        holder = devs[0].register_host(x)
        try:
            y = rf.stream_map(f, x, out, device=devs, workers=1)
            assert y is out and np.array_equal(out, x * 2 + 1)
        finally:
            holder.close()


@pytest.mark.gpu
@pytest.mark.parametrize("door", ["stream_map", "MapJob"])
def test_on_a_gpu_register_refuses_pinned_memory_by_name_and_auto_stages_it(cuda_device, door):
    """The driver's own refusal (CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED) is the one the
    simulated GPU quotes: a GPU names ``x`` as the simulated GPU does, and ``"auto"`` stages."""
    x, out = arrays(1 << 20)
    holder = cuda_device.register_host(x)
    try:
        with pytest.raises(ValueError, match=r"host='register' cannot pin x: .*pinned already.*x_buffer="):
            if door == "stream_map":
                rf.stream_map(f, x, out, device=cuda_device, host="register")
            else:
                rf.MapJob(f, x, out, device=cuda_device, host="register")
        if door == "stream_map":
            y = rf.stream_map(f, x, out, device=cuda_device, host="auto", workers=1, keep_warm=False)
        else:
            with rf.MapJob(f, x, out, device=cuda_device, host="auto", workers=1) as job:
                y = job()
        assert y is out and np.array_equal(out, x * 2 + 1)
    finally:
        holder.close()


@pytest.mark.parametrize("x", [np.float32(3), 3.0, 7], ids=["numpy scalar", "float", "int"])
@pytest.mark.parametrize("door", ["stream_map", "MapJob"])
def test_a_scalar_x_is_refused_with_advice_that_works(door, x):
    """A scalar was told "convert with np.asarray(x)", which makes the 0-d array the next check
    refuses: the advice now gives a 1-d array."""
    call = rf.stream_map if door == "stream_map" else rf.MapJob
    with pytest.raises(TypeError, match=r"np\.atleast_1d\(x\)") as info:
        call(f, x, device="sim")
    assert np.atleast_1d(x).ndim == 1
    assert "np.asarray(x)" not in str(info.value)


def test_register_refused_for_memory_another_threads_call_pins_names_that_call():
    # the refusal named an open MapJob, a register_host buffer or another device, none of which
    # the caller had made: the memory was pinned by a stream_map call running on another thread
    from tests.helpers.hooks import engines
    from tests.helpers.threads import start

    dev = rf.device("sim", checked=True)
    x = np.arange(1 << 12, dtype=np.float32)
    refused: list = []

    def f(a, b):
        b[...] = a * 2

    def other_call():
        with pytest.raises(ValueError) as info:
            rf.stream_map(f, x, device=dev, host="register", chunk_bytes=4096)
        refused.append(str(info.value))

    def while_pinned(_engine):  # the first call's arrays are registered now; it runs once this returns
        if not refused:
            start(other_call).result(timeout=60)

    with engines(on=while_pinned):
        y = rf.stream_map(f, x, device=dev, host="register", chunk_bytes=4096)
    np.testing.assert_array_equal(y, x * 2)
    assert len(refused) == 1
    assert "a whole-array call in progress" in refused[0] and "host='stage'" in refused[0], refused[0]
    rf.drop_warm_pipelines(dev)
    assert dev.live().total == 0


def test_a_call_staged_for_memory_pinned_already_is_not_remembered_and_the_next_registers(monkeypatch):
    """The plan a call made where "auto" staged memory pinned already is not kept for later calls
    with its arguments: once that memory is unpinned, the next call registers it and is kept."""
    from ringflow._pipeline import call_memo

    monkeypatch.setattr(call_memo, "MEMO", call_memo.CallMemo())
    dev = rf.device("sim")
    x, out = arrays()
    with rf.MapJob(f, x, device=dev, host="register"):
        assert np.array_equal(rf.stream_map(f, x, out, device=dev, workers=1), x * 2 + 1)
        assert len(call_memo.MEMO) == 0
    out[...] = 0
    assert np.array_equal(rf.stream_map(f, x, out, device=dev, workers=1), x * 2 + 1)
    assert len(call_memo.MEMO) == 1


@pytest.mark.parametrize("door", ["stream_map", "MapJob"])
def test_a_closed_device_is_refused_as_the_device_argument(door):
    """A device closed before the call raised the device's own "this simulated device is closed;
    create a new one", which says neither that it is the ``device=`` given nor what to pass (a
    closed device in a list is refused as ``device[i]``)."""
    dev = rf.device("sim")
    dev.close()
    x = np.ones(1024, np.float32)
    with pytest.raises(RuntimeError, match=r"device= \(<SimDevice[^)]*>\) is closed.*pass an open device"):
        if door == "stream_map":
            rf.stream_map(f, x, device=dev, chunk_bytes=1024)
        else:
            rf.MapJob(f, x, device=dev, chunk_bytes=1024)


@pytest.mark.parametrize("device_given", [False, True])
@pytest.mark.parametrize("door", ["stream_map", "MapJob"])
@pytest.mark.parametrize("side", ["x", "out"])
def test_a_pool_array_of_a_closed_device_is_refused_by_name(side, door, device_given):
    """A pool array's memory goes with its device when the device closes (a GPU frees every
    pinned allocation of its context). Named by no ``device=``, the call raised the device's own
    "this simulated device is closed; create a new one", naming neither the array nor its pool;
    on another device it read (or wrote) the array as if its memory were still there."""
    old, dev = rf.device("sim"), rf.device("sim")
    x, out = arrays(1024)
    pooled = rf.host.empty(1024, np.float32, device=old)
    if side == "x":
        pooled[...] = x
        x = pooled
    else:
        out = pooled
    old.close()
    ran = []

    def counting(a, b):
        ran.append(len(a))
        b[...] = a * 2 + 1

    options = {"device": dev} if device_given else {}
    with pytest.raises(RuntimeError, match=rf"{side} is memory from ringflow.host of <SimDevice[^>]*>, which is "
                                           rf"closed.*went with it"):
        if door == "stream_map":
            rf.stream_map(counting, x, out, chunk_bytes=1024, **options)
        else:
            rf.MapJob(counting, x, out, chunk_bytes=1024, **options)
    assert ran == []
    assert dev.live().host_buffers == 0


@pytest.mark.parametrize("door", ["stream_map-stage", "stream_map-register", "stream_map-two-devices", "MapJob",
                                  "MapJob-two-devices"])
def test_a_whole_array_call_from_inside_work_its_device_runs_is_refused_before_any_work(door):
    """The simulated GPU runs a compute as it advances, where nothing may wait for it; a
    whole-array call made there on the same device waits for it all the same. On one device
    the call failed part way ("a host task on the simulated GPU must not block"), its clean-up
    could not wait either, and the registrations it had made stayed pinned for good, with a
    RuntimeWarning for each; over several devices, one of them the compute's, it waited for ever
    (a shard's thread waited for the device the compute's thread held). Now it is refused up
    front, naming the device, and nothing is left behind."""
    dev, other = rf.device("sim"), rf.device("sim")
    devices = [dev, other] if door.endswith("two-devices") else dev
    small = np.arange(1024, dtype=np.float32)
    job = (rf.MapJob(f, small, device=devices, chunk_bytes=1024, host="register" if devices is dev else "auto")
           if door.startswith("MapJob") else None)

    def nested(a, b):
        b[...] = a * 2 + 1
        if job is not None:
            job()
        else:
            rf.stream_map(f, small, device=devices, chunk_bytes=1024,
                          host="register" if door == "stream_map-register" else "auto")

    x = np.arange(1 << 12, dtype=np.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(rf.StageError) as info:
            bounded(lambda: rf.stream_map(nested, x, device=dev, chunk_bytes=4096, host="stage"))
    assert isinstance(info.value.__cause__, RuntimeError)
    assert re.search(r"from inside work that <SimDevice[^>]*> runs", str(info.value.__cause__)), info.value.__cause__
    assert caught == [], [str(w.message) for w in caught]
    del info
    if job is not None:  # refused before the job did anything: it is open and runs as before
        assert not job.closed and np.array_equal(job(), small * 2 + 1)
        job.close()
    rf.drop_warm_pipelines()
    gc.collect()
    assert dev.live().total == 0 and other.live().total == 0, (dev.live(), other.live())
