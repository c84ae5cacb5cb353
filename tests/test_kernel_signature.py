"""A kernel's C parameters read from its source (src/ringflow/_kernel_signature.py), and the
simulated GPU refusing what a launch would misread."""

from __future__ import annotations

import numpy as np
import pytest

from ringflow import Kernel
from ringflow._kernel_signature import read_params

SAXPY = r"""
// a comment naming another signature: __global__ void saxpy(double* x) {
extern "C" __global__ void __launch_bounds__(256) saxpy(const float* __restrict__ x, float* y, float a, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        y[i] = a * x[i] + y[i];
}
"""


def saxpy_ref(x, y, a):
    y += a * x


def test_the_parameters_are_read_with_their_types():
    params = read_params(SAXPY, "saxpy")
    assert [p.pointer for p in params] == [True, True, False, False]
    assert [sorted(str(d) for d in p.dtypes) for p in params] == [["float32"], ["float32"], ["float32"], ["uint64"]]
    assert params[0].text == "const float* __restrict__ x"
    assert read_params('extern "C" __global__ void k() {}', "k") == ()
    assert read_params('extern "C" __global__ void k(void) {}', "k") == ()
    unnamed = read_params('extern "C" __global__ void k(const unsigned int*, unsigned long long) {}', "k")
    assert [(p.pointer, sorted(str(d) for d in p.dtypes)) for p in unnamed] == [(True, ["uint32"]), (False, ["uint64"])]


@pytest.mark.parametrize("source, name", [
    ("template <typename T> __global__ void twice(const T* x, T* y, size_t n) {}", "twice<float>"),
    ('#define NAME scale\nextern "C" __global__ void NAME(const float* x, float* y, size_t n) {}', "scale"),
    ('__global__ void k(const float* x, size_t n) {}\n__global__ void k(const double* x, size_t n) {}', "k"),
    ('extern "C" __global__ void k(const float (&x)[4], size_t n) {}', "k"),
], ids=["template", "macro", "overloads", "reference"])
def test_what_cannot_be_read_for_certain_checks_nothing(source, name):
    assert read_params(source, name) is None


def test_a_type_it_does_not_know_is_left_unchecked():
    params = read_params('extern "C" __global__ void k(const float2* x, MyStruct s, float** p, const void* v, '
                         'size_t n) {}', "k")
    assert [p.dtypes for p in params[:4]] == [None, None, None, None]
    k = Kernel('extern "C" __global__ void k(const float2* x, float2* y, size_t n) {}', "k",
               reference=lambda x, y: y.__setitem__(Ellipsis, x))
    k(np.zeros(4, np.complex64), np.zeros(4, np.complex64))  # float2 holds a complex64's bytes: runs


@pytest.mark.parametrize("args, says", [
    ((np.zeros(4), np.zeros(4, np.float32), np.float32(2)),
     r"argument 0 is a float64 array, but parameter 0 \(const float\* __restrict__ x\) reads float32, so a launch "
     r"would misread its bytes; pass a float32 array"),
    ((np.zeros(4, np.float32), np.zeros(4, np.float32), np.float64(2)),
     r"argument 2 is a float64 scalar, but parameter 2 \(float a\) reads float32"),
    ((np.zeros(4, np.float32), np.zeros(4, np.float32), np.zeros(4, np.float32)),
     r"argument 2 is an array, but parameter 2 \(float a\) takes a value; pass a numpy scalar"),
    ((np.zeros(4, np.float32), np.float32(2), np.float32(2)),
     r"argument 1 is a float32 scalar, but parameter 1 \(float\* y\) is a pointer; pass an array"),
    ((np.zeros(4, np.float32), np.zeros(4, np.float32)),
     r"takes 4 parameters .*: one for each of the 2 arguments given, then size_t n .*; pass 3 arguments"),
    ((np.zeros(4, np.float32), np.zeros(4, np.float32), np.float32(2), np.float32(3)),
     r"takes 4 parameters .*: one for each of the 4 arguments given"),
], ids=["array dtype", "scalar width", "array for a value", "scalar for a pointer", "too few", "too many"])
def test_on_the_simulated_gpu_what_a_launch_would_misread_is_refused_by_name(args, says):
    """On a GPU these launch and read the wrong bytes (a float64 array read as floats, an 8-byte
    scalar where 4 are read, the size_t n after it misplaced) or fail inside the kernel; the
    simulated GPU refuses them naming the kernel, the argument and its parameter, before the
    reference runs (which would often have taken them: numpy casts)."""
    ran = []
    k = Kernel(SAXPY, "saxpy", reference=lambda *a: ran.append(a))
    with pytest.raises(TypeError, match=f"^kernel 'saxpy'.*{says}"):
        k(*args)
    if len(args) == 3 and isinstance(args[2], np.generic):  # (bind takes trailing scalars only)
        with pytest.raises(TypeError, match=says):
            k.bind(args[2])(*args[:2])
    assert ran == []


