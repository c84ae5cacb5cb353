"""Hardware profiles: JSON round trips, validation, lookup by name or path, the per-GPU cache a
real GPU plans with, and the PCIe Gen4 profile's assumptions."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import types

import numpy as np
import pytest

import ringflow as rf
from ringflow._device import hardware
from ringflow._device.hardware import H200_PCIE5, PCIE4_X16, HardwareProfile, ProfileError, get_profile
from ringflow._device.protocol import Device

MEASURED = dataclasses.replace(H200_PCIE5, name="nvidia-h200-580.159.04", gpu_name="NVIDIA H200",
                               driver="580.159.04", measured_at="2026-12-01T09:30:00+00:00",
                               launch_overhead_s=6.5e-6, host_copy_GBps=((1, 9.5), (2, 15.0)),
                               staged_chunk_host_s=455e-6, direct_chunk_host_s=52e-6, scheduled_chunk_host_s=131e-6,
                               register_call_s=24e-6)


@pytest.fixture
def fresh_lookups(monkeypatch, tmp_path):
    """An empty per-GPU cache under tmp_path, and no lookups remembered from other tests."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(hardware.CALIBRATE_VAR, raising=False)
    monkeypatch.setattr(hardware, "_for_gpu", {})
    monkeypatch.setattr(hardware, "gpu_driver_version", lambda: "580.159.04")
    return tmp_path / "cache" / "ringflow" / "profiles"


# -- JSON -------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("profile", [H200_PCIE5, PCIE4_X16, hardware.UNIT_TEST, MEASURED], ids=lambda p: p.name)
def test_a_profile_round_trips_through_json(profile, tmp_path):
    text = profile.to_json()
    data = json.loads(text)
    assert data["schema"] == hardware.SCHEMA and data["schema_version"] == hardware.SCHEMA_VERSION
    assert data["name"] == profile.name and data["date"] == profile.measured_at
    assert data["machine"]["gpu"] == profile.gpu_name and data["machine"]["driver"] == profile.driver
    every = {f.name for f in dataclasses.fields(HardwareProfile)}
    assert set(data["model"]) == every - {"name", "measured_at", "gpu_name", "driver", "pcie_link"}
    assert HardwareProfile.from_json(text) == profile
    path = tmp_path / "p.json"
    assert hardware.save_profile(profile, path) == str(path)
    assert hardware.load_profile(path) == profile
    assert get_profile(str(path)) == profile and get_profile(path) == profile  # str and PathLike


def test_the_json_names_the_machine_and_its_link():
    data = json.loads(MEASURED.to_json())
    assert data["machine"] == {"gpu": "NVIDIA H200", "driver": "580.159.04", "pcie_link": {"GTps": 32.0, "width": 16}}
    assert data["date"] == "2026-12-01T09:30:00+00:00"
    assert data["model"]["host_copy_GBps"] == [[1, 9.5], [2, 15.0]]
    assert json.loads(PCIE4_X16.to_json())["machine"]["pcie_link"] == {"GTps": 16.0, "width": 16}


def _doc(**changes):
    """MEASURED's JSON document with ``changes`` applied: "model.x": value sets, None deletes."""
    data = json.loads(MEASURED.to_json())
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        obj = data
        for p in parents:
            obj = obj[p]
        if value is None:
            del obj[leaf]
        else:
            obj[leaf] = value
    return json.dumps(data)


