"""rf.Kernel: the numpy reference on the simulated GPU, NVRTC on a real one."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import types

import numpy as np
import pytest

import ringflow as rf
from ringflow._kernel import Kernel
from tests.helpers.dtypes import NOT_DEVICE_DTYPES, NOT_DEVICE_IDS, refusal

SAXPY = r"""
extern "C" __global__ void saxpy(const float* x, float* y, float a, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        y[i] = a * x[i] + y[i];
}
"""


def saxpy_ref(x, y, a):
    y += a * x


def make_saxpy(**kw):
    return Kernel(SAXPY, "saxpy", reference=saxpy_ref, **kw)


def test_reference_runs_on_numpy_arrays():
    k = make_saxpy()
    x, y = np.arange(10, dtype=np.float32), np.ones(10, np.float32)
    k(x, y, np.float32(2))
    np.testing.assert_array_equal(y, 1 + 2 * np.arange(10, dtype=np.float32))
    assert k.__name__ == "saxpy" and "saxpy" in repr(k)


def test_a_reference_returning_its_result_instead_of_writing_it_is_refused_as_a_launch_returns_nothing():
    """A launch writes its outputs and returns nothing, so a reference that returns a new array
    (leaving the output unwritten) is refused by name rather than handing its caller, on the
    simulated GPU only, a result that a GPU never returns; one that returns the array it wrote
    (np.multiply(x, a, out=y) does) is fine, and the call returns None either way, as a launch."""
    x, y = np.arange(4, dtype=np.float32), np.zeros(4, np.float32)
    k = Kernel(SAXPY, "saxpy", reference=lambda x, y, a: x * a)
    with pytest.raises(TypeError, match=r"kernel 'saxpy': its reference returned a new ndarray.*in place"):
        k(x, y, np.float32(2))
    with pytest.raises(TypeError, match="returned a new"):
        k.bind(np.float32(2))(x, y)
    k = Kernel(SAXPY, "saxpy", reference=lambda x, y, a: np.multiply(x, a, out=y))
    assert k(x, y, np.float32(2)) is None
    np.testing.assert_array_equal(y, 2 * x)


@pytest.mark.parametrize("returned, says", [(True, "bool True"), (4, "int 4"), (np.int64(4), "int64 4")],
                         ids=["bool", "count", "numpy count"])
def test_a_reference_returning_a_value_after_writing_its_outputs_is_refused_for_what_it_returned(returned, says):
    """A reference that writes its outputs and returns a flag or a count did write them: the
    refusal names what it returned and the rule (a reference returns None, as a launch returns
    nothing), without saying that it left its outputs unwritten."""
    def reference(x, y, a):
        np.multiply(x, a, out=y)
        return returned

    k = Kernel(SAXPY, "saxpy", reference=reference)
    x, y = np.arange(4, dtype=np.float32), np.zeros(4, np.float32)
    for call in (lambda: k(x, y, np.float32(2)), lambda: k.bind(np.float32(2))(x, y)):
        with pytest.raises(TypeError, match=rf"kernel 'saxpy': its reference returned {says}\b") as info:
            call()
        message = str(info.value)
        assert "must return None" in message and "a launch returns nothing" in message, message
        assert "instead of writing" not in message, message
    np.testing.assert_array_equal(y, 2 * x)


def test_bad_construction_and_calls():
    with pytest.raises(ValueError):
        Kernel("", "k")
    with pytest.raises(ValueError):
        Kernel(SAXPY, "")
    with pytest.raises(ValueError, match="block must be between 1 and 1024"):
        Kernel(SAXPY, "saxpy", block=0)
    with pytest.raises(TypeError, match="block must be an integer"):
        Kernel(SAXPY, "saxpy", block=128.0)
    assert Kernel(SAXPY, "saxpy", block=np.int64(128)).block == 128  # a numpy count is a count
    with pytest.raises(TypeError):
        Kernel(SAXPY, "saxpy", reference=3)
    with pytest.raises(TypeError, match="elementwise must be True or False"):
        Kernel(SAXPY, "saxpy", elementwise="no")  # a non-empty string was taken as True
    with pytest.raises(TypeError, match="options must be a dict"):
        Kernel(SAXPY, "saxpy", options=["-O3"])  # failed only at compile time, on a GPU
    no_ref = Kernel(SAXPY, "saxpy")
    with pytest.raises(TypeError, match="reference"):
        no_ref(np.zeros(3, np.float32), np.zeros(3, np.float32))
    with pytest.raises(TypeError, match="at least one array"):
        make_saxpy()(np.float32(1))


@pytest.mark.parametrize("call, error, says", [
    (lambda: Kernel(SAXPY.encode(), "saxpy"), TypeError, r"source must be a str of CUDA C\+\+ source, got bytes"),
    (lambda: Kernel(None, "saxpy"), TypeError, "source must be a str"),
    (lambda: Kernel(SAXPY, 3), TypeError, "name must be a str naming the __global__ function, got int"),
    (lambda: Kernel(SAXPY, "   "), ValueError, "name"),
    (lambda: Kernel(SAXPY, "saxpy", options={1: 2}), TypeError, "options must be a dict.*keyed by their names; got int 1"),
    (lambda: make_saxpy().bind(np.float32(2), name=3), TypeError, "bind: name must be a str or None, got int"),
], ids=["bytes source", "None source", "int name", "blank name", "option key not str", "bind name int"])
def test_construction_names_the_argument_of_the_wrong_kind(call, error, says):
    """A source or name of the wrong type was a ValueError that named neither the argument nor
    what it got; a blank name, an option keyed by a number and a bound name that is no string
    were taken, to fail only at compile time on a GPU (or to label operations with a number)."""
    with pytest.raises(error, match=says):
        call()


@pytest.mark.parametrize("args", [(SAXPY, "saxpy"), (SAXPY, "saxpy<float>")], ids=["plain", "template"])
def test_source_and_name_given_the_other_way_round_are_refused_saying_which_comes_first(args):
    """Kernel(name, source) was taken: on the simulated GPU the reference ran as if all were
    well, and only a GPU's compile failed, on a 'name' that was the whole source."""
    source, name = args
    with pytest.raises(ValueError, match=r"name .*looks like CUDA C\+\+ source.*Kernel\(source, name"):
        Kernel(name, source, reference=saxpy_ref)
    assert Kernel(source, name, reference=saxpy_ref).name == name


