"""``Pipeline(deliver="device")``: results stay on the device, lent to the consumer until it
releases them, and the release is ordered after the consumer's stream.

On the simulated GPU the consumer reads a result by launching on a stream of its own
(``reads=[res.array]``); the checker sees that read against the next compute into the slot."""

from __future__ import annotations

import copy
import gc
import logging
import pickle
import random
import threading
import time
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ringflow as rf
from ringflow import _testing
from ringflow._pipeline.states import SlotState
from tests.helpers.pipeline_checks import caught
from tests.helpers.interrupts import InterruptAt
from tests.helpers.sim import read_on
from tests.helpers.threads import JOIN_S, LogRecords, bounded, join, start


def f(x, y):
    y[...] = x * 2 + 1


f.sim_seconds = 20e-6


def run(seed, *, slots=2, n=30, release_order="fifo", guards=(), use_stream=True, hold=2):
    dev = rf.device("sim", chaos=True, seed=seed, checked=True)
    rng = np.random.default_rng(seed)
    items = [rng.standard_normal(int(rng.integers(1, 256))).astype(np.float32) for _ in range(n)]
    user = dev.create_stream()
    held, got = [], {}
    with _testing.inject(guards_off=guards):
        with rf.Pipeline(f, device=dev, chunk_bytes=1024, deliver="device", checked=True,
                         slots=rf.SlotCounts(host_in=2, device_in=2, device_out=slots, host_out=1)) as pipe:
            order = random.Random(seed)
            for res in pipe.map(items):
                got[res.index] = read_on(user, res)
                held.append(res)
                if len(held) >= hold:  # release some of what is held, in the order asked
                    k = order.randrange(len(held)) if release_order == "random" else 0
                    held.pop(k).release(stream=user if use_stream else None)
            for res in held:
                res.release(stream=user if use_stream else None)
            user.sync()
    user.close()
    return dev, items, got, pipe


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 16), order=st.sampled_from(["fifo", "random"]), slots=st.integers(1, 4),
       hold=st.integers(1, 3))
def test_device_results_are_right_under_chaos_with_any_release_order(seed, order, slots, hold):
    hold = min(hold, slots)  # holding every slot while waiting for another result would wait forever
    dev, items, got, pipe = run(seed, slots=slots, release_order=order, hold=hold)
    for i, a in enumerate(items):
        np.testing.assert_array_equal(got[i], a * 2 + 1)
    s = pipe.stats()
    assert (s.delivered, s.in_flight) == (len(items), 0)
    gc.collect()
    assert dev.live().total == 0


# the slot's free at close is the same unordered access, reported again as a warning (a close never raises)
@pytest.mark.filterwarnings("ignore:closing device-out ring buffer failed:RuntimeWarning")
def test_a_release_not_ordered_after_the_consumer_is_caught():
    """Switch off the guard (the next compute waits for the consumer's release event): the
    checker sees the consumer's read of a slot and the next write into it unordered."""
    outcomes = []
    for seed in range(6):
        try:
            run(seed, slots=1, hold=1, guards=["device_out.release_after_consumer"])
            outcomes.append(True)
        except BaseException as exc:  # noqa: BLE001 - what the checker raised, however it surfaced
            outcomes.append(exc)
    assert any(caught(o) for o in outcomes), outcomes


# the slot's free at close is the same unordered access, reported again as a warning (a close never raises)
@pytest.mark.filterwarnings("ignore:closing device-out ring buffer failed:RuntimeWarning")
def test_a_consumer_releasing_on_the_wrong_stream_is_caught():
    """Released with stream=None after launching its read on its own stream: on the simulated GPU
    nothing orders the next compute after that read."""
    outcomes = []
    for seed in range(6):
        try:
            run(seed, slots=1, hold=1, use_stream=False)
            outcomes.append(True)
        except BaseException as exc:  # noqa: BLE001
            outcomes.append(exc)
    assert any(caught(o) for o in outcomes), outcomes