@pytest.mark.parametrize("changes, phrase", [
    ({"model.duplex_GBps": None}, "missing field(s) model.duplex_GBps"),
    ({"machine.driver": None}, "missing field(s) machine.driver"),
    ({"date": None}, "missing field(s) date"),
    ({"model.duplx_GBps": 98.4}, "unknown field(s) model.duplx_GBps"),
    # a key is the file's text: its line breaks and escape sequences split the message or drove
    # the terminal where it was printed
    ({"model.a\rb": 1}, "unknown field(s) model.a\\rb; remove them"),
    ({"model.k\x1b]0;t\x07": 1}, "unknown field(s) model.k\\x1b]0;t\\x07; remove them"),
    ({"machine.g\u2028pu": 1}, "unknown field(s) machine.g\\u2028pu; remove them"),
    ({"model.duplex_GBps": "fast"}, "'model.duplex_GBps' must be a number, got string 'fast'"),
    ({"model.duplex_GBps": True}, "'model.duplex_GBps' must be a number"),
    ({"model.duplex_GBps": -98.4}, "'model.duplex_GBps' must be a finite number more than 0, got -98.4"),
    ({"model.register_GBps": 0}, "'model.register_GBps' must be a finite number more than 0"),
    ({"model.launch_overhead_s": -1e-6}, "'model.launch_overhead_s' must be a finite number 0 or more"),
    ({"model.h2d_curve": []}, "'model.h2d_curve' must be a non-empty list of [bytes, GB/s] pairs"),
    ({"model.h2d_curve": [[65536, 2.5], [1024, 10.0]]}, "the bytes must rise from point to point"),
    ({"model.h2d_curve": [[65536, -2.5]]}, "'model.h2d_curve'[0][1] (GB/s) must be a finite number more than 0"),
    ({"model.h2d_curve": [[65536.5, 2.5]]}, "[0][0] (bytes) must be a whole number"),
    ({"model.host_copy_GBps": [[0, 1.0]]}, "(threads) must be at least 1"),
    ({"model.sm_count": 0}, "'model.sm_count' must be at least 1"),
    # valid numbers past any machine, which broke the model's arithmetic (a ZeroDivisionError or
    # an OverflowError in the planner, reported as an internal error)
    ({"model.h2d_curve": [[1, 1e300]]}, "'model.h2d_curve'[0][1] (GB/s) must be from 1e-06 to 1e+06"),
    ({"model.duplex_GBps": 5e-324}, "'model.duplex_GBps' must be from 1e-06 to 1e+06"),
    ({"model.host_copy_GBps": [[1, 5e-324]]}, "must be from 1e-06 to 1e+06"),
    ({"model.launch_overhead_s": 1e308}, "'model.launch_overhead_s' must be from 0 to 3600"),
    ({"model.h2d_curve": [[2 ** 63, 2.5]]}, "[0][0] (bytes) must be at most"),
    # a whole number past a float's range is read as an infinity (_jsontext): it was refused
    # as not a whole number, 'got number inf'
    ({"model.sm_count": 10 ** 400}, "'model.sm_count' must be at most 4611686018427387904, got a number past a "
                                     "float's range"),
    ({"model.h2d_curve": [[10 ** 400, 2.5]]}, "[0][0] (bytes) must be at most 4611686018427387904"),
    ({"model.total_memory": -10 ** 400}, "'model.total_memory' must be at least 1, got a number past a float's range"),
    # a curve is extrapolated below its first point (a smaller copy takes as long as the first
    # point's, fewer threads copy at its rate a thread): one far out made every copy on the
    # simulated GPU last billions of virtual seconds, simulated for hours of real time
    ({"model.h2d_curve": [[2 ** 62, 1.0]]}, "'model.h2d_curve'[0]: a copy of 4611686018427387904 bytes at 1 GB/s "
                                             "takes 4.6e+09 s"),
    ({"model.d2h_curve": [[10 ** 13, 1e-3], [10 ** 14, 1.0]]}, "'model.d2h_curve'[0]: a copy of"),
    ({"model.host_copy_GBps": [[2 ** 62, 1.0]]}, "'model.host_copy_GBps'[0]: 1 GB/s over 4611686018427387904 "
                                                  "threads is 2.2e-19 GB/s a thread"),
    ({"model.first_touch_GBps": [[10 ** 7, 1.0]]}, "'model.first_touch_GBps'[0]: 1 GB/s over 10000000 threads"),
    ({"model.total_memory": "141GB"}, "'model.total_memory' must be a whole number"),
    ({"model.compute_capability": [9]}, "'model.compute_capability' must be a [major, minor] pair"),
    ({"model.chaos_spread": 1.5}, "'model.chaos_spread' must be below 1"),
    ({"model.staging_GBps": [[16, -14.1]]}, "'model.staging_GBps'[0][1] (GB/s) must be a finite number more than 0"),
    ({"model.staging_GBps": [[16, "14.1"]]}, "'model.staging_GBps'[0][1] (GB/s) must be a number, got string"),
    ({"model.staging_GBps": 14.1}, "'model.staging_GBps' must be a non-empty list of [threads, GB/s] pairs"),
    ({"model.staging_GBps": [[8, 14.1], [4, 9.0]]}, "'model.staging_GBps': the threads must rise"),
    ({"model.staged_chunk_host_s": 0}, "'model.staged_chunk_host_s' must be a finite number more than 0, got 0.0"),
    ({"model.direct_chunk_host_s": -6e-5}, "'model.direct_chunk_host_s' must be a finite number more than 0"),
    ({"model.staged_chunk_host_s": "400us"}, "'model.staged_chunk_host_s' must be a number, got string"),
    ({"model.direct_chunk_host_s": float("nan")}, "'model.direct_chunk_host_s' must be a finite number"),
    ({"model.staged_chunk_host_s": 1e9}, "'model.staged_chunk_host_s' must be from 0 to 3600"),
    ({"model.scheduled_chunk_host_s": 0}, "'model.scheduled_chunk_host_s' must be a finite number more than 0"),
    ({"model.scheduled_chunk_host_s": "140us"}, "'model.scheduled_chunk_host_s' must be a number, got string"),
    ({"machine.pcie_link": "gen5"}, "'machine.pcie_link' must be null or an object"),
    ({"machine.pcie_link": {"GTps": 32.0}}, "missing field(s) machine.pcie_link.width"),
    # a PCIe link runs at most 128 GT/s a lane (PCIe 7.0), over 1 to 32 lanes in the widths PCIe has
    ({"machine.pcie_link": {"GTps": 1e300, "width": 16}}, "'machine.pcie_link' GTps must be at most 128, got 1e+300"),
    ({"machine.pcie_link": {"GTps": 256, "width": 16}}, "'machine.pcie_link' GTps must be at most 128"),
    ({"machine.pcie_link": {"GTps": 0, "width": 16}}, "'machine.pcie_link' GTps must be a finite number more than 0"),
    ({"machine.pcie_link": {"GTps": float("inf"), "width": 16}}, "'machine.pcie_link' GTps must be a finite number"),
    ({"machine.pcie_link": {"GTps": "32", "width": 16}}, "'machine.pcie_link' GTps must be a number, got string"),
    ({"machine.pcie_link": {"GTps": 32.0, "width": 3}},
     "'machine.pcie_link' width must be one of 1, 2, 4, 8, 12, 16, 32 (lanes), got 3"),
    ({"machine.pcie_link": {"GTps": 32.0, "width": 64}}, "'machine.pcie_link' width must be one of"),
    ({"machine.pcie_link": {"GTps": 32.0, "width": 0}}, "'machine.pcie_link' width must be at least 1"),
    ({"machine.pcie_link": {"GTps": 32.0, "width": 16.0}}, "'machine.pcie_link' width must be a whole number"),
    ({"machine.gpu": 5}, "'machine.gpu' must be a string or null"),
    ({"date": "yesterday"}, "'date' must be an ISO 8601 date"),
    ({"name": ""}, "'name' must be a non-empty string"),
    ({"model": [1, 2]}, "'model' must be a JSON object"),
    ({"schema_version": 8}, "written by a newer ringflow (schema_version 8"),
    ({"schema_version": "1"}, "'schema_version' must be a whole number"),
    ({"schema": "something-else"}, "not a hardware profile ('schema' is 'something-else'"),
])
def test_a_bad_field_is_named(changes, phrase):
    with pytest.raises(ProfileError) as info:
        HardwareProfile.from_json(_doc(**changes), source="p.json")
    assert phrase in str(info.value) and str(info.value).startswith("p.json: ")