@pytest.mark.parametrize("options, says", [
    ({"fmad": False}, r"options: 'fmad' is not a cuda.core ProgramOptions field; did you mean 'fma'\?"),
    ({"use_fast_maths": True}, r"'use_fast_maths' is not .*did you mean 'use_fast_math'\?"),
    ({"-O3": True}, r"'-O3' is not a cuda.core ProgramOptions field; its fields are .*'fma'"),
], ids=["fmad", "plural", "a flag"])
def test_an_unknown_compile_option_is_refused_when_the_kernel_is_made(options, says):
    """Options reached ProgramOptions only when the kernel compiled, at its first launch on a GPU:
    a misspelt option passed on the simulated GPU and failed on a real one."""
    with pytest.raises(ValueError, match=says):
        make_saxpy(options=options)


@pytest.mark.parametrize("arch", ["sm_80", "compute_90", 90])
def test_an_architecture_is_refused_since_each_gpu_gets_its_own(arch):
    """compile() sets ``arch`` to the GPU's own after the user's options: an ``arch`` given here
    was taken and silently replaced."""
    with pytest.raises(ValueError, match=r"options: 'arch' .* is chosen by ringflow.*leave 'arch' out"):
        make_saxpy(options={"arch": arch})


@pytest.mark.parametrize("key, value, says", [
    ("fma", "false", r"options\['fma'\] must be True or False, got 'false' \(str\)"),
    ("max_register_count", 32.0, r"options\['max_register_count'\] must be an integer, got 32.0 \(float\)"),
    ("max_register_count", True, r"options\['max_register_count'\] must be an integer, got True \(bool\)"),
    ("std", 17, r"options\['std'\] must be a str"),
    ("name", None, r"options\['name'\] must be a str, got None"),
    ("include_path", ["inc", 3], r"options\['include_path'\] must be a str or a list of str"),
    ("define_macro", [("N", 4)], r"options\['define_macro'\] must be a str, a \(name, value\) tuple of str"),
    ("diag_suppress", "177", r"options\['diag_suppress'\] must be an int or a list of ints"),
], ids=["flag as str", "count as float", "count as bool", "str as int", "name None", "paths", "macro pair",
        "diagnostics as str"])
def test_a_compile_option_of_the_wrong_type_is_refused_by_name(key, value, says):
    with pytest.raises(TypeError, match=says):
        make_saxpy(options={key: value})


def test_compile_options_of_the_right_types_are_taken_as_given():
    options = {"fma": np.bool_(False), "max_register_count": np.int64(32), "std": "c++20", "ftz": None,
               "include_path": ["inc", "more"], "define_macro": ["A", ("N", "4")], "diag_suppress": [177, 550],
               "ptxas_options": "-v"}
    assert make_saxpy(options=options).options == options


def test_compile_options_are_the_fields_of_the_installed_cuda_core(monkeypatch):
    """Where cuda.core imports, its own ProgramOptions says which options there are: a field
    that version lacks is refused, and one only it has is taken."""
    from ringflow import _kernel

    @dataclasses.dataclass
    class ProgramOptions:
        name: str = "default_program"
        fma: bool | None = None
        newer_field: int | None = None

    monkeypatch.setattr(_kernel, "_cuda", lambda: types.SimpleNamespace(ProgramOptions=ProgramOptions))
    assert make_saxpy(options={"fma": False, "newer_field": 3}).options == {"fma": False, "newer_field": 3}
    with pytest.raises(ValueError, match="'pch' is not a cuda.core ProgramOptions field"):
        make_saxpy(options={"pch": True})
    with pytest.raises(TypeError, match=r"options\['fma'\] must be True or False"):
        make_saxpy(options={"fma": 0})


@pytest.mark.gpu
def test_the_kept_option_list_holds_every_field_of_cuda_cores_program_options():
    """Where cuda.core does not import, options are checked against a list kept in the module:
    it must name every field of cuda.core's ProgramOptions, each with the kind of value its
    annotation gives (the list may hold fields of a newer cuda.core than the one installed)."""
    core = pytest.importorskip("cuda.core")
    from ringflow._kernel import _PROGRAM_OPTIONS

    fields = {f.name: str(f.type) for f in dataclasses.fields(core.ProgramOptions)}
    assert set(fields) <= set(_PROGRAM_OPTIONS), sorted(set(fields) - set(_PROGRAM_OPTIONS))
    for name, annotation in fields.items():
        word = {"True or False": "bool", "an integer": "int"}.get(_PROGRAM_OPTIONS[name].says)
        assert word is None or word in annotation, (name, annotation)


