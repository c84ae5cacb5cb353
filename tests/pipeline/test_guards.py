"""Test the tests: switch off each event wait and slot-release guard in turn (through the
``ringflow._testing.inject(guards_off=...)`` seam, not by editing source) and show the suite's checks
catch its absence: a HazardError from the sim's checker, a StageError caused by one, or a
wrong result. Parametrized over ``GUARDS``, so a guard added without coverage fails here.

Also: with the sim's own checker off (``rf.device("sim", checked=False)``), the pipeline's
checked mode (poison every released slot) turns each premature release into a wrong result.
That is what the run on the real GPU relies on, where no checker watches."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import ringflow as rf
from ringflow import _testing
from ringflow._pipeline import GUARDS
from tests.helpers.sim import hold_copy
from tests.helpers.pipeline_checks import (
    Harness,
    caught,
    guard_outcome,
    random_sizes,
    run_map,
)

# (runner, slots, seed): the harness's own map runs (int64 payloads tagged per item, every
# result checked), stream_map staging a pageable array, and a pipeline of plain arrays whose
# results land in pinned pool arrays (half the items pool arrays read in place), and one whose
# results stay on the device, read there by a slow consumer kernel before each release, and
# requests sharing a chunk whose first item's copy into it is held while the scheduler steps
RUNNERS = ("harness", "stream_map", "pooled", "device", "shared")
CONFIGS = [(runner, slots, seed) for seed in range(3) for slots in (1, 2, 3) for runner in RUNNERS]
X = np.random.default_rng(0).standard_normal(256 * 1024).astype(np.float32)
RELEASE_GUARDS = [g for g in GUARDS if ".release_after_" in g]
# the guards that order the poison fills themselves can only be seen by the checker
POISON_VISIBLE = [g for g in GUARDS if not g.endswith(".wait_slot_ready")]


def f(x, y):
    y[...] = x * 3 + 1


f.sim_seconds = 20e-6


def run_config(runner: str, slots: int, seed: int, guards=(), checker: bool = True):
    dev = rf.device("sim", seed=seed, chaos=True, checked=checker)

    def harness():
        h = Harness(device=dev, slots=slots, chunk_bytes=512, compute_seconds=20e-6, disabled_guards=guards)
        run_map(h, random_sizes(np.random.default_rng(seed), 60, 64))
        return True

    def stream():
        with _testing.inject(guards_off=guards):
            y = rf.stream_map(f, X, device=dev, chunk_bytes=1 << 15, slots=slots, checked=True, host="stage")
        return np.array_equal(y, X * 3 + 1)

    def pooled():
        rng = np.random.default_rng(seed)
        items = []
        for i in range(40):
            n = int(rng.integers(1, 1024))
            a = rf.host.empty(n, np.float32, device=dev) if i % 2 else np.empty(n, np.float32)
            a[:] = rng.standard_normal(n)
            items.append(a)
        with _testing.inject(guards_off=guards):
            with rf.Pipeline(f, device=dev, chunk_bytes=1 << 12, slots=slots, checked=True) as pipe:
                results = list(pipe.map(items))
        pooled = sum(rf.host.buffer(r) is not None for r in results)  # at least the staged items'
        return (pooled >= len(items) // 2 and len(results) == len(items)
                and all(np.array_equal(r, a * 3 + 1) for r, a in zip(results, items)))

    def on_device():
        rng = np.random.default_rng(seed)
        items = [rng.standard_normal(int(rng.integers(1, 256))).astype(np.float32) for _ in range(24)]
        user = dev.create_stream()
        got = []

        def read(a, out):
            out[...] = a

        read.sim_seconds = 60e-6  # longer than a compute: a premature reuse lands inside it
        with _testing.inject(guards_off=guards):
            with rf.Pipeline(f, device=dev, chunk_bytes=1024, deliver="device", checked=True,
                             slots=rf.SlotCounts(host_in=2, device_in=2, device_out=slots, host_out=1)) as pipe:
                for res in pipe.map(items):
                    out = np.empty(res.shape, res.dtype)
                    user.launch(read, res.array, out, reads=[res.array])
                    res.release(stream=user)
                    got.append(out)
                user.sync()
        user.close()
        return len(got) == len(items) and all(np.array_equal(o, a * 3 + 1) for o, a in zip(got, items))

    def shared():
        a, b = X[:1000] + 0, X[1000:1700] + 0
        started, release = hold_copy(dev, a)
        out = {}
        with _testing.inject(guards_off=guards):
            with rf.Pipeline(f, device=dev, chunk_bytes=1 << 14, slots=slots, checked=True) as pipe:
                pipe.submit(np.zeros(4, np.float32)).result()  # warm: the next chunk is a new one
                def submit_a():
                    try:
                        out["a"] = pipe.submit(a)
                    except BaseException as exc:  # noqa: BLE001 - the checker's verdict, raised below
                        out["error"] = exc

                t = threading.Thread(target=submit_a)
                t.start()
                try:
                    assert started.wait(30)
                    fb = pipe.submit(b)  # joins the chunk a's copy is held in
                    sched, driver = pipe.scheduler, pipe._driver
                    steps = sched.steps
                    with driver.cv:  # the scheduler steps meanwhile: the chunk must wait for a's copy
                        driver.drive_here(lambda: sched.steps >= steps + 20 or not sched.inbox, None, "steps")
                        if not sched.inbox:  # admitted: let the device read it before the copy ends
                            driver.drive_here(lambda: not sched.pending_fences(), None, "the device")
                finally:
                    release.set()
                    t.join(30)
                if "error" in out:
                    raise out["error"]
                return bool(np.array_equal(out["a"].result(), a * 3 + 1) and np.array_equal(fb.result(), b * 3 + 1))

    return guard_outcome({"harness": harness, "stream_map": stream, "pooled": pooled, "device": on_device,
                          "shared": shared}[runner])


def describe(outcome) -> str:
    if outcome is True:
        return "all results right"
    if outcome is False:
        return "wrong data"
    return f"{type(outcome).__name__}: {str(outcome)[:120]}"


def test_guards_are_listed():
    assert len(GUARDS) == len(set(GUARDS)) >= 9
    assert RELEASE_GUARDS, "no release guards found by name"
    with pytest.raises(ValueError, match="unknown guards"):
        with _testing.inject(guards_off=["no.such_guard"]):
            rf.Pipeline(f, device=rf.device("sim"), chunk_bytes=512, slots=1)


@pytest.mark.parametrize("runner,slots,seed", CONFIGS[:3 * len(RUNNERS)])
def test_configs_pass_with_every_guard_on(runner, slots, seed):
    # no false alarms: the configurations below catch a missing guard, not a healthy pipeline
    assert run_config(runner, slots, seed) is True


@pytest.mark.parametrize("guard", GUARDS)
def test_each_guard_is_needed(guard):
    tried = []
    for config in CONFIGS:
        outcome = run_config(*config, guards=[guard])
        if caught(outcome):
            return
        tried.append(f"{config}: {describe(outcome)}")
    pytest.fail(f"switching off {guard!r} went unnoticed in every configuration:\n" + "\n".join(tried))


@pytest.mark.parametrize("guard", POISON_VISIBLE)
def test_poison_mode_catches_premature_reuse_without_the_checker(guard):
    tried = []
    for config in CONFIGS:
        outcome = run_config(*config, guards=[guard], checker=False)
        assert not isinstance(outcome, rf.HazardError), "the checker was meant to be off"
        if outcome is False:
            return
        tried.append(f"{config}: {describe(outcome)}")
    pytest.fail(f"with the checker off, switching off {guard!r} never gave a wrong result:\n" + "\n".join(tried))


def test_release_guards_are_poison_visible():
    assert set(RELEASE_GUARDS) <= set(POISON_VISIBLE)
