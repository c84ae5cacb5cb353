"""Hostile input to every public entry point (``stream_map``, ``MapJob``, ``Pipeline``) gets the
same answer on both whole-array engines and at every front door: a TypeError or ValueError whose
message names the argument and what to change, never a raw numpy or ``int()`` error, a hang, a
wrong result or a leaked stream, ring or registration."""

from __future__ import annotations

import gc
import warnings

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import ringflow as rf
from ringflow import SlotCounts, StageError
from ringflow._pipeline.trees import flatten
from tests.helpers import unit_device
from tests.helpers.pipeline_checks import check_map_refuses_not_iterable
from tests.helpers.dtypes import NOT_DEVICE_DTYPES, NOT_DEVICE_IDS, holding_no_uint16, refusal
from tests.helpers.threads import bounded
from tests.helpers.hostile import (BAD, DOOR_OPTIONS, ENGINE_SETTINGS, GOOD, GOOD_WHOLE_ARRAY_CHUNKS, NAN, INF,
                                   call, compute, expected, named, outcome, settle)

N = 64  # float32 elements: 256 bytes, a few chunks of 64 bytes
PIPE_CHUNK = 1024  # a Pipeline's slot, when a test gives none
WHOLE_ARRAY_DOORS = ("stream_map", "MapJob")
ALL_DOORS = WHOLE_ARRAY_DOORS + ("Pipeline",)


@pytest.fixture
def dev():
    device = unit_device()
    yield device
    assert settle(device) == 0, f"left live: {device.live()}"


def data(n: int = N) -> np.ndarray:
    return np.arange(n, dtype=np.float32) - 7.5


def variants(option: str):
    """Every (door, engine setting) where ``option`` is an argument; the Pipeline has no engine
    setting (it is the scheduler)."""
    for door in ALL_DOORS:
        if option not in DOOR_OPTIONS[door]:
            continue
        if door == "Pipeline":
            yield door, None
        else:
            for setting in ENGINE_SETTINGS:
                yield door, setting


_DATA = object()


def run(door: str, setting, dev, x=_DATA, out=None, **options):
    """``door`` on engine ``setting`` over ``x`` (default :func:`data`) in 64-byte chunks unless
    ``options`` say otherwise."""
    if setting is not None:
        options = {**ENGINE_SETTINGS[setting], **options}
    options.setdefault("chunk_bytes", 64)
    return call(door, dev, data() if x is _DATA else x, out, **options)


# -- 1. every option, every bad value: the same refusal at every door and on both engines -----------------------------
BAD_CASES = [(option, value) for option, values in BAD.items() for value in values]


@pytest.mark.parametrize("option,value", BAD_CASES, ids=[f"{o}={v!r}"[:40] for o, v in BAD_CASES])
def test_bad_option_refused_alike_everywhere(dev, option, value):
    seen = {}
    for door, setting in variants(option):
        seen[(door, setting)] = outcome(lambda: run(door, setting, dev, **{option: value}))
        rf.drop_warm_pipelines()  # a refusal made no events either, so no collection is needed
        assert dev.live().total == 0, f"{door}/{setting} left {dev.live()} after refusing {option}={value!r}"
    assert seen
    for where, got in seen.items():
        assert got[0] in (TypeError, ValueError), f"{where} accepted or mis-raised {option}={value!r}: {got}"
        assert option in got[1], f"{where}: the message does not name {option}: {got[2]!r}"
    kinds = {(got[0], got[1]) for got in seen.values()}
    assert len(kinds) == 1, f"{option}={value!r} is refused differently: {seen}"


def test_slotcounts_of_zero_refused_naming_slots():
    with pytest.raises(ValueError, match=r"slots\.host_in must be between 1 and 65536, got 0"):
        SlotCounts(0, 1, 1, 1)
    with pytest.raises(TypeError, match=r"slots\.host_in must be an integer, got '2'"):
        SlotCounts("2", 1, 1, 1)
    with pytest.raises(TypeError, match=r"slots\.device_in must be an integer, got 1\.5"):
        SlotCounts(1, 1.5, 1, 1)


@pytest.mark.parametrize("slots,inplace", [(SlotCounts(2, 2, 2, 2), True), (SlotCounts(2, 2, 0, 2), False)])
def test_slotcounts_that_do_not_match_inplace_refused_alike(dev, slots, inplace):
    seen = {where: outcome(lambda: run(*where, dev, slots=slots, inplace=inplace)) for where in variants("slots")}
    for where, got in seen.items():
        assert got[0] is ValueError and "slots.device_out" in got[2] and "inplace" in got[2], (where, got)


@pytest.mark.parametrize("chunk_bytes", GOOD_WHOLE_ARRAY_CHUNKS, ids=repr)
@pytest.mark.parametrize("door,setting", [(d, s) for d in WHOLE_ARRAY_DOORS for s in ENGINE_SETTINGS])
def test_good_chunk_sizes_accepted_for_whole_arrays(dev, door, setting, chunk_bytes):
    x = data()
    assert np.array_equal(run(door, setting, dev, x, chunk_bytes=chunk_bytes), expected(x))


@pytest.mark.parametrize("chunk_bytes", [8192, 8192.0, "8KiB", np.int64(256), "1 KiB", "1e3"], ids=repr)
def test_good_chunk_sizes_accepted_by_pipeline(dev, chunk_bytes):
    x = data()
    assert np.array_equal(call("Pipeline", dev, x, chunk_bytes=chunk_bytes), expected(x))


def test_auto_chunk_is_for_whole_arrays_only(dev):
    with pytest.raises(ValueError, match=r"chunk_bytes must be a number of bytes .*'auto' is for whole arrays"):
        rf.Pipeline(compute, device=dev, chunk_bytes="auto")
    for door in ALL_DOORS:
        with pytest.raises(ValueError, match=r"pinned_budget must be a number of bytes .*got 'auto'$"):
            call(door, dev, data(), pinned_budget="auto")


@pytest.mark.parametrize("value,message", [(NAN, "finite"), (INF, "finite"), (1.5, "whole number"),
                                           (10 ** 30, "at most"), ("8 parsecs", "size such as '8MiB'")])
def test_chunk_bytes_messages_say_what_to_change(dev, value, message):
    with pytest.raises(ValueError, match=message):
        rf.stream_map(compute, data(), device=dev, chunk_bytes=value)


@pytest.mark.parametrize("setting", ENGINE_SETTINGS)
@pytest.mark.parametrize("door", WHOLE_ARRAY_DOORS)
def test_pinned_budget_binds_only_staging_memory_on_both_engines(dev, door, setting):
    """A budget far below any staging ring: staging is refused naming pinned_budget; registered
    memory has no staging ring, so both engines run it the same."""
    got = outcome(lambda: run(door, setting, dev, pinned_budget=8))
    if setting == "stage":
        assert got[0] is ValueError and "pinned_budget" in got[1], got
    else:
        assert got[0] == "ok" and np.array_equal(got[1], expected(data())), got


