"""A pointwise compute (``rf.Kernel(..., pointwise=True)``, or any compute whose ``pointwise``
attribute is True) runs once over all the items of a shared chunk instead of once per item;
everything else about shared chunks holds: each item's own result bit for bit, its own
cancellation, its own future. On the simulated GPU a kernel's ``reference`` runs at each launch,
so counting its calls counts launches. The hazard checker runs in checked mode. (Cancelling
an item inside a span, and threads, interrupts and failures in any order: test_coalesce.py.)"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ringflow as rf

FAIL = np.float32(-7777.0)  # a launch that sees this anywhere raises
SRC = 'extern "C" __global__ void k(const float* x, float* y, size_t n) {}'  # never compiled on the sim
# untyped pointers, which the simulated GPU does not check against the items' dtypes (a real
# kernel for several dtypes is a template, one instantiation per dtype)
ANY_DTYPE_SRC = 'extern "C" __global__ void k(const void* x, void* y, size_t n) {}'


class Counted:
    """``y = 2x + 1`` as a kernel reference that counts its launches (and refuses FAIL)."""

    def __init__(self):
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self, x, y):
        with self._lock:
            self.calls += 1
        if np.any(x == FAIL):
            raise ValueError("marked item")
        np.multiply(x, x.dtype.type(2), out=y)
        y += x.dtype.type(1)


def expected(a: np.ndarray) -> np.ndarray:
    return a * a.dtype.type(2) + a.dtype.type(1)


def items(n: int, seed: int = 0, max_elems: int = 40_000) -> list:
    rng = np.random.default_rng(seed)
    return [rng.random(int(k)).astype(np.float32) for k in rng.integers(1, max_elems, n)]


def run(compute, xs, seed=0, checked=True, **options):
    """``xs`` submitted to a pipeline of ``compute`` on a chaotic simulated GPU; with ``checked``
    (its default) each shared launch's pointwise promise is also tested, by running ``compute``
    on each of its items alone (calls a test that counts launches must not see)."""
    with rf.Pipeline(compute, device=rf.device("sim", seed=seed, chaos=True), chunk_bytes=1 << 20, checked=checked,
                     on_error="continue", **options) as pipe:
        futs = [pipe.submit(x) for x in xs]
        outcomes = [fu.exception() for fu in futs]
        stats = pipe.stats()
        chunks = pipe.scheduler.chunks_admitted
    return futs, outcomes, stats, chunks


@pytest.mark.parametrize("seed", range(3))
def test_a_pointwise_kernel_runs_once_a_shared_chunk_and_each_item_gets_its_own_result(seed):
    ref = Counted()
    xs = items(200, seed=seed)
    futs, outcomes, stats, chunks = run(rf.Kernel(SRC, "k", reference=ref, pointwise=True).bind(), xs, seed,
                                        checked=False)
    assert all(e is None for e in outcomes)
    assert all(fu.result().shape == x.shape and np.array_equal(fu.result(), expected(x)) for fu, x in zip(futs, xs))
    assert chunks < len(xs) // 4  # the items shared chunks
    assert ref.calls == chunks  # one launch a chunk
    assert (stats.delivered, stats.in_flight) == (200, 0)


def test_without_the_promise_each_item_of_a_shared_chunk_has_its_own_launch():
    ref = Counted()
    xs = items(200, seed=1)
    futs, outcomes, _, chunks = run(rf.Kernel(SRC, "k", reference=ref).bind(), xs)
    assert all(np.array_equal(fu.result(), expected(x)) for fu, x in zip(futs, xs))
    assert chunks < len(xs) // 4 and ref.calls == len(xs)


def test_a_compute_that_is_not_pointwise_is_never_run_over_several_items():
    """Reversing an item is elementwise in size but not pointwise: run over a span of items it
    would hand each item another's bytes. Left at the default it stays right."""

    def reverse(x, y):
        y[...] = x[::-1]

    xs = items(120, seed=2)
    futs, outcomes, _, chunks = run(reverse, xs)
    assert chunks < len(xs) // 4
    assert all(np.array_equal(fu.result(), x[::-1]) for fu, x in zip(futs, xs))


