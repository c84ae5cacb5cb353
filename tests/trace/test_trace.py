"""The profiled timeline, its Chrome/Perfetto export, the report and the plot."""

import io
import json
import os
import stat
import threading

import numpy as np
import pytest

import ringflow as rf
from ringflow._trace import STAGES, load_spans
from ringflow._trace.summary import summarise

MB = 10**6


def profiled_run(n=10, chaos=False, seed=0, compute_s=0.5e-3):
    dev = rf.device("sim", profile="unit", chaos=chaos, seed=seed)

    def f(x, y):
        y[:] = x * 2 + 1

    f.sim_seconds = compute_s
    items = [np.full(MB // 4, i + 1, np.float32) for i in range(n)]
    # prepare=: items copied by the four CPU workers (the hand computations below count on
    # them); plain arrays alone would be copied into pinned memory by map() on this thread
    with rf.Pipeline(f, device=dev, chunk_bytes=MB, workers=4, profile=True, slots=4, prepare=np.asarray) as pipe:
        out = list(pipe.map(items))
    assert all(np.array_equal(o, i * 2 + 1) for o, i in zip(out, items, strict=True))
    return pipe.report()


def test_report_ideal_bound_matches_hand_computation():
    rep = profiled_run()
    # unit profile: 1 MB copies take 1 ms (H2D and D2H together still 1 GB/s each), each CPU
    # worker copies 1 MB in 1 ms, compute 0.5 ms, no host overheads: per chunk prepare 1, h2d 1,
    # compute 0.5, d2h 1, consume 1 (ms); 4 workers share prepare + consume -> 0.5 ms per chunk.
    med = rep.stage_median_s
    assert med["prepare"] == pytest.approx(1e-3)
    assert med["h2d"] == pytest.approx(1e-3)
    assert med["compute"] == pytest.approx(0.5e-3)
    assert med["d2h"] == pytest.approx(1e-3)
    assert med["consume"] == pytest.approx(1e-3)
    # first chunk through all five stages (4.5 ms), then one per max(1, 0.5, 1, 0.5) = 1 ms
    assert rep.ideal_s == pytest.approx(4.5e-3 + 9 * 1e-3)
    assert rep.bottleneck in ("h2d", "d2h")  # a tie: both copies take 1 ms
    assert 0.9 < rep.efficiency <= 1.0 + 1e-9
    assert rep.chunks == 10 and rep.latency_s["p50"] > 0
    assert rep.memory["pinned allocated"] == 8 * MB  # 4 host-in + 4 host-out slots of 1 MB


def test_load_spans_reads_a_trace_saved_with_a_byte_order_mark(tmp_path):
    """Some editors save UTF-8 with a byte order mark first; json.load refused the file ("Unexpected
    UTF-8 BOM"), where ringflow's other readers of a JSON file skip the mark."""
    path = profiled_run().save_trace(str(tmp_path / "t.json"))
    bommed = tmp_path / "bommed.json"
    bommed.write_bytes(b"\xef\xbb\xbf" + open(path, "rb").read())
    assert load_spans(str(bommed)) == load_spans(path)


def test_chrome_trace_is_valid_and_every_chunk_has_five_spans_in_stage_order(tmp_path):
    rep = profiled_run(chaos=True, seed=3)
    path = rep.save_trace(str(tmp_path / "t.json"))
    with open(path) as fh:
        data = json.load(fh)
    events = data["traceEvents"]
    assert all({"ph", "pid"} <= set(e) for e in events)
    complete = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 and isinstance(e["tid"], int) for e in complete)
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"gpu: h2d stream", "gpu: compute stream", "gpu: d2h stream"} <= names
    spans = load_spans(path)
    by_chunk = {}
    for s in spans:
        if s.name in STAGES:
            by_chunk.setdefault(s.chunk, {})[s.name] = s
    assert len(by_chunk) == 10
    for chunk, stages in by_chunk.items():
        assert list(stages) and set(stages) == set(STAGES), chunk
        ordered = [stages[s] for s in STAGES]
        for a, b in zip(ordered, ordered[1:]):
            assert a.end <= b.start + 1e-9, (chunk, a, b)
    # overlapping spans of one track are split into lanes, so no thread has overlapping X events
    by_tid = {}
    for e in complete:
        by_tid.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    for tid, iv in by_tid.items():
        iv.sort()
        assert all(a[1] <= b[0] + 1e-6 for a, b in zip(iv, iv[1:])), tid


