"""ringflow.device(): the spec forms, RINGFLOW_DEVICE, the 'auto' fallback warning, and the
errors for every misspelt spec or option. CI has no GPU: the cuda:N paths run against a
monkeypatched probe."""

from __future__ import annotations

import dataclasses
import importlib
import logging
import warnings

import numpy as np
import pytest

import ringflow as rf
from ringflow import _device

FORMS = ("'auto'", "'cuda'", "cuda:N", "'sim'")


@pytest.fixture
def no_gpu(monkeypatch):
    """CUDA unusable for a known reason, the one-time warning not yet given, no RINGFLOW_DEVICE."""
    monkeypatch.setattr(_device, "cuda_available", lambda: (False, "cuda.core is not installed; pip install X"))
    monkeypatch.setattr(_device, "_gpu_count", lambda: 0)
    monkeypatch.setattr(_device, "_fallback_warned", False)
    monkeypatch.delenv("RINGFLOW_DEVICE", raising=False)


class FakeCuda:
    """Stands in for CudaDevice: records how the factory built it."""

    made: list = []

    def __init__(self, index=0, **options):
        FakeCuda.made.append((index, options))
        self.backend = "cuda"


@pytest.fixture
def two_gpus(monkeypatch):
    """A machine with two usable GPUs, as far as the factory can tell."""
    import ringflow._device.cuda as cuda_pkg

    monkeypatch.setattr(_device, "cuda_available", lambda: (True, "2 CUDA GPU(s); cuda:0 is Fake"))
    monkeypatch.setattr(_device, "_gpu_count", lambda: 2)
    monkeypatch.setattr(cuda_pkg, "CudaDevice", FakeCuda)
    FakeCuda.made = []
    monkeypatch.delenv("RINGFLOW_DEVICE", raising=False)


# -- the package logger ---------------------------------------------------------------------------------------------
def test_the_package_logger_has_only_a_null_handler():
    handlers = logging.getLogger("ringflow").handlers
    assert len(handlers) == 1 and isinstance(handlers[0], logging.NullHandler)
    assert _device.logger.name.startswith("ringflow.")  # its records reach the package logger


# -- RINGFLOW_DEVICE and None ---------------------------------------------------------------------------------------
def test_no_argument_reads_the_environment(no_gpu, monkeypatch):
    monkeypatch.setenv("RINGFLOW_DEVICE", "sim")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an explicit "sim" gives no fallback warning
        assert rf.device().backend == "sim"
        assert rf.device(None).backend == "sim"


def test_a_bad_environment_value_names_the_variable(no_gpu, monkeypatch):
    monkeypatch.setenv("RINGFLOW_DEVICE", "gpu")
    with pytest.raises(ValueError, match="RINGFLOW_DEVICE") as info:
        rf.device()
    assert all(f in str(info.value) for f in FORMS)


@pytest.mark.parametrize("value, parsed", [(" sim", ("sim", None)), ("sim ", ("sim", None)),
                                           ("\tsim:3\n", ("sim", 3)), (" cuda:2 ", ("cuda", 2))])
def test_spaces_around_a_spec_are_dropped_alike_from_the_argument_and_the_environment(no_gpu, monkeypatch, value,
                                                                                       parsed):
    """One spec, one answer: ``RINGFLOW_DEVICE=" sim"`` made a simulated GPU while ``device(" sim")``
    (and ``--device " sim"``) refused it."""
    assert _device.parse_spec(value) == parsed
    monkeypatch.setenv("RINGFLOW_DEVICE", value)
    assert _device.parse_spec(None) == parsed
    if parsed == ("sim", None):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a simulated GPU asked for: no fallback warning
            assert rf.device(value).backend == "sim" and rf.device().backend == "sim"
    with pytest.raises(ValueError, match="an empty string"):  # only spaces: no spec at all
        rf.device(" \t")


def test_an_explicit_spec_wins_over_the_environment(no_gpu, monkeypatch):
    monkeypatch.setenv("RINGFLOW_DEVICE", "cuda:abc")
    assert rf.device("sim").backend == "sim"


def test_unset_environment_means_auto(no_gpu):
    with pytest.warns(RuntimeWarning):
        assert rf.device().backend == "sim"


