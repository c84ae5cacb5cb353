"""Misuse of the device API gets a clear ValueError / TypeError / RuntimeError that says what to
change; nothing crashes the interpreter and nothing is left half-done."""

from __future__ import annotations

import numpy as np
import pytest

import ringflow as rf
from ringflow._device.sim import charge
from tests.helpers import unit_device
from tests.helpers.dtypes import DEVICE_DTYPES, NOT_DEVICE_DTYPES, NOT_DEVICE_IDS, refusal


@pytest.fixture
def dev():
    return unit_device()


# -- devices and profiles -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["gpu7", "GPU", "cuda:x", "sim:x", "", "cpu"])
def test_unknown_device_string(spec):
    with pytest.raises(ValueError, match="unknown device") as info:
        rf.device(spec)
    msg = str(info.value)
    assert repr(spec) in msg and "'auto'" in msg and "'sim'" in msg and "cuda:N" in msg


def test_device_spec_must_be_a_string():
    with pytest.raises(TypeError, match="must be a string"):
        rf.device(0)


def test_cuda_without_a_gpu_says_to_use_sim():
    ok, _ = rf.cuda_available()
    if ok:
        pytest.skip("a GPU is usable here")
    with pytest.raises(RuntimeError, match="not usable") as info:
        rf.device("cuda:0")
    assert "device('sim')" in str(info.value)


def test_unsupported_profile_lists_the_choices():
    with pytest.raises(ValueError, match="unknown sim profile 'h100'") as info:
        rf.device("sim", profile="h100")
    assert "h200-pcie5" in str(info.value) and "unit" in str(info.value)


def test_unknown_sim_option():
    with pytest.raises(TypeError, match="bogus"):
        rf.device("sim", bogus=1)


@pytest.mark.parametrize("seed", [None, 1.5, "a", True, [1]], ids=repr)
def test_sim_seed_must_be_an_int(seed):
    """None would seed from the OS (a timeline no run repeats), a string or a float would pass
    unnoticed: the seed is what makes a simulated run a pure function of its calls."""
    with pytest.raises(TypeError, match="seed must be an int") as info:
        rf.device("sim", seed=seed)
    assert repr(seed) in str(info.value)


@pytest.mark.parametrize("option", ["chaos", "checked"])
@pytest.mark.parametrize("value", ["no", "False", 0, None], ids=repr)
def test_sim_flags_must_be_bools(option, value):
    """``checked="no"`` used to switch the checker on (a non-empty string is true)."""
    with pytest.raises(TypeError, match=f"{option} must be True or False"):
        rf.device("sim", **{option: value})


@pytest.mark.parametrize("seed", [-1, -5, np.int64(-3), -(2 ** 80)], ids=repr)
def test_sim_seed_must_not_be_negative(seed):
    """The simulator's generator seeds from the seed's absolute value, so seed=-5 ran the very
    timeline of seed=5: two seeds that look different gave one run."""
    with pytest.raises(ValueError, match=r"seed must be an int >= 0") as info:
        rf.device("sim", seed=seed)
    assert str(int(seed)) in str(info.value)
    assert rf.device("sim", seed=2 ** 80).seed == 2 ** 80  # any size of seed is a seed


def test_sim_options_of_numpy_types_are_fine():
    dev = rf.device("sim", seed=np.int64(3), chaos=np.bool_(True), checked=np.bool_(False))
    assert (dev.seed, dev.chaos, dev.checked) == (3, True, False)
    assert type(dev.seed) is int and type(dev.chaos) is bool


def test_using_a_closed_device(dev):
    s = dev.create_stream()
    dev.close()
    for call in (lambda: dev.create_stream(), lambda: dev.allocate(8), lambda: dev.allocate_host(8),
                 lambda: s.record(), lambda: dev.create_worker_pool(1)):
        with pytest.raises(RuntimeError, match="closed; create a new one"):
            call()


# -- sizes --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nbytes", [0, -1, -(1 << 40)])
@pytest.mark.parametrize("what", ["allocate", "allocate_host"])
def test_non_positive_sizes(dev, what, nbytes):
    with pytest.raises(ValueError, match="positive number of bytes") as info:
        getattr(dev, what)(nbytes)
    assert str(nbytes) in str(info.value) and "at least 1 byte" in str(info.value)
    assert dev.live().total == 0