def test_trace_summary_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    rep = profiled_run()
    path = rep.save_trace(str(tmp_path / "t.json"))
    info = summarise(path)
    assert info["chunks"] == 10
    assert info["stages"]["h2d"]["count"] == 10
    assert info["gpu_overlap"] > 1.0  # the three GPU stages ran at once some of the time
    png = tmp_path / "t.png"
    rep.plot(str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "efficiency" in str(rep)


@pytest.mark.parametrize("name", ["chart", "chart.", ".png"])
def test_a_plot_named_without_a_type_is_a_png_at_that_very_name(tmp_path, name):
    """matplotlib wrote ``chart.png`` (and ``.png.png``) for these: a file nobody asked for, next
    to a name the command line had checked."""
    pytest.importorskip("matplotlib")
    rep = profiled_run()
    rep.plot(str(tmp_path / name))
    assert os.listdir(tmp_path) == [name]
    assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("path", [0, 1, 5, True, 2.5, None, ["t.json"]], ids=repr)
def test_a_trace_or_plot_path_that_is_not_a_file_name_is_refused(path, capfd):
    """A number is not a file name: open() takes an int as a file descriptor, so save_trace(1)
    wrote the trace over stdout and then closed it (save_trace(5) closed whatever file the process
    had as descriptor 5)."""
    rep = profiled_run(n=2)
    with pytest.raises(TypeError, match="path must be a file name"):
        rep.save_trace(path)
    if path is not None:  # plot(None) saves nothing
        pytest.importorskip("matplotlib")
        with pytest.raises(TypeError, match="path must be a file name"):
            rep.plot(path)
    assert capfd.readouterr().out == ""
    os.fstat(1)  # stdout is still open


def test_a_plot_goes_into_an_open_binary_file_in_the_type_its_name_ends_with(tmp_path):
    """plot accepted an open file, then failed inside with a TypeError (leaving the file empty)."""
    pytest.importorskip("matplotlib")
    rep = profiled_run(n=2)
    buffer = io.BytesIO()
    rep.plot(buffer)  # no name: a PNG
    assert buffer.getvalue()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(tmp_path / "g.svg", "wb") as fh:
        rep.plot(fh)
    assert b"<svg" in (tmp_path / "g.svg").read_bytes()


def test_a_plot_into_a_text_file_is_refused_by_name(tmp_path):
    """An open text file passed the check for a file, then failed inside matplotlib ("string
    argument expected, got 'bytes'")."""
    pytest.importorskip("matplotlib")
    rep = profiled_run(n=2)
    with pytest.raises(TypeError, match="plot: path must be .*an open binary file.*got StringIO"):
        rep.plot(io.StringIO())
    with open(tmp_path / "g.svg", "w") as fh, pytest.raises(TypeError, match="open binary file.*TextIOWrapper"):
        rep.plot(fh)


def test_a_trace_or_plot_named_in_bytes_is_written_at_that_name(tmp_path):
    """Both accepted a bytes name, then failed inside with a TypeError."""
    rep = profiled_run(n=2)
    trace = os.fsencode(tmp_path / "t.json")
    rep.save_trace(trace)
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    pytest.importorskip("matplotlib")
    rep.plot(os.fsencode(tmp_path / "g.png"))
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(tmp_path)) == ["g.png", "t.json"]


