"""How ordinary numpy memory reaches the copy engines: staged, registered, or already pinned."""

import gc

import numpy as np
import pytest

import ringflow as rf
from tests.helpers.hooks import engines
from tests.helpers.host_strategy import layouts_planned, slow_staged_chunks
from tests.helpers.one_side import SIDES, one_side_arrays, one_side_profile, slow_registration
from ringflow import _plan as plan


def f(x, y):
    y[:] = x * 2 + 1


@pytest.mark.parametrize("host", ["stage", "register", "auto"])
@pytest.mark.parametrize("seed", range(4))
def test_every_host_strategy_gives_the_same_result_under_chaos(host, seed):
    dev = rf.device("sim", seed=seed, chaos=True)
    x = np.random.default_rng(seed).uniform(0.5, 1.5, (999, 13)).astype(np.float32)
    y = rf.stream_map(f, x, device=dev, chunk_bytes=13 * 4 * 37, host=host, checked=True)
    assert np.array_equal(y, x * 2 + 1)
    z = x.copy()
    assert rf.stream_map(f, z, out=z, device=dev, chunk_bytes=4096, host=host) is z  # in place
    assert np.array_equal(z, x * 2 + 1)
    gc.collect()
    assert rf.drop_warm_pipelines(dev) == 1  # the unchecked call's pipeline was kept warm
    assert dev.live().total == 0


def test_register_refuses_strided_arrays_and_auto_stages_them():
    dev = rf.device("sim")
    x = np.arange(200, dtype=np.float64).reshape(20, 10)[:, ::2]
    with pytest.raises(ValueError, match="C-contiguous"):
        rf.stream_map(f, x, device=dev, chunk_bytes=80, host="register")
    assert np.array_equal(rf.stream_map(f, x, device=dev, chunk_bytes=80), x * 2 + 1)


def test_already_pinned_buffers_are_used_in_place_without_staging():
    dev = rf.device("sim", chaos=True, seed=5)
    n = 1 << 14
    hx, hy = dev.allocate_host(n * 4), dev.allocate_host(n * 4)
    x, y = hx.view(np.float32), hy.view(np.float32)
    x[:] = np.random.default_rng(0).uniform(0.5, 1.5, n)
    ops = []
    dev.add_op_observer(lambda op: ops.append(op.label))
    rf.stream_map(f, x, y, device=dev, chunk_bytes=4096, x_buffer=hx, out_buffer=hy)
    assert np.array_equal(hy.view(np.float32, access="r"), hx.view(np.float32, access="r") * 2 + 1)
    # 16 chunks: 16 copies each way (too few chunks to move in copy groups), straight between the
    # caller's pinned memory and the device
    assert sum(lbl.startswith("copy h2d") for lbl in ops) == 16
    assert sum(lbl.startswith("copy d2h") for lbl in ops) == 16
    with pytest.raises(ValueError, match="both x_buffer and out_buffer"):
        rf.stream_map(f, x, y, device=dev, x_buffer=hx)
    hx.close()
    hy.close()


def test_host_strategy_rule_uses_the_measured_costs():
    # one-shot 1 GiB with a fresh output on the H200 profile: staging (2 GiB of memcpy on
    # 16 threads) beats registering (register + first touch + unregister of 2 GiB)
    choice = plan.choose_host_strategy("h200-pcie5", 1 << 30, 1 << 30, workers=16, out_is_fresh=True)
    assert choice.choice == "stage" and choice.stage_s < choice.register_s
    # one worker copies 10 GB/s: registering 2 GiB of touched memory is cheaper then
    single = plan.choose_host_strategy("h200-pcie5", 1 << 30, 1 << 30, workers=1, out_is_fresh=False)
    assert single.choice == "register"


def test_chunk_choice_trades_transfer_efficiency_against_fill_and_drain():
    small = plan.choose_chunk_bytes("h200-pcie5", 256 << 20, host_stages=False)
    assert 4 << 20 <= small.chunk_bytes <= 64 << 20
    rows = {c: t for c, _, t in small.table}
    assert rows[64 << 10] > small.predicted_s  # tiny copies are slow (2.5 GB/s at 64 KiB)
    assert rows[256 << 20] > small.predicted_s  # one chunk: nothing overlaps
    budget = plan.choose_chunk_bytes("h200-pcie5", 1 << 30, workers=16, pinned_budget=64 << 20)
    t, _ = plan.predict_seconds("h200-pcie5", 1 << 30, budget.chunk_bytes, workers=16)
    slots = plan.plan_slots(t).slots
    assert (slots.host_in + slots.host_out) * budget.chunk_bytes <= 64 << 20
    with pytest.raises(ValueError, match="budget"):
        plan.choose_chunk_bytes("h200-pcie5", 1 << 30, workers=16, pinned_budget=1 << 10)