def test_a_pinned_budget_in_pebibytes_is_read_as_a_size():
    """A pinned_budget in PiB (up to one PiB, its largest) was refused as no size at all, and one
    above it was told to be written as a size, not to be smaller."""
    from ringflow._pipeline.validate import MAX_HOST_BYTES, check_bytes

    assert check_bytes("pinned_budget", "0.5PiB", maximum=MAX_HOST_BYTES) == 1 << 49
    assert check_bytes("pinned_budget", "1 pib", maximum=MAX_HOST_BYTES) == 1 << 50
    assert check_bytes("pinned_budget", "1PB", maximum=MAX_HOST_BYTES) == 10 ** 15
    with pytest.raises(ValueError, match=r"pinned_budget must be at most 1125899906842624 bytes, got 9007199254740992"):
        check_bytes("pinned_budget", "8PiB", maximum=MAX_HOST_BYTES)


def test_direct_engine_refusals_name_engine_and_the_reason(dev):
    for options, reason in (({"host": "stage"}, "host='stage'"), ({"host": "register", "on_error": "continue"},
                                                                   "on_error='continue'")):
        for door in WHOLE_ARRAY_DOORS:
            with pytest.raises(ValueError, match="engine='direct' cannot run this job") as info:
                call(door, dev, data(), engine="direct", chunk_bytes=64, **options)
            assert reason in str(info.value) and "engine='pipeline'" in str(info.value)


@pytest.mark.parametrize("door", ALL_DOORS)
def test_compute_that_is_not_callable_is_refused(dev, door):
    with pytest.raises(TypeError, match=r"callable f\(x, y\)") as info:
        call(door, dev, data(), f=np.float32(2), chunk_bytes=64)
    assert "float32" in str(info.value)


@pytest.mark.parametrize("args", [("f", "dev"), ("x", "f")], ids=["Pipeline(f, dev)", "Pipeline(x, f)"])
def test_a_pipeline_given_more_than_the_compute_by_position_says_what_to_pass_by_keyword(dev, args):
    """stream_map and MapJob take f, x and out by position; a Pipeline takes only the compute,
    and Python's own message ('takes 2 positional arguments but 3 were given') said neither
    that nor where the items go."""
    given = {"f": lambda x, y: None, "dev": dev, "x": data()}
    with pytest.raises(TypeError, match=r"Pipeline takes one positional argument, the compute f\(x, y\).*got 2.*"
                                        r"by keyword.*device=.*submit\(item\) or map\(items\)"):
        rf.Pipeline(*(given[a] for a in args))


def _one_argument(x):
    return x * 2


class _Methods:
    def two(self, x, y):
        y[...] = x

    def three(self, x, y, z):
        y[...] = x


WRONG_ARITY = [(lambda x: x * 2, "<lambda>"), (_one_argument, "_one_argument"), (_Methods().three, "three"),
               (lambda x, y, *, scale: None, "<lambda>")]
RIGHT_ARITY = [lambda x, y: y.__setitem__(Ellipsis, x), lambda *a: a[1].__setitem__(Ellipsis, a[0]),
               lambda x, y=None, z=1: y.__setitem__(Ellipsis, x), _Methods().two, rf.Kernel(
                   "extern \"C\" __global__ void k(const float* x, float* y, unsigned n) {}", "k",
                   reference=lambda x, y: y.__setitem__(Ellipsis, x))]


@pytest.mark.parametrize("door", ALL_DOORS)
@pytest.mark.parametrize("f,name", WRONG_ARITY, ids=["lambda x", "def f(x)", "method(x, y, z)", "required keyword"])
def test_compute_that_cannot_take_x_and_y_is_refused_before_any_work(dev, door, f, name):
    """A compute that returns its result (``f(x) -> y``) is a common first try: it is refused
    when the door is called, naming the function and the form to write, not on every chunk."""
    with pytest.raises(TypeError, match=rf"is called as f\(x, y\).*{re.escape(name)}") as info:
        call(door, dev, data(), f=f, chunk_bytes=64)
    assert "y[...] = x * 2, not return" in str(info.value)


@pytest.mark.parametrize("door", ALL_DOORS)
@pytest.mark.parametrize("f", RIGHT_ARITY, ids=["(x, y)", "(*a)", "defaults", "method", "Kernel"])
def test_compute_that_can_take_x_and_y_is_accepted(dev, door, f):
    got = call(door, dev, data(), f=f, chunk_bytes=64)
    assert np.array_equal(np.asarray(got), data())


@pytest.mark.parametrize("option,fn,form", [
    ("prepare", lambda: None, "prepare(item)"), ("consume", lambda index, item: None, "consume(index, item, result)"),
    ("item_nbytes", lambda a, b: 0, "item_nbytes(item)"), ("output", lambda: None, "output(item)")])
def test_pipeline_callables_of_the_wrong_arity_are_refused(dev, option, fn, form):
    with pytest.raises(TypeError, match=rf"^{option} is called as {re.escape(form)};"):
        rf.Pipeline(compute, device=dev, chunk_bytes=PIPE_CHUNK, **{option: fn})
    assert dev.live().total == 0


@pytest.mark.parametrize("which", ["x", "out"])
@pytest.mark.parametrize("door", WHOLE_ARRAY_DOORS)
def test_a_masked_array_is_refused_not_unmasked(dev, door, which):
    """ringflow moves an array's data alone: a masked x would come back with its masked
    elements computed as if valid, and a masked out would hide results; both are refused."""
    x, out = data(), np.zeros(N, np.float32)
    arrays = {"x": x, "out": out}
    arrays[which] = np.ma.masked_array(arrays[which], mask=np.arange(N) % 2 == 0)
    with pytest.raises(TypeError, match=rf"^{which}: a numpy masked array.*\.filled"):
        call(door, dev, arrays["x"], arrays["out"], chunk_bytes=64)


def test_a_masked_item_is_refused_and_the_pipeline_goes_on(dev):
    item = np.ma.masked_array(data(), mask=np.arange(N) % 2 == 0)
    with rf.Pipeline(compute, device=dev, chunk_bytes=PIPE_CHUNK) as pipe:
        with pytest.raises(TypeError, match="masked array"):
            pipe.submit(item)
        np.testing.assert_array_equal(pipe.submit(data()).result(timeout=30), expected(data()))


def test_a_masked_array_from_prepare_fails_its_item_not_unmasked(dev):
    """As an item is, an array that ``prepare`` returns is refused when masked, alone as in a
    tuple: its mask would be dropped and its masked elements computed as if valid."""
    def prepare(i):
        return np.ma.masked_array(data(), mask=np.arange(N) % 2 == 0)

    with rf.Pipeline(compute, device=dev, chunk_bytes=PIPE_CHUNK, prepare=prepare) as pipe:
        with pytest.raises(rf.StageError) as info:
            pipe.submit(1).result(timeout=30)
    assert info.value.stage == "prepare"
    assert re.match(r"prepare's array: a numpy masked array.*\.filled", str(info.value.__cause__))