def test_a_function_marked_pointwise_is_run_once_a_chunk_too():
    calls = []

    def f(x, y):
        calls.append(x.size)
        np.multiply(x, np.float32(2), out=y)
        y += np.float32(1)

    f.pointwise = True
    xs = items(200, seed=3)
    futs, _, _, chunks = run(f, xs, checked=False)
    assert all(np.array_equal(fu.result(), expected(x)) for fu, x in zip(futs, xs))
    assert len(calls) == chunks and sum(calls) >= sum(x.size for x in xs)


def test_items_of_different_dtypes_in_one_chunk_each_get_their_own_launch():
    ref = Counted()
    rng = np.random.default_rng(4)
    xs = [rng.random(int(k)).astype(np.float32 if i % 2 else np.float64)
          for i, k in enumerate(rng.integers(1, 20_000, 120))]
    futs, outcomes, _, chunks = run(rf.Kernel(ANY_DTYPE_SRC, "k", reference=ref, pointwise=True).bind(), xs)
    assert all(fu.result().dtype == x.dtype and np.array_equal(fu.result(), expected(x)) for fu, x in zip(futs, xs))
    assert chunks < len(xs) // 4 and ref.calls == len(xs)


def test_a_failed_launch_fails_every_item_it_covered_and_no_other():
    ref = Counted()
    xs = items(200, seed=6)
    xs[50][0] = FAIL
    futs, outcomes, stats, chunks = run(rf.Kernel(SRC, "k", reference=ref, pointwise=True).bind(), xs)
    failed = [i for i, e in enumerate(outcomes) if e is not None]
    assert 50 in failed and 1 < len(failed) < len(xs) // 2  # the items of item 50's chunk
    assert failed == list(range(failed[0], failed[-1] + 1))  # one chunk: consecutive items
    for i in failed:
        assert isinstance(outcomes[i], rf.StageError) and "marked item" in str(outcomes[i].__cause__)
    assert all(np.array_equal(futs[i].result(), expected(x)) for i, x in enumerate(xs) if i not in failed)
    assert stats.failed == len(failed) and stats.delivered == len(xs) - len(failed) and stats.in_flight == 0


def test_pointwise_is_checked_when_the_kernel_is_made():
    with pytest.raises(TypeError, match="pointwise must be True or False"):
        rf.Kernel(SRC, "k", pointwise="yes")
    with pytest.raises(ValueError, match="pointwise=True needs elementwise=True"):
        rf.Kernel(SRC, "k", pointwise=True, elementwise=False)
    k = rf.Kernel(SRC, "k", pointwise=True)
    assert k.pointwise and k.bind(np.float32(1)).pointwise and not rf.Kernel(SRC, "k").bind().pointwise


@pytest.mark.gpu
@pytest.mark.parametrize("pointwise", [True, False])
def test_a_pointwise_kernel_over_shared_chunks_on_the_gpu_is_bit_exact(cuda_device, pointwise):
    """On a real GPU the span launch covers the alignment gaps between items (zeroed, computed
    and never delivered) and items of NaN: every item's result is still exact."""
    from ringflow._bench import kernels

    k = rf.Kernel(kernels.SCALE_SHIFT_SRC, "scale_shift", reference=kernels.scale_shift_reference,
                  pointwise=pointwise).bind()
    rng = np.random.default_rng(7)
    xs = [rng.uniform(0.5, 1.5, int(n)).astype(np.float32) for n in rng.integers(1, 300_000, 400)]
    xs[17][:] = np.nan
    with rf.Pipeline(k, device=cuda_device, chunk_bytes=8 << 20) as pipe:
        futs = [pipe.submit(x) for x in xs]
        results = [fu.result() for fu in futs]
        shared = pipe.scheduler.chunks_admitted < len(xs)
    assert shared
    assert all(r.shape == x.shape and np.array_equal(r, expected(x), equal_nan=True) for r, x in zip(results, xs))


class SpanRecorder:
    """A pointwise ``y = 2x + 1`` that keeps a copy of every array it is given (``spans``)."""

    pointwise = True

    def __init__(self):
        self.spans: list = []

    def __call__(self, x, y):
        self.spans.append(np.array(x))
        np.multiply(x, np.float32(2), out=y)
        y += np.float32(1)


def only_items_and_zeros(span: np.ndarray) -> bool:
    """Every value an item's (uniform in [0.5, 1.5)) or a gap's zero."""
    return bool(np.all((span == 0) | ((span >= 0.5) & (span < 1.5))))


