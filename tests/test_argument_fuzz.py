"""Hostile values for every argument of the public constructors and waits, drawn by hypothesis:
``ringflow.device`` (its spec, its options, ``RINGFLOW_DEVICE``), ``Pipeline``, ``submit`` /
``asubmit`` and a result's timeouts, ``SlotCounts`` and ``ringflow.host``. Each call either works
and gives a sane result, or raises a TypeError or ValueError whose message names the argument;
never another exception from inside ringflow (but the documented DeviceUnavailableError where a GPU
is asked for and there is none, and MemoryError for an array no memory holds), and a refused
construction leaves nothing live.

The per-option tables of tests/pipeline/test_bad_input.py pin known values door by door; this
draws arbitrary ones (any float, any int, any short text) for the same contract."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import warnings
from unittest import mock

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ringflow as rf
from ringflow import _device
from ringflow._device.sim.device import SimDevice
from tests.helpers import unit_device
from tests.helpers.hostile import settle

FUZZ = settings(max_examples=30, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

# values of every kind an argument might be given by mistake
JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6), st.binary(max_size=3),
    st.sampled_from(["auto", "1GiB", "-1", "lots", "8 MiB", "1e3", "nan", "inf", "0", "sim", "sim:1", "cuda",
                     "cuda:all", "unit", "host", "device", "rows", "numpy", "torch", "raise", "continue"]),
    st.sampled_from([np.float64("nan"), np.int64(-1), np.uint64(2 ** 63), np.bool_(True), [1], (1,), {}, 1 + 1j,
                     object(), rf.SlotCounts(1, 1, 1, 1), rf.SlotCounts(2, 2, 0, 2), ((8,), "f4"), ((8,), "V0"),
                     (8,), np.array(["numpy"]), np.array(1024)]),
)


def compute(x, y):
    y[...] = x * 2


def names(message: str, argument: str) -> bool:
    """Whether ``message`` names ``argument`` as a word (``slots.host_in`` names slots)."""
    return re.search(rf"(?<!\w){re.escape(argument)}(?!\w)", message) is not None


@contextlib.contextmanager
def no_gpu_and_env(value):
    """CUDA unusable, and ``RINGFLOW_DEVICE`` set to ``value`` (unset for None)."""
    saved = os.environ.get("RINGFLOW_DEVICE")
    with mock.patch.object(_device, "cuda_available", lambda: (False, "no GPU in this test")), \
            mock.patch.object(_device, "_gpu_count", lambda: 0), warnings.catch_warnings():
        warnings.simplefilter("ignore", _device.SimulatedFallbackWarning)
        try:
            if value is None:
                os.environ.pop("RINGFLOW_DEVICE", None)
            else:
                os.environ["RINGFLOW_DEVICE"] = value
            yield
        finally:
            if saved is None:
                os.environ.pop("RINGFLOW_DEVICE", None)
            else:
                os.environ["RINGFLOW_DEVICE"] = saved


SPECS = st.one_of(JUNK, st.from_regex(r"(sim|cuda|auto)[: ]?[0-9a-z\-+]{0,3}", fullmatch=True))
ENV = st.one_of(st.none(), st.sampled_from(["sim", "sim:x", "cuda", "cuda:all", "auto", " ", "junk"]),
                st.text(max_size=5).filter(lambda s: "\x00" not in s))
SIM_OPTION_NAMES = ("profile", "seed", "chaos", "checked", "array", "bogus")
OPTION_VALUES = st.one_of(st.integers(-3, 3), st.sampled_from(["unit", "h200-pcie5", "torch", np.int64(2)]), JUNK)


def made_or_refused_by_name(spec, options: dict, env) -> None:
    """``ringflow.device(spec, **options)`` with ``RINGFLOW_DEVICE=env`` and no GPU makes a
    simulated GPU of plain options or refuses naming one of its arguments."""
    with no_gpu_and_env(env):
        try:
            dev = rf.device(spec, **options)
        except (TypeError, ValueError) as exc:
            message = str(exc)
            arguments = list(options) + (["spec", "sim:"] if spec is not None else ["RINGFLOW_DEVICE"])
            assert any(names(message, a) or a in message for a in arguments), (spec, options, env, message)
            return
        except _device.DeviceUnavailableError as exc:  # a GPU was asked for (here there is none)
            assert "cuda" in str(exc), (spec, options, env, exc)
            return
    assert isinstance(dev, SimDevice), (spec, options, env, dev)
    assert type(dev.seed) is int and dev.seed >= 0
    assert type(dev.chaos) is bool and type(dev.checked) is bool


@FUZZ
@given(spec=SPECS, env=ENV)
def test_a_device_spec_or_environment_value_makes_a_device_or_is_refused_by_name(spec, env):
    if isinstance(spec, str) and re.fullmatch(r"sim:\d+", spec):  # named simulated GPUs live for the process
        spec = f"sim:{900 + int(spec[4:]) % 10}"
    made_or_refused_by_name(spec, {}, env)


@FUZZ
@given(spec=st.sampled_from(["sim", "auto", "sim:910", None]), option=st.sampled_from(SIM_OPTION_NAMES),
       value=OPTION_VALUES)
def test_a_device_option_makes_a_device_or_is_refused_by_name(spec, option, value):
    made_or_refused_by_name(spec, {option: value}, "sim")


PIPELINE_OPTIONS = ("chunk_bytes", "slots", "workers", "max_in_flight", "pinned_budget", "on_error", "ordered",
                    "inplace", "checked", "coalesce", "deliver", "like", "fill", "output", "profile", "prepare",
                    "consume", "item_nbytes", "processes", "compute")


@FUZZ
@given(option=st.sampled_from(PIPELINE_OPTIONS), value=JUNK)
def test_pipeline_runs_right_or_refuses_by_name_leaving_nothing(option, value):
    dev = unit_device()
    options = {"chunk_bytes": 1024, option: value}
    f = options.pop("compute", compute)
    x = np.arange(8, dtype=np.float32)
    try:
        pipe = rf.Pipeline(f, device=dev, **options)
    except (TypeError, ValueError) as exc:
        assert names(str(exc), option), (option, value, str(exc))
    else:
        with pipe:
            try:
                results = list(pipe.map([x]))
            except (rf.StageError, TypeError, ValueError):
                results = None  # a callable that does the wrong thing fails its item
            if results is not None and option != "deliver":
                assert len(results) == 1
                if option not in ("output", "prepare", "consume", "fill"):
                    assert np.array_equal(np.asarray(results[0]), x * 2), (option, value, results)
            del results
    assert settle(dev) == 0, (option, value, dev.live())


TIMEOUTS = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.integers(-2 ** 80, 2 ** 80),
                     st.sampled_from(["1", b"1", True, [1], np.float64("nan"), np.int64(-1), 1j]))


def refusable(door: str, timeout) -> bool:
    """Whether ``door`` may refuse ``timeout``: anything but a number, NaN, and (to submit,
    whose timeout bounds a wait for room) a number that is not finite and >= 0; a result's
    timeout is read as concurrent.futures reads it (infinite waits, negative does not)."""
    if timeout is None:
        return False
    if isinstance(timeout, (bool, np.bool_)) or not isinstance(timeout, (int, float, np.integer, np.floating)):
        return True
    try:
        value = float(timeout)
    except OverflowError:
        value = math.inf if timeout > 0 else -math.inf
    if math.isnan(value):
        return True
    return door != "result" and (not math.isfinite(value) or value < 0)


@FUZZ
@given(timeout=TIMEOUTS, door=st.sampled_from(["submit", "asubmit", "result"]))
def test_a_timeout_is_seconds_or_is_refused_by_name(timeout, door):
    dev = unit_device()
    x = np.arange(8, dtype=np.float32)
    with rf.Pipeline(compute, device=dev, chunk_bytes=1024) as pipe:
        try:
            if door == "submit":
                result = pipe.submit(x, timeout=timeout).result(timeout=60)
            elif door == "asubmit":
                async def go():
                    return await pipe.asubmit(x, timeout=timeout)
                result = asyncio.run(go())
            else:
                future = pipe.submit(x)
                future.result(timeout=60)  # done: any timeout it takes returns at once
                result = future.result(timeout=timeout)
        except (TypeError, ValueError) as exc:
            assert names(str(exc), "timeout"), (door, timeout, str(exc))
            assert refusable(door, timeout), (door, timeout, str(exc))
        else:
            assert np.array_equal(result, x * 2)
            assert not refusable(door, timeout), (door, timeout)
    assert settle(dev) == 0


@FUZZ
@given(counts=st.lists(JUNK | st.integers(-2, 4), min_size=4, max_size=4))
def test_slot_counts_are_whole_numbers_or_refused_by_ring(counts):
    try:
        slots = rf.SlotCounts(*counts)
    except (TypeError, ValueError) as exc:
        assert re.search(r"slots\.(host_in|device_in|device_out|host_out)", str(exc)), (counts, str(exc))
    else:
        values = (slots.host_in, slots.device_in, slots.device_out, slots.host_out)
        assert all(type(v) is int for v in values) and min(values) >= 0 and slots.device_in >= 1, slots


@FUZZ
@given(shape=JUNK | st.lists(st.integers(-1, 3) | JUNK, max_size=3).map(tuple), dtype=st.none() | JUNK,
       wait=JUNK)
def test_host_empty_and_collect_take_sane_arguments_or_refuse_them(shape, dtype, wait):
    dev = unit_device()
    try:
        a = rf.host.empty(shape, dtype if dtype is not None else np.float32, device=dev)
    except (TypeError, ValueError) as exc:
        assert re.search(r"shape|dtype|dimension", str(exc)), (shape, dtype, str(exc))
    except MemoryError as exc:  # documented: a size no memory can hold
        assert "host.empty(shape=" in str(exc)
    else:
        assert isinstance(a, np.ndarray) and a.flags.c_contiguous
        del a
    try:
        rf.host.collect(wait=wait, device=dev)
    except TypeError as exc:
        assert names(str(exc), "wait") and not isinstance(wait, (bool, np.bool_)), (wait, str(exc))
    else:
        assert isinstance(wait, (bool, np.bool_)), wait
    assert settle(dev) == 0
