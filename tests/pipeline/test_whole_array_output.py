"""``stream_map(..., output=...)`` and ``MapJob(..., output=...)``: whole-array results of another
row shape and dtype than the input.

The compute writes, row by row, ``2 * x`` (as the output dtype) into the first elements of each
result row and 7 into the rest, so every result is known exactly whatever the spec: smaller,
larger, another dtype; on either engine, staged or registered, on one device or several."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ringflow as rf
from ringflow import _plan as plan
from tests.helpers.sim import counting_allocations


def by_rows(x, y):
    flat, out = x.reshape(x.shape[0], -1), y.reshape(y.shape[0], -1)
    n = min(flat.shape[1], out.shape[1])
    out[:, :n] = (flat[:, :n] * 2).astype(out.dtype)
    out[:, n:] = 7


def expected(x: np.ndarray, shape, dtype) -> np.ndarray:
    out = np.empty(shape, dtype)
    by_rows(x, out)
    return out


DTYPES = ["uint8", "int16", "float16", "float32", "float64"]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(1, 200), tail=st.lists(st.integers(1, 12), max_size=2),
       out_tail=st.lists(st.integers(1, 40), max_size=2), dtype=st.sampled_from(DTYPES),
       host=st.sampled_from(["stage", "register"]), engine=st.sampled_from(["auto", "pipeline"]),
       chunk_rows=st.integers(1, 64), seed=st.integers(0, 2 ** 16))
def test_random_whole_array_output_specs_come_back_exact(rows, tail, out_tail, dtype, host, engine, chunk_rows, seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 50, (rows, *tail)).astype(np.float32)
    shape = (rows, *out_tail)
    out_row = int(np.prod(out_tail, dtype=np.int64)) * np.dtype(dtype).itemsize
    chunk_bytes = chunk_rows * max(x[0].nbytes, out_row)
    dev = rf.device("sim", chaos=True, seed=seed, checked=True)
    y = rf.stream_map(by_rows, x, device=dev, chunk_bytes=chunk_bytes, host=host, engine=engine,
                      output=(shape, dtype), checked=True, keep_warm=False)
    assert y.shape == shape and y.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(y, expected(x, shape, dtype))
    assert dev.live().device_buffers == 0


@pytest.mark.parametrize("host", ["stage", "register"])
def test_a_job_over_reshaped_results_runs_again_on_new_contents(host):
    x = np.arange(60 * 3 * 4, dtype=np.uint8).reshape(60, 3, 4)
    with rf.MapJob(by_rows, x, device=rf.device("sim", chaos=True, seed=3), chunk_bytes=256, host=host,
                   output=((60, 2), "float32"), checked=True) as job:
        np.testing.assert_array_equal(job(), expected(x, (60, 2), np.float32))
        x[:] = 9
        y = job()
        assert y is job.out and y.shape == (60, 2) and y.dtype == np.float32
        np.testing.assert_array_equal(y, np.full((60, 2), 18, np.float32))


def test_out_given_with_output_is_filled_in_place():
    x = np.ones((100, 8), np.int16)
    out = np.zeros((100, 2, 2), np.float64)
    y = rf.stream_map(by_rows, x, out, device=rf.device("sim"), chunk_bytes=320, output=(out.shape, out.dtype))
    assert y is out
    np.testing.assert_array_equal(out, np.full((100, 2, 2), 2.0))


@pytest.mark.parametrize("devices", [["sim:0", "sim:1"], ["sim:0", "sim:1", "sim:2", "sim:3"]])
def test_reshaped_results_over_several_devices_are_bit_identical_to_one(devices):
    x = np.random.default_rng(1).integers(0, 255, (301, 3, 5, 5), dtype=np.uint8)

    def normalise(x, y):
        y[:] = (x.astype(np.float32) / 255).astype(y.dtype)

    one = rf.stream_map(normalise, x, device=rf.device("sim", chaos=True, seed=5), chunk_bytes=4096,
                        output=(x.shape, "float16"))
    many = rf.stream_map(normalise, x, device=devices, chunk_bytes=4096, output=(x.shape, "float16"))
    assert many.dtype == np.float16
    np.testing.assert_array_equal(one, many)
    np.testing.assert_array_equal(one, (x.astype(np.float32) / 255).astype(np.float16))


def test_a_warm_engine_is_not_reused_for_another_output_spec():
    dev = rf.device("sim")
    x = np.ones((64, 4), np.float32)
    a = rf.stream_map(by_rows, x, device=dev, chunk_bytes=256, output=((64, 2), "float32"))
    b = rf.stream_map(by_rows, x, device=dev, chunk_bytes=256, output=((64, 8), "float64"))
    c = rf.stream_map(by_rows, x, device=dev, chunk_bytes=256)
    np.testing.assert_array_equal(a, expected(x, (64, 2), np.float32))
    np.testing.assert_array_equal(b, expected(x, (64, 8), np.float64))
    np.testing.assert_array_equal(c, x * 2)
    rf.drop_warm_pipelines()


def test_only_the_result_bytes_are_copied_back():
    """A reduction to one float16 per row moves a 64th of the input's bytes back: the device-out
    ring and every d2h are sized for the result."""
    dev = rf.device("sim")
    x = np.ones((4096, 32), np.float32)
    copies = []
    dev.add_op_observer(lambda op: copies.append((op.direction, op.nbytes)) if op.direction else None)
    rf.stream_map(by_rows, x, device=dev, chunk_bytes=1 << 14, host="register", output=((4096,), "float16"),
                  keep_warm=False)
    sent = sum(n for d, n in copies if d == "h2d")
    back = sum(n for d, n in copies if d == "d2h")
    assert sent == x.nbytes and back == 4096 * 2


def test_a_larger_result_sets_the_rows_of_a_chunk():
    """``chunk_bytes`` bounds a chunk's input and its result alike: float64 results of uint8
    rows get an eighth of the rows a chunk of the input alone would."""
    x = np.zeros((1024, 16), np.uint8)
    with rf.MapJob(by_rows, x, device=rf.device("sim"), chunk_bytes=1024, output=((1024, 16), "float64")) as job:
        assert job.chunk_bytes == 1024 and job.chunks == 1024 // 8
        np.testing.assert_array_equal(job(), np.zeros((1024, 16)))


@pytest.mark.parametrize("door", ["stream_map", "MapJob"])
def test_a_result_row_larger_than_a_chunk_says_to_shrink_the_row_of_output(door):
    """A result row wider than ``chunk_bytes`` was refused with "raise chunk_bytes ... or reshape
    x": x's rows fit, and reshaping x does not narrow the result's rows, which ``output`` sets."""
    x = np.zeros((16, 4), np.float32)  # 16-byte rows
    spec = ((16, 64), "float64")  # 512-byte rows of the result
    with pytest.raises(ValueError, match=r"one row of the result along axis 0 is 512 bytes but chunk_bytes is 256; "
                                         r"raise chunk_bytes to at least 512 or give output= fewer bytes a row"):
        if door == "stream_map":
            rf.stream_map(by_rows, x, device=rf.device("sim"), chunk_bytes=256, output=spec)
        else:
            rf.MapJob(by_rows, x, device=rf.device("sim"), chunk_bytes=256, output=spec)


