"""The simulated host (``_device/sim/host.py``): the process's ``"sim:N"`` GPUs share one host,
whose copy rate they split while declared copying at once, and whose pinned memory no two of them
hold; a plain simulated GPU stands alone on a host of its own, timed exactly as before."""

import dataclasses
import gc

import numpy as np
import pytest

import ringflow as rf
from ringflow import _plan as plan
from ringflow._device.protocol import Device, python_copy_threads
from ringflow._device.sim import SimDevice
from ringflow._device.sim import host as sim_host
from ringflow._errors import DeviceError
from tests.helpers.pages import check_pinning_within_a_page
from tests.helpers.sim import named_sims

MiB = 1 << 20
H200 = "h200-pcie5"


def f(x, y):
    y[:] = x * 2 + 1


def host_copy_seconds(dev, nbytes):
    """The virtual time ``dev.host_copy`` charges for ``nbytes``."""
    src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    start = dev.now
    dev.host_copy(dst, src)
    return dev.now - start


def task_seconds(dev, workers, nbytes, tasks=1):
    """The virtual time a worker pool's copy task of ``nbytes`` takes (start to done); with
    ``tasks``, a list of those times for that many tasks submitted at once, in order."""
    pool = dev.create_worker_pool(workers)
    started = [pool.submit(lambda: None, nbytes=nbytes) for _ in range(tasks)]
    times = []
    for task in started:
        task.sync()
        start, end = task.span
        times.append(end - start)
    pool.close()
    return times[0] if tasks == 1 else times


# -- who shares a host -----------------------------------------------------------------------------------------------
def test_named_sims_share_one_host_and_every_other_sim_has_its_own():
    with named_sims(30, 31) as (a, b):
        assert a.host is b.host
        assert rf.device("sim:31").host is a.host
    plain = [rf.device("sim"), rf.device("sim"), SimDevice()]
    assert len({id(d.host) for d in plain} | {id(a.host)}) == 4
    with named_sims(30) as (again,):  # a closed name's new device stands on the same host
        assert again.host is a.host and again is not a


# -- the rate each device gets ---------------------------------------------------------------------------------------
def test_a_device_alone_on_its_host_is_charged_exactly_the_profiles_rate():
    nbytes = 64 * MiB
    # a profile with no staging rate: its host copies are timed by the memcpy curve alone
    memcpy_only = dataclasses.replace(plan.get_profile(H200), name="no-staging-rate", staging_GBps=None)
    assert all(memcpy_only.staging_copy_rate(k) == memcpy_only.host_copy_rate(k) for k in (1, 2, 3, 4))
    for dev in (rf.device("sim", checked=False), SimDevice(H200, checked=False), SimDevice(memcpy_only, checked=False)):
        p = dev.hardware
        # the profile's rate for so many threads (HardwareProfile.staging_copy_rate: the memcpy
        # curve, capped at twice the staging curve where the profile has one), bit for bit: no
        # share of it taken; with no staging rate, the formulas before the host existed
        assert host_copy_seconds(dev, nbytes) == nbytes / (p.staging_copy_rate(python_copy_threads(nbytes)) * 1e9)
        # a pool task copies at its share of the rate of the pool's tasks running as it starts:
        # alone, one thread's; the k-th of four started at once, k threads' share
        assert task_seconds(dev, 4, nbytes) == pytest.approx(
            p.host_task_overhead_s + nbytes / (p.staging_copy_rate(1) * 1e9), rel=1e-12)
        assert task_seconds(dev, 4, nbytes, tasks=4) == pytest.approx(
            [p.host_task_overhead_s + nbytes / (p.staging_copy_rate(k) / k * 1e9) for k in (1, 2, 3, 4)], rel=1e-12)


