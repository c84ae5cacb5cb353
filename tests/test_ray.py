"""rf.RayMapper: batches through the GPU function called directly, then end to end on a local
Ray instance with the simulated GPU (CPU-only actors)."""

from __future__ import annotations

import copy
import dataclasses
import gc
import os
import pathlib
import pickle
import subprocess
import sys
import threading
import weakref

import numpy as np
import pytest

import ringflow as rf
from ringflow._device.hardware import get_profile
from ringflow._ray import BatchStageError

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Ray Data's own context warns about its deprecated settings whenever it is copied; starting Ray and
# its actors takes longer than pyproject's default per-test timeout allows for
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context"), pytest.mark.timeout(300)]


def affine(x, y):
    y[...] = x * 2 + 1


def fails_on_2345(x, y):
    if (x == 2345).any():
        raise ValueError("row value 2345 is refused")
    y[...] = x * 2 + 1


class Unpicklable(Exception):
    def __init__(self, message):
        super().__init__(message)
        self.lock = threading.Lock()


def fails_unpicklably(x, y):
    raise Unpicklable("holds a lock")


class NeedsTwoArguments(Exception):
    """Pickles, but cannot be unpickled: pickle rebuilds it from ``args``, one argument."""

    def __init__(self, message, code):
        super().__init__(message)
        self.code = code


def fails_not_unpicklably(x, y):
    raise NeedsTwoArguments("needs two", 2)


class StrRaises(Exception):
    def __str__(self):
        raise RuntimeError("this exception cannot describe itself")


def fails_undescribably(x, y):
    raise StrRaises()


@pytest.fixture
def mapper_factory():
    made = []

    def make(*args, **kwargs):
        kwargs.setdefault("device", "sim")
        m = rf.RayMapper(*args, **kwargs)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()
        assert m.device.closed


def numeric_batch(n=10_000):
    return {"id": np.arange(n) + 1000, "a": np.arange(n, dtype=np.float32),
            "b": np.linspace(-1, 1, n, dtype=np.float32), "label": np.array(["r"] * n)}


# -- called directly (no Ray needed) ---------------------------------------------------------


def test_one_column_to_a_new_column_others_pass_through(mapper_factory):
    m = mapper_factory(affine, ["a"], ["y"], chunk_bytes=4096)
    batch = numeric_batch()
    out = m(batch)
    assert list(out) == ["id", "a", "b", "label", "y"]
    np.testing.assert_array_equal(out["y"], batch["a"] * 2 + 1)
    assert out["a"] is batch["a"] and out["label"] is batch["label"]


def test_several_columns_stacked_and_split_back(mapper_factory):
    seen = []

    def f(x, y):
        seen.append(x.shape)
        y[...] = x * 2 + 1

    m = mapper_factory(f, ["a", "b"], ["a2", "b2"], chunk_bytes=8192)
    batch = numeric_batch()
    out = m(batch)
    np.testing.assert_array_equal(out["a2"], batch["a"] * 2 + 1)
    np.testing.assert_array_equal(out["b2"], batch["b"] * 2 + 1)
    assert out["a2"].flags.c_contiguous and out["a2"].shape == (10_000,)
    assert seen[0] == (1024, 2)  # a chunk holds whole rows of both columns


def test_results_replace_the_columns_by_default_and_tensor_columns_keep_their_shape(mapper_factory):
    m = mapper_factory(affine, "t", chunk_bytes=4096)
    t = np.arange(3000 * 4, dtype=np.float64).reshape(3000, 4)
    out = m({"t": t})
    assert list(out) == ["t"] and out["t"].shape == (3000, 4)
    np.testing.assert_array_equal(out["t"], t * 2 + 1)


def test_a_read_only_zero_copy_batch_is_streamed(mapper_factory):
    a = np.arange(5000, dtype=np.int32)
    a.flags.writeable = False  # as Ray hands out zero-copy batches
    out = mapper_factory(affine, "a", "y", chunk_bytes=2048)({"a": a})
    np.testing.assert_array_equal(out["y"], a * 2 + 1)


def test_a_pandas_batch_comes_back_as_a_dataframe(mapper_factory):
    pd = pytest.importorskip("pandas")
    batch = numeric_batch(5000)
    df = pd.DataFrame(batch)
    out = mapper_factory(affine, ["a", "b"], ["a2", "b2"], chunk_bytes=4096)(df)
    assert isinstance(out, pd.DataFrame)
    assert list(out.columns) == ["id", "a", "b", "label", "a2", "b2"]
    np.testing.assert_array_equal(out["a2"].to_numpy(), batch["a"] * 2 + 1)
    np.testing.assert_array_equal(out["b2"].to_numpy(), batch["b"] * 2 + 1)
    assert list(df.columns) == ["id", "a", "b", "label"]  # the input frame is left as it was


