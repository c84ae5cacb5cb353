"""The baselines of ``ringflow bench``: importable and cleanly unavailable without a GPU; the
CUDA C++ source ships and compiles where nvcc exists; on a GPU every baseline is correct."""

from __future__ import annotations

import json
import re
import stat
import sys
from pathlib import Path

import numpy as np
import pytest

from ringflow._bench import baselines as bl
from ringflow._bench import native
from ringflow._device import native_copy

ROOT = Path(__file__).resolve().parents[2]


def _gpu() -> bool:
    from ringflow._device import cuda_available

    return cuda_available()[0]


no_gpu_only = pytest.mark.skipif(_gpu(), reason="checks the behaviour where no GPU is usable")


# -- CPU: imports, source, kernels ----------------------------------------------------------------
def test_imports_and_public_api():
    for name in bl.__all__:
        assert hasattr(bl, name), name
    assert issubclass(bl.BaselineUnavailable, RuntimeError)


def test_cu_source_is_package_data_with_both_kernels():
    text = native.source_text()
    assert "cudaMallocHost" in text and "cudaStreamNonBlocking" in text and "cudaEventElapsedTime" in text
    ks = native.kernel_source()
    assert "affine_iter" in ks and "scale_shift" in ks and "#include" not in ks
    # declared as package data, so a wheel carries it
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'\[tool\.setuptools\.package-data\][^\[]*"ringflow\._bench\.native"\s*=\s*\[[^\]]*\*\.cu',
                     pyproject)


def _norm(src: str) -> str:
    return re.sub(r"\s+", " ", src).strip()


def test_kernels_match_ringflows_own():
    """ringflow and every baseline must run the same kernel code, or the comparison is unfair."""
    kernels = pytest.importorskip("ringflow._bench.kernels")
    ks = _norm(native.kernel_source())
    for attr in ("AFFINE_ITER_SRC", "SCALE_SHIFT_SRC"):
        src = getattr(kernels, attr, None)
        if src is None:
            pytest.skip(f"ringflow._bench.kernels has no {attr}")
        assert _norm(src) in ks, f"{attr} differs from native/overlap_pipeline.cu's kernel block"


def test_resolve_kernel_names():
    seed = bl.resolve_kernel("seed")
    assert seed == bl.BaselineKernel("affine_iter", 64) and seed.inplace and seed.name == "affine_iter_64"
    assert bl.resolve_kernel("affine_iter", iters=7).iters == 7
    assert bl.resolve_kernel("affine_iter_12").iters == 12
    for name in ("scale_shift", "x*2+1", "x * 2 + 1"):
        k = bl.resolve_kernel(name)
        assert k.kind == "scale_shift" and not k.inplace and k.native_name == "scale_shift"

    def affine_iter_9(x, y):  # shaped like ringflow._bench.kernels.affine(9)
        pass

    affine_iter_9.iters = 9
    assert bl.resolve_kernel(affine_iter_9).iters == 9
    with pytest.raises(ValueError):
        bl.resolve_kernel("nonsense")
    with pytest.raises(ValueError):
        bl.BaselineKernel("affine_iter", -1)


@pytest.mark.parametrize("iters", [1, 64, 300])
def test_affine_reference_matches_float32_iteration(iters):
    x = bl.random_input(50_000, seed=iters)
    assert np.count_nonzero(x) == x.size and x.min() >= -1 and x.max() < 1
    v = x.copy()
    for _ in range(iters):  # what the GPU does (one rounding per step, as with an FMA)
        v = (v.astype(np.float64) * float(np.float32(0.999)) + float(np.float32(0.001))).astype(np.float32)
    k = bl.resolve_kernel("seed", iters)
    assert k.check(x, v)["correct"]


def test_check_catches_poison_and_wrong_values():
    x = bl.random_input(10_000, seed=1)
    for k in (bl.resolve_kernel("seed"), bl.resolve_kernel("scale_shift")):
        y = k.reference(x).astype(np.float32)
        assert k.check(x, y) == {"correct": True, "mismatches": 0, "max_abs_err": k.check(x, y)["max_abs_err"]}
        bad = y.copy()
        bad[1234] = np.nan
        r = k.check(x, bad, block=999)
        assert not r["correct"] and r["mismatches"] == 1 and r["max_abs_err"] is None
        bad = y.copy()
        bad[-1] += 1e-3
        assert k.check(x, bad)["mismatches"] == 1
        assert not k.check(x, y[:-1])["correct"]
    ss = bl.resolve_kernel("scale_shift")
    assert ss.check(x, x * np.float32(2) + np.float32(1))["max_abs_err"] == 0.0
    # in [0.5, 1.5) the float32 sum x*2+1 rounds (it needs one bit more than float32 holds): the
    # reference is numpy's float32 result, bit for bit, not the exact value (the torch baselines
    # were marked wrong on the pageable workload for that 1-ulp rounding)
    x2 = np.random.default_rng(5).uniform(0.5, 1.5, 10_000).astype(np.float32)
    y32 = x2 * np.float32(2) + np.float32(1)
    assert not np.array_equal(y32.astype(np.float64), x2.astype(np.float64) * 2 + 1)
    assert ss.check(x2, y32)["correct"]
    assert ss.check(x2, np.nextafter(y32, np.float32(np.inf)))["mismatches"] == x2.size