def test_a_consumer_releasing_on_the_wrong_stream_is_told_what_to_change():
    """The user's bug, not ringflow's: ``map()`` raises the checker's HazardError itself, naming
    both accesses and what to change (not "the progress thread died ... a ringflow bug"), and
    leaving the ``with`` block adds no warning that cancelling failed."""
    for seed in range(3):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with pytest.raises(rf.HazardError) as info:
                run(seed, slots=1, hold=1, use_stream=False)
        message = str(info.value)
        assert "unordered accesses to device buffer" in message  # the checker's own finding
        assert "released on another stream" in message and "stream=" in message
        assert isinstance(info.value.__cause__, rf.HazardError)
        assert info.value.first is info.value.__cause__.first  # the two accesses, for tools
        assert not [w for w in seen if "cancelling the pipeline" in str(w.message)], [str(w.message) for w in seen]


# the slot's free at close is the same unordered access, reported again as a warning (a close never raises)
@pytest.mark.filterwarnings("ignore:closing device-out ring buffer failed:RuntimeWarning")
def test_the_array_of_a_released_result_is_refused_and_a_late_read_is_caught():
    outcomes = []
    for seed in range(6):
        dev = rf.device("sim", seed=seed, chaos=True, checked=True)
        user = dev.create_stream()
        try:
            with rf.Pipeline(f, device=dev, chunk_bytes=1024, deliver="device",
                             slots=rf.SlotCounts(host_in=1, device_in=1, device_out=1, host_out=1)) as pipe:
                first = pipe.submit(np.ones(8, np.float32)).result()
                kept = first.array  # a reference kept past the release: the user's bug
                first.release(stream=user)
                with pytest.raises(RuntimeError, match="was released"):
                    _ = first.array
                fut = pipe.submit(np.zeros(8, np.float32))  # its compute reuses the one slot
                late = np.empty(8, np.float32)

                def read(a):
                    late[...] = a

                read.sim_seconds = 1e-3
                user.launch(read, kept, reads=[kept])  # after the release: races that compute
                fut.result().release(stream=user)
                user.sync()
            outcomes.append(True)
        except BaseException as exc:  # noqa: BLE001 - however the checker's error surfaced
            outcomes.append(exc)
    assert any(caught(o) for o in outcomes), outcomes


@pytest.mark.parametrize("seed", range(3))
def test_a_result_taken_on_one_thread_is_read_and_released_on_others(seed):
    """The caller passes a result between its threads by joins the checker cannot see: the
    thread that takes ``array`` is ordered after the compute that wrote it (without that, the
    read on another thread is an unordered access), and the release from a third thread goes
    back in order."""
    dev = rf.device("sim", chaos=True, seed=seed, checked=True)
    with rf.Pipeline(f, device=dev, chunk_bytes=1024, deliver="device", checked=True,
                     slots=rf.SlotCounts(host_in=2, device_in=2, device_out=1, host_out=1)) as pipe:
        user = bounded(dev.create_stream)
        for k in range(6):  # one device-out slot: each release must come back for the next
            res = bounded(lambda k=k: pipe.submit(np.full(100, k, np.float32)).result())
            out = bounded(lambda res=res: read_on(user, res))
            bounded(lambda res=res: res.release(stream=user))
            bounded(user.sync)
            np.testing.assert_array_equal(out, np.full(100, 2 * k + 1, np.float32))
    user.close()
    assert dev.live().total == 0


def test_results_dropped_without_release_go_back_and_the_pipeline_goes_on():
    dev = rf.device("sim", seed=2)
    with rf.Pipeline(f, device=dev, chunk_bytes=1024, deliver="device",
                     slots=rf.SlotCounts(host_in=1, device_in=1, device_out=1, host_out=1)) as pipe:
        for k in range(20):  # one device-out slot: each result must come back for the next
            res = pipe.submit(np.full(4, k, np.float32)).result(timeout=10)
            assert res.shape == (4,) and res.dtype == np.float32
            del res
    assert pipe.stats().delivered == 20


def test_closing_with_results_still_held_frees_their_slots_when_released():
    dev = rf.device("sim", seed=3)
    user = dev.create_stream()
    pipe = rf.Pipeline(f, device=dev, chunk_bytes=1024, deliver="device")
    held = list(pipe.map([np.ones(16, np.float32)] * 3))
    pipe.close()  # bounded: does not wait for the consumer
    assert dev.live().device_buffers >= 1  # the lent slots' ring is still the consumer's
    out = read_on(user, held[0])
    for res in held:
        res.release(stream=user)
    user.sync()
    np.testing.assert_array_equal(out, np.full(16, 3, np.float32))
    assert dev.live().device_buffers == 0