def test_flags_of_numpy_bools_are_kept_as_bools():
    """A numpy bool is a flag, as the rest of the library takes it (device('sim', chaos=...),
    the pipeline's options)."""
    k = make_saxpy(elementwise=np.bool_(True), pointwise=np.bool_(True))
    assert k.elementwise is True and k.pointwise is True
    with pytest.raises(TypeError, match=r"pointwise must be True or False, got 1 \(int\)"):
        make_saxpy(pointwise=1)


@pytest.mark.parametrize("args, error, says", [
    ((np.zeros(4, np.float32), np.zeros(4, np.float32), 2.0), TypeError, "numpy scalars"),
    ((np.zeros(4, np.float32), np.zeros(4, np.float32), True), TypeError, "numpy scalars"),
    ((np.zeros(8, np.float32)[::2], np.zeros(4, np.float32), np.float32(2)), ValueError, "C-contiguous"),
    ((np.zeros(8, np.float32), np.zeros(4, np.float32), np.float32(2)), ValueError, "at least n = 8"),
], ids=["python float", "python bool", "strided", "short output"])
def test_the_reference_refuses_what_a_launch_refuses(args, error, says):
    """On numpy arrays (the simulated GPU) a kernel refuses the arguments its launch on a GPU
    refuses, with the same words, before the reference runs: a job that passes on the simulated
    GPU must not fail on a real one (the reference used to take them all)."""
    ran = []
    k = Kernel(SAXPY, "saxpy", reference=lambda *a: ran.append(a))
    with pytest.raises(error, match=says):
        k(*args)
    assert ran == []


class StridedMemoryView:
    """A device array as cuda.core's view gives a launch its pointer, shape and strides (in elements)."""

    def __init__(self, n, strides=None):
        self.shape, self.strides, self.ptr, self.device_id = (n,), strides, 1 << 20, 0


def _launch_without_a_gpu(monkeypatch):
    """Let a call on device arrays get as far as checking them, here where cuda.core is absent."""
    from ringflow import _kernel

    monkeypatch.setattr(_kernel, "_cuda_core", lambda what: types.SimpleNamespace())


@pytest.mark.parametrize("on", ["numpy", "device"])
def test_a_strided_array_is_named_by_its_position(monkeypatch, on):
    """A strided argument was refused as "kernel arguments must be C-contiguous", naming neither
    the kernel nor which of its arguments it was."""
    k = Kernel(SAXPY, "saxpy", reference=lambda *a: pytest.fail("the reference ran"))
    if on == "numpy":
        args = (np.zeros(4, np.float32), np.zeros(8, np.float32)[::2], np.float32(2))
    else:
        _launch_without_a_gpu(monkeypatch)
        args = (StridedMemoryView(4), StridedMemoryView(4, strides=(2,)), np.float32(2))
    with pytest.raises(ValueError, match=r"^kernel 'saxpy': argument 1 is not C-contiguous.*ascontiguousarray"):
        k(*args)


@pytest.mark.parametrize("on", ["numpy", "launch"])
def test_an_array_shorter_than_the_first_is_named_by_its_position_and_length(on):
    """It was "another" array, of the length of the shortest, whichever argument was short."""
    k = Kernel('extern "C" __global__ void k(){}', "k", reference=lambda *a: pytest.fail("the reference ran"))
    says = r"^kernel 'k': the first array has 8 elements but argument 3 has 4; every array must hold at least n = 8"
    with pytest.raises(ValueError, match=says):
        if on == "numpy":
            k(np.zeros(8, np.float32), np.float32(2), np.zeros(8, np.float32), np.zeros(4, np.float32),
              np.zeros(2, np.float32))
        else:  # as a ringflow stream's launch hands it the arrays' addresses and element counts
            k.__ringflow_launch__(None, 0, [1 << 20, np.float32(2), 2 << 20, 3 << 20, 4 << 20], [8, 8, 4, 2])


def saxpy_taking(c_type: str) -> str:
    """:data:`SAXPY` with its scalar ``a`` of ``c_type``."""
    return SAXPY.replace("float a", f"{c_type} a")


@pytest.mark.parametrize("scalar, c_type", [(np.float64(2), "double"), (np.complex128(2), "cuDoubleComplex"),
                                            (np.float32(2), "float"), (np.int64(2), "long long"),
                                            (np.bool_(True), "bool")], ids=lambda s: type(s).__name__)
def test_every_numeric_numpy_scalar_is_a_scalar_on_numpy_arrays(scalar, c_type):
    """np.float64 and np.complex128 subclass Python's float and complex: they were refused as
    "Python float64" on the simulated GPU, though a launch on a GPU and bind take them (each
    here to a kernel whose scalar parameter is of its C type)."""
    got = []
    k = Kernel(saxpy_taking(c_type), "saxpy", reference=lambda x, y, a: got.append(a))
    k(np.zeros(4, np.float32), np.zeros(4, np.float32), scalar)
    k.bind(scalar)(np.zeros(4, np.float32), np.zeros(4, np.float32))
    assert got == [scalar, scalar]


@pytest.mark.parametrize("scalar", [np.str_("a"), np.bytes_(b"a"), np.datetime64("2020"), np.timedelta64(1, "s"),
                                    np.void(b"ab")], ids=lambda s: type(s).__name__)