@pytest.mark.parametrize("bad", ["a string", "too big", "bad output"])
def test_an_item_a_map_refuses_fails_that_map_alone(dev, bad):
    """Refused before it was accepted, the item is that map's caller's error: the map raises it
    (cancelling what it took itself), and other callers' items and the pipeline go on."""
    output = None
    if bad == "bad output":  # the spec is bad for this item only
        output = lambda item: (item.shape, np.float32 if item.size == N else "no such dtype")  # noqa: E731
    with rf.Pipeline(compute, device=dev, chunk_bytes=PIPE_CHUNK, output=output) as pipe:
        others = [pipe.submit(data() + k) for k in range(4)]  # another thread's, say
        items = [data(), {"a string": "abc", "too big": np.zeros(PIPE_CHUNK), "bad output": data(N + 1)}[bad]]
        with pytest.raises((TypeError, ValueError)):
            list(pipe.map(items))
        for k, fut in enumerate(others):
            np.testing.assert_array_equal(fut.result(timeout=30), expected(data() + k))
        np.testing.assert_array_equal(pipe.submit(data()).result(timeout=30), expected(data()))
        s = pipe.stats()
        assert s.failed == 0 and s.delivered >= 5


@pytest.mark.parametrize("name", ["prepare", "consume", "item_nbytes"])
def test_pipeline_callbacks_that_are_not_callable_are_refused(dev, name):
    with pytest.raises(TypeError, match=f"{name} must be a callable or None, got str"):
        rf.Pipeline(compute, device=dev, chunk_bytes=PIPE_CHUNK, **{name: "nope"})


def _no_size(item):
    raise RuntimeError("no size here")


@pytest.mark.parametrize("nbytes,kind,says", [
    (lambda item: "40", TypeError, "returned '40'"), (lambda item: -1, ValueError, "returned -1"),
    (lambda item: float("nan"), TypeError, "returned nan"), (lambda item: None, TypeError, "returned None"),
    (lambda item: True, TypeError, "returned True"), (_no_size, RuntimeError, "no size here"),
    (lambda item: 10**30, ValueError, "returned 10000")],
    ids=["str", "negative", "nan", "None", "bool", "raises", "a nonillion"])
def test_an_item_nbytes_that_gives_no_byte_count_fails_its_item(dev, nbytes, kind, says):
    """``item_nbytes`` is the user's code on the progress thread: its error, or a value that is
    not a byte count, fails that item's prepare as a StageError (the progress thread used to die
    of it, every later call then raising "this is a ringflow bug"); the other items and the
    pipeline carry on."""
    items = [data(16) + k for k in range(3)]
    with rf.Pipeline(compute, device=dev, chunk_bytes=PIPE_CHUNK, prepare=np.copy, on_error="continue",
                     item_nbytes=lambda item: nbytes(item) if item[0] == items[1][0] else item.nbytes) as pipe:
        results = bounded(lambda: list(pipe.map(items)), timeout=20)  # a prepare of 1e30 bytes: no hang
        assert [r[0] for r in results] == [expected(items[0])[0], expected(items[2])[0]]
        (failure,) = pipe.failures
        assert failure.stage == "item_nbytes" and isinstance(failure.__cause__, kind)
        assert says in str(failure.__cause__)
        if kind is not RuntimeError:
            assert "item_nbytes" in str(failure.__cause__)
        assert np.array_equal(pipe.submit(items[0]).result(), expected(items[0]))


def test_an_item_nbytes_that_raises_is_named_as_the_failing_callable(dev):
    """The StageError of an item whose ``item_nbytes`` raised names ``item_nbytes``, not
    ``prepare``: the user's prepare never ran for it, and the message sends them to the function
    that failed. The chunk still ends FAILED, as any stage's failure does."""
    items = [data(16) + k for k in range(3)]
    with rf.Pipeline(compute, device=dev, chunk_bytes=PIPE_CHUNK, prepare=np.copy, on_error="continue",
                     item_nbytes=lambda item: _no_size(item) if item[0] == items[1][0] else item.nbytes) as pipe:
        futs = [pipe.submit(item) for item in items]
        with pytest.raises(StageError, match=r"^stage 'item_nbytes' failed for chunk 1: RuntimeError: no size here$") \
                as info:
            bounded(lambda: futs[1].result(timeout=20), timeout=30)
        assert info.value.stage == "item_nbytes" and info.value.index == 1
        assert isinstance(info.value.__cause__, RuntimeError)
        assert [f.stage for f in pipe.failures] == ["item_nbytes"]
        for k in (0, 2):
            assert np.array_equal(futs[k].result(timeout=20), expected(items[k]))
        s = pipe.stats()
        assert (s.failed, s.delivered) == (1, 2)
        del info


@pytest.mark.parametrize("setting", ENGINE_SETTINGS)
def test_mapjob_call_refuses_a_non_bool_profile_and_stays_usable(dev, setting):
    x = data()
    with rf.MapJob(compute, x, device=dev, chunk_bytes=64, **ENGINE_SETTINGS[setting]) as job:
        with pytest.raises(TypeError, match="profile must be True or False"):
            job(profile="yes")
        assert not job.closed and np.array_equal(job(), expected(x))


# -- 2. submit(timeout=) --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("timeout,kind", [(NAN, ValueError), (INF, ValueError), (-1, ValueError), (10 ** 400, ValueError),
                                          (-(10 ** 400), ValueError), ("1", TypeError), (True, TypeError),
                                          ([1], TypeError)], ids=lambda v: repr(v)[:12])
def test_submit_bad_timeout_refused_and_pipeline_still_usable(dev, timeout, kind):
    x = data(16)
    with rf.Pipeline(compute, device=dev, chunk_bytes=PIPE_CHUNK) as pipe:
        with pytest.raises(kind, match="timeout") as info:
            pipe.submit(x, timeout=timeout)
        assert "None" in str(info.value)  # says how to wait without limit
        assert pipe.stats().in_flight == 0
        assert np.array_equal(pipe.submit(x, timeout=5).result(), expected(x))
        assert np.array_equal(pipe.submit(x).result(), expected(x))


@pytest.mark.parametrize("timeout,kind", [(NAN, ValueError), ("1", TypeError), (True, TypeError), ([1], TypeError)],
                         ids=repr)
def test_result_bad_timeout_refused_naming_it(dev, timeout, kind):
    """A future's wait takes what concurrent.futures takes (None, a number, a negative number
    not waiting) and refuses the rest by name: NaN used to wait without limit, a string to fail
    inside the clock's arithmetic."""
    x = data(16)
    with rf.Pipeline(compute, device=dev, chunk_bytes=PIPE_CHUNK) as pipe:
        fut = pipe.submit(x)
        for wait in (fut.result, fut.exception):
            with pytest.raises(kind, match="timeout must be"):
                wait(timeout=timeout)
        assert np.array_equal(fut.result(timeout=INF), expected(x))
        assert np.array_equal(fut.result(timeout=10 ** 400), expected(x))  # beyond a float: without limit
        assert np.array_equal(fut.result(timeout=-1), expected(x))  # done: a wait that does not wait
        assert fut.exception(timeout=0) is None


def test_result_negative_timeout_does_not_wait(dev):
    import concurrent.futures
    with rf.Pipeline(compute, device=dev, chunk_bytes=PIPE_CHUNK) as pipe:
        fut = pipe.submit(data(16))
        if not fut.done():  # the simulated GPU advances only while someone waits
            with pytest.raises(concurrent.futures.TimeoutError):
                fut.result(timeout=-0.5)
        assert np.array_equal(fut.result(), expected(data(16)))