def test_prediction_counts_the_scheduler_as_a_resource():
    # 256 MiB in 64 KiB chunks: 4096 chunks of host time (the direct engine's enqueueing, as the
    # copy engines use the caller's memory) dominate; in 16 MiB chunks it hides behind the copies
    t_small, small = plan.predict_seconds("h200-pcie5", 256 << 20, 64 << 10, host_stages=False)
    assert t_small.bottleneck == "scheduler (host)"
    assert small >= 4096 * plan.DIRECT_S_PER_CHUNK
    t_big, big = plan.predict_seconds("h200-pcie5", 256 << 20, 16 << 20, host_stages=False)
    assert t_big.bottleneck in ("h2d", "d2h") and big < small


def test_stream_map_auto_chunk_size():
    dev = rf.device("sim")
    x = np.random.default_rng(1).uniform(0.5, 1.5, 1 << 20).astype(np.float32)
    assert np.array_equal(rf.stream_map(f, x, device=dev, chunk_bytes="auto"), x * 2 + 1)


def test_pinned_budget_caps_the_pinned_rings():
    dev = rf.device("sim", chaos=True, seed=2)
    chunk = 1 << 16
    with rf.Pipeline(f, device=dev, chunk_bytes=chunk, workers=16, pinned_budget=5 * chunk) as pipe:
        c = pipe.config.slots
        assert (c.host_in + c.host_out) * chunk <= 5 * chunk and min(c.host_in, c.host_out) >= 1
        items = [np.random.default_rng(i).uniform(0.5, 1.5, chunk // 4).astype(np.float32) for i in range(40)]
        assert all(np.array_equal(o, i * 2 + 1) for o, i in zip(pipe.map(items), items, strict=True))
        pinned = sum(len(r) * r.chunk_bytes for r in pipe.scheduler.rings if r.buffer.is_host)
        assert pinned <= 5 * chunk
    with pytest.raises(ValueError, match="pinned_budget"):
        rf.Pipeline(f, device=dev, chunk_bytes=chunk, slots=4, pinned_budget=5 * chunk)
    with pytest.raises(ValueError, match="pinned_budget"):
        rf.Pipeline(f, device=dev, chunk_bytes=chunk, pinned_budget=chunk)


def test_an_item_too_large_is_refused_before_acceptance_with_profiling_too():
    dev = rf.device("sim")
    for profile in (False, True):
        with rf.Pipeline(f, device=dev, chunk_bytes=64, profile=profile) as pipe:
            with pytest.raises(ValueError, match="chunk_bytes"):
                pipe.submit(np.zeros(100, np.float32) + 1)
            assert pipe.stats().accepted == 0


def test_a_short_stream_map_takes_no_more_slots_than_chunks():
    dev = rf.device("sim")
    x = np.random.default_rng(0).uniform(0.5, 1.5, 3 * 256).astype(np.float32)  # 3 chunks of 1 KiB
    seen = {}
    with engines(on=lambda p: seen.setdefault("p", p)):
        y = rf.stream_map(f, x, device=dev, chunk_bytes=1024, host="stage", workers=8)
    assert np.array_equal(y, x * 2 + 1)
    slots = seen["p"].config.slots
    assert max(slots.host_in, slots.device_in, slots.device_out, slots.host_out) <= 3
    rf.drop_warm_pipelines(dev)


def double(a, b):
    np.multiply(a, 2, out=b)


double.sim_seconds = 0.0  # a kernel of no time: the job turns on the host's costs alone


@pytest.mark.parametrize("pinned", ["x", "out"])
def test_a_job_staging_one_side_is_planned_and_simulated_with_one_sides_host_time(pinned):
    """stream_map of an ordinary array and a ringflow.host array: only the ordinary side is
    staged. With chunk_bytes="auto" the job is planned so (choose_chunk_bytes with the pair of
    staged sides: half the chunks a job staging both would take on this profile, whose
    scheduler spends much more per chunk staging both sides than one), and its simulated time is
    nearer the one-side prediction than the two-side one (within 15%: eight chunks, whose fill
    the model charges in full). In 4 MiB chunks, where the scheduler's host time bounds the job,
    the simulated GPU spends the one-side figure per chunk and the run takes what
    predict_seconds with the pair says, within 10%."""
    p = slow_registration(one_side_profile(1e-3, 4e-4))  # (staging the ordinary side beats registering it)
    sides = SIDES[pinned]
    total, workers = 128 << 20, 8
    dev = rf.device("sim", profile=p, checked=False)
    data = np.arange(total // 4, dtype=np.float32)
    x, out = one_side_arrays(dev, data, pinned)
    cost = dict(workers=workers, compute_s_per_chunk=0.0, compute_s_per_byte=0.0)
    one = plan.choose_chunk_bytes(p, total, host_stages=sides, align=4, **cost)
    both = plan.choose_chunk_bytes(p, total, host_stages=True, align=4, **cost)
    assert one.chunks < both.chunks  # (the two plans differ: the test can tell which was used)

    def run(chunk_bytes):
        """(report, one-side prediction, two-side prediction) of a call in chunks of ``chunk_bytes``."""
        with engines() as seen:
            y, report = rf.stream_map_report(double, x, out=out, device=dev, chunk_bytes=chunk_bytes, workers=workers,
                                             keep_warm=False)
        assert y is out and np.array_equal(y, data * 2)
        sched = seen[0].scheduler  # the pinned side's host ring is the caller's memory: only the other is staged
        assert (not sched.host_in.external, not sched.host_out.external) == sides
        chunk = total // report.chunks
        t, one_s = plan.predict_seconds(p, total, chunk, host_stages=sides, **cost)
        assert t.bottleneck == "scheduler (host)"
        return report, one_s, plan.predict_seconds(p, total, chunk, host_stages=True, **cost)[1]

    try:
        report, one_s, both_s = run("auto")
        assert report.chunks == one.chunks and one_s == one.predicted_s
        assert abs(report.measured_s - one_s) < abs(report.measured_s - both_s)
        assert report.measured_s == pytest.approx(one_s, rel=0.15)
        report, one_s, both_s = run(4 << 20)
        assert report.chunks == 32
        assert report.measured_s == pytest.approx(one_s, rel=0.10)
        assert abs(report.measured_s - one_s) < abs(report.measured_s - both_s)
    finally:
        dev.close()


def test_auto_stages_or_registers_as_predicted_at_the_calls_chunk(monkeypatch):
    """host="auto" on a host whose staged chunks cost the scheduler 627 µs each: 64 MiB of
    pageable memory in 1 MiB chunks is registered (staging 64 chunks would be bound by that
    host time), in 8 MiB chunks and with chunk_bytes="auto" staged; each call's choice is
    choose_host_strategy's at that chunk, and every result is right."""
    p = slow_staged_chunks()
    dev = rf.device("sim", profile=p)
    seen = layouts_planned(monkeypatch)

    x = np.arange(16 << 20, dtype=np.float32)
    try:
        for chunk, want in ((1 << 20, "register"), (8 << 20, "stage"), ("auto", "stage")):
            assert np.array_equal(rf.stream_map(double, x, device=dev, chunk_bytes=chunk, workers=4), x * 2)
            expected = plan.choose_host_strategy(p, x.nbytes, x.nbytes, workers=4, out_is_fresh=True, align=4,
                                                 chunk_bytes=None if chunk == "auto" else chunk,
                                                 compute_s_per_byte=0.0, compute_s_per_chunk=0.0)
            assert seen[-1].strategy == expected.choice == want, (chunk, expected)
    finally:
        rf.drop_warm_pipelines(dev)
        dev.close()


def test_a_mapjob_weighs_one_call_and_pinned_budget_bounds_what_auto_registers(monkeypatch):
    """On a host whose staged chunk costs the scheduler 627 µs, 64 MiB in 8 MiB chunks: stream_map
    stages (its one call would pay the pinning), a MapJob registers (it pins once for all its
    calls); a pinned_budget below the 128 MiB to pin makes either stage, one at it lets the job
    register; in 1 MiB chunks stream_map registers, but not past a budget. Every result is
    right."""
    p = slow_staged_chunks()
    dev = rf.device("sim", profile=p)
    seen = layouts_planned(monkeypatch)

    x = np.arange(16 << 20, dtype=np.float32)
    try:
        for chunk, budget, want in ((8 << 20, None, "stage"), (1 << 20, None, "register"),
                                    (1 << 20, (128 << 20) - 1, "stage")):
            assert np.array_equal(rf.stream_map(double, x, device=dev, chunk_bytes=chunk, workers=4, keep_warm=False,
                                                pinned_budget=budget), x * 2)
            assert seen[-1].strategy == want, (chunk, budget)
        for budget, want in ((None, "register"), (128 << 20, "register"), ((128 << 20) - 1, "stage")):
            with rf.MapJob(double, x, device=dev, chunk_bytes=8 << 20, workers=4, pinned_budget=budget) as job:
                assert job.strategy == want, budget
                assert np.array_equal(job(), x * 2) and np.array_equal(job(), x * 2)
        # in place (out=x): one array to pin, counted once against the budget
        y = x.copy()
        with rf.MapJob(double, y, y, device=dev, chunk_bytes=8 << 20, workers=4, pinned_budget=64 << 20) as job:
            assert job.strategy == "register" and np.array_equal(job(), x * 2)
        # one side from rf.host.empty: only the other is to pin, and counts against the budget
        out = rf.host.empty(x.shape, x.dtype, device=dev)
        with rf.MapJob(double, x, out, device=dev, chunk_bytes=8 << 20, workers=4, pinned_budget=64 << 20) as job:
            assert job.strategy == "register" and np.array_equal(job(), x * 2)
        del out
    finally:
        rf.drop_warm_pipelines(dev)
        dev.close()


def test_with_no_pinned_budget_auto_registers_at_most_a_quarter_of_the_hosts_memory(monkeypatch):
    """With no pinned_budget, host="auto" takes a quarter of the host's physical memory (4 GiB
    where it cannot be read) as the most it registers: the 128 MiB that a MapJob of 64 MiB, and a
    call in 1 MiB chunks, would pin are registered on a host of four times that and staged on
    one a page smaller. A pinned_budget given replaces the default, and host="register" pins what
    it is told. Every result is right."""
    from ringflow._device import host_pool
    from ringflow._pipeline.sizing import default_register_budget

    to_pin = 128 << 20
    dev = rf.device("sim", profile=slow_staged_chunks())
    seen = layouts_planned(monkeypatch)
    x = np.arange(16 << 20, dtype=np.float32)
    try:
        for ram, want in ((4 * to_pin, "register"), (4 * to_pin - 4096, "stage"), (None, "register")):
            monkeypatch.setattr(host_pool, "physical_memory", lambda: ram)
            assert default_register_budget() == (4 << 30 if ram is None else ram // 4)
            with rf.MapJob(double, x, device=dev, chunk_bytes=8 << 20, workers=4) as job:
                assert job.strategy == want, ram
                assert np.array_equal(job(), x * 2)
            assert np.array_equal(rf.stream_map(double, x, device=dev, chunk_bytes=1 << 20, workers=4,
                                                keep_warm=False), x * 2)
            assert seen[-1].strategy == want, ram
        monkeypatch.setattr(host_pool, "physical_memory", lambda: 4 * to_pin - 4096)
        with rf.MapJob(double, x, device=dev, chunk_bytes=8 << 20, workers=4, pinned_budget=to_pin) as job:
            assert job.strategy == "register" and np.array_equal(job(), x * 2)
        with rf.MapJob(double, x, device=dev, chunk_bytes=8 << 20, workers=4, host="register") as job:
            assert job.strategy == "register" and np.array_equal(job(), x * 2)
        assert dev.live().host_buffers == 0
    finally:
        rf.drop_warm_pipelines(dev)
        dev.close()


@pytest.mark.parametrize("refused", ["x", "out"])
def test_auto_stages_what_the_host_cannot_pin_and_register_says_which_array(monkeypatch, refused):
    """A registration the host refuses for want of pinnable memory (an out-of-memory from the
    driver): host="auto" stages instead, for a call and for a MapJob, with the right result and
    nothing left pinned; host="register" raises an OutOfMemoryError naming the array and what to
    pass."""
    dev = rf.device("sim", profile=slow_staged_chunks())
    real = dev.register_host
    tried = []

    def refuse_one(arr):
        tried.append(arr.nbytes)
        if len(tried) == (1 if refused == "x" else 2):
            raise rf.OutOfMemoryError("simulated: cuMemHostRegister failed: CUDA_ERROR_OUT_OF_MEMORY")
        return real(arr)

    monkeypatch.setattr(dev, "register_host", refuse_one)

    x = np.arange(1 << 20, dtype=np.float32)
    try:
        kw = dict(device=dev, chunk_bytes=64 << 10, workers=4, keep_warm=False)
        assert np.array_equal(rf.stream_map(double, x, **kw), x * 2)
        assert tried and dev.live().host_buffers == 0
        del tried[:]
        with rf.MapJob(double, x, device=dev, chunk_bytes=64 << 10, workers=4) as job:
            assert job.strategy == "stage" and tried
            assert np.array_equal(job(), x * 2)
        assert dev.live().host_buffers == 0
        del tried[:]
        with pytest.raises(rf.OutOfMemoryError, match=f"host='register' cannot pin {refused} .*host='stage'"):
            rf.stream_map(double, x, host="register", **kw)
        assert dev.live().host_buffers == 0
    finally:
        rf.drop_warm_pipelines(dev)
        dev.close()


@pytest.mark.parametrize("total,chunk", [(64 << 20, 1 << 20), (256 << 10, 256 << 10)],
                         ids=["64MiB-1MiB", "256KiB-one-chunk"])
def test_auto_picks_the_strategy_the_simulated_gpu_runs_faster(monkeypatch, total, chunk):
    """The simulated GPU charges a staged call the scheduler's host time per chunk, and a
    registered one its pinning and unpinning (their bytes at the profile's rates and the fixed
    cost per array): the staged call takes about what choose_host_strategy predicts (within 15%),
    the registered call the same run on pinned buffers plus the pinning the planner counts, and
    host="auto" takes the strategy that ran faster. The result is given (touched already), so no
    first touch is charged that the simulated clock does not see."""
    p = slow_staged_chunks(register_call_s=1e-3)
    dev = rf.device("sim", profile=p)
    seen = layouts_planned(monkeypatch)
    x = np.arange(total // 4, dtype=np.float32)
    out = np.zeros_like(x)
    kw = dict(device=dev, chunk_bytes=chunk, workers=4)
    hx, hout = dev.allocate_host(x.nbytes), dev.allocate_host(out.nbytes)
    px, pout = hx.view(np.float32), hout.view(np.float32)
    px[:] = x
    try:
        took = {}
        for host, args in (("stage", (x, out)), ("register", (x, out)), ("pinned", (px, pout))):
            more = dict(x_buffer=hx, out_buffer=hout) if host == "pinned" else dict(host=host)
            rf.stream_map(double, *args, **kw, **more)  # its engine made and kept warm
            t0 = dev.now
            assert rf.stream_map(double, *args, **kw, **more) is args[1] and np.array_equal(args[1], x * 2)
            took[host] = dev.now - t0
        predicted = plan.choose_host_strategy(p, total, total, workers=4, out_is_fresh=False, chunk_bytes=chunk,
                                              align=4, compute_s_per_byte=0.0, compute_s_per_chunk=0.0)
        pinning = 2 * total / (p.register_GBps * 1e9) + 2 * total / (p.unregister_GBps * 1e9) + 2 * 1e-3
        assert took["stage"] == pytest.approx(predicted.stage_s, rel=0.15), (took, predicted)
        assert took["register"] - took["pinned"] == pytest.approx(pinning, rel=0.02), (took, pinning)
        out[:] = 0
        assert rf.stream_map(double, x, out, **kw) is out and np.array_equal(out, x * 2)
        assert seen[-1].strategy == predicted.choice == min(("stage", "register"), key=took.get), (took, predicted)
    finally:
        del px, pout
        hx.close()
        hout.close()
        rf.drop_warm_pipelines(dev)
        dev.close()


def test_an_in_place_call_weighs_one_registration(monkeypatch):
    """out=x pins one array: on a host whose registration costs 0.4 ms a call beyond its bytes, a
    one-chunk call of 256 KiB in place registers (one registration beats one staged chunk's
    host time), where the same call into a separate result stages (two would not)."""
    dev = rf.device("sim", profile=slow_staged_chunks(register_call_s=0.4e-3))
    seen = layouts_planned(monkeypatch)
    x = np.arange(64 << 10, dtype=np.float32)
    try:
        out = np.zeros_like(x)
        assert rf.stream_map(double, x, out, device=dev, workers=4) is out and np.array_equal(out, x * 2)
        assert seen[-1].strategy == "stage"
        y = x.copy()
        assert rf.stream_map(double, y, y, device=dev, workers=4) is y and np.array_equal(y, x * 2)
        assert seen[-1].strategy == "register"
    finally:
        rf.drop_warm_pipelines(dev)
        dev.close()
