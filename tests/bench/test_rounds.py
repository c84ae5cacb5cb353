"""The table of every run against the C++ program counts each file's own rounds only."""

from __future__ import annotations

import json

import pytest

from ringflow._bench.rounds import rounds_rows, rounds_table


def _doc(when: str, ratios: dict) -> dict:
    """A bench/cpp_rounds.py document: ``ratios`` maps a workload to its rounds' (MapJob, stream_map)."""
    return {"date": when, "machine": "NVIDIA H100 80GB HBM3", "rounds": len(next(iter(ratios.values()))),
            "workloads": [{"workload": w, "rounds": [{"ratio": {"MapJob": m, "stream_map": s}} for m, s in rs]}
                          for w, rs in ratios.items()]}


@pytest.fixture
def results(tmp_path):
    seed = {"seed": [(0.98, 1.01), (0.99, 1.00), (1.02, 0.97)]}
    (tmp_path / "cpp-rounds-h100-2026-12-07-at-abc1234.json").write_text(json.dumps(
        {"date": "2026-12-07", "machine": "NVIDIA H100 80GB HBM3 (16 CPUs)", "cpp_rounds": _doc("2026-12-07T09:00", seed)}))
    # an A/B run: the base's rounds are another source's and do not count
    ab = {"stream_map_ab": {"runs": {"base": [{"rounds": _doc("2026-12-06T10:00", {"seed": [(5.0, 5.0)]})}],
                                     "this": [{"rounds": _doc("2026-12-06T10:01", {"balanced": [(0.9, 0.95)]})}]}}}
    (tmp_path / "call-start-ab-h200-2026-12-06-at-def5678.json").write_text(json.dumps(
        {"date": "2026-12-06", "machine": "NVIDIA H200 (16 CPUs)", **ab}))
    (tmp_path / "bench-h200.json").write_text(json.dumps({"workloads": {"seed": {}}}))  # no rounds: no row
    return tmp_path


def test_each_file_is_a_row_of_its_own_rounds_in_the_order_they_ran(results):
    rows = rounds_rows(results)
    assert [(r.card, r.commit) for r in rows] == [("H200", "def5678"), ("H100", "abc1234")]
    assert rows[0].ratios["balanced", "stream_map"] == [0.95] and rows[0].ratios["seed", "MapJob"] == []
    assert rows[1].ratios["seed", "MapJob"] == [0.98, 0.99, 1.02]


def test_a_cell_is_the_median_ratio_and_the_rounds_at_or_below_one(results):
    lines = rounds_table(results).splitlines()
    assert len(lines) == 4 and lines[0].startswith("| date | card | commit | seed `MapJob` |")
    h100 = [c.strip() for c in lines[3].strip("|").split("|")]
    assert h100[:5] == ["2026-12-07", "H100", "`abc1234`", "0.990 (2/3)", "1.000 (2/3)"]
    assert h100[5:] == ["-"] * 4
    h200 = [c.strip() for c in lines[2].strip("|").split("|")]
    assert h200[3:7] == ["-", "-", "0.900 (1/1)", "0.950 (1/1)"]