def test_a_pandas_tensor_column_comes_back_as_a_tensor_column(mapper_factory):
    # Ray Data hands a fixed-shape tensor column to a pandas batch as its TensorArray; the results
    # (n, 3) used to reach DataFrame.assign as they were: "Expected a 1D array, got (5000, 3)"
    pd = pytest.importorskip("pandas")
    extensions = pytest.importorskip("ray.data.extensions")
    t = np.random.default_rng(4).random((5000, 3), dtype=np.float32)
    df = pd.DataFrame({"id": np.arange(5000), "t": extensions.TensorArray(t)})
    out = mapper_factory(affine, "t", "y", chunk_bytes=4096)(df)
    assert isinstance(out["y"].dtype, extensions.TensorDtype)
    np.testing.assert_array_equal(out["y"].to_numpy(), t * 2 + 1)
    np.testing.assert_array_equal(out["t"].to_numpy(), t)  # the input column is left as it was
    same = mapper_factory(affine, "t", chunk_bytes=4096)(df)  # in place of the input column
    np.testing.assert_array_equal(same["t"].to_numpy(), t * 2 + 1)


@pytest.mark.parametrize("frame", [False, True], ids=["dict", "pandas"])
def test_a_column_of_arrays_of_one_shape_is_stacked_and_comes_back_as_rows(mapper_factory, frame):
    # an object column whose rows are numeric arrays of one shape and dtype (built by hand, or
    # by pandas from a list of arrays) used to be refused as "dtype object"
    pd = pytest.importorskip("pandas") if frame else None
    rows = [np.full(4, i, np.float32) for i in range(3000)]
    col = np.empty(len(rows), object)
    col[:] = rows
    batch = pd.DataFrame({"r": rows}) if frame else {"r": col}
    out = mapper_factory(affine, "r", "y", chunk_bytes=4096)(batch)
    got = out["y"].to_numpy() if frame else out["y"]
    if frame:  # as it came: one array per row
        assert got.dtype == object and got.shape == (3000,)
        got = np.stack(list(got))
    np.testing.assert_array_equal(got, np.stack(rows) * 2 + 1)


def test_a_column_of_arrays_of_one_shape_but_several_dtypes_is_named(mapper_factory):
    col = np.empty(4, object)
    col[:] = [np.zeros(2, np.float32), np.zeros(2, np.float64), np.zeros(2, np.float32), np.zeros(2, np.int8)]
    with pytest.raises(ValueError, match=r"column 'r' holds arrays of dtypes float32, float64, int8; pass dtype="):
        mapper_factory(affine, "r")({"r": col})
    out = mapper_factory(affine, "r", dtype="float32")({"r": col})
    np.testing.assert_array_equal(out["r"], np.ones((4, 2), np.float32))


def test_dtype_casts_columns_of_different_dtypes(mapper_factory):
    batch = {"i": np.arange(1000, dtype=np.int64), "f": np.ones(1000, np.float32)}
    with pytest.raises(ValueError, match=r"dtypes differ \(i: int64, f: float32\); pass dtype="):
        mapper_factory(affine, ["i", "f"])(batch)
    out = mapper_factory(affine, ["i", "f"], dtype="float32")(batch)
    assert out["i"].dtype == np.float32
    np.testing.assert_array_equal(out["i"], np.arange(1000) * 2 + 1)


@pytest.mark.parametrize("batch, message", [
    ({"a": np.zeros(10)}, r"no column 'x' \(it has \['a'\]\); fix columns="),
    ({"x": np.array(["s"] * 10, object)}, r"numeric columns; column 'x' has dtype object"),
    ({"x": np.array([np.zeros(3), np.zeros(5), np.zeros(5)] + [np.zeros(k) for k in range(7)], object)},
     r"column 'x' holds arrays of shapes \(3,\), \(5,\), \(0,\), \.\.\. \(a ragged tensor column\): pad"),
    ({"x": np.array([np.zeros(3), np.zeros(5)], object)}, r"arrays of shapes \(3,\), \(5,\) \(a ragged"),
    ({"x": np.array(["s"] * 10)}, r"numeric columns; column 'x' has dtype <U1"),
    ([1, 2, 3], r"dict of numpy arrays \(batch_format='numpy'\) or a pandas DataFrame"),
    # a Python list of rows of different lengths: numpy's own error named no column
    ({"x": [[1.0, 2.0], [3.0]]}, r"column 'x' is not one numpy array \(setting an array element with a sequence.*\); "
                                 r"give it as a numpy array, every row of one shape"),
    ({"x": [1.0, [2.0, 3.0]]}, r"column 'x' is not one numpy array"),
])
def test_batches_it_cannot_stream_are_refused_by_name(mapper_factory, batch, message):
    with pytest.raises((TypeError, ValueError), match=message):
        mapper_factory(affine, "x")(batch)