@pytest.mark.parametrize("nbytes", [1.5, "64", None, True])
def test_sizes_must_be_ints(dev, nbytes):
    with pytest.raises(TypeError, match="must be an int number of bytes"):
        dev.allocate(nbytes)


def test_numpy_int_sizes_are_fine(dev):
    assert dev.allocate(np.int64(64)).nbytes == 64


@pytest.mark.parametrize("nbytes", [1 << 63, 1 << 80])
def test_pinned_host_memory_no_host_can_hold_is_an_out_of_memory_error(dev, nbytes):
    """numpy's refusal of such a size (a ValueError, "Maximum allowed dimension exceeded") came
    through as it was: a ValueError naming nothing, where the device promises a MemoryError."""
    with pytest.raises(rf.OutOfMemoryError, match=rf"allocate_host\(nbytes\) asks for {nbytes} bytes of pinned host "
                                                  r"memory.*ask for fewer bytes") as info:
        dev.allocate_host(nbytes)
    assert isinstance(info.value, MemoryError) and not info.value.sticky
    assert dev.live().total == 0
    dev.allocate_host(64).close()


@pytest.mark.parametrize("times", [2, 10 ** 9])
def test_allocating_more_than_the_device_holds(dev, times):
    """The simulated GPU holds its profile's total memory, as a real one does: more is a
    MemoryError (Python's out-of-memory error, which the pipeline names chunk_bytes for), and the
    same error a real GPU's out-of-memory raises: a DeviceError that leaves the context usable,
    public as ``rf.OutOfMemoryError``."""
    assert "OutOfMemoryError" in rf.__all__
    total = dev.capabilities.total_memory
    with pytest.raises(rf.OutOfMemoryError, match=rf"allocate\(nbytes\) asks for {times * total} bytes of device memory, "
                                          rf"more than the device's total memory of {total} bytes") as info:
        dev.allocate(times * total)
    assert isinstance(info.value, rf.DeviceError) and isinstance(info.value, MemoryError) and not info.value.sticky
    assert dev.live().total == 0
    dev.allocate(64).close()


def test_register_host_needs_a_contiguous_array(dev):
    with pytest.raises(ValueError, match="C-contiguous") as info:
        dev.register_host(np.zeros((8, 8), np.float32)[:, ::2])
    assert "ascontiguousarray" in str(info.value)
    with pytest.raises(TypeError, match="numpy array"):
        dev.register_host([1, 2, 3])
    with pytest.raises(ValueError, match="positive number of bytes"):
        dev.register_host(np.zeros(0, np.float32))


# -- copies ------------------------------------------------------------------------------------------------------------
def test_copying_more_bytes_than_a_buffer_holds(dev):
    s = dev.create_stream()
    small, big = dev.allocate_host(64), dev.allocate(128)
    with pytest.raises(ValueError, match="does not fit") as info:
        s.copy(big, small, 100)
    msg = str(info.value)
    assert "100 bytes" in msg and "source holds 64" in msg and "destination 128" in msg and "at most" in msg
    with pytest.raises(ValueError, match="does not fit"):
        s.copy(small, big, 128)


@pytest.mark.parametrize("n", [0, -8])
def test_copying_no_bytes(dev, n):
    s = dev.create_stream()
    with pytest.raises(ValueError, match="copy at least 1 byte"):
        s.copy(dev.allocate(8), dev.allocate_host(8), n)


def test_copy_of_unequal_buffers_defaults_to_the_smaller(dev):
    s = dev.create_stream()
    h, d = dev.allocate_host(64), dev.allocate(32)
    h.view(np.uint8, access="w")[:] = 5
    s.copy(d, h)
    back = dev.allocate_host(32)
    s.copy(back, d)
    s.sync()
    assert (back.view(np.uint8, access="r") == 5).all()


def test_a_failed_copy_records_nothing(dev):
    s = dev.create_stream()
    h, d = dev.allocate_host(8), dev.allocate(16)
    with pytest.raises(ValueError):
        s.copy(d, h, 16)
    h.view(np.uint8, access="w")  # no pending access was left behind by the refused copy


