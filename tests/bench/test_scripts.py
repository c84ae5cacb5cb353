"""The measurement scripts under bench/ run end to end on the simulated GPU (tiny sizes), so a
change to the library cannot silently break the tools the H200 figures come from."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_script(tmp_path, script: str, *args: str) -> dict:
    out = tmp_path / "out.json"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), "--device", "sim", "--out", str(out),
                           *args], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_pipeline_stress(tmp_path):
    r = run_script(tmp_path, "pipeline_stress.py", "--chunks", "200", "--max-elems", "1024")
    assert r["ok"] is True and r["chunks_total"] >= 200 and r["mismatches_total"] == 0


def test_diagnose_requests(tmp_path):
    r = run_script(tmp_path, "diagnose_requests.py", "--count", "60", "--variants", "default")
    (v,) = r["variants"]
    assert v["isolated"]["p50_ms"] > 0 and v["closed"] and v["profile"]
    stages = v["stages"]
    assert {"1", "8"} <= set(stages) and "d2h gpu end->consume submitted" in stages["8"]["breakdown"]


def test_diagnose_hotpath(tmp_path):
    r = run_script(tmp_path, "diagnose_hotpath.py", "--parts", "setup,requests", "--requests", "60")
    assert "setup_error" not in r and "requests_error" not in r
    assert r["requests"]["p99_ms"] > 0 and r["setup"]["parts_us"]


def test_call_start(tmp_path):
    """Both faces timed to their first copy, and the profile cut off there: nothing after the
    first copy (the copies themselves, the wait for the last one) is in it."""
    r = run_script(tmp_path, "call_start.py", "--mib", "16", "--chunk-mib", "1", "--calls", "3", "--top", "1000")
    assert set(r["faces"]) == {"stream_map", "MapJob"}
    for face, s in r["faces"].items():
        assert s["copies_per_call"] == 32  # 16 chunks, one copy in and one out each
        assert 0 < s["to_first_copy_us"]["median"] < s["call_ms"]["median"] * 1e3
        functions = [row["function"] for row in s["before_first_copy_by_own_time"]]
        assert not any("(sync)" in fn or "sim/stream.py" in fn and "(copy)" in fn for fn in functions), functions
        top = ("whole_array.py:", "(stream_map)") if face == "stream_map" else ("job.py:", "(_call)")
        assert any(all(part in fn for part in top) for fn in functions), functions
        # the tail: from the last sync's return to the call's, and only that part profiled
        assert 0 < s["after_last_sync_us"]["median"] < s["call_ms"]["median"] * 1e3
        tail = [row["function"] for row in s["after_last_sync_by_own_time"]]
        assert not any("(copy)" in fn or "(launch)" in fn for fn in tail), tail
        assert any("(park)" in fn for fn in tail) if face == "stream_map" else any("job.py" in fn for fn in tail), tail


def test_diagnose_pageable(tmp_path):
    r = run_script(tmp_path, "diagnose_pageable.py", "--gib", "0.004", "--repeats", "1", "--no-floors",
                   "--trace", str(tmp_path / "trace.json"))
    assert [run["name"] for run in r["runs"]][0] == "defaults" and all(run["correct"] for run in r["runs"])
    assert r["report_correct"] is True and r["report"]["chunks"] > 0
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]


def _threads_ok(r: dict, threads: int, requests: int) -> None:
    assert r["ok"] is True, {k: v for k, v in r.items() if k != "versions"}
    assert r["checked_total"] == threads * requests and r["wrong_total"] == 0 and r["errors_total"] == 0
    after = r["stats_after_close"]
    assert after["in_flight"] == 0 and after["accepted"] == after["delivered"] == threads * requests
    assert r["live_total_after_close"] == 0 and r["machine"] and r["command"] and r["date"]


def test_threads_check_one_thread(tmp_path):
    r = run_script(tmp_path, "threads_check.py", "--threads", "1", "--requests", "50", "--max-elems", "4096")
    _threads_ok(r, 1, 50)


def test_threads_check_many_threads(tmp_path):
    r = run_script(tmp_path, "threads_check.py", "--threads", "4", "--requests", "50", "--max-elems", "4096",
                   "--timeout", "60")
    _threads_ok(r, 4, 50)
    assert {t["mode"] for t in r["per_thread"]} == {"submit", "map"}


def test_device_list_cost(tmp_path):
    r = run_script(tmp_path, "device_list_cost.py", "--mib", "2", "--calls", "3")
    assert set(r["median_ms"]) == {"device", "device_list"} and r["list_over_single"] > 0
    assert r["machine"] and r["command"] and r["date"]


def test_diagnose_compute_streams(tmp_path):
    r = run_script(tmp_path, "diagnose_compute_streams.py", "--mib", "64", "--iters", "2", "--calls", "2")
    row = r["rows"][0]
    assert row["compute_streams_default"] == 4 and row["default_over_one"] > 0 and r["machine"]


def test_diagnose_taper(tmp_path):
    r = run_script(tmp_path, "diagnose_taper.py", "--mib", "16", "--chunk-mib", "2", "--streams", "1,2",
                   "--calls", "1", "--workloads", "seed")
    row = r["workloads"][0]
    assert set(row["median_ms"]) == {"2MiB s1", "2MiB s1 taper", "2MiB s2", "2MiB s2 taper", "2MiB planned",
                                     "2MiB measured"}
    assert row["plans"]["2MiB measured"]["compute_streams"] in (1, 2) and r["machine"]


def test_diagnose_stream_map_gap(tmp_path):
    r = run_script(tmp_path, "diagnose_stream_map_gap.py", "--mib", "16", "--chunk-mib", "2", "--calls", "1",
                   "--workloads", "seed", "--profile", "3")
    row = r["rows"][0]
    assert row["stream_map"]["outside_run_ms"] > 0 and row["MapJob"]["run_ms"] > 0 and "stream_map" in r["profile"]


def test_cpp_rounds(tmp_path):
    r = run_script(tmp_path, "cpp_rounds.py", "--mib", "16", "--rounds", "2", "--calls", "1",
                   "--workloads", "seed,compute-bound")
    assert [w["workload"] for w in r["workloads"]] == ["seed", "compute-bound"]
    for w in r["workloads"]:
        assert w["correct"] == {"MapJob": True, "stream_map": True}
        assert [rd["cpp_first"] for rd in w["rounds"]] == [False, True]  # the order alternates
        for rd in w["rounds"]:
            assert "skipped" in rd["cpp"] and rd["ratio"] == {"MapJob": None, "stream_map": None}
            for face in ("MapJob", "stream_map"):
                side = rd["ringflow"][face]
                assert set(side["ms_by_chunks"]) == {str(c) for c in w["chunk_counts"]}
                assert side["best_ms"] == min(side["ms_by_chunks"].values()) > 0
        assert w["ratio"]["MapJob"] == {"median": None}


def test_cpp_rounds_ratios(tmp_path, monkeypatch):
    """With a C++ program standing in at a known time, each round's ratio is each face's best over
    it and the summary counts the rounds at or below 1.00."""
    import runpy

    from ringflow._bench import baselines

    cpp_ms = iter([1e9, 1e-9])  # round 0: far slower than ringflow; round 1: far faster
    monkeypatch.setattr(baselines, "cuda_cpp_pipeline", lambda n, **kw: {
        "ms_median": 1.0, "correct": True, "host_clock": {"ms_median": next(cpp_ms), "chunks": kw["chunks"][0]}})
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["cpp_rounds.py", "--device", "sim", "--mib", "16", "--rounds", "2",
                                      "--calls", "1", "--workloads", "balanced", "--out", str(out)])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(os.path.join(ROOT, "bench", "cpp_rounds.py"), run_name="__main__")
    assert done.value.code == 0
    (w,) = json.loads(out.read_text())["workloads"]
    first, second = w["rounds"]
    assert first["ratio"]["MapJob"] == first["ringflow"]["MapJob"]["best_ms"] / 1e9
    assert second["ratio"]["stream_map"] == second["ringflow"]["stream_map"]["best_ms"] / 1e-9
    for face in ("MapJob", "stream_map"):
        s = w["ratio"][face]
        assert s["rounds"] == 2 and s["rounds_at_or_below_1"] == 1 and s["min"] < 1 < s["max"]


def test_stream_map_overhead(tmp_path):
    r = run_script(tmp_path, "stream_map_overhead.py", "--calls", "50", "--before", "none,sleep,spin,touch")
    assert 0 < r["rows"]["MapJob"]["median_us"] and 0 < r["rows"]["stream_map"]["median_us"]
    assert {"stream_map after sleep", "MapJob after touch"} <= set(r["rows"])
    assert 0 < r["rows"]["stream_map"]["least_block_us"] and "least_block_us" not in r["rows"]["MapJob after touch"]


def test_stream_map_overhead_on_pool_memory(tmp_path):
    r = run_script(tmp_path, "stream_map_overhead.py", "--calls", "50", "--memory", "pinned,pool")
    assert {"stream_map", "MapJob", "pool stream_map", "pool MapJob"} == set(r["rows"])
    assert all(row["median_us"] > 0 for row in r["rows"].values())


def test_warm_capacity(tmp_path):
    """Three jobs in turn: a cache of two builds an engine on every timed call, one of four none."""
    r = run_script(tmp_path, "warm_capacity.py", "--mib", "0.0625", "--capacities", "2,4", "--rounds", "2")
    rows = {(row["host"], row["capacity"]): row for row in r["rows"]}
    assert set(rows) == {(host, c) for host in ("stage", "register") for c in (2, 4)}
    for host in ("stage", "register"):
        assert rows[host, 2]["engines_built"] == rows[host, 2]["calls"] == 6
        assert rows[host, 4]["engines_built"] == 0
    assert all(row["correct"] and row["median_ms"] > 0 for row in rows.values())


def test_capture_sync_probe(tmp_path):
    """On the simulated GPU alone (no GPU side): as on a GPU, synchronising another stream on the
    capturing thread abandons the capture (as the device-wide synchronisation does); an event
    recorded before the capture, and another thread's synchronisation, leave it whole."""
    r = run_script(tmp_path, "capture_sync_probe.py")
    rows = r["rows"]["sim"]
    assert r["rows"]["gpu"] is None and len(rows) == 5
    for name, row in rows.items():
        abandoned = name in ("device synchronize", "other stream sync")
        assert row["call"].startswith("raised CaptureError" if abandoned else "returned"), (name, row)
        assert row["end_capture"].startswith("raised CaptureError" if abandoned else "returned"), (name, row)