def test_chunk_bounds_and_page_splits():
    assert bl._bounds(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert bl._bounds(2, 4) == [(0, 1), (1, 2)]  # no empty chunks
    parts = bl._split(10 * bl.PAGE + 5, 4)
    assert parts[0][0] == 0 and parts[-1][1] == 10 * bl.PAGE + 5
    assert all(lo % bl.PAGE == 0 for lo, _ in parts)
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
    a = bl._aligned_empty(3 * bl.PAGE)
    assert a.ctypes.data % bl.PAGE == 0 and a.nbytes == 3 * bl.PAGE


def test_argument_errors_come_before_any_gpu_use():
    x = bl.random_input(16, seed=0)
    with pytest.raises(TypeError):
        bl.serial_copy_compute_copy(x.astype(np.float64))
    with pytest.raises(ValueError):
        bl.serial_copy_compute_copy(x, host="mapped")
    with pytest.raises(ValueError):
        bl.torch_streams_pipeline(x, chunks=0)
    with pytest.raises(ValueError):
        bl.cuda_cpp_pipeline(0)


# -- CPU: unavailable without a GPU ---------------------------------------------------------------
@no_gpu_only
def test_baselines_unavailable_without_gpu():
    x = bl.random_input(1024, seed=0)
    calls = [
        lambda: bl.serial_copy_compute_copy(x),
        lambda: bl.torch_naive(x, "scale_shift"),
        lambda: bl.torch_streams_pipeline(x, "scale_shift"),
        lambda: bl.cuda_cpp_pipeline(1024),
        lambda: bl.link_floor(1 << 20, 1 << 20),
        lambda: bl.host_floor(1 << 20),
    ]
    for call in calls:
        with pytest.raises(bl.BaselineUnavailable) as info:
            call()
        assert str(info.value)  # says what is missing
    skipped = bl.run_or_skip(bl.torch_naive, x)
    assert skipped["name"] == "torch_naive" and skipped["skipped"]
    assert bl.gpu_available()[0] is False
    av = bl.availability()
    assert set(av) == {"torch", "cupy", "nvcc", "gpu"} and av["gpu"] != "ok"


def test_cuda_cpp_pipeline_unavailable_without_nvcc(monkeypatch):
    monkeypatch.setattr(native, "find_nvcc", lambda: None)
    with pytest.raises(bl.BaselineUnavailable, match="nvcc"):
        bl.cuda_cpp_pipeline(1024)
    with pytest.raises(bl.BaselineUnavailable, match="nvcc"):
        native.build()


# -- CPU: the native wrapper ----------------------------------------------------------------------
needs_nvcc = pytest.mark.skipif(native.find_nvcc() is None, reason="nvcc not installed here")


@needs_nvcc
def test_cu_source_compiles():
    b = native.build()
    assert Path(b["exe"]).exists() and "-arch=sm_90" in b["command"] and "-O3" in b["command"]
    assert native.build()["cached"] is True


@needs_nvcc
@no_gpu_only
def test_built_program_reports_no_gpu():
    b = native.build()
    with pytest.raises(bl.BaselineUnavailable):
        native.run(b["exe"], n_floats=1024, chunks=[2], streams=[2], repeats=1, warmup=0)


def _fake_exe(tmp_path, stdout: str, code: int) -> str:
    p = tmp_path / "fake_overlap"
    p.write_text(f"#!{sys.executable}\nimport sys\nsys.stdout.write({stdout!r})\nsys.exit({code})\n")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return str(p)


FAKE = {
    "program": "overlap_pipeline", "device": "Fake GPU", "kernel": "affine_iter", "iters": 64,
    "stages": {"h2d": {"ms_median": 1.0}},
    "serial": {"ms_median": 10.0, "ms_p10": 9.9, "ms_p90": 10.1, "runs": 3, "correct": True},
    "pipelined": [
        {"chunks": 8, "streams": 4, "ms_median": 6.0, "ms_p10": 5.9, "ms_p90": 6.1, "ms_min": 5.8, "ms_max": 6.2,
         "runs": 3, "correct": True, "host_clock": {"ms_median": 6.02, "ms_p10": 6.0, "ms_p90": 6.1, "runs": 3}},
        {"chunks": 32, "streams": 4, "ms_median": 5.7, "ms_p10": 5.6, "ms_p90": 5.8, "ms_min": 5.5, "ms_max": 5.9,
         "runs": 3, "correct": True, "host_clock": {"ms_median": 6.05, "ms_p10": 6.0, "ms_p90": 6.1, "runs": 3},
         "refilled": {"ms_median": 5.9, "runs": 3, "host_clock": {"ms_median": 6.1, "runs": 3}}},
        {"chunks": 8, "streams": 1, "ms_median": 5.0, "ms_p10": 5.0, "ms_p90": 5.0, "ms_min": 5.0, "ms_max": 5.0,
         "runs": 3, "correct": True},
    ],
    "correct": True,
}


def test_native_run_parses_results_and_errors(tmp_path):
    r = native.run(_fake_exe(tmp_path, json.dumps(FAKE), 0), n_floats=1024, chunks=8, streams=4)
    assert r["device"] == "Fake GPU" and r["returncode"] == 0 and "--chunks 8 --streams 4" in r["command"]
    with pytest.raises(bl.BaselineUnavailable):
        native.run(_fake_exe(tmp_path, '{"error": "no CUDA device", "unavailable": true}', 3), n_floats=8)
    with pytest.raises(RuntimeError, match="out of memory"):
        native.run(_fake_exe(tmp_path, '{"error": "cudaMalloc: out of memory"}', 2), n_floats=8)
    with pytest.raises(RuntimeError, match="no JSON"):
        native.run(_fake_exe(tmp_path, "Segmentation fault", 139), n_floats=8)
    with pytest.raises(ValueError):
        native.run("x", n_floats=8, chunks=[0])


def test_cuda_cpp_pipeline_picks_best_multistream(monkeypatch, tmp_path):
    exe = _fake_exe(tmp_path, json.dumps(FAKE), 0)
    monkeypatch.setattr(native, "find_nvcc", lambda: "/fake/nvcc")
    monkeypatch.setattr(native, "build", lambda arch="sm_90": {"exe": exe, "arch": arch, "nvcc_version": "13.0.88",
                                                               "command": "nvcc ...", "build_s": 1.0})
    monkeypatch.setattr(bl, "gpu_available", lambda: (True, "fake"))
    r = bl.cuda_cpp_pipeline(1 << 26, chunks=[8, 32], streams=[4, 1])
    assert r["ms_median"] == 5.7 and r["chunks"] == 32 and r["streams"] == 4  # 1-stream rows are reference only
    assert r["serial_ms"] == 10.0 and r["correct"] is True and len(r["pipelined"]) == 3
    assert r["bytes_in"] == 4 << 26 and r["timing"] == "cuda_events"
    # on the host clock another configuration can be the best (its enqueue and wake-up counted)
    assert r["host_clock"]["ms_median"] == 6.02 and r["host_clock"]["chunks"] == 8
    assert r["refilled"] == {"chunks": 32, "ms_median": 5.9, "host_clock": {"chunks": 32, "ms_median": 6.1, "runs": 3}}
    json.dumps(r)


# -- GPU ------------------------------------------------------------------------------------------
SMALL = 1 << 20  # floats: 4 MiB


def _ok(r):
    assert "skipped" not in r, r
    assert r["correct"] is True, r
    assert r["runs"] >= 1 and 0 < r["ms_p10"] <= r["ms_median"] <= r["ms_p90"]
    json.dumps(r)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,host", [("seed", "pinned"), ("scale_shift", "pageable")])
def test_serial_gpu(kernel, host):
    r = bl.serial_copy_compute_copy(bl.random_input(SMALL, seed=5), kernel, host=host, warmup=1, repeats=3)
    _ok(r)
    assert r["timing"] == ("cuda_events" if host == "pinned" else "host_clock")


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["seed", "scale_shift"])
def test_torch_naive_gpu(kernel):
    x = bl.random_input(SMALL, seed=6)
    x0 = x.copy()
    _ok(bl.torch_naive(x, kernel, warmup=1, repeats=2))
    np.testing.assert_array_equal(x, x0)  # the input is not written