@pytest.mark.parametrize("items", [5, None, 2.5], ids=repr)
def test_map_of_something_not_iterable_is_refused_at_once_naming_items(dev, items):
    with rf.Pipeline(compute, device=dev, chunk_bytes=PIPE_CHUNK) as pipe:
        check_map_refuses_not_iterable(pipe, items)
        assert np.array_equal(list(pipe.map([data(16)]))[0], expected(data(16)))


@pytest.mark.parametrize("door", WHOLE_ARRAY_DOORS)
def test_a_whole_array_call_whose_compute_fails_warns_of_nothing_else(dev, door):
    """The failure leaves the call as a StageError and nothing more: no warning that cancelling
    the rest failed (it once tripped over a field only the progress thread's driver had)."""
    def fails(x, y):
        raise ValueError("the test's compute fails")

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(StageError, match="the test's compute fails"):
            call(door, dev, data(), None, chunk_bytes=64, f=fails)
    assert not [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]


# -- 3. out overlapping x -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("setting", ENGINE_SETTINGS)
@pytest.mark.parametrize("door", WHOLE_ARRAY_DOORS)
def test_out_overlapping_x_is_refused(dev, door, setting):
    buf = np.arange(2 * N, dtype=np.float32)
    before = buf.copy()
    for x, out in ((buf[:N], buf[1:N + 1]), (buf[1:N + 1], buf[:N]), (buf[:N], buf[N - 1:2 * N - 1]),
                   (buf[:N], buf[:N][::-1])):
        with pytest.raises(ValueError, match="overlap") as info:
            run(door, setting, dev, x, out)
        assert "out=x" in str(info.value)
    assert np.array_equal(buf, before)  # nothing was written


@pytest.mark.parametrize("setting", ENGINE_SETTINGS)
@pytest.mark.parametrize("door", WHOLE_ARRAY_DOORS)
@pytest.mark.parametrize("which", ["x itself", "x[...]", "separate", "other half"])
def test_out_that_is_x_or_apart_from_it_is_correct(dev, door, setting, which):
    buf = np.arange(2 * N, dtype=np.float32) - 3
    x = buf[:N]
    want = expected(x.copy())
    out = {"x itself": x, "x[...]": x[...], "separate": np.zeros(N, np.float32), "other half": buf[N:]}[which]
    result = run(door, setting, dev, x, out)
    assert result is out and np.array_equal(out, want)


@pytest.mark.parametrize("door", WHOLE_ARRAY_DOORS)
@pytest.mark.parametrize("engine", ["direct", "pipeline"])
def test_out_with_the_memory_of_x_is_registered_once(dev, monkeypatch, door, engine):
    """Registering the same host memory twice fails on a real GPU; ``out=x[...]`` must pin once."""
    pinned = []
    register = dev.register_host
    monkeypatch.setattr(dev, "register_host", lambda a: pinned.append(a) or register(a))
    x = data()
    want = expected(x)
    assert np.array_equal(call(door, dev, x, x[...], host="register", engine=engine, chunk_bytes=64), want)
    assert len(pinned) == 1


# -- 4. a compute that returns its result -----------------------------------------------------------------------------
def returns_value(x, y):
    return x * 2


def returns_y(x, y):
    return np.multiply(x, 2, out=y)


@pytest.mark.parametrize("door,setting", [(d, s) for d in WHOLE_ARRAY_DOORS for s in ENGINE_SETTINGS]
                         + [("Pipeline", None)])
def test_compute_returning_a_value_is_a_stage_error(dev, door, setting):
    with pytest.raises(StageError) as info:
        run(door, setting, dev, f=returns_value)
    err = info.value
    assert err.stage == "compute" and isinstance(err.__cause__, TypeError)
    assert "write the result into y" in str(err.__cause__)
    del info, err  # its traceback holds the failed call's events until dropped
    assert settle(dev) == 0
    x = data()
    assert np.array_equal(run(door, setting, dev, x, f=returns_y), x * 2)


# -- 5. pinned buffers that are not the memory behind x and out -------------------------------------------------------
@pytest.fixture
def pinned(dev):
    """Pinned x and out (the buffers and their views), another pinned buffer of the same size, and a
    larger one whose float32 view starts 16 bytes in."""
    bufs = {name: dev.allocate_host(N * 4 + (16 if name == "big" else 0)) for name in ("x", "out", "other", "big")}
    x = bufs["x"].view(np.float32)
    x[:] = data()
    shifted = bufs["big"].view(np.float32, offset=16)
    shifted[:] = data()
    yield bufs, x, bufs["out"].view(np.float32), shifted
    for b in bufs.values():
        b.close()


@pytest.mark.parametrize("engine", ["auto", "direct", "pipeline"])
@pytest.mark.parametrize("door", WHOLE_ARRAY_DOORS)
def test_pinned_buffers_must_be_the_memory_behind_x_and_out(dev, pinned, door, engine):
    bufs, x, out, shifted = pinned
    cases = [
        ("x_buffer", ValueError, dict(x=x, out=out, x_buffer=bufs["other"], out_buffer=bufs["out"])),
        ("out_buffer", ValueError, dict(x=x, out=out, x_buffer=bufs["x"], out_buffer=bufs["other"])),
        ("x_buffer", ValueError, dict(x=shifted, out=out, x_buffer=bufs["big"], out_buffer=bufs["out"])),
        ("x_buffer", TypeError, dict(x=x, out=out, x_buffer=x, out_buffer=bufs["out"])),
        ("out_buffer", TypeError, dict(x=x, out=out, x_buffer=bufs["x"], out_buffer="out")),
        ("out_buffer", ValueError, dict(x=x, out=out, x_buffer=bufs["x"])),
        ("out_buffer", ValueError, dict(x=x, out=None, x_buffer=bufs["x"], out_buffer=bufs["out"])),
    ]
    for name, kind, kw in cases:
        arr, result = kw.pop("x"), kw.pop("out")
        with pytest.raises(kind) as info:
            call(door, dev, arr, result, engine=engine, chunk_bytes=64, **kw)
        assert name in named(str(info.value)), (name, str(info.value))
        if result is None:  # says that out is missing, not that it is the wrong memory
            assert "pass out too" in str(info.value)
    assert dev.live().host_buffers == len(bufs)  # nothing registered or allocated behind them
    out[:] = 0
    assert call(door, dev, x, out, engine=engine, chunk_bytes=64, x_buffer=bufs["x"], out_buffer=bufs["out"]) is out
    assert np.array_equal(out, expected(data()))


@pytest.mark.parametrize("engine", ["auto", "direct", "pipeline"])
@pytest.mark.parametrize("door", WHOLE_ARRAY_DOORS)
def test_pinned_buffers_of_another_device_are_refused_by_name(dev, door, engine):
    """Another device's pinned memory cannot be copied from on this one: the call refuses it up
    front, naming the argument and what to pass instead, rather than failing mid-call in a
    stream operation that names a buffer and not the argument."""
    other = unit_device()
    mine = {name: dev.allocate_host(N * 4) for name in ("x", "out")}
    theirs = {name: other.allocate_host(N * 4) for name in ("x", "out")}
    for name in ("x", "out"):
        theirs[name].view(np.float32)[:] = mine[name].view(np.float32)[:] = data()
    cases = [("x_buffer", theirs["x"], mine["out"]), ("out_buffer", mine["x"], theirs["out"])]
    try:
        for name, x_buffer, out_buffer in cases:
            x, out = x_buffer.view(np.float32), out_buffer.view(np.float32)
            with pytest.raises(ValueError) as info:
                call(door, dev, x, out, engine=engine, chunk_bytes=64, x_buffer=x_buffer, out_buffer=out_buffer)
            message = str(info.value)
            assert named(message) >= {name}, (name, message)
            assert "another device" in message and "allocate_host" in message and "device=" in message, message
        assert dev.live().host_buffers == len(mine) and other.live().host_buffers == len(theirs)
    finally:
        for buf in [*mine.values(), *theirs.values()]:
            buf.close()
    assert settle(other) == 0, f"left live on the buffers' device: {other.live()}"