def test_request_stalls(tmp_path):
    r = run_script(tmp_path, "request_stalls.py", "--count", "60", "--rounds", "1", "--sample")
    assert r["capacity_per_s"] > 0 and [lv["sampled"] for lv in r["rounds"]] == [False, True]
    assert all(lv["correct"] and 0 < lv["submit_busy_share"] <= 1 and "pinned_in_level" in lv for lv in r["rounds"])
    for lv in r["rounds"]:  # every request counted once, on time or behind
        assert lv["submit_on_time"]["requests"] + lv["submit_behind"]["requests"] == 60


def test_staging_in_pipeline(tmp_path):
    r = run_script(tmp_path, "staging_in_pipeline.py", "--count", "40", "--threads", "2", "--streaming", "1,0",
                   "--rounds", "1")
    assert [row["streaming"] for row in r["rows"]] == [True, False]
    assert all(row["correct"] and row["copies"] == 3 * 40 and row["alone"]["mean_us"] > 0 for row in r["rows"])


def test_pin_stall_check(tmp_path):
    r = run_script(tmp_path, "pin_stall_check.py", "--pins", "2", "--mib", "4")
    assert len(r["pin_ms"]) == 2 and r["rounds_outside"] > 0


def run_plain(tmp_path, script: str, *args: str) -> dict:
    """Run a script that takes its devices its own way (no ``--device``); its JSON."""
    out = tmp_path / "out.json"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_multi_gpu_check(tmp_path):
    r = run_plain(tmp_path, "multi_gpu_check.py", "--devices", "sim:0,sim:1", "--mib-per-gpu", "8",
                  "--pageable-mib", "16", "--calls", "1")
    assert "median_ms" in r["seed_like"]["all"] and "median_ms" in r["pageable"]["all"]
    assert r["seed_like_graph"]["all"]["replays_graph"] and not r["seed_like"]["all"]["replays_graph"]
    assert r["sim_prediction"]["throughput_scaling"] > 1.5
    assert r["sim_prediction_pageable"]["speedup"] > 0 and r["sim_prediction_pageable"]["all_ms"] > 0


