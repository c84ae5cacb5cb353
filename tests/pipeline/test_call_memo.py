"""A warm stream_map call with an earlier call's arguments reuses its checks and plan, and
anything that would change them is planned anew or refused as before."""

import gc
import re
import weakref

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import ringflow as rf
from ringflow._pipeline import call_memo, whole_array
from ringflow._testing import inject
from tests.helpers.threads import join, start


def f(x, y):
    y[:] = x * 2 + 1


@pytest.fixture(autouse=True)
def empty():
    rf.drop_warm_pipelines()
    call_memo.MEMO.forget()
    yield
    rf.drop_warm_pipelines()
    call_memo.MEMO.forget()


@pytest.fixture
def plans(monkeypatch):
    """The calls that were checked and planned in full (each a list entry)."""
    made = []
    real = whole_array.prepare_whole

    def counted(*a, **k):
        made.append(a[0])
        return real(*a, **k)

    monkeypatch.setattr(whole_array, "prepare_whole", counted)
    return made


def fresh(n, seed):
    return np.random.default_rng(seed).uniform(0.5, 1.5, n).astype(np.float32)


def test_a_repeated_call_is_planned_once_and_every_result_is_right(plans):
    dev = rf.device("sim", seed=1, chaos=True)
    x = fresh(5000, 0)
    out = np.empty_like(x)
    for i in range(4):
        x[:] = fresh(5000, i)
        assert rf.stream_map(f, x, out, device=dev, chunk_bytes=4096) is out
        assert np.array_equal(out, x * 2 + 1)
    for i in range(3):  # a fresh result each call: planned once too
        y = rf.stream_map(f, x, device=dev, chunk_bytes=4096)
        assert np.array_equal(y, x * 2 + 1) and y is not out
    assert len(plans) == 2


def test_a_warm_call_that_finds_its_engine_builds_no_layout(monkeypatch):
    """The layout is what a new engine is built from; a call served by the memo whose engine is
    taken warm never reads it, so none is made."""
    made = []

    class Counted(whole_array.MapLayout):
        def __init__(self, *a, **k):
            made.append(None)
            super().__init__(*a, **k)

    dev = rf.device("sim", seed=1)
    x = fresh(5000, 0)
    out = np.empty_like(x)
    rf.stream_map(f, x, out, device=dev, chunk_bytes=4096)
    monkeypatch.setattr(whole_array, "MapLayout", Counted)
    for i in range(3):
        x[:] = fresh(5000, i)
        rf.stream_map(f, x, out, device=dev, chunk_bytes=4096)
        assert np.array_equal(out, x * 2 + 1)
    assert made == []


def test_pinned_buffers_and_in_place_calls_are_remembered_too(plans):
    dev = rf.device("sim", seed=2)
    hb = dev.allocate_host(1 << 16)
    x = hb.view(np.float32, access="rw")
    try:
        for i in range(3):
            x[:] = fresh(x.size, i)
            want = x * 2 + 1
            rf.stream_map(f, x, x, device=dev, chunk_bytes=8192, x_buffer=hb, out_buffer=hb, inplace=True)
            assert np.array_equal(x, want)
        assert len(plans) == 1
        hb.close()
        with pytest.raises(Exception, match="closed"):  # refused as a first call would be
            rf.stream_map(f, x, x, device=dev, chunk_bytes=8192, x_buffer=hb, out_buffer=hb, inplace=True)
    finally:
        hb.close()


@pytest.mark.parametrize("change", ["float chunk_bytes", "bool chunk_bytes", "bool workers after 1", "read-only out",
                                    "another f",
                                    "sim_seconds replaced", "strided x", "hooks", "another device"])