@pytest.mark.parametrize("engine", ["auto", "direct", "pipeline"])
@pytest.mark.parametrize("door", WHOLE_ARRAY_DOORS)
def test_closed_pinned_buffers_are_refused_by_name(dev, door, engine):
    """A pinned buffer closed before the call raised the buffer's own "<pinned host buffer #N ...
    closed> is closed; allocate a new buffer", which says neither which argument it is (two
    buffers of one size are told apart by a number the caller never saw) nor that its view, the
    array passed with it, went with it."""
    for name in ("x_buffer", "out_buffer"):
        bufs = {side: dev.allocate_host(N * 4) for side in ("x", "out")}
        x, out = bufs["x"].view(np.float32), bufs["out"].view(np.float32)
        x[:] = data()
        try:
            call(door, dev, x, out, engine=engine, chunk_bytes=64, x_buffer=bufs["x"], out_buffer=bufs["out"])
            bufs[name[:-7]].close()  # (after a call: a stream_map's next call has its plan remembered)
            with pytest.raises(RuntimeError) as info:
                call(door, dev, x, out, engine=engine, chunk_bytes=64, x_buffer=bufs["x"], out_buffer=bufs["out"])
            message = str(info.value)
            assert named(message) >= {name} and "is closed" in message and "allocate_host" in message, message
        finally:
            for buf in bufs.values():
                buf.close()
    assert settle(dev) == 0


# -- 6. a MapJob dropped without close() ------------------------------------------------------------------------------
@pytest.mark.parametrize("setting", ENGINE_SETTINGS)
def test_mapjob_dropped_without_close_warns_and_releases(dev, setting):
    x = data()
    job = rf.MapJob(compute, x, device=dev, chunk_bytes=64, **ENGINE_SETTINGS[setting])
    assert np.array_equal(job(), expected(x))
    assert dev.live().total > 0
    with pytest.warns(ResourceWarning, match="without close"):
        del job
        gc.collect()
    assert settle(dev) == 0


@pytest.mark.parametrize("setting", ENGINE_SETTINGS)
def test_mapjob_closed_twice_is_harmless_and_a_closed_job_refuses_calls(dev, setting):
    x = data()
    job = rf.MapJob(compute, x, device=dev, chunk_bytes=64, **ENGINE_SETTINGS[setting])
    job.close()
    assert dev.live().total == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no ResourceWarning either when collected later
        job.close()
        with pytest.raises(RuntimeError, match="closed"):
            job()
        with pytest.raises(RuntimeError, match="closed"):
            job.report()
        del job
        gc.collect()


# -- 7. a tiny array with a huge chunk size --------------------------------------------------------------------------
@pytest.mark.parametrize("chunk_bytes", [1 << 30, "1TiB", "auto"])
@pytest.mark.parametrize("door,setting", [(d, s) for d in WHOLE_ARRAY_DOORS for s in ENGINE_SETTINGS])
def test_tiny_array_with_huge_chunk_allocates_only_its_bytes(dev, monkeypatch, door, setting, chunk_bytes):
    sizes = []
    for name in ("allocate", "allocate_host"):
        real = getattr(dev, name)
        monkeypatch.setattr(dev, name, lambda n, *a, _real=real, **k: sizes.append(n) or _real(n, *a, **k))
    x = np.arange(10, dtype=np.float32)  # 40 bytes: one chunk, so one slot per ring
    assert np.array_equal(run(door, setting, dev, x, chunk_bytes=chunk_bytes), expected(x))
    assert sizes and max(sizes) <= x.nbytes, sizes


# -- 8. allocation failures on the simulated device -------------------------------------------------------------------
def test_failed_host_allocation_is_not_counted(dev):
    held = dev.allocate_host(64)
    before = dev.live()
    with pytest.raises(MemoryError):
        dev.allocate_host(1 << 60)
    assert dev.live() == before
    held.close()


@pytest.mark.parametrize("failing", ["allocate", "allocate_host", "create_stream", "register_host"])
@pytest.mark.parametrize("door,setting", [(d, s) for d in WHOLE_ARRAY_DOORS for s in ENGINE_SETTINGS]
                         + [("Pipeline", None)])
