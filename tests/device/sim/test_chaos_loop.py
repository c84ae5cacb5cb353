"""Chaos over many seeds: a correctly synchronised three-stream copy -> compute -> copy loop never
reports a hazard and is bit-exact, and removing any single wait or sync from it is caught.

The loop is ``tests.helpers.ring.run_ring``; its six ordering points are ``POINTS``. A hypothesis
test adds random programs that are correctly synchronised by construction.
"""

from __future__ import annotations

import gc
import inspect
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ringflow as rf
from tests.helpers import OBSERVE_STYLES, POINTS, Timeline, observe, ring, run_ring, slowed, unit_device

SEEDS = range(200)


def test_correct_loop_never_reports_a_hazard_over_200_seeds_and_is_bit_exact():
    devices = []
    for seed in SEEDS:
        dev = rf.device("sim", seed=seed, chaos=True)
        run = run_ring(dev, chunks=12, slots=3)
        assert run.ok, f"seed {seed}: wrong data from a correctly synchronised loop"
        assert dev.checks > 0
        devices.append(dev)
    gc.collect()
    for seed, dev in zip(SEEDS, devices):
        assert dev.live().total == 0, f"seed {seed}: leaked {dev.live()}"


@pytest.mark.parametrize("style", OBSERVE_STYLES)
def test_correct_loop_with_each_way_of_observing_events(style):
    for seed in range(20):
        dev = rf.device("sim", seed=seed, chaos=True)  # h200-pcie5: queries cost time, so polling ends
        assert run_ring(dev, observe_style=style).ok


@pytest.mark.parametrize("slots", [1, 2, 4])
def test_correct_loop_with_other_ring_sizes(slots):
    for seed in range(20):
        assert run_ring(rf.device("sim", seed=seed, chaos=True), slots=slots, chunks=9).ok


# -- the loop's ordering points are all of its waits and syncs (test the test) -------------------------------------------
def test_every_wait_and_sync_in_the_loop_is_a_droppable_point():
    src = inspect.getsource(ring.run_ring)
    lines = src.splitlines()
    guarded = set()
    calls = 0
    for i, line in enumerate(lines):
        if ".wait(" in line or "observe(dev" in line or ".sync()" in line or "wait_any" in line:
            calls += 1
            m = re.search(r'at\("(\w+)"', lines[i - 1])
            assert m, f"unguarded wait/sync in run_ring: {line.strip()!r}"
            guarded.add(m.group(1))
    assert calls == 6  # four stream waits, two host syncs
    assert guarded == set(POINTS)


def test_a_clean_run_performs_every_point_and_drops_none():
    run = run_ring(unit_device())
    assert {p for p, _ in run.executed} == set(POINTS)
    assert run.dropped == []
    # chunks 0..2 have no earlier user of their slot, so the "free again" points start at chunk 3
    assert ("host_syncs_h2d_before_refill", 2) not in run.executed
    assert ("host_syncs_h2d_before_refill", 3) in run.executed
    assert len(run.executed) == 3 * 12 + 3 * 9


def test_dropping_skips_exactly_what_was_asked():
    dev = unit_device(checked=False)
    run = run_ring(dev, drop=("compute_waits_h2d", 4))
    assert run.dropped == [("compute_waits_h2d", 4)]
    run = run_ring(unit_device(checked=False), drop="compute_waits_h2d")
    assert run.dropped == [("compute_waits_h2d", i) for i in range(12)]
    with pytest.raises(ValueError, match="unknown point"):
        run_ring(unit_device(), drop="no_such_point")


# -- removing any single wait or sync makes some seed fail -------------------------------------------------------------
EXPECTED_PAIR = {  # the two operations the HazardError must name when that point is missing
    "host_syncs_h2d_before_refill": ("copy h2d", "host view (w)"),
    "h2d_waits_compute_done": ("launch kernel", "copy h2d"),
    "compute_waits_h2d": ("copy h2d", "launch kernel"),
    "compute_waits_d2h_done": ("copy d2h", "launch kernel"),
    "d2h_waits_compute": ("launch kernel", "copy d2h"),
    "host_syncs_d2h_before_consume": ("copy d2h", "host view (r)"),
}