def test_a_numpy_scalar_of_no_c_type_is_refused_by_name(scalar):
    """A numpy string, date or raw-bytes scalar has no C type to pass by value: it reached the
    reference (a numpy error from inside it) or the driver."""
    ran = []
    k = Kernel(SAXPY, "saxpy", reference=lambda *a: ran.append(a))
    says = f"kernel 'saxpy': argument 2 is {type(scalar).__name__}.*numeric numpy scalar"
    with pytest.raises(TypeError, match=says):
        k(np.zeros(4, np.float32), np.zeros(4, np.float32), scalar)
    with pytest.raises(TypeError, match="numeric numpy scalar"):
        k.bind(scalar)
    assert ran == []


@pytest.mark.parametrize("dtype,advice", NOT_DEVICE_DTYPES, ids=NOT_DEVICE_IDS)
def test_a_numpy_array_of_a_dtype_no_device_array_has_is_refused_as_the_simulated_gpu_refuses_it(dtype, advice):
    """On a GPU a kernel's arrays are device arrays, which never hold dates, strings, records or
    raw bytes: the reference must not run on such numpy arrays either."""
    ran = []
    k = Kernel(SAXPY, "saxpy", reference=lambda *a: ran.append(a))
    with pytest.raises(TypeError, match=r"^kernel 'saxpy': argument 1: " + refusal(dtype, advice)):
        k(np.zeros(4, np.float32), np.zeros(4, dtype), np.float32(2))
    assert ran == []


def test_an_array_of_python_objects_or_swapped_bytes_or_a_stream_no_launch_takes_is_refused_on_numpy_arrays_too():
    """The simulated GPU ran the reference on an object array and ignored any ``stream=``, where
    a launch on a GPU refuses both: what runs on the simulated GPU should launch on a real one."""
    import ringflow as rf

    ran = []
    k = Kernel(SAXPY, "saxpy", reference=lambda *a: ran.append(a))
    x = np.zeros(4, np.float32)
    with pytest.raises(TypeError, match="kernel 'saxpy': argument 1: dtype object holds Python objects"):
        k(x, np.empty(4, object), np.float32(2))
    swapped = np.zeros(4, np.dtype(np.float32).newbyteorder())  # a launch would read its bytes as native floats
    with pytest.raises(TypeError, match="kernel 'saxpy': argument 1: dtype .* non-native byte order"):
        k(x, swapped, np.float32(2))
    with pytest.raises(TypeError, match="kernel 'saxpy': stream must be None, a ringflow stream.*got str 'fast'"):
        k(x, x, np.float32(2), stream="fast")
    assert ran == []
    dev = rf.device("sim")
    s = dev.create_stream()
    try:
        k(x, x, np.float32(2), stream=s)  # a ringflow stream is taken (the reference ignores it)
    finally:
        s.close()
        dev.close()
    assert len(ran) == 1


@pytest.mark.parametrize("args, says", [
    ((np.ones(4, np.float32), None), "argument 1 is NoneType None"),
    ((np.ones(4, np.float32), "y"), "argument 1 is str 'y'"),
    (([1.0, 2.0], np.ones(4, np.float32)), "argument 0 is list"),
], ids=["None", "str", "list"])
def test_an_argument_that_is_no_array_is_named_by_its_position_and_type(args, says):
    """Beside a numpy array it was called "a mix of numpy and device arrays"."""
    k = Kernel('extern "C" __global__ void k(){}', "k", reference=lambda *a: None)
    with pytest.raises(TypeError, match=f"kernel 'k': {says}.*must be numpy, CuPy, PyTorch") as info:
        k(*args)
    assert "mix" not in str(info.value)


def _without_cuda_core(monkeypatch):
    """Make ``import cuda.core`` fail, as on a machine without it (and forget one imported)."""
    import builtins

    from ringflow import _kernel

    real_import = builtins.__import__

    def no_cuda(name, *args, **kwargs):
        if name == "cuda.core" or name.startswith("cuda.core."):
            raise ModuleNotFoundError("No module named 'cuda'")
        return real_import(name, *args, **kwargs)

    _kernel._cuda.cache_clear()
    monkeypatch.setattr(builtins, "__import__", no_cuda)


@pytest.mark.parametrize("args, says", [
    (("y",), "argument 0 is str 'y'"),
    (([1.0, 2.0],), r"argument 0 is list \[1\.0, 2\.0\]"),
    ((None,), "argument 0 is NoneType None"),
    (([1.0], np.float32(2)), "argument 0 is list"),
    ((np.float32(2), (1, 2)), "argument 1 is tuple"),
], ids=["str", "list", "None", "list and scalar", "scalar and tuple"])
def test_no_array_argument_is_named_not_taken_for_a_device_array_without_cuda_core(monkeypatch, args, says):
    """With no numpy array among them, arguments that are no array were taken for device arrays:
    the call asked for cuda.core to be installed, on the simulated GPU too, where what is wrong
    is the argument."""
    _without_cuda_core(monkeypatch)
    k = Kernel('extern "C" __global__ void k(){}', "k", reference=lambda *a: None)
    with pytest.raises(TypeError, match=f"kernel 'k': {says}.*must be numpy, CuPy, PyTorch") as info:
        k(*args)
    assert "cuda.core needs" not in str(info.value) and "install" not in str(info.value)
    if isinstance(args[0], list):
        assert "np.asarray" in str(info.value)


def test_only_scalars_say_an_array_is_needed_without_cuda_core(monkeypatch):
    _without_cuda_core(monkeypatch)
    k = Kernel('extern "C" __global__ void k(){}', "k", reference=lambda *a: None)
    with pytest.raises(TypeError, match=r"kernel 'k' needs at least one array argument.*got only scalars"):
        k(np.float32(1), 2.0)