@pytest.mark.parametrize("entry", ["pipeline", "stream_map"])
def test_pipeline_and_stream_map_pass_none_to_the_factory(no_gpu, monkeypatch, entry):
    def f(x, y):
        y[:] = x

    x = np.arange(64, dtype=np.float32)
    monkeypatch.setenv("RINGFLOW_DEVICE", "cuda:abc")  # proves the environment is read
    with pytest.raises(ValueError, match="RINGFLOW_DEVICE"):
        if entry == "pipeline":
            rf.Pipeline(f, chunk_bytes=256)
        else:
            rf.stream_map(f, x, chunk_bytes=256)
    monkeypatch.setenv("RINGFLOW_DEVICE", "sim")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        if entry == "pipeline":
            with rf.Pipeline(f, chunk_bytes=256) as pipe:
                assert pipe.device.backend == "sim"
        else:
            assert np.array_equal(rf.stream_map(f, x, chunk_bytes=256), x)


# -- the 'auto' fallback --------------------------------------------------------------------------------------------
def test_auto_fallback_warns_once_with_the_reason_and_logs_every_time(no_gpu, caplog):
    caplog.set_level(logging.INFO, logger="ringflow")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # the once-only rule must be ringflow's, not the filter's
        assert rf.device("auto").backend == "sim"
        assert rf.device("auto").backend == "sim"
        assert rf.device().backend == "sim"
    fallback = [w for w in seen if issubclass(w.category, RuntimeWarning)]
    assert len(fallback) == 1
    text = str(fallback[0].message)
    assert "cuda.core is not installed; pip install X" in text  # why
    assert "device('sim')" in text and "RINGFLOW_DEVICE=sim" in text  # how to silence it
    # (the variable names the device of device() alone: an explicit device('auto') is not it)
    assert "ringflow.device() with RINGFLOW_DEVICE=sim set" in text
    assert fallback[0].filename == __file__  # points at the caller's line, not ringflow's
    records = [r for r in caplog.records if r.name.startswith("ringflow") and "simulated GPU" in r.getMessage()]
    assert len(records) == 3 and all(r.levelno == logging.INFO for r in records)


def test_auto_with_a_gpu_gives_cuda_0_without_a_warning(two_gpus):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rf.device("auto", array="dlpack", profile="unit").backend == "cuda"
    assert FakeCuda.made == [(0, {"array": "dlpack"})]  # sim options are not passed to the GPU


# -- cuda:N ---------------------------------------------------------------------------------------------------------
def test_cuda_index_beyond_the_gpus_names_the_count(two_gpus):
    with pytest.raises(ValueError, match="cuda:7") as info:
        rf.device("cuda:7")
    assert "2 CUDA GPU(s)" in str(info.value) and "cuda:0..cuda:1" in str(info.value)
    assert FakeCuda.made == []


def test_cuda_index_within_the_gpus_builds_that_gpu(two_gpus):
    assert rf.device("cuda:1", array="torch").backend == "cuda"
    assert rf.device("cuda").backend == "cuda"
    assert FakeCuda.made == [(1, {"array": "torch"}), (0, {})]


def test_cuda_without_cuda_is_a_ringflow_error_and_a_runtime_error(no_gpu):
    with pytest.raises(rf.RingflowError, match="not usable") as info:
        rf.device("cuda:0")
    assert isinstance(info.value, RuntimeError)
    assert "pip install X" in str(info.value) and "device('sim')" in str(info.value)


def test_gpu_count_is_zero_when_cuda_is_not_usable():
    cuda_probe = importlib.import_module("ringflow._device.cuda.probe")
    ok, _ = cuda_probe.probe()
    if ok:
        assert cuda_probe.gpu_count() >= 1
    else:
        assert cuda_probe.gpu_count() == 0


# -- misspelt specs and options -------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["", " ", "cuda:-1", "cuda:abc", "cuda:", "cuda: 1", "cuda:1.0", "cuda:١",
                                  "sim:x", "sim:-1", "sim:", "simulated", "CUDA", "gpu7", "auto:0"])
def test_bad_spec_is_a_value_error_naming_the_argument_and_the_forms(no_gpu, spec):
    with pytest.raises(ValueError, match="unknown device") as info:
        rf.device(spec)
    msg = str(info.value)
    assert repr(spec) in msg and "spec argument" in msg
    assert all(f in msg for f in FORMS)


@pytest.mark.parametrize("spec", [3, 0, b"sim", ["sim"], 1.5])
def test_non_string_spec_is_a_type_error(spec):
    with pytest.raises(TypeError, match="spec must be a string") as info:
        rf.device(spec)
    assert type(spec).__name__ in str(info.value)


@pytest.mark.parametrize("spec, bad, accepted", [
    ("sim", "profle", "profile, seed, chaos, checked"),
    ("sim", "array", "profile, seed, chaos, checked"),
    ("auto", "sead", "profile, seed, chaos, checked, array"),
])
def test_unknown_option_is_a_type_error_naming_it_and_the_accepted_ones(no_gpu, spec, bad, accepted):
    with pytest.raises(TypeError, match=f"'{bad}'") as info:
        rf.device(spec, **{bad: "x"})
    assert accepted in str(info.value)