@pytest.mark.parametrize("seed", range(6))
def test_a_result_released_after_a_checked_close_frees_its_ring_after_every_poison_fill(seed):
    """Checked mode poisons each slot handed back, on a stream; a result still held at close keeps
    its ring, which is freed on the host when that result comes back. That free came after no
    wait for the fills of the slots released before the close (a HazardError from the close of
    the ring, which then stayed allocated), where a GPU would free memory a fill still writes."""
    dev = rf.device("sim", seed=seed, chaos=True, checked=True)
    user = dev.create_stream()
    pipe = rf.Pipeline(f, device=dev, chunk_bytes=512, deliver="device", checked=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        results = pipe.map([np.full(16, k, np.float32) for k in range(6)])
        held = next(results)
        for res in results:
            res.release(stream=user)  # each one's slot poisoned on the pipeline's stream
        pipe.close()  # held is still the consumer's: its ring stays
        out = read_on(user, held)
        held.release(stream=user)
        user.sync()
    assert not [w for w in seen if "failed" in str(w.message)], [str(w.message) for w in seen]
    np.testing.assert_array_equal(out, np.full(16, 1, np.float32))
    user.close()
    del held, results
    gc.collect()
    assert dev.live().total == 0, dev.live()


@pytest.mark.parametrize("checked", [False, True])
def test_closing_after_releases_on_the_consumers_stream_frees_the_ring_after_them(checked):
    """Results released on the consumer's stream (``release(stream=...)``), that stream not yet
    synchronised when the pipeline closes, as the feeding guide's loop does: the ring's free came
    after the pipeline's own streams only, not the release events (a HazardError from the close of
    the ring, reported as a warning), where a GPU would free memory the model step still reads."""
    dev = rf.device("sim", seed=5, chaos=True)
    user = dev.create_stream()
    outs = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with rf.Pipeline(f, device=dev, chunk_bytes=512, deliver="device", checked=checked) as pipe:
            for res in pipe.map([np.full(16, k, np.float32) for k in range(6)]):
                outs.append(read_on(user, res, seconds=1e-3))  # a long model step
                res.release(stream=user)
        user.sync()
    assert not [w for w in seen if "failed" in str(w.message)], [str(w.message) for w in seen]
    for k, out in enumerate(outs):
        np.testing.assert_array_equal(out, np.full(16, 2 * k + 1, np.float32))
    user.close()
    gc.collect()
    assert dev.live().total == 0, dev.live()


def test_output_specs_and_device_delivery_together():
    dev = rf.device("sim", seed=4)
    user = dev.create_stream()

    def means(x, y):
        y[...] = x.reshape(2, -1).mean(axis=1).astype(y.dtype)

    with rf.Pipeline(means, device=dev, chunk_bytes=4096, deliver="device", output=((2,), "float16")) as pipe:
        res = pipe.submit(np.arange(10, dtype=np.uint8)).result()
        with res:
            out = read_on(user, res)
            res.release(stream=user)
        user.sync()
    np.testing.assert_array_equal(out, np.array([2, 7], np.float16))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"deliver": "gpu"}, ValueError, "deliver"),
    ({"deliver": "device", "consume": lambda i, it, r: r}, ValueError, "consume= cannot be used with deliver"),
])
def test_bad_deliver_options_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        rf.Pipeline(f, device=rf.device("sim"), chunk_bytes=1024, **kwargs)


def test_release_refuses_what_is_not_a_stream():
    with rf.Pipeline(f, device=rf.device("sim"), chunk_bytes=1024, deliver="device") as pipe:
        res = pipe.submit(np.ones(4, np.float32)).result()
        with pytest.raises(TypeError, match="stream must be"):
            res.release(stream="default")
        assert not res.released
        res.release()
        res.release()  # twice: nothing
        assert res.released and "released" in repr(res)