def test_kernel_as_compute_on_the_simulated_gpu():
    """stream.launch(kernel, x_arg, y_arg, scalar) runs the reference on sim."""
    dev = rf.device("sim")
    n = 1000
    s = dev.create_stream()
    hx, hy = dev.allocate_host(4 * n), dev.allocate_host(4 * n)
    dx, dy = dev.allocate(4 * n, stream=s), dev.allocate(4 * n, stream=s)
    x = np.random.default_rng(0).random(n, dtype=np.float32)
    hx.view(np.float32)[:] = x
    hy.view(np.float32)[:] = 1
    s.copy(dx, hx)
    s.copy(dy, hy)
    s.launch(make_saxpy(), dx.array(np.float32, n), dy.array(np.float32, n), np.float32(3),
             reads=[dx, dy], writes=[dy])
    s.copy(hy, dy)
    s.sync()
    np.testing.assert_array_equal(hy.view(np.float32), np.float32(3) * x + np.float32(1))
    for b in (dx, dy, hx, hy, s):
        b.close()
    dev.close()


@pytest.mark.parametrize("args, says", [
    (lambda x, y: (x, y, [2.0]), r"argument 2 is list \[2\.0\].*np\.asarray"),
    (lambda x, y: (x, y, None), "argument 2 is NoneType None"),
    (lambda x, y: ([x], y, np.float32(2)), "argument 0 is list"),
    (lambda x, y: (x, y, "a"), "argument 2 is str 'a'"),
], ids=["list", "None", "list of an array", "str"])
def test_a_kernel_called_while_a_simulated_gpu_captures_names_an_argument_that_is_no_array(args, says):
    """As a call on numpy arrays does: a list or None among the stand-ins a capture hands the
    launched callable is named as what it is, not as the scalar numpy would make of it."""
    saxpy = make_saxpy()
    n = 8
    x, y = np.ones(n, np.float32), np.zeros(n, np.float32)
    with pytest.raises(TypeError, match=f"kernel 'saxpy': {says}"):
        saxpy(*args(x, y))
    dev = rf.device("sim")
    s, dx, dy = dev.create_stream(), dev.allocate(4 * n), dev.allocate(4 * n)
    s.begin_capture()
    with pytest.raises(TypeError, match=f"kernel 'saxpy': {says}"):
        s.launch(lambda x, y: saxpy(*args(x, y)), dx.array(np.float32, n), dy.array(np.float32, n))
    s.abort_capture()
    dev.close()


def _kinds():
    out = []
    for kind in ("cupy", "torch", "dlpack"):
        missing = kind != "dlpack" and importlib.util.find_spec(kind) is None
        out.append(pytest.param(kind, marks=pytest.mark.skipif(missing, reason=f"{kind} not installed")))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("kind", _kinds())
def test_kernel_compiles_and_matches_reference_on_gpu(kind):
    n = (1 << 20) + 3  # not a multiple of the block
    x = np.random.default_rng(1).random(n, dtype=np.float32)
    y0 = np.random.default_rng(2).random(n, dtype=np.float32)
    # fmad=False: a * x + y as two roundings, exactly as numpy does it
    k = make_saxpy(options={"fma": False})
    with rf.device("cuda:0", array=kind) as dev:
        s = dev.create_stream()
        hx, hy = dev.allocate_host(4 * n), dev.allocate_host(4 * n)
        dx, dy = dev.allocate(4 * n, stream=s), dev.allocate(4 * n, stream=s)
        hx.view(np.float32)[:] = x
        hy.view(np.float32)[:] = y0
        s.copy(dx, hx)
        s.copy(dy, hy)
        s.launch(k, dx.array(np.float32, n), dy.array(np.float32, n), np.float32(3))
        s.copy(hy, dy)
        s.sync()
        expect = y0.copy()
        saxpy_ref(x, expect, np.float32(3))
        np.testing.assert_array_equal(hy.view(np.float32), expect)
        with pytest.raises(TypeError, match="numpy scalars"):
            s.launch(k, dx.array(np.float32, n), dy.array(np.float32, n), 3.0)
        with pytest.raises(ValueError, match="at least n"):
            s.launch(k, dx.array(np.float32, n), dy.array(np.float32, n - 1), np.float32(3))
        for b in (dx, dy):
            b.close(stream=s)
        for b in (hx, hy, s):
            b.close()
        assert dev.live().total == 0


@pytest.mark.gpu
def test_template_kernel_and_compile_errors():
    src = r"""
    template <typename T> __global__ void twice(const T* x, T* y, size_t n) {
        size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
        if (i < n) y[i] = x[i] + x[i];
    }
    """
    k = Kernel(src, "twice<int>", reference=lambda x, y: np.add(x, x, out=y))
    with rf.device("cuda:0", array="dlpack") as dev:
        s = dev.create_stream()
        n = 5000
        h = dev.allocate_host(4 * n)
        d_in, d_out = dev.allocate(4 * n, stream=s), dev.allocate(4 * n, stream=s)
        x = np.random.default_rng(3).integers(-2**20, 2**20, n, dtype=np.int32)
        h.view(np.int32)[:] = x
        s.copy(d_in, h)
        s.launch(k, d_in.array(np.int32, n), d_out.array(np.int32, n))
        s.copy(h, d_out)
        s.sync()
        np.testing.assert_array_equal(h.view(np.int32), 2 * x)
        broken = Kernel("extern \"C\" __global__ void oops(float* x, size_t n) { x[0] = undefined_name; }", "oops")
        with pytest.raises(RuntimeError, match="oops"):
            broken.compile(0)
        for b in (d_in, d_out, h, s):
            b.close()