@pytest.mark.parametrize("output, error, match", [
    (lambda item: ((1,), "float32"), TypeError, "one \\(shape, dtype\\) pair for the whole result"),
    (((99, 2), "float32"), ValueError, "must start with x's rows \\(100\\)"),
    (((), "float32"), ValueError, "must start with x's rows"),
    (((100, 0), "float32"), ValueError, "no elements in a row"),
    ((7, "float32"), ValueError, "must start with x's rows \\(100\\)"),
    (((100, 2), "no such dtype"), TypeError, "output"),
    ("float32", TypeError, "output must be a \\(shape, dtype\\) pair"),
])
def test_bad_whole_array_output_specs_name_output(output, error, match):
    x = np.ones((100, 4), np.float32)
    with pytest.raises(error, match=match):
        rf.stream_map(by_rows, x, device=rf.device("sim"), output=output)
    with pytest.raises(error, match=match):
        rf.MapJob(by_rows, x, device=rf.device("sim"), output=output)


def test_out_must_agree_with_output_or_say_how():
    x = np.ones((10, 4), np.float32)
    with pytest.raises(ValueError, match="as output= says"):
        rf.stream_map(by_rows, x, np.empty((10, 3), np.float32), device=rf.device("sim"), output=((10, 2), "float32"))
    with pytest.raises(ValueError, match="pass output=\\(shape, dtype\\) too"):
        rf.stream_map(by_rows, x, np.empty((10, 2), np.float32), device=rf.device("sim"))