def test_allocation_failing_while_building_leaves_nothing(dev, monkeypatch, door, setting, failing):
    """The second allocation of a kind fails (as an exhausted device or host would); whatever was
    made before it is released and the MemoryError reaches the caller."""
    real, calls = getattr(dev, failing), []

    def second_fails(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            raise MemoryError(f"simulated: {failing} out of memory")
        return real(*args, **kwargs)

    monkeypatch.setattr(dev, failing, second_fails)
    x = data()
    got = outcome(lambda: run(door, setting, dev, x))
    if len(calls) >= 2:  # (a ring's names the ring and chunk_bytes: an rf.OutOfMemoryError)
        assert isinstance(got[0], type) and issubclass(got[0], MemoryError), got
    else:  # this engine makes at most one of these
        assert got[0] == "ok" and np.array_equal(got[1], expected(x)), got
    assert settle(dev) == 0, dev.live()


# -- 9. hostile arrays and items --------------------------------------------------------------------------------------
NOT_ARRAYS = {"list": [1.0, 2.0], "str": "abc", "bytes": b"abcd", "None": None, "int": 3}


@pytest.mark.parametrize("what", NOT_ARRAYS)
@pytest.mark.parametrize("door,setting", [(d, s) for d in WHOLE_ARRAY_DOORS for s in ENGINE_SETTINGS])
def test_whole_array_refuses_what_is_not_an_array(dev, door, setting, what):
    with pytest.raises(TypeError, match="numpy array x") as info:
        run(door, setting, dev, NOT_ARRAYS[what])
    # (a scalar made an array by np.asarray is 0-d, which is refused next: it is told atleast_1d)
    assert ("np.atleast_1d(x)" if what == "int" else "np.asarray(x)") in str(info.value)


@pytest.mark.parametrize("what", [w for w in NOT_ARRAYS if w != "None"])
@pytest.mark.parametrize("door", WHOLE_ARRAY_DOORS)
def test_whole_array_refusing_an_out_that_is_not_an_array_names_what_it_got(dev, door, what):
    """The message read "got None list" (a list's missing shape, then its type)."""
    with pytest.raises(ValueError, match=f"out must be a numpy array of shape \\(64,\\) and dtype float32, got "
                                         f"a {type(NOT_ARRAYS[what]).__name__};"):
        run(door, "stage", dev, data(), NOT_ARRAYS[what])


@pytest.mark.parametrize("what", NOT_ARRAYS)
def test_pipeline_refuses_items_that_are_not_arrays(dev, what):
    with rf.Pipeline(compute, device=dev, chunk_bytes=PIPE_CHUNK) as pipe:
        with pytest.raises(TypeError, match="items (.*)?must be numpy arrays"):
            pipe.submit(NOT_ARRAYS[what])
        with pytest.raises(TypeError, match="items (.*)?must be numpy arrays"):
            list(pipe.map([data(4), NOT_ARRAYS[what]]))


@pytest.mark.parametrize("door,setting", [(d, s) for d in WHOLE_ARRAY_DOORS for s in ENGINE_SETTINGS])
def test_whole_array_refuses_object_and_0d_arrays(dev, door, setting):
    with pytest.raises(TypeError, match="dtype object"):
        run(door, setting, dev, np.array([1, "a", None], dtype=object))
    with pytest.raises(ValueError, match="at least one dimension"):
        run(door, setting, dev, np.array(3.0, np.float32))


def test_pipeline_refuses_object_items_before_accepting_them(dev):
    with rf.Pipeline(compute, device=dev, chunk_bytes=PIPE_CHUNK) as pipe:
        with pytest.raises(TypeError, match="dtype object"):
            pipe.submit(np.array([1, "a", None], dtype=object))


# dtypes ringflow cannot move for GPU code: items of 0 bytes (nothing to move, nothing to rebuild
# from), bytes in the other byte order (numpy reads them right, but CuPy, PyTorch and a CUDA
# kernel know only the native order and would compute on misread values: wrong on a GPU only),
# and dtypes no GPU array holds (dates, strings, records, raw bytes, long doubles: the simulated
# GPU computed on them, a GPU failed in the framework at the first compute).
# (dtype, the error, what its message says after the name)
UNMOVABLE_DTYPES = [
    (np.dtype("V0"), ValueError, r"dtype \|V0 has items of 0 bytes.*at least 1 byte"),
    (np.dtype([]), ValueError, r"dtype .* has items of 0 bytes.*at least 1 byte"),
    (np.dtype("f4").newbyteorder(), TypeError, r"dtype >f4 is in non-native byte order.*newbyteorder"),
    (np.dtype([("a", "u1"), ("b", np.dtype("i2").newbyteorder())]), TypeError, r"dtype .* non-native byte order"),
] + [(dtype, TypeError, refusal(dtype, advice)) for dtype, advice in NOT_DEVICE_DTYPES]
UNMOVABLE_IDS = ["V0", "no fields", "swapped", "swapped field"] + NOT_DEVICE_IDS


@pytest.mark.parametrize("dtype,error,says", UNMOVABLE_DTYPES, ids=UNMOVABLE_IDS)
@pytest.mark.parametrize("door,setting", [(d, s) for d in WHOLE_ARRAY_DOORS for s in ENGINE_SETTINGS])
def test_whole_array_refuses_an_unmovable_dtype_naming_x_or_output(dev, door, setting, dtype, error, says):
    with pytest.raises(error, match=r"^x: " + says):
        run(door, setting, dev, np.zeros(N, dtype))
    with pytest.raises(error, match=r"^output: " + says):
        run(door, setting, dev, output=((N,), dtype))


@pytest.mark.parametrize("dtype,error,says", UNMOVABLE_DTYPES, ids=UNMOVABLE_IDS)
@pytest.mark.parametrize("shape", ["array", "dict"])
def test_pipeline_refuses_items_of_an_unmovable_dtype_before_accepting_them(dev, dtype, error, says, shape):
    item = np.zeros(4, dtype) if shape == "array" else {"a": np.zeros(4, dtype), "b": np.ones(3, np.float32)}
    with rf.Pipeline(compute, device=dev, chunk_bytes=PIPE_CHUNK) as pipe:
        with pytest.raises(error, match=r"^items.*: " + says):
            pipe.submit(item)
        assert pipe.stats().accepted == 0
        np.testing.assert_array_equal(pipe.submit(data(4)).result(timeout=30), expected(data(4)))


@pytest.mark.parametrize("dtype,error,says", UNMOVABLE_DTYPES, ids=UNMOVABLE_IDS)
def test_pipeline_refuses_outputs_of_an_unmovable_dtype_naming_output(dev, dtype, error, says):
    with pytest.raises(error, match=r"^output: " + says):
        rf.Pipeline(compute, device=dev, chunk_bytes=PIPE_CHUNK, output=((3,), dtype))
    with rf.Pipeline(compute, device=dev, chunk_bytes=PIPE_CHUNK, output=lambda item: {"a": ((3,), dtype)}) as pipe:
        with pytest.raises(error, match=r"^output\(item\): " + says):
            pipe.submit(data(4))
    assert pipe.stats().accepted == 0


@pytest.mark.parametrize("dtype,error,says", UNMOVABLE_DTYPES, ids=UNMOVABLE_IDS)
def test_a_prepared_array_of_an_unmovable_dtype_fails_its_item_naming_prepare(dev, dtype, error, says):
    with rf.Pipeline(compute, device=dev, chunk_bytes=PIPE_CHUNK, on_error="continue",
                     prepare=lambda i: np.zeros(4, dtype) if i == 1 else data(4)) as pipe:
        with pytest.raises(StageError, match=r"prepare.*" + says):
            pipe.submit(1).result(timeout=30)
        np.testing.assert_array_equal(pipe.submit(2).result(timeout=30), expected(data(4)))


@pytest.mark.parametrize("door,setting", [(d, s) for d in WHOLE_ARRAY_DOORS for s in ENGINE_SETTINGS])
def test_whole_array_asks_the_device_whether_its_arrays_hold_x_and_output(dev, door, setting):
    """A device's array type may hold fewer dtypes than the rule allows; x and output are refused
    by the device's own check before any device work, not by the first chunk's compute."""
    dev = holding_no_uint16(dev)
    ops = []
    dev.add_op_observer(ops.append)
    with pytest.raises(TypeError, match=r"^x: dtype uint16 is not held by this device's arrays"):
        run(door, setting, dev, np.zeros(N, np.uint16))
    with pytest.raises(TypeError, match=r"^output: dtype uint16 is not held by this device's arrays"):
        run(door, setting, dev, output=((N,), np.uint16))
    assert ops == []


def test_a_pipeline_asks_the_device_whether_its_arrays_hold_items_and_outputs(dev):
    dev = holding_no_uint16(dev)
    with pytest.raises(TypeError, match=r"^output: dtype uint16 is not held"):
        rf.Pipeline(compute, device=dev, chunk_bytes=PIPE_CHUNK, output={"a": ((3,), np.uint16)})
    with rf.Pipeline(compute, device=dev, chunk_bytes=PIPE_CHUNK, output=lambda item: ((3,), np.uint16)) as pipe:
        with pytest.raises(TypeError, match=r"^output\(item\): dtype uint16 is not held"):
            pipe.submit(data(4))
        assert pipe.stats().accepted == 0
    with rf.Pipeline(compute, device=dev, chunk_bytes=PIPE_CHUNK) as pipe:
        with pytest.raises(TypeError, match=r"^items: dtype uint16 is not held"):
            pipe.submit(np.zeros(4, np.uint16))
        with pytest.raises(TypeError, match=r"^items \(each array of a tuple, list or dict\): dtype uint16 is not held"):
            pipe.submit({"a": data(4), "b": np.zeros(4, np.uint16)})
        assert pipe.stats().accepted == 0
        np.testing.assert_array_equal(pipe.submit(data(4)).result(timeout=30), expected(data(4)))


@pytest.mark.parametrize("made", ["one array", "a dict of arrays"])
def test_prepared_arrays_are_asked_of_the_device_in_the_prepare_stage(dev, made):
    """What ``prepare`` returns is checked by the device's own narrowing as it is staged, so the
    chunk fails in prepare naming it, not later where the device first makes its array."""
    dev = holding_no_uint16(dev)

    def prepare(i):
        if i != 1:
            return data(4)
        return np.zeros(4, np.uint16) if made == "one array" else {"a": data(4), "b": np.zeros(4, np.uint16)}

    def each_leaf(x, y):
        for a, b in zip(flatten(x)[0], flatten(y)[0]):
            compute(a, b)

    with rf.Pipeline(each_leaf, device=dev, chunk_bytes=PIPE_CHUNK, on_error="continue", prepare=prepare) as pipe:
        with pytest.raises(StageError, match=r"prepare.*prepare's arrays?[ :].*dtype uint16 is not held") as info:
            pipe.submit(1).result(timeout=30)
        assert info.value.stage == "prepare"
        assert pipe.submit(2).result(timeout=30) is not None


@pytest.mark.parametrize("door,setting", [(d, s) for d in WHOLE_ARRAY_DOORS for s in ENGINE_SETTINGS])
def test_read_only_out_is_refused(dev, door, setting):
    out = np.zeros(N, np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out is read-only"):
        run(door, setting, dev, data(), out)
    assert not out.any()


@pytest.mark.parametrize("door,setting", [(d, s) for d in WHOLE_ARRAY_DOORS for s in ENGINE_SETTINGS]
                         + [("Pipeline", None)])
def test_nan_and_inf_flow_through(dev, door, setting):
    x = data()
    x[1::7], x[2::11], x[::3] = INF, -INF, NAN
    result = run(door, setting, dev, x.copy())
    assert np.array_equal(result, expected(x), equal_nan=True)
    assert np.isnan(result[::3]).all() and np.array_equal(np.isinf(result), np.isinf(x))


@pytest.mark.parametrize("door,setting", [(d, s) for d in WHOLE_ARRAY_DOORS for s in ENGINE_SETTINGS]
                         + [("Pipeline", None)])
def test_sixty_four_dimensions(dev, door, setting):
    x = (np.arange(8, dtype=np.float32) - 2).reshape((8,) + (1,) * 63)
    result = run(door, setting, dev, x, chunk_bytes=8)
    assert result.reshape(-1).tolist() == expected(x).reshape(-1).tolist()


@pytest.mark.parametrize("dtype", [bool, np.complex128, "=f4", np.uint64, np.float16, np.int8])
@pytest.mark.parametrize("setting", ENGINE_SETTINGS)
def test_any_device_dtype_moves_as_bytes(dev, setting, dtype):
    x = np.arange(12).astype(np.float32).astype(dtype)

    def copy(a, b):
        b[...] = a

    out = run("stream_map", setting, dev, x, f=copy, chunk_bytes=x.itemsize * 5)
    assert out.dtype == x.dtype and out.tobytes() == x.tobytes()


@pytest.mark.parametrize("shape", [(0,), (4, 0), (0, 3)])
@pytest.mark.parametrize("setting", ENGINE_SETTINGS)
def test_zero_size_array_returns_at_once_with_no_device_work(dev, monkeypatch, setting, shape):
    ops = []
    dev.add_op_observer(ops.append)
    for name in ("allocate", "allocate_host", "register_host", "create_stream"):
        monkeypatch.setattr(dev, name, lambda *a, _n=name, **k: pytest.fail(f"{_n} called for an empty array"))
    x = np.zeros(shape, np.float32)
    result = run("stream_map", setting, dev, x)
    assert result.shape == shape and result.dtype == x.dtype
    out = np.zeros(shape, np.float32)
    assert run("stream_map", setting, dev, x, out) is out
    with pytest.raises(ValueError, match="at least one element in x"):
        run("MapJob", setting, dev, x)
    assert ops == []


# -- 10. random mixes of good and bad options --------------------------------------------------------------------------
def _conflicts(door: str, opts: dict) -> set:
    """Arguments that good values of other arguments make wrong together (each such refusal
    names one of them)."""
    found = set()
    if door != "Pipeline" and opts.get("engine") == "direct" and (opts.get("host", "auto") != "register"
                                                                 or opts.get("on_error") == "continue"):
        found |= {"engine", "host", "on_error"}
    slots = opts.get("slots")
    if isinstance(slots, SlotCounts) and (slots.device_out != 0) == bool(opts.get("inplace", False)):
        found |= {"slots", "inplace"}
    return found


@st.composite
def door_and_options(draw):
    door = draw(st.sampled_from(ALL_DOORS))
    names = DOOR_OPTIONS[door]
    opts = {}
    for name in names:
        good = GOOD_WHOLE_ARRAY_CHUNKS if (name == "chunk_bytes" and door != "Pipeline") else GOOD[name]
        if draw(st.booleans()):
            opts[name] = draw(st.sampled_from(good))
    spoiled = draw(st.permutations(names))[:draw(st.integers(0, 3))]
    for name in spoiled:
        opts[name] = draw(st.sampled_from(BAD[name]))
    return door, opts, set(spoiled)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(door_and_options())
def test_random_options_run_right_or_are_refused_by_name(case):
    door, opts, spoiled = case
    dev = unit_device()
    x = data()
    got = outcome(lambda: call(door, dev, x.copy(), **opts))
    event(f"{door}: {'ran' if got[0] == 'ok' else 'refused'}")
    if got[0] == "ok":
        assert not spoiled, f"{door} accepted bad {sorted(spoiled)}: {opts}"
        assert np.array_equal(got[1], expected(x))
    else:
        assert got[0] in (TypeError, ValueError), f"{door}({opts}) raised {got}"
        allowed = spoiled | _conflicts(door, opts)
        assert allowed, f"{door} refused good options {opts}: {got[2]}"
        assert got[1] & allowed, f"{door}({opts}): {got[2]!r} names none of {sorted(allowed)}"
    assert settle(dev) == 0, f"{door}({opts}) left {dev.live()}"


def _boom(nbytes):
    raise RuntimeError("no cost model here")


@pytest.mark.parametrize("cost", ["abc", float("nan"), -1.0, float("inf"), True, _boom, lambda n: None,
                                  lambda n: "1e-3", lambda n: -2e-6, 1e9, lambda n: 1e30],
                         ids=["str", "nan", "negative", "inf", "bool", "raises", "returns-None", "returns-str",
                              "returns-negative", "a-billion-seconds", "returns-1e30"])
@pytest.mark.parametrize("door", ALL_DOORS)
def test_a_compute_cost_that_is_not_seconds_is_refused_by_name(dev, door, cost):
    """``sim_seconds`` is read by the planner on every device: a value that is not a finite number
    of seconds >= 0 (or a function that raises or returns one) is refused where the job is
    planned, naming ``sim_seconds``, before any device work."""
    def f(x, y):
        y[...] = x

    f.sim_seconds = cost
    x = rf.host.empty(N, np.float32, device=dev)
    x[:] = 1
    def run():
        if door == "stream_map":
            rf.stream_map(f, x, rf.host.empty_like(x), device=dev, chunk_bytes=64, keep_warm=False)
        elif door == "MapJob":
            with rf.MapJob(f, x, rf.host.empty_like(x), device=dev, chunk_bytes=64) as job:
                job()
        else:
            with rf.Pipeline(f, device=dev, chunk_bytes=PIPE_CHUNK) as pipe:
                pipe.submit(x).result()

    with pytest.raises(ValueError, match="sim_seconds"):
        bounded(run, timeout=20)  # a kernel of 1e9 virtual seconds: refused, not simulated for ever


@pytest.mark.parametrize("cost", [_boom, lambda n: None, lambda n: -2e-6, lambda n: 1e30],
                         ids=["raises", "returns-None", "returns-negative", "returns-1e30"])
@pytest.mark.parametrize("coalesce", [True, False])
def test_a_compute_cost_that_fails_for_one_item_size_fails_that_item_alone(dev, cost, coalesce):
    """A Pipeline's items come in sizes the planner never saw: a ``sim_seconds`` function that
    fails only for one of them (raises, or gives no seconds) fails that item's compute, naming
    ``sim_seconds``; the progress thread goes on, other items are delivered and close() ends it."""
    def f(x, y):
        y[...] = x

    f.sim_seconds = lambda nbytes: cost(nbytes) if nbytes == 40 else 1e-6
    with rf.Pipeline(f, device=dev, chunk_bytes=PIPE_CHUNK, on_error="continue", coalesce=coalesce) as pipe:
        bad = pipe.submit(data(10))  # 40 bytes
        with pytest.raises(StageError, match="sim_seconds") as caught:
            bounded(bad.result, timeout=20)
        assert caught.value.stage == "compute"
        assert np.array_equal(bounded(pipe.submit(data(12)).result, timeout=20), data(12))
    assert pipe.stats().failed == 1 and pipe.stats().delivered == 1


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit])
def test_a_compute_cost_that_raises_an_interrupt_for_one_item_size_fails_that_item_with_it(dev, exc_type):
    """The cost is read as the item's compute is launched, on the progress thread: an interrupt
    it raises fails that item, its future raising the very object, as one the compute raises."""
    boom = exc_type("stop in sim_seconds")

    def f(x, y):
        y[...] = x

    def cost(nbytes):
        if nbytes == 40:
            raise boom
        return 1e-6

    f.sim_seconds = cost
    with rf.Pipeline(f, device=dev, chunk_bytes=PIPE_CHUNK, on_error="continue") as pipe:
        bad = pipe.submit(data(10))  # 40 bytes
        with pytest.raises(exc_type) as caught:
            bounded(bad.result, timeout=20)
        assert caught.value is boom
        assert np.array_equal(bounded(pipe.submit(data(12)).result, timeout=20), data(12))
    assert pipe.stats().failed == 1 and pipe.stats().delivered == 1
    del caught
    boom.__traceback__ = None