@pytest.mark.parametrize("columns", ["feat", ["feat", "b"]], ids=["one", "stacked"])
def test_a_column_in_the_other_byte_order_is_named_and_dtype_converts_it(mapper_factory, columns):
    batch = {"feat": np.arange(6, dtype=">f4"), "b": np.ones(6, ">f4")}
    with pytest.raises(TypeError, match=r"column 'feat' has dtype >f4, in non-native byte order.*pass dtype="):
        mapper_factory(affine, columns)(batch)
    out = mapper_factory(affine, columns, dtype="float32")(batch)
    assert out["feat"].dtype == np.float32
    np.testing.assert_array_equal(out["feat"], np.arange(6) * 2 + 1)


def test_without_columns_every_column_is_stacked_and_a_text_column_is_named(mapper_factory):
    out = mapper_factory(affine, chunk_bytes=4096)({"a": np.arange(3000.0), "b": np.ones(3000)})
    np.testing.assert_array_equal(out["a"], np.arange(3000.0) * 2 + 1)
    np.testing.assert_array_equal(out["b"], 3)
    with pytest.raises(TypeError, match=r"column 'label' has dtype <U1; name the columns to stream with columns="):
        mapper_factory(affine)(numeric_batch(100))


@pytest.mark.parametrize("frame", [False, True], ids=["numpy", "pandas"])
def test_columns_named_by_numbers_are_all_streamed_without_columns(mapper_factory, frame):
    batch = {0: np.arange(50.0), 1: np.ones(50)}
    if frame:
        pd = pytest.importorskip("pandas")
        batch = pd.DataFrame(batch)
    out = mapper_factory(affine)(batch)
    np.testing.assert_array_equal(np.asarray(out[0]), np.arange(50.0) * 2 + 1)
    np.testing.assert_array_equal(np.asarray(out[1]), 3)


@pytest.mark.parametrize("dtype", ["Int64", "Float64", "boolean"])
def test_a_pandas_nullable_column_with_missing_values_is_refused_by_name(mapper_factory, dtype):
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame({"a": pd.array([True, None, False] if dtype == "boolean" else [1, None, 3], dtype=dtype)})
    with pytest.raises(TypeError, match=rf"column 'a' of pandas' nullable dtype {dtype} holds missing values.*fillna"):
        mapper_factory(affine, "a")(frame)
    if dtype != "boolean":  # without missing values it streams (as Ray's pyarrow-backed columns do)
        out = mapper_factory(affine, "a")(pd.DataFrame({"a": pd.array([1, 2, 3], dtype=dtype)}))
        np.testing.assert_array_equal(np.asarray(out["a"], float), [3, 5, 7])


@pytest.mark.parametrize("columns", ["a", ["a", "b"]])
def test_a_column_of_one_value_is_refused_by_name(mapper_factory, columns):
    with pytest.raises(TypeError, match=r"column 'a' is a single value \(a 0-d array of float64\)"):
        mapper_factory(affine, columns)({"a": np.array(1.0), "b": np.array(2.0)})


def test_columns_of_different_shapes_are_not_stacked(mapper_factory):
    with pytest.raises(ValueError, match=r"need one shape per row \(a: \(10,\), t: \(10, 2\)\)"):
        mapper_factory(affine, ["a", "t"])({"a": np.zeros(10), "t": np.zeros((10, 2))})


@pytest.mark.parametrize("columns", [["a", "b"], None], ids=["named", "all"])
def test_columns_of_different_lengths_are_named_as_such(mapper_factory, columns):
    with pytest.raises(ValueError, match=r"columns of one batch have one length each; got a: 5 rows, b: 3 rows"):
        mapper_factory(affine, columns)({"a": np.zeros(5), "b": np.zeros(3)})