def test_the_gaps_a_span_launch_covers_hold_zeros_not_stale_bytes():
    """A kernel may trap on values (a device assert, a NaN check): the alignment gaps between
    items, which the span launch computes over, are zeroed by the submitting thread, whatever
    the pool memory held before (here: earlier items and their results, from slabs used again)."""
    f = SpanRecorder()
    spans = f.spans
    rng = np.random.default_rng(9)
    with rf.Pipeline(f, device=rf.device("sim", seed=2), chunk_bytes=1 << 16, checked=True) as pipe:
        stale = [np.full(int(n), FAIL, np.float32) for n in rng.integers(1, 3000, 300)]
        for fu in [pipe.submit(x) for x in stale]:
            fu.result()
        del fu
        spans.clear()
        xs = [rng.uniform(0.5, 1.5, int(n)).astype(np.float32) for n in rng.integers(1, 3000, 300)]
        results = [fu.result() for fu in [pipe.submit(x) for x in xs]]
    assert all(np.array_equal(r, expected(x)) for r, x in zip(results, xs))
    fused = [s for s in spans if s.size > 0]
    assert any(s.size > 3000 for s in fused)  # some launches covered several items
    # every value in a span is an item's (in [0.5, 1.5)) or a gap's zero: not the earlier items
    # or their results written over them, nor the poison the simulated GPU fills pool memory with
    assert all(only_items_and_zeros(s) for s in fused)


