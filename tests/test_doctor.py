"""ringflow doctor: the report, its rendering and the CLI."""

from __future__ import annotations

import json

import pytest

import ringflow as rf
from ringflow import _doctor as doctor
from ringflow._cli import main


def _render_text(report) -> str:
    from rich.console import Console

    console = Console(record=True, width=120)
    console.print(doctor.render(report))
    return console.export_text()


def test_sim_report_has_versions_and_profile():
    report = doctor.collect("sim")
    assert report["device"]["backend"] == "sim"
    assert report["sim_profile"]["name"] == "h200-pcie5"
    assert report["versions"]["python"] and report["versions"]["numpy"]
    json.dumps(report)  # JSON-ready
    text = _render_text(report)
    assert "simulated" in text and "duplex_GBps" in text


def test_no_gpu_falls_back_to_the_profile():
    ok, _ = rf.cuda_available()
    if ok:
        pytest.skip("a GPU is usable here")
    report = doctor.collect("auto")
    assert report["device"]["backend"] == "sim" and "no usable GPU" in report["note"]
    assert doctor.doctor_command(json_out=True, device="cuda:0") == 1


def test_cli_json(capsys, tmp_path):
    out = tmp_path / "doctor.json"
    assert main(["doctor", "--json", "--device", "sim", "--output", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["device"]["backend"] == "sim"
    assert json.loads(out.read_text())["device_spec"] == "sim"


def test_cli_tables(capsys):
    assert main(["doctor", "--device", "sim"]) == 0
    assert "ringflow doctor" in capsys.readouterr().out


def test_cli_without_command_prints_help(capsys):
    assert main([]) == 2


def test_checks_compare_with_design_figures():
    m = {"h2d_pinned": {"GBps": 54.0}, "d2h_pinned": {"GBps": 40.0}, "duplex_pinned": {"GBps": 99.0},
         "overlap": {"fraction": 0.95}, "roundtrip_bit_exact": True, "pageable": {"bit_exact": True}}
    rows = {r["what"]: r for r in doctor.checks(m, "NVIDIA H200")}
    assert rows["pinned H2D 256 MiB"]["ok"] and not rows["pinned D2H 256 MiB"]["ok"]
    assert rows["copy/kernel overlap fraction"]["ok"] and rows["round trips bit-exact"]["ok"]
    assert not any(r["applies"] for r in doctor.checks(m, "NVIDIA A100") if "MiB" in r["what"])


@pytest.mark.gpu
def test_gpu_report_measures():
    report = doctor.collect("cuda:0", repeats=3)
    m = report["measurements"]
    assert report["device"]["backend"] == "cuda"
    assert m["roundtrip_bit_exact"] and m["pageable"]["bit_exact"]
    for key in ("h2d_pinned", "d2h_pinned", "duplex_pinned"):
        assert m[key]["GBps"] > 1
    assert len(m["pinned_h2d_by_size"]) == 7
    assert 0 <= m["overlap"]["fraction"] <= 1.2
    _render_text(report)