@pytest.mark.parametrize("columns", ["a", None], ids=["named", "all"])
def test_a_dataframe_with_a_column_name_twice_is_refused_by_name(mapper_factory, columns):
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame([[1.0, 2.0, 3.0]], columns=["a", "a", "b"])
    with pytest.raises(ValueError, match=r"the batch has 2 columns named 'a'; rename them"):
        mapper_factory(affine, columns)(frame)


@pytest.mark.parametrize("ids, named", [(np.arange(3), None), (np.arange(6000).reshape(3000, 2), ([0, 1], [5998, 5999]))],
                         ids=["shorter", "two-wide"])
def test_a_failure_names_its_rows_whatever_the_id_column_holds(mapper_factory, ids, named):
    """An id column that does not hold one value a row names no ids; the failure itself is
    still the error raised."""
    with pytest.raises(BatchStageError) as info:
        mapper_factory(fails_on_2345, "a", id_column="id")({"a": np.arange(3000.0), "id": ids})
    assert info.value.rows == (0, 3000) and info.value.ids == named
    assert isinstance(info.value.__cause__, ValueError)
    assert pickle.loads(pickle.dumps(info.value)).ids == named


@pytest.mark.parametrize("frame", [False, True], ids=["dict", "DataFrame"])
def test_an_id_column_the_batch_lacks_is_refused_by_name_before_any_work(mapper_factory, frame):
    """A misspelt ``id_column`` would only show as failures that name no rows' ids, found when a
    failure needs them: the batch is refused up front, naming the column and the batch's own."""
    batch = {"a": np.arange(3000.0), "ident": np.arange(3000)}
    if frame:
        batch = pytest.importorskip("pandas").DataFrame(batch)
    m = mapper_factory(affine, "a", id_column="id")
    with pytest.raises(ValueError, match=r"the batch has no id_column 'id' \(it has \['a', 'ident'\]\); fix id_column="):
        m(batch)


@pytest.mark.parametrize("args, kwargs, message", [
    (("not callable",), {}, r"needs a callable f\(x, y\)"),
    ((lambda x: x * 2,), {}, r"RayMapper's first argument is called as f\(x, y\), and writes its result into y"),
    ((affine, 3), {}, r"columns must be a column name or a list"),
    ((affine, []), {}, r"columns must be a non-empty list"),
    ((affine, ["a", "a"]), {}, r"columns names a column twice"),
    ((affine, None, ["y"]), {}, r"output_columns needs columns"),
    ((affine, ["a", "b"], ["y"]), {}, r"one column per entry of columns: got 1 for 2"),
    ((affine, "a"), {"dtype": "no such dtype"}, r"dtype .no such dtype. is not a numpy dtype"),
    ((affine, "a"), {"dtype": ","}, r"dtype .,. is not a numpy dtype .invalid syntax."),
    ((affine, "a"), {"dtype": object}, r"dtype must be a numeric numpy dtype"),
    # the columns it streams are numeric, so the dtype they are cast to is too: a string dtype
    # turned numbers into text, a structured or void one into records of raw bytes
    ((affine, "a"), {"dtype": "U5"}, r"dtype must be a numeric numpy dtype .*got <U5"),
    ((affine, "a"), {"dtype": "datetime64[s]"}, r"dtype must be a numeric numpy dtype .*got datetime64\[s\]"),
    ((affine, "a"), {"dtype": [("p", "f4")]}, r"dtype must be a numeric numpy dtype"),
    ((affine, "a"), {"dtype": "V8"}, r"dtype must be a numeric numpy dtype"),
    # every batch would be cast to it and then refused by stream_map, in words about its 'x'
    ((affine, "a"), {"dtype": ">f4"}, r"RayMapper's dtype: dtype >f4 is in non-native byte order.*dtype='float32'"),
    ((affine, "a"), {"id_column": 3}, r"id_column must be a column name"),
    ((affine, "a"), {"chunk_bytes": -1}, r"chunk_bytes"),
    ((affine, "a"), {"host": "pinned"}, r"host"),
    ((affine, "a"), {"engine": "direct", "host": "stage"}, r"engine='direct' cannot run this job: host='stage'"),
    ((affine, "a"), {"engine": "direct", "on_error": "continue"},
     r"engine='direct' cannot run this job: on_error='continue'"),
    ((affine, "a"), {"out": np.zeros(3)}, r"unexpected keyword argument\(s\) \['out'\]"),
    ((affine, "a"), {"device": "gpu"}, r"unknown device 'gpu'"),
    ((affine, "a"), {"device_options": "x"}, r"device_options must be a dict"),
    # (Python's own 'keywords must be strings' named no argument)
    ((affine, "a"), {"device_options": {1: 2}}, r"device_options must map ringflow\.device keyword names \(strings\) "
                                               r"to values, got the key 1 \(int\)"),
])
def test_bad_arguments_are_refused_when_the_mapper_is_made(args, kwargs, message):
    kwargs.setdefault("device", "sim")
    with pytest.raises((TypeError, ValueError), match=message):
        rf.RayMapper(*args, **kwargs)


