"""Pure helpers of the bench workloads (no device)."""

from __future__ import annotations

from ringflow._bench.workloads import _versus_cpp, pageable_floor_ms

MiB = 1 << 20


def test_versus_cpp_compares_like_with_like():
    cpp = {"name": "hand-written CUDA C++ pipeline", "ms_median": 5.8, "chunks": 16,
           "host_clock": {"ms_median": 5.81, "chunks": 16},
           "refilled": {"ms_median": 5.79, "chunks": 32, "host_clock": {"ms_median": 5.8, "chunks": 32}}}
    r = _versus_cpp([{"name": "serial"}, cpp], refilled_ms={16 * MiB: 6.1, 8 * MiB: 6.2},
                    untouched_ms={16 * MiB: 5.9, 8 * MiB: 5.7}, total_bytes=256 * MiB)
    u, f = r["untouched_input"], r["refilled_input"]
    # each side's best: ringflow untouched at 32 chunks against the C++ program's untouched runs
    assert (u["ringflow_best_ms"], u["ringflow_chunks"], u["cpp_best_ms_cuda_events"]) == (5.7, 32, 5.8)
    assert abs(u["ratio_vs_host_clock"] - 5.7 / 5.81) < 1e-12
    # refilled ringflow (16 chunks) against the C++ program's refilled runs
    assert (f["ringflow_best_ms"], f["ringflow_chunks"], f["cpp_best_ms_host_clock"]) == (6.1, 16, 5.8)
    assert abs(f["ratio_vs_cuda_events"] - 6.1 / 5.79) < 1e-12


def test_versus_cpp_without_the_cpp_row_or_its_refill():
    assert _versus_cpp([{"name": "hand-written CUDA C++ pipeline", "skipped": "no nvcc"}], {1: 1.0}, {1: 1.0}, 1) is None
    r = _versus_cpp([{"name": "hand-written CUDA C++ pipeline", "ms_median": 2.0, "chunks": 4}], {1: 1.0}, {1: 1.0}, 4)
    assert r["untouched_input"]["ratio_vs_cuda_events"] == 0.5 and r["untouched_input"]["ratio_vs_host_clock"] is None
    assert r["refilled_input"]["ratio_vs_cuda_events"] is None


def test_the_pageable_floor_is_the_fastest_single_run_of_its_work_or_the_link_s():
    # a median of the floor's few runs (best_ms) was once slower than the staged path itself
    floors = {"link_floor_ms": 23.4, "staging_together_best_ms": 80.5, "staging_together_fastest_ms": 66.0}
    assert pageable_floor_ms(floors) == 66.0
    assert pageable_floor_ms({**floors, "link_floor_ms": 70.0}) == 70.0
    assert pageable_floor_ms({"link_floor_ms": 23.4}) is None
    assert pageable_floor_ms({"staging_together_fastest_ms": 66.0}) is None