@pytest.mark.parametrize("point", list(POINTS))
def test_removing_a_point_is_caught_by_the_checker(point):
    caught = []
    for seed in SEEDS:
        try:
            run_ring(rf.device("sim", seed=seed, chaos=True), drop=point)
        except rf.HazardError as err:
            caught.append((seed, err))
            break
    assert caught, f"dropping {point} was never caught over {len(SEEDS)} seeds"
    seed, err = caught[0]
    msg = str(err)
    first, second = EXPECTED_PAIR[point]
    assert err.first.op.startswith(first) and err.second.op.startswith(second), msg
    assert first in msg and second in msg and err.first.buffer_name in msg


def _instances():
    return run_ring(unit_device()).executed


@pytest.mark.parametrize("instance", _instances(), ids=lambda p: f"{p[0]}@{p[1]}")
def test_removing_any_single_instance_is_caught(instance):
    # the checker is happens-before, not timing: one missing wait for one chunk is enough
    with pytest.raises(rf.HazardError):
        run_ring(rf.device("sim", seed=instance[1], chaos=True), drop=instance)


# Without the checker, the sim's data model alone exposes each missing point as wrong data,
# provided timing lets the race happen: each point needs its own stage to be the bottleneck.
STAGE = 4096 / 1e9  # one 4 KiB chunk at the unit profile's 1 GB/s
RACE_SETUP = {
    "host_syncs_h2d_before_refill": dict(profile="unit", kernel_seconds=STAGE),
    "h2d_waits_compute_done": dict(profile="unit", kernel_seconds=4 * STAGE),  # compute-bound
    "compute_waits_h2d": dict(profile=slowed("h2d"), kernel_seconds=STAGE),  # h2d-bound
    "compute_waits_d2h_done": dict(profile=slowed("d2h"), kernel_seconds=STAGE),  # d2h-bound
    "d2h_waits_compute": dict(profile="unit", kernel_seconds=4 * STAGE),  # compute-bound
    "host_syncs_d2h_before_consume": dict(profile="unit", kernel_seconds=STAGE),
}


@pytest.mark.parametrize("point", list(POINTS))
def test_removing_a_point_gives_wrong_data_without_the_checker(point):
    setup = RACE_SETUP[point]
    for seed in SEEDS:
        dev = rf.device("sim", profile=setup["profile"], seed=seed, chaos=True, checked=False)
        if not run_ring(dev, drop=point, kernel_seconds=setup["kernel_seconds"]).ok:
            return
    pytest.fail(f"dropping {point} gave the right answer on every seed: a lucky right answer")


def test_the_same_setups_are_right_with_every_point_in_place():
    for setup in RACE_SETUP.values():
        for seed in range(20):
            dev = rf.device("sim", profile=setup["profile"], seed=seed, chaos=True, checked=False)
            assert run_ring(dev, kernel_seconds=setup["kernel_seconds"]).ok


def test_a_loop_timeline_is_reproducible_from_its_seed():
    def timeline(seed):
        dev = rf.device("sim", seed=seed, chaos=True)
        tl = Timeline(dev)
        run_ring(dev)
        return tl.rows()

    assert timeline(5) == timeline(5)
    assert timeline(5) != timeline(6)


# -- random programs, correctly synchronised by construction ------------------------------------------------------------
# Two pinned and two device buffers of 32 bytes; the host and three streams issue random copies
# (any direction), fills, kernels (y = x + c) and host reads and writes over 8-byte-aligned
# ranges. Before each operation the program orders itself after every earlier conflicting one on
# another actor (a stream waits on that operation's event; the host syncs it). Such a program
# must never raise, and every value the host reads must equal a sequential execution's.

BUF = 32
HOST, DEVICE = ("h0", "h1"), ("d0", "d1")
rng_st = st.tuples(st.integers(0, 3), st.integers(1, 4)).map(lambda t: (t[0] * 8, min(BUF - t[0] * 8, t[1] * 8)))
stream_st = st.integers(0, 2)
op_st = st.one_of(
    st.tuples(st.just("copy"), stream_st, st.sampled_from(HOST + DEVICE), st.sampled_from(HOST + DEVICE), rng_st,
              rng_st),
    st.tuples(st.just("fill"), stream_st, st.sampled_from(HOST + DEVICE), rng_st, st.integers(0, 255)),
    st.tuples(st.just("kernel"), stream_st, st.sampled_from(DEVICE), st.sampled_from(DEVICE), rng_st, rng_st,
              st.integers(0, 255)),
    st.tuples(st.just("hwrite"), st.sampled_from(HOST), rng_st, st.integers(0, 255)),
    st.tuples(st.just("hread"), st.sampled_from(HOST), rng_st),
)