@pytest.mark.parametrize("arg, kwargs", [
    ("columns", {"columns": {"a", "b"}, "output_columns": ["a2", "b2"]}),
    ("columns", {"columns": frozenset({"a", "b"})}),
    ("output_columns", {"columns": ["a", "b"], "output_columns": {"a2", "b2"}}),
], ids=["columns", "frozenset", "output_columns"])
def test_column_names_in_a_set_are_refused_since_its_order_decides_where_results_go(arg, kwargs):
    """A set was taken in its iteration order, which string hashing makes differ from one
    process (one Ray actor) to the next: column a's results went to b2 in some of them."""
    with pytest.raises(TypeError, match=rf"^{arg} must be .*in order.*got a {type(kwargs[arg]).__name__}"):
        rf.RayMapper(affine, device="sim", **kwargs)


@pytest.mark.parametrize("copy_it", [pickle.dumps, copy.deepcopy], ids=["pickle", "deepcopy"])
def test_a_mapper_does_not_travel_and_says_to_give_ray_the_class(mapper_factory, copy_it):
    """Ray Data takes an instance given to map_batches for a function and pickles it to ship to
    its workers: the error names the class to give instead, not a lock deep in the device."""
    m = mapper_factory(affine, "a")
    with pytest.raises(TypeError, match=r"a RayMapper does not pickle or copy: it holds its process's device.*"
                                        r"map_batches\(rf\.RayMapper, fn_constructor_kwargs=\{'f': f, \.\.\.\}"):
        copy_it(m)
    np.testing.assert_array_equal(m({"a": np.arange(3.0)})["a"], [1, 3, 5])  # unharmed


def test_a_device_object_is_refused_it_does_not_travel_to_actors():
    dev = rf.device("sim")
    with pytest.raises(TypeError, match="device must be a spec string"):
        rf.RayMapper(affine, "a", device=dev)
    dev.close()


@pytest.mark.parametrize("device, env", [
    (["sim:0", "sim:1"], None), (("sim",), None), (3, None), ("cuda:all", None), (" cuda:all ", None),
    (None, "cuda:all"),
], ids=["list", "tuple", "int", "cuda:all", "spaced", "env"])
def test_several_devices_or_no_spec_are_refused_naming_the_mappers_device(monkeypatch, device, env):
    """A list of devices or 'cuda:all' (given, or from RINGFLOW_DEVICE) asks one actor for several
    GPUs, where a mapper runs on one: refused naming RayMapper's device and saying how Ray gives
    each actor its own GPU. The errors named ringflow.device(spec), which the caller never called,
    and sent 'cuda:all' to stream_map's device=, which a mapper's caller cannot reach."""
    if env is not None:
        monkeypatch.setenv("RINGFLOW_DEVICE", env)
    with pytest.raises((TypeError, ValueError), match=r"^RayMapper's device .*one device.*num_gpus=1") as info:
        rf.RayMapper(affine, "a", device=device)
    assert "ringflow.device(spec)" not in str(info.value) and "stream_map" not in str(info.value)


def test_the_device_spec_comes_from_the_environment_when_not_given(monkeypatch):
    monkeypatch.setenv("RINGFLOW_DEVICE", "sim")
    m = rf.RayMapper(affine, "a", device=None, device_options={"profile": "h200-pcie5"})
    assert m.device.name == "simulated h200-pcie5"
    m.close()


@pytest.mark.parametrize("host", ["stage", "register"])
def test_a_failed_chunk_names_its_rows_in_the_batch_also_on_a_warm_engine(mapper_factory, host):
    m = mapper_factory(fails_on_2345, "a", "y", id_column="id", chunk_bytes=1024, host=host)
    good = numeric_batch(5000)
    good["a"] = good["a"] + 10_000
    for _ in range(2):  # the engine is kept warm between these calls and the failing one
        m(good)
    with pytest.raises(rf.StageError) as info:
        m(numeric_batch(5000))
    err = info.value
    # 256 rows of float32 per 1 KiB chunk: row 2345 is in chunk 9, rows 2304..2559
    assert (err.stage, err.index, err.rows, err.batch_rows, err.ids) == ("compute", 9, (2304, 2560), 5000,
                                                                        (3304, 3559))
    assert str(err) == ("stage 'compute' failed for rows 2304..2559 of a batch of 5000 rows (id 3304..3559, chunk 9) "
                        "on simulated h200-pcie5: ValueError: row value 2345 is refused")
    assert isinstance(err.__cause__, ValueError)
    out = m(good)  # the mapper goes on after a failed batch
    np.testing.assert_array_equal(out["y"], good["a"] * 2 + 1)


