"""The ``feed`` bench workload: its arithmetic, its CPU work, and end to end on the simulated GPU
(the torch rows skipped there, with the reason); one test on a real GPU."""

from __future__ import annotations

import json
import os
import types

import numpy as np
import pytest

import ringflow as rf
from ringflow._bench import feed as fd
from ringflow._bench.workloads import BY_NAME_ONLY, WORKLOADS, _baseline, run_workload
from ringflow._cli import build_parser, main


@pytest.fixture
def sim():
    dev = rf.device("sim")
    yield dev
    dev.close()


# -- the arithmetic ----------------------------------------------------------------------------------
def test_the_bound_is_the_slowest_stage():
    b = fd.stage_bound({"cpu": 0.004, "h2d": 0.001, "gpu": 0.002})
    assert b["bound_stage"] == "cpu" and b["bound_ms"] == pytest.approx(4.0)
    assert b["bound_batches_per_s"] == pytest.approx(250.0)
    assert b["stage_ms"] == pytest.approx({"cpu": 4.0, "h2d": 1.0, "gpu": 2.0})
    assert fd.fraction_of_bound({"batches_per_s": 200.0}, b) == pytest.approx(0.8)
    assert fd.fraction_of_bound({"skipped": "no GPU"}, b) is None
    for bad in ({}, {"cpu": 0.0}, {"cpu": 0.001, "gpu": -1.0}):
        with pytest.raises(ValueError, match="positive time"):
            fd.stage_bound(bad)


def test_gpu_idle_is_the_gaps_between_steps_over_their_span():
    # steps of 1 s, 0.5 s, 1 s with gaps of 0.5 s and 0 s over 3 s
    assert fd.gpu_idle([(0.0, 1.0), (1.5, 2.0), (2.0, 3.0)]) == pytest.approx(0.5 / 3)
    assert fd.gpu_idle([(0.0, 1.0), (1.0, 2.0)]) == 0.0
    assert fd.gpu_idle([(0.0, 1.0), (3.0, 4.0)]) == pytest.approx(0.5)
    assert fd.gpu_idle([(0.0, 1.0)]) is None and fd.gpu_idle([]) is None


def test_same_bits_tells_negative_zero_and_shapes_apart():
    a = np.array([0.0, 1.5], np.float16)
    assert fd.same_bits(a, a.copy())
    assert not fd.same_bits(a, np.array([-0.0, 1.5], np.float16))
    assert not fd.same_bits(a, a.reshape(2, 1))


# -- the CPU work ------------------------------------------------------------------------------------
def test_the_cpu_work_is_deterministic_per_index():
    a, b = fd.ImageBatches(4, 16), fd.ImageBatches(4, 16)
    x = a.decode_augment(5)
    assert x.dtype == np.uint8 and x.shape == (4, 3, 16, 16) and x.flags.c_contiguous
    assert np.array_equal(x, b.decode_augment(5)) and np.array_equal(x, a.decode_augment(5))
    assert not np.array_equal(x, a.decode_augment(6))
    assert not np.array_equal(x, a.decode_augment(5 + len(a.sources)))  # same source, other augmentation
    assert not np.array_equal(x, fd.ImageBatches(4, 16, seed=1).decode_augment(5))


def test_each_image_is_a_crop_of_its_source_through_a_lookup_table():
    images = fd.ImageBatches(3, 8)
    x = images.decode_augment(2)
    src = images.sources[2 % len(images.sources)]
    for j in range(images.batch):
        matches = [(top, left, flip) for top in range(images.pad + 1) for left in range(images.pad + 1)
                   for flip in (False, True)
                   if _through_a_table(src[j, :, top:top + 8, left:left + 8][:, :, ::-1 if flip else 1], x[j])]
        assert matches, j


def _through_a_table(crop: np.ndarray, out: np.ndarray) -> bool:
    """Whether ``out`` is ``table[crop]`` for some table (equal inputs give equal outputs)."""
    table = np.full(256, -1)
    for v, y in zip(crop.ravel(), out.ravel()):
        if table[v] not in (-1, y):
            return False
        table[v] = y
    return True


def test_expected_is_the_exact_normalisation():
    images = fd.ImageBatches(2, 8)
    x = images.decode_augment(1).astype(np.float64)
    y = images.expected(1)
    assert y.dtype == np.float16 and y.shape == images.shape
    # MEAN and INV_STD are exact in float16, so every value is exact
    assert np.array_equal(y.astype(np.float64), (x - 114.5) / 64)