@pytest.mark.parametrize("link, phrase", [((200.0, 16), "GTps must be at most 128"),
                                          ((32.0, 24), "width must be one of 1, 2, 4, 8, 12, 16, 32")])
def test_a_pcie_link_no_pcie_has_is_refused_by_the_constructor_too(link, phrase):
    with pytest.raises(ProfileError, match=f"HardwareProfile.pcie_link {phrase}"):
        dataclasses.replace(MEASURED, pcie_link=link)
    for lanes in (1, 2, 4, 8, 12, 16, 32):
        assert dataclasses.replace(MEASURED, pcie_link=(128, lanes)).pcie_link == (128.0, lanes)


@pytest.mark.parametrize("content, phrase", [
    ("", "not JSON"), ("{not json", "not JSON (Expecting property name"), ("[1, 2]", "a JSON array, not an object"),
    ("null", "a JSON null, not an object"),
    ('{"date": "x", "versions": {}, "measurements": {}}', "a ringflow doctor report, not a hardware profile"),
])
def test_a_file_that_is_no_profile_says_so(tmp_path, content, phrase):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ProfileError) as info:
        get_profile(str(path))
    assert phrase in str(info.value) and "bad.json" in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("key", ["name", "duplex_GBps", "GTps"])
def test_a_key_given_twice_is_refused_naming_it_and_the_file(tmp_path, key):
    """JSON readers keep the last of two values of one key without a word: a profile edited by
    hand with a field added rather than changed planned with whichever came last."""
    text = MEASURED.to_json()
    first = text.index(f'"{key}":')
    line_end = text.index("\n", first)
    doubled = text[:line_end] + "\n" + text[first:line_end] + text[line_end:]  # the line again, after itself
    assert doubled.count(f'"{key}":') == 2 and json.loads(doubled)  # JSON all the same
    path = tmp_path / "twice.json"
    path.write_text(doubled)
    for load in (lambda: get_profile(str(path)), lambda: rf.device("sim", profile=str(path))):
        with pytest.raises(ProfileError) as info:
            load()
        message = str(info.value)
        assert message.startswith(f"hardware profile {str(path)!r}: "), message
        assert f"'{key}' appears more than once" in message and "keep one" in message, message
    with pytest.raises(ProfileError, match=f"^p.json: key '{key}' appears more than once"):
        HardwareProfile.from_json(doubled, source="p.json")


def test_binary_missing_and_folder_files_are_refused(tmp_path):
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(ProfileError, match="not a text file"):
        get_profile(str(tmp_path / "bin.json"))
    with pytest.raises(ProfileError, match="missing.json.*cannot read it"):
        get_profile(str(tmp_path / "missing.json"))
    with pytest.raises(ProfileError, match="is a folder"):
        get_profile(tmp_path)
    (tmp_path / "big.json").write_text(" " * (2 << 20))
    with pytest.raises(ProfileError, match="too large for a profile"):
        get_profile(str(tmp_path / "big.json"))


@pytest.mark.parametrize("path", ["a\0b.json", "dir/a\0b", b"x\0.json"], ids=repr)
def test_a_path_with_a_nul_byte_is_a_profile_error_that_names_it(path):
    """It escaped as os.stat's bare ValueError, 'embedded null byte', naming no file."""
    with pytest.raises(ProfileError, match=r"hardware profile .*x00.*cannot read it \(.*null"):
        hardware.load_profile(path)
    if isinstance(path, str):
        with pytest.raises(ProfileError, match="cannot read it"):
            rf.device("sim", profile=path)


@pytest.mark.parametrize("path", [3, None, 1.5, ["p.json"]], ids=repr)
def test_load_profile_of_no_path_says_what_it_takes(path):
    """os.fspath's TypeError named no argument."""
    with pytest.raises(TypeError, match=r"load_profile: path must be a file name \(a str or os.PathLike\), got"):
        hardware.load_profile(path)


def test_constructing_a_profile_checks_it_too():
    with pytest.raises(ProfileError, match="HardwareProfile.duplex_GBps must be a finite number more than 0"):
        dataclasses.replace(H200_PCIE5, duplex_GBps=float("nan"))
    with pytest.raises(ProfileError, match="HardwareProfile.d2h_curve"):
        dataclasses.replace(H200_PCIE5, d2h_curve=())
    with pytest.raises(ProfileError, match="HardwareProfile.host_copy_GBps.0.: 1 GB/s over 1048576 threads"):
        dataclasses.replace(H200_PCIE5, host_copy_GBps=((1 << 20, 1.0),))


@pytest.mark.parametrize("first", [(1, 1e-6), (1 << 40, 1000.0)], ids=["a kB/s", "a TiB at 1 TB/s"])
def test_a_first_curve_point_within_an_hour_is_taken(first):
    """The bound on a curve's first point refuses only the absurd: a byte copied at a kB/s, or a
    tebibyte at a terabyte a second, is a profile."""
    p = dataclasses.replace(H200_PCIE5, h2d_curve=(first,), host_copy_GBps=((1 << 10, 1.0),))
    assert p.h2d_curve == (first,)


def test_a_rewritten_file_is_read_again(tmp_path):
    path = tmp_path / "p.json"
    MEASURED.save(path)
    assert get_profile(str(path)) is get_profile(str(path))  # read once while unchanged
    faster = dataclasses.replace(MEASURED, duplex_GBps=120.0)
    faster.save(path)
    os.utime(path, ns=(1, 1))  # a new modification time even on a coarse clock
    assert get_profile(str(path)).duplex_GBps == 120.0


def test_get_profile_takes_names_profiles_and_paths_only():
    assert get_profile("pcie4-x16") is PCIE4_X16 and get_profile(MEASURED) is MEASURED
    with pytest.raises(ValueError, match="unknown sim profile 'h100'.*pcie4-x16.*profile JSON file"):
        get_profile("h100")
    with pytest.raises(TypeError, match="profile must be a profile name .* got int"):
        get_profile(5)


