"""Virtual time on the simulated GPU: when it moves, what orders ops, when data moves, and that
a seed reproduces a run exactly."""

from __future__ import annotations

import math
import pathlib
import time

import numpy as np
import pytest

import ringflow as rf
from ringflow._device.sim.engine import Engine, Op
from ringflow._device.hardware import H200_PCIE5, UNIT_TEST
from tests.helpers import Timeline, run_ring, unit_device

MB = 1_000_000  # on the unit profile a copy of 1 MB takes exactly 1 ms


def pair(dev, nbytes=MB):
    return dev.allocate_host(nbytes), dev.allocate(nbytes)


# -- time moves only inside host calls ---------------------------------------------------------------
def test_enqueue_costs_nothing_on_the_unit_profile_and_sync_moves_time():
    dev = unit_device()
    tl = Timeline(dev)
    s = dev.create_stream()
    h, d = pair(dev)
    s.copy(d, h)
    e = s.record()
    assert dev.now == 0.0
    assert tl.ops == []  # nothing has even started: the engine runs only inside host calls
    e.sync()
    assert dev.now == pytest.approx(1e-3, rel=1e-12)
    assert e.done_at == dev.now  # sync returns at the completion instant, not later


def test_each_host_call_costs_its_profile_overhead():
    dev = rf.device("sim")  # h200-pcie5: copy 4 us, launch 11 us, event 1 us
    p = dev.profile
    s1, s2 = dev.create_stream(), dev.create_stream()
    h, d = pair(dev, 4096)
    t = dev.now
    s1.copy(d, h)
    assert dev.now - t == pytest.approx(p.copy_overhead_s)
    t = dev.now
    s1.launch(lambda a: None, d.array(np.uint8, 4096))
    assert dev.now - t == pytest.approx(p.launch_overhead_s)
    t = dev.now
    e = s1.record()
    assert dev.now - t == pytest.approx(p.event_overhead_s)
    t = dev.now
    s2.wait(e)
    assert dev.now - t == pytest.approx(p.event_overhead_s)
    t = dev.now
    e.is_done  # noqa: B018 - a query is a host call too
    assert dev.now - t == pytest.approx(p.event_overhead_s)


def test_polling_is_done_terminates():
    # a query costs host time, so a polling loop lets the device make progress
    dev = rf.device("sim")
    s = dev.create_stream()
    h, d = pair(dev, 1 << 20)
    s.copy(d, h)
    e = s.record()
    polls = 0
    while not e.is_done:
        polls += 1
        assert polls < 100_000, "virtual time never moved while polling"
    assert polls > 1
    assert dev.now >= e.done_at


def test_buffer_views_and_allocations_do_not_move_time():
    dev = rf.device("sim")
    h = dev.allocate_host(64)
    t = dev.now
    h.view(np.uint8, access="w")[:] = 1
    dev.allocate(64).close()
    h.view(np.uint8, access="r")
    assert dev.now == t


def test_now_is_monotonic_across_a_run():
    dev = rf.device("sim", seed=3, chaos=True)
    seen = []
    dev.add_op_observer(lambda op: seen.append(dev.now))
    run_ring(dev)
    assert seen == sorted(seen)
    assert dev.now >= seen[-1]