def test_multi_gpu_predict(tmp_path):
    r = run_plain(tmp_path, "multi_gpu_predict.py", "--mib-per-gpu", "8", "--pageable-mib", "16",
                  "--requests", "40")
    rows = r["rows"]
    assert set(rows) == {"seed", "balanced", "pageable", "requests"} and r["device_counts"] == [1, 2]
    for name in ("seed", "balanced"):  # pinned in place: each device has its own link, nothing shared
        assert rows[name]["correct"] is True and rows[name]["ratio"]["2"] > 1 and rows[name]["planner_ratio"]["2"] > 1
        assert rows[name]["devices"]["2"]["bytes_in"] == 2 * rows[name]["devices"]["1"]["bytes_in"]
    assert rows["pageable"]["correct"] is True and rows["pageable"]["devices"]["2"]["planner_ms"] > 0
    assert rows["requests"]["ratio"]["2"] > 0 and rows["requests"]["planner_ratio"] is None
    assert r["simulated"] is True and r["sizes"]["scaled_down"] is True and r["profile"] == "h200-pcie5"
    assert r["machine"] and r["command"] and r["date"] and r["versions"]["numpy"]


def test_feed_variants(tmp_path):
    r = run_script(tmp_path, "feed_variants.py", "--batches", "4", "--rounds", "1", "--workers", "2", "--batch", "2",
                   "--size", "8")
    names = [row["name"] for row in r["rows"]]
    assert names == ["processes, in slot", "processes, new array", "threads, in slot", "threads, new array"]
    assert all(row["correct"] for row in r["rows"]) and r["bound"]["bound_ms"] > 0