def test_release_refuses_a_stream_of_another_device():
    """An event on another device's stream cannot order this one's work: refused at once, where
    it used to be taken and then kill the progress thread."""
    dev, other = rf.device("sim"), rf.device("sim")
    with rf.Pipeline(f, device=dev, chunk_bytes=1024, deliver="device", slots=1) as pipe:
        results = []
        for res in pipe.map([np.ones(4, np.float32) * k for k in range(3)]):
            with pytest.raises(TypeError, match="another device's stream") as refused:
                res.release(stream=other.create_stream())
            # the two devices' labels are alike: the message says the stream's is another object
            assert "another device object that is also" in str(refused.value)
            assert not res.released
            res.release(stream=dev.create_stream())
            results.append(res)
        assert pipe.stats().delivered == 3
    other.close()


def test_lent_is_a_slot_state_of_the_device_rings_only():
    from ringflow._pipeline.states import LEGAL_SLOT_TRANSITIONS, RingKind

    for kind, table in LEGAL_SLOT_TRANSITIONS.items():
        has = (SlotState.COMPUTING, SlotState.LENT) in table
        assert has == (kind in (RingKind.DEVICE_OUT, RingKind.DEVICE_INPLACE)), kind


def test_a_device_result_is_made_by_a_pipeline_only():
    with pytest.raises(TypeError, match="made by a Pipeline"):
        rf.DeviceResult(0, None, None, None)



@pytest.mark.parametrize("how,what", [(pickle.dumps, "pickled"), (copy.copy, "copied"), (copy.deepcopy, "copied")],
                         ids=["pickle", "copy", "deepcopy"])
def test_a_device_result_refuses_to_be_pickled_or_copied_and_says_what_to_copy(how, what):
    """A DeviceResult is a lent slot: a copy would be a second handle on the same slot (released
    twice), and a pickle cannot carry device memory to another process."""
    dev = rf.device("sim")
    with rf.Pipeline(f, device=dev, chunk_bytes=1024, deliver="device") as pipe:
        res = pipe.submit(np.ones(4, np.float32)).result(timeout=30)
        with pytest.raises(TypeError, match=rf"^a DeviceResult cannot be {what}: .*lent until release\(\).*"
                                            r"copy its \.array.*deliver='host'"):
            how(res)
        assert not res.released
        user = dev.create_stream()
        got = read_on(user, res)  # the result itself is still good to read and to release
        res.release(stream=user)
        user.sync()
        user.close()
        np.testing.assert_array_equal(got, np.full(4, 3, np.float32))
        with pytest.raises(TypeError, match=f"cannot be {what}"):
            how(res)  # released or not
    assert pipe.stats().in_flight == 0

@pytest.mark.parametrize("read", [np.asarray, np.array, lambda a: np.array_equal(a, np.full(4, 3, np.float32)),
                                  lambda a: np.testing.assert_array_equal(a, np.full(4, 3, np.float32))],
                         ids=["asarray", "array", "array_equal", "assert_array_equal"])
def test_a_device_result_read_as_a_host_array_on_the_simulated_gpu_says_how_to_read_it(read):
    """On the simulated GPU a result's array is a launch argument: numpy would make a 0-d object
    array of it (and compare that), where a GPU framework's array refuses to become a host array."""
    dev = rf.device("sim")
    with rf.Pipeline(f, device=dev, chunk_bytes=1024, deliver="device") as pipe:
        res = pipe.submit(np.ones(4, np.float32)).result(timeout=30)
        with pytest.raises(TypeError, match=r"simulated GPU.*stream\.launch\(.*reads="):
            read(res.array)
        user = dev.create_stream()
        got = read_on(user, res)  # read as the message says
        res.release(stream=user)
        user.sync()
        user.close()
        np.testing.assert_array_equal(got, np.full(4, 3, np.float32))


def _one_slot_pipeline(seed):
    return rf.Pipeline(f, device=rf.device("sim", seed=seed), chunk_bytes=1024, deliver="device",
                       slots=rf.SlotCounts(host_in=1, device_in=1, device_out=1, host_out=1))