def test_an_item_taken_back_leaves_zeros_where_its_bytes_were():
    """A copy into a shared chunk that fails half way (or is interrupted) takes its item back;
    the bytes it had written lie between its neighbours, inside their span launch, so they are
    zeroed too."""
    f = SpanRecorder()
    spans = f.spans
    dev = rf.device("sim", seed=3)
    real, calls = dev.host_copy, []

    def host_copy(dst, src):
        calls.append(src.size)
        if len(calls) % 10 == 5:  # this one writes half of its item, then fails
            half = dst.reshape(-1)[: dst.size // 2]
            half[...] = np.float32(7e30)
            raise RuntimeError("copy failed half way")
        return real(dst, src)

    dev.host_copy = host_copy
    rng = np.random.default_rng(4)
    xs = [rng.uniform(0.5, 1.5, int(n)).astype(np.float32) for n in rng.integers(100, 3000, 60)]
    with rf.Pipeline(f, device=dev, chunk_bytes=1 << 16, checked=True) as pipe:
        futs = []
        for x in xs:
            try:
                futs.append((x, pipe.submit(x)))
            except RuntimeError as exc:
                assert "copy failed half way" in str(exc)
        results = [(x, fu.result()) for x, fu in futs]
    assert len(results) == len(xs) - 6 and all(np.array_equal(r, expected(x)) for x, r in results)
    assert any(s.size > 3000 for s in spans)
    assert all(only_items_and_zeros(s) for s in spans)  # no half-copied bytes


@pytest.mark.parametrize("how", ["kernel", "function"])
def test_checked_mode_on_the_simulated_gpu_catches_a_compute_that_breaks_its_pointwise_promise(how):
    """A compute marked pointwise whose elements depend on their neighbours (here: each element
    less the mean of the launch's) gives an item sharing a launch a result that depends on the
    other items. With ``checked=True`` the simulated GPU runs each shared launch's items alone
    too and fails those items, naming ``pointwise=True``; items launched alone are right."""
    def centred(x, y):
        np.subtract(x, x.mean(dtype=x.dtype), out=y)

    if how == "kernel":
        compute = rf.Kernel(ANY_DTYPE_SRC, "k", reference=centred, pointwise=True).bind()
    else:
        compute = centred
        compute.pointwise = True
    xs = items(120, seed=5)
    futs, outcomes, stats, chunks = run(compute, xs)
    assert chunks < len(xs) // 4, "items shared launches"
    failed = [e for e in outcomes if e is not None]
    assert failed and all(isinstance(e, rf.StageError) and "pointwise=True" in str(e.__cause__) for e in failed)
    for fu, x, e in zip(futs, xs, outcomes, strict=True):
        if e is None:
            np.testing.assert_allclose(fu.result(), x - x.mean(dtype=x.dtype), rtol=1e-5)
    assert stats.failed == len(failed) and stats.in_flight == 0


def test_checked_mode_passes_a_compute_that_keeps_its_pointwise_promise():
    ref = Counted()
    xs = items(200, seed=7)
    futs, outcomes, stats, chunks = run(rf.Kernel(SRC, "k", reference=ref, pointwise=True).bind(), xs)
    assert all(e is None for e in outcomes) and chunks < len(xs) // 4
    assert all(np.array_equal(fu.result(), expected(x)) for fu, x in zip(futs, xs, strict=True))
    assert ref.calls > chunks, "each shared launch's items also ran alone"


def small_then_big(seed: int) -> list:
    """Items of a few thousand elements, and item 5 of seven: the one below ten elements."""
    xs = items(120, seed=seed, max_elems=3000)
    for i, x in enumerate(xs):
        if x.size < 10:
            xs[i] = np.concatenate([x, np.ones(10, np.float32)])
    xs[5] = np.ones(7, np.float32)
    return xs


def test_checked_mode_fails_only_the_items_whose_results_differ():
    """A compute that breaks its promise only for some items (here: one that scales an array of
    fewer than ten elements by 3, others by 2, so only the small item's result alone differs)
    fails those items alone; the items whose results alone are the same get them."""
    def by_size(x, y):
        np.multiply(x, np.float32(3 if x.size < 10 else 2), out=y)

    by_size.pointwise = True
    cause = _fails_item_5_alone(by_size, seed=10)
    assert "item 5" in str(cause)


def test_an_item_whose_compute_raises_only_when_run_alone_fails_alone():
    """The check's own run of an item alone that raises fails that item, its cause naming
    ``pointwise=True`` and the compute's error as its cause in turn; the other items of the
    launch are not failed by it."""
    def picky(x, y):
        if x.size < 10:
            raise ValueError("too few elements")
        np.multiply(x, np.float32(2), out=y)

    picky.pointwise = True
    cause = _fails_item_5_alone(picky, seed=11)
    assert "pointwise=True" in str(cause) and "too few elements" in str(cause.__cause__)


# computes that keep the promise, each for the dtype kinds it applies to: floating point math
# whose results numpy might round differently by position (a vector loop's body or its tail,
# aligned or not), NaN and infinities (NaN is not equal to itself), signed zeros, integers that
# wrap, and a cast to a narrower type and back
def _float_math(x, y):
    with np.errstate(all="ignore"):
        y[...] = np.sin(x) * np.exp(np.tanh(x)) + np.sqrt(np.abs(x)) / x.dtype.type(3) - np.log(np.abs(x))


def _cancelling(x, y):
    with np.errstate(all="ignore"):
        y[...] = np.sin(x) ** 2 + np.cos(x) ** 2 - x.dtype.type(1)


def _power(x, y):
    with np.errstate(all="ignore"):
        y[...] = np.power(np.abs(x), x.dtype.type(1.7))


def _negate(x, y):
    np.negative(x, out=y)


def _wrapping(x, y):
    np.multiply(x, x, out=y)
    y += x.dtype.type(7)


def _logical(x, y):
    np.logical_not(x, out=y)


def _narrowed(x, y):
    with np.errstate(all="ignore"):
        y[...] = x.astype(np.float16 if x.dtype.kind == "f" else np.complex64).astype(x.dtype)


POINTWISE_COMPUTES = {"f": [_float_math, _cancelling, _power, _negate, _narrowed],
                      "c": [_float_math, _cancelling, _negate, _narrowed],
                      "i": [_negate, _wrapping], "u": [_wrapping], "b": [_logical]}
SHARED_DTYPES = [np.float16, np.float32, np.float64, np.complex64, np.complex128, np.int8, np.int32, np.int64,
                 np.uint16, np.uint64, np.bool_]


def _values(dtype: np.dtype, n: int, rng: np.random.Generator) -> np.ndarray:
    if dtype.kind == "b":
        return rng.random(n) < 0.5
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    special = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-300, 6e4])
    x = np.where(rng.random(n) < 0.2, rng.choice(special, n), rng.uniform(-5, 5, n))
    with np.errstate(all="ignore"):
        x = x.astype(dtype)
        if dtype.kind == "c":
            x = x + 1j * np.where(rng.random(n) < 0.2, rng.choice(special, n), rng.uniform(-5, 5, n)).astype(dtype)
    return x


