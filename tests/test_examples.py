"""Every script in examples/ runs on the simulated GPU and prints what it promises."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

import ringflow

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"

# script -> lines its output must contain (regular expressions, each matched against one line)
EXPECTED = {
    "01_numpy_through_a_gpu_function.py": [r"^device: simulated ", r"^stream_map: 16 MiB through f, result matches numpy$",
                                           r"^in place: ok$"],
    "02_request_stream.py": [r"^map: 100 results, in order, all correct$", r"^submit: 100 futures resolved, all correct$",
                             r"^stats: accepted=200 delivered=200 failed=0 cancelled=0 in_flight=0$",
                             r"^latency \(submit to result\): p50 \d+\.\d+ ms, p99 \d+\.\d+ ms$"],
    "03_cuda_kernel.py": [r"\(the numpy reference runs\)$", r"^saxpb over 4194304 floats in 4 chunks: correct$"],
    "04_profile_and_trace.py": [r"^16 chunks, 16\.8 MB in \d+\.\d+ ms \(ideal \d+\.\d+ ms, efficiency \d\.\d\d, bottleneck ",
                                r"^trace: .*trace\.json \(open at https://ui\.perfetto\.dev\)$",
                                r"^timeline: .*timeline\.png$",
                                r"^pipeline: 5 requests in [1-5] chunks, chunk latency p50 \d+\.\d+ ms, p99 \d+\.\d+ ms$"],
    "05_mapjob.py": [r"^<MapJob \(1048576, 4\) float32 in 8 chunks .*host=register, engine=direct, open>$",
                     r"^call 4: \d+\.\d+ ms, out == 9$", r"^8 chunks, 16\.8 MB in ",
                     r"^graph: 64 chunks of 256 KiB, the last call \d+\.\d+ ms, replayed as one graph: True$"],
    "06_ray_data.py": [r"^ray data: 200000 rows through f on 2 CPU actors \(simulated GPU\), result matches numpy$",
                       r"^error: stage 'compute' failed for rows 12288\.\.16383 of a batch of 25000 rows "
                       r"\(id 12288\.\.16383\): ValueError: 12345 is not allowed$"],
    "07_feed_model.py": [r"^fed 32 batches of 8 images \(3x32x32, float16\) to the model step on the device; "
                         r"outputs match numpy$"],
}
# examples that need an optional extra: skipped, with the reason, where it is not installed
NEEDS = {"06_ray_data.py": ("ray.data", "Ray Data is not installed (pip install 'ringflow[ray]')")}


def run_example(name: str, cwd: pathlib.Path, *args: str) -> str:
    env = dict(os.environ, RINGFLOW_DEVICE="sim")
    # the ringflow under test, also when it is imported from a source tree rather than installed
    src = str(pathlib.Path(ringflow.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, f"{name} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    # a clean-up that failed is a RuntimeWarning on stderr, not an exit status (close_quietly)
    if name not in NEEDS:
        assert "RuntimeWarning" not in proc.stderr, f"{name} warned:\n{proc.stderr}"
    return proc.stdout


def test_every_example_is_checked():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(EXPECTED)


# (the Ray example starts Ray and two pools of actors: longer than the default per-test timeout)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.timeout(300)) if n in NEEDS else n
                                  for n in sorted(EXPECTED)])
def test_example_runs_on_the_simulated_gpu(name, tmp_path):
    if name in NEEDS:
        pytest.importorskip(NEEDS[name][0], reason=NEEDS[name][1])
    lines = run_example(name, tmp_path).splitlines()
    for pattern in EXPECTED[name]:
        assert any(re.search(pattern, line) for line in lines), f"{name}: no line matches {pattern!r}:\n" + "\n".join(lines)


def test_profile_example_writes_a_perfetto_trace_and_a_png(tmp_path):
    run_example("04_profile_and_trace.py", tmp_path, "out")
    trace = json.loads((tmp_path / "out" / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert {e["name"] for e in spans} and all(e["dur"] >= 0 for e in spans)
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert any("h2d" in t for t in tracks) and any("d2h" in t for t in tracks)
    assert (tmp_path / "out" / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
