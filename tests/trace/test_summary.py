"""ringflow trace: the summary's figures, its legend, --json, and traces it must refuse."""

from __future__ import annotations

import json
import os
import re
import sys

import numpy as np
import pytest

from ringflow._cli import main
from ringflow._trace import summary
from ringflow._trace.summary import LEGEND, read_spans, summarise
from tests.helpers.traces import reference_summary, write_long_trace


def write_trace(path, spans, *, names=None):
    """A Chrome trace of (tid, cat, start_ms, end_ms, chunk) spans; ``names`` maps tid -> track."""
    events = [{"ph": "M", "pid": 1, "tid": tid, "name": "thread_name", "args": {"name": name}}
              for tid, name in (names or {}).items()]
    for tid, cat, a, b, chunk in spans:
        events.append({"ph": "X", "pid": 1, "tid": tid, "name": f"{cat} #{chunk}", "cat": cat, "ts": a * 1e3,
                       "dur": (b - a) * 1e3, "args": {"chunk": chunk}})
    path.write_text(json.dumps({"traceEvents": events}))
    return str(path)


@pytest.fixture
def two_workers(tmp_path):
    """prepare on two worker tracks: [0, 4] and [4, 8] ms on one, [2, 6] ms on the other; h2d
    [4, 6] and compute [5, 8] ms on their streams. Wall time 8 ms."""
    return write_trace(tmp_path / "t.json", [
        (1, "prepare", 0, 4, 0), (1, "prepare", 4, 8, 2), (2, "prepare", 2, 6, 1),
        (3, "h2d", 4, 6, 0), (4, "compute", 5, 8, 0)],
        names={1: "cpu: prepare", 2: "cpu: prepare [1]", 3: "gpu: h2d stream", 4: "gpu: compute stream"})


def test_busy_figures_by_hand(two_workers):
    info = summarise(two_workers)
    assert info["wall_ms"] == pytest.approx(8.0) and info["chunks"] == 3 and info["spans"] == 5
    prep = info["stages"]["prepare"]
    assert prep["count"] == 3 and prep["tracks"] == 2
    assert prep["total_ms"] == pytest.approx(12.0) and prep["median_ms"] == pytest.approx(4.0)
    assert prep["busy_fraction"] == pytest.approx(1.0)  # some prepare ran all 8 ms
    assert prep["per_track_fraction"] == pytest.approx(12 / 16)  # two tracks, 12 of 16 track-ms
    h2d = info["stages"]["h2d"]
    assert h2d["busy_fraction"] == pytest.approx(2 / 8) and h2d["per_track_fraction"] == pytest.approx(2 / 8)
    # h2d [4, 6] and compute [5, 8]: 5 ms of span time over a 4 ms union
    assert info["gpu_busy_union_ms"] == pytest.approx(4.0) and info["gpu_overlap"] == pytest.approx(5 / 4)
    assert list(info["stages"]) == ["prepare", "h2d", "compute"]  # pipeline order


def test_no_figure_tops_100_percent_and_a_legend_explains_them(two_workers, capsys):
    assert main(["trace", two_workers]) == 0
    out = capsys.readouterr().out
    assert all(int(p) <= 100 for p in re.findall(r"(\d+)%", out)), out
    assert "75%" in out  # busy/track of prepare
    for key in ("busy =", "tracks =", "busy/track =", "GPU stage overlap ="):
        assert key in out, key
    assert "x1.25" in out


def test_spans_that_overlap_on_one_track_stay_within_100_percent(tmp_path, capsys):
    """Three h2d spans at once on one thread (nested or hand-made spans; ringflow puts each on a
    lane of its own) counted as one track: busy/track read 200%, past the legend's 'at most
    100%'. The spans that ran at once count as tracks."""
    path = write_trace(tmp_path / "t.json", [(1, "h2d", 0, 4, 0), (1, "h2d", 1, 5, 1), (1, "h2d", 2, 6, 2),
                                             (2, "compute", 6, 7, 0)])
    h2d = summarise(path)["stages"]["h2d"]
    assert h2d["tracks"] == 3 and h2d["per_track_fraction"] == pytest.approx(12 / (3 * 7))
    assert main(["trace", path]) == 0
    out = capsys.readouterr().out
    assert all(int(p) <= 100 for p in re.findall(r"(\d+)%", out)), out


