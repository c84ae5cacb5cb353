"""ringflow doctor: the report, its rendering and the CLI."""

from __future__ import annotations

import json
import os
import re

import numpy as np
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


def fake_measurements(h2d=54.8, d2h=54.7, duplex=98.4, overlap=0.95):
    def bw(x):
        return {"GBps": x, "GBps_min": x - 0.04, "GBps_max": x + 0.04, "repeats": 10, "median_ms": 4.897654321,
                "min_ms": 4.8912, "max_ms": 4.9011, "bytes": 256 << 20}

    sizes = [64 << 10, 256 << 10, 1 << 20]
    return {"h2d_pinned": bw(h2d), "d2h_pinned": bw(d2h), "duplex_pinned": bw(duplex),
            "roundtrip_bit_exact": True,
            "pageable": {"h2d": bw(15.91234), "d2h": bw(11.3), "h2d_sync": bw(9.87654), "d2h_sync": bw(8.1),
                         "bit_exact": True},
            "pinned_h2d_by_size": [dict(bw(2.512345), bytes=n) for n in sizes],
            "pinned_d2h_by_size": [dict(bw(2.498765), bytes=n) for n in sizes],
            "overlap": {"t_copy_ms": 4.8976543, "t_kernel_ms": 4.91234, "t_both_ms": 5.1234567, "fraction": overlap},
            "seconds": 12.345678}


GEN5_X16 = doctor.link_rate(32.0, 16)


def test_link_rate_per_generation():
    assert GEN5_X16["GBps"] == pytest.approx(32 * 16 * 128 / 130 / 8) and GEN5_X16["generation"] == 5
    assert doctor.link_rate(8.0, 8)["GBps"] == pytest.approx(8 * 8 * 128 / 130 / 8)  # Gen3 x8
    assert doctor.link_rate(2.5, 1)["GBps"] == pytest.approx(0.25)  # Gen1: 8b/10b
    assert doctor.link_rate(64.0, 16)["generation"] == 6


def make_sysfs(root, bus="0000:1b:00.0", **files):
    """A fake /sys with one PCI device; files maps e.g. current_link_speed -> its text (None: absent)."""
    folder = root / "bus" / "pci" / "devices" / bus
    folder.mkdir(parents=True)
    defaults = {"current_link_speed": "32.0 GT/s PCIe\n", "current_link_width": "16\n",
                "max_link_speed": "32.0 GT/s PCIe\n", "max_link_width": "16\n"}
    defaults.update(files)
    for name, text in defaults.items():
        if text is not None:
            (folder / name).write_text(text)
    return str(root)


def test_read_pcie_link_from_sysfs(tmp_path):
    sysfs = make_sysfs(tmp_path)
    for spelling in ("0000:1b:00.0", "00000000:1B:00.0", "1b:00.0"):  # as sysfs, CUDA and NVML print it
        link = doctor.read_pcie_link(spelling, sysfs)
        assert link["reason"] is None and link["bus_id"] == "0000:1b:00.0"
        assert link["current"] == GEN5_X16 and link["max"] == GEN5_X16


def test_read_pcie_link_older_kernel_format(tmp_path):
    sysfs = make_sysfs(tmp_path, current_link_speed="8 GT/s\n", current_link_width="x8")
    link = doctor.read_pcie_link("0000:1b:00.0", sysfs)
    assert link["current"]["generation"] == 3 and link["current"]["width"] == 8


@pytest.mark.parametrize("files, phrase", [
    ({"current_link_speed": None}, "cannot read"),
    ({"current_link_width": None}, "cannot read"),
    ({"current_link_speed": "Unknown\n"}, "'Unknown'"),
    ({"current_link_speed": "fast"}, "not a link speed"),
    ({"current_link_speed": "-5 GT/s"}, "not a link speed"),
    ({"current_link_width": "0\n"}, "not a link width"),
    ({"current_link_width": "3\n"}, "not a link width"),  # (a width PCIe does not have: no profile holds it)
    ({"current_link_width": "64\n"}, "not a link width"),
    ({"current_link_speed": "256.0 GT/s PCIe"}, "not a link speed"),
    ({"current_link_width": "sixteen"}, "not a link width"),
    ({"current_link_width": "\xff\xfe"}, "not a link width"),
])
def test_read_pcie_link_missing_or_garbled_files(tmp_path, files, phrase):
    link = doctor.read_pcie_link("0000:1b:00.0", make_sysfs(tmp_path, **files))
    assert link["current"] is None and phrase in link["reason"]
    rows = {r["what"]: r for r in doctor.checks(fake_measurements(), link)}
    row = rows["pinned H2D 256 MiB"]
    assert row["applies"] is False and row["ok"] is None and phrase in row["expected"]  # skipped, with the reason


def test_read_pcie_link_without_the_device_or_an_address(tmp_path):
    assert "cannot read" in doctor.read_pcie_link("0000:02:00.0", make_sysfs(tmp_path))["reason"]
    assert "not a PCI address" in doctor.read_pcie_link("GPU-1234", str(tmp_path))["reason"]
    assert doctor.read_pcie_link("0000:1b:00.0", str(tmp_path / "nowhere"))["current"] is None


def test_missing_max_link_keeps_the_current_one(tmp_path):
    link = doctor.read_pcie_link("0000:1b:00.0", make_sysfs(tmp_path, max_link_speed=None))
    assert link["current"] == GEN5_X16 and link["max"] is None and link["reason"] is None
    assert doctor.compare_with_link(fake_measurements(), link)["basis"] == "current"