@pytest.mark.parametrize("name", ["g.svg", "g.png"])
def test_a_plot_into_a_pipe_is_refused_and_the_pipe_left_as_it_was(tmp_path, name):
    """A plot named a pipe waited for ever for a reader (an SVG), or failed inside matplotlib
    (a PNG); save_trace and every other file ringflow writes refuse one."""
    pytest.importorskip("matplotlib")
    rep = profiled_run(n=2)
    path = str(tmp_path / name)
    os.mkfifo(path)
    outcome = []

    def plot():
        try:
            rep.plot(path)
            outcome.append(None)
        except Exception as exc:  # noqa: BLE001 - the test looks at what was raised
            outcome.append(exc)

    worker = threading.Thread(target=plot, daemon=True)
    worker.start()
    worker.join(30)
    if worker.is_alive():  # open the other end, so that the plot's write ends and the thread with it
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as reader:
            while worker.is_alive():
                reader.read()
                worker.join(0.1)
        pytest.fail("plot waited for a reader of the pipe")
    assert isinstance(outcome[0], OSError) and "not a regular file" in str(outcome[0]), outcome
    assert outcome[0].filename == path
    assert stat.S_ISFIFO(os.stat(path).st_mode) and os.listdir(tmp_path) == [name]


def test_report_needs_profiling():
    dev = rf.device("sim")
    with rf.Pipeline(lambda x, y: None, device=dev, chunk_bytes=1024) as pipe:
        with pytest.raises(RuntimeError, match="profile=True"):
            pipe.report()