def test_no_wall_clock_is_used(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the simulator touched the wall clock")

    for name in ("sleep", "time", "monotonic", "perf_counter", "time_ns", "monotonic_ns", "perf_counter_ns"):
        monkeypatch.setattr(time, name, refuse)
    dev = rf.device("sim", seed=1, chaos=True)
    assert run_ring(dev).ok
    pool = dev.create_worker_pool(2)
    tasks = [pool.submit(lambda: None, sim_seconds=1.0) for _ in range(3)]
    dev.wait_any(tasks, timeout=0.5)
    for t in tasks:
        t.sync()
    pool.close()


def test_the_sim_source_never_reads_the_wall_clock():
    src = pathlib.Path(rf.__file__).parent / "_device" / "sim"
    files = sorted(src.glob("*.py"))
    assert len(files) > 5, f"the simulated GPU's modules are not where this test looks: {src}"
    for f in files:
        text = f.read_text()
        for needle in ("import time", "from time", "time.sleep", "perf_counter", "monotonic", "datetime", "asyncio"):
            assert needle not in text, f"{f.name} uses {needle!r}"


def test_virtual_seconds_cost_no_wall_seconds():
    dev = unit_device()
    s = dev.create_stream()
    d = dev.allocate(8)
    for _ in range(100):
        s.launch(lambda a: None, d.array(np.uint8, 8), sim_seconds=60.0)
    t0 = time.perf_counter()
    s.sync()
    assert dev.now == pytest.approx(6000.0)  # 100 minutes of device time...
    assert time.perf_counter() - t0 < 1.0  # ...in well under a second


# -- what orders ops -----------------------------------------------------------------------------------
def test_stream_fifo_and_cross_stream_wait():
    dev = unit_device()
    tl = Timeline(dev)
    s1, s2 = dev.create_stream(), dev.create_stream()
    h, d = pair(dev)
    d2, h2 = dev.allocate(MB), dev.allocate_host(MB)
    s1.copy(d, h)  # h2d [0, 1 ms]
    s1.launch(lambda a, b: b.__setitem__(slice(None), a), d.array(np.uint8, MB), d2.array(np.uint8, MB),
              reads=[d], writes=[d2], sim_seconds=1e-3)  # after the copy on the same stream: [1, 2 ms]
    e = s1.record()
    s2.wait(e)
    s2.copy(h2, d2)  # d2h after the wait: [2, 3 ms]
    s2.sync()
    (copy_in,) = tl.of("copy h2d")
    (kern,) = tl.of("launch")
    (copy_out,) = tl.of("copy d2h")
    assert (copy_in.started_at, copy_in.done_at) == pytest.approx((0.0, 1e-3))
    assert (kern.started_at, kern.done_at) == pytest.approx((1e-3, 2e-3))
    assert (copy_out.started_at, copy_out.done_at) == pytest.approx((2e-3, 3e-3))


def test_unordered_streams_overlap():
    dev = unit_device()
    tl = Timeline(dev)
    s1, s2, s3 = dev.create_stream(), dev.create_stream(), dev.create_stream()
    h1, d1 = pair(dev)
    h2, d2 = pair(dev)
    d3 = dev.allocate(8)
    s1.copy(d1, h1)
    s2.copy(h2, d2)
    s3.launch(lambda a: None, d3.array(np.uint8, 8), sim_seconds=1e-3)
    for s in (s1, s2, s3):
        s.sync()
    starts = [op.started_at for op in tl.ops if op.resource]
    assert starts == [0.0, 0.0, 0.0]  # H2D engine, D2H engine and SMs all busy at once
    assert dev.now == pytest.approx(1e-3)


def test_one_copy_engine_per_direction():
    dev = unit_device()
    tl = Timeline(dev)
    s1, s2 = dev.create_stream(), dev.create_stream()
    h1, d1 = pair(dev)
    h2, d2 = pair(dev)
    s1.copy(d1, h1)
    s2.copy(d2, h2)  # same direction, other stream: queues for the same engine
    s1.sync()
    s2.sync()
    a, b = tl.of("copy h2d")
    assert (a.started_at, a.done_at, b.started_at, b.done_at) == pytest.approx((0, 1e-3, 1e-3, 2e-3))


def test_a_wait_on_a_done_event_costs_nothing_on_the_device():
    dev = unit_device()
    tl = Timeline(dev)
    s1, s2 = dev.create_stream(), dev.create_stream()
    e = s1.record()
    e.sync()
    n = len(tl.ops)
    s2.wait(e)
    s2.sync()
    assert [op.label for op in tl.ops[n:]] == ["event record"]  # no wait op was enqueued


def test_engine_refuses_to_wait_for_what_can_never_finish():
    eng = Engine(UNIT_TEST)
    q = eng.add_queue("s")
    ghost = Op(q, "never enqueued")
    op = eng.enqueue(Op(q, "blocked", deps=[ghost]))
    with pytest.raises(RuntimeError, match="can never complete"):
        eng.advance(math.inf, lambda: op.done)


# -- data moves when an op completes ---------------------------------------------------------------------
def test_a_copy_moves_its_bytes_at_its_completion_instant():
    dev = unit_device()
    s = dev.create_stream()
    h, d = pair(dev)
    h.view(np.uint8, access="w")[:] = 7
    seen = {}

    def observe(op):
        if op.label.startswith("copy h2d"):
            seen["at_done"] = int(d._mem[0])  # the device bytes, looked at from outside

    dev.add_op_observer(observe)
    s.copy(d, h)
    before = int(d._mem[0])
    e = s.record()
    e.sync()
    assert before == 0xCD  # poisoned fresh memory: nothing moved at enqueue
    assert seen["at_done"] == 7


def test_a_host_read_mid_flight_sees_old_data_unchecked():
    # with the checker off, reading a D2H destination too early gives the old bytes, not a lucky right answer
    dev = unit_device(checked=False)
    s = dev.create_stream()
    h, d = pair(dev)
    out = dev.allocate_host(MB)
    h.view(np.uint8, access="w")[:] = 42
    s.copy(d, h)
    s.sync()
    out.view(np.uint8, access="w")[:] = 1
    s.copy(out, d)
    e = s.record()
    assert dev.wait_any([e], timeout=0.5e-3) == []  # half way through the copy
    assert (out.view(np.uint8, access="r") == 1).all()
    e.sync()
    assert (out.view(np.uint8, access="r") == 42).all()


def copy_then_increment(wait: bool) -> tuple[np.ndarray, np.ndarray]:
    """H2D on one stream, ``b = a + 1`` and D2H on another, with or without the wait between
    them, on an unchecked sim (so a missing wait shows as data, not as a HazardError)."""
    dev = unit_device(checked=False)
    s1, s2 = dev.create_stream(), dev.create_stream()
    h, d = pair(dev)
    dout, hout = dev.allocate(MB), dev.allocate_host(MB)
    x = np.arange(MB, dtype=np.uint8)
    h.view(np.uint8, access="w")[:] = x

    def inc(a, b):
        b[:] = a + 1

    s1.copy(d, h)
    e = s1.record()
    if wait:
        s2.wait(e)
    s2.launch(inc, d.array(np.uint8, MB), dout.array(np.uint8, MB), reads=[d], writes=[dout], sim_seconds=1e-6)
    s2.copy(hout, dout)
    s2.sync()
    e.sync()
    return hout.view(np.uint8, access="r"), x


def test_a_missing_wait_gives_wrong_data_unchecked():
    # without the wait the kernel runs at once and reads device memory the copy has not reached
    got, x = copy_then_increment(wait=False)
    assert not np.array_equal(got, x + 1)
    assert (got == 1).all()  # it read the zeros of fresh (unpoisoned) memory


def test_the_same_program_with_the_wait_is_right():
    got, x = copy_then_increment(wait=True)
    assert np.array_equal(got, x + 1)


def test_a_kernel_runs_at_its_completion_not_at_launch():
    dev = unit_device()
    s = dev.create_stream()
    d = dev.allocate(8)
    ran_at = []
    s.launch(lambda a: ran_at.append(dev.now), d.array(np.uint8, 8), sim_seconds=2e-3)
    assert ran_at == []
    s.sync()
    assert ran_at == [pytest.approx(2e-3)]


# -- seeds and chaos -----------------------------------------------------------------------------------------
def ring_timeline(**options):
    dev = rf.device("sim", **options)
    tl = Timeline(dev)
    run = run_ring(dev)
    assert run.ok
    return tl.rows(), dev.now


def test_the_same_seed_gives_the_same_timeline():
    a = ring_timeline(seed=11, chaos=True)
    b = ring_timeline(seed=11, chaos=True)
    assert a == b  # every op's start and completion, exactly


def test_different_seeds_give_different_timelines_with_chaos():
    timelines = {seed: ring_timeline(seed=seed, chaos=True) for seed in range(5)}
    assert len({repr(t) for t in timelines.values()}) == 5


def test_chaos_off_is_deterministic_whatever_the_seed():
    base = ring_timeline(seed=0, chaos=False)
    for seed in (1, 7, 12345):
        assert ring_timeline(seed=seed, chaos=False) == base


def test_chaos_reorders_completions_across_streams():
    # which of two unordered kernels on two streams finishes first depends on the seed
    orders = set()
    for seed in range(20):
        dev = rf.device("sim", profile="unit", seed=seed, chaos=True)
        tl = Timeline(dev)
        s1, s2 = dev.create_stream(), dev.create_stream()
        h1, h2 = dev.allocate_host(MB), dev.allocate_host(MB)
        b1, b2 = dev.allocate(MB), dev.allocate(MB)
        s1.copy(b1, h1)
        s2.copy(h2, b2)
        s1.sync()
        s2.sync()
        orders.add(tuple(op.label for op in tl.ops if op.label.startswith("copy")))
    assert len(orders) == 2


@pytest.mark.parametrize("seed", range(10))
def test_chaos_never_breaks_stream_order_waits_or_engine_capacity(seed):
    dev = rf.device("sim", seed=seed, chaos=True)
    tl = Timeline(dev)
    assert run_ring(dev).ok
    by_queue: dict = {}
    by_resource: dict = {}
    for op in tl.ops:
        assert op.enqueued_at <= op.started_at <= op.done_at
        for dep in op.deps:
            assert dep.done_at <= op.started_at, (op.label, dep.label)
        by_queue.setdefault(op.queue.name, []).append(op)
        if op.resource:
            by_resource.setdefault(op.resource, []).append(op)
    for ops in by_queue.values():
        ops.sort(key=lambda o: o.seq)
        for before, after in zip(ops, ops[1:]):
            assert before.done_at <= after.started_at  # FIFO
    for ops in by_resource.values():
        ops.sort(key=lambda o: o.started_at)
        for before, after in zip(ops, ops[1:]):
            assert before.done_at <= after.started_at  # one op per engine at a time


def test_chaos_varies_durations_within_the_profiles_spread():
    spread = H200_PCIE5.chaos_spread
    nominal = (1 << 20) / (26.8e9)  # a 1 MiB H2D alone
    seen = []
    for seed in range(30):
        dev = rf.device("sim", seed=seed, chaos=True)
        tl = Timeline(dev)
        s = dev.create_stream()
        h, d = pair(dev, 1 << 20)
        s.copy(d, h)
        s.sync()
        (op,) = tl.of("copy h2d")
        seen.append((op.done_at - op.started_at) / nominal)
    assert all(1 - spread - 1e-9 <= r <= 1 + spread + 1e-9 for r in seen)
    assert max(seen) - min(seen) > spread / 2  # and it really varies