def _add(c):
    def k(a, b):
        b[:] = a + np.uint8(c)
    k.__name__ = f"add{c}"
    return k


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op_st, min_size=1, max_size=25), seed=st.integers(0, 2**16), fast_host=st.booleans(),
       styles=st.lists(st.sampled_from(OBSERVE_STYLES), min_size=1, max_size=4))
def test_random_correctly_synchronised_programs_never_raise_and_match_sequential(ops, seed, fast_host, styles):
    profile = "unit" if fast_host else "h200-pcie5"
    if fast_host:
        styles = [s for s in styles if s != "is_done"] or ["sync"]  # polling needs queries that cost time
    dev = rf.device("sim", profile=profile, seed=seed, chaos=True)
    streams = [dev.create_stream() for _ in range(3)]
    bufs = {name: dev.allocate_host(BUF) for name in HOST}
    bufs.update({name: dev.allocate(BUF) for name in DEVICE})
    model = {name: np.full(BUF, 0xCD, np.uint8) for name in bufs}  # checked mode poisons fresh memory
    past: list = []  # (actor, [(buf, lo, hi, writes)], event)
    n_sync = 0

    def order_after_conflicts(actor, touches):
        nonlocal n_sync
        for p_actor, p_touches, p_event in past:
            if p_actor == actor or p_event is None:
                continue  # same actor: program order; host before a stream: enqueue order
            if not any(b == pb and lo < phi and plo < hi and (w or pw)
                       for (b, lo, hi, w) in touches for (pb, plo, phi, pw) in p_touches):
                continue
            if actor == "host":
                observe(dev, p_event, styles[n_sync % len(styles)])
                n_sync += 1
            else:
                streams[actor].wait(p_event)

    for op in ops:
        kind = op[0]
        if kind == "copy":
            _, s, dst, src, (dlo, dn), (slo, sn) = op
            n = min(dn, sn)
            touches = [(src, slo, slo + n, False), (dst, dlo, dlo + n, True)]
            order_after_conflicts(s, touches)
            streams[s].copy(bufs[dst].slice(dlo, n), bufs[src].slice(slo, n))
            model[dst][dlo:dlo + n] = model[src][slo:slo + n].copy()
        elif kind == "fill":
            _, s, dst, (lo, n), byte = op
            touches = [(dst, lo, lo + n, True)]
            order_after_conflicts(s, touches)
            streams[s].fill(bufs[dst].slice(lo, n), byte)
            model[dst][lo:lo + n] = byte
        elif kind == "kernel":
            _, s, src, dst, (slo, sn), (dlo, dn), c = op
            n = min(sn, dn)
            touches = [(src, slo, slo + n, False), (dst, dlo, dlo + n, True)]
            order_after_conflicts(s, touches)
            a, b = bufs[src].slice(slo, n), bufs[dst].slice(dlo, n)
            streams[s].launch(_add(c), a.array(np.uint8, n), b.array(np.uint8, n), reads=[a], writes=[b])
            model[dst][dlo:dlo + n] = model[src][slo:slo + n] + np.uint8(c)
        elif kind == "hwrite":
            _, dst, (lo, n), byte = op
            touches = [(dst, lo, lo + n, True)]
            order_after_conflicts("host", touches)
            bufs[dst].view(np.uint8, offset=lo, count=n, access="w")[:] = byte
            model[dst][lo:lo + n] = byte
        else:
            _, src, (lo, n) = op
            touches = [(src, lo, lo + n, False)]
            order_after_conflicts("host", touches)
            got = bufs[src].view(np.uint8, offset=lo, count=n, access="r")
            assert np.array_equal(got, model[src][lo:lo + n]), f"host read of {src}[{lo}:{lo + n}]"
        actor = "host" if kind in ("hwrite", "hread") else op[1]
        event = streams[actor].record() if actor != "host" else None
        past.append((actor, touches, event))

    for s in streams:
        s.sync()
    for name in HOST:
        assert np.array_equal(bufs[name].view(np.uint8, access="r"), model[name]), name
    for name in DEVICE:
        back = dev.allocate_host(BUF)
        streams[0].copy(back, bufs[name])
        streams[0].sync()
        assert np.array_equal(back.view(np.uint8, access="r"), model[name]), name