def test_stalls_are_recorded_when_slots_run_short():
    dev = rf.device("sim", profile="unit")

    def f(x, y):
        y[:] = x

    f.sim_seconds = 3e-3  # compute-bound with one slot of each ring: chunks queue for slots
    items = [np.ones(MB // 4, np.float32) for _ in range(6)]
    with rf.Pipeline(f, device=dev, chunk_bytes=MB, slots=1, profile=True) as pipe:
        list(pipe.map(items))
    # staged by map() itself, items wait at the device-in slot
    assert pipe.report().stall_s.get("wait device-in slot", 0) > 3 * 3e-3
    with rf.Pipeline(f, device=dev, chunk_bytes=MB, slots=1, profile=True, prepare=np.asarray) as pipe:
        list(pipe.map(items))
    rep = pipe.report()
    # a device slot is handed back when its last use is enqueued (the GPU orders the reuse),
    # so the shortage shows on the host side as chunks waiting for the host-in slot, whose
    # H2D waits on the GPU for the device slot
    assert rep.stall_s.get("wait host-in slot", 0) > 3 * 3e-3
    assert rep.stall_s.get("consumer waiting for data", 0) > 0
    h2d_starts = sorted(r.stages["h2d"][0] for r in rep.timeline.records)
    assert all(b - a >= 3e-3 - 1e-9 for a, b in zip(h2d_starts, h2d_starts[1:]))  # one slot: serial


def test_a_lone_fast_first_chunk_and_loaded_later_ones_count_as_they_ran():
    """Chunk 0 alone is 3x faster on the CPU than the loaded ones after it: the bound adds the
    time each chunk actually spent, on the resource that ran it (a median per stage would
    charge chunk 0 the loaded time)."""
    from ringflow._trace.report import Report
    from ringflow._trace.timeline import ChunkRecord, Timeline

    ms = 1e-3
    recs = []
    t = 0.0
    for i, scale in enumerate([1.0, 3.0, 3.0, 3.0]):
        d = {"prepare": scale * ms, "h2d": 0.5 * ms, "compute": 0.1 * ms, "d2h": 0.5 * ms, "consume": scale * ms}
        stages, s = {}, t
        for stage in STAGES:
            stages[stage] = (s, s + d[stage])
            s += d[stage]
        recs.append(ChunkRecord(index=i, nbytes=1, final="delivered", accepted=t, ended=s, stages=stages))
        t += 4 * ms
    rep = Report.build(Timeline(records=recs), workers=2, memory={}, host_seconds=0.0)
    pool = (1 + 1 + 3 * (3 + 3)) * ms / 2  # every prepare and consume, on 2 workers
    latency = (3 + 0.5 + 0.1 + 0.5 + 3) * ms  # a loaded chunk from prepare to consume
    assert rep.ideal_s == pytest.approx(max(pool, latency)) == pytest.approx(10 * ms)
    assert rep.bottleneck == "cpu (prepare+consume)"
    assert rep.efficiency <= 1.0


@pytest.mark.parametrize("accepted", [[4.0], []], ids=["stall before the window's first chunk", "stalls only"])
def test_a_window_whose_stall_began_before_its_first_chunk_starts_its_trace_at_that_stall(accepted):
    """A report window (``report(reset=True)``) may hold a caller's stall that began before any of
    its chunks was accepted (one whose chunk ended in the previous window), or stalls and no
    chunk: its trace still counts from its earliest span, so no timestamp is negative and none
    is a time since the device was made."""
    from ringflow._trace.chrome import to_chrome
    from ringflow._trace.timeline import ChunkRecord, Span, Timeline

    records = [ChunkRecord(index=0, nbytes=8, final="delivered", accepted=a, ended=a + 1.0,
                           stages={"compute": (a + 0.2, a + 0.5)}) for a in accepted]
    stall = Span("stall: consumer", "consumer waiting for data", 2.0, 3.5)
    trace = json.loads(json.dumps(to_chrome(Timeline(records=records, stalls=[stall]))))
    ts = {e["name"]: e["ts"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert ts["consumer waiting for data"] == 0.0
    if accepted:
        assert ts["compute #0"] == pytest.approx(2.2e6)


@pytest.mark.parametrize("text, what", [
    ("", "the file is empty"),
    ("{not json", "not JSON"),
    ('{"events": []}', "'traceEvents'"),
    ("5", "a JSON number"),
    ('[{"ph": "X", "dur": 5, "cat": "h2d", "tid": 1}]', "event 0 has no numeric 'ts'"),
    ('[{"ph": "X", "ts": 0, "dur": 5, "tid": 1}]', "event 0 has no 'cat' or 'name' string"),
    ('[{"ph": "M", "name": "thread_name", "tid": 1}]', "event 0 (a thread_name) has no args.name string"),
    ("[7]", "event 0 is not a JSON object"),
])
def test_load_spans_names_the_file_and_what_is_wrong_with_it(tmp_path, text, what):
    """A file that is not a usable trace is one ValueError that names the file, what is wrong
    and where a trace comes from (a KeyError 'ts' or a TypeError named neither)."""
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        load_spans(str(path))
    msg = str(info.value)
    assert msg.startswith(f"{path} is not a Chrome trace: ") and what in msg, msg
    assert "Report.save_trace" in msg, msg


def test_load_spans_of_a_file_it_cannot_open_names_the_file_and_what_to_give(tmp_path):
    missing = tmp_path / "missing.json"
    with pytest.raises(FileNotFoundError) as info:
        load_spans(str(missing))
    assert info.value.filename == str(missing) and "Report.save_trace" in str(info.value), info.value
    with pytest.raises(ValueError, match=f"{tmp_path} is a folder; give the trace JSON file inside it"):
        load_spans(str(tmp_path))


@pytest.mark.parametrize("chunk, output", [(1001, None), (1 << 16, ((16,), "float32"))],
                         ids=["unaligned-chunk", "small-output"])
def test_report_memory_allocated_is_what_the_rings_allocated(chunk, output):
    """The report's allocated bytes are those the rings took: each device slot starts on a 256-byte
    boundary (a chunk of 1001 bytes takes 1024 but the last), and a small fixed output's device-out
    and host-out slots hold its bytes, 256 apart; counting each ring as its slots times their bytes
    gave other figures."""
    dev = rf.device("sim")
    rf.host.set_budget(1, device=dev)  # no pool: nothing pinned beside the rings
    with rf.Pipeline(lambda x, y: None, device=dev, chunk_bytes=chunk, output=output, slots=3, profile=True) as pipe:
        device = dev.memory_in_use
        pinned = sum(r.buffer.nbytes for r in pipe.scheduler.rings if r.buffer.is_host)
        list(pipe.map([np.ones(chunk // 4, np.float32)] * 4))
    memory = pipe.report().memory
    assert (memory["device allocated"], memory["pinned allocated"]) == (device, pinned)
    assert device == (2 * 1024 + 1001) * 2 if output is None else 3 * chunk + 2 * 256 + 64