def test_a_kernel_without_n_last_is_refused_with_what_to_add():
    k = Kernel('extern "C" __global__ void k(const float* x, float* y) {}', "k", reference=lambda x, y: None)
    with pytest.raises(TypeError, match=r"takes 2 parameters"):
        k(np.zeros(4, np.float32), np.zeros(4, np.float32))
    k = Kernel('extern "C" __global__ void k(const float* x, float* y, float* z) {}', "k", reference=lambda *a: None)
    with pytest.raises(TypeError, match=r"last parameter \(float\* z\) is a pointer, but a launch passes the "
                                        r"element count n there; add size_t n"):
        k(np.zeros(4, np.float32), np.zeros(4, np.float32))


def test_matching_arguments_run_and_a_pickled_kernel_checks_the_same():
    import pickle

    k = Kernel(SAXPY, "saxpy", reference=saxpy_ref)
    x, y = np.arange(4, dtype=np.float32), np.ones(4, np.float32)
    k(x, y, np.float32(2))
    np.testing.assert_array_equal(y, 2 * x + 1)
    again = pickle.loads(pickle.dumps(k))
    with pytest.raises(TypeError, match="argument 0 is a float64 array"):
        again(np.zeros(4), y, np.float32(2))


def test_a_read_only_array_where_the_kernel_writes_is_refused_by_name():
    """numpy's own words ("output array is read-only") named neither the kernel nor the argument;
    an input the kernel only reads (``const``) may be read-only."""
    params = read_params(SAXPY, "saxpy")
    assert [p.writes for p in params] == [False, True, False, False]
    assert read_params('extern "C" __global__ void k(float const* x, float* const y, size_t n) {}', "k")[0].writes is False
    k = Kernel(SAXPY, "saxpy", reference=saxpy_ref)
    x, y = np.ones(4, np.float32), np.ones(4, np.float32)
    x.flags.writeable = False
    k(x, y, np.float32(2))  # a read-only input is fine
    y.flags.writeable = False
    with pytest.raises(TypeError, match=r"kernel 'saxpy': argument 1 is a read-only array, but parameter 1 \(float\* y\) "
                                        r"points to memory the kernel may write"):
        k(np.ones(4, np.float32), y, np.float32(2))


@pytest.mark.parametrize("source", [
    '#define PTR float*\nextern "C" __global__ void k(const float* x, PTR y, size_t n) {}',
    'typedef float* floatp;\nextern "C" __global__ void k(const float* x, floatp y, size_t n) {}',
    '#define IN const float* __restrict__\nextern "C" __global__ void k(IN x, float* y, size_t n) {}',
], ids=["macro", "typedef", "macro with qualifiers"])
def test_a_type_name_it_does_not_know_may_name_a_pointer(source):
    """A macro or a typedef may name a pointer type, written without a ``*``: a GPU launch
    passes an array there, so the simulated GPU takes one too."""
    _copies_float32(source)


@pytest.mark.parametrize("source", [
    'typedef const float cfloat;\nextern "C" __global__ void k(cfloat* x, float* y, size_t n) {}',
    '#define IN_T const float\nextern "C" __global__ void k(IN_T* __restrict__ x, float* y, size_t n) {}',
], ids=["typedef", "macro"])
def test_a_pointer_to_a_type_it_does_not_know_may_point_to_const(source):
    """A typedef or a macro may hold the ``const``: the kernel then only reads there, and a
    read-only array is taken."""
    assert read_params(source, "k")[0].writes is False
    k = Kernel(source, "k", reference=lambda x, y: y.__setitem__(Ellipsis, x))
    x, y = np.arange(4, dtype=np.float32), np.zeros(4, np.float32)
    x.flags.writeable = False
    k(x, y)
    np.testing.assert_array_equal(y, x)