def test_out_over_the_bytes_of_x_in_another_layout_is_told_to_be_separate():
    """``out=x`` works in place only for a result shaped as ``x``: where ``out`` is ``x``'s bytes
    under another dtype or shape, the refusal's advice is a separate array, not ``out=x``."""
    x = np.ones((10, 4), np.float32)
    for out, output in ((x.view(np.int32), (x.shape, "int32")), (x.reshape(10, 2, 2), ((10, 2, 2), "float32")),
                        (x.view(np.uint8)[:, :4], ((10, 4), "uint8"))):
        with pytest.raises(ValueError, match="overlap") as info:
            rf.stream_map(by_rows, x, out, device=rf.device("sim"), output=output)
        assert "out=x" not in str(info.value) and "separate array" in str(info.value)
    assert (x == 1).all()


def test_output_with_inplace_is_refused_unless_it_is_the_input_shape():
    x = np.ones((10, 4), np.float32)
    with pytest.raises(ValueError, match="inplace=True"):
        rf.stream_map(by_rows, x, device=rf.device("sim"), inplace=True, output=((10, 4), "float64"))
    y = rf.stream_map(lambda a, b: None, x, x, device=rf.device("sim"), inplace=True, output=(x.shape, x.dtype))
    assert y is x


def test_an_empty_x_returns_an_empty_result_of_the_output_spec():
    y = rf.stream_map(by_rows, np.ones((0, 4), np.float32), device=rf.device("sim"), output=((0, 3), "int16"))
    assert y.shape == (0, 3) and y.dtype == np.int16


def test_an_x_without_elements_refuses_an_output_with_elements():
    """``f`` never runs on an ``x`` without elements: a result with elements would come back
    unwritten (``np.empty``'s bytes), so it is refused, naming ``output``."""
    x = np.ones((5, 0), np.float32)
    with pytest.raises(ValueError, match="output.*no elements"):
        rf.stream_map(by_rows, x, device=rf.device("sim"), output=((5,), "float32"))
    with pytest.raises(ValueError, match="output.*no elements"):
        rf.stream_map(by_rows, x, np.zeros(5, np.float32), device=rf.device("sim"), output=((5,), "float32"))
    y = rf.stream_map(by_rows, x, device=rf.device("sim"), output=((5, 0), "int16"))
    assert y.shape == (5, 0) and y.dtype == np.int16


def test_the_planner_counts_the_result_bytes():
    """A job whose results are a tenth of its input leaves the link to the copies in for most of
    each chunk (the link's duplex limit no longer binds): faster than a same-shaped job; results
    twice the input's size take nearly twice as long (the copies back bind)."""
    same = plan.predict_seconds("h200-pcie5", 1 << 30, 8 << 20, host_stages=False)[1]
    small = plan.predict_seconds("h200-pcie5", 1 << 30, 8 << 20, host_stages=False, out_ratio=0.1)[1]
    large = plan.predict_seconds("h200-pcie5", 1 << 30, 8 << 20, host_stages=False, out_ratio=2.0)[1]
    assert small < 0.95 * same and large > 1.7 * same
    assert plan.predict_seconds("h200-pcie5", 1 << 30, 8 << 20, host_stages=False, out_ratio=1.0)[1] == same
    t = plan.queued_stage_times("h200-pcie5", 8 << 20, compute=0.0, workers=1, out_ratio=0.1)
    assert t.d2h < 0.2 * t.h2d