# -- the simulated GPU on a file -----------------------------------------------------------------------------------
def test_the_simulated_gpu_runs_on_a_saved_profile(tmp_path):
    slow = dataclasses.replace(MEASURED, name="slow-link", h2d_curve=((1, 0.5), (1 << 40, 0.5)),
                               d2h_curve=((1, 0.5), (1 << 40, 0.5)), duplex_GBps=1.0)
    path = slow.save(tmp_path / "slow.json")
    dev = rf.device("sim", profile=path)
    assert dev.hardware == slow and dev.name == "simulated slow-link"
    s = dev.create_stream()
    h, d = dev.allocate_host(10**6), dev.allocate(10**6)
    t0 = dev.now
    s.copy(d, h)
    s.sync()
    assert dev.now - t0 == pytest.approx(10**6 / 0.5e9, rel=0.02)  # 1 MB at 0.5 GB/s, plus enqueue costs
    with pytest.raises(ProfileError, match="cannot read it"):
        rf.device("sim", profile=str(tmp_path / "nope.json"))


# -- the per-GPU cache ------------------------------------------------------------------------------------------------
def test_the_cache_path_honours_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert hardware.cached_profile_path("NVIDIA H200", "580.159.04") == str(
        tmp_path / "ringflow" / "profiles" / "nvidia-h200-580.159.04.json")
    assert hardware.cached_profile_path("NVIDIA GeForce RTX 4090 (x)", None).endswith(
        "nvidia-geforce-rtx-4090-x-unknown-driver.json")
    for unset in ("", "relative/cache"):  # unset, or relative (which XDG says to ignore)
        monkeypatch.setenv("XDG_CACHE_HOME", unset)
        assert hardware.cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "ringflow", "profiles")


def test_a_gpu_without_a_cached_profile_plans_with_the_h200_one_and_says_so(fresh_lookups, caplog):
    with caplog.at_level(logging.INFO, logger="ringflow"):
        assert hardware.profile_for_gpu("NVIDIA H200") is H200_PCIE5
        assert hardware.profile_for_gpu("NVIDIA H200") is H200_PCIE5
    notes = [r for r in caplog.records if "no hardware profile cached" in r.getMessage()]
    assert len(notes) == 1 and "ringflow doctor --save" in notes[0].getMessage()  # once, not per call
    assert str(fresh_lookups / "nvidia-h200-580.159.04.json") in notes[0].getMessage()


def test_a_gpu_plans_with_the_profile_cached_for_its_model_and_driver(fresh_lookups):
    fresh_lookups.mkdir(parents=True)
    MEASURED.save(fresh_lookups / "nvidia-h200-580.159.04.json")
    assert hardware.profile_for_gpu("NVIDIA H200") == MEASURED
    assert hardware.profile_for_gpu("NVIDIA H200", "570.1") is H200_PCIE5  # another driver: not that file
    assert hardware.profile_for_gpu("NVIDIA H100") is H200_PCIE5  # another model neither
    # Device.hardware of a real GPU is this lookup by its name
    assert Device.hardware.fget(types.SimpleNamespace(name="NVIDIA H200")) == MEASURED


def test_a_profile_saved_after_the_first_lookup_is_used(fresh_lookups):
    assert hardware.profile_for_gpu("NVIDIA H200") is H200_PCIE5
    fresh_lookups.mkdir(parents=True)
    MEASURED.save(fresh_lookups / "nvidia-h200-580.159.04.json")
    assert hardware.profile_for_gpu("NVIDIA H200") == MEASURED


def test_a_corrupt_cached_profile_is_a_warning_and_the_h200_profile(fresh_lookups, caplog):
    fresh_lookups.mkdir(parents=True)
    (fresh_lookups / "nvidia-h200-580.159.04.json").write_text('{"schema": "ringflow-hardware-profile"')
    with caplog.at_level(logging.INFO, logger="ringflow"):
        assert hardware.profile_for_gpu("NVIDIA H200") is H200_PCIE5
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "not JSON" in warning.getMessage() and "nvidia-h200-580.159.04.json" in warning.getMessage()


def test_a_cached_profile_of_another_gpu_is_a_warning_and_the_h200_profile(fresh_lookups, caplog):
    """A profile measured on an H100 that sits at the H200's cache path (copied there, or left by
    another machine) is not planned with: the warning names the file, both GPUs and what to do,
    once however often the GPU asks, as for a cached file that cannot be read."""
    fresh_lookups.mkdir(parents=True)
    path = fresh_lookups / "nvidia-h200-580.159.04.json"
    dataclasses.replace(MEASURED, gpu_name="NVIDIA H100").save(path)
    with caplog.at_level(logging.INFO, logger="ringflow"):
        assert hardware.profile_for_gpu("NVIDIA H200") is H200_PCIE5
        assert hardware.profile_for_gpu("NVIDIA H200") is H200_PCIE5
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    text = warning.getMessage()
    assert str(path) in text and "NVIDIA H100" in text and "NVIDIA H200" in text
    assert "ringflow doctor --save" in text and "delete" in text


def test_a_cached_profile_of_another_driver_is_a_warning_and_the_h200_profile(fresh_lookups, caplog):
    fresh_lookups.mkdir(parents=True)
    path = fresh_lookups / "nvidia-h200-580.159.04.json"
    dataclasses.replace(MEASURED, driver="570.86.10").save(path)
    with caplog.at_level(logging.INFO, logger="ringflow"):
        assert hardware.profile_for_gpu("NVIDIA H200") is H200_PCIE5
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    text = warning.getMessage()
    assert str(path) in text and "570.86.10" in text and "580.159.04" in text


def test_a_cached_profile_that_records_no_driver_is_used(fresh_lookups):
    fresh_lookups.mkdir(parents=True)
    unrecorded = dataclasses.replace(MEASURED, driver=None)
    unrecorded.save(fresh_lookups / "nvidia-h200-580.159.04.json")
    assert hardware.profile_for_gpu("NVIDIA H200") == unrecorded


