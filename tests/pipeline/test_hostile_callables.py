"""User callables that misbehave in ways the other error tests do not cover: exceptions that
cannot describe themselves, or cannot travel between processes. Each must fail its own chunk
only, as a StageError naming the stage (or as itself, for a BaseException that is not an
Exception), and leave a pipeline that goes on and closes clean."""

from __future__ import annotations


import numpy as np
import pytest

import ringflow as rf
from ringflow._errors import StageError
from tests.helpers.pipeline_checks import closed_clean
from tests.helpers.threads import bounded

STAGES = ("prepare", "compute", "consume", "item_nbytes")
BAD = 2.0  # the first value of the item whose stage raises


class StrRaises(Exception):
    """An exception whose ``str()`` raises (a broken ``__str__``, or one reading a missing attribute)."""

    def __str__(self) -> str:
        raise RuntimeError("this exception cannot describe itself")


class BaseStrRaises(BaseException):
    """A BaseException of the user's own whose ``str()`` raises."""

    def __str__(self) -> str:
        raise RuntimeError("this exception cannot describe itself")


def _pipe_raising(stage: str, exc: BaseException, on_error: str, seed: int = 1, devices: int = 1):
    """A pipeline on the simulated GPU (over ``devices`` of them) whose ``stage`` raises ``exc``
    for the item starting with :data:`BAD`."""
    devs = [rf.device("sim", chaos=True, seed=seed + i, checked=True) for i in range(devices)]

    def fail(*_):
        raise exc

    def f(x, y):
        if stage == "compute" and x[0] == BAD:
            fail()
        y[...] = x * 2

    options: dict = {"chunk_bytes": 256, "slots": 2, "checked": True, "on_error": on_error}
    if stage == "prepare":
        options["prepare"] = lambda item: fail() if item[0] == BAD else item
    elif stage == "consume":
        options["consume"] = lambda index, item, r: fail() if item[0] == BAD else np.array(r)
    elif stage == "item_nbytes":
        options["prepare"] = lambda item: item
        options["item_nbytes"] = lambda item: fail() if item[0] == BAD else item.nbytes
    return devs, rf.Pipeline(f, device=devs[0] if devices == 1 else devs, **options)



@pytest.mark.parametrize("devices", (1, 2), ids=("one-device", "two-devices"))
@pytest.mark.parametrize("stage", STAGES)
def test_an_exception_whose_str_raises_fails_its_chunk_alone(stage, devices):
    # its StageError's message was built with str(cause), which raised on the progress thread:
    # the thread died ("this is a ringflow bug") and every chunk with it
    devs, pipe = _pipe_raising(stage, StrRaises(), "continue", devices=devices)
    futs = [pipe.submit(np.full(4, float(k))) for k in range(5)]
    for k, fut in enumerate(futs):
        if k == BAD:
            with pytest.raises(StageError) as info:
                bounded(lambda f=fut: f.result(timeout=60))
            err = info.value
            assert err.stage == stage and err.index == k
            assert isinstance(err.__cause__, StrRaises)
            assert "StrRaises" in str(err) and "str() raised RuntimeError" in str(err)
        else:
            assert list(bounded(lambda f=fut: f.result(timeout=60))) == [2.0 * k] * 4
    assert [(e.stage, e.index) for e in pipe.failures] == [(err.stage, 2)]
    del info, err, futs, fut
    closed_clean(devs, pipe)


@pytest.mark.parametrize("stage", ("prepare", "compute", "consume"))
def test_a_map_stopped_by_an_exception_whose_str_raises_says_why_it_stopped(stage):
    # on_error="raise": the refusal of later work quotes the failure that stopped the pipeline
    devs, pipe = _pipe_raising(stage, BaseStrRaises(), "raise")
    with pytest.raises(BaseStrRaises):
        bounded(lambda: list(pipe.map(np.full(4, float(k)) for k in range(5))))
    with pytest.raises(RuntimeError, match="a failure stopped it.*BaseStrRaises: <str[(][)] raised RuntimeError"):
        pipe.submit(np.ones(4))
    closed_clean(devs, pipe)


def test_describe_never_raises():
    from ringflow._errors import describe

    assert describe(ValueError("bad")) == "ValueError: bad"
    assert describe(StrRaises()) == "StrRaises: <str() raised RuntimeError>"
    assert str(StageError("consume", 3, StrRaises())) == \
        "stage 'consume' failed for chunk 3: StrRaises: <str() raised RuntimeError>"


class IterRaisesTypeError:
    """An iterable whose ``__iter__`` has a TypeError of its own."""

    def __iter__(self):
        raise TypeError("a bug inside __iter__")


@pytest.mark.parametrize("call", ("map", "amap"))
def test_a_type_error_raised_inside_iter_is_the_callers_own_not_a_refusal(call):
    # it was replaced by "items must be an iterable of items", hiding the caller's bug and its traceback
    import asyncio

    dev = rf.device("sim", chaos=True, seed=4, checked=True)
    with rf.Pipeline(lambda x, y: np.multiply(x, 2, out=y), device=dev, chunk_bytes=256) as pipe:
        with pytest.raises(TypeError, match="^a bug inside __iter__$"):
            if call == "map":
                pipe.map(IterRaisesTypeError())
            else:
                async def first():
                    async for r in pipe.amap(IterRaisesTypeError()):
                        return r

                asyncio.run(first())
        assert list(pipe.map([np.ones(4)]))[0].tolist() == [2.0] * 4
    assert dev.live().total == 0