def test_what_changes_a_call_is_checked_and_planned_anew(plans, change):
    dev = rf.device("sim", seed=3)
    x = fresh(4096, 1)
    out = np.empty_like(x)
    kw = dict(device=dev, chunk_bytes=4096)
    g = f
    rf.stream_map(g, x, out, **kw)
    assert len(plans) == 1
    if change == "float chunk_bytes":  # equal to 4096 in Python and hashed alike: checked on its own
        rf.stream_map(g, x, out, device=dev, chunk_bytes=4096.0)
        assert len(plans) == 2 and np.array_equal(out, x * 2 + 1)
        return
    if change == "bool chunk_bytes":
        with pytest.raises(TypeError, match="chunk_bytes"):
            rf.stream_map(g, x, out, device=dev, chunk_bytes=True)
        return
    if change == "bool workers after 1":  # True == 1 and hashes alike; only the int is a worker count
        rf.stream_map(g, x, out, workers=1, **kw)
        with pytest.raises(TypeError, match="workers"):
            rf.stream_map(g, x, out, workers=True, **kw)
        return
    if change == "read-only out":
        out.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            rf.stream_map(g, x, out, **kw)
        return
    if change == "another f":
        def g(a, b):
            b[:] = a - 1
        want = x - 1
    elif change == "sim_seconds replaced":
        def g(a, b):
            b[:] = a * 2 + 1
        rf.stream_map(g, x, out, **kw)
        g.sim_seconds = 1.0  # a compute-bound job: two compute streams
        want = x * 2 + 1
    elif change == "strided x":
        x = fresh(8192, 2)[::2]  # not contiguous: staged, not registered
        want = x * 2 + 1
    elif change == "another device":
        kw["device"] = rf.device("sim", seed=4)
        want = x * 2 + 1
    else:
        want = x * 2 + 1
    before = len(plans)
    if change == "hooks":
        with inject(guards_off={"d2h.wait_compute"}):
            rf.stream_map(g, x, out, **kw)
        assert len(plans) == before + 1
        return
    rf.stream_map(g, x, out, **kw)
    assert np.array_equal(out, want)
    assert len(plans) == before + 1


def test_calls_on_pool_arrays_are_served_and_receive_their_arrays_every_time(plans, monkeypatch):
    from ringflow._device import host_pool

    received = []
    real = host_pool.receive

    def counted(arr, dev):
        received.append(arr)
        return real(arr, dev)

    monkeypatch.setattr(host_pool, "receive", counted)
    dev = rf.device("sim", seed=5, chaos=True, checked=True)
    x = rf.host.empty((4096,), np.float32, device=dev)
    out = rf.host.empty((4096,), np.float32, device=dev)
    for k in range(3):
        x[:] = fresh(4096, k)
        for y in (rf.stream_map(f, x, device=dev, chunk_bytes=4096), rf.stream_map(f, x, out, device=dev)):
            assert np.array_equal(y, x * 2 + 1)
    assert len(plans) == 2  # each kind of call planned once
    served = [a for a in received if a is x or a is out]
    assert len(served) >= 3 * 3  # x each call, out each call that has it
    rf.stream_map(f, x, x, device=dev, inplace=True)
    received.clear()
    rf.stream_map(f, x, x, device=dev, inplace=True)  # served
    assert len(received) == 1 and received[0] is x  # in place: received once


def test_pool_arrays_made_on_another_thread_are_ordered_after_their_hand_out_on_a_served_call(plans):
    """The pool hands each array out on the thread that asked; the call that takes it in on
    another (passed on by a join, which the checker cannot see) must be ordered after that
    hand-out, served by the memo or not (a dropped array's block comes back at the same address,
    so most calls after the first are served)."""
    dev = rf.device("sim", seed=7, chaos=True, checked=True)

    def made(k):
        x = rf.host.empty((2048,), np.float32, device=dev)
        x[:] = fresh(2048, k)
        return x, rf.host.empty((2048,), np.float32, device=dev)

    places = set()
    for k in range(6):
        ((x, out),) = join([start(lambda k=k: made(k))])
        places.add((x.ctypes.data, out.ctypes.data))
        assert rf.stream_map(f, x, out, device=dev, chunk_bytes=4096) is out
        assert np.array_equal(out, x * 2 + 1)
        del x, out
    assert len(plans) == len(places) < 6  # planned once for each place the pool gave the arrays