def test_pinned_write_check(tmp_path):
    r = run_script(tmp_path, "pinned_write_check.py", "--mib", "1", "--repeats", "1")
    assert set(r["kinds"]) == {"new numpy array (warm)", "allocate_host", "register_host", "rf.host.empty"}
    assert all(v > 0 for row in r["kinds"].values() for v in row.values())


def test_decode_into_slot_check():
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "decode_into_slot_check.py"), "--device", "sim",
                           "--batch", "2", "--size", "8"], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ms a batch") == 9


def test_map_small_items(tmp_path):
    r = run_script(tmp_path, "map_small_items.py", "--sizes-kib", "4,64", "--total-mib", "1", "--rounds", "1")
    assert r["correct"] is True and set(r["sizes"]) == {"4KiB", "64KiB"}
    small = r["sizes"]["4KiB"]
    assert small["items"] == 256 and small["map-alone"]["chunks"] == 256
    assert small["map"]["chunks"] < small["map-alone"]["chunks"] and small["map_over_alone"] > 0


def test_few_chunks(tmp_path):
    r = run_script(tmp_path, "few_chunks.py", "--chunk-mib", "1", "--chunks", "2,64", "--rounds", "1")
    assert r["correct"] is True and [row["chunks"] for row in r["rows"]] == [2, 64]
    few, many = r["rows"]
    assert 0 < few["simulated_ms"] < many["simulated_ms"] and 0 < few["predicted_ms"] < many["predicted_ms"]


def test_diagnose_staged_call(tmp_path):
    r = run_script(tmp_path, "diagnose_staged_call.py", "--shapes", "1x2", "--calls", "2")
    (row,) = r["rows"]
    assert row["chunks"] == 2 and len(row["wall_ms"]) == 2 and row["report"]["chunks"] == 2
    assert {"h2d", "d2h", "prepare", "consume"} <= {span[1] for span in row["spans"]}