# -- end to end on the simulated GPU ------------------------------------------------------------------
def test_feed_runs_on_the_simulated_gpu(sim):
    res = fd.feed(sim, batch=2, size=16, batches=10, workers=2, rounds=2)
    rows = {r["name"]: r for r in res["rows"]}
    ours = res["rows"][0]
    assert ours["name"] == fd.RINGFLOW and ours["deliver"] == "device"
    assert ours["correct"] is True and ours["checked_batches"] == 10 and ours["runs"] == 2
    assert ours["batches_per_s"] == pytest.approx(1e3 / ours["ms_median"])
    # the bound: the slowest stage measured alone, and ringflow within it
    assert set(res["stage_ms"]) == set(fd.STAGES) and all(v > 0 for v in res["stage_ms"].values())
    assert res["bound_ms"] == max(res["stage_ms"].values())
    assert res["stage_ms"][res["bound_stage"]] == res["bound_ms"]
    assert res["bound_batches_per_s"] == pytest.approx(1e3 / res["bound_ms"])
    assert 0 < res["ringflow_fraction_of_bound"] <= 1
    assert res["ringflow_fraction_of_bound"] == pytest.approx(ours["batches_per_s"] / res["bound_batches_per_s"])
    assert 0 <= res["ringflow_gpu_idle_fraction"] <= 1
    assert [rows[f"stage alone: {s}"]["bound"] for s in fd.STAGES].count(True) == 1
    # no GPU framework here: the DataLoader is skipped with the reason, and so are the ratios
    assert "CUDA GPU" in rows[fd.DATALOADER]["skipped"]
    assert res["dataloader_batches_per_s"] is None and res["ringflow_vs_dataloader"] is None
    assert sim.live().total == 0


def test_a_wrong_batch_fails_the_check(sim):
    images = fd.ImageBatches(2, 8)
    side = fd.SimSide(sim, images, hidden=16)
    try:
        row = fd.ringflow_feed(sim, images, side, workers=2, batches=4, rounds=1, check=4,
                               prepare=lambda i: images.decode_augment(i + 1))
    finally:
        side.close()
    assert row["correct"] is False and row["checked_batches"] == 4


def test_torch_rows_are_skipped_with_the_reason_without_pytorch(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "torch", None)  # import torch fails
    images = fd.ImageBatches(2, 8)
    row = _baseline(fd.DATALOADER, lambda: fd.dataloader_feed(images, None, workers=1, batches=2, rounds=1, check=1))
    assert row["name"] == fd.DATALOADER and "PyTorch is not installed" in row["skipped"]
    # on a GPU without PyTorch the model step cannot run: both systems are skipped, saying why
    gpu = types.SimpleNamespace(backend="cuda")
    res = fd.feed(gpu, batch=2, size=8, batches=2, workers=1, rounds=1)
    assert [r["name"] for r in res["rows"]] == [fd.RINGFLOW, fd.DATALOADER]
    assert all("PyTorch is not installed" in r["skipped"] for r in res["rows"])
    assert res["ringflow_batches_per_s"] is None and res["ringflow_vs_dataloader"] is None


# -- the command line --------------------------------------------------------------------------------
def test_feed_runs_only_when_named(tmp_path, capsys):
    assert "feed" not in WORKLOADS and "feed" in BY_NAME_ONLY
    bench = next(a for a in build_parser()._subparsers._group_actions if a.choices).choices["bench"]
    assert "feed" in bench.format_help() and "only when named" in bench.format_help()
    assert main(["bench", "feed", "--device", "sim", "--quick", "--out", str(tmp_path)]) == 0
    (path,) = [p for p in os.listdir(tmp_path) if p.startswith("bench-sim")]
    w = json.load(open(tmp_path / path))["workloads"]
    assert set(w) == {"feed"} and "error" not in w["feed"]
    assert w["feed"]["rows"][0]["correct"] is True and w["feed"]["rows"][0]["checked_batches"] == 24
    assert "ringflow_fraction_of_bound" in capsys.readouterr().out


def test_run_workload_feed_on_the_sim_is_quick(sim):
    import time

    t0 = time.perf_counter()
    res = run_workload(sim, "feed")
    assert time.perf_counter() - t0 < 10
    assert res["batch"] == 4 and res["image"] == [3, 16, 16] and res["rows"][0]["correct"] is True


# -- on a real GPU -----------------------------------------------------------------------------------
@pytest.mark.gpu
def test_feed_on_a_gpu():
    pytest.importorskip("torch")
    dev = rf.device("cuda")
    try:
        res = fd.feed(dev, batch=8, size=64, batches=12, workers=2, rounds=1, check=6)
    finally:
        dev.close()
    ours, theirs = res["rows"][:2]
    assert ours["correct"] is True and theirs.get("correct") is True, (ours, theirs)
    assert res["ringflow_vs_dataloader"] > 0 and 0 <= res["ringflow_gpu_idle_fraction"] <= 1
    assert 0 <= res["dataloader_gpu_idle_fraction"] <= 1


def test_the_cpu_stage_on_worker_processes_is_measured():
    images = fd.ImageBatches(2, 8)
    seconds = fd.cpu_stage_seconds_processes(images, 2, 4)
    assert 0 < seconds < 5