DAY = 86400.0


@pytest.mark.parametrize("door", ALL_DOORS)
def test_a_compute_said_to_take_a_day_runs_in_a_few_device_waits(dev, monkeypatch, door):
    """``sim_seconds`` may be any duration up to MAX_SIM_SECONDS: the simulated GPU's waits are virtual, so a
    driver waits there until a fence completes rather than looking again every 50 virtual ms
    (a kernel said to take a day took over a million scheduler steps: a hang)."""
    def slow(x, y):
        y[...] = x * 2 + 1

    slow.sim_seconds = DAY
    waits = []
    real_wait = dev.wait_any
    monkeypatch.setattr(dev, "wait_any", lambda *a, **k: waits.append(1) or real_wait(*a, **k))
    x = data()
    result = bounded(lambda: call(door, dev, x, f=slow, chunk_bytes=128), timeout=20)
    assert np.array_equal(result, expected(x)) and dev.now >= DAY
    assert len(waits) < 200, len(waits)


@pytest.mark.parametrize("made, message", [
    (None, r"prepare must return a numpy array \(or a tuple, list or dict of them\), got NoneType"),
    ([1.0, 2.0], r"^prepare's arrays \(each array of a tuple, list or dict\) must be numpy arrays[^=]*got float$"),
])
def test_what_prepare_returns_wrongly_is_named_without_suggesting_prepare(dev, made, message):
    with rf.Pipeline(compute, device=dev, chunk_bytes=PIPE_CHUNK, prepare=lambda i: made) as pipe:
        with pytest.raises(rf.StageError) as info:
            pipe.submit(1).result(timeout=30)
    assert isinstance(info.value.__cause__, TypeError)
    assert re.search(message, str(info.value.__cause__)), info.value.__cause__