def test_a_device_gets_its_share_of_the_rate_while_others_are_declared_copying():
    nbytes = 64 * MiB
    with named_sims(30, 31, 32, checked=False) as (a, b, c):
        p = a.hardware
        t = python_copy_threads(nbytes)
        alone_copy, alone_task = host_copy_seconds(a, nbytes), task_seconds(a, 4, nbytes)
        with b.sharing_host(4):
            assert a.host.threads_besides(a) == 4 and a.host.threads_besides(b) == 0
            # (the host's rate for that many threads, no more than the staging rate allows)
            assert host_copy_seconds(a, nbytes) == pytest.approx(
                nbytes / (min(p.host_copy_rate(t + 4), 2 * p.staging_rate(t + 4)) * t / (t + 4) * 1e9))
            shared_task = task_seconds(a, 4, nbytes)
            # the task copies alone in its pool, beside the other device's 4 threads
            assert shared_task == pytest.approx(
                p.host_task_overhead_s + nbytes / (min(p.host_copy_rate(5), 2 * p.staging_rate(5)) / 5 * 1e9))
            assert shared_task > 1.3 * alone_task  # 1 + 4 threads copy about 20 GB/s, not 5.5 + 18
            with a.sharing_host(16):  # a device's own declaration leaves its own rate alone
                assert task_seconds(a, 4, nbytes) == pytest.approx(shared_task, rel=1e-12)
            with c.sharing_host(2), b.sharing_host(2):  # declarations add up
                assert a.host.threads_besides(a) == 8
                assert task_seconds(a, 4, nbytes) == pytest.approx(
                    p.host_task_overhead_s + nbytes / (min(p.host_copy_rate(9), 2 * p.staging_rate(9)) / 9 * 1e9))
            assert a.host.threads_besides(a) == 4
        assert a.host.threads_besides(a) == 0
        assert host_copy_seconds(a, nbytes) == pytest.approx(alone_copy, rel=1e-12)
        assert task_seconds(a, 4, nbytes) == pytest.approx(alone_task, rel=1e-12)
        with b.sharing_host(4):
            b.close()  # a closed device copies nothing
            assert a.host.threads_besides(a) == 0
        for bad in (-1, 1.5, True, "4"):
            with pytest.raises(ValueError, match="threads must be an int >= 0"):
                with a.sharing_host(bad):
                    pass


def test_declarations_of_one_device_may_end_in_any_order_none_copying_included():
    """Two jobs declared the same device at once, one with no copy threads (its host memory is
    pinned): the first to end took the device's entry away with it, and the other's end raised
    KeyError out of its call. Each declaration ends on its own, in any order."""
    with named_sims(33, 34, checked=False) as (a, b):
        host = a.host
        for first, second in ((0, 0), (4, 0), (0, 4), (3, 3)):
            one, two = b.sharing_host(first), b.sharing_host(second)
            one.__enter__()
            two.__enter__()
            assert host.threads_besides(a) == first + second
            one.__exit__(None, None, None)  # the first made ends first: not nested
            assert host.threads_besides(a) == second
            two.__exit__(None, None, None)
            assert host.threads_besides(a) == 0 and b not in host._declared


def test_a_real_gpus_declaration_does_nothing():
    # the CUDA device inherits the protocol's no-op: its host shares itself
    from ringflow._device.cuda.device import CudaDevice

    assert CudaDevice.sharing_host is Device.sharing_host
    with Device.sharing_host(None, 8) as nothing:  # it reads nothing of the device
        assert nothing is None


# -- whole jobs against the planner ----------------------------------------------------------------------------------
STAGED_BYTES, STAGED_CHUNK = 128 * MiB, 4 * MiB