def test_a_wait_only_a_release_can_end_times_out_on_the_simulated_clock():
    # the one device slot is held by a result the waiting thread keeps: nothing is in flight, so
    # virtual time must pass (at the pace of real time) to the waits' deadlines; it used to stand
    # still: a hang
    pipe = _one_slot_pipeline(5)
    held = pipe.submit(np.ones(4, np.float32)).result(timeout=10)

    def wait_for_more():
        fut = pipe.submit(np.ones(4, np.float32), timeout=1)
        with pytest.raises(TimeoutError, match="chunk 1"):
            fut.result(timeout=1)
        with pytest.raises(TimeoutError, match="capacity"):
            for _ in range(64):  # until admission is full
                pipe.submit(np.ones(4, np.float32), timeout=1)

    join([start(wait_for_more)], timeout=30)
    held.release()
    pipe.close()
    assert pipe.stats().delivered == pipe.stats().accepted


@pytest.mark.parametrize("timeout", [30.0, None])
def test_a_release_from_another_thread_ends_a_timed_wait_on_the_simulated_clock(timeout):
    # another thread releases the held result in real time: a timed wait must not time out first
    # (the simulated clock once jumped straight to the deadline)
    pipe = _one_slot_pipeline(8)
    held = pipe.submit(np.ones(4, np.float32)).result(timeout=10)
    nxt = pipe.submit(np.ones(4, np.float32))
    releaser = threading.Timer(0.2, held.release)  # the other thread's pace, not a proof
    releaser.start()
    (second,) = join([start(nxt.result, timeout)], timeout=30)
    releaser.join()
    assert pipe._sched.device.now < 10.0, pipe._sched.device.now  # the clock went at real time's pace
    second.release()
    pipe.close()
    assert pipe.stats().delivered == 2


def test_a_done_callback_waiting_for_a_slot_held_by_results_gets_its_result_once_released():
    pipe = rf.Pipeline(f, device=rf.device("sim", seed=9, chaos=True, checked=True), chunk_bytes=1024,
                       deliver="device", slots=rf.SlotCounts(host_in=1, device_in=1, device_out=2, host_out=1))
    first = pipe.submit(np.ones(4, np.float32)).result(timeout=10)
    outcome: list = []
    called, finished = threading.Event(), threading.Event()

    def callback(fut):  # on the progress thread, while fut's result holds the other slot
        called.set()
        try:
            res = pipe.submit(np.full(4, 3, np.float32)).result(timeout=30)
            outcome.append(res.shape)
            res.release()
        except BaseException as exc:  # noqa: BLE001 - the test's to see
            outcome.append(exc)
        finally:
            finished.set()

    second = pipe.submit(np.ones(4, np.float32))
    second.add_done_callback(callback)
    assert called.wait(JOIN_S)
    first.release()  # now the callback's item can be computed
    assert finished.wait(JOIN_S)
    assert outcome == [(4,)], outcome  # was: RuntimeError("... this is a ringflow bug")
    got = second.result(timeout=10)
    got.release()
    pipe.close()
    assert pipe.stats().delivered == 3




@pytest.fixture
def driver_warnings(monkeypatch):
    from ringflow._pipeline import driver

    monkeypatch.setattr(driver, "_HELD_WARN_S", 0.0)  # at once: the test's pace, not a real 5 s
    # the RuntimeWarning that goes with the record is expected here (pytest resets the filters
    # after the test); the test of the warning itself records it under filters of its own
    warnings.filterwarnings("ignore", "a wait on the pipeline has found", RuntimeWarning)
    records = LogRecords(logging.WARNING)
    driver.logger.addHandler(records)
    yield records
    driver.logger.removeHandler(records)


def test_a_wait_only_a_release_can_end_says_which_results_to_release(driver_warnings):
    pipe = _one_slot_pipeline(6)
    held = pipe.submit(np.ones(4, np.float32)).result(timeout=10)
    waiter = start(pipe.submit(np.ones(4, np.float32)).result)
    assert driver_warnings.arrived.wait(JOIN_S), "no warning while a wait could only end by a release"
    message = driver_warnings.records[0].getMessage()
    assert "not yet released (chunks 0)" in message and "release" in message, message
    assert len(driver_warnings.records) == 1  # once for the same results
    held.release()
    (second,) = join([waiter], timeout=30)
    second.release()
    pipe.close()