def test_a_profile_of_another_gpu_given_by_its_file_is_used(tmp_path, capsys):
    """Naming a profile file asks what a job would do on the machine it was measured on: one
    measured on another GPU is that machine's model, not a mistake."""
    from ringflow._cli import main

    h100 = dataclasses.replace(MEASURED, name="nvidia-h100-580.159.04", gpu_name="NVIDIA H100")
    path = h100.save(tmp_path / "h100.json")
    assert rf.device("sim", profile=path).hardware == h100
    assert main(["plan", "--bytes", "256MiB", "--pinned", "--profile", path]) == 0
    assert "measured on NVIDIA H100" in capsys.readouterr().out


def test_calibrating_on_first_use_is_opt_in(fresh_lookups, monkeypatch):
    from ringflow import _doctor

    calls = []

    def fake_calibrate(dev, path):
        calls.append((dev, path))
        MEASURED.save(path)
        return MEASURED

    monkeypatch.setattr(_doctor, "calibrate", fake_calibrate)
    gpu = object()
    assert hardware.profile_for_gpu("NVIDIA H200", device=gpu) is H200_PCIE5  # not asked for: no measuring
    assert calls == []
    monkeypatch.setattr(hardware, "_for_gpu", {})
    monkeypatch.setenv(hardware.CALIBRATE_VAR, "1")
    fresh_lookups.mkdir(parents=True)
    assert hardware.profile_for_gpu("NVIDIA H200", device=gpu) == MEASURED
    assert hardware.profile_for_gpu("NVIDIA H200", device=gpu) == MEASURED
    assert calls == [(gpu, str(fresh_lookups / "nvidia-h200-580.159.04.json"))]  # measured once


# -- the PCIe Gen4 profile --------------------------------------------------------------------------------------------
def test_the_gen4_profile_halves_the_link_and_keeps_the_rest():
    g5, g4 = H200_PCIE5, PCIE4_X16
    assert g4.pcie_link == (16.0, 16) and g5.pcie_link == (32.0, 16)
    for curve in ("h2d_curve", "d2h_curve"):
        assert getattr(g4, curve) == tuple((n, r / 2) for n, r in getattr(g5, curve))
    for n in (4 << 10, 3 << 20, 100 << 20, 1 << 30):  # between and beyond the points too
        assert g4.copy_GBps("h2d", n) == pytest.approx(g5.copy_GBps("h2d", n) / 2)
    assert g4.duplex_GBps == g5.duplex_GBps / 2
    # pageable: the host's share of the Gen5 time kept, the link's doubled
    host_s = 1 / 15.9 - 1 / 54.8
    assert g4.pageable_h2d_GBps == pytest.approx(1 / (host_s + 2 / 54.8))
    for name in ("launch_overhead_s", "copy_overhead_s", "event_overhead_s", "host_task_overhead_s"):
        assert getattr(g4, name) == pytest.approx(getattr(g5, name) * 1.25)
    for name in ("device_GBps", "kernel_min_s", "host_copy_GBps", "register_GBps", "register_fresh_GBps",
                 "unregister_GBps", "first_touch_GBps", "staging_GBps", "async_engine_count", "sm_count",
                 "compute_capability", "total_memory"):
        assert getattr(g4, name) == getattr(g5, name), name


def test_the_gen4_profile_runs_copies_at_half_speed_on_the_simulated_gpu():
    seconds = {}
    for name in ("h200-pcie5", "pcie4-x16"):
        dev = rf.device("sim", profile=name)
        s = dev.create_stream()
        h, d = dev.allocate_host(64 << 20), dev.allocate(64 << 20)
        h.view(np.uint8)[:] = 7
        s.sync()
        e0 = s.record(timing=True)
        s.copy(d, h)
        e1 = s.record(timing=True)
        e1.sync()
        seconds[name] = e1.elapsed_since(e0)
    # the span also holds the host's time to enqueue the copy, which the Gen4 host takes longer over
    link = {name: seconds[name] - get_profile(name).copy_overhead_s for name in seconds}
    assert link["pcie4-x16"] == pytest.approx(2 * link["h200-pcie5"], rel=1e-9)


def test_a_failed_calibration_is_a_warning_and_the_h200_profile(fresh_lookups, monkeypatch, caplog):
    from ringflow import _doctor

    def broken(dev, path):
        raise OSError(28, "No space left on device", path)

    monkeypatch.setattr(_doctor, "calibrate", broken)
    monkeypatch.setenv(hardware.CALIBRATE_VAR, "1")
    with caplog.at_level(logging.INFO, logger="ringflow"):
        assert hardware.profile_for_gpu("NVIDIA H200", device=object()) is H200_PCIE5
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "measuring NVIDIA H200's hardware profile failed" in warning.getMessage()
    assert "No space left on device" in warning.getMessage()


def test_a_profile_file_rewritten_again_and_again_is_remembered_once(tmp_path):
    """A file is read again when it changes; each version was kept for the life of the process,
    so a profile rewritten in a loop (a calibration that saves as it goes) grew without bound."""
    import os

    path = tmp_path / "p.json"
    base = get_profile("unit")
    before = len(hardware._loaded)
    for k in range(5):
        hardware.save_profile(dataclasses.replace(base, name=f"unit-{k}"), path)
        os.utime(path, ns=(k * 10**9, k * 10**9))  # a new time even where the clock's grain is coarse
        assert hardware.load_profile(path).name == f"unit-{k}"
    assert len(hardware._loaded) - before == 1