def test_the_rows_follow_the_planners_chunking_with_chunk_bytes_auto(mapper_factory):
    m = mapper_factory(fails_on_2345, "a", chunk_bytes="auto")
    x = np.arange(1 << 20, dtype=np.float32)
    with pytest.raises(rf.StageError) as info:
        m({"a": x})
    start, stop = info.value.rows
    assert start <= 2345 < stop and stop - start < len(x)


def fails_on_1500000(x, y):
    if (x == 1_500_000).any():
        raise ValueError("row value 1500000 is refused")
    y[...] = x


def _compute_bound_by_its_sim_seconds():
    def f(x, y):
        fails_on_1500000(x, y)

    f.sim_seconds = lambda nbytes: nbytes * 1e-8  # far longer than a chunk's copies: compute-bound
    return f, {}


def _compute_bound_as_measured():
    # kernels slower than any copy, with no cost stated: the direct engine times a chunk of its
    # first call and tapers its later ones
    slow = dataclasses.replace(get_profile("h200-pcie5"), name="slow-kernels", device_GBps=0.5)
    return fails_on_1500000, {"profile": slow}


@pytest.mark.parametrize("compute_bound", [_compute_bound_by_its_sim_seconds, _compute_bound_as_measured])
def test_a_failed_chunk_names_its_rows_where_a_compute_bound_job_tapers_its_chunks(mapper_factory, compute_bound):
    f, device_options = compute_bound()
    m = mapper_factory(f, "a", "y", id_column="id", chunk_bytes=4 << 20, host="register",
                       device_options=device_options)
    n = 4_000_000  # 1 Mi rows of float32 a whole chunk; the first and last ones shorter
    good = {"a": np.arange(n, dtype=np.float32) + n, "id": np.arange(n) + 7}
    m(good)  # a first call, which a measured job's later ones follow
    with pytest.raises(rf.StageError) as info:
        m({"a": np.arange(n, dtype=np.float32), "id": np.arange(n) + 7})
    err = info.value
    # the chunks are 131072, 262144, 524288 rows, then whole ones: row 1500000 is in chunk 3
    assert (err.index, err.rows, err.ids) == (3, (917504, 1966080), (917511, 1966086))
    assert "rows 917504..1966079 of a batch of 4000000 rows" in str(err)


def test_the_error_pickles_with_its_rows_and_cause(mapper_factory):
    with pytest.raises(rf.StageError) as info:
        mapper_factory(fails_on_2345, "a", id_column="id", chunk_bytes=1024)(numeric_batch(5000))
    err = info.value
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is BatchStageError and str(back) == str(err)
    assert (back.stage, back.index, back.rows, back.batch_rows, back.ids, back.id_column, back.where) == \
        (err.stage, err.index, err.rows, err.batch_rows, err.ids, err.id_column, err.where)
    assert type(back.__cause__) is ValueError and str(back.__cause__) == "row value 2345 is refused"


def test_a_cause_that_does_not_pickle_travels_as_its_name_and_message(mapper_factory):
    with pytest.raises(rf.StageError) as info:
        mapper_factory(fails_unpicklably, "a", chunk_bytes=1024)(numeric_batch(3000))
    with pytest.raises(TypeError):
        pickle.dumps(info.value.__cause__)
    back = pickle.loads(pickle.dumps(info.value))
    assert str(back) == str(info.value) and "rows 0..255 of a batch of 3000 rows (chunk 0)" in str(back)
    assert type(back.__cause__) is RuntimeError and str(back.__cause__) == "Unpicklable: holds a lock"


def test_a_cause_that_pickles_but_does_not_unpickle_travels_as_its_name_and_message(mapper_factory):
    # pickle.dumps of it worked, so it was sent as itself, and the driver could not load the error
    with pytest.raises(rf.StageError) as info:
        mapper_factory(fails_not_unpicklably, "a", chunk_bytes=1024)(numeric_batch(3000))
    back = pickle.loads(pickle.dumps(info.value))
    assert str(back) == str(info.value)
    assert type(back.__cause__) is RuntimeError and str(back.__cause__) == "NeedsTwoArguments: needs two"