def test_ordinary_memory_at_a_pool_arrays_address_is_planned_as_ordinary_memory(plans):
    """An array over a pool array's memory that is not a view of it (through a memoryview) has
    the same address, shape, strides and dtype, but no pool buffer behind it: a plan made for
    the pool array (its buffers used in place) must not serve it, nor the other way round."""
    dev = rf.device("sim", seed=8, checked=True)
    x = rf.host.empty((4096,), np.float32, device=dev)
    out = rf.host.empty((4096,), np.float32, device=dev)
    x[:] = fresh(4096, 1)
    x_alias = np.frombuffer(memoryview(x), np.float32)
    out_alias = np.frombuffer(memoryview(out), np.float32)
    assert x_alias.ctypes.data == x.ctypes.data and host_pool_device(x_alias) is None
    for a, b in ((x, out), (x_alias, out_alias), (x, out), (x_alias, out_alias)):
        out[:] = 0
        assert rf.stream_map(f, a, b, device=dev, chunk_bytes=4096) is b
        assert np.array_equal(out, x * 2 + 1)
    assert len(plans) >= 4  # each alternation plans anew (the memo holds one entry per key)


def host_pool_device(arr):
    from ringflow._device import host_pool

    return host_pool.device_of(arr)


def test_the_memo_keeps_neither_the_compute_nor_the_arrays_alive():
    dev = rf.device("sim", seed=6)

    def g(a, b):
        b[:] = a + 1

    x = fresh(4096, 4)
    out = np.empty_like(x)
    rf.stream_map(g, x, out, device=dev, chunk_bytes=4096, keep_warm=False)
    assert len(call_memo.MEMO) == 1
    refs = [weakref.ref(o) for o in (g, x, out)]
    del g, x, out
    gc.collect()
    assert [r() for r in refs] == [None, None, None]


def test_the_memo_keeps_no_pinned_buffer_alive():
    dev = rf.device("sim", seed=6)
    hb = dev.allocate_host(1 << 14)
    x = hb.view(np.float32, access="rw")
    x[:] = fresh(x.size, 4)
    rf.stream_map(f, x, x, device=dev, chunk_bytes=4096, x_buffer=hb, out_buffer=hb, inplace=True, keep_warm=False)
    assert len(call_memo.MEMO) == 1
    ref = weakref.ref(hb)
    del x, hb
    gc.collect()
    assert ref() is None


def test_the_memo_keeps_no_device_alive():
    """A device a caller drops goes, as a RayMapper's does when collected: the memo's entry for
    it holds it weakly (its warm engines, dropped with it, hold it otherwise)."""
    dev = rf.device("sim", seed=6)
    x = fresh(4096, 4)
    for _ in range(2):  # the second call served by the memo
        rf.stream_map(f, x, device=dev, chunk_bytes=4096, keep_warm=False)
    assert len(call_memo.MEMO) == 1
    dev.close()
    ref = weakref.ref(dev)
    del dev
    gc.collect()
    assert ref() is None