def test_pyspy_summary(tmp_path):
    """The py-spy summary splits samples by thread, leaves out the pool's first pinning, and
    sorts a native profile's submitting-thread samples into what the C frames show."""
    sub = ("thread (1): MainThread;<module> (request_costs.py:1);run_variant (request_costs.py:2);"
           "Pipeline.submit (ringflow/_pipeline/api.py:531)")
    prog = "thread (2): ringflow-progress-1;_run (ringflow/_pipeline/driver.py:356);ProgressThread.step_once (x.py:1)"
    raw = tmp_path / "native.txt"
    raw.write_text("\n".join([
        f"{sub};copy (ringflow/_device/native_copy.py:361);ringflow_copy (n.so);copy_part (native_copy-1.so) 6",
        f"{sub};copy (ringflow/_device/native_copy.py:361);0x1 (_ctypes.cpython-312.so);pthread_cond_timedwait (libc.so.6);0x2 (libc.so.6) 3",
        f"{sub};Condition.__enter__ (threading.py:300);PyThread_acquire_lock_timed (python3.12);0x2 (libc.so.6) 1",
        f"{sub};HostPool.take (h.py:1);LegacyPinnedMemoryResource.allocate (_legacy.py:57) 50",
        f"{prog};Scheduler.step (s.py:1) 4",
    ]) + "\n")
    out = tmp_path / "summary.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "pyspy_summary.py"), "--out", str(out), str(raw)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(out.read_text())["native.txt"]
    assert s["submit"]["samples"] == 10 and s["progress"]["samples"] == 4
    assert s["submit_native_parts"] == {"copying (copy_part)": 0.6,
                                        "taking the GIL back after the copy's ctypes call": 0.3,
                                        "waiting for a lock (the driver's, the batch lock)": 0.1}
    assert ["Scheduler.step (s.py)", 1.0] in s["progress"]["inclusive"]


def test_auto_chunk_cost(tmp_path):
    r = run_script(tmp_path, "auto_chunk_cost.py", "--mib", "2", "--rounds", "1")
    assert r["correct"] is True and {row["setting"] for row in r["rows"]} >= {"auto", "auto, planned afresh"}
    assert r["choose_chunk_bytes_remembered_us"] < r["choose_chunk_bytes_afresh_us"]


def test_copy_spin_check(tmp_path):
    r = run_script(tmp_path, "copy_spin_check.py", "--spins", "200,0", "--rounds", "1", "--count", "30",
                   "--passes", "1")
    assert [run["spin_us"] for run in r["runs"]] == [200.0, 0.0]
    for run in r["runs"]:
        assert run["correct"] is True and run["capacity_per_s"] > 0 and run["copy_alone_us"]["1MiB"] > 0
        assert set(run["host_cpu_s"]) >= {"user", "idle", "steal"} and set(run["copy_counters"]) >= {"split_copies"}
    assert r["machine"] and r["command"] and r["date"]


def test_large_submit_parts(tmp_path):
    r = run_script(tmp_path, "large_submit_parts.py", "--count", "60", "--rounds", "1")
    (rnd,) = r["rounds"]
    assert rnd["correct"] is True and rnd["capacity_per_s"] > 0 and rnd["p99_ms"] > 0
    assert {"submit", "host_copy", "accepting"} <= set(rnd["closed"]["large"]) and "submit" in rnd["open"]["small"]