def test_arity_is_read_from_an_inherited_call_and_skipped_where_it_cannot_be_read():
    """A callable object's ``__call__`` may come from a base class; a callable whose signature
    cannot be read from its code (a builtin, a partial) is checked when it is called."""
    import functools

    from ringflow._pipeline.validate import cannot_take

    class Base:
        def __call__(self, x):
            return x

    class Derived(Base):
        pass

    assert cannot_take(Derived(), 2).startswith("Derived")
    assert cannot_take(Derived(), 1) is None
    assert cannot_take(functools.partial(lambda a, x: x, 1), 2) is None
    assert cannot_take(print, 2) is None and cannot_take(Base, 2) is None


def _f_add_one(x, y):
    y[...] = x + 1


@pytest.mark.parametrize("how", ["map", "amap"])
def test_a_1d_array_handed_to_map_warns_that_each_element_becomes_an_item(dev, how):
    """``pipe.map(x)`` on a 1-D array makes each element a 0-d item (a chunk or a share of one
    each), where the caller almost always meant to stream the array: the results are right,
    and a warning names the call and the one to use instead."""
    import asyncio

    x = np.arange(6, dtype=np.float32)
    with rf.Pipeline(_f_add_one, device=dev, chunk_bytes=4096) as pipe, pytest.warns(UserWarning) as seen:
        if how == "map":
            out = list(pipe.map(x))
        else:
            async def take():
                return [r async for r in pipe.amap(x)]
            out = asyncio.run(take())
    assert [float(v) for v in out] == [1, 2, 3, 4, 5, 6]
    (warning,) = [w for w in seen if "element" in str(w.message)]
    assert f"Pipeline.{how}()" in str(warning.message) and "stream_map" in str(warning.message)
    assert warning.filename == __file__  # the caller's line, not ringflow's


def test_arrays_of_rows_and_items_for_a_prepare_go_to_map_without_a_warning(dev):
    """Rows of a 2-D array are items of their own by design, and a prepare's items are whatever
    it takes (indices, names): neither warns."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with rf.Pipeline(_f_add_one, device=dev, chunk_bytes=4096) as pipe:
            assert len(list(pipe.map(np.zeros((3, 4), np.float32)))) == 3
        with rf.Pipeline(_f_add_one, device=dev, chunk_bytes=4096,
                         prepare=lambda i: np.full(4, i, np.float32)) as pipe:
            assert [float(r[0]) for r in pipe.map(np.arange(3))] == [1, 2, 3]