def _stall_until_warned_then_release(driver_warnings):
    """A one-slot pipeline whose second result's wait can only end by a release, held until the
    held-results warning arrives, then released; returns the closed pipeline."""
    pipe = _one_slot_pipeline(6)
    held = pipe.submit(np.ones(4, np.float32)).result(timeout=10)
    waiter = start(pipe.submit(np.ones(4, np.float32)).result)
    assert driver_warnings.arrived.wait(JOIN_S), "no warning while a wait could only end by a release"
    held.release()
    (second,) = join([waiter], timeout=30)  # past the warning: its thread went on to compute it
    second.release()
    pipe.close()
    return pipe


def test_a_wait_only_a_release_can_end_is_also_a_runtime_warning(driver_warnings):
    """The library's logger has only a NullHandler, so the log record alone reaches nobody who
    has not set up logging: the same message comes as a RuntimeWarning (shown by Python's default
    filters), once for the same held results."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _stall_until_warned_then_release(driver_warnings)
    shown = [w for w in seen if "not yet released" in str(w.message)]
    assert len(shown) == 1, [str(w.message) for w in seen]
    assert shown[0].category is RuntimeWarning
    assert str(shown[0].message) == driver_warnings.records[0].getMessage()
    assert "not yet released (chunks 0)" in str(shown[0].message) and "release" in str(shown[0].message)


def test_the_held_results_warning_made_an_error_does_not_stop_the_pipeline(driver_warnings):
    """Under ``-W error`` the warning is not raised on the progress thread (which would die of
    it): the log record still says it, and the release lets the wait go on."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe = _stall_until_warned_then_release(driver_warnings)
    assert pipe.stats().delivered == 2 and pipe.stats().in_flight == 0


def _ungated(pipe) -> None:
    """The simulated GPU's progress thread run as a real GPU's is: whenever there is work, with no
    record of who waits through a future (a done-callback, a waiter, an await)."""
    driver = pipe._driver
    with driver.cv:
        driver.gated = False
        driver.notify()


@pytest.mark.parametrize("how", ["asubmit", "amap", "futures.wait", "done-callback"])
def test_on_a_real_gpu_a_wait_through_a_future_only_a_release_can_end_is_warned_of(how, driver_warnings):
    """The one slot is held by a result the consumer keeps while it waits for the next through a
    future rather than result(): an asyncio await (asubmit, amap), concurrent.futures.wait, a
    done-callback. A real GPU's progress thread keeps no record of such waits, and it took
    nobody to be waiting: the wait went on for ever without the warning."""
    import asyncio
    import concurrent.futures

    pipe = _one_slot_pipeline(13)
    _ungated(pipe)
    held = pipe.submit(np.ones(4, np.float32)).result(timeout=10)
    got: list = []

    async def next_one():
        if how == "asubmit":
            return await pipe.asubmit(np.full(4, 2, np.float32))
        async for res in pipe.amap([np.full(4, 2, np.float32)]):
            return res

    if how in ("asubmit", "amap"):
        waiter = start(asyncio.run, next_one())
    else:
        fut = pipe.submit(np.full(4, 2, np.float32))
        if how == "futures.wait":
            waiter = start(lambda: concurrent.futures.wait([fut]) and fut.result())
        else:
            came = threading.Event()
            fut.add_done_callback(lambda f: came.set())
            waiter = start(lambda: came.wait(JOIN_S) and fut.result())
    assert driver_warnings.arrived.wait(JOIN_S), "no warning while a wait could only end by a release"
    message = driver_warnings.records[0].getMessage()
    assert "not yet released (chunks 0)" in message, message
    held.release()
    got = join([waiter], timeout=JOIN_S)[0]
    assert isinstance(got, rf.DeviceResult) and got.index == 1, got
    got.release()
    pipe.close()
    assert pipe.stats().delivered == 2 and pipe.stats().in_flight == 0


def test_the_warning_counts_only_time_someone_waits(monkeypatch, driver_warnings):
    from ringflow._pipeline import driver

    monkeypatch.setattr(driver, "_HELD_WARN_S", 0.3)
    pipe = _one_slot_pipeline(10)
    held = pipe.submit(np.ones(4, np.float32)).result(timeout=10)
    nxt = pipe.submit(np.ones(4, np.float32))
    time.sleep(0.6)  # held, with nobody waiting, past the threshold (the scenario, not a proof)
    releaser = threading.Timer(0.05, held.release)
    releaser.start()
    nxt.result(timeout=30).release()  # a wait of a twentieth of a second
    releaser.join()
    pipe.close()
    assert driver_warnings.records == [], [r.getMessage() for r in driver_warnings.records]