def test_checks_compare_with_the_link():
    link = {"current": GEN5_X16, "max": GEN5_X16}
    rows = {r["what"]: r for r in doctor.checks(fake_measurements(h2d=54.0, d2h=40.0, duplex=99.0), link)}
    h2d, d2h, duplex = rows["pinned H2D 256 MiB"], rows["pinned D2H 256 MiB"], rows["pinned H2D+D2H at once (sum)"]
    assert h2d["ok"] and h2d["share"] == pytest.approx(54.0 / GEN5_X16["GBps"], abs=1e-3)
    assert not d2h["ok"] and d2h["applies"]  # 40 of 63 GB/s: below 75% of the link
    assert duplex["ok"] and duplex["share"] == pytest.approx(99.0 / (2 * GEN5_X16["GBps"]), abs=1e-3)
    assert "63.0 GB/s" in h2d["expected"] and "126.0 GB/s" in duplex["expected"]
    assert rows["copy/kernel overlap fraction"]["ok"] and rows["round trips bit-exact"]["ok"]
    assert not {r["what"]: r for r in doctor.checks(fake_measurements(overlap=0.3), link)}[
        "copy/kernel overlap fraction"]["ok"]


def test_an_idle_downshifted_link_is_compared_at_its_maximum():
    gen1 = doctor.link_rate(2.5, 16)
    basis = doctor.compare_with_link(fake_measurements(), {"current": gen1, "max": GEN5_X16})
    assert basis["basis"] == "max" and basis["rate"] == GEN5_X16 and "Gen1" in basis["note"]


def test_a_link_below_its_maximum_is_reported():
    gen4 = doctor.link_rate(16.0, 16)
    basis = doctor.compare_with_link(fake_measurements(h2d=25.0, d2h=25.0), {"current": gen4, "max": GEN5_X16})
    assert basis["basis"] == "current" and "below its maximum" in basis["note"] and "Gen4" in basis["note"]


def test_rounding():
    r = doctor.rounded({"measurements": fake_measurements(h2d=54.81234)})
    m = r["measurements"]
    assert m["h2d_pinned"]["GBps"] == 54.8 and m["pageable"]["h2d"]["GBps"] == 15.9
    assert m["h2d_pinned"]["median_ms"] == 4.9 and m["overlap"]["t_both_ms"] == 5.12
    assert m["seconds"] == 12.3 and m["h2d_pinned"]["bytes"] == 256 << 20 and m["roundtrip_bit_exact"] is True
    assert doctor.rounded({"host_copy_GBps": ((1, 10.04), (4, 21.06))}) == {"host_copy_GBps": [[1, 10.0], [4, 21.1]]}
    assert doctor.rounded({"kernel_min_s": 2.0e-6, "launch_overhead_s": 1.1234e-5}) == {
        "kernel_min_s": 2e-6, "launch_overhead_s": 1.12e-5}


def cuda_report(link):
    m = doctor.rounded(fake_measurements(h2d=54.81234))
    return {"device": {"backend": "cuda", "name": "NVIDIA H200", "index": 0, "array_type": "cupy"},
            "versions": {"python": "3.11"}, "capabilities": {"sm_count": 132}, "measurements": m,
            "link": dict(link, source="sysfs", comparison=doctor._comparison_summary(m, link)),
            "checks": doctor.checks(m, link)}


def test_render_a_gpu_report_rounded_with_its_link():
    text = _render_text(cuda_report({"bus_id": "0000:1b:00.0", "current": GEN5_X16, "max": GEN5_X16, "reason": None}))
    assert "54.8 GB/s" in text and "54.81" not in text
    assert "PCIe Gen5 x16 (63.0 GB/s per direction)" in text and "87%" in text
    assert "4.9 ms" in text and "5.12 ms" in text  # the overlap times, 3 significant digits
    assert "H200" in text and "of the link" in text


def test_render_a_gpu_report_without_a_link():
    text = _render_text(cuda_report({"bus_id": None, "current": None, "max": None, "reason": "no sysfs here"}))
    assert "no sysfs here" in text and "n/a" in text


def test_sim_report_models_its_profiles_link(capsys):
    report = doctor.collect("sim")
    assert report["link"]["current"]["generation"] == 5 and report["link"]["current"]["width"] == 16
    assert report["link"]["comparison"]["h2d_share"] == pytest.approx(54.8 / GEN5_X16["GBps"], abs=1e-3)
    assert report["sim_profile"]["register_GBps"] == round(report["sim_profile"]["register_GBps"], 1)
    text = _render_text(report)
    assert "PCIe Gen5 x16" in text and "2 µs" in text


class FakeProps:
    pci_domain_id, pci_bus_id, pci_device_id = 0, 0x1B, 0