def test_unknown_cuda_option_is_refused_before_touching_the_gpu(two_gpus):
    with pytest.raises(TypeError, match="'profile'.*accepts array"):
        rf.device("cuda:0", profile="unit")
    assert FakeCuda.made == []


def test_parse_spec_forms(no_gpu, monkeypatch):
    assert _device.parse_spec("auto") == ("auto", None)
    assert _device.parse_spec("sim") == ("sim", None)
    assert _device.parse_spec("cuda") == ("cuda", 0)
    assert _device.parse_spec("cuda:12") == ("cuda", 12)
    assert _device.parse_spec(None) == ("auto", None)
    monkeypatch.setenv("RINGFLOW_DEVICE", " cuda:3 ")
    assert _device.parse_spec(None) == ("cuda", 3)


def test_a_named_simulated_gpu_takes_its_options_again_as_defaults_or_spelled_out():
    """The options a named simulated GPU is asked for again are compared once the defaults are
    filled in: seed=0 is what a device made with no options has."""
    first = rf.device("sim:41")
    try:
        assert rf.device("sim:41", seed=0) is first
        assert rf.device("sim:41", seed=np.int64(0), chaos=np.bool_(False), checked=True,
                         profile="h200-pcie5") is first
        assert rf.device("sim:41", profile=first.profile) is first
        with pytest.raises(ValueError, match="sim:41.*exists already"):
            rf.device("sim:41", seed=1)
        with pytest.raises(ValueError, match="sim:41.*exists already"):
            rf.device("sim:41", profile="unit")
    finally:
        first.close()
    other = rf.device("sim:42", seed=3, chaos=True)
    try:
        assert rf.device("sim:42", chaos=True, seed=3, checked=True) is other
        with pytest.raises(ValueError, match="sim:42.*exists already, made with options"):
            rf.device("sim:42", seed=3)  # chaos=False by default: another device
    finally:
        other.close()


def test_a_named_simulated_gpu_made_from_a_profile_file_is_compared_by_the_profile_it_was_made_with(tmp_path):
    """A named simulated GPU made from a profile file, asked for again once the file changed: the
    options were compared by reading the file again, so the same path gave the device planning
    with the old profile without a word, the profile it holds was refused as another, and a file
    since removed failed the lookup."""
    from ringflow._device import hardware

    path = tmp_path / "p.json"
    hardware.H200_PCIE5.save(path)
    first = rf.device("sim:44", profile=str(path))
    try:
        dataclasses.replace(hardware.UNIT_TEST, name="changed").save(path)
        with pytest.raises(ValueError, match="sim:44.*exists already.*'h200-pcie5' that file held then"):
            rf.device("sim:44", profile=str(path))
        assert rf.device("sim:44", profile="h200-pcie5") is first
        path.unlink()
        assert rf.device("sim:44", seed=0) is first
        assert first.profile == hardware.H200_PCIE5
    finally:
        first.close()


@pytest.mark.parametrize("option,value,error,says", [
    ("chaos", "yes", TypeError, "chaos must be True or False"),
    ("checked", None, TypeError, "checked must be True or False"),
    ("seed", 1.5, TypeError, "seed must be an int"),
    ("seed", -1, ValueError, "seed must be an int >= 0"),
    ("profile", 5, TypeError, "profile must be a profile name"),
], ids=lambda v: repr(v)[:20])
def test_a_named_simulated_gpu_asked_again_with_a_bad_option_names_the_option(option, value, error, says):
    """Asked for again with a value no device takes, it said it exists already with other
    options, as if the value were good but different."""
    first = rf.device("sim:43")
    try:
        with pytest.raises(error, match=says) as info:
            rf.device("sim:43", **{option: value})
        assert "exists already" not in str(info.value)
        assert rf.device("sim:43") is first
    finally:
        first.close()


@pytest.mark.parametrize("array", ["bogus", 5, None])
def test_auto_refuses_a_bad_array_option_where_it_falls_back_to_the_simulated_gpu(no_gpu, array):
    """A GPU machine refuses it; falling back, the option was dropped unread, so a script passed
    here and failed there."""
    with pytest.raises(ValueError, match=r"array.*'auto', 'cupy', 'torch', 'dlpack'"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rf.device("auto", array=array)


def test_auto_takes_a_good_array_option_where_it_falls_back(no_gpu):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert rf.device("auto", array="torch").backend == "sim"