def test_a_call_naming_no_device_makes_one_device(monkeypatch, caplog):
    """device=None makes a new device on every call ("auto", or RINGFLOW_DEVICE): the memo
    serves only calls given a device object, so such a call still makes exactly one (and logs
    the fallback once)."""
    import logging
    import warnings

    monkeypatch.delenv("RINGFLOW_DEVICE", raising=False)
    x = fresh(4096, 4)
    with caplog.at_level(logging.INFO, logger="ringflow"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            rf.stream_map(f, x, chunk_bytes=4096)
    assert sum("using the simulated GPU" in r.getMessage() for r in caplog.records) == 2
    assert len(call_memo.MEMO) == 0


def test_an_entry_serves_only_the_objects_it_was_made_for():
    memo = call_memo.CallMemo(capacity=2)

    class Thing:
        pass

    a, b = Thing(), Thing()
    memo.put("k", (a, None), (1,), "plan")
    assert memo.get("k", (a, None), (1,)) == "plan"
    assert memo.get("k", (b, None), (1,)) is None  # another object under the same id
    assert memo.get("k", (a, b), (1,)) is None  # a buffer given where there was none
    assert memo.get("k", (a, None), (object(),)) is None  # a value replaced
    memo.put("k2", (a, None), (1,), "p2")
    memo.put("k3", (a, None), (1,), "p3")
    assert len(memo) == 2 and memo.get("k", (a, None), (1,)) is None  # the oldest went
    memo.put("k4", (1, None), (1,), "p4")  # an int cannot be weakly referenced: not kept
    assert memo.get("k4", (1, None), (1,)) is None
    cost = Thing()  # a value held weakly: gone, the entry serves nothing
    memo.put("k5", (a, None), (cost,), "p5")
    assert memo.get("k5", (a, None), (cost,)) == "p5"
    ref = weakref.ref(cost)
    del cost
    gc.collect()
    assert ref() is None


def test_dropping_a_devices_warm_pipelines_forgets_its_plans():
    dev, other = rf.device("sim", seed=7), rf.device("sim", seed=8)
    x = fresh(4096, 5)
    rf.stream_map(f, x, device=dev, chunk_bytes=4096)
    rf.stream_map(f, x, device=other, chunk_bytes=4096)
    assert len(call_memo.MEMO) == 2
    rf.drop_warm_pipelines(dev)
    assert len(call_memo.MEMO) == 1
    rf.drop_warm_pipelines()
    assert len(call_memo.MEMO) == 0


def test_threads_sharing_remembered_plans_get_their_own_results():
    dev = rf.device("sim", seed=9, chaos=True)
    errors = []

    def worker(t):
        try:
            x = fresh(6000, t)
            out = np.empty_like(x)
            for i in range(20):
                x[:] = fresh(6000, 100 * t + i)
                rf.stream_map(f, x, out, device=dev, chunk_bytes=4096)
                assert np.array_equal(out, x * 2 + 1)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    join([start(lambda t=t: worker(t)) for t in range(4)], 120)
    assert errors == []


# -- the memo changes nothing but the time: the same calls with and without it ------------------



def _double(a, b):
    b[:] = a * 2 + 1


def _minus(a, b):
    b[:] = a - 1


def _timed(a, b):
    b[:] = a * 2 + 1


CALL = st.fixed_dictionaries({
    "before": st.sampled_from(["nothing", "nothing", "toggle read-only out", "replace sim_seconds",
                               "remake pool arrays"]),
    "f": st.sampled_from(["double", "minus", "timed", "timed"]),
    # pool arrays: of the call's device, a view at an offset into one, another device's, and
    # ordinary memory over one's bytes (the same address, no pool buffer behind it)
    "x": st.sampled_from(["plain", "plain", "strided", "read-only", "ints", "pool", "pool", "pool", "pool",
                          "pool view", "other pool", "alias of pool", "alias of pool"]),
    "out": st.sampled_from(["none", "given", "given", "x", "read-only", "overlapping", "pool", "pool", "pool",
                            "pool", "pool view", "alias of pool"]),
    "chunk_bytes": st.sampled_from([4096, 4096, 8192, 1, True, "4KiB", "auto", None]),
    "host": st.sampled_from(["auto", "auto", "stage", "register"]),
    "engine": st.sampled_from(["auto", "auto", "pipeline", "direct"]),
    "workers": st.sampled_from([None, 1, 1, True]),
    # the previous call's arguments again (after "before"), all of them or all but the one named
    # (taken from this draw): the memo's case, and its nearest misses (1 then True, say)
    # ("alias": the previous call with each pool array and ordinary memory over its bytes swapped)
    "again": st.sampled_from([None, "all", "all", "workers", "chunk_bytes", "out", "f", "x", "alias", "alias"]),
})


def _replay(calls, memo_on: bool) -> list:
    """Each call's outcome through ``stream_map_report``: ``("ok", result, plan)`` (the chunks,
    engine, chunk bytes and compute lanes it ran with) or ``("raised", type name, message)``."""
    dev, other = rf.device("sim", seed=21), rf.device("sim", seed=22)
    shared = fresh(8192, 11)
    read_only = shared[:4096].copy()
    read_only.flags.writeable = False
    xs = {"plain": shared[:4096].copy(), "strided": shared[::2], "read-only": read_only,
          "ints": np.arange(4096, dtype=np.int32)}
    given_out, locked_out = np.empty(4096, np.float32), np.empty(4096, np.float32)
    locked_out.flags.writeable = False

    def pool_arrays() -> None:
        """(Re)make the pool arrays: dropped ones' blocks come back, most often at the same address."""
        for name in ("pool", "pool view", "other pool", "alias of pool", "pool out", "pool view out",
                     "alias of pool out"):
            xs.pop(name, None)
        for name, device, n, at in (("pool", dev, 4096, 0), ("pool view", dev, 4097, 1),
                                    ("other pool", other, 4096, 0)):
            xs[name] = rf.host.empty(n, np.float32, device=device)[at:]
            xs[name][:] = shared[:4096]
        xs["alias of pool"] = np.frombuffer(memoryview(xs["pool"]), np.float32)
        xs["pool out"] = rf.host.empty(4096, np.float32, device=dev)
        xs["pool view out"] = rf.host.empty(4097, np.float32, device=dev)[1:]
        xs["alias of pool out"] = np.frombuffer(memoryview(xs["pool out"]), np.float32)

    pool_arrays()
    _timed.sim_seconds = 1e-3  # compute-bound: two compute lanes
    got = []
    previous = None
    try:
        for spec in calls:
            if spec["again"] is not None and previous is not None:
                field = spec["again"]
                if field == "alias":
                    swap = {"pool": "alias of pool", "alias of pool": "pool"}
                    spec = {**previous, "before": spec["before"], "x": swap.get(previous["x"], previous["x"]),
                            "out": swap.get(previous["out"], previous["out"])}
                else:
                    spec = {**previous, "before": spec["before"], **({} if field == "all" else {field: spec[field]})}
            previous = spec
            if spec["before"] == "toggle read-only out":
                given_out.flags.writeable = not given_out.flags.writeable
            elif spec["before"] == "replace sim_seconds":  # a cost now far below a copy's: one compute lane
                _timed.sim_seconds = 1e-9 if _timed.sim_seconds == 1e-3 else 1e-3
            elif spec["before"] == "remake pool arrays":
                pool_arrays()
            f = {"double": _double, "minus": _minus, "timed": _timed}[spec["f"]]
            x = xs[spec["x"]]
            out = {"none": None, "given": given_out, "x": x, "read-only": locked_out,
                   "overlapping": shared[1::2] if spec["x"] == "strided" else shared[1:4097],
                   "pool": xs["pool out"], "pool view": xs["pool view out"],
                   "alias of pool": xs["alias of pool out"]}[spec["out"]]
            if not memo_on:
                call_memo.MEMO.forget()
            try:
                y, rep = rf.stream_map_report(f, x, out, device=dev, chunk_bytes=spec["chunk_bytes"],
                                              host=spec["host"], engine=spec["engine"], inplace=spec["out"] == "x",
                                              workers=spec["workers"])
                meta = rep.timeline.meta
                got.append(("ok", np.array(y, copy=True),
                            (rep.chunks, meta.get("engine"), meta.get("chunk_bytes"), meta.get("compute_lanes"))))
            except Exception as exc:  # noqa: BLE001 - the outcome compared
                # (a buffer's number counts every buffer the process made: it differs between replays)
                got.append(("raised", type(exc).__name__, re.sub(r"#\d+", "#N", str(exc))))
    finally:
        del _timed.sim_seconds
        rf.drop_warm_pipelines(dev)
        xs.clear()
        other.close()
    return got


_BOTH_POOL = {"before": "nothing", "f": "double", "x": "pool", "out": "pool", "chunk_bytes": 4096, "host": "auto",
              "engine": "auto", "workers": None, "again": None}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls=st.lists(CALL, min_size=2, max_size=6))