def test_json_summary_on_stdout(two_workers, capsys):
    assert main(["trace", "--json", two_workers]) == 0
    captured = capsys.readouterr()
    info = json.loads(captured.out)
    assert captured.err == ""
    assert info["stages"]["prepare"]["per_track_fraction"] == pytest.approx(0.75)
    assert info["stages"]["prepare"]["tracks"] == 2 and info["file"] == two_workers
    assert set(info["legend"]) == set(LEGEND) and "at most 100%" in info["legend"]["busy_fraction"]


def test_a_profiled_run_stays_within_100_percent(tmp_path, capsys):
    from tests.trace.test_trace import profiled_run

    path = profiled_run().save_trace(str(tmp_path / "run.json"))
    info = summarise(path)
    assert info["stages"]["prepare"]["tracks"] > 1  # four workers overlapped
    for name, st in info["stages"].items():
        assert 0 < st["busy_fraction"] <= 1 + 1e-9 and 0 < st["per_track_fraction"] <= 1 + 1e-9, name
    assert main(["trace", "--json", path]) == 0
    assert json.loads(capsys.readouterr().out)["chunks"] == 10


def test_a_trace_without_spans(tmp_path, capsys):
    path = write_trace(tmp_path / "none.json", [])
    assert summarise(path)["spans"] == 0
    assert main(["trace", path]) == 0
    assert "no spans" in capsys.readouterr().out


@pytest.mark.parametrize("text, phrase", [
    ("", "empty"),
    ("{", "not JSON"),
    ('{"traceEvents": {}}', "must be a list"),
    # a file of one value has no 'traceEvents' to blame
    ("NaN", "a JSON number, not an object with a 'traceEvents' list nor a list of events"),
    ('"trace"', "a JSON string, not an object"),
    ("null", "a JSON null, not an object"),
    ('[5]', "event 0 is not a JSON object (got int)"),
    ('[{"ph": "X", "ts": 1, "dur": 1}]', "no 'cat' or 'name'"),
    ('[{"ph": "X", "ts": true, "dur": 1, "name": "h2d"}]', "numeric 'ts'"),
    ('[{"ph": "X", "ts": 1, "dur": "2", "name": "h2d"}]', "'dur'"),
    ('[{"ph": "X", "ts": 1, "dur": 1, "name": "h2d", "args": []}]', "'args'"),
    ('[{"ph": "X", "ts": 1, "dur": 1, "name": "h2d", "args": {"chunk": [1]}}]', "args.chunk"),
    ('[{"ph": "M", "name": "thread_name", "tid": 1, "args": {"name": 3}}]', "args.name"),
])
def test_malformed_traces_are_value_errors_naming_the_file(tmp_path, text, phrase):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(phrase)) as info:
        read_spans(str(path))
    assert str(path) in str(info.value)


def test_unhashable_thread_ids_are_read(tmp_path):
    path = tmp_path / "tid.json"
    path.write_text(json.dumps([{"ph": "X", "tid": [1, 2], "ts": 0, "dur": 5, "name": "h2d"}]))
    (span,) = read_spans(str(path))
    assert span.name == "h2d" and span.end == pytest.approx(5e-6)


def test_json_summary_writes_null_for_a_total_beyond_a_float(tmp_path, capsys):
    """Spans whose durations add up beyond a float's range give an infinite total: --json writes
    null there (Infinity is not JSON), and the rest of the summary as it is."""
    events = [{"ph": "X", "tid": 1, "cat": "h2d", "name": "h2d", "ts": 0, "dur": 1e308, "args": {"chunk": i}}
              for i in range(10_000)]
    path = tmp_path / "huge.json"
    path.write_text(json.dumps(events))
    assert main(["trace", str(path), "--json"]) == 0
    text = capsys.readouterr().out
    assert "Infinity" not in text and "NaN" not in text
    h2d = json.loads(text)["stages"]["h2d"]
    assert h2d["total_ms"] is None and h2d["count"] == 10_000 and h2d["median_ms"] > 0