def test_results_released_in_time_raise_no_warning(driver_warnings):
    with _one_slot_pipeline(7) as pipe:
        for k in range(20):
            res = pipe.submit(np.full(4, k, np.float32)).result(timeout=10)
            del res  # back before the next wait
    assert pipe.stats().delivered == 20
    assert driver_warnings.records == []


def _release_interrupted_at(n: int) -> tuple:
    """One slot, its result released with a SIGINT at the ``n``-th instruction of the release;
    the caller retries; returns (interrupted, instructions seen, next result came)."""
    pipe = _one_slot_pipeline(11)
    res = pipe.submit(np.ones(4, np.float32)).result(timeout=10)
    interrupted = False
    with InterruptAt(n, ("release", "give_back", "_wake"), sigint=True) as at:
        try:
            res.release()
        except KeyboardInterrupt:
            interrupted = True
    assert not res._lock.locked(), n  # a retried release would wait for ever
    res.release()  # the caller retries: a no-op if the first went through
    nxt = pipe.submit(np.full(4, 2, np.float32))
    came = join([start(nxt.result, 5.0)], timeout=30)[0]
    came.release()
    pipe.close()
    assert pipe.stats().delivered == 2 and pipe.stats().in_flight == 0
    return interrupted, at.seen, True


def test_ctrl_c_anywhere_in_a_release_gives_the_slot_back():
    """A SIGINT at every instruction of ``DeviceResult.release`` and the hand-back it runs: the
    release is carried out whole (a Ctrl-C is raised once it is), so the slot comes back and
    the next result arrives. Unshielded, an interrupt after the result was marked released and
    before its hand-back lost the slot for good (the next wait timed out)."""
    assert threading.current_thread() is threading.main_thread()
    _, total, _ = _release_interrupted_at(10 ** 9)
    interrupted = sum(_release_interrupted_at(n)[0] for n in range(total))
    assert total > 10 and interrupted == total, (interrupted, total)


@pytest.mark.parametrize("slots", [None, 2, 4])
def test_two_amaps_on_one_pipeline_of_device_results_both_finish(slots):
    """Each releases every result at once. An amap that waited for room before handing out its
    ready head kept that result (and its slot) from its consumer: with the other amap doing the
    same, every slot was lent to results nobody had been given, for ever."""
    import asyncio

    dev = rf.device("sim", seed=12, chaos=True, checked=True)
    pipe = rf.Pipeline(f, device=dev, chunk_bytes=1024, deliver="device", slots=slots)
    items = [np.full(8, i, np.float32) for i in range(60)]

    async def consume():
        seen = []
        async for res in pipe.amap(items):
            seen.append(res.index)
            res.release()
        return seen

    async def both():
        return await asyncio.gather(consume(), consume())

    got = join([start(asyncio.run, both())], timeout=JOIN_S)[0]
    assert [len(g) for g in got] == [60, 60] and all(g == sorted(g) for g in got)  # each in its order
    pipe.close()
    assert pipe.stats().delivered == 120 and pipe.stats().in_flight == 0


GC_SWEEP = r"""
import gc, sys
import numpy as np
import ringflow as rf

def f(x, y):
    y[...] = x * 2 + 1

class Box:
    pass

mode, last = sys.argv[1], int(sys.argv[2])
for n in range(1, last):
    dev = rf.device("sim", seed=0)
    pipe = rf.Pipeline(f, device=dev, chunk_bytes=1024, deliver="device",
                       slots=rf.SlotCounts(host_in=1, device_in=1, device_out=4, host_out=1))
    res = [pipe.submit(np.full(4, i, np.float32)).result() for i in range(4)]
    keep = res[0]
    if mode == "after":
        pipe.close()
    gc.collect()
    for r in res[1:]:  # reachable only from garbage cycles: released by the collector's finaliser
        b = Box(); b.self = b; b.r = r
    del r, b, res
    gc.set_threshold(n, 100000, 100000)  # the collector runs at the n-th allocation from here
    try:
        if mode == "close":
            pipe.close()
        else:
            keep.release()
    finally:
        gc.set_threshold(700, 10, 10)
    if mode == "close":
        keep.release()
    gc.collect()
    assert dev.live().device_buffers == 0, (n, dev.live())
print("swept", last - 1)
"""