# a plan that uses both pool buffers in place, then ordinary memory at their addresses
@example(calls=[_BOTH_POOL, {**_BOTH_POOL, "again": "alias"}])
def test_calls_end_alike_with_and_without_the_memo(calls):
    with_memo = _replay(calls, memo_on=True)
    without = _replay(calls, memo_on=False)
    assert [o[0] for o in with_memo] == [o[0] for o in without]
    for a, b in zip(with_memo, without):
        if a[0] == "ok":
            assert a[1].dtype == b[1].dtype and np.array_equal(a[1], b[1]) and a[2] == b[2]
        else:
            assert a[1:] == b[1:]


# -- the key of an array ---------------------------------------------------------------------------------------------
@given(st.integers(1, 64), st.integers(0, 7), st.integers(1, 3), st.sampled_from(["int8", "float32", "complex128"]),
       st.booleans(), st.booleans())
@settings(max_examples=200, deadline=None)
def test_an_arrays_key_reads_the_address_the_array_interface_gives(n, start, step, dtype, transpose, read_only):
    """The address a key holds is ``__array_interface__``'s for arrays and views of every kind:
    at an offset, strided, transposed, read-only, of any item size."""
    base = np.zeros((n, 3), dtype)
    view = base[start:][::step]
    view = view.T if transpose else view
    if read_only:
        view.flags.writeable = False
    address, readonly = view.__array_interface__["data"]
    assert call_memo.array_key(view) == (address, not readonly, view.shape, view.strides, view.dtype)