def _rewrite_keeping_size_and_time(path, profile):
    """Save ``profile`` over ``path`` (a new file moved over it), then give it the old file's
    modification time back, as ``cp -p`` or a clock's coarse grain would; the size must match."""
    before = os.stat(path)
    profile.save(path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def test_a_file_replaced_by_one_of_the_same_size_and_time_is_read_again(tmp_path):
    """A file was known by its modification time and size only: a same-size profile saved over it
    within one tick of the clock (or with its time kept) was answered with the old profile."""
    path = tmp_path / "p.json"
    MEASURED.save(path)
    assert hardware.load_profile(path) == MEASURED
    other = dataclasses.replace(MEASURED, launch_overhead_s=7.5e-6)
    _rewrite_keeping_size_and_time(path, other)
    assert hardware.load_profile(path) == other


def test_a_cached_profile_replaced_by_one_of_the_same_size_and_time_is_used(fresh_lookups):
    fresh_lookups.mkdir(parents=True)
    path = fresh_lookups / "nvidia-h200-580.159.04.json"
    MEASURED.save(path)
    assert hardware.profile_for_gpu("NVIDIA H200") == MEASURED
    other = dataclasses.replace(MEASURED, launch_overhead_s=7.5e-6)
    _rewrite_keeping_size_and_time(path, other)
    assert hardware.profile_for_gpu("NVIDIA H200") == other


def test_a_profile_saved_with_a_byte_order_mark_is_read(tmp_path):
    """An editor that saves UTF-8 with a byte order mark first (Notepad, PowerShell) left a file
    refused as "not JSON (Unexpected UTF-8 BOM (decode using utf-8-sig))", advice for a programmer."""
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + MEASURED.to_json().encode("utf-8"))
    assert get_profile(str(path)) == MEASURED


@pytest.mark.parametrize("marks, found", [(1, "one byte order mark"), (2, "two byte order marks")])
def test_a_profile_text_that_starts_with_byte_order_marks_is_refused_saying_how_many(marks, found, tmp_path):
    """A str given to from_json is the text itself, no decoding having skipped a mark: the
    message counts the marks it holds (one was called "two"), where a file's counts the file's."""
    with pytest.raises(ProfileError) as info:
        HardwareProfile.from_json("\ufeff" * marks + MEASURED.to_json(), source="p")
    assert f"the text starts with {found}" in str(info.value), info.value
    path = tmp_path / "marks.json"
    path.write_bytes(b"\xef\xbb\xbf" * (marks + 1) + MEASURED.to_json().encode("utf-8"))
    with pytest.raises(ProfileError) as info:
        hardware.load_profile(path)
    assert f"the file starts with {['two', '3'][marks - 1]} byte order marks" in str(info.value), info.value


def test_a_profile_of_schema_version_1_is_read_without_a_staging_rate():
    """Version 1 files were written before the staging rate was measured: read, with none."""
    data = hardware.H200_PCIE5.to_dict()
    data["schema_version"] = 1
    del data["model"]["staging_GBps"], data["model"]["staged_chunk_host_s"], data["model"]["direct_chunk_host_s"]
    del data["model"]["scheduled_chunk_host_s"], data["model"]["register_call_s"], data["model"]["one_side_chunk_host_s"]
    p = HardwareProfile.from_dict(data)
    assert p.staging_GBps is None
    assert dataclasses.replace(p, staging_GBps=hardware.H200_PCIE5.staging_GBps) == hardware.H200_PCIE5
    data["model"]["staging_GBps"] = [[16, 15.5]]  # not a field version 1 had
    with pytest.raises(ProfileError, match=r"unknown field\(s\) model.staging_GBps"):
        HardwareProfile.from_dict(data)


def test_a_profile_of_schema_version_2_is_read_with_its_one_staging_rate_for_any_threads():
    """Version 2 held one staging rate, measured with the most threads, and planned with it for
    any number of threads (each thread's memcpy rate still a cap): read as that, so a file of
    version 2 plans as it did."""
    data = hardware.H200_PCIE5.to_dict()
    data["schema_version"] = 2
    data["model"]["staging_GBps"] = 13.4
    for field in ("staged_chunk_host_s", "direct_chunk_host_s", "scheduled_chunk_host_s", "register_call_s",
                  "one_side_chunk_host_s"):
        del data["model"][field]
    p = HardwareProfile.from_dict(data)
    assert p.staging_GBps == ((1, 13.4),)
    assert [p.staging_rate(t) for t in (1, 4, 16, 64)] == [13.4] * 4
    assert p.staging_copy_rate(1) == p.host_copy_rate(1) and p.staging_copy_rate(16) == 2 * 13.4
    data["model"]["staging_GBps"] = None  # not measured: said so
    assert HardwareProfile.from_dict(data).staging_GBps is None
    data["model"]["staging_GBps"] = [[16, 13.4]]  # a curve is version 3's
    with pytest.raises(ProfileError, match=r"'model.staging_GBps' must be a number, got array"):
        HardwareProfile.from_dict(data)
    del data["model"]["staging_GBps"]
    with pytest.raises(ProfileError, match=r"missing field\(s\) model.staging_GBps"):
        HardwareProfile.from_dict(data)


def test_a_profile_of_schema_version_3_holds_its_staging_curve_or_null():
    data = hardware.H200_PCIE5.to_dict()
    data["schema_version"] = 3
    for field in ("staged_chunk_host_s", "direct_chunk_host_s", "scheduled_chunk_host_s", "register_call_s",
                  "one_side_chunk_host_s"):
        del data["model"][field]
    assert data["model"]["staging_GBps"] == [list(p) for p in hardware.H200_PCIE5.staging_GBps]
    assert HardwareProfile.from_dict(data) == hardware.H200_PCIE5
    data["model"]["staging_GBps"] = None  # not measured: said so
    assert HardwareProfile.from_dict(data).staging_GBps is None
    del data["model"]["staging_GBps"]
    with pytest.raises(ProfileError, match=r"missing field\(s\) model.staging_GBps"):
        HardwareProfile.from_dict(data)