def test_a_parameter_list_with_preprocessor_lines_checks_nothing():
    """Which parameters an ``#if`` keeps depends on macros (NVRTC's options may define them):
    here ``a`` is compiled out, and a GPU launch of two arrays runs."""
    source = ('extern "C" __global__ void k(const float* x, float* y,\n#ifdef WITH_SCALE\n    float a,\n#endif\n'
              '    size_t n) {}')
    assert read_params(source, "k") is None
    _copies_float32(source)


def test_type_specifiers_are_read_in_any_order():
    """C++ takes ``short unsigned`` for ``unsigned short``; written without a parameter's name,
    such a type was read as its first word (``short``), and a uint16 scalar refused."""
    params = read_params('extern "C" __global__ void k(float* y, short unsigned, int unsigned, long double, '
                         'long unsigned int a, size_t n) {}', "k")
    assert [p.dtypes and sorted(str(d) for d in p.dtypes) for p in params[1:5]] == [
        ["uint16"], ["uint32"], None, ["uint64"]]
    k = Kernel('extern "C" __global__ void k(float* y, short unsigned, size_t n) {}', "k",
               reference=lambda y, s: None)
    k(np.zeros(4, np.float32), np.uint16(3))


def test_lines_joined_by_a_backslash_are_read_as_one():
    """A backslash ending a line joins the next one to it before comments end: a ``//``
    comment so ended takes the next line in (here a parameter a GPU does not compile), and a
    parameter so split is read whole."""
    source = ('extern "C" __global__ void k(const float* x, // out of use \\\n    float* old,\n'
              '    float* \\\r\n    y, size_t n) {}')
    params = read_params(source, "k")
    assert [p.text for p in params] == ["const float* x", "float* y", "size_t n"]
    k = _copies_float32(source)
    with pytest.raises(TypeError, match=r"argument 1 is a float64 array, but parameter 1 \(float\* y\) reads float32"):
        k(np.zeros(4, np.float32), np.zeros(4))


def test_a_second_definition_it_cannot_read_leaves_the_kernel_unchecked():
    """The definition it reads may be the one compiled out: a GPU compiles the ``#else``
    branch's, whose ``__launch_bounds__`` holds parentheses the reader does not take apart."""
    source = ('#if 0\nextern "C" __global__ void k(const double* x, double* y, size_t n) {}\n#else\n'
              'extern "C" __global__ void __launch_bounds__((256)) k(const float* x, float* y, size_t n) {}\n#endif')
    assert read_params(source, "k") is None
    _copies_float32(source)


def _copies_float32(source: str) -> Kernel:
    """A kernel ``k(x, y)`` of ``source`` whose reference copies ``x`` into ``y``, launched once on
    float32 arrays (which it must take) and checked to have copied; returned for more calls."""
    k = Kernel(source, "k", reference=lambda x, y: y.__setitem__(Ellipsis, x))
    x, y = np.arange(4, dtype=np.float32), np.zeros(4, np.float32)
    k(x, y)
    np.testing.assert_array_equal(y, x)
    return k


@pytest.mark.parametrize("last", ["float n", "double n", "bool n", "__half n"])
def test_a_last_parameter_that_is_no_integer_is_refused_as_a_launch_passes_the_count_there(last):
    """A launch passes the element count as a size_t in the last parameter: one of a float type
    reads those bytes as another number, so the kernel loops over the wrong count on a GPU,
    while the simulated GPU ran the reference over every element."""
    k = Kernel(f'extern "C" __global__ void k(const float* x, float* y, {last}) {{}}', "k",
               reference=lambda x, y: y.__setitem__(Ellipsis, x))
    with pytest.raises(TypeError, match=rf"last parameter \({last}\) is not an integer.*declare it size_t n"):
        k(np.ones(4, np.float32), np.zeros(4, np.float32))


@pytest.mark.parametrize("last", ["size_t n", "unsigned long long n", "int n", "unsigned n", "Count n"])
def test_a_last_parameter_of_an_integer_or_unknown_type_is_taken(last):
    k = Kernel(f'extern "C" __global__ void k(const float* x, float* y, {last}) {{}}', "k",
               reference=lambda x, y: y.__setitem__(Ellipsis, x))
    y = np.zeros(4, np.float32)
    k(np.ones(4, np.float32), y)
    np.testing.assert_array_equal(y, 1)
