"""Durations on the simulated GPU come from its profile: checked against numbers computed by hand
(the ``unit`` profile) and against the H200 figures of the ``h200-pcie5`` profile (``H200_PCIE5``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import ringflow as rf
from ringflow._device.sim import charge
from ringflow._device.hardware import H200_PCIE5, UNIT_TEST
from tests.helpers import Timeline, run_ring, unit_device

KiB, MiB = 1 << 10, 1 << 20
MB = 1_000_000


def copy_time(dev, nbytes, direction="h2d"):
    """Virtual seconds one copy of ``nbytes`` takes alone on ``dev``."""
    tl = Timeline(dev)
    s = dev.create_stream()
    h, d = dev.allocate_host(nbytes), dev.allocate(nbytes)
    if direction == "h2d":
        s.copy(d, h)
    else:
        s.copy(h, d)
    s.sync()
    (op,) = tl.of(f"copy {direction}")
    return op.done_at - op.started_at


def gated_pair(dev, nbytes):
    """An H2D and a D2H of ``nbytes`` on two streams, released at the same instant by one event."""
    tl = Timeline(dev)
    s0, s1, s2 = dev.create_stream(), dev.create_stream(), dev.create_stream()
    d0 = dev.allocate(8)
    h1, d1 = dev.allocate_host(nbytes), dev.allocate(nbytes)
    h2, d2 = dev.allocate_host(nbytes), dev.allocate(nbytes)
    s0.launch(lambda a: None, d0.array(np.uint8, 8), sim_seconds=1e-3)
    gate = s0.record()
    s1.wait(gate)
    s1.copy(d1, h1)
    s2.wait(gate)
    s2.copy(h2, d2)
    s1.sync()
    s2.sync()
    (up,) = tl.of("copy h2d")
    (down,) = tl.of("copy d2h")
    assert up.started_at == down.started_at
    return up, down


# -- h200-pcie5: the measured figures ---------------------------------------------------------------------
class Big:
    """One unchecked h200-pcie5 device with 256 MiB buffers, made once: the sim really moves the
    bytes, so these are the costly allocations of the suite (512 MiB). Timing does not depend on
    the data, so the copies share the two buffers without ordering them (the checker is off)."""

    N = 256 * MiB

    def __init__(self):
        self.dev = rf.device("sim", checked=False)
        self.h = self.dev.allocate_host(self.N)
        self.d = self.dev.allocate(self.N)
        self.s0, self.s1, self.s2 = (self.dev.create_stream() for _ in range(3))
        self.tl = Timeline(self.dev)

    def run(self, *copies):
        """Release ``copies`` ((stream, dst, src), ...) at one instant; their ops, in order given."""
        gate_buf = self.dev.allocate(8)
        self.s0.launch(lambda a: None, gate_buf.array(np.uint8, 8), sim_seconds=1e-3)
        gate = self.s0.record()
        n = len(self.tl.ops)
        for s, dst, src in copies:
            s.wait(gate)
            s.copy(dst, src)
        for s, _, _ in copies:
            s.sync()
        ops = [op for op in self.tl.ops[n:] if op.label.startswith("copy")]
        assert len({op.started_at for op in ops}) == 1
        return sorted(ops, key=lambda op: op.seq)


@pytest.fixture(scope="module")
def big():
    return Big()


def test_256_mib_h2d_at_the_measured_54_8_gbps(big):
    (op,) = big.run((big.s1, big.d, big.h))
    assert op.done_at - op.started_at == pytest.approx(256 * MiB / 54.8e9, rel=1e-9)


def test_256_mib_d2h_at_the_measured_54_7_gbps(big):
    (op,) = big.run((big.s2, big.h, big.d))
    assert op.done_at - op.started_at == pytest.approx(256 * MiB / 54.7e9, rel=1e-9)


def test_h2d_and_d2h_at_once_share_98_4_gbps(big):
    n = 256 * MiB
    up, down = big.run((big.s1, big.d, big.h), (big.s2, big.h, big.d))
    assert up.label.startswith("copy h2d") and down.label.startswith("copy d2h")
    scale = 98.4 / (54.8 + 54.7)  # both slowed alike so the sum is the duplex figure
    r_up, r_down = 54.8e9 * scale, 54.7e9 * scale
    t_up = n / r_up
    assert up.done_at - up.started_at == pytest.approx(t_up, rel=1e-9)
    # while both ran they moved 98.4 GB/s together
    moved_together = n + r_down * t_up
    assert moved_together / t_up == pytest.approx(98.4e9, rel=1e-9)
    # then the D2H had the link to itself again
    t_down = t_up + (n - r_down * t_up) / 54.7e9
    assert down.done_at - down.started_at == pytest.approx(t_down, rel=1e-9)


@pytest.mark.parametrize("nbytes,gbps", [(64 * KiB, 2.5), (256 * KiB, 10.4), (1 * MiB, 26.8), (4 * MiB, 43.1),
                                         (16 * MiB, 49.4)])
def test_small_copies_are_as_slow_as_measured(nbytes, gbps):
    assert copy_time(rf.device("sim"), nbytes) == pytest.approx(nbytes / (gbps * 1e9), rel=1e-9)


def test_below_64_kib_a_copy_is_latency_bound():
    t64 = copy_time(rf.device("sim"), 64 * KiB)
    for n in (1, 4 * KiB, 32 * KiB):
        assert copy_time(rf.device("sim"), n) == pytest.approx(t64, rel=1e-9)


def test_bandwidth_grows_with_copy_size_between_measured_points():
    sizes = [64 * KiB * 2 ** i for i in range(13)]  # 64 KiB .. 256 MiB
    bw = [H200_PCIE5.copy_GBps("h2d", n) for n in sizes]
    assert bw == sorted(bw)
    assert bw[0] == pytest.approx(2.5) and bw[-1] == pytest.approx(54.8)


def test_launch_overhead_bounds_a_stream_of_tiny_kernels():
    dev = rf.device("sim")
    s = dev.create_stream()
    d = dev.allocate(64)
    t0 = dev.now
    for _ in range(100):
        s.launch(lambda a: None, d.array(np.uint8, 64))
    s.sync()
    # 100 launches at 11 us each (the profile's eager launch cost), then the last kernel
    # (whose 2 us cover the 1 us of the sync's own event record)
    assert dev.now - t0 == pytest.approx(100 * 11e-6 + H200_PCIE5.kernel_min_s, rel=1e-9)


def test_a_tiny_kernel_takes_the_minimum_kernel_time():
    dev = rf.device("sim")
    tl = Timeline(dev)
    s = dev.create_stream()
    d = dev.allocate(64)
    s.launch(lambda a: None, d.array(np.uint8, 64))
    s.sync()
    (k,) = tl.of("launch")
    assert k.done_at - k.started_at == pytest.approx(H200_PCIE5.kernel_min_s)


# -- unit: numbers by hand ------------------------------------------------------------------------------------
def test_unit_profile_copies_at_1_gbps_both_ways():
    assert copy_time(unit_device(), MB, "h2d") == pytest.approx(1e-3, rel=1e-12)
    assert copy_time(unit_device(), MB, "d2h") == pytest.approx(1e-3, rel=1e-12)


def test_both_directions_at_once_on_a_link_narrower_than_their_sum():
    shared = dataclasses.replace(UNIT_TEST, name="unit-shared", duplex_GBps=1.5)
    up, down = gated_pair(rf.device("sim", profile=shared), MB)
    # 0.75 GB/s each while both run: both finish after 1 MB / 0.75 GB/s
    assert up.done_at - up.started_at == pytest.approx(MB / 0.75e9, rel=1e-9)
    assert down.done_at - down.started_at == pytest.approx(MB / 0.75e9, rel=1e-9)


def test_unit_profile_duplex_does_not_slow_either_direction():
    up, down = gated_pair(unit_device(), MB)
    assert up.done_at - up.started_at == pytest.approx(1e-3)
    assert down.done_at - down.started_at == pytest.approx(1e-3)


def test_a_kernel_is_memory_bound_over_the_bytes_it_touches_by_default():
    dev = unit_device()
    tl = Timeline(dev)
    s = dev.create_stream()
    a, b = dev.allocate(MB), dev.allocate(MB)
    s.launch(lambda x, y: None, a.array(np.uint8, MB), b.array(np.uint8, MB), reads=[a], writes=[b])
    s.launch(lambda x, y: None, a.array(np.uint8, MB), b.array(np.uint8, MB), reads=[a], writes=[b],
             sim_seconds=5e-3)
    s.sync()
    k1, k2 = tl.of("launch")
    assert k1.done_at - k1.started_at == pytest.approx(2 * MB / 10e9)  # read 1 MB + write 1 MB at 10 GB/s
    assert k2.done_at - k2.started_at == pytest.approx(5e-3)  # sim_seconds overrides


def test_fill_and_device_to_device_copy_read_and_write_device_memory():
    dev = unit_device()
    tl = Timeline(dev)
    s = dev.create_stream()
    a, b = dev.allocate(MB), dev.allocate(MB)
    s.fill(a, 0)
    s.copy(b, a)
    s.sync()
    f, c = tl.of("fill")[0], tl.of("copy d2d")[0]
    assert f.done_at - f.started_at == pytest.approx(MB / 5e9)  # half of 10 GB/s: each byte read and written
    assert c.done_at - c.started_at == pytest.approx(MB / 5e9)


def test_timing_events_measure_device_time():
    dev = unit_device()
    s = dev.create_stream()
    h, d = dev.allocate_host(MB), dev.allocate(MB)
    start = s.record(timing=True)
    s.copy(d, h)
    end = s.record(timing=True)
    end.sync()
    assert end.elapsed_since(start) == pytest.approx(1e-3)
    plain = s.record()
    plain.sync()
    with pytest.raises(RuntimeError, match="timing=True"):
        plain.elapsed_since(start)


def test_ring_loop_reaches_the_ideal_bound():
    # three balanced stages of 4.096 us on independent engines: the steady interval is one stage,
    # and n chunks take (n + 2) stages (the first chunk still traverses all three)
    n, stage = 12, 4096 / 1e9
    dev = unit_device()
    assert run_ring(dev, chunks=n, slots=3, elems=1024, kernel_seconds=stage).ok
    assert dev.now == pytest.approx((n + 2) * stage, rel=1e-9)


def test_a_ring_of_one_slot_overlaps_only_the_next_h2d_with_the_last_d2h():
    # one slot per ring: H2D(i) waits for compute(i-1) (device-in), compute(i) for D2H(i-1)
    # (device-out); only H2D(i) and D2H(i-1) overlap, so each chunk costs two stages
    n, stage = 6, 4096 / 1e9
    dev = unit_device()
    assert run_ring(dev, chunks=n, slots=1, elems=1024, kernel_seconds=stage).ok
    assert dev.now == pytest.approx((2 * n + 1) * stage, rel=1e-9)


# -- host worker pools ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 3, 8])
def test_n_tasks_on_n_lanes_finish_together(n):
    dev = unit_device()
    pool = dev.create_worker_pool(n)
    tasks = [pool.submit(lambda: None, sim_seconds=1e-3) for _ in range(n)]
    for t in tasks:
        t.sync()
    assert dev.now == pytest.approx(1e-3)
    assert [t.op.done_at for t in tasks] == pytest.approx([1e-3] * n)
    pool.close()


@pytest.mark.parametrize("n", [1, 3, 8])
def test_one_task_more_than_lanes_takes_twice_as_long(n):
    dev = unit_device()
    pool = dev.create_worker_pool(n)
    tasks = [pool.submit(lambda: None, sim_seconds=1e-3) for _ in range(n + 1)]
    for t in tasks:
        t.sync()
    assert dev.now == pytest.approx(2e-3)
    assert tasks[-1].op.started_at == pytest.approx(1e-3)
    pool.close()


def test_charge_adds_virtual_cpu_time_to_the_running_task():
    dev = unit_device()
    pool = dev.create_worker_pool(1)
    t = pool.submit(lambda: charge(3e-3), sim_seconds=1e-3)
    t.sync()
    assert dev.now == pytest.approx(4e-3)
    charge(1.0)  # outside a task: a no-op, so the same callable runs on a real GPU
    assert dev.now == pytest.approx(4e-3)


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_nbytes_sets_a_tasks_duration_from_the_host_copy_rate(workers):
    dev = unit_device()  # host copies: 1 GB/s per thread on the unit profile
    pool = dev.create_worker_pool(workers)
    tasks = [pool.submit(lambda: None, nbytes=MB) for _ in range(workers)]
    for t in tasks:
        t.sync()
    assert dev.now == pytest.approx(1e-3)


def test_wait_any_returns_the_first_done_and_times_out():
    dev = unit_device()
    pool = dev.create_worker_pool(3)
    fast = pool.submit(lambda: "fast", sim_seconds=1e-3)
    slow = pool.submit(lambda: "slow", sim_seconds=5e-3)
    assert dev.wait_any([slow, fast]) == [fast]
    assert dev.now == pytest.approx(1e-3)
    assert dev.wait_any([slow], timeout=1e-3) == []
    assert dev.now == pytest.approx(2e-3)
    assert dev.wait_any([slow, fast]) == [fast]  # fast is already done: returned at once
    assert dev.now == pytest.approx(2e-3)
    assert dev.wait_any([slow]) == [slow]
    assert dev.now == pytest.approx(5e-3)
    assert slow.result() == "slow"


def test_wait_any_mixes_events_and_tasks():
    dev = unit_device()
    pool = dev.create_worker_pool(1)
    s = dev.create_stream()
    h, d = dev.allocate_host(MB), dev.allocate(MB)
    s.copy(d, h)
    e = s.record()
    t = pool.submit(lambda: None, sim_seconds=3e-3)
    assert dev.wait_any([t, e]) == [e]
    assert dev.now == pytest.approx(1e-3)


def test_a_stream_waiting_for_the_submitters_host_work_starts_its_next_work_once_it_is_done():
    """The pool's host work runs one piece after another on a lane of its own; a stream told to
    wait for a piece runs its later work once that piece is done, without holding the host (the
    wait is no device call: the unit profile's host calls cost nothing anyway, and the host's
    clock does not move) and without ordering anything for the checker (the work touches no
    memory). A piece already done adds no wait."""
    dev = unit_device()
    pool = dev.create_worker_pool(2)
    tl = Timeline(dev)
    s = dev.create_stream()
    h, d = dev.allocate_host(MB), dev.allocate(MB)
    first, second = pool.host_work(2e-3), pool.host_work(3e-3)
    s.wait(second)
    s.copy(d, h)
    assert dev.now == 0.0  # not held
    s.sync()
    (copy,) = tl.of("copy h2d")
    assert first.span == pytest.approx((0.0, 2e-3)) and second.span == pytest.approx((2e-3, 5e-3))
    assert copy.started_at == pytest.approx(5e-3) and dev.now == pytest.approx(6e-3)
    waits = len(tl.of("wait"))
    s.wait(first)  # done: nothing to wait for
    s.copy(d, h)
    s.sync()
    assert len(tl.of("wait")) == waits and dev.now == pytest.approx(7e-3)
    other = unit_device()
    with pytest.raises(ValueError, match="another device"):
        other.create_stream().wait(pool.host_work(1e-3))
    pool.close()


# -- stream priorities ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("chaos", [False, True])
def test_a_higher_priority_streams_kernel_runs_first_when_both_wait(chaos):
    """Two kernels become ready while a third holds the compute engine: the one on the
    higher-priority stream (the lower number) runs next, although it was enqueued second."""
    dev = rf.device("sim", profile="unit", chaos=chaos, seed=1)
    tl = Timeline(dev)
    busy, low, high = dev.create_stream(), dev.create_stream(priority=0), dev.create_stream(priority=-5)
    busy.launch(lambda a: None, dev.allocate(8).array(np.uint8, 8), sim_seconds=1e-3)
    dev.sleep(1e-4)  # the busy kernel now holds the engine
    for s in (low, high):  # each on its own buffer: nothing orders them but the engine
        s.launch(lambda a: None, dev.allocate(8).array(np.uint8, 8), sim_seconds=1e-3)
    for s in (busy, low, high):
        s.sync()
    first, second, third = sorted(tl.of("launch"), key=lambda op: op.started_at)
    assert first.queue is busy._queue and second.queue is high._queue and third.queue is low._queue


def test_equal_priorities_keep_the_order_kernels_were_enqueued():
    dev = rf.device("sim", profile="unit")
    tl = Timeline(dev)
    busy, a, b = (dev.create_stream(priority=-2) for _ in range(3))
    for s in (busy, a, b):
        s.launch(lambda x: None, dev.allocate(8).array(np.uint8, 8), sim_seconds=1e-3)
    for s in (busy, a, b):
        s.sync()
    order = [op.queue for op in sorted(tl.of("launch"), key=lambda op: op.started_at)]
    assert order == [busy._queue, a._queue, b._queue]


def test_timing_events_add_nothing_to_a_span_on_the_simulated_gpu():
    dev = rf.device("sim")
    s = dev.create_stream()
    t0 = dev.now
    assert dev.timing_floor(s) == 0.0
    assert dev.now == t0  # nothing recorded, no virtual time spent


@pytest.mark.parametrize("call_s", [None, 1e-3])
def test_registering_and_unregistering_take_their_bytes_at_the_profiles_rates_and_the_fixed_cost(call_s):
    """Pinning an array in place advances the clock by its bytes at register_GBps and half the
    fixed cost per array (register_call_s, none where not measured); unpinning it by its bytes
    at unregister_GBps and the other half. Allocating pinned memory costs no such time."""
    p = dataclasses.replace(H200_PCIE5, name="rates", register_GBps=2.0, unregister_GBps=4.0, register_call_s=call_s)
    dev = rf.device("sim", profile=p)
    arr = np.ones(8 << 20, np.uint8)
    half = (call_s or 0.0) / 2
    t0 = dev.now
    buf = dev.register_host(arr)
    assert dev.now - t0 == pytest.approx((8 << 20) / 2e9 + half, rel=1e-9)
    t0 = dev.now
    buf.close()
    assert dev.now - t0 == pytest.approx((8 << 20) / 4e9 + half, rel=1e-9)
    t0 = dev.now
    dev.allocate_host(8 << 20).close()
    assert dev.now == t0
    dev.close()