class FakeCudaDevice:
    """What collect() touches of a CudaDevice."""

    def __init__(self, index=0):
        self.index, self.name, self.array_type, self.closed = index, "NVIDIA H200", "cupy", False
        self._cc = type("CC", (), {"properties": FakeProps()})()

    @property
    def capabilities(self):
        return type("Caps", (), {"as_dict": lambda self: {"sm_count": 132}})()

    def close(self):
        self.closed = True


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    import ringflow._device as device_pkg
    import ringflow._device.cuda as cuda_pkg
    import ringflow._device.cuda.measure as measure_mod

    monkeypatch.setattr(device_pkg, "cuda_available", lambda: (True, "1 CUDA GPU(s)"))
    monkeypatch.setattr(device_pkg, "_gpu_count", lambda: 1)
    monkeypatch.setattr(cuda_pkg, "CudaDevice", FakeCudaDevice)
    monkeypatch.setattr(measure_mod, "measure", lambda dev, repeats: fake_measurements(h2d=54.81234, duplex=101.14))
    monkeypatch.setattr(doctor, "SYSFS", make_sysfs(tmp_path, current_link_speed="2.5 GT/s PCIe"))


def test_collect_on_a_gpu_reads_its_link(fake_gpu):
    said = []
    report = doctor.collect("cuda:0", progress=said.append)
    assert report["device"]["name"] == "NVIDIA H200" and report["link"]["bus_id"] == "0000:1b:00.0"
    assert report["link"]["comparison"]["basis"] == "max"  # read at Gen1 after the copies: idle
    assert report["measurements"]["h2d_pinned"]["GBps"] == 54.8
    assert any("measuring" in s for s in said)
    rows = {r["what"]: r for r in report["checks"]}
    assert rows["pinned H2D+D2H at once (sum)"]["measured"] == 101.1  # GB/s keep their decimal
    _render_text(report)


def test_bus_id_from_the_driver_when_cuda_core_lacks_it(monkeypatch):
    import sys
    import types

    class NoProps(FakeCudaDevice):
        def __init__(self):
            super().__init__(0)
            self._cc = object()  # no .properties

    driver = types.SimpleNamespace(cuDeviceGetPCIBusId=lambda n, index: (0, b"0000:00:06.0\x00" + b" " * 19))
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = driver
    monkeypatch.setitem(sys.modules, "cuda", types.ModuleType("cuda"))
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    assert doctor._bus_id(NoProps()) == "0000:00:06.0"
    assert doctor._bus_id(FakeCudaDevice()) == "0000:1b:00.0"


def test_collect_refuses_a_gpu_index_beyond_the_count(fake_gpu):
    with pytest.raises(ValueError, match="has 1 CUDA GPU"):
        doctor.collect("cuda:7")


def test_progress_only_on_a_terminal_and_never_with_json(capsys):
    tty = type("Tty", (), {"isatty": lambda self: True})()
    pipe = type("Pipe", (), {"isatty": lambda self: False})()
    assert doctor.show_progress(False, tty) and not doctor.show_progress(True, tty)
    assert not doctor.show_progress(False, pipe) and not doctor.show_progress(False, object())
    assert doctor.doctor_command(json_out=True, device="sim") == 0
    assert capsys.readouterr().err == ""


def test_progress_shows_on_a_terminal(fake_gpu, monkeypatch):
    shown = []

    class Status:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, text):
            shown.append(text)

    import rich.console

    monkeypatch.setattr(rich.console.Console, "status", lambda self, text: Status())
    monkeypatch.setattr(doctor, "show_progress", lambda json_out, stream=None: not json_out)
    assert doctor.doctor_command(json_out=False, device="cuda:0") == 0
    assert any("measuring" in s for s in shown)
    shown.clear()
    assert doctor.doctor_command(json_out=True, device="cuda:0") == 0
    assert shown == []


def test_a_bad_device_is_refused():
    with pytest.raises(ValueError, match="unknown device 'bogus'"):
        doctor.doctor_command(device="bogus")
    assert main(["doctor", "--device", "bogus"]) == 2


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


@pytest.mark.gpu
def test_gpu_calibration_measures_every_figure_of_a_profile(tmp_path):
    """``doctor --save``'s measurements on the GPU make a valid profile, the host's staging rate
    included (half the threads copying in, half out, the GPU's copies beside), and the host's
    time per chunk of each engine, staging the dearer."""
    from ringflow._device.hardware import get_profile

    dev = rf.device("cuda:0")
    try:
        profile = doctor.calibrate(dev, str(tmp_path / "gpu.json"), repeats=3)
        assert dev.live().host_buffers == 0 and dev.live().streams == 0
    finally:
        dev.close()
    assert get_profile(str(tmp_path / "gpu.json")) == profile
    assert [t for t, _ in profile.staging_GBps] == [t for t, _ in profile.host_copy_GBps]
    assert all(0.1 < rate < profile.host_copy_rate(t) for t, rate in profile.staging_GBps)
    assert 0 < profile.direct_chunk_host_s < profile.staged_chunk_host_s < 0.05  # seconds a chunk
    assert 0 < profile.scheduled_chunk_host_s < 0.05 and 0 < profile.one_side_chunk_host_s < 0.05
    # a page's registration and unregistration: a driver call each way, well under a millisecond,
    # and more than a page's bytes at the registration rates
    page = 4096 / (profile.register_GBps * 1e9) + 4096 / (profile.unregister_GBps * 1e9)
    assert page < profile.register_call_s < 1e-3