def test_the_table_prints_huge_durations_as_figures_not_inf_or_rows_of_digits(tmp_path, capsys, monkeypatch):
    """Spans of 1e308 us: the wall time and median were written out to some 300 digits (cut by
    the column to what read as a small number), and a total beyond a float's range read "inf".
    Beyond a float's exact digits figures are in powers of ten; a total past a float's range
    says that it is."""
    monkeypatch.setenv("COLUMNS", "200")  # (the whole title on one line)
    events = [{"ph": "X", "tid": 1, "cat": "h2d", "name": "h2d", "ts": 0, "dur": 1e308, "args": {"chunk": i}}
              for i in range(2000)]
    path = tmp_path / "huge.json"
    path.write_text(json.dumps(events))
    assert main(["trace", str(path)]) == 0
    out = capsys.readouterr().out
    assert "inf" not in out and not re.search(r"\d{17}", out), out
    assert "1.000e+305 ms wall time" in out
    (row,) = [line for line in out.splitlines() if line.startswith("│ h2d")]
    assert "1.0000e+305" in row and f">{sys.float_info.max:.1e}" in row, row


def test_the_table_prints_ordinary_durations_in_fixed_places(two_workers, capsys):
    assert main(["trace", two_workers]) == 0
    out = capsys.readouterr().out
    assert "8.000 ms wall time" in out and "4.0000" in out and "12.000" in out


def test_most_at_once_counts_overlaps_and_nothing_for_no_spans():
    from ringflow._trace.summary import _most_at_once

    assert _most_at_once(np.array([]), np.array([])) == 0
    starts, ends = np.array([0.0, 1.0, 2.0, 5.0]), np.array([2.0, 3.0, 4.0, 5.0])
    assert _most_at_once(starts, ends) == 2  # one ending as another starts does not overlap it