# -- StopIteration from a user callable -------------------------------------------------------------
# A StopIteration raised inside map()'s generator became "generator raised StopIteration", and one
# raised where a loop's next() is awaited could end that loop as if the items had run out: each
# callable's must fail loudly, never end a map or stream_map early with what it has.
def _first_results(call: str, pipe: rf.Pipeline, items: list) -> list:
    import asyncio

    if call == "map":
        return list(pipe.map(items))

    async def collect():
        return [r async for r in pipe.amap(items)]

    return asyncio.run(collect())


@pytest.mark.parametrize("call", ("map", "amap"))
@pytest.mark.parametrize("devices", (1, 2), ids=("one-device", "two-devices"))
@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_raising_stop_iteration_fails_the_map_never_ends_it_early(stage, devices, call):
    devs, pipe = _pipe_raising(stage, StopIteration("the user's"), "raise", devices=devices)
    items = [np.full(4, float(k)) for k in range(5)]
    with pytest.raises(StageError) as info:
        bounded(lambda: _first_results(call, pipe, items))
    assert info.value.stage == stage
    assert isinstance(info.value.__cause__, StopIteration) and "StopIteration: the user's" in str(info.value)
    del info
    closed_clean(devs, pipe)


def _output_stopping(item):
    if item[0] == BAD:
        raise StopIteration("the user's")
    return item.shape, item.dtype


@pytest.mark.parametrize("call", ("submit", "map", "amap"))
@pytest.mark.parametrize("devices", (1, 2), ids=("one-device", "two-devices"))
def test_an_output_callable_raising_stop_iteration_is_refused_naming_output_and_the_item(devices, call):
    """It came out of submit as a bare StopIteration (ending a loop of the caller's that called
    submit inside a generator, silently) and out of map as 'generator raised StopIteration'."""
    devs = [rf.device("sim", chaos=True, seed=5 + i, checked=True) for i in range(devices)]
    pipe = rf.Pipeline(lambda x, y: np.multiply(x, 2, out=y), device=devs[0] if devices == 1 else devs,
                       chunk_bytes=256, output=_output_stopping)
    items = [np.full(4, float(k)) for k in range(5)]
    with pytest.raises(TypeError) as info:
        if call == "submit":
            for item in items:
                pipe.submit(item).result(timeout=60)
        else:
            bounded(lambda: _first_results(call, pipe, items))
    text = str(info.value)
    assert text.startswith("output(item) must return the result's (shape, dtype); for item "
                           "array([2., 2., 2., 2.]) it raised StopIteration: the user's. "), text
    assert "end the items' iterator" in text and isinstance(info.value.__cause__, StopIteration)
    del info
    assert list(bounded(lambda: pipe.submit(np.ones(4)).result(timeout=60))) == [2.0] * 4  # it goes on
    closed_clean(devs, pipe)


@pytest.mark.parametrize("setting", ["stage", "register-direct", "register-pipeline"])
@pytest.mark.parametrize("door", ["stream_map", "MapJob"])
def test_a_whole_array_compute_raising_stop_iteration_fails_the_call(door, setting):
    from tests.helpers.hostile import ENGINE_SETTINGS, call

    def stops(x, y):
        if (x == 300).any():
            raise StopIteration("the user's")
        y[...] = x * 2

    dev = rf.device("sim", chaos=True, seed=6, checked=True)
    x = np.arange(4096, dtype=np.float32)
    with pytest.raises(StageError) as info:
        call(door, dev, x, f=stops, chunk_bytes=1024, **ENGINE_SETTINGS[setting])
    assert info.value.stage == "compute" and isinstance(info.value.__cause__, StopIteration)
    del info
    rf.drop_warm_pipelines()
    import gc

    gc.collect()
    assert dev.live().total == 0


class ReprRaises:
    """An item whose ``repr()`` raises."""

    def __repr__(self) -> str:
        raise RuntimeError("this item cannot show itself")


def test_an_output_stop_iteration_for_an_item_that_cannot_show_itself_still_names_output():
    def output(item):
        raise StopIteration

    dev = rf.device("sim", chaos=True, seed=7, checked=True)
    pipe = rf.Pipeline(lambda x, y: np.multiply(x, 2, out=y), device=dev, chunk_bytes=256,
                       prepare=lambda item: np.ones(4), output=output)
    with pytest.raises(TypeError, match=r"^output\(item\) must return the result's \(shape, dtype\); for item "
                                        r"<ReprRaises object: repr\(\) raised RuntimeError> it raised StopIteration\. "):
        pipe.submit(ReprRaises())
    closed_clean([dev], pipe)


def test_shown_cuts_a_long_repr_and_never_raises():
    from ringflow._errors import shown

    assert shown("x" * 200, width=10) == "'xxxxxx..."
    assert shown([1, 2]) == "[1, 2]"
    assert shown(ReprRaises()) == "<ReprRaises object: repr() raised RuntimeError>"