@pytest.mark.gpu
def test_torch_naive_gpu_with_torch_callable():
    x = bl.random_input(SMALL, seed=7)
    r = bl.torch_naive(x, lambda t: t * 2 + 1, reference=lambda a: a.astype(np.float64) * 2 + 1, repeats=2)
    _ok(r)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,host", [("seed", "pinned"), ("scale_shift", "pageable"), ("seed", "pageable")])
def test_torch_streams_pipeline_gpu(kernel, host):
    x = bl.random_input(SMALL + 3, seed=8)  # chunks of unequal length
    r = bl.torch_streams_pipeline(x, kernel, chunks=(4, 7), streams=3, host=host, warmup=1, repeats=2)
    _ok(r)
    assert r["chunks"] in (4, 7) and r["streams"] == 3 and len(r["by_chunks"]) == 2


@pytest.mark.gpu
@needs_nvcc
@pytest.mark.parametrize("kernel", ["seed", "scale_shift"])
def test_cuda_cpp_pipeline_gpu(kernel):
    r = bl.cuda_cpp_pipeline(SMALL + 5, chunks=(4, 8), streams=(2, 1), kernel=kernel, repeats=2, warmup=1,
                             refill=True)
    _ok(r)
    assert r["refilled"]["ms_median"] > 0 and r["refilled"]["host_clock"]["ms_median"] >= r["refilled"]["ms_median"] * 0.99
    assert {(p["chunks"], p["streams"]) for p in r["pipelined"]} == {(4, 2), (8, 2), (4, 1), (8, 1)}
    assert r["streams"] == 2 and r["serial"]["correct"] and r["stages"]["h2d"]["ms_median"] > 0
    for p in r["pipelined"]:  # the host clock spans the GPU span and the enqueue around it
        assert p["host_clock"]["runs"] == 2 and p["host_clock"]["ms_min"] >= p["ms_min"] * 0.99
    assert r["host_clock"]["ms_median"] >= r["ms_median"] * 0.99