def same_bits_but_nan(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` and ``b`` hold the same bits, but for NaN, which matches NaN of any sign
    and payload: numpy's complex math gives a NaN's sign bit by where the element lies in the
    array (the same element of a complex64 array computed alone and inside a longer one)."""
    if a.dtype.kind == "c":
        a, b = a.view(a.real.dtype), b.view(b.real.dtype)
    if a.dtype.kind == "f":
        nan = np.isnan(a)
        if not np.array_equal(nan, np.isnan(b)):
            return False
        a, b = a[~nan], b[~nan]
    return a.tobytes() == b.tobytes()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(SHARED_DTYPES), which=st.integers(0, 4), seed=st.integers(0, 2**32 - 1),
       sizes=st.lists(st.integers(1, 300), min_size=2, max_size=40))
def test_checked_mode_passes_computes_that_keep_the_promise_whatever_the_sizes_dtypes_and_values(
        dtype, which, seed, sizes):
    """No false failure: a compute that keeps the promise passes checked mode over items of
    every size from one element, at every offset a shared launch puts them, with NaN (of either
    sign), infinities, signed zeros, subnormals and overflow in the values, for every dtype
    items share launches in. Each item's result is its result alone, NaN where NaN, bit for
    bit."""
    dtype = np.dtype(dtype)
    computes = POINTWISE_COMPUTES[dtype.kind]
    f = computes[which % len(computes)]

    def compute(x, y):
        f(x, y)

    compute.pointwise = True
    rng = np.random.default_rng(seed)
    xs = [_values(dtype, n, rng) for n in sizes]
    futs, outcomes, stats, _ = run(compute, xs, seed=seed % 7)
    assert all(e is None for e in outcomes), [e.__cause__ for e in outcomes if e is not None][:1]
    for fu, x in zip(futs, xs, strict=True):
        alone = np.empty_like(x)
        f(x.copy(), alone)
        assert same_bits_but_nan(fu.result(), alone)
    assert stats.delivered == len(xs) and stats.in_flight == 0


@pytest.mark.parametrize("name", ["cumsum", "reversed", "centred", "neighbour"])
def test_checked_mode_fails_computes_marked_pointwise_that_are_not(name):
    """The check still catches a compute that breaks the promise: a running sum, a reversal,
    subtracting the mean, adding a neighbour: every item of a shared launch (a few thousand
    elements each) fails, naming ``pointwise=True``."""
    def compute(x, y):
        if name == "cumsum":
            np.cumsum(x, out=y)
        elif name == "reversed":
            y[...] = x[::-1].copy()
        elif name == "centred":
            y[...] = x - x.mean(dtype=x.dtype)
        else:
            y[...] = x + np.roll(x, 1)

    compute.pointwise = True
    xs = items(100, seed=12, max_elems=3000)
    futs, outcomes, stats, chunks = run(compute, xs)
    assert chunks < len(xs) // 4, "items shared launches"
    failed = [e for e in outcomes if e is not None]
    assert all(isinstance(e, rf.StageError) and "pointwise=True" in str(e.__cause__) for e in failed)
    assert len(failed) >= len(xs) - chunks  # each shared launch's items but perhaps one alone
    assert stats.failed == len(failed) and stats.in_flight == 0


def _fails_item_5_alone(compute, seed: int) -> BaseException:
    """Run ``compute`` (marked pointwise) over :func:`small_then_big`'s items sharing launches in
    checked mode, and check that item 5 alone failed, its cause naming ``pointwise=True``, while
    every other item got twice its input; returns that cause."""
    xs = small_then_big(seed=seed)
    futs, outcomes, stats, chunks = run(compute, xs)
    assert chunks < len(xs) // 4, "items shared launches"
    failed = [i for i, e in enumerate(outcomes) if e is not None]
    assert failed == [5]
    assert isinstance(outcomes[5], rf.StageError) and "pointwise=True" in str(outcomes[5].__cause__)
    assert all(np.array_equal(fu.result(), x * np.float32(2))
               for i, (fu, x) in enumerate(zip(futs, xs, strict=True)) if i != 5)
    assert stats.failed == 1 and stats.in_flight == 0
    return outcomes[5].__cause__