def test_a_cause_whose_str_raises_is_named_and_the_error_still_travels(mapper_factory):
    with pytest.raises(rf.StageError) as info:
        mapper_factory(fails_undescribably, "a", chunk_bytes=1024)(numeric_batch(3000))
    assert str(info.value).endswith(": StrRaises: <str() raised RuntimeError>")
    back = pickle.loads(pickle.dumps(info.value))
    assert str(back) == str(info.value) and isinstance(back.__cause__, StrRaises)


def test_close_releases_the_kept_engines_and_the_device():
    m = rf.RayMapper(affine, "a", device="sim", chunk_bytes=1024, host="stage")
    m(numeric_batch(3000))
    assert m.device.live().streams > 0  # an engine is kept warm between batches
    m.close()
    m.close()
    assert m.device.closed


def test_a_mapper_collected_without_close_releases_its_device_and_keeps_nothing():
    """A mapper dropped unclosed closes its device when collected; its exit-time hook went on
    holding the (closed) device until the process ended, one for every such mapper."""
    m = rf.RayMapper(affine, "a", device="sim", chunk_bytes=1024, host="stage")
    m(numeric_batch(3000))  # an engine kept warm
    dev = m.device
    device_ref = weakref.ref(dev)
    del m
    gc.collect()
    assert dev.closed and dev.live().total == 0, dev.live()
    del dev
    gc.collect()
    assert device_ref() is None


def test_a_batch_the_mapper_was_closed_under_says_so(monkeypatch):
    """close() on another thread while a batch streams (an actor's exit, a caller's own close):
    the batch fails in the mapper's words, not with the device's advice to make a new device."""
    from ringflow import _ray

    m = rf.RayMapper(affine, "a", device="sim", chunk_bytes=1024)
    m(numeric_batch(3000))  # an engine kept warm
    real = _ray.stream_map

    def closed_under(*args, **kwargs):  # the close lands once the call is under way
        m.close()
        return real(*args, **kwargs)

    monkeypatch.setattr(_ray, "stream_map", closed_under)
    with pytest.raises(RuntimeError, match=r"this RayMapper was closed \(close\(\)\) while it mapped this batch.*"
                                           r"make a new one") as info:
        m(numeric_batch(3000))
    assert info.value.__cause__ is not None and m.device.closed