def test_bind_fixes_trailing_scalars():
    k = make_saxpy()
    f = k.bind(np.float32(2), name="saxpy2")
    x, y = np.arange(10, dtype=np.float32), np.ones(10, np.float32)
    f(x, y)
    np.testing.assert_array_equal(y, 1 + 2 * np.arange(10, dtype=np.float32))
    assert f.__name__ == "saxpy2" and "saxpy" in repr(f)
    assert k.bind().__name__ == "saxpy"
    f.sim_seconds = 1e-3  # a compute function may carry its simulated duration
    with pytest.raises(TypeError, match="numpy scalars"):
        k.bind(2.0)


@pytest.mark.gpu
def test_fast_and_general_launch_paths_agree_on_gpu():
    """A kernel (bound or not) launched through a stream takes the pointer fast path; the same
    kernel called inside a plain function gets framework arrays: both give numpy's result."""
    n = (1 << 18) + 5
    x = np.random.default_rng(3).random(n, dtype=np.float32)
    y0 = np.random.default_rng(4).random(n, dtype=np.float32)
    k = make_saxpy(options={"fma": False})
    expect = y0.copy()
    saxpy_ref(x, expect, np.float32(3))
    with rf.device("cuda:0") as dev:
        s = dev.create_stream()
        hx, hy = dev.allocate_host(4 * n), dev.allocate_host(4 * n)
        dx, dy = dev.allocate(4 * n, stream=s), dev.allocate(4 * n, stream=s)
        hx.view(np.float32)[:] = x
        s.copy(dx, hx)
        for fn, extra in ((k, (np.float32(3),)), (k.bind(np.float32(3)), ()),
                          (lambda a, b: k(a, b, np.float32(3)), ())):
            hy.view(np.float32)[:] = y0
            s.copy(dy, hy)
            s.launch(fn, dx.array(np.float32, n), dy.array(np.float32, n), *extra)
            s.copy(hy, dy)
            s.sync()
            np.testing.assert_array_equal(hy.view(np.float32), expect)
        host_arg = hx.array(np.float32, n)  # a host buffer is refused on either path
        with pytest.raises(ValueError, match="device memory"):
            s.launch(k.bind(np.float32(3)), host_arg, dy.array(np.float32, n))
        for b in (dx, dy):
            b.close(stream=s)
        for b in (hx, hy, s):
            b.close()
        assert dev.live().total == 0


def test_compiling_without_cuda_core_says_what_to_install(monkeypatch):
    _without_cuda_core(monkeypatch)
    with pytest.raises(RuntimeError, match=r"compiling kernel 'k' needs cuda.core.*pip install 'ringflow\[cuda\]'"):
        rf.Kernel('extern "C" __global__ void k() {}', "k").compile(0)

    class DeviceArray:  # what any framework's device array shows
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (1 << 20, False), "version": 3}

    # a launch on device arrays failed inside with the import's own ModuleNotFoundError
    with pytest.raises(RuntimeError, match=r"launching kernel 'k' on device arrays needs cuda.core.*pip install"):
        rf.Kernel('extern "C" __global__ void k() {}', "k")(DeviceArray())


@pytest.mark.parametrize("scalar", [np.longdouble(2), np.clongdouble(2)], ids=lambda s: type(s).__name__)
def test_a_numpy_scalar_wider_than_a_launch_passes_is_refused_by_name(scalar):
    """cuda.core passes floats of 2, 4 and 8 bytes and complex numbers of 8 and 16: np.longdouble
    ran the reference on the simulated GPU and failed at a launch on a GPU ("unsupported type")."""
    ran = []
    k = Kernel(SAXPY, "saxpy", reference=lambda *a: ran.append(a))
    with pytest.raises(TypeError, match=f"argument 2 is {type(scalar).__name__}.*numeric numpy scalar"):
        k(np.zeros(4, np.float32), np.zeros(4, np.float32), scalar)
    with pytest.raises(TypeError, match="numeric numpy scalar"):
        k.bind(scalar)
    assert ran == []


@pytest.mark.parametrize("scalar, sized, c_type", [(np.longlong(-3), np.int64, "long long"),
                                                   (np.ulonglong(3), np.uint64, "unsigned long long")],
                         ids=["longlong", "ulonglong"])
def test_a_long_long_is_passed_as_the_sized_integer_a_launch_takes(scalar, sized, c_type):
    """np.longlong is a type of its own beside np.int64 (of the same bits), and cuda.core takes
    only the sized one: a launch refused it ("unsupported type") where the simulated GPU ran."""
    from ringflow._checks import launch_scalar

    got = []
    Kernel(saxpy_taking(c_type), "saxpy", reference=lambda x, y, a: got.append(a)).bind(scalar)(
        np.zeros(4, np.float32), np.zeros(4, np.float32))
    assert type(got[0]) is sized and got[0] == scalar
    assert type(launch_scalar(scalar)) is sized and type(launch_scalar(np.float32(1))) is np.float32


SCALE = r"""
extern "C" __global__ void scale(const float* x, float* y, float a, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        y[i] = a * x[i];
}
"""


def scale_ref(x, y, a):
    np.multiply(x, a, out=y)