def test_copy_needs_buffers(dev):
    s = dev.create_stream()
    with pytest.raises(TypeError, match="expected a Buffer"):
        s.copy(np.zeros(8, np.uint8), dev.allocate_host(8))


# -- closed things ------------------------------------------------------------------------------------------------------
def test_using_a_closed_buffer(dev):
    s = dev.create_stream()
    h, d = dev.allocate_host(8), dev.allocate(8)
    d.close()
    h2 = dev.allocate_host(8)
    h2.close()
    for call in (lambda: s.copy(d, h), lambda: s.copy(h, d), lambda: s.fill(d, 0), lambda: h2.view(np.uint8),
                 lambda: d.slice(0, 4), lambda: d.array(np.uint8, 8),
                 lambda: s.launch(lambda a: None, h.array(np.uint8, 8), reads=[d])):
        with pytest.raises(RuntimeError, match="is closed; allocate a new buffer"):
            call()


def test_using_a_slice_of_a_buffer_closed_since(dev):
    s = dev.create_stream()
    d = dev.allocate(8)
    part = d.slice(0, 4)
    arr = d.array(np.uint8, 8)
    d.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.fill(part, 0)
    with pytest.raises(RuntimeError, match="closed"):
        s.launch(lambda a: None, arr)


def test_using_a_closed_stream(dev):
    s = dev.create_stream()
    e = s.record()
    s.close()
    h, d = dev.allocate_host(8), dev.allocate(8)
    for call in (lambda: s.copy(d, h), lambda: s.record(), lambda: s.wait(e), lambda: s.fill(d, 0),
                 lambda: s.launch(lambda a: None, d.array(np.uint8, 8)), lambda: d.close(stream=s),
                 lambda: dev.allocate(8, stream=s)):
        with pytest.raises(RuntimeError, match="is closed; create a new stream"):
            call()
    assert not d.closed


def test_a_closed_stream_still_finishes_its_work(dev):
    s = dev.create_stream()
    h, d = dev.allocate_host(1000), dev.allocate(1000)
    s.copy(d, h)
    e = s.record()
    s.close()
    e.sync()
    assert dev.now == pytest.approx(1e-6)


def test_using_a_closed_pool(dev):
    pool = dev.create_worker_pool(1)
    pool.close()
    with pytest.raises(RuntimeError, match="pool is closed; create a new one"):
        pool.submit(lambda: None)


def test_closing_everything_twice_is_harmless(dev):
    s, h, d, pool = dev.create_stream(), dev.allocate_host(8), dev.allocate(8), dev.create_worker_pool(1)
    d2 = dev.allocate(8)
    for _ in range(2):
        s.close()
        h.close()
        d.close()
        d2.close(stream=None)
        pool.close()
    dev.close()
    dev.close()
    assert dev.live().total == 0


# -- views ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(count=17), dict(offset=60, count=2), dict(offset=68), dict(offset=-4),
                                dict(count=-1)])
def test_view_out_of_range(dev, kw):
    h = dev.allocate_host(64)
    with pytest.raises(ValueError, match="the buffer holds 64") as info:
        h.view(np.float32, **kw)
    assert "fewer items or a smaller offset" in str(info.value)


def test_view_access_mode(dev):
    h = dev.allocate_host(8)
    with pytest.raises(ValueError, match="access must be 'r', 'w' or 'rw'"):
        h.view(np.uint8, access="x")
    v = h.view(np.uint8, access="r")
    with pytest.raises(ValueError, match="read-only"):
        v[0] = 1


@pytest.mark.parametrize("offset,nbytes", [(-1, 4), (0, 9), (8, 1), (4, -1)])
def test_slice_out_of_range(dev, offset, nbytes):
    with pytest.raises(ValueError, match="outside") as info:
        dev.allocate(8).slice(offset, nbytes)
    assert "keep offset + nbytes within the buffer" in str(info.value)


def test_array_larger_than_its_buffer(dev):
    with pytest.raises(ValueError, match="outside"):
        dev.allocate(16).array(np.float32, 5)