def test_a_result_too_large_to_allocate_names_output():
    x = np.ones((10, 4), np.float32)
    with pytest.raises(MemoryError, match="stream_map could not allocate its result of shape \\(10, 1099511627776\\)"
                                          ".*as output= says.*pass a smaller output"):
        rf.stream_map(by_rows, x, device=rf.device("sim"), output=((10, 1 << 40), "float32"))


def test_shards_cut_the_same_chunks_as_one_device_when_the_result_is_wider():
    """Over several devices every shard cuts chunks of the rows one device would (the wider of a
    row of x and a row of the result sets them), so a failing chunk's index and rows mean the
    same either way."""
    x = np.arange(400 * 4, dtype=np.uint8).reshape(400, 4)
    spec = ((400, 4), "float64")  # a result row is 8x an input row: 16 rows a chunk of 512 bytes
    with rf.MapJob(by_rows, x, device=["sim:0", "sim:1"], chunk_bytes=512, output=spec) as job, \
            rf.MapJob(by_rows, x, device=rf.device("sim"), chunk_bytes=512, output=spec) as one:
        assert one._layout.rows == 16
        assert [s.rows for s in job._held.engine.shards] == [16, 16]
        assert [p._layout.rows for p in job._held.engine.parts] == [16, 16]
        np.testing.assert_array_equal(job(), one())


@pytest.mark.parametrize("profile", [False, None, 0])
def test_stream_map_report_refuses_to_be_told_not_to_profile(profile):
    """``stream_map_report`` always profiles: ``profile=False`` was dropped without a word."""
    with pytest.raises(ValueError, match=r"stream_map_report always profiles.*leave profile= out.*stream_map"):
        rf.stream_map_report(by_rows, np.ones((4, 2), np.float32), device=rf.device("sim"), profile=profile)


def test_a_staged_reduction_allocates_out_slots_of_a_results_bytes(monkeypatch):
    """stream_map on the scheduler, staged, with results of 4 bytes a row for 1 KiB of input: the
    host-out and device-out rings are three slots of a chunk's result, the host-in and device-in
    rings three of its input, and the results are exact where the checked mode poisons every
    slot freed."""
    dev = rf.device("sim", checked=True)
    pinned = counting_allocations(monkeypatch, dev, "allocate_host")
    asked = counting_allocations(monkeypatch, dev)
    x = np.random.default_rng(5).integers(-8, 8, (4096, 256)).astype(np.float32)

    def row_sums(x, y):
        y[:] = x.sum(axis=1)

    chunk = 1 << 20  # 1024 rows in, 4 KiB of results out
    y = rf.stream_map(row_sums, x, device=dev, chunk_bytes=chunk, output=((4096,), np.float32), host="stage",
                      engine="pipeline", slots=3, checked=True, keep_warm=False)
    assert pinned == [3 * chunk, 3 * 4096] and asked == [3 * chunk, 3 * 4096]
    np.testing.assert_array_equal(y, x.sum(axis=1))