def staged_seconds(names, devs):
    """The simulated wall time of a staged (pageable) ``stream_map`` over ``names``: the largest
    of its devices' clock differences."""
    x = np.ones(STAGED_BYTES // 4, np.float32)
    start = [d.now for d in devs]
    y = rf.stream_map(f, x, device=names if len(names) > 1 else names[0], chunk_bytes=STAGED_CHUNK, host="stage")
    assert y[0] == 3 and y[-1] == 3
    return max(d.now - s for d, s in zip(devs, start))


def staged_on(n):
    with named_sims(*range(n), checked=False) as devs:
        return staged_seconds([f"sim:{i}" for i in range(n)], devs)


@pytest.mark.parametrize("n", [2, 4])
def test_devices_of_one_host_staging_at_once_take_what_the_planner_predicts(n):
    one, many = staged_on(1), staged_on(n)
    predicted = plan.predict_devices(H200, STAGED_BYTES, STAGED_CHUNK, n, workers=4)
    alone = plan.predict_devices(H200, STAGED_BYTES, STAGED_CHUNK, 1, workers=4)
    assert predicted.host_floor_s > predicted.per_device_s  # bound by the host's copies
    assert many == pytest.approx(predicted.predicted_s, rel=0.10)
    # one host-bound device against n: the host copy rate of 4 threads against that of 4n
    assert one / many == pytest.approx(alone.host_floor_s / predicted.host_floor_s, rel=0.10)
    assert one / many < 0.8 * n


def test_without_the_share_two_devices_staging_would_beat_the_planner(monkeypatch):
    monkeypatch.setattr(sim_host, "_SHARE", False)
    one, two = staged_on(1), staged_on(2)
    predicted = plan.predict_devices(H200, STAGED_BYTES, STAGED_CHUNK, 2, workers=4)
    assert one / two > 1.9  # as if each device had a host of its own
    assert two != pytest.approx(predicted.predicted_s, rel=0.10)  # the test above would fail
    assert two < 0.85 * predicted.predicted_s


def test_independent_sims_are_hosts_of_their_own_and_share_nothing():
    devs = [rf.device("sim", checked=False) for _ in range(2)]
    two = staged_seconds(devs, devs)
    alone = rf.device("sim", checked=False)
    assert staged_seconds([alone], [alone]) / two > 1.9


def test_a_pipeline_over_devices_of_one_host_shares_its_copy_rate():
    items = [np.full(1 << 21, k, np.float32) for k in range(24)]  # 8 MiB each: staged by the workers

    def run(devs):
        start = [d.now for d in devs]
        with rf.Pipeline(f, device=devs, chunk_bytes=8 * MiB, checked=False) as pipe:
            out = list(pipe.map(items))
            used = [p.stats().delivered for p in pipe.parts]
        assert all(np.array_equal(r, a * 2 + 1) for a, r in zip(items, out, strict=True)) and all(u > 0 for u in used)
        return max(d.now - s for d, s in zip(devs, start))

    apart = run([rf.device("sim", checked=False) for _ in range(2)])
    with named_sims(30, 31, checked=False) as devs:
        together = run(devs)
        assert devs[0].host.threads_besides(devs[0]) == 0  # closed: nothing declared any more
    assert together > 1.2 * apart


# -- pinned memory ---------------------------------------------------------------------------------------------------
def test_no_host_memory_is_behind_buffers_of_two_devices_of_one_host():
    """The happens-before checkers are per device, so a hazard between two devices' accesses to
    one host buffer could not be seen; instead no such access can be made: a stream refuses
    another device's buffer, and the host refuses to pin memory pinned already (by any of its
    devices, as a real GPU does)."""
    with named_sims(30, 31) as (a, b):
        pinned = a.allocate_host(4096)
        sa, sb = a.create_stream(), b.create_stream()
        da, db = a.allocate(4096), b.allocate(4096)
        sa.copy(pinned, da)  # device 0's d2h writes the pinned buffer...
        with pytest.raises(ValueError, match="belongs to another device"):
            sb.copy(db, pinned)  # ...and device 1's h2d may not read it, ordered or not
        sa.sync()
        x = np.zeros(1024, np.float32)
        registered = a.register_host(x)
        with pytest.raises(DeviceError, match="pinned already.*another simulated GPU of this host") as info:
            b.register_host(x[256:512])
        assert not info.value.sticky
        with pytest.raises(DeviceError, match="pinned already"):
            b.register_host(pinned.view(np.float32))  # allocated pinned memory too
        with pytest.raises(DeviceError, match="pinned already.*this device"):
            a.register_host(x[:8])  # nor the device that pinned it: a GPU pins memory once
        b.register_host(np.zeros(1024, np.float32)).close()  # other memory is free to pin
        registered.close()
        b.register_host(x).close()  # unpinned: free again
        lost = b.register_host(x)
        del lost
        gc.collect()
        a.register_host(x).close()  # a registration collected unclosed pins nothing
        for obj in (pinned, da, db, sa, sb):
            obj.close()
    x = np.zeros(64, np.float32)
    c, d = rf.device("sim"), rf.device("sim")
    c.register_host(x).close()
    held = c.register_host(x)
    d.register_host(x).close()  # GPUs of separate hosts: nothing shared, nothing refused
    held.close()


def test_memory_sharing_a_page_with_pinned_memory_is_pinned_and_only_pinned_bytes_are_refused():
    """As a GPU's driver does (tests/device/cuda/test_cuda_memory.py): bytes pinned already are
    refused, the rest of their page is not."""
    dev = rf.device("sim")
    try:
        check_pinning_within_a_page(dev, DeviceError)
    finally:
        dev.close()


def test_pinning_memory_twice_says_what_to_do_in_whole_sentences():
    """The refusal ended "or copy it into memory of this device's", a sentence cut off: it says
    which buffer to use, and how to get memory this device may pin."""
    dev = rf.device("sim")
    x = np.zeros(1024, np.float32)
    registered = dev.register_host(x)
    try:
        with pytest.raises(DeviceError) as info:
            dev.register_host(x)
        said = str(info.value)
        assert not said.endswith("device's") and said.endswith(")")
        assert "close" in said and "rf.host.empty_like" in said
    finally:
        registered.close()
        dev.close()