@pytest.mark.parametrize("dtype,offset,align", [(np.float32, 1, 4), (np.float64, 4, 8), (np.complex128, 8, 16),
                                                (np.int16, 3, 2), (np.uint64, 4, 8), (np.complex64, 4, 8)])
def test_array_misaligned_for_its_dtype(dev, dtype, offset, align):
    """numpy reads a misaligned array, so the simulated GPU computed on it; a GPU kernel loading
    it stops with a misaligned-address error that breaks the device: both refuse it up front."""
    buf = dev.allocate(256)
    for make in (lambda: buf.array(dtype, 2, offset), lambda: buf.slice(offset).array(dtype, 2)):
        with pytest.raises(ValueError, match="misaligned") as info:
            make()
        assert f"multiple of {align} bytes" in str(info.value) and f"offset {offset - offset % align}" in str(info.value)
    assert buf.array(dtype, 2, align).where.offset == align  # on the boundary: taken
    assert buf.array(np.bool_, 2, 1).where.offset == 1 and buf.array(np.uint8, 2, 1).where.offset == 1


@pytest.mark.parametrize("dtype,advice", NOT_DEVICE_DTYPES, ids=NOT_DEVICE_IDS)
def test_an_array_of_a_dtype_no_gpu_array_holds_is_refused(dev, dtype, advice):
    """numpy holds dates, strings, records, raw bytes and long doubles, so the simulated GPU made
    such arrays and launched computes on them; CuPy, PyTorch and CUDA kernels have none of those
    types, so a GPU failed the same launch in the framework: both refuse the array up front."""
    buf = dev.allocate(256)
    for make in (lambda: buf.array(dtype, 2), lambda: buf.slice(16).array(dtype, 2), lambda: buf.array(dtype, ())):
        with pytest.raises(TypeError, match=r"^array\(dtype\): " + refusal(dtype, advice)):
            make()
    assert dev.live().device_buffers == 1


@pytest.mark.parametrize("dtype", DEVICE_DTYPES)
def test_an_array_of_every_device_dtype_is_launched_on(dev, dtype):
    buf = dev.allocate(256)
    arg = buf.array(dtype, 4)
    seen = []
    stream = dev.create_stream()
    stream.launch(lambda a: seen.append(a.dtype), arg)
    stream.record().sync()
    assert seen == [np.dtype(dtype)]


# -- launches, fills, waits ----------------------------------------------------------------------------------------------
def test_launch_needs_a_callable(dev):
    with pytest.raises(TypeError, match="callable"):
        dev.create_stream().launch("not a function")


def test_launch_takes_device_memory(dev):
    h = dev.allocate_host(8)
    with pytest.raises(ValueError, match="copy host data to a device buffer first"):
        dev.create_stream().launch(lambda a: None, h.array(np.uint8, 8))


def test_launch_takes_typed_arrays_not_raw_buffers(dev):
    d = dev.allocate(8)
    with pytest.raises(TypeError, match=r"buf.array\(dtype, shape\)"):
        dev.create_stream().launch(lambda a: None, d)


@pytest.mark.parametrize("seconds", [-1.0, float("nan"), float("inf"), 2e6, 1e30])
def test_bad_sim_seconds(dev, seconds):
    """A duration past MAX_SIM_SECONDS is refused: virtual time could not represent it finely
    enough, and simulating it would not end."""
    d = dev.allocate(8)
    with pytest.raises(ValueError, match="number of seconds from 0 to 1e"):
        dev.create_stream().launch(lambda a: None, d.array(np.uint8, 8), sim_seconds=seconds)
    with pytest.raises(ValueError, match="number of seconds from 0 to 1e"):
        dev.create_worker_pool(1).submit(lambda: None, sim_seconds=seconds)


@pytest.mark.parametrize("seconds", [-1.0, float("nan"), float("inf"), 2e6, 1e300], ids=repr)
def test_sleep_out_of_range(dev, seconds):
    """The clock stays where it was: a sleep past MAX_SIM_SECONDS would leave virtual time too
    coarse to time copies in (or never end), and one below 0 or NaN is a mistake."""
    before = dev.now
    with pytest.raises(ValueError, match=r"sleep\(seconds\) must be a number of seconds from 0 to 1e\+06, got"):
        dev.sleep(seconds)
    assert dev.now == before