def test_a_reader_that_misreads_an_address_is_not_used():
    """The fast address reader is used only where it gives the interface's answer: one that reads
    the wrong field, or raises, gives way to ``__array_interface__``."""
    assert call_memo.checked_reader(lambda a: a.__array_interface__["data"][0]) is not call_memo._interface_address

    def raises(a):
        raise OSError("cannot read")

    for wrong in (lambda a: 0, lambda a: a.__array_interface__["data"][0] + 8, raises):
        assert call_memo.checked_reader(wrong) is call_memo._interface_address


def test_a_report_refuses_an_option_stream_map_does_not_take():
    x = fresh(1024, 1)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['bogus'\]"):
        rf.stream_map_report(f, x, device=rf.device("sim"), bogus=1)
    y, report = rf.stream_map_report(f, x, device=rf.device("sim"), chunk_bytes=1024)
    assert np.array_equal(y, x * 2 + 1) and report.chunks == 4


def test_a_warm_call_looks_its_arrays_up_in_the_pools_once(monkeypatch):
    """A warm call on ordinary arrays asks the host pools about ``x`` and ``out`` once (whether
    the memo serves it), not again when the call ends: arrays known not to be pool memory leave
    no hand-off. A MapJob asks once for the job, not per call. (Staged: a call that "auto"
    would have registered finds the arrays pinned by the job, stages them instead and, since the
    job may unpin them before the next call, is not remembered.)"""
    from ringflow._device import host_pool

    dev = rf.device("sim")
    x = fresh(4096, 1)
    out = np.empty_like(x)
    job = rf.MapJob(f, x, out, device=dev, chunk_bytes=4096)
    rf.stream_map(f, x, out, device=dev, chunk_bytes=4096, host="stage")
    asked = []
    real = host_pool.device_of

    def counted(arr):
        asked.append(arr)
        return real(arr)

    monkeypatch.setattr(host_pool, "device_of", counted)
    rf.stream_map(f, x, out, device=dev, chunk_bytes=4096, host="stage")
    assert len(asked) == 2 and np.array_equal(out, x * 2 + 1)
    asked.clear()
    out[:] = 0
    job()
    job.close()
    assert asked == [] and np.array_equal(out, x * 2 + 1)