def test_ab_source(tmp_path):
    """bench/ab_source.sh runs the request measurements under a base source (here this tree's own,
    archived) and this tree's, and gathers them."""
    tar = tmp_path / "base-src.tar.gz"
    subprocess.run(f"tar -czf {tar} src", shell=True, check=True, cwd=ROOT)
    env = dict(os.environ, OUT=str(tmp_path / "out"), DEVICE="sim", BENCH_ARGS="--quick", PARTS_ARGS="--count 40",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    proc = subprocess.run(["bash", os.path.join(ROOT, "bench", "ab_source.sh"), "1", str(tar)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "out" / "ab.json").read_text())
    for v in ("base", "this"):
        (run,) = r["runs"][v]
        assert run["requests"]["correct"] is True and run["large_submit_parts"]["correct"] is True
        assert r["medians"][v]["capacity_per_s"] > 0 and r["medians"][v]["large_lock_wait_us_per_request_open"] >= 0


def test_stream_map_ab(tmp_path):
    """bench/stream_map_ab.sh runs the whole-array measurements under a base source and this
    tree's, and gathers their medians by source."""
    tar = tmp_path / "base-src.tar.gz"
    subprocess.run(f"tar -czf {tar} src", shell=True, check=True, cwd=ROOT)
    env = dict(os.environ, OUT=str(tmp_path / "out"), DEVICE="sim",
               GAP_ARGS="--mib 16 --chunk-mib 2 --calls 1 --workloads seed",
               ROUNDS_ARGS="--mib 16 --calls 1 --workloads seed",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    proc = subprocess.run(["bash", os.path.join(ROOT, "bench", "stream_map_ab.sh"), "1", str(tar)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "out" / "stream_map_ab.json").read_text())
    for v in ("base", "this"):
        (run,) = r["runs"][v]
        assert run["gap"]["rows"][0]["workload"] == "seed" and run["rounds"]["workloads"][0]["correct"]["MapJob"]
        assert r["medians"][v]["seed stream_map outside_run_ms"] > 0


@pytest.mark.parametrize("freeze", [False, True])
def test_gc_pauses(tmp_path, freeze):
    r = run_script(tmp_path, "gc_pauses.py", "--count", "60", *(["--freeze"] if freeze else []))
    assert r["correct"] is True and r["capacity_per_s"] > 0 and r["p99_80_over_isolated"] > 0
    assert r["freeze"] is freeze and (r["heap"]["frozen_objects"] > 0) is freeze
    assert set(r["gc"]) >= {"gen0", "gen1", "gen2"} and r["gc"]["gen0"]["count"] >= 0


def test_queue_policies(tmp_path):
    r = run_script(tmp_path, "queue_policies.py", "--count", "100", "--seeds", "5", "--long", "400")
    rows = {(row["requests"], row["hold"], row["policy"]): row for row in r["rows"]}
    assert len(rows) == 2 * 2 * 4 and all(row["p99_over_isolated_median"] >= 1.0 for row in rows.values())


def test_queue_policies_fifo_is_the_benchs_perfect_server_and_a_smaller_request_interrupts():
    """The script's first-come order is the bench's own perfect FIFO server (``queue_floor``), and
    its interrupting order lets a small request overtake a large one in service."""
    import importlib.util

    import numpy as np

    from ringflow._bench.baselines import queue_floor

    spec = importlib.util.spec_from_file_location("queue_policies", os.path.join(ROOT, "bench", "queue_policies.py"))
    qp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(qp)
    rng = np.random.default_rng(5)
    nbytes = rng.integers(1 << 12, 1 << 23, 300).astype(np.float64)
    arrived = np.cumsum(rng.exponential(1 / 4000, 300))
    isolated = 2e-4 + nbytes / 20e9
    capacity = 5000.0
    alike, by_bytes = queue_floor(arrived, isolated, nbytes, capacity)
    hold = nbytes / nbytes.mean() / capacity
    np.testing.assert_allclose(qp.serve("fifo", arrived, hold, nbytes) + isolated, by_bytes, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(qp.serve("fifo", arrived, np.full(300, 1 / capacity), nbytes) + isolated, alike,
                               rtol=1e-12, atol=1e-12)
    # a 10 ms request at 0, a 1 ms one at 2 ms: the small one runs at once, the large one ends at 11 ms
    two = qp.serve("shortest-remaining", np.array([0.0, 2e-3]), np.array([10e-3, 1e-3]), np.array([10.0, 1.0]))
    np.testing.assert_allclose(two, [1e-3, 0.0], atol=1e-12)
    # without interrupting, the small one waits for the large one's end
    np.testing.assert_allclose(qp.serve("shortest-first", np.array([0.0, 2e-3]), np.array([10e-3, 1e-3]),
                                        np.array([10.0, 1.0])), [0.0, 8e-3], atol=1e-12)
    # two waiting behind a third: the fewest bytes or the most go next
    arrive, holds, sizes = np.array([0.0, 0.5e-3, 0.5e-3]), np.array([1e-3, 5e-3, 2e-3]), np.array([1.0, 5.0, 2.0])
    np.testing.assert_allclose(qp.serve("shortest-first", arrive, holds, sizes), [0.0, 2.5e-3, 0.5e-3], atol=1e-12)
    np.testing.assert_allclose(qp.serve("largest-first", arrive, holds, sizes), [0.0, 0.5e-3, 5.5e-3], atol=1e-12)
    with pytest.raises(ValueError, match="policy must be one of"):
        qp.serve("random", arrived, hold, nbytes)


def test_staging_rate_check(tmp_path):
    r = run_script(tmp_path, "staging_rate_check.py", "--sizes-mib", "4", "--threads", "2", "--workers", "2",
                   "--rounds", "1", "--repeats", "2", "--chunk-mib", "1", "--path-mib", "32")
    assert [row["split"] for row in r["rows"]] == ["1+1", "2+0", "2 threads, 1 MiB chunks through a ring"]
    assert all(row["GBps_fastest"] > 0 for row in r["rows"]) and r["staged_correct"] is True
    assert r["path_bytes"] == 32 << 20 and len(r["staged_ms"]) == 1


def test_scheduler_load(tmp_path):
    r = run_script(tmp_path, "scheduler_load.py", "--workers", "1,2", "--chunks-kib", "64,256", "--rounds", "1")
    assert r["correct"] is True and [(row["workers"], row["chunk_bytes"]) for row in r["rows"]] == [
        (1, 64 << 10), (2, 64 << 10), (1, 256 << 10), (2, 256 << 10)]
    assert all(row["scheduler_us_per_chunk_median"] > 0 and row["wall_ms_median"] > 0 for row in r["rows"])
    assert all(row["planned_host_us_per_chunk"] == pytest.approx(416.0) for row in r["rows"])  # the fit


def test_sides_check(tmp_path):
    """Every case runs and is checked; the one-side staged rows carry both predictions (one side
    below both sides), the free choices record what the layout chose. Every timed call found its
    engine warm: sixteen settings, none evicting another's."""
    r = run_script(tmp_path, "sides_check.py", "--mib", "4", "--chunks", "256,auto", "--rounds", "2")
    assert r["correct"] is True
    assert [row["warm_calls"] for row in r["rows"]] == [2] * 16
    assert all(row["first_ms"] > 0 for row in r["rows"])
    cases = {(row["case"], row["chunk_bytes"]) for row in r["rows"]}
    assert len(cases) == len(r["rows"]) == 8 * 2
    small = run_script(tmp_path, "sides_check.py", "--mib", "0.0625", "--chunks", "default", "--rounds", "1")
    assert small["correct"] is True and small["bytes"] == 64 << 10
    assert {row["chunk_bytes"] for row in small["rows"]} == {None}
    assert all(row.get("planned_chunk_bytes", 64 << 10) == 64 << 10 for row in small["rows"])
    # a MapJob weighs one call: its registered prediction is the run alone, below a call's
    auto = {row["chunk_bytes"]: row for row in r["rows"] if row["case"] == "auto both"}
    assert [row["chunk_bytes"] for row in r["job_rows"]] == [256 << 10, "auto"]
    for row in r["job_rows"]:
        assert row["strategy"] in ("stage", "register") and row["median_ms"] > 0 and row["setup_ms"] > 0
        assert row["predicted_register_ms"] < auto[row["chunk_bytes"]]["predicted_register_ms"]
        assert row["predicted_stage_ms"] == pytest.approx(auto[row["chunk_bytes"]]["predicted_stage_ms"])
    for row in r["rows"]:
        assert row["median_ms"] > 0
        if row["case"] == "stage in, out pinned":
            assert row["predicted_ms"] < row["predicted_both_staged_ms"]
        if row["case"].startswith("auto"):
            assert row["host_choice"] in ("stage", "register")
        else:
            assert row["host_choice"] is None