# -- saving a hardware profile (--save), with fake measurements ---------------------------------------------------------
def fake_model_measurements():
    return {"bytes": 256 << 20, "threads": [1, 4, 8, 16], "device_GBps": 4012.34, "kernel_min_s": 2.1e-6,
            "launch_overhead_s": 6.5e-6, "copy_overhead_s": 3.2e-6, "event_overhead_s": 1.1e-6,
            "host_task_overhead_s": 4.4e-6, "host_copy_GBps": [[1, 9.8], [4, 20.5], [8, 30.9], [16, 40.2]],
            "register_GBps": 30.1, "register_fresh_GBps": 7.5, "unregister_GBps": 50.2, "register_call_s": 23.5e-6,
            "first_touch_GBps": [[1, 3.7], [16, 30.5]],
            "staging_GBps": [[1, 2.9], [4, 8.2], [8, 12.1], [16, 13.9]], "seconds": 2.5}


FAKE_CHUNK_HOST_SECONDS = {"staged": 512.5e-6, "one_side": 402.5e-6, "scheduled": 164.25e-6, "direct": 71.25e-6}


class FullCudaDevice(FakeCudaDevice):
    """A fake GPU whose capabilities hold everything a profile takes from them."""

    @property
    def capabilities(self):
        caps = {"sm_count": 132, "async_engine_count": 3, "compute_capability": (9, 0), "total_memory": 150 * 10**9}
        return type("Caps", (), {"as_dict": lambda self: dict(caps)})()


