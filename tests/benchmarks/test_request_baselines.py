"""The request-stream baselines of ``ringflow bench requests``: the ring's bookkeeping, the
open-loop driver, the measurements and the side-by-side figures on the CPU (a fake backend and a
fake clock stand in for the GPU); the torch baselines themselves on a GPU."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from ringflow._bench import baselines as bl
from ringflow._bench.workloads import TORCH_NAIVE, TORCH_RING, versus_torch


def _gpu() -> bool:
    from ringflow._device import cuda_available

    return cuda_available()[0]


class Clock:
    """A clock that moves ``step`` seconds each time it is read, or when told to."""

    def __init__(self, step: float = 1e-6):
        self.t, self.step = 0.0, step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


class FakeRing:
    """A ring backend whose requests finish when the test (or ``auto_after`` polls) says so;
    it logs what the ring asks of it and refuses a slot reused before it was finished."""

    def __init__(self, slots: int, auto_after: int | None = None, wrong: set | None = None):
        self.busy = [None] * slots  # the item in flight in each slot
        self.done = [False] * slots
        self.log: list[tuple[str, int]] = []
        self.polls = [0] * slots
        self.auto_after, self.wrong = auto_after, wrong or set()
        self.started = 0

    def start(self, slot, item):
        assert self.busy[slot] is None, f"slot {slot} reused before its request was finished"
        self.busy[slot], self.done[slot] = (self.started, item), False
        self.started += 1
        self.log.append(("start", slot))

    def ready(self, slot):
        self.polls[slot] += 1
        if self.auto_after is not None and self.polls[slot] >= self.auto_after:
            self.done[slot] = True
        return self.done[slot]

    def finish(self, slot):
        (n, item), self.busy[slot], self.polls[slot] = self.busy[slot], None, 0
        self.log.append(("finish", slot))
        y = bl.scale_shift_expected(item)
        if n in self.wrong:
            y[0] += 1
        return y


def _items(count, seed=0, max_elems=64):
    rng = np.random.default_rng(seed)
    return [rng.uniform(0.5, 1.5, int(rng.integers(1, max_elems))).astype(np.float32) for _ in range(count)]


def test_ring_takes_slots_round_robin_and_completes_oldest_first():
    backend = FakeRing(3)
    ring = bl.RingServer(backend, 3, clock=Clock())
    items = _items(7)
    ring.reset(7)
    for i in range(3):
        ring.submit(i, items[i])
    assert ring.in_flight == 3 and [s for _, s in backend.log] == [0, 1, 2]
    assert not ring.poll()  # nothing done yet: poll does not wait
    backend.done[1] = True
    assert not ring.poll()  # the second is done but the oldest is not: completion stays in order
    backend.done[0] = True
    assert ring.poll() and ring.poll() and not ring.poll()
    assert ring.in_flight == 1 and ring.results[0] is not None and ring.results[2] is None
    ring.submit(3, items[3])  # two free slots: no wait
    ring.submit(4, items[4])
    assert ring.in_flight == 3 and backend.log[-2:] == [("start", 0), ("start", 1)]
    ring.submit(5, items[5])  # full: the oldest (request 2, slot 2) is completed first, then its slot reused
    assert backend.log[-2:] == [("finish", 2), ("start", 2)] and ring.in_flight == 3
    ring.submit(6, items[6])
    assert backend.log[-2:] == [("finish", 0), ("start", 0)]
    ring.drain()
    assert ring.in_flight == 0
    assert [s for what, s in backend.log if what == "finish"] == [0, 1, 2, 0, 1, 2, 0]
    for r, it in zip(ring.results, items):
        np.testing.assert_array_equal(r, bl.scale_shift_expected(it))
    lat = ring.latencies()
    assert np.all(lat > 0) and np.all(np.isfinite(lat))


def test_one_slot_ring_is_one_request_at_a_time():
    backend = FakeRing(1)
    ring = bl.RingServer(backend, 1, clock=Clock())
    ring.reset(3)
    for i, it in enumerate(_items(3)):
        ring.submit(i, it)
    ring.drain()
    assert backend.log == [("start", 0), ("finish", 0)] * 3


def test_ring_refuses_a_bad_slot_count():
    with pytest.raises(ValueError, match="slots"):
        bl.RingServer(FakeRing(1), 0)


def test_open_loop_submits_each_request_at_its_arrival():
    clock = Clock(step=0.0)
    seen = []

    def advance(t):  # an idle server: jump to the arrival
        clock.t = max(clock.t, t)

    def submit(i):
        seen.append((i, clock.t))
        if i == 1:
            clock.t += 5.0  # a slow submit: request 2 arrives meanwhile and goes in right after

    clock.t = 10.0
    arrived, submitted = bl.open_loop(clock, [1.0, 2.0, 0.5, 6.0], submit, advance)
    assert [i for i, _ in seen] == [0, 1, 2, 3]
    np.testing.assert_allclose(arrived, [11.0, 13.0, 13.5, 19.5])
    np.testing.assert_allclose(submitted, [11.0, 13.0, 18.0, 19.5])


def test_sync_server_records_each_call():
    calls = []
    clock = Clock()
    srv = bl.SyncServer(lambda a: calls.append(a.size) or bl.scale_shift_expected(a), clock=clock)
    items = _items(4)
    srv.reset(4)
    for i, it in enumerate(items):
        srv.submit(i, it)
    srv.drain()
    assert calls == [a.size for a in items] and not srv.poll() and srv.in_flight == 0
    assert np.all(srv.latencies() > 0)
    srv.advance(clock.t + 1e-3)
    assert clock.t >= 1e-3


@pytest.mark.parametrize("slots", [1, 4])
def test_measure_request_server_on_a_fake_ring(slots):
    items = _items(40, seed=slots)
    expected = [bl.scale_shift_expected(a) for a in items]
    backend = FakeRing(slots, auto_after=3)
    ring = bl.RingServer(backend, slots, clock=Clock())
    m = bl.measure_request_server(ring, items, expected, warmup=5, loads=(0.5, 0.8), passes=3)
    # an untimed pass over every request, the isolated pass, 3 capacity passes, 5 + 40 per load
    assert backend.started == 40 + 40 + 3 * 40 + 2 * (5 + 40)
    assert m["correct"] is True and m["requests"] == 40 and len(m["capacity_passes_per_s"]) == 3
    assert m["capacity_per_s"] == float(np.median(m["capacity_passes_per_s"])) > 0
    assert 0 < m["isolated_p50_ms"] <= m["isolated_p99_ms"]
    assert [lv["load"] for lv in m["levels"]] == [0.5, 0.8]
    for lv in m["levels"]:
        assert lv["correct"] and lv["offered_per_s"] == pytest.approx(lv["load"] * m["capacity_per_s"])
        assert 0 < lv["p50_ms"] <= lv["p99_ms"]
        assert lv["p99_over_isolated"] == pytest.approx(lv["p99_ms"] / m["isolated_p99_ms"])
        assert lv["gc_pauses"] >= 0 and lv["gc_pause_max_ms"] >= 0 and lv["p99_slowdown_per_request"] > 0
        slowest = [s["latency_ms"] for s in lv["slowest"]]
        assert len(slowest) == 5 and slowest == sorted(slowest, reverse=True) and slowest[0] == pytest.approx(
            max(slowest))
        assert all(s["arrived_ms"] <= s["submitted_ms"] for s in lv["slowest"])
    assert ring.in_flight == 0
    row = bl._request_row("fake", m, slots=slots)
    assert row["name"] == "fake" and row["load"] == 0.5 and row["p99_ms"] == m["levels"][0]["p99_ms"]
    json.dumps(row)


def test_loaded_latency_counts_from_arrival():
    """A server that takes each request inside submit() hides its queue from a clock started at
    submit(): under load the latency must run from the arrival."""
    clock = Clock(step=0.0)

    def serve(a):
        clock.t += 1e-3  # each request takes 1 ms of the server's time
        return bl.scale_shift_expected(a)

    def advance(t):
        clock.t = max(clock.t, t)

    srv = bl.SyncServer(serve, clock=clock)
    srv.advance = advance
    items = _items(200, seed=5)
    m = bl.measure_request_server(srv, items, [bl.scale_shift_expected(a) for a in items], warmup=5,
                                  loads=(0.8,), passes=1)
    assert m["capacity_per_s"] == pytest.approx(1000.0) and m["isolated_p99_ms"] == pytest.approx(1.0)
    (level,) = m["levels"]
    assert level["p99_from_submit_ms"] == pytest.approx(1.0)  # what submit-to-result would report
    assert level["p99_ms"] > 2.0 and level["p99_over_isolated"] > 2.0  # requests queued behind others


@pytest.mark.parametrize("wrong", [16, 30])
def test_measure_request_server_catches_a_wrong_result(wrong):
    items = _items(12, seed=3)
    expected = [bl.scale_shift_expected(a) for a in items]
    # the request started 17th (an isolated one, checked as it comes back) or 31st (in the first
    # capacity pass) is wrong: after a warm-up pass over the 12 requests
    ring = bl.RingServer(FakeRing(2, auto_after=1, wrong={wrong}), 2, clock=Clock())
    m = bl.measure_request_server(ring, items, expected, warmup=5, loads=(0.8,), passes=2)
    assert m["correct"] is False and m["levels"][0]["correct"] is True
    with pytest.raises(ValueError, match="expected"):
        bl.measure_request_server(ring, items, expected[:-1])


def test_versus_torch_side_by_side():
    ours = {"capacity_per_s": 3000.0, "isolated_p50_ms": 0.3, "isolated_p99_ms": 1.0,
            "levels": [{"load": 0.5, "p50_ms": 0.4, "p99_ms": 1.1, "p99_over_isolated": 1.1},
                       {"load": 0.8, "p50_ms": 0.5, "p99_ms": 1.5, "p99_over_isolated": 1.5}]}
    ring = {"name": TORCH_RING, "capacity_per_s": 2000.0, "isolated_p50_ms": 0.25, "isolated_p99_ms": 0.9,
            "levels": [{"load": 0.8, "p50_ms": 0.6, "p99_ms": 2.7, "p99_over_isolated": 3.0}], "correct": True}
    naive = {"name": TORCH_NAIVE, "capacity_per_s": 1200.0, "isolated_p50_ms": 0.7, "isolated_p99_ms": 1.4,
             "levels": [], "correct": True}
    r = versus_torch(ours, [naive, ring])
    assert r["ringflow_vs_torch_ring"] == 1.5 and r["ringflow_vs_torch_naive"] == 2.5
    assert r["p99_80_over_isolated"] == 1.5
    by = {s["name"]: s for s in r["side_by_side"]}
    assert by["ringflow"]["p99_80_ms"] == 1.5 and by[TORCH_RING]["p99_80_ms"] == 2.7
    assert by[TORCH_NAIVE]["capacity_per_s"] == 1200.0 and by[TORCH_NAIVE]["p99_80_ms"] is None
    json.dumps(r)


def test_versus_torch_without_the_baselines():
    ours = {"capacity_per_s": 3000.0, "isolated_p50_ms": 0.3, "isolated_p99_ms": 1.0,
            "levels": [{"load": 0.95, "p50_ms": 0.4, "p99_ms": 1.1, "p99_over_isolated": 1.1}]}
    r = versus_torch(ours, [{"name": TORCH_RING, "skipped": "no GPU"}])
    assert r["ringflow_vs_torch_ring"] is None and r["ringflow_vs_torch_naive"] is None
    assert r["p99_80_over_isolated"] is None  # no 80% level measured
    by = {s["name"]: s for s in r["side_by_side"]}
    assert by[TORCH_RING] == {"name": TORCH_RING, "skipped": "no GPU"} and by[TORCH_NAIVE]["skipped"] == "not run"


def test_request_baseline_arguments_checked_before_any_gpu_use():
    items = _items(3)
    with pytest.raises(ValueError, match="slots"):
        bl.torch_requests_ring(items, slots=0)
    with pytest.raises(ValueError, match="slot_bytes"):
        bl.torch_requests_ring(items, slot_bytes=4)
    with pytest.raises(TypeError, match="float32"):
        bl.torch_requests_naive([a.astype(np.float64) for a in items])
    with pytest.raises(ValueError, match="at least one request"):
        bl.torch_requests_ring([])


@pytest.mark.skipif(_gpu(), reason="checks the behaviour where no GPU is usable")
def test_request_baselines_unavailable_without_gpu():
    for fn in (bl.torch_requests_naive, bl.torch_requests_ring):
        with pytest.raises(bl.BaselineUnavailable) as info:
            fn(_items(3))
        assert "PyTorch" in str(info.value)


# -- GPU ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("which", ["naive", "ring"])
def test_torch_request_baselines_gpu(which):
    rng = np.random.default_rng(4)
    items = [rng.uniform(0.5, 1.5, int(n)).astype(np.float32) for n in rng.integers(1000, 1 << 18, 60)]
    fn = bl.torch_requests_naive if which == "naive" else bl.torch_requests_ring
    r = fn(items, warmup=5, loads=(0.8,), passes=2)
    assert r["correct"] is True and r["compute_bit_exact_on_sample"] is True, r
    assert r["capacity_per_s"] > 0 and 0 < r["isolated_p50_ms"] <= r["isolated_p99_ms"]
    assert r["load"] == 0.8 and 0 < r["p50_ms"] <= r["p99_ms"]
    json.dumps(r)


def test_bench_requests_on_the_sim_carries_the_comparison(tmp_path, capsys):
    import os

    from ringflow._cli import main

    assert main(["bench", "requests", "--device", "sim", "--quick", "--out", str(tmp_path)]) == 0
    (path,) = [p for p in os.listdir(tmp_path) if p.startswith("bench-sim")]
    with open(tmp_path / path) as fh:
        w = json.load(fh)["workloads"]["requests"]
    assert "error" not in w, w.get("error")
    # ringflow's own figures; the torch baselines skipped with the reason, their ratios null
    assert w["capacity_per_s"] > 0 and w["p99_80_over_isolated"] > 0
    assert w["ringflow_vs_torch_ring"] is None and w["ringflow_vs_torch_naive"] is None
    by = {r["name"]: r for r in w["rows"]}
    for name in (TORCH_NAIVE, TORCH_RING):
        assert "simulated GPU" in by[name]["skipped"]
    side = {s["name"]: s for s in w["side_by_side"]}
    assert side["ringflow"]["capacity_per_s"] == w["capacity_per_s"] and side[TORCH_RING]["skipped"]
    assert all(r.get("correct", True) is not False for r in w["rows"])
    assert "capacity_per_s=" in capsys.readouterr().out


def test_ringflow_is_measured_by_the_baselines_method(monkeypatch):
    """ringflow's pipeline goes through measure_request_server like the torch baselines: an
    untimed pass over every request first, the isolated pass, 3 capacity passes, then warm-up
    and the requests again at each load; every result checked and every landing stamped."""
    import ringflow as rf
    from ringflow._bench import workloads

    seen = {}
    real = workloads.measure_request_server

    def spy(server, items, expected, **kw):
        out = real(server, items, expected, **kw)
        seen["accepted"] = server.pipe.stats().accepted
        return out

    monkeypatch.setattr(workloads, "measure_request_server", spy)
    w = workloads.requests(rf.device("sim"), count=12, warmup=3, loads=(0.5, 0.8))
    assert seen["accepted"] == 12 + 12 + 3 * 12 + 2 * (3 + 12) and w["cold_pass_per_s"] > 0
    assert w["correct"] is True and len(w["capacity_passes_per_s"]) == 3
    assert [lv["load"] for lv in w["levels"]] == [0.5, 0.8] and all(lv["correct"] for lv in w["levels"])
    assert all("slowest" in lv and "gc_pauses" in lv for lv in w["levels"])
    # a landing left unstamped would make its level's percentiles NaN
    assert all(np.isfinite([lv["p99_ms"], lv["p99_from_submit_ms"]]).all() for lv in w["levels"])
    assert 0 < w["pinned_high_water_MiB"] <= w["pinned_allocated_MiB"]
    at80 = w["levels"][1]
    assert w["p99_80_over_perfect_fifo"] == at80["p99_over_perfect_fifo"] and len(at80["p99_over_perfect_fifo"]) == 2


def test_the_requests_workload_with_handler_threads_submits_on_them(monkeypatch):
    import threading

    import ringflow as rf
    from ringflow._bench import workloads

    names = set()
    real = workloads.PipelineServer.submit

    def spy(self, i, item):
        names.add(threading.current_thread().name)
        return real(self, i, item)

    monkeypatch.setattr(workloads.PipelineServer, "submit", spy)
    w = workloads.requests(rf.device("sim"), count=12, warmup=3, loads=(0.8,), handlers=3, baselines=False)
    assert w["correct"] is True and w["handler_threads"] == 3 and all(lv["correct"] for lv in w["levels"])
    assert names and names <= {f"request-handler-{k}" for k in range(3)}
    assert not [r for r in w["rows"] if "torch" in r["name"]]  # baselines=False leaves them out
    assert not [t for t in threading.enumerate() if t.name.startswith("request-handler")]  # closed


def test_queue_floor_is_a_perfect_fifo_server():
    iso = np.array([0.5, 0.5, 0.5, 0.5])
    # spaced at the service time: nobody waits
    fixed, by_size = bl.queue_floor(np.array([0.0, 1.0, 2.0, 3.0]), iso, [10, 10, 10, 10], capacity=1.0)
    assert np.allclose(fixed, iso) and np.allclose(by_size, iso)
    # a burst of three: each waits for those before it, for a second each, or by its bytes
    fixed, by_size = bl.queue_floor(np.array([0.0, 0.0, 0.0, 10.0]), iso, [5, 5, 20, 10], capacity=1.0)
    assert np.allclose(fixed, iso + [0, 1, 2, 0])
    assert np.allclose(by_size, iso + [0, 0.5, 1.0, 0])  # holds of 0.5, 0.5, 2, 1 s (mean 1 s)


def test_each_level_carries_the_perfect_servers_p99():
    items = _items(40, seed=9)
    ring = bl.RingServer(FakeRing(2, auto_after=3), 2, clock=Clock())
    m = bl.measure_request_server(ring, items, [bl.scale_shift_expected(a) for a in items], warmup=5,
                                  loads=(0.8,), passes=1)
    level = m["levels"][0]
    fixed, by_size = level["perfect_fifo_p99_over_isolated"]
    assert fixed > 0 and by_size > 0
    # the level's p99 over each perfect server's: the ratio to the isolated p99, divided by theirs
    assert level["p99_over_perfect_fifo"] == pytest.approx([level["p99_over_isolated"] / fixed,
                                                            level["p99_over_isolated"] / by_size])


class _BlockingServer(bl.SyncServer):
    """A server whose ``submit`` waits until ``gate`` opens and notes the thread it ran on."""

    def __init__(self, gate, fail_on=None):
        import threading

        super().__init__(bl.scale_shift_expected)
        self.gate, self.fail_on = gate, fail_on
        self.threads: set = set()
        self.inside = self.most_inside = 0
        self._lock = threading.Lock()

    def submit(self, i, item):
        import threading

        with self._lock:
            self.threads.add(threading.current_thread().name)
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        try:
            assert self.gate.wait(10)
            if i == self.fail_on:
                raise ValueError(f"request {i} refused")
            super().submit(i, item)
        finally:
            with self._lock:
                self.inside -= 1


def test_handler_threads_submit_on_their_own_threads_and_drain_waits_for_every_request():
    import threading

    gate = threading.Event()
    srv = bl.HandlerThreads(_BlockingServer(gate), 3)
    try:
        items = _items(9, seed=7)
        srv.reset(9)
        for i, it in enumerate(items):
            srv.submit(i, it)  # returns at once: the handlers wait at the gate
        assert all(r is None for r in srv.results)
        inner = srv.server
        deadline = time.monotonic() + 10
        while inner.inside < 3:  # every handler holds a request at the gate
            assert time.monotonic() < deadline, "three handlers never held a request each"
            time.sleep(0.001)
        gate.set()
        srv.drain()
        assert all(np.array_equal(r, bl.scale_shift_expected(a)) for r, a in zip(srv.results, items))
        assert inner.threads == {f"request-handler-{k}" for k in range(3)} and inner.most_inside == 3
        assert np.all(srv.latencies() > 0)
    finally:
        srv.close()


def test_handler_threads_raise_a_handlers_error_from_drain():
    import threading

    gate = threading.Event()
    gate.set()
    srv = bl.HandlerThreads(_BlockingServer(gate, fail_on=2), 2)
    try:
        srv.reset(4)
        for i, it in enumerate(_items(4, seed=8)):
            srv.submit(i, it)
        with pytest.raises(ValueError, match="request 2 refused"):
            srv.drain()
    finally:
        srv.close()


def test_handler_threads_refuse_a_bad_count():
    with pytest.raises(ValueError, match="threads"):
        bl.HandlerThreads(bl.SyncServer(bl.scale_shift_expected), 0)