def test_a_profile_of_schema_version_4_holds_the_hosts_time_per_chunk_or_null():
    """Version 4 added the host's measured time per chunk of each engine; a file of version 3 is
    read with it unknown (the planner then uses its fit), and one of version 4 must say it."""
    data = MEASURED.to_dict()
    data["schema_version"] = 4
    del data["model"]["scheduled_chunk_host_s"], data["model"]["register_call_s"], data["model"]["one_side_chunk_host_s"]
    assert (data["model"]["staged_chunk_host_s"], data["model"]["direct_chunk_host_s"]) == (455e-6, 52e-6)
    assert HardwareProfile.from_dict(data) == dataclasses.replace(MEASURED, scheduled_chunk_host_s=None,
                                                                  register_call_s=None)
    assert H200_PCIE5.to_dict()["model"]["staged_chunk_host_s"] is None  # built in: the planner's fit
    older = json.loads(json.dumps(data))
    older["schema_version"] = 3
    with pytest.raises(ProfileError, match=r"unknown field\(s\) model.direct_chunk_host_s, model.staged_chunk_host_s"):
        HardwareProfile.from_dict(older)
    del older["model"]["staged_chunk_host_s"], older["model"]["direct_chunk_host_s"]
    read = HardwareProfile.from_dict(older)
    assert (read.staged_chunk_host_s, read.direct_chunk_host_s) == (None, None)
    assert read == dataclasses.replace(MEASURED, staged_chunk_host_s=None, direct_chunk_host_s=None,
                                       scheduled_chunk_host_s=None, register_call_s=None)
    del data["model"]["direct_chunk_host_s"]
    with pytest.raises(ProfileError, match=r"missing field\(s\) model.direct_chunk_host_s"):
        HardwareProfile.from_dict(data)


def test_a_profile_of_schema_version_5_holds_the_schedulers_unstaged_time_per_chunk_or_null(tmp_path):
    """Version 5 added the scheduler's time per chunk on pinned memory (scheduled_chunk_host_s); a
    file of version 4 is read with it unknown, planned with the scheduler's fit, its other
    measured figures kept; one of version 5 must say it."""
    from ringflow import _plan as plan

    data = MEASURED.to_dict()
    data["schema_version"] = 5
    del data["model"]["register_call_s"], data["model"]["one_side_chunk_host_s"]
    assert data["model"]["scheduled_chunk_host_s"] == 131e-6
    assert HardwareProfile.from_dict(data) == dataclasses.replace(MEASURED, register_call_s=None)
    assert H200_PCIE5.to_dict()["model"]["scheduled_chunk_host_s"] is None  # built in: the planner's fit
    older = json.loads(json.dumps(data))
    older["schema_version"] = 4
    with pytest.raises(ProfileError, match=r"unknown field\(s\) model.scheduled_chunk_host_s"):
        HardwareProfile.from_dict(older)
    del older["model"]["scheduled_chunk_host_s"]
    path = tmp_path / "v4.json"
    path.write_text(json.dumps(older))
    read = hardware.load_profile(path)
    assert read == dataclasses.replace(MEASURED, scheduled_chunk_host_s=None, register_call_s=None)
    assert plan.host_seconds_per_chunk(read, False, scheduler=True) == plan.SCHEDULER_S_PER_CHUNK
    assert plan.host_seconds_per_chunk(read, False) == 52e-6 and plan.host_seconds_per_chunk(read, True) == 455e-6
    assert plan.host_seconds_per_chunk(MEASURED, False, scheduler=True) == 131e-6
    del data["model"]["scheduled_chunk_host_s"]
    with pytest.raises(ProfileError, match=r"missing field\(s\) model.scheduled_chunk_host_s"):
        HardwareProfile.from_dict(data)


def test_a_profile_of_schema_version_6_holds_the_fixed_cost_of_a_registration_or_null():
    """Version 6 added a registration's fixed cost (register_call_s); a file of version 5 is read
    with it unknown, so the planner counts registration by its bytes alone, as before; one of
    version 6 must say it."""
    from ringflow import _plan as plan

    data = MEASURED.to_dict()
    assert data["schema_version"] == hardware.SCHEMA_VERSION
    assert data["model"]["register_call_s"] == 24e-6
    assert HardwareProfile.from_dict(data) == MEASURED
    assert H200_PCIE5.to_dict()["model"]["register_call_s"] is None  # built in: not measured
    older = json.loads(json.dumps(data))
    older["schema_version"] = 5
    del older["model"]["one_side_chunk_host_s"]  # (version 7's)
    with pytest.raises(ProfileError, match=r"unknown field\(s\) model.register_call_s"):
        HardwareProfile.from_dict(older)
    del older["model"]["register_call_s"]
    read = HardwareProfile.from_dict(older)
    assert read == dataclasses.replace(MEASURED, register_call_s=None)
    job = dict(workers=4, out_is_fresh=False, chunk_bytes=64 << 10)
    both = plan.choose_host_strategy(MEASURED, 64 << 10, 64 << 10, **job)
    assert both.register_s - plan.choose_host_strategy(read, 64 << 10, 64 << 10, **job).register_s == (
        pytest.approx(2 * 24e-6))  # one registration a side
    one = plan.choose_host_strategy(MEASURED, 64 << 10, 64 << 10, pinned=(True, False), **job)
    assert one.register_s - plan.choose_host_strategy(read, 64 << 10, 64 << 10, pinned=(True, False),
                                                      **job).register_s == pytest.approx(24e-6)
    for bad, says in ((0, "a finite number more than 0"), ("24us", "a number, got string")):
        data["model"]["register_call_s"] = bad
        with pytest.raises(ProfileError, match=f"'model.register_call_s' must be {says}"):
            HardwareProfile.from_dict(data)
    del data["model"]["register_call_s"]
    with pytest.raises(ProfileError, match=r"missing field\(s\) model.register_call_s"):
        HardwareProfile.from_dict(data)


def test_the_staging_curve_is_read_by_threads_and_its_fastest_point_is_the_floor():
    p = dataclasses.replace(hardware.H200_PCIE5, staging_GBps=((1, 4.0), (4, 8.0), (16, 16.0)))
    assert [p.staging_rate(t) for t in (1, 4, 64)] == pytest.approx([4.0, 8.0, 16.0])
    assert p.staging_rate(8) == pytest.approx(8.0 * 2 ** 0.5)  # log-log between points
    assert p.staging_floor_rate() == 16.0
    assert p.staging_copy_rate(4) == min(p.host_copy_rate(4), 2 * p.staging_rate(4))
    dipping = dataclasses.replace(p, staging_GBps=((4, 9.0), (16, 7.0)))  # more threads, less: a floor is the best
    assert dipping.staging_floor_rate() == 9.0 and dipping.staging_rate(2) == 4.5
    assert dataclasses.replace(p, staging_GBps=None).staging_floor_rate() is None