# -- a trace read as a stream: memory, and the same summary and errors as reading it whole ----------------------------
def test_summarising_a_long_trace_takes_a_fraction_of_its_size_in_memory(tmp_path):
    """The whole file was read into one string and parsed into a dict per event, then a Span per
    span: some ten times the file's size at once (gigabytes for a long run's trace). Events are
    now parsed one at a time and only their figures kept, in arrays."""
    import tracemalloc

    summarise(write_long_trace(str(tmp_path / "short.json"), 3))  # (what it imports on first use is not counted)
    path = write_long_trace(str(tmp_path / "long.json"), 5000)
    size = os.path.getsize(path)
    tracemalloc.start()
    try:
        info = summarise(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info["chunks"] == 5000 and info["stages"]["h2d"]["count"] == 5000
    assert peak < size, f"peak {peak} bytes for a trace of {size} bytes"


def _foreign_events() -> list:
    """Events as other writers (or hands) make them: thread names after the spans they name, ids
    of every JSON type, a name without a category, chunks beyond 64 bits, zero and equal spans."""
    events = [
        {"ph": "X", "tid": 1.0, "name": "h2d", "ts": 5, "dur": 3, "args": {"chunk": 2**70}},
        {"ph": "X", "tid": True, "cat": "compute", "name": "k", "ts": 5, "dur": 0},
        {"ph": "X", "tid": [1, 2], "cat": "prepare", "ts": 0, "dur": 10, "args": {"chunk": -2**70}},
        {"ph": "X", "tid": {"b": 1, "a": 2}, "cat": "prepare", "ts": 0, "dur": 10, "args": {"chunk": 3}},
        {"ph": "X", "tid": {"a": 2, "b": 1}, "cat": "prepare", "ts": 2, "dur": 1, "args": {"chunk": 3}},
        {"ph": "X", "cat": "d2h", "ts": 7.5, "dur": 2.25, "args": {"chunk": 1, "bytes": 8}},
        {"ph": "X", "tid": "7", "cat": "wait h\u00f6st \u2192 slot", "ts": 1, "dur": 2, "args": {"chunk": 9}},
        {"ph": "B", "tid": 1, "name": "ignored", "ts": 0},
        {"ph": "M", "tid": 1, "name": "thread_name", "args": {"name": "gpu: h2d stream"}},
        {"ph": "M", "tid": "7", "name": "thread_name", "args": {"name": "gpu: h2d stream"}},
        {"ph": "M", "tid": 1, "name": "thread_name", "args": {"name": "renamed"}},
    ]
    events += [{"ph": "X", "tid": i % 3, "cat": "consume", "ts": i * 0.5, "dur": 1.5, "args": {"chunk": i}}
               for i in range(50)]
    return events


def _same_traces(tmp_path) -> list:
    from tests.trace.test_trace import profiled_run

    events = _foreign_events()
    texts = {
        "object": json.dumps({"traceEvents": events}),
        "list": json.dumps(events),
        "indented, events last": json.dumps({"otherData": {"x": [1, {"y": "]"}]}, "displayTimeUnit": "ms",
                                             "traceEvents": events}, indent=2),
        "spaces everywhere": " \n{ \"traceEvents\" :\r\n[ " + " ,\t".join(json.dumps(e) for e in events) + " ] }\n",
        "no spans": json.dumps({"traceEvents": [{"ph": "M", "name": "process_name", "args": {"name": "x"}}]}),
        "empty list": "[]",
        "a key twice, the last kept": '{"traceEvents": [5], "traceEvents": ' + json.dumps(events) + "}",
    }
    paths = []
    for i, text in enumerate(texts.values()):
        path = tmp_path / f"t{i}.json"
        path.write_text(text, encoding="utf-8")
        paths.append(str(path))
    paths.append(write_long_trace(str(tmp_path / "long.json"), 300, seed=1))
    paths.append(profiled_run().save_trace(str(tmp_path / "run.json")))
    return paths


@pytest.mark.parametrize("read_chars", [None, 7])
def test_the_summary_is_the_one_of_every_span_read_whole(tmp_path, monkeypatch, read_chars):
    """Figure for figure, as computed with every span in a list; the file read in pieces of any
    size (events cut anywhere between two pieces)."""
    if read_chars is not None:
        monkeypatch.setattr(summary, "READ_CHARS", read_chars)
    for path in _same_traces(tmp_path):
        assert summarise(path) == reference_summary(path), path


@pytest.mark.parametrize("read_chars", [None, 5])
@pytest.mark.parametrize("text", [
    "", " \n\t", "\u00a0", "[\ufeff]", " \ufeff[]", "{", "[", "[1", "[{}", "[{},]", "[{}] x", "[{}]]", "{}", '{"a": 1}',
    '{"traceEvents": []', '{"traceEvents": [], }', '{"traceEvents": {}}', '{"traceEvents": 5}', "5", '"x"',
    "null", '{"traceEvents": [], "traceEvents": [5]}', "[5]",
    '[{"ph": "X", "ts": 1, "dur": 1}]', '[{"ph": "X", "ts": 1, "dur": 1, "name": "h2d"}, 5]',
    '[{"ph": "X", "ts": 1e999, "dur": 1, "name": "h2d"}]', '[{"ph": "X", "ts": 1, "dur": -1, "name": "h2d"}]',
    '[{"ph": "X", "ts": 1, "dur": 1, "name": "h2d", "args": {"chunk": 1.0}}]',
    '[{"ph": "X", "ts": 1, "dur": 1, "name": "h2d", "args": {"chunk": ' + "9" * 5000 + "}}]",
    "[" * 100_000 + "]" * 100_000, '[{"ph": "M", "name": "thread_name", "tid": 1, "args": []}]',
    '[{"ph": "X", "ts": 1, "dur": 1, "name": "h2d"}] \ud800',
])
def test_a_trace_it_refuses_is_refused_as_when_read_whole(tmp_path, monkeypatch, read_chars, text):
    """The same error, naming the same event or line and column, as reading the file whole."""
    path = tmp_path / "bad.json"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    with pytest.raises((ValueError, OSError)) as whole:
        read_spans(str(path))
    if read_chars is not None:
        monkeypatch.setattr(summary, "READ_CHARS", read_chars)
    with pytest.raises(type(whole.value)) as streamed:
        summarise(str(path))
    assert str(streamed.value) == str(whole.value)


@pytest.mark.parametrize("read_chars", [None, 1, 5])
def test_a_trace_saved_with_a_byte_order_mark_is_read_as_without_it(tmp_path, monkeypatch, read_chars):
    """A byte order mark first (some editors save UTF-8 with one) is not the JSON's: the trace was
    refused as "not JSON (Unexpected UTF-8 BOM (decode using utf-8-sig) ...)". Only a mark that
    starts the file is skipped; one after it is still not JSON (the list above)."""
    if read_chars is not None:
        monkeypatch.setattr(summary, "READ_CHARS", read_chars)
    plain = write_trace(tmp_path / "plain.json", [(1, "h2d", 0, 2, 0), (2, "compute", 1, 3, 0)],
                        names={1: "gpu: h2d stream", 2: "gpu: compute stream"})
    bommed = tmp_path / "bommed.json"
    bommed.write_bytes(b"\xef\xbb\xbf" + open(plain, "rb").read())
    assert read_spans(str(bommed)) == read_spans(plain)
    assert summarise(str(bommed)) == dict(summarise(plain), file=str(bommed))


def test_a_trace_of_several_processes_counts_each_process_chunks_and_names_its_own_threads(tmp_path):
    """A sharded call's trace has a process per device, each with chunks 0, 1, ... and thread ids
    1, 2, ... of its own: the summary counted chunk 0 of every device once, and named every
    process's thread 2 after the last process's thread 2."""
    events = [{"ph": "M", "pid": 1, "tid": 1, "name": "thread_name", "args": {"name": "cpu: prepare"}},
              {"ph": "M", "pid": 1, "tid": 2, "name": "thread_name", "args": {"name": "cpu: prepare [1]"}},
              {"ph": "M", "pid": 2, "tid": 1, "name": "thread_name", "args": {"name": "cpu: prepare"}},
              {"ph": "M", "pid": 2, "tid": 2, "name": "thread_name", "args": {"name": "gpu: h2d stream"}}]
    for pid, tid, cat, a, b, chunk in [(1, 1, "prepare", 0, 4, 0), (1, 2, "prepare", 1, 3, 1),
                                       (2, 1, "prepare", 0, 2, 0), (2, 2, "h2d", 2, 3, 0)]:
        events.append({"ph": "X", "pid": pid, "tid": tid, "name": f"{cat} #{chunk}", "cat": cat, "ts": a * 1e3,
                       "dur": (b - a) * 1e3, "args": {"chunk": chunk}})
    path = tmp_path / "two.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert {s.track for s in read_spans(str(path)) if s.name == "prepare"} == {"cpu: prepare", "cpu: prepare [1]"}
    info = summarise(str(path))
    assert info == reference_summary(str(path))
    assert info["chunks"] == 3 and info["stages"]["prepare"]["tracks"] == 3  # (two on one device, one on the other)


def test_the_summary_of_a_sharded_call_counts_every_device_chunks(tmp_path):
    import ringflow as rf

    devs = [rf.device("sim", seed=i) for i in range(2)]
    x = np.ones((256, 64), np.float32)
    _, report = rf.stream_map_report(lambda a, b: np.copyto(b, a), x, device=devs, chunk_bytes=1 << 13)
    assert summarise(report.save_trace(str(tmp_path / "t.json")))["chunks"] == report.chunks == 8