@pytest.mark.gpu
def test_link_floor_gpu():
    r = bl.link_floor(8 << 20, 4 << 20, repeats=3)
    assert r["link_correct"] is True
    assert r["link_h2d_GBps"] > 0 and r["link_d2h_GBps"] > 0 and r["link_duplex_GBps"] > 0
    assert 0 < r["link_floor_ms"] <= r["link_h2d_min_ms"] + r["link_d2h_min_ms"] + 1e-9
    assert r["link_floor_ms"] <= r["link_duplex_min_ms"] <= r["link_duplex_ms"]
    assert set(r["link_by_streams"]) == {"1", "2", "4"} and r["link_floor_streams"] in (1, 2, 4)
    assert r["link_floor_ms"] == min(v["link_floor_ms"] for v in r["link_by_streams"].values())
    json.dumps(r)


@pytest.mark.gpu
def test_host_floor_gpu():
    r = bl.host_floor(8 << 20, threads=(1, 2), touch_threads=(1, 2), repeats=1, warmup=0)
    assert set(r["host_copy_in_GBps"]) == {"1", "2"} and all(v > 0 for v in r["host_copy_in_GBps"].values())
    assert r["host_register_touched_ms"] > 0 and r["host_register_fresh_ms"] > 0
    assert r["host_first_touch_ms"]["1"] > 0 and r["host_staging_ms_estimate"] > 0
    json.dumps(r)


def test_staging_floor_copies_include_ringflow_s_own_copy_where_it_is_built():
    # a floor made only of copies slower than the staged path's own is beaten by it
    copies = dict(bl._staging_copies(lambda d, s: np.copyto(d, s), lambda d, s: d.__setitem__(slice(None), s)))
    assert ("native" in copies) == (native_copy.copier() is not None)
    src = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8)
    for name, copy in copies.items():
        dst = np.zeros_like(src)
        copy(dst[5:], src[5:])
        assert np.array_equal(dst[5:], src[5:]) and not dst[:5].any(), name


@pytest.mark.gpu
def test_staging_floor_gpu():
    r = bl.staging_floor(64 << 20, splits=((2, 2), (1, 3)), chunk=4 << 20, ring_slots=4, repeats=1)
    copies = ("numpy", "memmove") + (("native",) if native_copy.copier() is not None else ())
    assert set(r["staging_together_ms"]) == {f"{s} {how}" for s in ("2+2", "1+3") for how in copies}
    assert r["staging_together_best_ms"] == min(r["staging_together_ms"].values()) > 0
    assert 0 < r["staging_together_fastest_ms"] <= r["staging_together_best_ms"]
    # the run includes the GPU's copies, so it cannot beat them on an idle host by much
    assert r["staging_together_best_ms"] >= r["staging_link_alone_ms"] * 0.9 and r["staging_host_part_ms"] > 0
    alone = bl.staging_floor(64 << 20, splits=((2, 2),), chunk=4 << 20, ring_slots=4, repeats=1, with_link=False)
    assert "staging_link_alone_ms" not in alone and alone["staging_together_best_ms"] > 0
    json.dumps(r)