def test_a_kernel_survives_pickling_and_runs_the_same_on_the_simulated_gpu(monkeypatch):
    """A kernel goes to worker processes and Ray tasks pickled: its lock and what it compiled
    for this process's GPUs stay behind, and the copy compiles again where it first runs."""
    import pickle
    import threading

    k = Kernel(SCALE, "scale", reference=scale_ref, block=128, pointwise=True, options={"fma": False})
    k._compiled[0] = threading.Lock()  # stands for a compiled kernel, which belongs to this process
    k._configs[1000] = threading.Lock()
    copy = pickle.loads(pickle.dumps(k))
    assert (copy.source, copy.name, copy.block, copy.elementwise, copy.pointwise, copy.options, copy.__name__) == \
        (k.source, k.name, k.block, k.elementwise, k.pointwise, k.options, k.__name__)
    assert copy._compiled == {} and copy._configs == {} and copy._lock is not k._lock
    assert k._compiled and k._configs  # the original keeps what it compiled
    x = np.random.default_rng(3).random(4096, dtype=np.float32)
    want = rf.stream_map(k.bind(np.float32(3)), x, device=rf.device("sim"), chunk_bytes=4096)
    got = rf.stream_map(copy.bind(np.float32(3)), x, device=rf.device("sim"), chunk_bytes=4096)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, np.float32(3) * x)
    bound = pickle.loads(pickle.dumps(k.bind(np.float32(2), name="twice")))
    assert bound.__name__ == "twice" and bound.kernel.name == "scale" and bound.scalars == (np.float32(2),)
    np.testing.assert_array_equal(rf.stream_map(bound, x, device=rf.device("sim"), chunk_bytes=4096), 2 * x)
    _without_cuda_core(monkeypatch)  # compiling the copy takes its own lock, then asks for cuda.core
    with pytest.raises(RuntimeError, match="compiling kernel 'scale' needs cuda.core"):
        copy.compile(0)


@pytest.mark.gpu
def test_a_pickled_kernel_compiles_again_and_gives_the_same_result_on_the_gpu():
    """The copy leaves the original's compiled kernel behind: its first launch compiles anew, in
    this process as in a worker's, and must give the original's result bit for bit."""
    import pickle

    k = Kernel(SCALE, "scale", reference=scale_ref, block=128, pointwise=True, options={"fma": False})
    x = np.random.default_rng(4).random((1 << 20) + 5, dtype=np.float32)
    with rf.device("cuda:0") as dev:
        want = rf.stream_map(k.bind(np.float32(3)), x, device=dev, chunk_bytes=1 << 20, keep_warm=False)
        copy = pickle.loads(pickle.dumps(k))
        assert copy._compiled == {}
        got = rf.stream_map(copy.bind(np.float32(3)), x, device=dev, chunk_bytes=1 << 20, keep_warm=False)
        assert copy._compiled  # compiled on its first launch
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, np.float32(3) * x)


@pytest.mark.parametrize("bounds", ["__launch_bounds__(128)", "__launch_bounds__( 128u , 2 )", "__launch_bounds__(0x80)"])
def test_a_block_larger_than_the_kernels_launch_bounds_is_refused_as_a_gpu_launch_fails(bounds):
    """A GPU refuses a launch with more threads per block than the kernel's __launch_bounds__
    allows, so the simulated GPU must not run it: the kernel is refused when made, naming the
    bound and the block to pass; a block within the bound, or a bound that is not a number
    (a macro's), is taken."""
    for where in ("before", "after"):
        src = SCALE.replace("__global__ void", f"__global__ {bounds} void" if where == "before"
                            else f"__global__ void {bounds}")
        with pytest.raises(ValueError, match=r"block=256.*__launch_bounds__.*128.*block=128 or less"):
            Kernel(src, "scale", reference=scale_ref)
        k = Kernel(src, "scale", reference=scale_ref, block=128)
        x, y = np.arange(4, dtype=np.float32), np.zeros(4, np.float32)
        k(x, y, np.float32(2))
        np.testing.assert_array_equal(y, 2 * x)
    Kernel(SCALE.replace("__global__ void", "__global__ __launch_bounds__(MAX_THREADS) void"), "scale", block=1024)


@pytest.mark.parametrize("arrays, says", [
    (1, r"1 argument given and the 1 scalar bound by bind.*pass 2 arrays to the bound kernel"),
    (3, r"3 arguments given and the 1 scalar bound by bind.*pass 2 arrays to the bound kernel"),
], ids=["too few", "too many"])
def test_a_bound_kernel_given_the_wrong_count_says_how_many_arrays_it_takes(arrays, says):
    """A bound kernel is called with its arrays alone: a wrong count is told in those terms
    (the scalars bind fixed counted apart), not as the count of the kernel's own arguments,
    which would ask for one array per bound scalar too many; when capturing on the simulated
    GPU too."""
    bound = Kernel(SCALE, "scale", reference=scale_ref).bind(np.float32(2))
    xs = [np.ones(8, np.float32) for _ in range(arrays)]
    with pytest.raises(TypeError, match=says):
        bound(*xs)
    dev = rf.device("sim")
    s, bufs = dev.create_stream(), [dev.allocate(32) for _ in range(arrays)]
    s.begin_capture()
    with pytest.raises(TypeError, match=says):
        s.launch(bound, *[b.array(np.float32, 8) for b in bufs])
    s.abort_capture()
    dev.close()
    # called unbound, the count is the kernel's own
    with pytest.raises(TypeError, match=r"one for each of the 2 arguments given, then size_t n.*pass 3 arguments,"):
        bound.kernel(np.ones(8, np.float32), np.ones(8, np.float32))