def test_ringflow_and_the_mapper_import_without_ray_or_pandas():
    code = ("import sys, numpy as np, ringflow as rf\n"
            "m = rf.RayMapper(lambda x, y: None, 'a', device='sim')\n"
            "m({'a': np.zeros(4)}); m.close()\n"
            "print(sorted(k for k in ('ray', 'pandas', 'pyarrow') if k in sys.modules))")
    src = str(pathlib.Path(rf.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# -- end to end on a local Ray instance --------------------------------------------------------


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'ringflow[ray]')")
    pytest.importorskip("ray.data", reason="Ray Data is not installed (pip install 'ringflow[ray]')")
    # the workers import ringflow and this module as the driver does
    path = os.pathsep.join(p for p in (str(pathlib.Path(rf.__file__).parent.parent), str(ROOT),
                                       os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RINGFLOW_DEVICE": "sim", "PYTHONPATH": path}})
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    try:
        yield ray
    finally:
        ray.shutdown()


def dataset(ray, n=20_000, blocks=10):
    """Rows ``id`` 0..n-1 and ``x`` = id as float32, in blocks of n/blocks rows."""
    return ray.data.range(n, override_num_blocks=blocks).map_batches(
        lambda b: {"id": b["id"], "x": b["id"].astype(np.float32)}, batch_format="numpy")


def map_kwargs(ray, f, batch_format, **constructor):
    # CPU-only actors taking a quarter CPU each: the read tasks that feed them, and the next test's
    # actors while these shut down, find CPUs free
    return dict(fn_constructor_kwargs={"f": f, **constructor}, batch_format=batch_format, batch_size=2000,
                num_gpus=0, num_cpus=0.25, compute=ray.data.ActorPoolStrategy(size=2))


@pytest.mark.parametrize("batch_format", ["numpy", "pandas"])
def test_ray_data_map_batches_matches_numpy(ray_local, batch_format):
    ds = dataset(ray_local).map_batches(rf.RayMapper, **map_kwargs(ray_local, affine, batch_format, columns=["x"],
                                                                    output_columns=["y"], chunk_bytes=2048))
    rows = ds.take_all()
    assert len(rows) == 20_000
    ids = np.array([r["id"] for r in rows])
    y = np.array([r["y"] for r in rows])
    assert sorted(rows[0]) == ["id", "x", "y"]
    np.testing.assert_array_equal(np.sort(ids), np.arange(20_000))
    np.testing.assert_array_equal(y, ids.astype(np.float32) * 2 + 1)


def test_ray_data_map_batches_a_tensor_column_in_pandas_batches(ray_local):
    ds = ray_local.data.range(6000, override_num_blocks=3).map_batches(
        lambda b: {"id": b["id"], "t": np.repeat(b["id"].astype(np.float32)[:, None], 3, axis=1)},
        batch_format="numpy")
    ds = ds.map_batches(rf.RayMapper, **map_kwargs(ray_local, affine, "pandas", columns="t", output_columns="y",
                                                   chunk_bytes=2048))
    rows = ds.take_all()
    ids = np.array([r["id"] for r in rows], np.float32)
    y = np.stack([np.asarray(r["y"]) for r in rows])
    assert y.shape == (6000, 3)
    np.testing.assert_array_equal(y, np.repeat(ids[:, None], 3, axis=1) * 2 + 1)


def test_ray_data_reports_the_failed_stage_and_rows(ray_local):
    ds = dataset(ray_local).map_batches(rf.RayMapper, **map_kwargs(ray_local, fails_on_2345, "numpy", columns="x",
                                                                    id_column="id", chunk_bytes=1024))
    with pytest.raises(Exception) as info:
        ds.materialize()
    # blocks and batches are 2000 rows, chunks 256: row 2345 is row 345 of batch 1, in chunk 1
    assert ("stage 'compute' failed for rows 256..511 of a batch of 2000 rows (id 2256..2511, chunk 1) on simulated "
            "h200-pcie5: ValueError: row value 2345 is refused") in str(info.value)


def test_ray_data_raises_the_stage_error_itself_when_asked(ray_local):
    ctx = ray_local.data.DataContext.get_current()
    ctx.raise_original_map_exception = True
    try:
        ds = dataset(ray_local).map_batches(rf.RayMapper, **map_kwargs(ray_local, fails_on_2345, "pandas", columns="x",
                                                                        chunk_bytes=1024))
        with pytest.raises(rf.StageError) as info:
            ds.materialize()
    finally:
        ctx.raise_original_map_exception = False
    assert (info.value.stage, info.value.rows, info.value.batch_rows) == ("compute", (256, 512), 2000)


def test_a_closed_mapper_says_it_is_closed():
    """A batch given to a closed mapper was refused by the closed device, whose advice (make a
    new device) did not fit: the mapper itself is closed."""
    m = rf.RayMapper(affine, "a", device="sim", chunk_bytes=1024)
    m.close()
    with pytest.raises(RuntimeError, match=r"this RayMapper is closed.*make a new one"):
        m(numeric_batch(10))


@pytest.mark.parametrize("how", ["close", "collected"])
def test_a_mapper_on_a_named_simulated_gpu_leaves_that_device_open_for_the_process(how):
    """``device="sim:N"`` names the process's N-th simulated GPU, which every other "sim:N" of the
    process shares (a pipeline, another mapper): the mapper's close, or its collection, closed it
    under them. The mapper lets go of it instead, and refuses batches once closed."""
    dev = rf.device("sim:7")
    try:
        with rf.Pipeline(affine, device=dev) as pipe:
            m = rf.RayMapper(affine, "a", device="sim:7", chunk_bytes=1024)
            assert m.device is dev
            m(numeric_batch(3000))
            if how == "close":
                m.close()
                with pytest.raises(RuntimeError, match=r"this RayMapper is closed.*make a new one"):
                    m(numeric_batch(10))
            del m
            gc.collect()
            assert not dev.closed
            np.testing.assert_array_equal(pipe.submit(np.ones(4, np.float32)).result(timeout=10),
                                          np.full(4, 3, np.float32))
    finally:
        dev.close()


def test_a_masked_column_is_refused_by_name_not_streamed_without_its_mask(mapper_factory):
    """A masked column (a direct caller's; Ray gives none) would stream its masked-out values as if
    they were data, the mask dropped: it is refused, naming the column, as stream_map refuses a
    masked ``x``."""
    batch = {"a": np.ma.masked_array(np.arange(8.0), mask=[0, 1, 0, 0, 0, 0, 0, 1])}
    with pytest.raises(TypeError, match=r"column 'a': a numpy masked array, whose mask ringflow would drop"):
        mapper_factory(affine, "a")(batch)