def test_a_file_rewritten_in_place_with_its_size_and_time_kept_is_read_again(tmp_path):
    """``cp -p`` onto an existing profile writes into the same inode and then sets the old
    modification time back: device, inode, size and time all as before. The change time, which
    no one can set back, tells it apart."""
    path = tmp_path / "p.json"
    MEASURED.save(path)
    assert hardware.load_profile(path) == MEASURED
    other = dataclasses.replace(MEASURED, launch_overhead_s=7.5e-6)
    before = os.stat(path)
    text = other.to_json().encode()
    assert len(text) == before.st_size
    while True:  # (until the change time moves: its clock may tick coarser than the write takes)
        with open(path, "r+b") as fh:  # in place: the same inode
            fh.write(text)
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        after = os.stat(path)
        if after.st_ctime_ns != before.st_ctime_ns:
            break
    assert (after.st_dev, after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_dev, before.st_ino, before.st_size, before.st_mtime_ns)
    assert hardware.load_profile(path) == other


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("kind", ["folder", "pipe"])
def test_a_cached_entry_that_is_no_file_is_a_warning_that_says_to_remove_it(fresh_lookups, caplog, kind):
    """A folder or a pipe at the cache path was warned about with "Run `ringflow doctor --save`
    on this GPU to measure it again, or delete that file", after load_profile's own advice to give
    a profile file inside the folder: doctor --save cannot write over either (it fails with "Is a
    directory" or "not a regular file"), so the advice left the warning on every run."""
    fresh_lookups.mkdir(parents=True)
    path = fresh_lookups / "nvidia-h200-580.159.04.json"
    if kind == "folder":
        path.mkdir()
    else:
        os.mkfifo(path)
    with caplog.at_level(logging.INFO, logger="ringflow"):
        assert hardware.profile_for_gpu("NVIDIA H200") is H200_PCIE5
        assert hardware.profile_for_gpu("NVIDIA H200") is H200_PCIE5
    (text,) = _warnings(caplog)
    assert str(path) in text and "not a file" in text and "remove it" in text, text
    assert "inside it" not in text and "delete that file" not in text, text
    with pytest.raises(OSError):
        MEASURED.save(path)  # why removing it comes first



@pytest.mark.parametrize("kind", ["dangling", "loop"])
def test_a_cached_link_that_leads_to_no_file_is_a_warning_not_a_missing_profile(fresh_lookups, caplog,
                                                                                monkeypatch, kind):
    """A symbolic link at the cache path that leads nowhere (its target deleted or on a share
    not mounted) or round in a loop was taken for no cached profile: an INFO note that the
    default logging hides, and with RINGFLOW_CALIBRATE=1 a measurement saved over the link."""
    from ringflow import _doctor

    fresh_lookups.mkdir(parents=True)
    path = fresh_lookups / "nvidia-h200-580.159.04.json"
    if kind == "dangling":
        path.symlink_to(fresh_lookups / "gone.json")
    else:
        path.symlink_to(path)
    calls = []
    monkeypatch.setattr(_doctor, "calibrate", lambda dev, where: calls.append(where))
    monkeypatch.setenv(hardware.CALIBRATE_VAR, "1")
    with caplog.at_level(logging.INFO, logger="ringflow"):
        assert hardware.profile_for_gpu("NVIDIA H200", device=object()) is H200_PCIE5
        assert hardware.profile_for_gpu("NVIDIA H200", device=object()) is H200_PCIE5
    (text,) = _warnings(caplog)
    assert str(path) in text and "cannot read it" in text and "ringflow doctor --save" in text, text
    assert calls == [] and path.is_symlink()  # the link is the user's: nothing measured over it
    path.unlink()
    MEASURED.save(path)  # what the warning says to do
    assert hardware.profile_for_gpu("NVIDIA H200") == MEASURED


def test_a_profile_of_schema_version_7_holds_the_one_side_host_time_or_null():
    """Version 7 added the scheduler's host time per chunk staging one side
    (one_side_chunk_host_s); a file of version 6 is read with it unknown, and the planner derives
    the one-side figure from the staged and unstaged ones as before; where it is measured, the
    planner takes it, for either side."""
    from ringflow import _plan as plan

    data = MEASURED.to_dict()
    assert data["schema_version"] == 7 == hardware.SCHEMA_VERSION
    assert data["model"]["one_side_chunk_host_s"] is None and H200_PCIE5.to_dict()["model"]["one_side_chunk_host_s"] is None
    measured = dataclasses.replace(MEASURED, one_side_chunk_host_s=402e-6)
    data = measured.to_dict()
    assert data["model"]["one_side_chunk_host_s"] == 402e-6 and HardwareProfile.from_dict(data) == measured
    older = json.loads(json.dumps(data))
    older["schema_version"] = 6
    with pytest.raises(ProfileError, match=r"unknown field\(s\) model.one_side_chunk_host_s"):
        HardwareProfile.from_dict(older)
    del older["model"]["one_side_chunk_host_s"]
    assert HardwareProfile.from_dict(older) == MEASURED
    for sides in ((True, False), (False, True)):
        assert plan.host_seconds_per_chunk(measured, sides) == 402e-6
        assert plan.host_seconds_per_chunk(MEASURED, sides) == pytest.approx(
            (MEASURED.staged_chunk_host_s + MEASURED.scheduled_chunk_host_s) / 2)
    for bad, says in ((0, "a finite number more than 0"), ("402us", "a number, got string")):
        data["model"]["one_side_chunk_host_s"] = bad
        with pytest.raises(ProfileError, match=f"'model.one_side_chunk_host_s' must be {says}"):
            HardwareProfile.from_dict(data)