@pytest.mark.parametrize("mode", ["close", "after"])
def test_a_result_the_collector_releases_inside_a_close_or_a_release_never_waits_for_itself(mode):
    """The collector may run a dropped result's finaliser at any allocation, on a thread inside
    the scheduler's lend lock (a close, a release after close) or inside the driver's wake flag:
    the finaliser's hand-back took the same lock again and waited for ever (at the 22nd
    allocation of a close, the 11th of a release after close)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", GC_SWEEP, mode, "60"], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "swept 59" in done.stdout


def _held_past_the_device(seed):
    """A result still held once its pipeline and then its device were closed; returns it, with a
    stream of that device on which the consumer read it."""
    dev = rf.device("sim", seed=seed, checked=True)
    user = dev.create_stream()
    pipe = rf.Pipeline(f, device=dev, chunk_bytes=1024, deliver="device", slots=1)
    res = pipe.submit(np.ones(4, np.float32)).result(timeout=10)
    read_on(user, res)
    pipe.close()  # the ring stays while the result is held
    dev.close()  # its memory goes with the device
    return res, user


@pytest.mark.parametrize("taken", [False, True], ids=["first", "again"])
def test_the_array_of_a_result_whose_device_was_closed_is_refused(taken):
    """The device's memory went with its close: ``array`` handed out the slot all the same (on a
    GPU, an array over freed memory that a later allocation may hold)."""
    dev = rf.device("sim", seed=14, checked=True)
    pipe = rf.Pipeline(f, device=dev, chunk_bytes=1024, deliver="device", slots=1)
    res = pipe.submit(np.ones(4, np.float32)).result(timeout=10)
    if taken:
        res.array  # noqa: B018 - taken (and kept by the result) while the device was open
    pipe.close()
    dev.close()
    with pytest.raises(RuntimeError, match=r"result 0's device .* was closed.*memory"):
        _ = res.array
    with pytest.raises(RuntimeError, match="was closed"):
        with res:
            pass
    assert not res.released
    res.release()
    assert res.released


@pytest.mark.parametrize("how", ["stream", "default"])
def test_a_result_whose_device_was_closed_is_released_without_error(how):
    """Nothing runs on a closed device, so its release has nothing to order after: it used to
    record on the closed device (RuntimeError "this simulated device is closed" for a stream of
    it), and the result stayed unreleased."""
    res, user = _held_past_the_device(15)
    res.release(stream=user if how == "stream" else None)
    assert res.released and "released" in repr(res)
    res.release(stream=user)  # twice: nothing


def test_results_of_a_fixed_output_are_lent_from_device_out_slots_of_their_bytes():
    """A reduction delivered on the device: each device-out slot holds a result's bytes (each on a
    256-byte boundary), not a chunk's, and each result lent from one is exact while several are
    held and released out of order, the checked mode poisoning every slot freed."""
    dev = rf.device("sim", chaos=True, seed=9, checked=True)
    user = dev.create_stream()

    def sums(x, y):
        y[...] = x.reshape(4, -1).sum(axis=1)

    items = [np.arange(64, dtype=np.float32) + k for k in range(20)]
    got, held = {}, []
    with rf.Pipeline(sums, device=dev, chunk_bytes=4096, deliver="device", output=((4,), "float32"), checked=True,
                     slots=rf.SlotCounts(host_in=2, device_in=2, device_out=3, host_out=1)) as pipe:
        ring = pipe.scheduler.dev_out
        assert (ring.chunk_bytes, ring.stride, ring.buffer.nbytes) == (16, 256, 2 * 256 + 16)
        for res in pipe.map(items):
            got[res.index] = read_on(user, res)
            held.append(res)
            if len(held) == 2:
                held.pop(1).release(stream=user)
        for res in held:
            res.release(stream=user)
        user.sync()
    user.close()
    for k, it in enumerate(items):
        np.testing.assert_array_equal(got[k], it.reshape(4, -1).sum(axis=1))