@pytest.mark.parametrize("seconds", ["1", None, True, np.bool_(True), [1]], ids=repr)
def test_sleep_needs_a_number(dev, seconds):
    with pytest.raises(TypeError, match=r"sleep\(seconds\) must be a number of seconds, got"):
        dev.sleep(seconds)


def test_sleep_takes_any_real_number(dev):
    dev.sleep(np.float32(0.5))
    dev.sleep(1)
    assert dev.now == pytest.approx(1.5)


def test_bad_task_sizes_and_charges(dev):
    pool = dev.create_worker_pool(1)
    with pytest.raises(ValueError, match="int >= 0"):
        pool.submit(lambda: None, nbytes=-1)
    with pytest.raises(TypeError, match="callable"):
        pool.submit(None)
    for seconds in (-1.0, 1e30):
        t = pool.submit(lambda: charge(seconds))
        t.sync()
        with pytest.raises(ValueError, match="number of seconds from 0 to"):
            t.result()


@pytest.mark.parametrize("workers", [0, -2, 1025, 10 ** 9])
def test_worker_counts_out_of_range(dev, workers):
    """As many workers as the pipeline's ``workers=`` allows, no more: each is a lane of the
    engine, and a billion of them would take minutes to set up."""
    with pytest.raises(ValueError, match=rf"create_worker_pool\(workers\) must be between 1 and 1024, got {workers}"):
        dev.create_worker_pool(workers)


@pytest.mark.parametrize("workers", [1.5, True, "4", None], ids=repr)
def test_worker_counts_must_be_ints(dev, workers):
    with pytest.raises(TypeError, match=r"create_worker_pool\(workers\) must be an integer, got"):
        dev.create_worker_pool(workers)


def test_worker_counts_of_numpy_ints_are_fine(dev):
    pool = dev.create_worker_pool(np.int64(2))
    assert pool.workers == 2 and type(pool.workers) is int


@pytest.mark.parametrize("byte", [-1, 256, 1000])
def test_fill_byte_out_of_range(dev, byte):
    with pytest.raises(ValueError, match=r"0\.\.255"):
        dev.create_stream().fill(dev.allocate(8), byte)


@pytest.mark.parametrize("priority", [1, -6, 100])
def test_stream_priority_out_of_range(dev, priority):
    with pytest.raises(ValueError, match=r"outside the device's range \[-5 \(highest\), 0 \(lowest\)\]"):
        dev.create_stream(priority=priority)


@pytest.mark.parametrize("priority", ["x", 1.5, None, True], ids=repr)
def test_stream_priority_must_be_an_int(dev, priority):
    with pytest.raises(TypeError, match="stream priority must be an int, got"):
        dev.create_stream(priority)
    assert dev.live().streams == 0


def test_stream_priority_of_a_numpy_int_is_fine(dev):
    assert dev.create_stream(np.int64(-5)).priority == -5


def test_wait_takes_an_event(dev):
    with pytest.raises(TypeError, match="SimEvent"):
        dev.create_stream().wait("event")


def test_wait_any_needs_something_to_wait_for(dev):
    with pytest.raises(ValueError, match="at least one"):
        dev.wait_any([])
    with pytest.raises(TypeError, match="events and host tasks"):
        dev.wait_any([object()])


@pytest.mark.parametrize("timeout,error", [("1", TypeError), ([1], TypeError), (True, TypeError),
                                           (float("nan"), ValueError)], ids=repr)
def test_wait_any_timeout_must_be_a_number(dev, timeout, error):
    e = dev.create_stream().record()
    with pytest.raises(error, match="timeout must be"):
        dev.wait_any([e], timeout=timeout)


def test_wait_any_timeouts_below_zero_and_infinite(dev):
    """A negative timeout does not wait, an infinite one waits without limit (as None does)."""
    s = dev.create_stream()
    s.launch(lambda a: None, dev.allocate(8).array(np.uint8, 8), sim_seconds=1.0)
    e = s.record()
    assert dev.wait_any([e], timeout=-1) == []
    assert dev.wait_any([e], timeout=float("inf")) == [e]