class Scaler:
    """A model whose compute is a method: ``stream_map(model.step, x)`` looks the method up anew
    on every call."""

    def __init__(self, k):
        self.k = k

    def step(self, x, y):
        y[:] = x * self.k


def test_a_method_given_as_the_compute_is_planned_once_and_kept_warm_for_its_own_object(plans, monkeypatch):
    """``model.step`` is a new bound method on every lookup: the calls of one model's method share
    one plan and one warm engine, another model's method gets its own, each runs on its own
    object (its state as it is at the call), and neither the memo nor a dropped engine keeps a
    model alive."""
    made = []
    real = whole_array.make_engine
    monkeypatch.setattr(whole_array, "make_engine", lambda *a, **k: made.append(1) or real(*a, **k))
    dev = rf.device("sim")
    x = fresh(4096, 1)
    two, three = Scaler(2), Scaler(3)
    for _ in range(4):
        assert np.array_equal(rf.stream_map(two.step, x, device=dev, chunk_bytes=4096), x * 2)
        assert np.array_equal(rf.stream_map(three.step, x, device=dev, chunk_bytes=4096), x * 3)
    assert len(plans) == 2 and len(made) == 2
    two.k = 5  # the object's state at the call, through the engine kept for its method
    assert np.array_equal(rf.stream_map(two.step, x, device=dev, chunk_bytes=4096), x * 5)
    assert len(plans) == 2 and len(made) == 2
    gone = weakref.ref(two)
    del two
    plans.clear()  # (the fixture keeps what it counted: the methods, and their objects)
    rf.drop_warm_pipelines()
    gc.collect()
    assert gone() is None


def test_a_call_whose_key_cannot_be_hashed_runs_unremembered(plans):
    # a shape given as a numpy array is an output spec the call takes and no dict key can hold
    dev = rf.device("sim", seed=2)
    x = fresh(4000, 3)

    def g(a, b):
        b[:] = a[:, None] * 2 + 1

    for _ in range(2):
        y = rf.stream_map(g, x, device=dev, chunk_bytes=4096, output=(np.array([4000, 2]), "f4"))
        assert np.array_equal(y, np.repeat(x[:, None] * 2 + 1, 2, axis=1))
    assert len(plans) == 2 and len(call_memo.MEMO) == 0


@pytest.mark.parametrize("side", ["x", "out"])
def test_a_served_call_refuses_a_pool_array_whose_device_closed_since(plans, side):
    """Another device's pool array is staged (planned once, then served); once that device is
    closed its pinned memory is gone, and a call that the memo would serve must refuse it as the
    full path does, not copy from or into freed memory."""
    dev, other = rf.device("sim", seed=9), rf.device("sim", seed=10)
    pooled = rf.host.empty((4096,), np.float32, device=other)
    plain = fresh(4096, 2)
    if side == "x":
        pooled[:] = plain
        x, out = pooled, np.empty_like(plain)
    else:
        x, out = plain, pooled
    for _ in range(2):
        assert rf.stream_map(f, x, out, device=dev, chunk_bytes=4096) is out
        assert np.array_equal(out, x * 2 + 1)
    assert len(plans) == 1
    other.close()
    with pytest.raises(RuntimeError, match=f"{side} is memory from ringflow.host of .*, which is closed"):
        rf.stream_map(f, x, out, device=dev, chunk_bytes=4096)