@pytest.mark.parametrize("inplace", [False, True])
def test_a_staged_job_with_a_wider_result_allocates_device_in_slots_of_an_inputs_bytes(monkeypatch, inplace):
    """A result row four times its input row, on the scheduler: each device-in slot holds a chunk's
    input, each device-out slot its result, and the results are exact where the checked mode
    poisons every slot freed. In place (the result is the input, shaped as it), the one device
    ring's slots hold a chunk."""
    dev = rf.device("sim", checked=True)
    asked = counting_allocations(monkeypatch, dev)
    x = np.random.default_rng(6).integers(-8, 8, (512, 16)).astype(np.float32)
    if inplace:
        def f(x, y):
            np.multiply(x, 3, out=y)

        y = rf.stream_map(f, x, device=dev, chunk_bytes=8192, host="stage", engine="pipeline", slots=3,
                          checked=True, keep_warm=False, inplace=True)
        assert asked == [3 * 8192]
        np.testing.assert_array_equal(y, x * 3)
        return

    def f(x, y):
        y[:] = np.repeat(x, 4, axis=1)

    chunk = 8192  # 32 rows: 2 KiB in, 8 KiB out
    y = rf.stream_map(f, x, device=dev, chunk_bytes=chunk, output=((512, 64), np.float32), host="stage",
                      engine="pipeline", slots=3, checked=True, keep_warm=False)
    assert asked == [3 * 2048, 3 * chunk]
    np.testing.assert_array_equal(y, np.repeat(x, 4, axis=1))


def _widen(x, y):
    y[:] = np.repeat(x, 4, axis=1) * 3


def test_a_staged_widening_pins_host_in_slots_of_an_inputs_bytes(monkeypatch):
    """stream_map on the scheduler, staged, with results 4x a chunk's input: only the input is
    staged into a host-in slot, so the host-in ring is three slots of a chunk's input and the
    host-out ring three of its result; the results are exact where the checked mode poisons every
    slot freed."""
    dev = rf.device("sim", checked=True)
    pinned = counting_allocations(monkeypatch, dev, "allocate_host")
    x = np.random.default_rng(7).integers(-8, 8, (4096, 16)).astype(np.float32)
    chunk = 1 << 16  # 256 rows: 16 KiB in, 64 KiB of results out
    y = rf.stream_map(_widen, x, device=dev, chunk_bytes=chunk, output=((4096, 64), np.float32), host="stage",
                      engine="pipeline", slots=3, checked=True, keep_warm=False)
    assert pinned == [3 * (chunk // 4), 3 * chunk]
    np.testing.assert_array_equal(y, np.repeat(x, 4, axis=1) * 3)


def test_a_staged_widening_fits_a_pinned_budget_of_its_input_sized_host_in_ring(monkeypatch):
    """A pinned_budget that holds three input-sized host-in slots and three result-sized host-out
    slots, and no more, runs the 4x-widening job with the slots given, pinning what it counted."""
    dev = rf.device("sim", checked=True)
    pinned = counting_allocations(monkeypatch, dev, "allocate_host")
    x = np.random.default_rng(8).integers(-8, 8, (4096, 16)).astype(np.float32)
    chunk = 1 << 16
    budget = 3 * (chunk // 4) + 3 * chunk
    y = rf.stream_map(_widen, x, device=dev, chunk_bytes=chunk, output=((4096, 64), np.float32), host="stage",
                      engine="pipeline", slots=3, checked=True, keep_warm=False, pinned_budget=budget)
    assert sum(pinned) == budget
    np.testing.assert_array_equal(y, np.repeat(x, 4, axis=1) * 3)


def test_an_in_place_staged_job_keeps_host_in_slots_of_a_chunk(monkeypatch):
    """An in-place staged job's host-in slots stay a chunk's bytes (the input and the result are
    the same size there), and its results are exact in the checked mode."""
    dev = rf.device("sim", checked=True)
    pinned = counting_allocations(monkeypatch, dev, "allocate_host")
    x = np.random.default_rng(9).integers(-8, 8, (4096, 16)).astype(np.float32)

    def triple(x, y):
        y[...] = x * 3

    chunk = 1 << 14
    y = rf.stream_map(triple, x, device=dev, chunk_bytes=chunk, host="stage", engine="pipeline",
                      slots=rf.SlotCounts(3, 3, 0, 3), inplace=True, checked=True, keep_warm=False)
    assert pinned == [3 * chunk, 3 * chunk]
    np.testing.assert_array_equal(y, x * 3)