def test_a_bound_kernel_carries_the_sim_seconds_set_on_its_kernel():
    """A compute callable's sim_seconds is its simulated duration: a kernel bound after one is
    set on it keeps it (the simulated GPU would otherwise model the launch as free), one set on
    the bound kernel wins, and a kernel without one gives a bound kernel without one."""
    import pickle

    k = Kernel(SCALE, "scale", reference=scale_ref)
    assert not hasattr(k.bind(np.float32(2)), "sim_seconds")
    k.sim_seconds = 0.25
    bound = k.bind(np.float32(2))
    assert bound.sim_seconds == 0.25
    assert pickle.loads(pickle.dumps(bound)).sim_seconds == 0.25
    bound.sim_seconds = 0.5
    assert (bound.sim_seconds, k.sim_seconds) == (0.5, 0.25)
    x = np.ones(1024, np.float32)
    out, report = rf.stream_map_report(k.bind(np.float32(2)), x, device=rf.device("sim"), chunk_bytes=4096)
    np.testing.assert_array_equal(out, 2 * x)
    assert report.measured_s >= 0.25


def _writes_its_input(x, y, a):
    x *= a  # x is const in the kernel: a launch would never write it
    y[...] = x


def _assigns_its_input(x, y, a):
    x[...] = x * a
    y[...] = x


@pytest.mark.parametrize("reference", [_writes_its_input, _assigns_its_input], ids=["in place", "assignment"])
def test_a_reference_writing_its_read_only_input_is_refused_naming_the_argument(reference):
    """numpy's words ("output array is read-only", "assignment destination is read-only")
    named neither the kernel nor the argument, inside a pipeline's StageError too, where the
    input a kernel declares const is handed to it read-only: the message names the argument by
    its position and parameter, and says to write only the outputs or declare it non-const."""
    says = (r"kernel 'scale': its reference wrote into a read-only array.*argument 0 \(const float\* x\) is "
            r"read-only.*write only the kernel's outputs.*non-const")
    k = Kernel(SCALE, "scale", reference=reference)
    x, y = np.ones(4, np.float32), np.zeros(4, np.float32)
    x.flags.writeable = False
    with pytest.raises(ValueError, match=says):
        k(x, y, np.float32(2))
    with pytest.raises(rf.StageError, match=says):
        rf.stream_map(k.bind(np.float32(2)), np.ones((64, 4), np.float32), device=rf.device("sim"), chunk_bytes=256)
    # the parameters of a template are not read: the argument is named by its position alone
    template = Kernel("template <typename T> __global__ void scale(const T* x, T* y, T a, size_t n) {}",
                      "scale<float>", reference=reference)
    with pytest.raises(ValueError, match=r"kernel 'scale<float>': its reference wrote into a read-only array.*"
                                         r"argument 0 is read-only"):
        template(x, y, np.float32(2))


@pytest.mark.parametrize("reference", [
    lambda x, y, a: np.multiply(x, a, out=y[...]),
    lambda x, y, a: np.multiply(x, a, out=y.reshape(y.shape)),
    lambda x, y, a: np.multiply(x.ravel(), a, out=y.ravel()),
], ids=["y[...]", "reshape", "ravel"])
def test_a_reference_returning_a_view_of_the_output_it_wrote_is_taken(reference):
    """Writing through a view of an output (``out=y[...]``, as the refusal of a new array
    suggests) writes it in place: the view it returns is not a new array, and the call runs,
    alone and as a pipeline's compute."""
    k = Kernel(SCALE, "scale", reference=reference)
    x, y = np.arange(6, dtype=np.float32).reshape(2, 3), np.zeros((2, 3), np.float32)
    assert k(x, y, np.float32(2)) is None
    np.testing.assert_array_equal(y, 2 * x)
    out = rf.stream_map(k.bind(np.float32(3)), np.ones((64, 4), np.float32), device=rf.device("sim"),
                        chunk_bytes=256)
    np.testing.assert_array_equal(out, np.full((64, 4), 3, np.float32))


@pytest.mark.parametrize("name, says", [
    ("saxpi", "did you mean 'saxpy'"),
    ("saxpi<float>", "did you mean 'saxpy'"),
    ("scale", "its __global__ functions are 'saxpy'"),
], ids=["typo", "template typo", "another"])
def test_a_name_the_source_never_mentions_is_refused_as_a_gpu_cannot_compile_it(name, says):
    """A name the source does not hold at all (a typo) compiles on no GPU, while the simulated
    GPU ran the reference as if all were well: it is refused when the kernel is made, with the
    source's __global__ functions of a similar name."""
    with pytest.raises(ValueError, match=rf"kernel {re.escape(repr(name))} is not in the source.*{says}"):
        Kernel(SAXPY, name, reference=saxpy_ref)
    with pytest.raises(ValueError, match=rf"kernel {re.escape(repr(name))} is not in the source.*{says}"):
        Kernel(SAXPY + f"\n// {name} comes later\n", name, reference=saxpy_ref)  # (a comment holds no function)


@pytest.mark.parametrize("source, name", [
    ('#include "kernels.cuh"\n', "saxpy"),
    ('#define DEF(n, T) extern "C" __global__ void n##_##T(T* y, size_t m) {}\nDEF(fill, float)\n', "fill_float"),
    ('#define DEF(n) extern "C" __global__ void n(float* y, size_t m) {}\nDEF(fill)\n', "fill"),
    (SAXPY + "\n// a comment naming saxpy2\n", "saxpy"),
], ids=["include", "token pasting", "macro", "comment"])
def test_a_name_that_an_include_or_a_macro_may_make_is_taken(source, name):
    Kernel(source, name, reference=saxpy_ref)