@pytest.fixture
def fake_calibration(fake_gpu, monkeypatch, tmp_path):
    """fake_gpu, with the profile's extra measurements faked and the per-GPU cache in tmp_path."""
    import ringflow._chunk_host_cost as chunk_host_cost
    import ringflow._device.cuda as cuda_pkg
    import ringflow._device.cuda.measure as measure_mod
    from ringflow._device import hardware

    monkeypatch.setattr(cuda_pkg, "CudaDevice", FullCudaDevice)
    monkeypatch.setattr(measure_mod, "measure_model", lambda dev, repeats: fake_model_measurements())
    monkeypatch.setattr(chunk_host_cost, "chunk_host_seconds", lambda dev, repeats: FAKE_CHUNK_HOST_SECONDS)
    monkeypatch.setattr(hardware, "gpu_driver_version", lambda: "580.159.04")
    monkeypatch.setattr(hardware, "_for_gpu", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "ringflow" / "profiles" / "nvidia-h200-580.159.04.json"


def test_save_writes_a_profile_of_the_measurements_that_round_trips(fake_calibration, tmp_path, capsys):
    from ringflow._device.hardware import HardwareProfile, get_profile

    path = tmp_path / "h200.json"
    assert main(["doctor", "--device", "cuda:0", "--save", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"saved hardware profile nvidia-h200-580.159.04 to {path}" in out and "plan --profile" in out
    assert "Launch, host copy, registration and per-chunk host costs" in out
    p = get_profile(str(path))
    assert p == HardwareProfile.from_json(path.read_text())
    assert (p.gpu_name, p.driver, p.name) == ("NVIDIA H200", "580.159.04", "nvidia-h200-580.159.04")
    assert p.staging_GBps == ((1, 2.9), (4, 8.2), (8, 12.1), (16, 13.9))
    assert p.measured_at and p.pcie_link == (32.0, 16)  # the link the copies ran on (its maximum: see fake_gpu)
    m = fake_measurements(h2d=54.81234, duplex=101.14)
    assert p.h2d_curve == tuple((r["bytes"], r["GBps"]) for r in m["pinned_h2d_by_size"])  # unrounded
    assert p.duplex_GBps == 101.14 and p.pageable_h2d_GBps == 15.91234
    assert p.launch_overhead_s == 6.5e-6 and p.host_copy_GBps == ((1, 9.8), (4, 20.5), (8, 30.9), (16, 40.2))
    assert p.first_touch_GBps == ((1, 3.7), (16, 30.5)) and p.device_GBps == 4012.34
    assert (p.staged_chunk_host_s, p.scheduled_chunk_host_s, p.direct_chunk_host_s) == (512.5e-6, 164.25e-6, 71.25e-6)
    assert re.search(r"staged_chunk_host_s +│ 513 µs", out) and re.search(r"direct_chunk_host_s +│ 71.2 µs", out)
    assert re.search(r"scheduled_chunk_host_s +│ 164 µs", out)
    assert p.one_side_chunk_host_s == 402.5e-6 and re.search(r"one_side_chunk_host_s +│ 403 µs", out)
    assert p.register_call_s == 23.5e-6 and re.search(r"register_call_s +│ 23.5 µs", out)
    assert json.loads(path.read_text())["model"]["scheduled_chunk_host_s"] == 164.25e-6  # the file holds it
    assert (p.sm_count, p.async_engine_count, p.compute_capability, p.total_memory) == (132, 3, (9, 0), 150 * 10**9)
    assert not fake_calibration.exists()  # a path was given: the cache is left alone


def test_save_without_a_path_fills_the_cache_this_gpu_plans_with(fake_calibration, capsys):
    from ringflow._device import hardware
    from ringflow._device.protocol import Device

    assert main(["doctor", "--device", "cuda:0", "--json", "--save"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)  # stdout stays JSON; the note goes to stderr
    assert report["profile"]["path"] == str(fake_calibration) and "now plans with it" in captured.err
    assert report["model_measurements"]["device_GBps"] == 4012.3  # rounded in the report, not in the profile
    saved = hardware.load_profile(fake_calibration)
    assert saved.device_GBps == 4012.34
    gpu = FullCudaDevice()
    assert Device.hardware.fget(gpu) == saved  # the real GPU's model is now its own


def test_calibrate_on_first_use_measures_and_caches(fake_calibration, monkeypatch):
    from ringflow._device import hardware

    monkeypatch.setenv(hardware.CALIBRATE_VAR, "1")
    profile = hardware.profile_for_gpu("NVIDIA H200", device=FullCudaDevice())
    assert profile.gpu_name == "NVIDIA H200" and profile.launch_overhead_s == 6.5e-6
    assert hardware.load_profile(fake_calibration) == profile


def test_plan_reads_a_saved_profile(fake_calibration, tmp_path, capsys):
    path = tmp_path / "h200.json"
    assert main(["doctor", "--device", "cuda:0", "--save", str(path)]) == 0
    capsys.readouterr()
    assert main(["plan", "--bytes", "256MiB", "--pinned", "--profile", str(path)]) == 0
    out = capsys.readouterr().out
    assert "nvidia-h200-580.159.04" in out and "predicted total" in out and "slots host_in" in out
    assert "measured on NVIDIA H200 (driver 580.159.04)" in out
    assert re.search(r"host time per chunk from +│ +this profile", out)
    assert main(["plan", "--bytes", "256MiB", "--profile", str(path)]) == 0  # staged
    assert re.search(r"host time per chunk from +│ +this profile", capsys.readouterr().out)


def test_plan_on_the_gen4_profile(capsys):
    assert main(["plan", "--bytes", "16MiB", "--pinned", "--profile", "pcie4-x16"]) == 0
    out = capsys.readouterr().out
    assert "pcie4-x16" in out and "chunks of 2 MiB x 8" in out  # tests/test_plan.py works out why
    assert re.search(r"host time per chunk from +│ +the planner's fit", out)  # a built-in profile measured no host


@pytest.mark.parametrize("content, phrase", [
    ('{"schema": "ringflow-hardware-profile"', "not JSON"),
    ("[1]", "not a hardware profile"),
])
def test_plan_refuses_a_corrupt_profile_in_one_line(tmp_path, capsys, content, phrase):
    path = tmp_path / "bad.json"
    path.write_text(content)
    assert main(["plan", "--profile", str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ringflow plan: error: ") and phrase in err[0] and "bad.json" in err[0]


def test_plan_refuses_a_profile_with_a_bad_field(tmp_path, capsys):
    from ringflow._device.hardware import H200_PCIE5

    data = json.loads(H200_PCIE5.to_json())
    data["model"]["duplex_GBps"] = -1
    path = tmp_path / "neg.json"
    path.write_text(json.dumps(data))
    assert main(["plan", "--profile", str(path)]) == 1
    assert "'model.duplex_GBps' must be a finite number more than 0, got -1.0" in capsys.readouterr().err


@pytest.mark.parametrize("value, phrase", [
    (0, "must be at least 1, got 0"), (-1, "must be at least 1, got -1"),
    (float("nan"), "must be a whole number, got number nan"), ("1GiB", "must be a whole number, got string '1GiB'"),
    (1.5, "must be a whole number, got number 1.5"), (True, "must be a whole number, got boolean True"),
])
def test_plan_refuses_a_profile_whose_total_memory_is_not_a_byte_count(tmp_path, capsys, value, phrase):
    from ringflow._device.hardware import H200_PCIE5

    data = json.loads(H200_PCIE5.to_json())
    data["model"]["total_memory"] = value
    path = tmp_path / "memory.json"
    path.write_text(json.dumps(data))
    assert main(["plan", "--profile", str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ringflow plan: error: "), err
    assert f"'model.total_memory' {phrase}" in err[0] and "memory.json" in err[0]


def test_plan_on_a_profile_of_little_device_memory_plans_only_rings_that_fit(tmp_path, capsys):
    """A profile of 1 KiB of device memory is a valid profile. `plan` plans chunks whose device
    rings fit there (not 64 KiB chunks, whose rings need 384 KiB), refuses a --chunk whose rings
    do not (naming --chunk and total_memory), and refuses a device too small for any chunk's
    rings naming chunk_bytes and total_memory; one line each, exit 1, never a traceback. The
    chunks that fit 1 KiB are pinned ones (the direct engine packs its slots): staged, the
    scheduler starts each slot on a 256-byte boundary, and no chunk's rings fit (1026 bytes at
    the least)."""
    import dataclasses

    from ringflow import _plan as plan
    from ringflow._device.hardware import H200_PCIE5

    path = tmp_path / "tiny.json"
    tiny = dataclasses.replace(H200_PCIE5, name="tiny", total_memory=1 << 10)
    tiny.save(path)
    assert main(["plan", "--bytes", "64MiB", "--pinned", "--profile", str(path)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    chunk = plan.choose_chunk_bytes(tiny, 64 << 20, workers=8, host_stages=False).chunk_bytes
    assert 6 * chunk <= 1 << 10 and f"in chunks of {chunk / 2**20:g} MiB" in out
    assert main(["plan", "--bytes", "64MiB", "--profile", str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "chunk_bytes of 1 bytes" in err[0] and "total_memory of 1024 bytes" in err[0], err
    assert main(["plan", "--bytes", "64MiB", "--chunk", "8MiB", "--profile", str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ringflow plan: error: --chunk 8388608 bytes: "), err
    assert "total_memory of 1024 bytes" in err[0] and "--chunk auto" in err[0]
    dataclasses.replace(tiny, total_memory=1).save(path)
    assert main(["plan", "--bytes", "64MiB", "--profile", str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "chunk_bytes of 1 bytes" in err[0] and "total_memory of 1 bytes" in err[0], err


def test_the_simulated_profile_can_be_saved_as_a_starting_point(tmp_path, capsys):
    from ringflow._device.hardware import H200_PCIE5, load_profile

    path = tmp_path / "start.json"
    assert main(["doctor", "--device", "sim", "--save", str(path)]) == 0
    assert load_profile(path) == H200_PCIE5
    capsys.readouterr()
    assert main(["doctor", "--device", "sim", "--save"]) == 2  # no GPU to cache a profile for
    assert "give a file name (--save FILE)" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["unit", "my profile.json"])
def test_the_plan_command_a_save_advises_plans_with_the_saved_file(tmp_path, monkeypatch, capsys, name):
    """A file named as a built-in profile (``--save unit``) or with a space in its name: the
    advised ``ringflow plan --profile unit`` planned with the built-in profile, not the file, and
    ``--profile my profile.json`` was two arguments."""
    import shlex

    monkeypatch.chdir(tmp_path)
    assert main(["doctor", "--device", "sim", "--save", name]) == 0
    advice = re.search(r"plan with it: ringflow (plan --profile .*?), or ", capsys.readouterr().out).group(1)
    assert main([*shlex.split(advice), "--bytes", "1MiB"]) == 0
    assert f"on profile h200-pcie5 (from {os.path.join(os.curdir, name)})" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("args, env, named", [
    (["--device", "sim"], None, "--device sim"),
    ([], "sim", "RINGFLOW_DEVICE=sim"),
    (["--device", "sim:1", "--json"], "cuda:0", "--device sim:1"),
])
def test_save_without_a_path_on_the_simulated_gpu_is_refused_before_any_work(capsys, monkeypatch, args, env, named):
    """The per-GPU cache holds measured GPUs' profiles: on the simulated GPU, --save without a file
    name is a mistake on the command line, refused as one (exit 2, naming the option) before the
    report is collected or printed."""
    if env is None:
        monkeypatch.delenv("RINGFLOW_DEVICE", raising=False)
    else:
        monkeypatch.setenv("RINGFLOW_DEVICE", env)
    collected = []
    monkeypatch.setattr(doctor, "_collect", lambda *a, **k: collected.append(a) or pytest.fail("collected"))
    assert main(["doctor", *args, "--save"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and not collected
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ringflow doctor: error: argument --save: "), err
    assert named in lines[0] and "give a file name (--save FILE)" in lines[0]


def test_save_without_a_gpu_says_why(tmp_path, capsys, monkeypatch):
    import ringflow._device as device_pkg

    monkeypatch.setattr(device_pkg, "cuda_available", lambda: (False, "no driver here"))
    assert main(["doctor", "--save", str(tmp_path / "p.json")]) == 1
    err = capsys.readouterr().err
    assert "--save: no usable GPU to measure (no driver here)" in err and not (tmp_path / "p.json").exists()


def test_save_refuses_an_unwritable_path_before_measuring(fake_calibration, tmp_path, capsys):
    assert main(["doctor", "--device", "cuda:0", "--save", str(tmp_path / "nowhere" / "p.json")]) == 2
    assert "argument --save" in capsys.readouterr().err


def test_a_report_without_the_model_measurements_makes_no_profile():
    report = cuda_report({"bus_id": None, "current": None, "max": None, "reason": "none"})
    with pytest.raises(ValueError, match="ringflow doctor --save"):
        doctor.profile_from_report(report)
    with pytest.raises(ValueError, match="real GPU"):
        doctor.profile_from_report(doctor.collect("sim"))
    report["model_measurements"] = dict(fake_model_measurements(), register_GBps=-3.0,  # a failed measurement
                                        staged_chunk_host_s=5e-4, direct_chunk_host_s=7e-5,
                                        scheduled_chunk_host_s=1.6e-4)
    report["capabilities"] = FullCudaDevice().capabilities.as_dict()
    with pytest.raises(ValueError, match="register_GBps must be a finite number more than 0"):
        doctor.profile_from_report(report)


def _no_op():
    pass


def test_measure_model_reads_back_the_simulated_gpus_figures():
    """The new measurements, run on the simulated GPU (whose costs are its profile's exactly),
    recover the profile: the arithmetic and the gating of device spans are right."""
    from ringflow._device.cuda.measure import measure_model

    dev = rf.device("sim", profile="pcie4-x16", checked=False)
    p = dev.hardware
    m = measure_model(dev, nbytes=8 << 20, staging_bytes=4 << 20, repeats=3, calls=20, cpus=2,
                      kernel=lambda stream, seconds: stream.launch(_no_op, sim_seconds=seconds or None))
    assert m["device_GBps"] == pytest.approx(p.device_GBps, rel=1e-9)
    assert m["kernel_min_s"] == pytest.approx(p.kernel_min_s, rel=1e-9)
    for name in ("launch_overhead_s", "copy_overhead_s", "event_overhead_s", "host_task_overhead_s"):
        assert m[name] == pytest.approx(getattr(p, name), rel=1e-9), name
    assert m["threads"] == [1, 2] and [t for t, _ in m["host_copy_GBps"]] == [1, 2]
    assert [t for t, _ in m["first_touch_GBps"]] == [1, 2]
    for key in ("register_GBps", "register_fresh_GBps", "unregister_GBps", "register_call_s"):
        assert m[key] > 0  # the host's own work, on the host clock
    assert m["register_call_s"] < 0.01
    assert all(rate > 0 for _, rate in m["host_copy_GBps"] + m["first_touch_GBps"])
    # the host's copies, with the device's in virtual time beside them, on each thread count timed
    assert [t for t, _ in m["staging_GBps"]] == [1, 2] and all(rate > 0 for _, rate in m["staging_GBps"])
    assert dev.live().streams == 0 and dev.live().device_buffers == 0 and dev.live().host_buffers == 0


@pytest.mark.parametrize("fast_pass", [0, 1])
def test_the_staging_rate_is_the_fastest_run_of_two_passes_apart(monkeypatch, fast_pass):
    """The host's memory bandwidth drifts from one minute to the next, so one short pass of the
    staging measurement can land on a slow stretch and give a "floor" the staged path beats. The
    measurement runs twice, before the host's other measurements and after them, and each thread
    count keeps its fastest run of either."""
    import ringflow._device.cuda.measure as measure_mod

    calls = []
    nbytes = 8 << 20

    def fake_runs(s_in, s_out, d_a, d_b, h_in, h_out, src, executor, t_in, t_out, repeats):
        assert src.nbytes == nbytes  # staging_bytes: the staged path's whole-array scale, not nbytes
        threads = t_in + t_out
        passes = sum(1 for t, _ in calls if t == threads) // len(measure_mod.staging_splits(threads))
        calls.append((threads, passes))
        seconds = 1e-3 * (1 if passes == fast_pass else 2) / threads
        return [seconds * 1.1, seconds]

    monkeypatch.setattr(measure_mod, "staging_runs", fake_runs)
    dev = rf.device("sim", checked=False)
    try:
        m = measure_mod.measure_model(dev, nbytes=1 << 20, staging_bytes=nbytes, repeats=2, calls=5, cpus=2,
                                      kernel=lambda stream, seconds: stream.launch(_no_op, sim_seconds=seconds or None))
    finally:
        dev.close()
    assert sorted({p for _, p in calls}) == [0, 1]  # two passes over every thread count
    assert m["staging_GBps"] == [[t, pytest.approx(nbytes / 2 / (1e-3 / t) / 1e9)] for t in (1, 2)]


@pytest.mark.parametrize("pinnable_mib, expected_mib", [(64, 16), (6, 4), (2, None)])
def test_the_staging_measurement_takes_fewer_bytes_where_memory_is_short(monkeypatch, pinnable_mib, expected_mib):
    """The staging measurement holds more memory than the doctor's others (two pinned buffers of
    its size): on a host that cannot pin that much it halves its size, down to the others' size,
    and says which it took; where even that fails the error is the allocation's, and nothing the
    measurement made is left behind."""
    import ringflow._device.cuda.measure as measure_mod
    from ringflow._errors import OutOfMemoryError

    dev = rf.device("sim", checked=False)
    allocate_host = dev.allocate_host

    pins = []

    def short(nbytes, *args, **kwargs):  # the doctor's first pinned buffer (4 MiB) is always pinned
        pins.append(nbytes)
        if len(pins) > 1 and nbytes > (pinnable_mib << 20):
            raise OutOfMemoryError(f"cannot pin {nbytes} bytes")
        return allocate_host(nbytes, *args, **kwargs)

    monkeypatch.setattr(dev, "allocate_host", short)
    sizes = []

    def fake_runs(s_in, s_out, d_a, d_b, h_in, h_out, src, executor, t_in, t_out, repeats):
        sizes.append((src.nbytes, h_in.nbytes, h_out.nbytes, d_a.nbytes, d_b.nbytes))
        return [1e-3]

    monkeypatch.setattr(measure_mod, "staging_runs", fake_runs)
    try:
        run = lambda: measure_mod.measure_model(  # noqa: E731
            dev, nbytes=4 << 20, staging_bytes=16 << 20, repeats=2, calls=5, cpus=2,
            kernel=lambda stream, seconds: stream.launch(_no_op, sim_seconds=seconds or None))
        if expected_mib is None:
            with pytest.raises(OutOfMemoryError, match="cannot pin"):
                run()
        else:
            m = run()
            size = expected_mib << 20
            assert m["staging_bytes"] == size and set(sizes) == {(size, size, size, size // 2, size // 2)}
            assert m["staging_GBps"][0] == [1, pytest.approx(size / 2 / 1e-3 / 1e9)]
        live = dev.live()
        assert live.streams == 0 and live.device_buffers == 0 and live.host_buffers == 0
    finally:
        dev.close()


@pytest.mark.parametrize("t_in, t_out, chunk_kib", [(1, 0, 0), (1, 1, 0), (2, 2, 0), (1, 3, 0), (1, 0, 64),
                                                     (3, 0, 64), (2, 0, 96)])
def test_the_staging_measurement_copies_on_as_many_threads_as_it_times(monkeypatch, t_in, t_out, chunk_kib):
    """Each staging run hands one task per thread it times to the executor (a task runs on one
    thread): one thread's point copies in and then out on that thread, as one worker stages its
    chunks in and its results out by turns. Two tasks for one thread timed two threads at once,
    and the planner then took one worker to stage at twice the rate it does. In chunks through
    a ring, each thread copies every ``t_in``-th chunk in and then out."""
    import concurrent.futures

    import ringflow._device.cuda.measure as measure_mod

    submitted = []

    class OneAtATime:  # runs each task as it is handed over, and counts them
        def submit(self, fn, *args):
            submitted.append(fn)
            future = concurrent.futures.Future()
            future.set_result(fn(*args))
            return future

    # numpy's copies, as the staged path's workers make them: ringflow's native copy (streaming
    # stores, made for a request's staging) moves the same bytes at another rate
    from ringflow._device import native_copy

    monkeypatch.setattr(native_copy, "copy", lambda *a: pytest.fail("the staging measurement made a native copy"))
    nbytes, repeats = 1 << 20, 2
    dev = rf.device("sim", checked=False)
    made = []
    try:
        s_in, s_out = dev.create_stream(), dev.create_stream()
        made += [s_in, s_out]
        d_a, d_b = dev.allocate(nbytes, stream=s_in), dev.allocate(nbytes, stream=s_in)
        h_in, h_out = dev.allocate_host(nbytes), dev.allocate_host(nbytes)
        made += [d_a, d_b, h_in, h_out]
        src = np.arange(nbytes, dtype=np.uint8)
        h_out.view(np.uint8)[:] = 7
        runs = measure_mod.staging_runs(s_in, s_out, d_a, d_b, h_in, h_out, src, OneAtATime(), t_in, t_out, repeats,
                                        chunk_bytes=chunk_kib << 10)
        s_in.sync()
        s_out.sync()
        pinned_in = h_in.view(np.uint8)[: nbytes // 2].copy()
        if chunk_kib:
            with pytest.raises(ValueError, match="chunk_bytes: .* t_out must be 0"):
                measure_mod.staging_runs(s_in, s_out, d_a, d_b, h_in, h_out, src, OneAtATime(), 1, 1, repeats,
                                         chunk_bytes=chunk_kib << 10)
    finally:
        for obj in reversed(made):
            obj.close()
        dev.close()
    assert len(runs) == repeats and all(r > 0 for r in runs)
    assert len(submitted) == (repeats + 1) * (t_in + t_out)  # a warm-up run and the timed ones
    if not chunk_kib:
        np.testing.assert_array_equal(pinned_in, src[: nbytes // 2])  # the host's half went in
    else:  # through a ring of two slots a thread (four at the least): each slot holds its last chunk
        chunk = chunk_kib << 10
        n = -(-(nbytes // 2) // chunk)
        slots = max(4, 2 * t_in)
        for slot in range(slots):
            k = max(k for k in range(n) if k % slots == slot)
            got = pinned_in[slot * chunk: slot * chunk + min(chunk, nbytes // 2 - k * chunk)]
            np.testing.assert_array_equal(got, src[k * chunk: k * chunk + got.size])


@pytest.mark.parametrize("threads, expected", [(1, (1,)), (2, (1, 2)), (3, (1, 3)), (4, (1, 2, 4)),
                                               (8, (3, 4, 8)), (16, (6, 8, 16))])
def test_the_staging_rate_is_timed_with_the_threads_split_and_by_turns(threads, expected):
    """How many threads copy in (the rest copy out): half, three in eight, and all of them, each
    copying its part in and then out by turns as the staged path's workers do. With two threads
    the only split was one each way, and the staged path with two workers beat the figure by a
    seventh: one thread copying out (faulting fresh pages in) may run long after the other has
    ended its copy in, where threads taking turns end together."""
    from ringflow._device.cuda.measure import staging_splits

    assert staging_splits(threads) == expected


@pytest.mark.parametrize("cpus, expected", [(1, (1,)), (2, (1, 2)), (6, (1, 2, 4, 6)), (16, (1, 2, 4, 8, 16)),
                                            (64, (1, 2, 4, 8, 16)), (None, (1,))])
def test_host_copies_are_timed_on_the_threads_there_are(cpus, expected):
    from ringflow._device.cuda.measure import thread_counts

    assert thread_counts(cpus) == expected


def test_doctor_command_refuses_save_true_on_the_simulated_gpu_before_collecting(monkeypatch):
    monkeypatch.setattr(doctor, "_collect", lambda *a, **k: pytest.fail("collected"))
    with pytest.raises(ValueError, match=r"--save: the device is the simulated GPU \(--device sim\); give a file"):
        doctor.doctor_command(device="sim", save=True)


def test_a_measurement_that_is_not_a_number_is_written_as_strict_json(fake_gpu, monkeypatch, tmp_path, capsys):
    """A figure the GPU's run gave as NaN or infinite (a copy timed at zero, an overlap of
    nothing) was printed as the bare words ``NaN``/``Infinity``, which strict JSON readers
    refuse: it is null, in the printed report and in the file."""
    import json

    import ringflow._device.cuda.measure as measure_mod

    monkeypatch.setattr(measure_mod, "measure",
                        lambda dev, repeats: fake_measurements(h2d=float("nan"), duplex=float("inf"), overlap=float("nan")))
    out = tmp_path / "doctor.json"
    assert doctor.doctor_command(json_out=True, device="cuda:0", output=str(out)) == 0
    printed = capsys.readouterr().out

    def strict(text):
        return json.loads(text, parse_constant=lambda word: pytest.fail(f"{word} in the JSON"))

    for report in (strict(printed), strict(out.read_text())):
        assert report["measurements"]["h2d_pinned"]["GBps"] is None
        assert report["measurements"]["duplex_pinned"]["GBps"] is None