def test_elapsed_since_needs_done_timing_events(dev):
    s = dev.create_stream()
    a = s.record(timing=True)
    s.launch(lambda x: None, dev.allocate(8).array(np.uint8, 8), sim_seconds=1.0)
    b = s.record(timing=True)
    with pytest.raises(RuntimeError, match="sync them first"):
        b.elapsed_since(a)


# -- objects of another device -----------------------------------------------------------------------------------------
def test_buffers_of_another_device_are_refused(dev):
    other = unit_device()
    s = dev.create_stream()
    mine_h, mine_d = dev.allocate_host(8), dev.allocate(8)
    theirs_h, theirs_d = other.allocate_host(8), other.allocate(8)
    for call in (lambda: s.copy(mine_d, theirs_h), lambda: s.copy(theirs_d, mine_h), lambda: s.fill(theirs_d, 0),
                 lambda: s.launch(lambda a: None, theirs_d.array(np.uint8, 8)),
                 lambda: s.launch(lambda a: None, mine_d.array(np.uint8, 8), reads=[theirs_d])):
        with pytest.raises(ValueError, match="belongs to another device"):
            call()


def test_events_and_streams_of_another_device_are_refused(dev):
    other = unit_device()
    theirs = other.create_stream()
    e = theirs.record()
    with pytest.raises(ValueError, match="another device"):
        dev.create_stream().wait(e)
    with pytest.raises(ValueError, match="another device"):
        dev.wait_any([e])
    with pytest.raises(ValueError, match="stream of this device"):
        dev.allocate(8, stream=theirs)
    d = dev.allocate(8)
    with pytest.raises(ValueError, match="stream of this buffer's device"):
        d.close(stream=theirs)
    assert not d.closed


CROSS_DEVICE_WAIT = (r"^<SimStream \d+ priority=0> of sim:{mine} cannot wait for <(Sim|Captured)Event on stream \d+( done| pending)?>, "
                     r"recorded on sim:{theirs}: a stream waits only for events of its own device \(the simulated GPU "
                     r"cannot order one device's work after another's, so neither backend takes such a wait\); order "
                     r"the two through the host instead: event\.sync\(\), then enqueue the work on this stream$")


@pytest.mark.parametrize("captured", (False, True), ids=("event", "captured-event"))
def test_a_wait_for_an_event_of_another_device_names_both_devices_and_what_to_do(captured):
    # the CUDA backend refuses the same wait with the same words (test_cuda_streams); it said
    # "recorded on another device" here and raised a TypeError there
    mine, theirs = rf.device("sim:14"), rf.device("sim:15")
    try:
        source = theirs.create_stream()
        if captured:
            source.begin_capture()
        e = source.record()
        s = mine.create_stream()
        with pytest.raises(ValueError, match=CROSS_DEVICE_WAIT.format(mine=14, theirs=15)):
            s.wait(e)
        if captured:
            source.end_capture().close()
        s.wait(s.record())  # the stream is still usable
        s.sync()
    finally:
        mine.close()
        theirs.close()


def test_a_wait_across_two_device_objects_with_one_name_says_to_use_one_object():
    a, b = unit_device(), unit_device()
    assert repr(a) == repr(b)  # two simulated GPUs alike: their label cannot tell them apart
    with pytest.raises(ValueError, match=r"recorded on another device object that is also <SimDevice .*> \(make "
                                         r"the device once and use that one object\)"):
        a.create_stream().wait(b.create_stream().record())


@pytest.mark.parametrize("dtype", [",", b"i4,(2", "no such type"])
def test_a_string_numpy_cannot_read_as_a_dtype_is_refused_as_a_typeerror_naming_it(dev, dtype):
    """numpy refuses some strings with a SyntaxError of its own (it parses them as a structure);
    a buffer's array and a host buffer's view refuse every such string alike."""
    buf, host = dev.allocate(1024), dev.allocate_host(1024)
    try:
        for make in (lambda: buf.array(dtype, 4), lambda: host.view(dtype)):
            with pytest.raises(TypeError, match="is not a numpy dtype"):
                make()
    finally:
        buf.close()
        host.close()
