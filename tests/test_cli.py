"""The command line end to end on the simulated GPU (what CI can run)."""

import errno
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import ringflow
import ringflow as rf
from ringflow._cli import main
from tests.helpers.threads import racing
from tests.helpers.host_strategy import slow_staged_chunks

MiB = 1 << 20


def test_demo_runs_on_the_simulated_gpu(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["demo", "--device", "sim", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "simulated" in out
    assert os.path.getsize(tmp_path / "trace.json") > 0
    assert open(tmp_path / "timeline.png", "rb").read(4) == b"\x89PNG"


def test_bench_runs_every_workload_on_the_sim(tmp_path, capsys):
    from ringflow import _plan as plan

    assert main(["bench", "--device", "sim", "--quick", "--out", str(tmp_path), "--trace",
                 str(tmp_path / "t.json")]) == 0
    (path,) = [p for p in os.listdir(tmp_path) if p.startswith("bench-sim")]
    res = json.load(open(tmp_path / path))
    assert set(res["workloads"]) == {"seed", "balanced", "compute-bound", "pageable", "requests"}
    assert "date" in res["environment"] and "command" in res["environment"]
    for name, w in res["workloads"].items():
        assert "error" not in w, (name, w.get("error"))
        for row in w["rows"]:
            assert row.get("correct", True) is not False, (name, row)
    assert res["workloads"]["seed"]["efficiency"] > 0.9
    # ringflow's rows are also timed with the input untouched between calls, as the C++ program's are
    seed = res["workloads"]["seed"]
    assert seed["efficiency_no_refill"] > 0.9
    sized = [r for r in seed["rows"] if "chunk_bytes" in r and "engine" not in r]  # one per chunk size tried
    # the same job bound once (MapJob): the direct engine at every size, the scheduler's at the chosen one
    jobs = [r for r in seed["rows"] if "MapJob" in r["name"]]
    assert {r["engine"] for r in jobs} == {"direct", "pipeline"} and len(jobs) == len(sized) + 1
    assert all(r["correct"] is True for r in jobs)
    # at 64 chunks of 256 KiB the simulated host's cost per operation bounds a call (copy groups
    # move those chunks four to a copy, but each still has its launch and events), and the ideal
    # bound counts only the stages' own time
    assert all(r["efficiency"] > 0.9 for r in jobs if r["chunk_bytes"] >= 512 << 10 and r["engine"] == "direct")
    # the scheduler's engine spends its host time per chunk (the planner's SCHEDULER_S_PER_CHUNK, on
    # the simulated GPU too) before each chunk's copy in: more than a copy of these chunks takes, so
    # it bounds the call, beyond the direct engine's bound (the row's ideal)
    (scheduled,) = [r for r in jobs if r["engine"] == "pipeline"]
    chunks = next(r["chunks"] for r in sized if r["chunk_bytes"] == scheduled["chunk_bytes"])
    assert scheduled["ms_median"] >= chunks * plan.SCHEDULER_S_PER_CHUNK * 1e3
    # and no call beats its bound, the host-bound ones included
    assert all(r["efficiency"] <= 1.0 for r in jobs + sized), [(r["name"], r["efficiency"]) for r in jobs + sized]
    assert seed["mapjob_efficiency"] > 0.9 and seed["mapjob_best_ms"] <= seed["mapjob_ms"]
    assert seed["vs_cpp_mapjob_like_with_like"] is None  # no C++ program on the simulated GPU
    assert sized and all(r["ms_median_no_refill"] > 0 for r in sized)
    assert main(["trace", str(tmp_path / "t.json")]) == 0


def test_bench_refuses_an_unknown_workload(capsys):
    assert main(["bench", "nope", "--device", "sim"]) == 2
    assert "unknown workload" in capsys.readouterr().err


def test_plan_command(capsys):
    assert main(["plan", "--bytes", "256MiB", "--pinned"]) == 0
    out = capsys.readouterr().out
    assert "slots" in out and "predicted total" in out
    assert main(["plan", "--bytes", "1GiB", "--chunk", "8MiB", "--compute-ms-per-gib", "5"]) == 0


def test_doctor_without_a_gpu_reports_the_profile(capsys):
    assert main(["doctor", "--json", "--device", "sim"]) == 0


# -- user mistakes: one stderr line, a non-zero exit, never a traceback -----------------------------------------------
SRC = os.path.dirname(os.path.dirname(os.path.abspath(ringflow.__file__)))


def run_cli(*args: str, env_extra: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    """``python -m ringflow ARGS`` with this checkout's package, no GPU choice inherited."""
    env = {k: v for k, v in os.environ.items() if k not in ("RINGFLOW_DEVICE", "RINGFLOW_DEBUG")}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "ringflow", *args], capture_output=True, text=True, timeout=120,
                          env=env, cwd=cwd)


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    """Files that are not traces or bench results, and a file to put paths under."""
    d = tmp_path_factory.mktemp("bad")
    contents = {"empty.json": "", "blank.json": "  \n", "corrupt.json": "not json{", "events_int.json": '{"traceEvents": 5}',
                "list_of_ints.json": "[1, 2, 3]", "no_events.json": '{"a": 1}', "x_without_ts.json": '[{"ph": "X"}]',
                "ts_text.json": '[{"ph": "X", "ts": "abc", "name": "h2d"}]', "null.json": "null",
                "negative_dur.json": '[{"ph": "X", "ts": 0, "dur": -5, "name": "h2d"}]',
                "nan_ts.json": '[{"ph": "X", "ts": NaN, "dur": 1, "name": "h2d"}]',
                "bad_thread_name.json": '[{"ph": "M", "name": "thread_name", "tid": 1, "args": 3}]',
                "bench_list.json": "[1]", "bench_rows_bad.json": '{"workloads": {"seed": {"rows": 5}}}',
                "bench_workload_bad.json": '{"workloads": {"seed": 5}}',
                "afile": "x", "deep.json": "[" * 100_000 + "]" * 100_000,
                "deep_events.json": '{"traceEvents": ' + "[" * 100_000 + "]" * 100_000 + "}",
                "long_number.json": '[{"ph": "X", "ts": 0, "dur": ' + "9" * 5000 + ', "name": "h2d"}]',
                # valid JSON, beyond a float's range: float arithmetic on it raised OverflowError
                "beyond_float.json": '[{"ph": "X", "ts": 0, "dur": ' + "9" * 400 + ', "name": "h2d"}]',
                "key_twice.json": '{"name": "a", "name": "b"}'}
    for name, text in contents.items():
        (d / name).write_text(text)
    (d / "binary.json").write_bytes(b"\xff\xfe\x00\x81garbage")
    return d


# (arguments, the command named in the error, a phrase the one line must contain); {d} is the bad_files folder
MISTAKES = [
    (["plan", "--bytes", "abc"], "plan", "argument --bytes: 'abc' is not a size (use e.g. 512MiB, 1GiB or 1073741824)"),
    (["plan", "--bytes", "-1"], "plan", "argument --bytes: '-1'"),
    # (a negative size with a unit was taken for an option: "expected one argument", naming no value)
    (["plan", "--bytes", "-1KiB"], "plan", "argument --bytes: '-1KiB'"),
    (["plan", "--chunk", "-8MiB"], "plan", "argument --chunk: '-8MiB'"),
    (["plan", "--bytes", "-.5GiB"], "plan", "argument --bytes: '-.5GiB'"),
    (["plan", "--bytes", "nan"], "plan", "argument --bytes: 'nan'"),
    (["plan", "--bytes", "inf"], "plan", "argument --bytes: 'inf'"),
    (["plan", "--bytes", "1e400"], "plan", "argument --bytes: '1e400'"),
    (["plan", "--bytes", "0"], "plan", "at least 1 byte"),
    (["plan", "--bytes", "0.1"], "plan", "at least 1 byte"),
    (["plan", "--bytes", ""], "plan", "argument --bytes"),
    (["plan", "--bytes", "1.5.5MiB"], "plan", "'1.5.5MiB' is not a size"),
    (["plan", "--bytes", "1XiB"], "plan", "'1XiB' is not a size"),
    (["plan", "--bytes", "99999PiB"], "plan", "too large"),
    # an exponent past what decimal.Decimal holds raised its InvalidOperation (an internal error)
    (["plan", "--bytes", "1e9999999999999999999"], "plan", "argument --bytes: '1e9999999999999999999' is too large"),
    (["plan", "--bytes", "1e-9999999999999999999"], "plan", "argument --bytes: '1e-9999999999999999999' is less than "
     "1 byte"),
    (["plan", "--chunk", "0.0e9999999999999999999KiB"], "plan", "argument --chunk: '0.0e9999999999999999999KiB' is "
     "less than 1 byte"),
    (["plan", "--bytes", "1000", "--row-bytes", "3"], "plan", "argument --row-bytes: --bytes 1000 is not a whole "
     "number of rows of 3 bytes"),
    (["plan", "--workers", "0"], "plan", "argument --workers: '0'"),
    (["plan", "--workers", "-3"], "plan", "argument --workers: '-3'"),
    (["plan", "--workers", "x"], "plan", "argument --workers: 'x'"),
    (["plan", "--workers", "2.5"], "plan", "argument --workers: '2.5'"),
    # int() and float() read these as 10, 3 and 12; a number on the command line is ASCII digits only
    (["plan", "--workers", "1_0"], "plan", "argument --workers: '1_0' is not a whole number of workers (use e.g. "),
    (["plan", "--workers", "\u0663"], "plan", "argument --workers: '\u0663' is not a whole number of workers"),
    (["plan", "--workers", "+3"], "plan", "argument --workers: '+3' is not a whole number of workers"),
    (["plan", "--devices", "\uff11\uff12"], "plan", "argument --devices: '\uff11\uff12' is not a whole number of GPUs"),
    (["plan", "--compute-ms-per-gib", "1_0"], "plan", "argument --compute-ms-per-gib: '1_0' is not a number of "
     "milliseconds (use e.g. "),
    (["plan", "--compute-ms-per-gib", "\u0663"], "plan", "argument --compute-ms-per-gib: '\u0663' is not a number"),
    (["plan", "--bytes", "\u0663MiB"], "plan", "argument --bytes: '\u0663MiB' is not a size (use e.g. "),
    (["plan", "--chunk", "\uff11\uff12MiB"], "plan", "argument --chunk: '\uff11\uff12MiB' is not a size"),
    (["plan", "--chunk", "abc"], "plan", "argument --chunk: 'abc' is not a size"),
    (["plan", "--chunk", "0"], "plan", "argument --chunk"),
    (["plan", "--chunk", "-5"], "plan", "argument --chunk"),
    (["plan", "--compute-ms-per-gib", "x"], "plan", "argument --compute-ms-per-gib: 'x'"),
    (["plan", "--compute-ms-per-gib", "-1"], "plan", "argument --compute-ms-per-gib: '-1'"),
    # (a word of "-" and a letter was taken for an option: "expected one argument", naming no value)
    (["plan", "--compute-ms-per-gib", "-inf"], "plan", "argument --compute-ms-per-gib: '-inf' is not a number"),
    (["plan", "--compute-ms-per-gib", "-NaN"], "plan", "argument --compute-ms-per-gib: '-NaN' is not a number"),
    (["plan", "--bytes", "-Infinity"], "plan", "argument --bytes: '-Infinity'"),
    (["plan", "--compute-ms-per-gib", "nan"], "plan", "argument --compute-ms-per-gib: 'nan'"),
    (["plan", "--compute-ms-per-gib", "inf"], "plan", "argument --compute-ms-per-gib: 'inf'"),
    (["plan", "--profile", "nope"], "plan", "argument --profile: unknown sim profile 'nope'"),
    (["plan", "--compare", "{d}/missing.json"], "plan", "missing.json"),
    (["plan", "--compare", "{d}/corrupt.json"], "plan", "not JSON"),
    (["plan", "--compare", "{d}/bench_list.json"], "plan", "bench"),
    (["plan", "--compare", "{d}/bench_rows_bad.json"], "plan", "rows"),
    # (it was said to have 'rows' that are not a list of tables, though it has no rows at all)
    (["plan", "--compare", "{d}/bench_workload_bad.json"], "plan",
     "--compare '{d}/bench_workload_bad.json': workload 'seed' is not a table (a JSON object holding its 'rows')"),
    (["plan", "--compare", "{d}"], "plan", "folder"),
    # (an empty name was taken for no --compare at all: the plan ran without the comparison asked for)
    (["plan", "--compare", ""], "plan", "argument --compare: an empty string is not a file name; give a bench JSON"),
    (["plan", "--compare", " "], "plan", "argument --compare: an empty string is not a file name"),
    (["plan", "--compare", "{d}/missing.json"], "plan",
     "--compare '{d}/missing.json': cannot read it (No such file or directory); give a bench JSON"),
    (["plan", "--nosuchopt"], "plan", "unrecognized arguments: --nosuchopt"),
    # (it said only "'{d}/missing.json': No such file or directory": neither the argument nor the change)
    (["trace", "{d}/missing.json"], "trace", "argument file: cannot read '{d}/missing.json' (No such file or "
     "directory); give a trace JSON written by Report.save_trace or ringflow bench --trace"),
    (["trace", "{d}/missing/t.json"], "trace", "argument file: cannot read '{d}/missing/t.json' (No such file"),
    (["trace", "{d}/empty.json"], "trace", "empty"),
    (["trace", "{d}/blank.json"], "trace", "empty"),
    (["trace", "{d}/corrupt.json"], "trace", "not JSON"),
    (["trace", "{d}/binary.json"], "trace", "binary.json"),
    (["trace", "{d}/events_int.json"], "trace", "traceEvents"),
    (["trace", "{d}/list_of_ints.json"], "trace", "event 0"),
    (["trace", "{d}/no_events.json"], "trace", "traceEvents"),
    (["trace", "{d}/null.json"], "trace", "not a Chrome trace"),
    (["trace", "{d}/x_without_ts.json"], "trace", "'ts'"),
    (["trace", "{d}/ts_text.json"], "trace", "'ts'"),
    (["trace", "{d}/nan_ts.json"], "trace", "'ts'"),
    (["trace", "{d}/negative_dur.json"], "trace", "'dur'"),
    (["trace", "{d}/bad_thread_name.json"], "trace", "args"),
    (["trace", "{d}"], "trace", "folder"),
    (["trace", "{d}/deep.json"], "trace", "not JSON (arrays or objects nested too deeply"),
    (["trace", "{d}/deep_events.json"], "trace", "not JSON (arrays or objects nested too deeply"),
    (["trace", "{d}/long_number.json"], "trace", "not JSON (a number of 5000 digits"),
    (["trace", "{d}/beyond_float.json"], "trace", "'dur' that is not a duration >= 0 in microseconds: inf"),
    (["plan", "--compare", "{d}/deep.json"], "plan", "not JSON (arrays or objects nested too deeply"),
    (["plan", "--profile", "{d}/deep.json"], "plan", "not JSON (arrays or objects nested too deeply"),
    (["plan", "--profile", "{d}/long_number.json"], "plan", "not JSON (a number of 5000 digits"),
    (["plan", "--profile", "{d}/key_twice.json"], "plan",
     "hardware profile '{d}/key_twice.json': key 'name' appears more than once in one object; keep one"),
    (["trace"], "trace", "the following arguments are required: file"),
    (["trace", ""], "trace", "argument file: an empty string is not a file name; give a trace JSON"),
    (["trace", "  "], "trace", "argument file: an empty string is not a file name; give a trace JSON"),
    (["doctor", "--device", "bogus"], "doctor", "argument --device: 'bogus' is not a device"),
    (["doctor", "--device", "cuda:abc"], "doctor", "argument --device: 'cuda:abc'"),
    (["doctor", "--device", ""], "doctor", "argument --device"),
    (["doctor", "--device", "cuda:7"], "doctor", "cuda:7"),
    (["doctor", "--device", "sim", "--output", "/proc/x/doctor.json"], "doctor", "argument --output"),
    (["doctor", "--device", "sim", "--output", "{d}/afile/x.json"], "doctor", "argument --output"),
    (["doctor", "--device", "sim", "--output", "{d}"], "doctor", "folder"),
    (["demo", "--device", "bogus"], "demo", "argument --device: 'bogus' is not a device"),
    (["demo", "--device", "cuda:7"], "demo", "cuda:7"),
    (["demo", "--device", "sim", "--out", "/proc/x"], "demo", "argument --out"),
    (["demo", "--device", "sim", "--out", "{d}/afile/sub"], "demo", "argument --out"),
    (["demo", "--device", "sim", "--out", "{d}/afile"], "demo", "argument --out"),
    (["bench", "--device", "bogus", "seed"], "bench", "argument --device: 'bogus' is not a device"),
    (["bench", "--device", "cuda:7", "seed"], "bench", "cuda:7"),
    (["bench", "nosuchworkload"], "bench", "unknown workload"),
    (["bench", "--device", "sim", "--quick", "seed", "--out", "/proc/x"], "bench", "argument --out"),
    (["bench", "--device", "sim", "--quick", "seed", "--trace", "{d}/afile/t.json"], "bench", "argument --trace"),
    (["bench", "--device", "sim", "--quick", "seed", "--plot", "/proc/x/t.png"], "bench", "argument --plot"),
    (["demo", "--device", "sim", "--out", ""], "demo", "argument --out: give a folder name"),
    (["trace", "/dev/zero"], "trace", "not a regular file"),  # would never end
    (["plan", "--compare", "/dev/zero"], "plan", "not a regular file"),  # read until memory ran out
    (["plan", "--profile", "/dev/zero"], "plan", "not a regular file"),
    (["doctor", "--device", "sim", "--json", "--output", "/dev/full"], "doctor", "'/dev/full' is not a regular file"),
    (["bench", "--device", "sim", "--quick", "seed", "--plot", "{d}/x.txt"], "bench", "cannot write .txt"),
    (["bench", "--device", "sim", "--quick", "seed", "--plot", "{d}/x.pngx"], "bench",
     "argument --plot: matplotlib cannot write .pngx files (path '{d}/x.pngx'); end the name with one of "),
    (["plan", "--workers", "1025"], "plan", "workers: give 1 to 1024"),
    (["plan", "--devices", "0"], "plan", "argument --devices: '0' GPUs: give 1 to 64"),
    (["bench", "--device", "sim", "--quick", "seed", "--trace", "/dev/full"], "bench", "'/dev/full' is not a regular file"),
    (["bench", "--device", "sim", "--quick", "seed", "--plot", "/dev/null"], "bench", "--plot: '/dev/null' is not a regular"),
    # each found before the run, not after it (the bench's results were then lost)
    (["bench", "--device", "sim", "--quick", "seed", "--trace", "{d}/newdir/"], "bench", "ends with a slash"),
    (["bench", "--device", "sim", "--quick", "seed", "--trace", "{d}/missing/../t.json"], "bench", "does not exist"),
    (["bench", "--device", "sim", "--quick", "seed", "--trace", "{d}/" + "t" * 300], "bench", "File name too long"),
    (["bench", "--device", "sim", "--quick", "seed", "--trace", "{d}/same.png", "--plot", "{d}/same.png"], "bench",
     "argument --plot: '{d}/same.png' is also given to --trace"),
    (["bench", "--device", "sim", "--quick", "seed", "--out", "{d}/o", "--trace", "{d}/o"], "bench",
     "is also given to --out"),
    (["doctor", "--device", "sim", "--output", "{d}/p.json", "--save", "{d}/p.json"], "doctor", "also given to --output"),
    (["nosuchcommand"], None, "invalid choice: 'nosuchcommand'"),
    (["--nosuch"], None, "unrecognized arguments: --nosuch"),
]


def check_one_line(code, err, command, phrase):
    lines = err.strip().splitlines()
    assert code != 0
    assert "Traceback" not in err
    assert len(lines) == 1, err
    prefix = f"ringflow {command}: error: " if command else "ringflow: error: "
    assert lines[0].startswith(prefix), lines[0]
    assert phrase in lines[0], lines[0]


@pytest.mark.parametrize("args, command, phrase", MISTAKES, ids=[" ".join(m[0]) or "-" for m in MISTAKES])
def test_a_mistake_is_one_stderr_line_and_a_non_zero_exit(bad_files, monkeypatch, capsys, args, command, phrase):
    monkeypatch.delenv("RINGFLOW_DEVICE", raising=False)
    monkeypatch.delenv("RINGFLOW_DEBUG", raising=False)
    code = main([a.replace("{d}", str(bad_files)) for a in args])
    check_one_line(code, capsys.readouterr().err, command, phrase.replace("{d}", str(bad_files)))


# one of each kind of mistake, run as a user would: a fresh interpreter, its real stderr
IN_A_PROCESS = ["plan --bytes abc", "plan --workers 0", "plan --bytes 1000 --row-bytes 3",
                "plan --compare {d}/corrupt.json", "trace {d}/missing.json",
                "trace {d}/empty.json", "trace {d}/corrupt.json", "trace {d}/events_int.json", "doctor --device bogus",
                "doctor --device cuda:7", "demo --device cuda:7", "demo --device sim --out {d}/afile/sub",
                "bench --device bogus seed", "bench nosuchworkload", "doctor --device sim --output /proc/x/doctor.json",
                "nosuchcommand"]


@pytest.mark.parametrize("args, said", [
    (["demo", "--device", "sim", "--out", "/proc/x"], "cannot write into '/proc' to make folder '/proc/x' ("),
    (["bench", "--device", "sim", "--quick", "seed", "--out", "/proc"], "cannot write into '/proc' ("),
], ids=["missing", "existing"])
def test_a_folder_that_takes_no_file_is_named_with_what_to_change(capsys, args, said):
    """A folder whose file system refuses a new file (/proc, a read-only mount): the line named
    the made-up name of the probe file as if it were the problem, and said nothing to change."""
    code = main(args)
    err = capsys.readouterr().err
    check_one_line(code, err, args[0], f"argument --out: {said}")
    assert err.rstrip().endswith("); give another folder name"), err
    assert "tmp" not in err, err


@pytest.mark.parametrize("line", IN_A_PROCESS)
def test_a_mistake_in_a_fresh_process(bad_files, line):
    (args, command, phrase), = [m for m in MISTAKES if " ".join(m[0]) == line]
    proc = run_cli(*[a.replace("{d}", str(bad_files)) for a in args])
    check_one_line(proc.returncode, proc.stderr, command, phrase.replace("{d}", str(bad_files)))


def test_a_stdout_that_is_not_utf8_gets_the_report_with_what_it_cannot_show_escaped(tmp_path):
    """An ASCII stdout (PYTHONIOENCODING, a POSIX locale without UTF-8, an old console) cannot
    show every character a report prints (a dash, an ellipsis, a file's name): the command
    failed at the first one, after all its work, with only an encoding error to show."""
    # its name is printed in the plan's title; relative, so that no long folder folds the title's line
    profile = "profil-\u00fc\u20ac.json"
    assert run_cli("doctor", "--device", "sim", "--save", profile, cwd=tmp_path).returncode == 0
    for args, shown in ((["doctor", "--device", "sim"], "simulated"),
                        (["plan", "--bytes", "1MiB", "--profile", profile], "profil-\\xfc\\u20ac.json")):
        proc = run_cli(*args, env_extra={"PYTHONIOENCODING": "ascii"}, cwd=tmp_path)
        assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
        assert shown in proc.stdout


def test_a_posix_locale_stdout_gets_the_report_with_what_it_cannot_show_escaped():
    """In the POSIX locale with UTF-8 mode off, Python's stdout is ASCII with the error handler
    ``surrogateescape``, not ``strict``: it fails on a dash as a strict one does, and the
    doctor's report failed at its title, after all its work."""
    posix = {"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0", "PYTHONIOENCODING": ""}
    proc = run_cli("doctor", "--device", "sim", env_extra=posix)
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
    assert "doctor \\u2014 simulated" in proc.stdout


class FullStdout(io.StringIO):
    """A stdout on a full disk: every write fails as the OS's would."""

    def write(self, text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("args", [["plan", "--bytes", "1MiB"], ["trace", "--json", "{trace}"]], ids=["plan", "trace"])
def test_a_stdout_that_cannot_be_written_is_named(tmp_path, monkeypatch, capsys, args):
    """Output redirected to a full disk: the OS's words alone ('No space left on device') named
    neither what could not be written nor what to do."""
    trace = tmp_path / "t.json"
    trace.write_text('[{"ph": "X", "ts": 0, "dur": 5, "name": "h2d", "tid": 1}]')
    monkeypatch.setattr(sys, "stdout", FullStdout())
    code = main([a.replace("{trace}", str(trace)) for a in args])
    check_one_line(code, capsys.readouterr().err, args[0],
                   "cannot write the output to standard output (No space left on device); send it where it can be "
                   "written")
    assert code == 1


def test_a_bench_whose_stdout_is_full_still_writes_its_results(tmp_path, monkeypatch, capsys):
    """``ringflow bench --out DIR`` into a full disk: the tables, printed after the whole run,
    failed before the results were written into DIR, and the run's results were lost."""
    monkeypatch.setattr(sys, "stdout", FullStdout())
    assert main(["bench", "--device", "sim", "--quick", "seed", "--out", str(tmp_path)]) == 1
    (result,) = tmp_path.glob("bench-sim-*.json")
    assert "ringflow_ms" in json.loads(result.read_text())["workloads"]["seed"]


@pytest.mark.skipif(sys.platform == "win32", reason="a POSIX pipe")
def test_a_bench_piped_into_a_reader_that_went_away_still_writes_its_results(tmp_path):
    """``ringflow bench --out DIR | head``: as for a full disk, the results were lost."""
    env = {k: v for k, v in os.environ.items() if k not in ("RINGFLOW_DEVICE", "RINGFLOW_DEBUG")}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    read, write = os.pipe()
    os.close(read)  # the reader gone before the first line
    try:
        proc = subprocess.run([sys.executable, "-m", "ringflow", "bench", "--device", "sim", "--quick", "seed",
                               "--out", str(tmp_path)], stdout=write, stderr=subprocess.PIPE, text=True, timeout=120,
                              env=env)
    finally:
        os.close(write)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    (result,) = tmp_path.glob("bench-sim-*.json")
    assert "ringflow_ms" in json.loads(result.read_text())["workloads"]["seed"]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_stdout_on_a_full_device_is_named_in_a_fresh_process():
    env = {k: v for k, v in os.environ.items() if k not in ("RINGFLOW_DEVICE", "RINGFLOW_DEBUG")}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "ringflow", "plan"], stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=120, env=env)
    check_one_line(proc.returncode, proc.stderr, "plan", "cannot write the output to standard output")


@pytest.mark.parametrize("args, command", [(["--help"], None), (["--version"], None), (["plan", "--help"], "plan"),
                                           ([], None)], ids=["help", "version", "plan help", "no command"])
def test_help_or_version_on_a_stdout_that_cannot_be_written_is_an_error(monkeypatch, capsys, args, command):
    """argparse drops an error in writing its help or the version: on a full disk the command
    printed nothing and exited 0."""
    monkeypatch.setattr(sys, "stdout", FullStdout())
    code = main(args)
    check_one_line(code, capsys.readouterr().err, command, "cannot write the output to standard output (No space "
                   "left on device); send it where it can be written")
    assert code == 1


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("option", ["--help", "--version"])
def test_help_or_version_on_a_full_device_fails_in_a_fresh_process(option):
    env = {k: v for k, v in os.environ.items() if k not in ("RINGFLOW_DEVICE", "RINGFLOW_DEBUG")}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "ringflow", option], stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=120, env=env)
    check_one_line(proc.returncode, proc.stderr, None, "cannot write the output to standard output")
    assert proc.returncode == 1


@pytest.mark.parametrize("args, command", [(["plan", "--bytes", "1MiB"], "plan"), (["--version"], None)],
                         ids=["plan", "version"])
def test_a_closed_stdout_is_an_error(monkeypatch, capsys, args, command):
    """A process started with its stdout closed (``ringflow plan >&-``) has ``sys.stdout`` None,
    where every print is dropped: the command printed nothing and exited 0."""
    monkeypatch.setattr(sys, "stdout", None)
    code = main(args)
    check_one_line(code, capsys.readouterr().err, command, "cannot write the output to standard output (Bad file "
                   "descriptor); send it where it can be written")
    assert code == 1 and sys.stdout is None


@pytest.mark.skipif(sys.platform == "win32", reason="closes a POSIX file descriptor")
def test_a_closed_stdout_is_an_error_in_a_fresh_process():
    env = {k: v for k, v in os.environ.items() if k not in ("RINGFLOW_DEVICE", "RINGFLOW_DEBUG")}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "ringflow", "plan"], stderr=subprocess.PIPE, text=True, timeout=120,
                          env=env, preexec_fn=lambda: os.close(1))
    check_one_line(proc.returncode, proc.stderr, "plan", "cannot write the output to standard output")
    assert proc.returncode == 1


@pytest.mark.parametrize("args, command, status, debug", [
    (["plan", "--profile", "{d}/missing.json"], "plan", 1, False),
    (["plan", "--profile", "{d}/missing.json"], "plan", 1, True),  # the traceback too
    (["trace", "{d}/corrupt.json"], "trace", 1, False),
    (["plan", "--bytes", "abc"], "plan", 2, False),
], ids=["error", "error with traceback", "trace error", "usage"])
def test_a_closed_stderr_keeps_errors_out_of_stdout(bad_files, monkeypatch, capsys, args, command, status, debug):
    """A process started with its stderr closed (``ringflow plan 2>&-``) has ``sys.stderr`` None,
    and ``print(file=None)`` writes to stdout: the error line landed in the command's output.
    Nothing is left to say it on; the exit status does."""
    monkeypatch.delenv("RINGFLOW_DEVICE", raising=False)
    monkeypatch.setenv("RINGFLOW_DEBUG", "1" if debug else "0")
    monkeypatch.setattr(sys, "stderr", None)
    code = main([a.replace("{d}", str(bad_files)) for a in args])
    out, _ = capsys.readouterr()
    assert (code, out) == (status, ""), (code, out)
    assert sys.stderr is None


def test_a_closed_stderr_keeps_warning_lines_out_of_stdout(monkeypatch, capsys):
    """The warning lines (a warning, a record of the library's logger) go where the error lines
    go: not into the command's output."""
    import logging
    import warnings

    import ringflow._cli as cli

    def plan_that_warns(args):
        warnings.warn("a warning of the command", RuntimeWarning)
        logging.getLogger("ringflow").warning("a warning the library logs")
        print("the output")
        return 0

    monkeypatch.setattr(cli, "_plan", plan_that_warns)
    monkeypatch.setattr(sys, "stderr", None)
    code = main(["plan"])
    out, _ = capsys.readouterr()
    assert (code, out) == (0, "the output\n"), (code, out)


def test_a_closed_stderr_keeps_the_entry_points_interrupted_line_out_of_stdout(monkeypatch, capsys):
    """A Ctrl-C before the command line is parsed is said by the entry point: not into stdout
    either."""
    import _ringflow_entry

    import ringflow._cli as cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    monkeypatch.setattr(sys, "argv", ["ringflow", "bench", "--quick"])
    monkeypatch.setattr(sys, "stderr", None)
    assert _ringflow_entry.main() == 130
    assert capsys.readouterr().out == ""


@pytest.mark.skipif(sys.platform == "win32", reason="closes a POSIX file descriptor")
def test_a_closed_stderr_keeps_errors_out_of_stdout_in_a_fresh_process(bad_files):
    env = {k: v for k, v in os.environ.items() if k not in ("RINGFLOW_DEVICE", "RINGFLOW_DEBUG")}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "ringflow", "plan", "--profile", str(bad_files / "missing.json")],
                          stdout=subprocess.PIPE, text=True, timeout=120, env=env, preexec_fn=lambda: os.close(2))
    assert (proc.returncode, proc.stdout) == (1, ""), (proc.returncode, proc.stdout)


def test_usage_mistakes_exit_2():
    proc = run_cli("plan", "--bytes", "abc")
    assert proc.returncode == 2 and proc.stdout == ""


def test_doctor_on_a_missing_gpu_still_prints_the_report(bad_files):
    from ringflow._device import cuda_available

    proc = run_cli("doctor", "--json", "--device", "cuda:7")
    assert proc.returncode == 1
    if not cuda_available()[0]:  # no CUDA here: the report is printed all the same, and says why
        report = json.loads(proc.stdout)
        assert report["device_spec"] == "cuda:7" and report["cuda_usable"] is False and report["cuda_reason"]


def test_an_unwritable_output_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    import ringflow._bench.runner as runner

    def must_not_run(*a, **k):
        raise AssertionError("the bench ran although its output folder cannot be written")

    monkeypatch.setattr(runner, "run_bench", must_not_run)
    (tmp_path / "afile").write_text("x")
    assert main(["bench", "--device", "sim", "--out", str(tmp_path / "afile" / "sub")]) == 2
    assert "argument --out" in capsys.readouterr().err


# folders that cannot be made, though their nearest existing ancestor takes a new file: each was
# found only by the makedirs after the whole run (exit 1, the bench's results lost)
OUT_FOLDERS = {
    "a link to itself": lambda d: _link(d / "loop", "loop"),
    "a link to nothing": lambda d: _link(d / "dangling", "missing/x"),
    "under a link to itself": lambda d: _link(d / "loop", "loop") / "sub",
    "a name too long": lambda d: d / ("n" * 300),
    "under a name too long": lambda d: d / ("n" * 300) / "sub",
    "a path too long": lambda d: d.joinpath(*["p" * 200] * 25),
}


def _link(path, target):
    os.symlink(target, path)
    return path


@pytest.mark.parametrize("command", ["bench", "demo"])
@pytest.mark.parametrize("make", OUT_FOLDERS.values(), ids=OUT_FOLDERS.keys())
def test_an_out_folder_that_cannot_be_made_is_refused_before_any_work(tmp_path, monkeypatch, capsys, command, make):
    _out_refused_before_any_work(tmp_path, monkeypatch, capsys, command, str(make(tmp_path)))


def _out_refused_before_any_work(tmp_path, monkeypatch, capsys, command: str, out: str) -> None:
    """``command --out out`` exits 2 with one line about ``--out``, without running and without
    leaving anything new in ``tmp_path``."""
    import ringflow._bench.runner as runner
    import ringflow._demo as demo

    def must_not_run(*a, **k):
        raise AssertionError(f"the {command} ran although its --out folder {out!r} was to be refused")

    monkeypatch.setattr(runner, "run_bench", must_not_run)
    monkeypatch.setattr(demo, "demo", must_not_run)
    before = sorted(os.listdir(tmp_path))
    code = main([command, "--device", "sim", "--quick", "seed", "--out", out] if command == "bench"
                else [command, "--device", "sim", "--out", out])
    check_one_line(code, capsys.readouterr().err, command, "argument --out: ")
    assert code == 2
    assert sorted(os.listdir(tmp_path)) == before  # (the check makes nothing it leaves behind)


def _folder_of_path_length(base, length: int) -> str:
    """A folder under ``base`` (not made) whose absolute path is ``length`` bytes long."""
    parts, left = [], length - len(os.fsencode(os.path.abspath(base)))
    while left > 0:
        n = min(200, left - 1)
        if left - 1 - n == 1:  # would leave a last part of no name: this one shorter
            n -= 1
        parts.append("p" * n)
        left -= 1 + n
    out = os.path.join(os.path.abspath(base), *parts)
    assert len(os.fsencode(out)) == length
    return out


@pytest.mark.parametrize("made", [False, True], ids=["missing", "made"])
@pytest.mark.parametrize("command", ["bench", "demo"])
def test_an_out_folder_too_long_for_the_files_the_command_writes_is_refused_before_any_work(tmp_path, monkeypatch,
                                                                                           capsys, command, made):
    """The folder's own path fits, but not with the name of a file the command writes into it
    (bench-cuda-<time>.json, trace.json and timeline.png): that write failed after the whole run,
    its results lost."""
    longest_path = os.pathconf(tmp_path, "PC_PATH_MAX")
    out = _folder_of_path_length(tmp_path, longest_path - 1 - len("/trace.json") + 1)  # trace.json: 1 byte over
    if made:
        os.makedirs(out)
    _out_refused_before_any_work(tmp_path, monkeypatch, capsys, command, out)


@pytest.mark.parametrize("option", ["--trace", "--plot"])
@pytest.mark.parametrize("target", ["device", "fifo", "read-only"])
def test_an_output_file_that_cannot_take_the_result_is_refused_before_any_work(tmp_path, monkeypatch, capsys,
                                                                                option, target):
    import ringflow._bench.runner as runner

    def must_not_run(*a, **k):
        raise AssertionError(f"the bench ran although its {option} file cannot be written")

    monkeypatch.setattr(runner, "run_bench", must_not_run)
    if target == "device":
        path = "/dev/full"  # every write fails, but only once written: after the whole bench
    elif target == "fifo":
        path = str(tmp_path / "pipe.png")
        os.mkfifo(path)  # opening it to write would wait for a reader for ever
    else:
        path = str(tmp_path / "kept.png")
        open(path, "w").close()
        os.chmod(path, 0o444)
        if os.access(path, os.W_OK):
            pytest.skip("this user writes read-only files (root)")
    assert main(["bench", "--device", "sim", "--quick", "seed", option, path]) == 2
    err = capsys.readouterr().err
    assert f"argument {option}" in err and repr(path) in err, err


@pytest.mark.parametrize("name, make", [("trace.json", os.mkdir), ("timeline.png", os.mkfifo)],
                         ids=["a folder", "a fifo"])
def test_a_demo_folder_whose_output_file_cannot_be_written_is_refused_before_any_work(tmp_path, monkeypatch, capsys,
                                                                                       name, make):
    """The demo writes trace.json and timeline.png into --out: one that is a folder or a pipe
    there failed only after the whole demo had run."""
    import ringflow._demo as demo

    def must_not_run(*a, **k):
        raise AssertionError(f"the demo ran although its {name} cannot be written")

    monkeypatch.setattr(demo, "demo", must_not_run)
    make(str(tmp_path / name))
    assert main(["demo", "--device", "sim", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ringflow demo: error: argument --out: ") and repr(str(tmp_path / name)) in err, err
    assert "give another folder" in err and len(err.splitlines()) == 1


def _profile_with_a_key(folder, key):
    from ringflow._device.hardware import UNIT_TEST

    doc = UNIT_TEST.to_dict()
    doc["model"][key] = 1
    path = folder / "profile.json"
    path.write_text(json.dumps(doc))
    return str(path)


# text the user did not write as one line: a file's name (from a listing: `ringflow trace *`) or a
# key read from a file, holding a line break other than \n or a terminal's control sequence
CONTROL_IN_ERRORS = {
    "a carriage return in a path": lambda d: ["trace", str(d / "a\rb.json")],
    "a line separator in a path": lambda d: ["trace", str(d / "a\u2028b.json")],
    "a vertical tab in a path": lambda d: ["trace", str(d / "a\x0bb.json")],
    "an escape sequence in a path": lambda d: ["trace", str(d / "a\x1b[2Jb.json")],
    "a carriage return in a profile's key": lambda d: ["plan", "--profile", _profile_with_a_key(d, "ok\rfine")],
    "an escape sequence in a profile's key": lambda d: ["plan", "--profile", _profile_with_a_key(d, "k\x1b]0;t\x07")],
}


@pytest.mark.parametrize("make", CONTROL_IN_ERRORS.values(), ids=CONTROL_IN_ERRORS.keys())
def test_an_error_holding_line_breaks_or_control_characters_is_one_plain_line(tmp_path, monkeypatch, capsys, make):
    """Only \\n was made a space: a carriage return or line separator split the line (a terminal
    wrote the rest over its start), and an escape sequence reached the terminal."""
    import re

    monkeypatch.delenv("RINGFLOW_DEBUG", raising=False)
    args = make(tmp_path)
    code = main(args)
    err = capsys.readouterr().err
    check_one_line(code, err, args[0], "error: ")
    assert not re.search(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]", err[:-1]), repr(err)
    assert err.endswith("\n")


@pytest.mark.parametrize("interrupt, code", [(KeyboardInterrupt(), 130), (SystemExit(3), 3)])
def test_ctrl_c_inside_a_simulated_launch_stops_the_bench(monkeypatch, capsys, interrupt, code):
    """The simulated GPU runs a launched function inside a later call and reports what it raised
    as a LaunchError caused by it; a Ctrl-C there was a failed workload's row, the bench went on
    and ended 1 with nothing on stderr."""
    import ringflow._bench.runner as runner

    def interrupted(*a, **k):
        err = rf.LaunchError("launch f on stream 1 failed: KeyboardInterrupt: ")
        err.__cause__ = interrupt
        raise err

    monkeypatch.setattr(runner, "run_workload", interrupted)
    monkeypatch.delenv("RINGFLOW_DEBUG", raising=False)
    if isinstance(interrupt, SystemExit):
        with pytest.raises(SystemExit) as info:
            main(["bench", "--device", "sim", "--quick", "seed", "balanced"])
        assert info.value.code == code
        return
    assert main(["bench", "--device", "sim", "--quick", "seed", "balanced"]) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["ringflow bench: interrupted"], err


def _launch_interrupted(*args, **kwargs):
    """What the simulated GPU raises when a launched function got the Ctrl-C."""
    err = rf.LaunchError("launch affine_iter_64 on stream 39 failed: KeyboardInterrupt: ")
    err.__cause__ = KeyboardInterrupt()
    raise err


def test_ctrl_c_inside_a_simulated_launch_stops_the_demo(tmp_path, monkeypatch, capsys):
    """The demo has no runner of its own to look behind the simulated GPU's LaunchError: a Ctrl-C
    during its seed workload was 'error: launch ... failed: KeyboardInterrupt:' and exit 1."""
    import ringflow._bench.workloads as workloads

    monkeypatch.setattr(workloads, "inplace_pinned", _launch_interrupted)
    monkeypatch.delenv("RINGFLOW_DEBUG", raising=False)
    assert main(["demo", "--device", "sim", "--out", str(tmp_path / "demo")]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["ringflow demo: interrupted"]


def test_a_demo_interrupted_in_its_profiled_run_leaves_no_folder_behind(tmp_path, monkeypatch, capsys):
    """The demo made its --out folder (and any missing above it) before the profiled run: a
    Ctrl-C there left empty folders behind, with nothing written into them."""
    import ringflow._bench.workloads as workloads
    import ringflow._pipeline.whole_array as whole_array

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    def quick(dev, **kwargs):  # the comparisons before the profiled run are not what is tested
        return {"workload": "quick", "rows": []}

    monkeypatch.setattr(workloads, "pageable", quick)
    monkeypatch.setattr(workloads, "inplace_pinned", quick)
    monkeypatch.setattr(whole_array, "stream_map_report", interrupted)
    monkeypatch.delenv("RINGFLOW_DEBUG", raising=False)
    assert main(["demo", "--device", "sim", "--out", str(tmp_path / "new" / "demo")]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["ringflow demo: interrupted"]
    assert os.listdir(tmp_path) == []


def test_a_ctrl_c_behind_any_commands_error_is_an_interrupt(monkeypatch, capsys):
    import ringflow._cli as cli

    monkeypatch.setattr(cli, "_plan", _launch_interrupted)
    monkeypatch.delenv("RINGFLOW_DEBUG", raising=False)
    assert main(["plan"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["ringflow plan: interrupted"]


@pytest.mark.parametrize("exc, code, phrase", [
    (KeyError("boom"), 1, "internal error"),
    (ModuleNotFoundError("No module named 'rich'", name="rich"), 1, "'rich' cannot be imported"),
    (ModuleNotFoundError("No module named 'rich'", name="rich"), 1, "; pip install rich"),
    (ImportError("libcuda.so.1: cannot open shared object file", name="cuda.bindings.driver"), 1,
     "pip install 'ringflow[cuda]'"),
    (ImportError("cannot import name 'x'"), 1, "pip install --force-reinstall ringflow"),
    (ZeroDivisionError("boom"), 1, "internal error"),
    (KeyboardInterrupt(), 130, "interrupted"),
    (ValueError("bad value\nsecond line"), 1, "error: bad value second line"),
    (OSError(28, "No space left on device", "/x/y"), 1, "No space left on device"),
    (rf.StageError("compute", 3, RuntimeError("kernel failed")), 1, "stage 'compute' failed for chunk 3"),
])
def test_main_turns_every_exception_into_one_line(monkeypatch, capsys, exc, code, phrase):
    import ringflow._cli as cli

    def boom(args):
        raise exc

    monkeypatch.delenv("RINGFLOW_DEBUG", raising=False)
    monkeypatch.setattr(cli, "_plan", boom)
    assert main(["plan"]) == code
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("ringflow plan: ") and phrase in err
    if phrase == "internal error":
        assert "RINGFLOW_DEBUG=1" in err and type(exc).__name__ in err


def test_ringflow_debug_shows_the_traceback(monkeypatch, capsys):
    import ringflow._cli as cli

    def boom(args):
        raise KeyError("boom")

    monkeypatch.setenv("RINGFLOW_DEBUG", "1")
    monkeypatch.setattr(cli, "_plan", boom)
    assert main(["plan"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "KeyError" in err and "internal error" in err


def test_an_auto_fallback_warning_is_one_line(monkeypatch, capsys):
    import warnings

    import ringflow._cli as cli

    def warns(args):
        warnings.warn("first\nsecond", RuntimeWarning)
        return 0

    monkeypatch.setattr(cli, "_plan", warns)
    assert main(["plan"]) == 0
    assert capsys.readouterr().err == "ringflow plan: warning: first second\n"


# -- --version, --help, python -m ringflow ----------------------------------------------------------------------------
def test_version():
    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout == f"ringflow {ringflow.__version__}\n"


def test_python_m_ringflow_help():
    proc = run_cli("--help")
    assert proc.returncode == 0 and proc.stderr == ""
    for command in ("doctor", "demo", "bench", "trace", "plan"):
        assert command in proc.stdout
    assert run_cli("plan", "--help").stdout.count("--bytes") >= 1


# -- Ctrl-C while the command starts: the package is imported inside the entry point's try ------------------------
ROOT = os.path.dirname(SRC)
# A module of this name, put ahead of the real one on the path, sends the process a real SIGINT
# while it is being imported: a Ctrl-C at that point of the command's start, every run. numpy is
# imported by the ringflow package's __init__; argparse by ringflow._cli alone, after it.
_CTRL_C_ON_IMPORT = """import os, signal
os.kill(os.getpid(), signal.SIGINT)  # Python's handler raises KeyboardInterrupt at the next instruction
for _ in range(10 ** 7):
    pass
raise AssertionError("SIGINT did not interrupt the import")
"""


def _script_target() -> tuple:
    """pyproject.toml's ``ringflow`` script: its target (module, function) and the setuptools table."""
    tomllib = pytest.importorskip("tomllib")  # (Python 3.11+)
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        meta = tomllib.load(fh)
    module, _, function = meta["project"]["scripts"]["ringflow"].partition(":")
    return module, function, meta["tool"]["setuptools"]


def _interrupted_start(tmp_path, module: str, how: str) -> subprocess.CompletedProcess:
    """Start ``ringflow plan`` (``how``: "script", the console script pip writes for pyproject's
    target, or "-m", ``python -m ringflow``) with a Ctrl-C arriving while ``module`` is imported."""
    fake = tmp_path / "fake"
    (fake / module).mkdir(parents=True)
    (fake / module / "__init__.py").write_text(_CTRL_C_ON_IMPORT)
    env = {k: v for k, v in os.environ.items() if k not in ("RINGFLOW_DEVICE", "RINGFLOW_DEBUG")}
    env["PYTHONPATH"] = os.pathsep.join([str(fake), SRC])
    if how == "script":
        target, function, _ = _script_target()
        script = tmp_path / "ringflow"
        script.write_text(f"import sys\nfrom {target} import {function}\nif __name__ == '__main__':\n"
                          f"    sys.argv[0] = sys.argv[0].removesuffix('.exe')\n    sys.exit({function}())\n")
        argv = [sys.executable, str(script), "plan"]
    else:  # interpreter options before -m are passed over when the module's name is looked for
        argv = [sys.executable, "-B", "-W", "default", "-m", "ringflow", "plan"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)


@pytest.mark.parametrize("how", ["script", "-m"])
@pytest.mark.parametrize("module", ["numpy", "argparse"])
def test_ctrl_c_while_the_command_imports_is_one_line_and_status_130(tmp_path, module, how):
    """The console script imported ringflow._cli (and so the whole package, numpy with it) before
    main's try, and ``python -m ringflow`` imported the package before ringflow.__main__ ran:
    a Ctrl-C then was a traceback. Now it ends the command as a Ctrl-C once it runs does."""
    proc = _interrupted_start(tmp_path, module, how)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 130 and proc.stderr == "ringflow plan: interrupted\n", (proc.returncode, proc.stderr)
    assert proc.stdout == ""


# The same Ctrl-C, raised inside code that exec() runs from a string, as dataclasses and
# namedtuple do while a module is imported: CPython then marks the interrupt unhandled for the
# whole process, and ``python -m`` ends by killing itself with SIGINT, whatever status it exits with.
_CTRL_C_IN_EXEC_ON_IMPORT = """import os, signal
exec("os.kill(os.getpid(), signal.SIGINT)\\nfor _ in range(10 ** 7):\\n    pass\\n")
raise AssertionError("SIGINT did not interrupt the import")
"""


# numpy: the package's import (its __init__ exits); argparse: the entry point's import of the
# command line; decimal: while the command line is parsed (--bytes is read), inside _cli.main
@pytest.mark.parametrize("module", ["numpy", "argparse", "decimal"])
def test_ctrl_c_inside_execd_code_is_still_status_130_under_python_m(tmp_path, module):
    """A Ctrl-C that landed in code run by exec() from a string left CPython's "unhandled
    KeyboardInterrupt" mark set: ``python -m ringflow`` said it was interrupted and then died of
    SIGINT (status -2 to a Python caller) instead of exiting 130."""
    fake = tmp_path / "fake"
    (fake / module).mkdir(parents=True)
    (fake / module / "__init__.py").write_text(_CTRL_C_IN_EXEC_ON_IMPORT)
    env = {k: v for k, v in os.environ.items() if k not in ("RINGFLOW_DEVICE", "RINGFLOW_DEBUG")}
    env["PYTHONPATH"] = os.pathsep.join([str(fake), SRC])
    proc = subprocess.run([sys.executable, "-m", "ringflow", "plan"], capture_output=True, text=True, timeout=120,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 130 and proc.stderr == "ringflow plan: interrupted\n", (proc.returncode, proc.stderr)
    assert proc.stdout == ""


@pytest.mark.parametrize("options, module", [
    (["-m", "ringflow", "plan"], "ringflow"),
    (["-mringflow", "plan"], "ringflow"),
    (["-Bm", "ringflow"], "ringflow"),
    (["-Bmringflow"], "ringflow"),
    (["-OOm", "ringflow"], "ringflow"),
    (["-sW", "ignore", "-m", "ringflow"], "ringflow"),
    (["-sWignore", "-m", "ringflow"], "ringflow"),
    (["-W", "ignore", "-X", "dev", "-m", "ringflow"], "ringflow"),
    (["-BXdev", "-Im", "ringflow"], "ringflow"),
    (["--check-hash-based-pycs", "never", "-m", "ringflow"], "ringflow"),
    (["-Wm", "-m", "other"], "other"),  # "m" there is -W's value, not the option
    (["-Xm", "-m", "other"], "other"),
    (["-Bc", "-m"], None),  # a command runs, whose text is "-m"
    (["-c", "import ringflow", "-m", "ringflow"], None),
    (["script.py", "-m", "ringflow"], None),
    (["-", "-m", "ringflow"], None),
    (["--", "-m"], None),
    (["-B"], None),
    (["-Bm"], None),
])
def test_the_module_python_m_runs_is_read_past_the_interpreters_options(monkeypatch, options, module):
    """``python -m`` is recognised in clusters of the interpreter's single-letter options, as
    CPython reads them: within ``-Bm``, ``-OOm`` or ``-sW``, the letters c, m, W and X take a
    value, the rest of the cluster or else the next argument; ``-c`` runs a command, not a module."""
    import _ringflow_entry

    monkeypatch.setattr(sys, "argv", ["-m"])
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, *options], raising=False)
    assert _ringflow_entry._run_module() == module


def test_ctrl_c_while_a_program_imports_ringflow_is_its_keyboard_interrupt(tmp_path):
    """Only the command exits quietly: a program importing ringflow gets the KeyboardInterrupt."""
    fake = tmp_path / "fake" / "numpy"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(_CTRL_C_ON_IMPORT)
    code = "import sys\ntry:\n    import ringflow\nexcept KeyboardInterrupt:\n    sys.exit(7)\n"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake.parent), SRC]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 7, (proc.returncode, proc.stderr)


def test_the_script_target_in_pyproject_is_a_callable_that_is_installed():
    """pyproject.toml's ``ringflow`` script names a function that exists, in a module setuptools
    installs (a top-level module must be listed in py-modules; packages are found under src)."""
    import importlib

    module, function, setuptools_table = _script_target()
    assert callable(getattr(importlib.import_module(module), function))
    if "." in module:
        assert os.path.isfile(os.path.join(SRC, *module.split(".")[:-1], "__init__.py"))
    else:
        assert module in setuptools_table.get("py-modules", []), setuptools_table
        assert os.path.isfile(os.path.join(SRC, module + ".py"))


def test_the_entry_point_knows_every_command():
    """A Ctrl-C before the command line is parsed names the command from the entry point's own
    list, which must be the parser's."""
    import _ringflow_entry

    from ringflow._cli import build_parser

    parser = build_parser()
    assert set(_ringflow_entry.COMMANDS) == set(parser._ringflow_commands)  # type: ignore[attr-defined]


def test_the_entry_point_runs_the_command_line(monkeypatch, capsys):
    import _ringflow_entry

    monkeypatch.setattr(sys, "argv", ["ringflow", "plan", "--bytes", "64MiB"])
    assert _ringflow_entry.main() == 0
    assert "predicted total" in capsys.readouterr().out


def test_the_entry_point_turns_a_ctrl_c_while_parsing_into_one_line(monkeypatch, capsys):
    """_cli.main catches a Ctrl-C inside a command; one while it builds the parser or reads the
    command line reaches the entry point, which says it the same way."""
    import _ringflow_entry

    import ringflow._cli as cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    monkeypatch.setattr(sys, "argv", ["ringflow", "bench", "--quick"])
    assert _ringflow_entry.main() == 130
    assert capsys.readouterr().err == "ringflow bench: interrupted\n"
    monkeypatch.setattr(sys, "argv", ["ringflow", "--quick"])
    assert _ringflow_entry.main() == 130
    assert capsys.readouterr().err == "ringflow: interrupted\n"


def test_device_defaults_to_ringflow_device(monkeypatch, capsys):
    monkeypatch.setenv("RINGFLOW_DEVICE", "cuda:abc")  # read because --device is left out
    assert main(["doctor", "--json"]) == 1
    err = capsys.readouterr().err
    assert "RINGFLOW_DEVICE" in err and len(err.strip().splitlines()) == 1
    monkeypatch.setenv("RINGFLOW_DEVICE", "sim")
    assert main(["doctor", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["device"]["backend"] == "sim"


def test_spaces_around_a_device_are_dropped_from_the_option_as_from_the_environment(monkeypatch, capsys):
    """``--device " sim"`` was refused while ``RINGFLOW_DEVICE=" sim"`` ran on the simulated GPU."""
    monkeypatch.delenv("RINGFLOW_DEVICE", raising=False)
    assert main(["doctor", "--json", "--device", " sim "]) == 0
    assert json.loads(capsys.readouterr().out)["device_spec"] == "sim"
    monkeypatch.setenv("RINGFLOW_DEVICE", " sim")
    assert main(["doctor", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["device_spec"] == "sim"


def test_plan_accepts_the_size_forms(capsys):
    from ringflow._planning_cli import parse_bytes

    assert parse_bytes("1GiB") == 1 << 30 and parse_bytes("512 MiB") == 512 << 20 and parse_bytes("1073741824") == 1 << 30
    assert parse_bytes("1.5KiB") == 1536 and parse_bytes("2mb") == 2 * 10**6 and parse_bytes("1e6") == 10**6
    assert main(["plan", "--bytes", "64MiB", "--workers", "1", "--compute-ms-per-gib", "0.5"]) == 0


@pytest.mark.parametrize("option, value", [("--workers", "1_0"), ("--devices", "\u0663"), ("--workers", "\uff11\uff12"),
                                           ("--compute-ms-per-gib", "1_0"), ("--compute-ms-per-gib", "\u0663.5"),
                                           ("--bytes", "\u0663GiB")])
def test_a_number_that_is_not_ascii_digits_is_a_usage_error(capsys, option, value):
    """int(), float() and decimal.Decimal read digits grouped by '_' and any script's digits;
    a number on the command line is ASCII digits only, anything else a usage error (exit 2)."""
    assert main(["plan", option, value]) == 2
    check_one_line(2, capsys.readouterr().err, "plan", f"argument {option}: {value!r} is not a ")


@settings(max_examples=300, deadline=None, database=None)
@example(text="1_0")
@example(text="\u0663")
@example(text=" 8 ")
@given(text=st.text(max_size=6) | st.from_regex(r"\s*[-+]?\d{1,5}\s*", fullmatch=True))
def test_a_count_option_takes_ascii_digits_in_its_range_only(text):
    """Any text: the number it writes in ASCII digits (the spaces around them dropped) where
    that is 1 to 1024 workers, else an ArgumentTypeError that says what to type."""
    import argparse

    from ringflow._cli import workers

    plain = text.strip()
    want = int(plain) if plain.isascii() and plain.isdigit() and 1 <= int(plain) <= 1024 else None
    try:
        got = workers(text)
    except argparse.ArgumentTypeError as exc:
        assert want is None, (text, str(exc))
        assert "(use e.g. 1, 8 or 16)" in str(exc) or "give 1 to 1024" in str(exc), (text, str(exc))
    else:
        assert got == want and type(got) is int, text


def test_a_file_named_like_a_negative_number_is_read_after_a_flag_or_double_dash(tmp_path, monkeypatch, capsys):
    """A negative value after an option was joined to it (``--bytes=-1KiB``) whatever the option:
    ``ringflow trace -- -5`` became ``--=-5`` ("ambiguous option ... could match --help,
    --version") and ``ringflow trace --json -5`` became ``--json=-5`` ("ignored explicit
    argument"), where both name the file ``-5``."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RINGFLOW_DEBUG", raising=False)
    (tmp_path / "-5").write_text('[{"ph": "X", "ts": 0, "dur": 5, "name": "h2d", "tid": 1, "pid": 1}]')
    assert main(["trace", "--", "-5"]) == 0
    assert "-5: 0 chunks" in capsys.readouterr().out
    assert main(["trace", "--json", "-5"]) == 0
    assert json.loads(capsys.readouterr().out)["spans"] == 1
    # a flag takes no value: the word is what follows it, a workload here
    assert main(["bench", "--quick", "-5"]) == 2
    assert "unknown workload(s) '-5'" in capsys.readouterr().err
    # an option that takes a value still gets the negative one, also when abbreviated
    assert main(["plan", "--byt", "-1KiB"]) == 2
    assert "argument --bytes: '-1KiB'" in capsys.readouterr().err
    assert main(["plan", "--pinned", "--chunk", "-1KiB"]) == 2
    assert "argument --chunk: '-1KiB'" in capsys.readouterr().err


def test_demo_names_the_install_command_with_its_extra(tmp_path, capsys, monkeypatch):
    """The fallback reason holds "ringflow[cuda]": printed as text, not eaten as rich markup."""
    from ringflow import _demo

    missing = lambda: (False, "cuda.core is missing: pip install 'ringflow[cuda]'")  # noqa: E731
    monkeypatch.setattr("ringflow.cuda_available", missing)
    monkeypatch.setattr("ringflow._device.cuda_available", missing)
    _demo.demo("auto", out_dir=str(tmp_path))
    assert "ringflow[cuda]" in capsys.readouterr().out


@pytest.mark.parametrize("device, env", [("sim", None), (None, "sim")])
def test_the_demo_asked_for_the_simulated_gpu_gives_no_reason_to_install_cuda(tmp_path, capsys, monkeypatch,
                                                                                 device, env):
    """--device sim (or RINGFLOW_DEVICE=sim) on a machine without a GPU: the demo said 'No usable
    GPU (...) pip install ...' as if it had fallen back, where the simulated GPU was asked for."""
    from ringflow import _demo

    monkeypatch.setattr("ringflow.cuda_available", lambda: (False, "cuda.core is missing: pip install 'ringflow[cuda]'"))
    if env is None:
        monkeypatch.delenv("RINGFLOW_DEVICE", raising=False)
    else:
        monkeypatch.setenv("RINGFLOW_DEVICE", env)
    assert _demo.demo(device, out_dir=str(tmp_path)) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "As asked, running on the simulated H200" in out and "No usable GPU" not in out


def test_plan_over_several_gpus(capsys):
    assert main(["plan", "--bytes", "1GiB", "--devices", "2"]) == 0
    out = capsys.readouterr().out
    assert "on 2 GPUs of this host" in out and "the host's shared copies" in out
    assert "each GPU's share alone (512 MiB)" in out
    # more GPUs than the job has bytes: a shard holds a row, so only as many GPUs as bytes get one
    assert main(["plan", "--bytes", "10", "--devices", "64"]) == 0
    out = capsys.readouterr().out
    assert "on 10 of 64 GPUs of this host" in out and "on 64 GPUs" not in out, out
    assert main(["plan", "--bytes", "1GiB", "--devices", "0"]) == 2
    assert "devices" in capsys.readouterr().err


def test_plan_over_several_gpus_splits_whole_rows(capsys):
    """--row-bytes: the rows are split, so 3 rows of 1 MiB give 3 of 4 GPUs a row each (a split of
    bytes gave all 4 a share of 768 KiB), as stream_map over 4 simulated GPUs runs such a job."""
    from ringflow import _plan as plan

    assert main(["plan", "--bytes", "3MiB", "--row-bytes", "1MiB", "--chunk", "1MiB", "--devices", "4"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "on 3 of 4 GPUs of this host (a shard" in out and "needs a row)" in out, out
    assert "each GPU's share alone (1 MiB)" in out and "in 1 chunks of 1 MiB" in out, out
    assert "3 rows of 1 MiB" in out, out
    many = plan.predict_devices("h200-pcie5", 3 * MiB, MiB, 4, workers=8, row_bytes=MiB)
    assert f"{many.per_device_s * 1e3:.3f} ms in 1 chunks" in out, out

    def f(x, y):
        y[:] = x

    f.sim_seconds = 0.0
    x = np.ones((3, MiB // 4), np.float32)
    y, report = rf.stream_map_report(f, x, device=[rf.device("sim", checked=False) for _ in range(4)],
                                     chunk_bytes=MiB, host="stage", keep_warm=False)
    assert np.array_equal(y, x) and len(report.reports) == many.devices == 3
    # a row of a byte (the default) is the plan as before
    assert main(["plan", "--bytes", "3MiB", "--chunk", "1MiB", "--devices", "4"]) == 0
    plain = capsys.readouterr().out
    assert main(["plan", "--bytes", "3MiB", "--row-bytes", "1", "--chunk", "1MiB", "--devices", "4"]) == 0
    assert capsys.readouterr().out == plain and "on 4 GPUs of this host" in plain


@pytest.mark.parametrize("argv, phrase", [
    (["--row-bytes", "0"], "argument --row-bytes: '0' is less than 1 byte"),
    (["--row-bytes", "-4"], "argument --row-bytes: '-4' is negative"),
    (["--row-bytes", "2.5"], "argument --row-bytes: '2.5' is not a whole number of bytes"),
    (["--row-bytes", "1.5e0"], "argument --row-bytes: '1.5e0' is not a whole number of bytes"),
    (["--row-bytes", "abc"], "argument --row-bytes: 'abc' is not a size"),
    (["--row-bytes", "\u0663"], "argument --row-bytes: '\u0663' is not a size"),
    (["--bytes", "1000", "--row-bytes", "3"],
     "argument --row-bytes: --bytes 1000 is not a whole number of rows of 3 bytes"),
    (["--bytes", "1KiB", "--row-bytes", "2KiB"],
     "argument --row-bytes: --bytes 1024 is not a whole number of rows of 2048 bytes"),
    (["--bytes", "4MiB", "--row-bytes", "1MiB", "--chunk", "512KiB"],
     "argument --chunk: 524288 bytes is smaller than a row (--row-bytes 1048576)"),
], ids=["zero", "negative", "fraction", "fraction-exponent", "word", "not-ascii", "not-whole-rows", "row-over-total",
        "chunk-below-a-row"])
def test_plan_refuses_a_bad_row_size_naming_the_option(capsys, monkeypatch, argv, phrase):
    """A row size that is no whole, positive number of bytes, or that does not cut --bytes (or
    fit --chunk) in whole rows, is a usage error: one line naming the option, exit status 2."""
    monkeypatch.delenv("RINGFLOW_DEBUG", raising=False)
    assert main(["plan", *argv]) == 2
    check_one_line(2, capsys.readouterr().err, "plan", phrase)


def test_plan_takes_a_row_size_with_a_unit_and_plans_whole_rows(capsys):
    """--row-bytes takes a size as --bytes does (1.5KiB is 1536 bytes, a whole number); the
    chosen chunk is a whole number of rows, as stream_map plans one."""
    import re

    from ringflow import _plan as plan

    assert main(["plan", "--bytes", "96MiB", "--row-bytes", "1.5KiB", "--workers", "4"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    chosen = plan.choose_chunk_bytes("h200-pcie5", 96 * MiB, workers=4, align=1536).chunk_bytes
    assert chosen % 1536 == 0 and re.search(rf"in chunks of {chosen / MiB:g} MiB x {-(-96 * MiB // chosen)}", out), out


def _plan_out(capsys, argv) -> str:
    assert main(["plan", *argv]) == 0, capsys.readouterr().err
    return " ".join(capsys.readouterr().out.split())


def test_plan_with_a_result_size_predicts_its_copy_back_and_slots(capsys):
    """--out-row-bytes: a result four times its input. The copy back, the consume and the slots are
    planned for the result's bytes (predict_seconds and planned_slots with them), and a given
    --chunk is cut into rows of the wider side, as stream_map cuts it: the plan assumed a result
    as large as the input."""
    from ringflow import _plan as plan
    from ringflow._pipeline.sizing import planned_slots

    argv = ["--bytes", "64MiB", "--row-bytes", "1KiB", "--chunk", "1MiB", "--workers", "4"]
    same, out = _plan_out(capsys, argv), _plan_out(capsys, argv + ["--out-row-bytes", "4KiB"])
    chunk, total = 256 << 10, 64 * MiB  # 1 MiB holds 256 result rows of 4 KiB
    n = total // chunk
    assert f"in chunks of {chunk / MiB:g} MiB x {n}" in out, out
    assert "result │ 256 MiB (4 KiB a row)" in out, out
    t, predicted = plan.predict_seconds("h200-pcie5", total, chunk, workers=4, out_ratio=4.0)
    t1, _ = plan.predict_seconds("h200-pcie5", total, chunk, workers=4)
    assert f"d2h per chunk │ {t.d2h * 1e3:.4f} ms" in out, out
    assert f"d2h per chunk │ {t1.d2h * 1e3:.4f} ms" not in out and t1.d2h < t.d2h, out
    assert f"consume per chunk │ {t.consume * 1e3:.4f} ms" in out, out
    assert f"predicted total │ {predicted * 1e3:.3f} ms" in out, out
    slots = planned_slots("h200-pcie5", chunk, False, 4, plan.kernel_cost(0.0, 0.0, chunk), bulk=True, max_chunks=n,
                          out_bytes=4 * chunk)
    for ring in ("host_in", "device_in", "device_out", "host_out"):
        assert f"slots {ring} │ {getattr(slots, ring)} (lifetime" in out, (ring, out)
    assert out != same


@pytest.mark.parametrize("pinned", [False, True])
def test_plan_with_a_result_size_chooses_the_chunk_the_planner_does(capsys, pinned):
    """--chunk auto with --out-row-bytes picks what choose_chunk_bytes picks for that result
    (out_ratio), and the line for several GPUs predicts with it too."""
    from ringflow import _plan as plan

    flag = ["--pinned"] if pinned else []
    out = _plan_out(capsys, ["--bytes", "256MiB", "--row-bytes", "2KiB", "--out-row-bytes", "8KiB", "--workers", "4",
                             "--devices", "2", *flag])
    total = 256 * MiB
    choice = plan.choose_chunk_bytes("h200-pcie5", total, workers=4, align=2048, out_ratio=4.0, host_stages=not pinned)
    assert choice.chunk_bytes != plan.choose_chunk_bytes("h200-pcie5", total, workers=4, align=2048,
                                                         host_stages=not pinned).chunk_bytes or pinned
    assert f"in chunks of {choice.chunk_bytes / MiB:g} MiB x {choice.chunks}" in out, out
    many = plan.predict_devices("h200-pcie5", total, "auto", 2, workers=4, host_stages=not pinned, row_bytes=2048,
                                out_ratio=4.0)
    assert f"on 2 GPUs of this host │ {many.predicted_s * 1e3:.3f} ms" in out, out



@pytest.mark.parametrize("measured", [None, 1e-3], ids=["the-fit", "measured"])
def test_plan_pinned_on_the_scheduler_predicts_with_its_host_time_per_chunk(tmp_path, capsys, measured):
    """--pinned --engine pipeline: the scheduler runs the pinned job, so its host time per chunk is
    the scheduler's unstaged one (the profile's scheduled_chunk_host_s, else SCHEDULER_S_PER_CHUNK),
    larger than the direct engine's, and the total, the chunk --chunk auto picks, its candidates and
    the line for several GPUs are predicted with it (scheduler=True)."""
    import dataclasses

    from ringflow import _plan as plan

    # the direct engine's figure differs from the scheduler's either way: using it is seen
    profile = dataclasses.replace(plan.get_profile("h200-pcie5"), name="hosts", scheduled_chunk_host_s=measured,
                                  direct_chunk_host_s=None if measured is None else 7e-5)
    path = tmp_path / "hosts.json"
    profile.save(path)
    total, chunk = 256 * MiB, MiB
    argv = ["--bytes", "256MiB", "--workers", "4", "--pinned", "--profile", str(path)]
    direct = _plan_out(capsys, argv + ["--chunk", "1MiB"])
    sched = _plan_out(capsys, argv + ["--chunk", "1MiB", "--engine", "pipeline"])
    host = plan.SCHEDULER_S_PER_CHUNK if measured is None else measured
    direct_host = plan.host_seconds_per_chunk(profile, False)
    assert direct_host < host
    assert f"host time per chunk │ {host * 1e3:.4f} ms" in sched, sched
    assert f"host time per chunk │ {direct_host * 1e3:.4f} ms" in direct, direct
    source = "the planner's fit" if measured is None else "this profile (scheduled_chunk_host_s)"
    assert f"host time per chunk from │ {source}" in sched, sched
    assert "engine │ pipeline (the scheduler)" in sched and "engine │ direct" in direct, (sched, direct)
    _, predicted = plan.predict_seconds(profile, total, chunk, workers=4, host_stages=False, scheduler=True)
    _, on_direct = plan.predict_seconds(profile, total, chunk, workers=4, host_stages=False)
    assert on_direct < predicted
    assert f"predicted total │ {predicted * 1e3:.3f} ms" in sched, sched
    assert f"predicted total │ {on_direct * 1e3:.3f} ms" in direct, direct
    # --chunk auto and --devices: the scheduler's choice, its candidates, its split over two GPUs
    auto = _plan_out(capsys, argv + ["--devices", "2", "--engine", "pipeline"])
    choice = plan.choose_chunk_bytes(profile, total, workers=4, host_stages=False, scheduler=True)
    assert choice.table != plan.choose_chunk_bytes(profile, total, workers=4, host_stages=False).table
    assert f"in chunks of {choice.chunk_bytes / MiB:g} MiB x {choice.chunks}" in auto, auto
    assert "candidates: " + ", ".join(f"{c / MiB:g} MiB: {s * 1e3:.2f} ms" for c, _, s in choice.table) in auto, auto
    many = plan.predict_devices(profile, total, "auto", 2, workers=4, host_stages=False, scheduler=True)
    assert f"on 2 GPUs of this host │ {many.predicted_s * 1e3:.3f} ms" in auto, auto


def test_plan_says_where_the_host_time_per_chunk_of_each_job_comes_from():
    """The source row of ringflow plan names the profile field behind the host's time per chunk,
    or the planner's fit; for a job staging one side (--pinned in or out) the fields that figure
    is derived from, as host_seconds_per_chunk derives it."""
    import dataclasses

    from ringflow import _plan as plan
    from ringflow._planning_cli import host_time_from
    from tests.helpers.one_side import one_side_profile

    base = plan.get_profile("h200-pcie5")
    assert host_time_from(base, True, True) == "the planner's fit"
    measured = dataclasses.replace(one_side_profile(5e-4, 2e-4), direct_chunk_host_s=7e-5)
    assert host_time_from(measured, True, True) == "this profile (staged_chunk_host_s)"
    assert host_time_from(measured, False, True) == "this profile (scheduled_chunk_host_s)"
    assert host_time_from(measured, False, False) == "this profile (direct_chunk_host_s)"
    for sides in ((True, False), (False, True)):
        assert host_time_from(base, sides, True) == "the planner's fit"
        assert host_time_from(measured, sides, True) == \
            "this profile (midpoint of staged_chunk_host_s and scheduled_chunk_host_s: one side staged)"
        assert host_time_from(one_side_profile(5e-4, None), sides, True) == \
            ("this profile (staged_chunk_host_s less the planner's fit of a pool hand-off, at least half of it: "
             "one side staged)")
        assert host_time_from(one_side_profile(None, 2e-4), sides, True) == \
            "this profile (scheduled_chunk_host_s plus the planner's fit of a pool hand-off: one side staged)"
        one_side = dataclasses.replace(measured, one_side_chunk_host_s=4e-4)
        assert host_time_from(one_side, sides, True) == "this profile (one_side_chunk_host_s)"


def test_plan_engine_direct_needs_pinned_data(capsys, monkeypatch):
    """--engine direct without --pinned: the direct engine runs only pinned data, so it is a
    one-line usage error naming --engine (exit status 2); with --pinned it is the default's plan."""
    monkeypatch.delenv("RINGFLOW_DEBUG", raising=False)
    code = main(["plan", "--bytes", "64MiB", "--engine", "direct"])
    check_one_line(code, capsys.readouterr().err, "plan",
                   "argument --engine: the direct engine needs pinned data on both sides; pass --pinned, or "
                   "--engine pipeline or auto")
    assert code == 2
    for side in ("in", "out"):  # one side pinned: the other is staged, which only the scheduler does
        code = main(["plan", "--bytes", "64MiB", "--pinned", side, "--engine", "direct"])
        check_one_line(code, capsys.readouterr().err, "plan", "the direct engine needs pinned data on both sides")
        assert code == 2
    argv = ["--bytes", "64MiB", "--chunk", "1MiB", "--pinned"]
    assert _plan_out(capsys, argv + ["--engine", "direct"]) == _plan_out(capsys, argv)
    assert _plan_out(capsys, argv + ["both"]) == _plan_out(capsys, argv)



@pytest.mark.parametrize("pinned", [None, "in", "out"])
def test_plan_says_what_host_auto_does_for_a_call_and_for_a_mapjob(tmp_path, capsys, pinned):
    """Where a side is ordinary memory, the plan says what host="auto" picks and both predictions:
    for a call (stream_map, the pinning within it) and for a MapJob's call (its arrays pinned
    once). On a host whose staged chunk costs the scheduler 627 µs, 64 MiB in 8 MiB chunks with
    both sides ordinary stages for a call and registers for a job; with both sides pinned there is
    nothing to choose and no such row."""

    from ringflow import _plan as plan

    profile = slow_staged_chunks()
    path = tmp_path / "slow.json"
    profile.save(path)
    argv = ["--bytes", "64MiB", "--chunk", "8MiB", "--workers", "4", "--profile", str(path)]
    out = _plan_out(capsys, argv + ([] if pinned is None else ["--pinned", pinned]))
    sides = (pinned == "in", pinned == "out")
    for what, pins_once in (("a call", False), ("a MapJob's call", True)):
        s = plan.choose_host_strategy(profile, 64 * MiB, 64 * MiB, workers=4, out_is_fresh=True, pinned=sides,
                                      chunk_bytes=8 * MiB, pins_once=pins_once)
        want = f"host='auto', {what} │ {s.choice}: staged {s.stage_s * 1e3:.3f}, registered {s.register_s * 1e3:.3f} ms"
        assert want in out, out
    if pinned is None:
        assert "a call │ stage:" in out and "a MapJob's call │ register:" in out, out
    auto = _plan_out(capsys, argv[:2] + argv[4:])  # --chunk auto: each strategy at its own best chunk
    s = plan.choose_host_strategy(profile, 64 * MiB, 64 * MiB, workers=4, out_is_fresh=True, pins_once=True)
    assert f"a MapJob's call │ {s.choice}: staged {s.stage_s * 1e3:.3f}, registered {s.register_s * 1e3:.3f}" in auto
    assert "host='auto'" not in _plan_out(capsys, argv + ["--pinned"])


def test_plan_says_when_host_auto_stages_for_want_of_a_pinned_budget(tmp_path, capsys, monkeypatch):
    """On a host of 256 MiB, whose quarter is less than the 128 MiB a job of 64 MiB would pin, the
    plan's row for a MapJob's call says it stages although registering is faster, and why."""
    from ringflow._device import host_pool

    path = tmp_path / "slow.json"
    slow_staged_chunks().save(path)
    argv = ["--bytes", "64MiB", "--chunk", "8MiB", "--workers", "4", "--profile", str(path)]
    monkeypatch.setattr(host_pool, "physical_memory", lambda: 256 * MiB)
    out = _plan_out(capsys, argv)
    assert "a MapJob's call │ stage:" in out, out
    flat = " ".join(out.replace("│", " ").split())  # the row's cell wraps over lines
    assert "would pin more than auto's bound on this host, 64 MiB: a pinned_budget raises it" in flat, out

@pytest.mark.parametrize("side", ["in", "out"])
def test_plan_with_one_side_pinned_stages_the_other(tmp_path, capsys, side):
    """--pinned in (or out): that side is the caller's pinned memory, used in place, and only the
    other is staged: the chunk, the total, the staging floor and the host time per chunk are the
    planner's for that pair of sides (host_stages), the pinned side has no host ring of its own,
    and the plan differs from staging both sides and from staging neither."""
    import dataclasses

    from ringflow import _plan as plan

    staged = (side == "out", side == "in")
    profile = dataclasses.replace(plan.get_profile("h200-pcie5"), name="hosts", staged_chunk_host_s=5e-4,
                                  scheduled_chunk_host_s=2e-4)
    path = tmp_path / "hosts.json"
    profile.save(path)
    total = 256 * MiB
    argv = ["--bytes", "256MiB", "--workers", "4", "--profile", str(path)]
    out = _plan_out(capsys, argv + ["--pinned", side])
    choice = plan.choose_chunk_bytes(profile, total, workers=4, host_stages=staged)
    assert f"in chunks of {choice.chunk_bytes / MiB:g} MiB x {choice.chunks}" in out, out
    t, predicted = plan.predict_seconds(profile, total, choice.chunk_bytes, workers=4, host_stages=staged)
    assert f"predicted total │ {predicted * 1e3:.3f} ms" in out, out
    assert f"host time per chunk │ {t.scheduler * 1e3:.4f} ms" in out, out
    assert t.scheduler == pytest.approx(3.5e-4)  # the midpoint: one pool hand-off, not two
    assert "engine │ pipeline (the scheduler)" in out, out
    pinned_ring, staged_ring = ("host_in", "host_out") if side == "in" else ("host_out", "host_in")
    assert f"slots {pinned_ring} │ none: the caller's pinned memory, in place" in out, out
    assert f"slots {staged_ring} │ none" not in out and f"slots {staged_ring} │ " in out, out
    floor = plan.staging_floor_seconds(profile, total * staged[0], total * staged[1])
    assert f"host memory floor │ {floor * 1e3:.3f} ms" in out, out
    both = _plan_out(capsys, argv)
    neither = _plan_out(capsys, argv + ["--pinned"])
    assert out != both and out != neither
    assert "staged │ input and result" in both and "staged │ nothing (both pinned)" in neither


@pytest.mark.parametrize("argv", [["--bytes", "64MiB"], ["--bytes", "64MiB", "--chunk", "1MiB", "--devices", "2"]],
                         ids=["auto-chunk", "given-chunk"])
def test_plan_engine_pipeline_without_pinned_is_the_default(capsys, argv):
    """Staged data always runs on the scheduler: --engine pipeline (or auto) without --pinned
    prints the default's plan."""
    default = _plan_out(capsys, argv)
    assert _plan_out(capsys, argv + ["--engine", "auto"]) == default
    assert "engine │ pipeline (the scheduler)" in default, default
    # the staged plan is the same; only host="auto"'s registered run is the scheduler's too
    pipeline = _plan_out(capsys, argv + ["--engine", "pipeline"])
    staged_part = default.index("host='auto', a call")
    assert pipeline[:staged_part] == default[:staged_part]
    assert pipeline[staged_part:] != default[staged_part:]

def test_plan_checks_the_device_rings_at_the_result_size_of_the_engine(tmp_path, capsys, monkeypatch):
    """The memory check of a given --chunk counts the rings the engine allocates: staged, every
    slot as large as a chunk's result; pinned, device-in slots of the input. --chunk auto plans a
    chunk whose staged rings fit."""
    import dataclasses

    from ringflow import _plan as plan

    monkeypatch.delenv("RINGFLOW_DEBUG", raising=False)
    mem = 16 * MiB
    path = tmp_path / "small.json"
    dataclasses.replace(plan.get_profile("h200-pcie5"), name="small", total_memory=mem).save(path)
    # 1536 rows a chunk: 1.5 MiB in, 6 MiB out; staged 6 slots of 6 MiB, pinned 3 of 1.5 and 3 of 6
    argv = ["plan", "--bytes", "96MiB", "--row-bytes", "1KiB", "--out-row-bytes", "4KiB", "--chunk", "6MiB",
            "--workers", "4", "--profile", str(path)]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "3 device-in and 3 device-out slots" in err and f"total_memory of {mem} bytes" in err, err
    assert main(argv[:-6] + ["--chunk", "auto", "--workers", "4", "--profile", str(path)]) == 0
    assert main(argv + ["--pinned"]) == 1  # (pinned: 22.5 MiB, past the memory too)
    capsys.readouterr()
    assert main(argv[:-6] + ["--chunk", "3MiB", "--workers", "4", "--profile", str(path), "--pinned"]) == 0, \
        capsys.readouterr().err


def test_plan_checks_the_schedulers_device_slots_at_their_256_byte_boundaries(tmp_path, capsys, monkeypatch):
    """A staged 180-byte chunk on a GPU of 1100 bytes: 3 + 3 slots packed would take 1080 bytes,
    but the scheduler starts each slot on a 256-byte boundary (1384 bytes, as stream_map
    allocates them): the plan refuses the chunk; pinned (the direct engine packs its slots) it fits."""
    import dataclasses

    from ringflow import _plan as plan

    monkeypatch.delenv("RINGFLOW_DEBUG", raising=False)
    path = tmp_path / "tiny.json"
    dataclasses.replace(plan.get_profile("h200-pcie5"), name="tiny", total_memory=1100).save(path)
    argv = ["plan", "--bytes", "12000", "--row-bytes", "12", "--chunk", "180", "--workers", "4", "--profile", str(path)]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "need 1384 bytes" in err and "total_memory of 1100 bytes" in err, err
    assert main(argv + ["--pinned"]) == 0, capsys.readouterr().err
    # pinned, but run by the scheduler (engine="pipeline"): its slots on 256-byte boundaries again
    assert main(argv + ["--pinned", "--engine", "pipeline"]) == 1
    err = capsys.readouterr().err
    assert "3 device-in and 3 device-out slots" in err and "need 1384 bytes" in err, err


@pytest.mark.parametrize("argv, phrase", [
    (["--row-bytes", "4", "--out-row-bytes", "0"], "argument --out-row-bytes: '0' is less than 1 byte"),
    (["--row-bytes", "4", "--out-row-bytes", "-4"], "argument --out-row-bytes: '-4' is negative"),
    (["--row-bytes", "4", "--out-row-bytes", "2.5"], "argument --out-row-bytes: '2.5' is not a whole number of bytes"),
    (["--row-bytes", "4", "--out-row-bytes", "abc"], "argument --out-row-bytes: 'abc' is not a size"),
    (["--row-bytes", "4", "--out-row-bytes", "\u0663"], "argument --out-row-bytes: '\u0663' is not a size"),
    (["--bytes", "1MiB", "--out-row-bytes", "4"], "argument --out-row-bytes: give --row-bytes too"),
    (["--bytes", "4MiB", "--row-bytes", "1KiB", "--out-row-bytes", "1MiB", "--chunk", "512KiB"],
     "argument --chunk: 524288 bytes is smaller than a row of the result (--out-row-bytes 1048576)"),
], ids=["zero", "negative", "fraction", "word", "not-ascii", "without-row-bytes", "chunk-below-a-result-row"])
def test_plan_refuses_a_bad_result_row_size_naming_the_option(capsys, monkeypatch, argv, phrase):
    """A result row size that is no whole, positive number of bytes, one given without the input's
    row (--row-bytes), or one larger than --chunk, is a usage error: one line naming the option,
    exit status 2."""
    monkeypatch.delenv("RINGFLOW_DEBUG", raising=False)
    assert main(["plan", *argv]) == 2
    check_one_line(2, capsys.readouterr().err, "plan", phrase)


@pytest.mark.parametrize("size, devices", [("16MiB", 2), ("64MiB", 8)])
def test_plan_over_several_gpus_cuts_each_share_in_the_chunk_its_shard_uses(capsys, size, devices):
    """With --chunk auto each shard of a whole-array job plans its chunk for its own share (sharded.plan_shards):
    the plan predicted each GPU's share with the chunk chosen for the whole job. The share's row names the chunk a
    simulated job over as many GPUs cuts each shard in, and its time is predict_seconds of the share in it."""
    import re

    from ringflow import _plan as plan
    from ringflow._planning_cli import _human, parse_bytes

    total = parse_bytes(size)
    assert main(["plan", "--bytes", size, "--devices", str(devices), "--chunk", "auto"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    row = re.search(r"each GPU's share alone \(([^)]*)\)\s*│?\s*([\d.]+) ms(.*?)│", out)
    assert row, out

    def f(x, y):
        y[:] = x

    f.sim_seconds = 0.0  # the plan's kernel: --compute-ms-per-gib 0
    devs = [rf.device("sim", checked=False) for _ in range(devices)]
    x = np.arange(total, dtype=np.uint8)
    y, report = rf.stream_map_report(f, x, device=devs, chunk_bytes="auto", workers=8, host="stage", keep_warm=False)
    assert np.array_equal(y, x)
    (used,) = {max(r.nbytes for r in shard.timeline.records) for shard in report.reports}
    share = -(-total // devices)
    assert used != plan.choose_chunk_bytes("h200-pcie5", total, workers=8).chunk_bytes  # not the whole job's chunk
    _, per_device = plan.predict_seconds("h200-pcie5", share, used, workers=8)
    assert row.group(1) == _human(share) and row.group(2) == f"{per_device * 1e3:.3f}", out
    assert row.group(3).strip() == f"in {-(-share // used)} chunks of {_human(used)}", out


def test_plan_with_a_chunk_larger_than_the_bytes_plans_one_chunk_of_them(capsys):
    """A whole array is never cut in chunks larger than itself: 1 MiB with --chunk 8MiB is one
    chunk of 1 MiB, predicted as such (it was predicted as moving 8 MiB, five times as long)."""
    assert main(["plan", "--bytes", "1MiB", "--chunk", "8MiB"]) == 0
    larger = capsys.readouterr().out
    assert main(["plan", "--bytes", "1MiB", "--chunk", "1MiB"]) == 0
    assert larger == capsys.readouterr().out
    assert "in chunks of 1 MiB x 1" in larger


def test_square_brackets_in_names_are_shown_as_written(tmp_path, capsys):
    """File names, span names and bench workload names are the user's text: rich read ``[/b]``
    in them as markup and failed (an internal error), or hid ``[bold]``."""
    folder = tmp_path / "a[/b]"  # (a folder "a[" holding "b]")
    folder.mkdir(parents=True)
    trace = folder / "[bold]t.json"
    trace.write_text('[{"ph": "X", "ts": 0, "dur": 5, "name": "h2d [/]", "tid": 1}]')
    assert main(["trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "[bold]t.json" in "".join(out.split()) and "h2d [/]" in out, out  # (the title may wrap)
    bench = tmp_path / "cmp.json"
    bench.write_text('{"workloads": {"[/]": {"rows": [{"name": "[/b]", "chunk_bytes": 1048576, '
                     '"predicted_ms": 1, "ms_median": 1}]}}}')
    assert main(["plan", "--bytes", "64MiB", "--compare", str(bench)]) == 0
    assert "[/] [/b]: predicted" in capsys.readouterr().out


def test_a_pgf_chart_without_latex_is_refused_before_the_run(tmp_path, monkeypatch, capsys):
    """matplotlib writes .pgf through LaTeX, found missing only once the chart was drawn, after
    the whole bench (whose results were then lost)."""
    pytest.importorskip("matplotlib")
    import shutil

    import ringflow._bench.runner as runner

    if shutil.which("xelatex"):
        pytest.skip("LaTeX is installed here")

    def must_not_run(*a, **k):
        raise AssertionError("the bench ran although its chart cannot be written")

    monkeypatch.setattr(runner, "run_bench", must_not_run)
    assert main(["bench", "--device", "sim", "--quick", "seed", "--plot", str(tmp_path / "x.pgf")]) == 2
    err = capsys.readouterr().err
    assert "argument --plot: .pgf files need xelatex" in err, err


@pytest.mark.parametrize("command", ["trace", "trace read whole", "plan"])
def test_a_file_too_large_for_memory_is_named_not_called_a_bug(command, tmp_path, monkeypatch, capsys):
    """A trace or bench JSON too large to read raised a MemoryError, reported as an internal
    error; the message now names the file, its size and what to do. A trace is read as a stream
    (its spans kept), or whole where the stream cannot take it (a key given twice)."""
    import ringflow._jsontext as jsontext
    from ringflow._trace import summary

    path = tmp_path / "huge.json"
    path.write_text({"plan": '{"workloads": {}}', "trace read whole": '{"traceEvents": [], "traceEvents": []}',
                     "trace": '[{"ph": "X", "ts": 0, "dur": 1, "cat": "h2d"}]'}[command])

    def out_of_memory(*args):
        raise MemoryError

    monkeypatch.setattr(jsontext, "loads", out_of_memory)
    monkeypatch.setattr(summary._Collect, "add", out_of_memory)
    argv = ["plan", "--bytes", "64MiB", "--compare", str(path)] if command == "plan" else ["trace", str(path)]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "internal error" not in err, err
    assert "huge.json" in err and "too large" in err and "bytes" in err, err


@pytest.mark.parametrize("command", ["trace", "trace read whole", "plan"])
def test_a_file_saved_with_a_byte_order_mark_is_read_as_without_it(command, tmp_path, capsys):
    """An editor that saves UTF-8 with a byte order mark first (Notepad, PowerShell) left a trace
    or bench JSON refused as "not JSON (Unexpected UTF-8 BOM (decode using utf-8-sig) ...)",
    advice for a programmer; a hardware profile is read with one, and so are these."""
    text = {"plan": '{"workloads": {"seed": {"rows": [{"name": "ringflow", "chunk_bytes": 1048576, '
                    '"predicted_ms": 1, "ms_median": 2}]}}}',
            "trace read whole": '{"traceEvents": [], "traceEvents": [{"ph": "X", "ts": 0, "dur": 5, "cat": "h2d"}]}',
            "trace": '[{"ph": "X", "ts": 0, "dur": 5, "cat": "h2d"}, {"ph": "X", "ts": 2, "dur": 5, "cat": "compute"}]'}
    outputs = []
    for name, bom in (("plain.json", b""), ("bommed.json", b"\xef\xbb\xbf")):
        path = tmp_path / name
        path.write_bytes(bom + text[command].encode("utf-8"))
        argv = (["plan", "--bytes", "64MiB", "--compare", str(path)] if command == "plan"
                else ["trace", "--json", str(path)])
        assert main(argv) == 0, capsys.readouterr().err
        out, err = capsys.readouterr()
        assert err == ""
        outputs.append(out.replace(str(path), "FILE"))
    assert outputs[0] == outputs[1]
    assert ("predicted 1.000 ms, measured 2.000 ms" if command == "plan" else '"h2d"') in outputs[1], outputs[1]


def test_running_out_of_memory_is_an_error_not_a_bug(monkeypatch, capsys):
    import ringflow._bench.runner as runner

    def out_of_memory(*a, **k):
        raise MemoryError

    monkeypatch.setattr(runner, "run_bench", out_of_memory)
    assert main(["bench", "--device", "sim", "--quick", "seed"]) == 1
    err = capsys.readouterr().err
    assert "internal error" not in err and "out of memory" in err, err


def test_plan_lists_each_candidate_chunk_once(capsys):
    """--bytes 1MiB cuts every larger candidate down to 1 MiB: the list shows it once."""
    assert main(["plan", "--bytes", "1MiB"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.count("1 MiB:") == 1, out


def test_sizes_are_read_exactly_and_refused_above_the_maximum(capsys):
    """A size is read exactly, never through a float: one byte above 8 PiB is refused (it was
    rounded down to 8 PiB and accepted), and a fraction of a byte is dropped, not rounded up."""
    from ringflow._planning_cli import MAX_BYTES, parse_bytes

    assert parse_bytes(str(MAX_BYTES)) == MAX_BYTES == parse_bytes("8PiB")
    for text in (str(MAX_BYTES + 1), "8.0000000000000000001PiB", "9007199254740992.5", "1e9999999"):
        with pytest.raises(ValueError, match="too large"):
            parse_bytes(text)
    assert parse_bytes("2251799813685248.9") == 2251799813685248  # a float reads ...249
    assert parse_bytes("0.1e1KiB") == 1024 and parse_bytes(".5KiB") == 512
    with pytest.raises(ValueError, match="less than 1 byte"):
        parse_bytes("1e-9999999GiB")
    assert main(["plan", "--bytes", str(MAX_BYTES + 1)]) == 2
    err = capsys.readouterr().err
    assert "--bytes" in err and "too large" in err and "8 PiB" in err


def test_a_size_whose_exponent_decimal_cannot_hold_is_a_usage_error(capsys):
    """decimal.Decimal takes exponents up to 10**18 and raises InvalidOperation (no ValueError)
    past them: parse_bytes let it out, and the command line called it a bug in ringflow."""
    from ringflow._planning_cli import parse_bytes

    for text, says in (("1e1000000000000000000", "too large"), ("7.5e+0001000000000000000000", "too large"),
                       ("1e-1000000000000000000", "less than 1 byte"), ("0e1000000000000000000", "less than 1 byte")):
        with pytest.raises(ValueError, match=says):
            parse_bytes(text)
    assert main(["plan", "--bytes", "1e1000000000000000000"]) == 2
    assert "internal error" not in capsys.readouterr().err


def _size_and_value(draw_digits, exponent, unit):
    """A size's text and what it is worth: its bytes, "large" above 8 PiB, "small" below 1 byte."""
    from fractions import Fraction

    from ringflow._planning_cli import _UNITS, MAX_BYTES

    text = draw_digits + ("" if exponent is None else f"e{exponent:+d}") + unit
    digits = Fraction(draw_digits if not draw_digits.endswith(".") else draw_digits[:-1] or "0")
    power = exponent or 0
    if digits == 0 or power < -60:
        return text, "small"
    if power > 60:
        return text, "large"
    value = digits * Fraction(10) ** power * _UNITS[unit.strip().lower()]
    return text, "large" if value > MAX_BYTES else "small" if value < 1 else int(value)


@settings(max_examples=300, deadline=None, database=None)
@example(digits="1", exponent=10 ** 19, unit="")  # (exponents past what decimal.Decimal holds)
@example(digits="0.0", exponent=10 ** 19, unit="KiB")
@example(digits="2.5", exponent=-10 ** 19, unit="PiB")
@given(digits=st.from_regex(r"[0-9]{1,25}(\.[0-9]{0,25})?|\.[0-9]{1,25}", fullmatch=True),
       exponent=st.none() | st.integers(-60, 60) | st.integers(-10 ** 22, 10 ** 22),
       unit=st.sampled_from(["", "B", " KiB", "k", "MiB", "mb", "G", "gib ", "TB", "tib", "P", "PiB", "pb"]))
def test_a_size_is_read_exactly_or_refused_as_a_size(digits, exponent, unit):
    """Any number with any exponent and unit: its bytes rounded down, or a ValueError saying it
    is too large or less than 1 byte, never another error."""
    from ringflow._planning_cli import parse_bytes

    text, value = _size_and_value(digits, exponent, unit)
    try:
        got = parse_bytes(text)
    except ValueError as exc:
        said = "large" if "too large" in str(exc) else "small" if "less than 1 byte" in str(exc) else str(exc)
        assert said == value, (text, str(exc))
    else:
        assert got == value, text


def test_bench_out_writes_json_without_nan_and_plan_compare_reads_it(tmp_path, monkeypatch, capsys):
    """A figure that does not exist (NaN, or a ratio over zero) is written as null: NaN and
    Infinity are not JSON, and strict readers refuse the file. plan --compare reads it back."""
    import numpy as np

    import ringflow._bench.runner as runner

    def workload(dev, name, **kw):
        return {"workload": name, "efficiency": float("nan"), "ratio": float("inf"),
                "rows": [{"name": "ringflow", "chunk_bytes": 8 << 20, "predicted_ms": 2.0, "ms_median": 2.5,
                          "efficiency": np.float32("nan"), "ms_p10": 2.0, "ms_p90": 3.0}]}

    monkeypatch.setattr(runner, "run_workload", workload)
    result = runner.run_bench("sim", ["seed"], out_dir=str(tmp_path))
    text = open(result["path"], encoding="utf-8").read()
    assert "NaN" not in text and "Infinity" not in text, text
    seed = json.loads(text)["workloads"]["seed"]
    assert seed["efficiency"] is None and seed["ratio"] is None and seed["rows"][0]["efficiency"] is None
    capsys.readouterr()
    assert main(["plan", "--bytes", "64MiB", "--compare", result["path"]]) == 0
    assert "error -20.0%" in capsys.readouterr().out


def test_lone_surrogates_in_names_are_shown_escaped(tmp_path, capsys):
    """A JSON file may hold a lone surrogate ("\\ud800") in a span or workload name, and a file
    name undecodable bytes (read as surrogates): no terminal can print them, and the table
    failed with 'surrogates not allowed'. They are shown as escapes."""
    folder = tmp_path / "\udcff"  # the byte 0xff, as Python reads it from a file name
    folder.mkdir()
    trace = folder / "t.json"
    trace.write_text('[{"ph": "X", "ts": 0, "dur": 5, "name": "h2d \\ud800 [b]", "tid": 1}]')
    assert main(["trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "h2d \\ud800 [b]" in out and "\\udcff" in "".join(out.split()), out
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"workloads": {"w\ud800": {"rows": [
        {"name": "r\udfff", "chunk_bytes": 8 << 20, "predicted_ms": 2.0, "ms_median": 2.5}]}}}))
    assert main(["plan", "--bytes", "64MiB", "--compare", str(bench)]) == 0
    assert "w\\ud800 r\\udfff: predicted 2.000 ms" in capsys.readouterr().out


def test_control_characters_in_names_are_shown_escaped(tmp_path, capsys):
    """A span, workload or profile name read from a file may hold an escape sequence (which a
    terminal runs: colours, a new window title, a cleared screen) or a line break (a table row
    split in two): they reached stdout as they were. They are shown as escapes."""
    import re

    trace = tmp_path / "t.json"
    trace.write_text('[{"ph": "X", "ts": 0, "dur": 5, "name": "h\\u001b[2J\\n\\u009b1", "tid": 1}]')
    assert main(["trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "h\\x1b[2J\\n\\x9b1" in out, out
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"workloads": {"w\x1b]0;t\x07": {"rows": [
        {"name": "r\r", "chunk_bytes": 8 << 20, "predicted_ms": 2.0, "ms_median": 2.5}]}}}))
    from ringflow._device.hardware import UNIT_TEST

    doc = UNIT_TEST.to_dict()
    doc["name"], doc["machine"]["gpu"] = "unit\x1b[31m", "G\u2028PU"
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(doc))
    assert main(["plan", "--bytes", "64MiB", "--compare", str(bench), "--profile", str(profile)]) == 0
    out = capsys.readouterr().out
    assert "w\\x1b]0;t\\x07 r\\r: predicted 2.000 ms" in out and "measured on G\\u2028PU" in out, out
    assert "unit\\x1b[31m" in "".join(out.split()), out
    assert not re.search(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029]", out), repr(out)


def test_plan_shows_no_ring_with_more_slots_than_chunks(capsys):
    """A whole array's pipeline keeps at most one slot a chunk in each ring; the plan showed the
    rings of an endless stream (5 slots for 2 chunks, 503 for 128)."""
    import re

    for argv, chunks in ((["--bytes", "16MiB", "--chunk", "8MiB"], 2),
                         (["--bytes", "1GiB", "--chunk", "8MiB", "--workers", "1024"], 128)):
        assert main(["plan", *argv]) == 0
        out = capsys.readouterr().out
        shown = [int(m) for m in re.findall(r"slots \w+\s+│?\s*(\d+) \(lifetime", out)]
        assert len(shown) == 4 and max(shown) <= chunks, (argv, shown, out)


@pytest.mark.parametrize("argv, host", [
    (["--bytes", "64MiB", "--chunk", "1MiB", "--workers", "6"], "stage"),
    (["--bytes", "3MiB", "--chunk", "1MiB", "--workers", "8", "--compute-ms-per-gib", "50"], "stage"),
    (["--bytes", "64MiB", "--chunk", "256KiB", "--workers", "4", "--pinned"], "register"),
    # (flags last: the options are read in pairs below)
    (["--bytes", "64MiB", "--chunk", "256KiB", "--workers", "4", "--engine", "pipeline", "--pinned"], "register"),
], ids=["staged", "staged-few-chunks", "pinned-copy-groups", "pinned-on-the-scheduler"])
def test_plan_shows_the_slots_stream_map_allocates(capsys, argv, host):
    """The slot counts the plan prints are the rings stream_map allocates for the same job on the
    simulated GPU of the same profile: the plan printed the counts the lifetimes need, without the
    device rings' slack, a staging slot per worker or the direct engine's rings of whole copy groups."""
    import re

    from tests.helpers.hooks import engines

    assert main(["plan", *argv]) == 0
    out = capsys.readouterr().out
    shown = dict(re.findall(r"slots (\w+)\s+│?\s*(\d+) \(lifetime", out))
    opt = dict(zip(argv[::2], argv[1::2]))
    total, chunk = rf._planning_cli.parse_bytes(opt["--bytes"]), rf._planning_cli.parse_bytes(opt["--chunk"])
    per_byte = float(opt.get("--compute-ms-per-gib", 0)) * 1e-3 / (1 << 30)

    def f(x, y):
        y[:] = x

    f.sim_seconds = lambda nbytes: per_byte * nbytes
    seen = []
    with engines(on=seen.append):
        rf.stream_map(f, np.ones(total // 4, np.float32), device=rf.device("sim", checked=False), chunk_bytes=chunk,
                      workers=int(opt["--workers"]), host=host, keep_warm=False, engine=opt.get("--engine", "auto"))
    if opt.get("--engine") == "pipeline":  # the scheduler on the caller's memory: its device rings alone
        allocated = {ring: len(getattr(seen[0].scheduler, ring).slots) for ring in ("dev_in", "dev_out")}
    elif host == "register":  # the direct engine: each device ring one buffer of its slots (no host rings)
        allocated = {ring: getattr(seen[0], ring).nbytes // chunk for ring in ("dev_in", "dev_out")}
    else:
        allocated = {ring: len(getattr(seen[0].scheduler, ring).slots) for ring in
                     ("host_in", "dev_in", "dev_out", "host_out")}
    allocated = {ring.replace("dev_", "device_"): count for ring, count in allocated.items()}
    assert {ring: int(shown[ring]) for ring in allocated} == allocated, out


def test_pinned_copy_groups_fit_the_devices_memory_in_plan_and_stream_map(tmp_path, capsys):
    """Small pinned chunks are moved in copy groups, and the device rings grow to whole groups
    (sizing.copy_group): 256 KiB chunks, 64 slots each way on a large GPU, 32 MiB. On a GPU of
    16 MiB the groups are smaller, so the grown rings fit as the planned ones do (3 slots each way):
    stream_map of such chunks, given or chosen, allocates them and runs (it raised
    OutOfMemoryError), and the plan prints those rings and checks them against total_memory."""
    import dataclasses

    from ringflow import _plan as plan
    from ringflow._pipeline.sizing import copy_group, planned_slots

    total, chunk, mem = 64 << 20, 256 << 10, 16 << 20
    big = plan.get_profile("h200-pcie5")
    small = dataclasses.replace(big, name="small-memory", total_memory=mem)
    n = total // chunk

    def grouped(profile):
        planned = planned_slots(profile, chunk, False, 4, plan.kernel_cost(0.0, 0.0, chunk), external=(True, True),
                                bulk=True, max_chunks=n)
        return copy_group(profile, chunk, n, planned, planned=True, inplace=False)

    (group_big, rings_big), (group, rings) = grouped(big), grouped(small)
    assert (rings_big.device_in + rings_big.device_out) * chunk > mem  # the large GPU's groups would not fit
    assert 1 < group < group_big and (rings.device_in + rings.device_out) * chunk <= mem

    def f(x, y):
        y[:] = x

    f.sim_seconds = 0.0
    x = np.arange(total, dtype=np.uint64).astype(np.uint8)
    for chunk_bytes in (chunk, "auto"):
        y = rf.stream_map(f, x, device=rf.device("sim", profile=small, checked=False), chunk_bytes=chunk_bytes,
                          workers=4, host="register", keep_warm=False)
        assert np.array_equal(y, x)
    path = tmp_path / "small-memory.json"
    small.save(path)
    argv = ["plan", "--bytes", "64MiB", "--chunk", "256KiB", "--workers", "4", "--pinned", "--profile", str(path)]
    assert main(argv) == 0, capsys.readouterr().err
    out = " ".join(capsys.readouterr().out.split())
    assert f"slots device_in │ {rings.device_in} (lifetime" in out, out
    assert f"slots device_out │ {rings.device_out} (lifetime" in out, out


def test_plan_shows_how_many_workers_copy_at_once(capsys):
    """Past the workers the pipeline keeps busy, more change neither the plan nor its time; the
    table says how many copy at once."""
    import re

    shown = {}
    for workers in ("16", "1024"):
        assert main(["plan", "--workers", workers, "--chunk", "8MiB"]) == 0
        out = capsys.readouterr().out
        assert re.search(rf"workers copying at once\s+│?\s*16 of {workers}", out), out
        shown[workers] = re.search(r"predicted total\s+│?\s*([\d.]+) ms", out).group(1)
    assert shown["16"] == shown["1024"]


@pytest.mark.parametrize("name, make", [("trace.json", os.mkdir), ("timeline.png", os.mkfifo)],
                         ids=["a folder", "a fifo"])
def test_a_demo_folder_whose_name_reads_like_advice_is_named_whole(tmp_path, monkeypatch, capsys, name, make):
    """The demo's message was cut out of check_out_file's at its first '; give ': a folder whose
    name holds those words lost the rest of its name, and what was wrong with it."""
    import ringflow._demo as demo

    monkeypatch.setattr(demo, "demo", lambda *a, **k: pytest.fail("the demo ran"))
    out = tmp_path / "run; give up"
    out.mkdir()
    make(str(out / name))
    assert main(["demo", "--device", "sim", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    what = "is a folder" if make is os.mkdir else "is not a regular file"
    assert err == (f"ringflow demo: error: argument --out: the demo writes {name} into {str(out)!r}, but "
                   f"{str(out / name)!r} {what}; give another folder\n"), err


def test_runs_checking_the_same_output_file_at_once_do_not_refuse_each_other(tmp_path):
    """Two demos started at once into one folder (or two benches given one --trace) check the
    same new file name; the check makes the very name and removes it. A run checking while the
    other's probe was there was refused: 'File exists', 'is not a regular file' (gone between two
    looks) or 'Permission denied' (gone before its permissions were read)."""
    from ringflow._cli import out_file_problem

    path = str(tmp_path / "trace.json")
    problems = []

    def check():
        for _ in range(3000):
            problem = out_file_problem(path)
            if problem is not None:
                problems.append(problem[0])

    racing(check, 2)
    assert problems == [], sorted(set(problems))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("make, says", [
    (lambda d: "", "argument --trace: an empty string is not a file name; give a file name"),
    (lambda d: d, "argument --trace: {d!r} is a folder; give a file name inside it"),
    (lambda d: os.path.join(d, "missing", "t.json"),
     "argument --trace: cannot write {p!r}: {m!r} does not exist; create it first"),
    (lambda d: os.path.join(d, "new") + "/", "argument --trace: {p!r} ends with a slash; give a file name, not a folder"),
], ids=["empty", "folder", "no folder", "slash"])
def test_check_out_file_names_the_option_what_is_wrong_and_what_to_change(tmp_path, make, says):
    from ringflow._cli import UsageError, check_out_file

    d = str(tmp_path)
    path = make(d)
    with pytest.raises(UsageError) as info:
        check_out_file(path, "--trace")
    assert str(info.value) == says.format(d=d, p=path, m=os.path.join(d, "missing"))


def test_the_librarys_logged_warnings_are_one_stderr_line_each(monkeypatch, capsys):
    """A warning the library logs while a command runs (a fallback it took, a setting it could
    not use; from any thread) reaches the user as ``ringflow <cmd>: warning: ...``: the library's
    logger has only a NullHandler, so before, the command line showed nothing. Debug and info
    records stay quiet, and the handler goes with the command."""
    import logging
    import threading

    import ringflow._cli as cli

    def logs(args):
        log = logging.getLogger("ringflow.somewhere")
        log.info("not shown")
        log.warning("RINGFLOW_X=%r is not a number;\nusing %g", "nan", 200)
        t = threading.Thread(target=log.warning, args=("from a thread",))
        t.start()
        t.join()
        return 0

    monkeypatch.setattr(cli, "_plan", logs)
    before = list(logging.getLogger("ringflow").handlers)
    assert main(["plan"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == ["ringflow plan: warning: RINGFLOW_X='nan' is not a number; using 200",
                   "ringflow plan: warning: from a thread"], err
    assert logging.getLogger("ringflow").handlers == before


_OTHER_LIBRARY_WARNS = """import logging, sys
import ringflow._cli as cli

def logs(args):
    logging.getLogger("matplotlib.backends.backend_ps").warning("The PostScript backend does not support "
                                                                "transparency;\\npartially transparent")
    logging.getLogger("other").info("not shown")
    return 0

cli._plan = logs
status = cli.main(["plan"])
logging.getLogger("other").warning("after the command")
sys.exit(status)
"""


def test_another_librarys_logged_warning_is_one_stderr_line_too():
    """A library the command uses that logs a warning with no handler set up (matplotlib, for a
    chart written as .eps) reached stderr through Python's last-resort handler: a bare line,
    without the command's name, split where the message holds a line break. While the command
    runs it is one ``ringflow <cmd>: warning: ...`` line; after, Python's handler is back."""
    env = {k: v for k, v in os.environ.items() if k not in ("RINGFLOW_DEVICE", "RINGFLOW_DEBUG")}
    env["PYTHONPATH"] = SRC
    proc = subprocess.run([sys.executable, "-c", _OTHER_LIBRARY_WARNS], capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        "ringflow plan: warning: The PostScript backend does not support transparency; partially transparent",
        "after the command"], proc.stderr


def test_plan_takes_a_valid_profile_of_slow_host_calls(tmp_path, capsys):
    """Every field of the profile is in range (a copy takes a minute to enqueue): the plan is
    printed, with no ring asked for more slots than a ring may have."""
    import dataclasses

    from ringflow._device.hardware import H200_PCIE5

    path = tmp_path / "slow-enqueue.json"
    dataclasses.replace(H200_PCIE5, name="slow-enqueue", copy_overhead_s=60.0).save(path)
    assert main(["plan", "--bytes", "1MiB", "--profile", str(path)]) == 0, capsys.readouterr().err
    assert "slow-enqueue" in capsys.readouterr().out


def test_the_files_the_demo_and_bench_wrote_are_named_as_written(tmp_path, monkeypatch, capsys):
    """The demo's closing line ('trace: ... timeline: ...') and the bench's 'wrote ...' line
    printed the --out folder's name as rich markup: a folder named 'a[/b]' ended the command, its
    files written, with an internal error (MarkupError), and '[red]' vanished from the name shown;
    the demo's no-PNG reason lost the extra in "pip install 'ringflow[plot]'"."""
    import ringflow._bench.runner as runner
    import ringflow._bench.workloads as workloads
    from ringflow._trace.report import Report

    # (the measured runs are not what is checked: stubbed, so that only the printing runs)
    monkeypatch.setattr(workloads, "pageable", lambda *a, **k: {})
    monkeypatch.setattr(workloads, "inplace_pinned", lambda *a, **k: {})
    monkeypatch.setattr(runner, "run_workload", lambda *a, **k: {"workload": "seed"})
    monkeypatch.setattr(runner, "table", lambda res: "")

    def no_matplotlib(self, path):
        raise RuntimeError("report.plot needs matplotlib: pip install 'ringflow[plot]'")

    monkeypatch.setattr(Report, "plot", no_matplotlib)
    for name in ("a[/b]", "x[red]y"):
        out = tmp_path / name
        assert main(["demo", "--device", "sim", "--out", str(out)]) == 0, capsys.readouterr().err
        shown = "".join(capsys.readouterr().out.split())  # (a long line wraps)
        assert f"trace:{out / 'trace.json'}" in shown, shown
        assert "pipinstall'ringflow[plot]'" in shown, shown
        assert main(["bench", "--device", "sim", "--quick", "seed", "--out", str(out)]) == 0, capsys.readouterr().err
        (result,) = [p for p in os.listdir(out) if p.startswith("bench-sim")]
        assert f"wrote{out / result}" in "".join(capsys.readouterr().out.split())
        os.unlink(out / result)


@pytest.mark.parametrize("where", ["a read-only folder", "a folder of /proc"])
def test_a_writable_file_in_a_folder_that_takes_no_new_file_is_refused_before_any_work(tmp_path, monkeypatch,
                                                                                         capsys, where):
    """A file is written whole, through a new file beside it moved over it: an existing file that
    could be written, in a folder that takes no new file, passed the check and failed only after
    the whole run (for /proc/self/comm with 'No such file or directory', of a file that exists)."""
    import ringflow._doctor as doctor

    monkeypatch.setattr(doctor, "doctor_command", lambda **k: pytest.fail("the doctor ran"))
    if where == "a folder of /proc":
        path = "/proc/self/comm"  # (a regular file its owner may write, in a folder taking none)
        if not (os.path.isfile(path) and os.access(path, os.W_OK)):
            pytest.skip("no writable /proc/self/comm here")
    else:
        folder = tmp_path / "kept"
        folder.mkdir()
        path = str(folder / "report.json")
        open(path, "w").close()
        os.chmod(folder, 0o555)
        try:
            open(folder / "probe", "w").close()
            pytest.skip("this user writes into read-only folders (root)")
        except PermissionError:
            pass
    assert main(["doctor", "--device", "sim", "--output", path]) == 2
    err = capsys.readouterr().err
    assert f"argument --output: cannot write {path!r}: its folder {os.path.dirname(path)!r} takes no new file" in err, err


@pytest.mark.parametrize("command", ["demo", "bench"])
@pytest.mark.parametrize("option, env", [("cuda:1", None), (None, "cuda")], ids=["--device", "RINGFLOW_DEVICE"])
def test_a_gpu_asked_for_and_not_usable_says_which_option_to_change(tmp_path, monkeypatch, capsys, command, option,
                                                                    env):
    """The library's message ends with advice for a Python caller, "Use device('sim') or
    device('auto') instead": on the command line it names the setting the GPU came from and the
    option to give instead."""
    import ringflow._bench.runner as runner
    import ringflow._demo as demo

    monkeypatch.setattr("ringflow._device.cuda_available", lambda: (False, "no driver"))
    monkeypatch.setattr(demo, "demo", lambda **k: rf.device(k["device"]) and 0)
    monkeypatch.setattr(runner, "run_bench", lambda device, *a, **k: rf.device(device) and {"workloads": {}})
    if env is None:
        monkeypatch.delenv("RINGFLOW_DEVICE", raising=False)
    else:
        monkeypatch.setenv("RINGFLOW_DEVICE", env)
    argv = [command, "--out", str(tmp_path)] + (["--device", option] if option else [])
    assert main(argv) == 1
    err = capsys.readouterr().err
    named = f"--device {option}" if option else f"RINGFLOW_DEVICE={env}"
    assert err == (f"ringflow {command}: error: device {option or env!r} ({named}) is not usable: no driver; "
                   "use --device sim or --device auto (the simulated GPU where there is none)\n"), err


def test_two_benches_in_the_same_second_keep_both_results(tmp_path, monkeypatch, capsys):
    """A result is named by the second its run ended: a second run ending in the same second
    (two at once into one --out folder) replaced the first one's file, whose results were lost."""
    import datetime
    import types

    import ringflow._bench.runner as runner

    class Frozen(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2030, 1, 2, 3, 4, 5, tzinfo=tz)

    monkeypatch.setattr(runner, "datetime", types.SimpleNamespace(datetime=Frozen, timezone=datetime.timezone))
    monkeypatch.setattr(runner, "run_workload", lambda dev, name, **k: {"workload": name})
    monkeypatch.setattr(runner, "table", lambda res: "")
    for name in ("seed", "pageable", "requests"):
        assert main(["bench", "--device", "sim", "--quick", name, "--out", str(tmp_path)]) == 0
    files = sorted(os.listdir(tmp_path))
    assert files == ["bench-sim-2030-01-02T030405-2.json", "bench-sim-2030-01-02T030405-3.json",
                     "bench-sim-2030-01-02T030405.json"], files
    kept = {next(iter(json.load(open(tmp_path / f))["workloads"])) for f in files}
    assert kept == {"seed", "pageable", "requests"}
    assert "wrote" in capsys.readouterr().out


def test_a_bench_result_name_never_holds_less_than_the_whole_result(tmp_path, monkeypatch):
    """The result's name was taken by an empty file before its contents went in: a reader of
    the folder (a plan --compare of the newest result, a run beside it) saw an empty result
    meanwhile, and a process killed then left one behind. The name now appears with the whole
    contents, still first come first served among runs of the same second."""
    import datetime

    import ringflow._bench.runner as runner
    import ringflow._files as files

    seen = []
    real_fsync = os.fsync

    def fsync(fd):  # the contents are going to the disk: what do the result names hold now?
        seen.extend((name, os.path.getsize(tmp_path / name)) for name in os.listdir(tmp_path)
                    if name.startswith("bench-"))
        return real_fsync(fd)

    monkeypatch.setattr(files.os, "fsync", fsync)
    when = datetime.datetime(2030, 1, 2, 3, 4, 5)
    first = runner.write_new_result(str(tmp_path), "sim", when, '{"run": 1}')
    second = runner.write_new_result(str(tmp_path), "sim", when, '{"run": 2}')
    assert os.path.basename(first) == "bench-sim-2030-01-02T030405.json"
    assert os.path.basename(second) == "bench-sim-2030-01-02T030405-2.json"
    assert json.load(open(first)) == {"run": 1} and json.load(open(second)) == {"run": 2}
    assert all(size > 0 for _, size in seen), seen
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(second), os.path.basename(first)]


def test_the_profile_doctor_saved_is_named_with_its_control_characters_escaped(tmp_path, capsys):
    """'saved hardware profile ... to PATH' wrote the file's name as it was: an escape sequence in
    it reached the terminal (colours, a cleared screen) and a line break split the line."""
    import re

    path = tmp_path / "p\x1b[31mX\nY.json"
    assert main(["doctor", "--device", "sim", "--save", str(path)]) == 0
    out = capsys.readouterr().out
    line = out[out.index("ringflow doctor: saved hardware profile"):]
    assert "p\\x1b[31mX\\nY.json" in line and line.count("\n") == 1, repr(line)
    assert not re.search(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]", line), repr(line)
    assert path.exists()


def test_a_workload_named_twice_runs_once(monkeypatch, capsys):
    """'ringflow bench seed seed' ran the seed workload twice, the first run's results replaced by
    the second's and its time lost."""
    import ringflow._bench.runner as runner

    ran = []
    monkeypatch.setattr(runner, "run_workload", lambda dev, name, **k: ran.append(name) or {"workload": name})
    monkeypatch.setattr(runner, "table", lambda res: "")
    assert main(["bench", "--device", "sim", "--quick", "seed", "pageable", "seed"]) == 0
    assert ran == ["seed", "pageable"]


def test_workloads_may_be_named_on_both_sides_of_an_option(monkeypatch, capsys):
    """'ringflow bench seed --quick balanced' said 'unrecognized arguments: balanced', a
    workload it knows: argparse fills a list of positional words once, from the first run of
    them, and left the words after an option over. They are the same list."""
    import ringflow._bench.runner as runner

    ran = []
    monkeypatch.setattr(runner, "run_workload", lambda dev, name, **k: ran.append(name) or {"workload": name})
    monkeypatch.setattr(runner, "table", lambda res: "")
    monkeypatch.delenv("RINGFLOW_DEBUG", raising=False)
    assert main(["bench", "seed", "--device", "sim", "pageable", "--quick", "requests", "seed"]) == 0
    assert ran == ["seed", "pageable", "requests"]
    ran.clear()
    assert main(["bench", "seed", "--device", "sim", "--quick", "--", "balanced"]) == 0  # (-- ends the options)
    assert ran == ["seed", "balanced"]
    # an unknown workload after an option is named as one; an unknown option still is one
    assert main(["bench", "seed", "--quick", "nosuch"]) == 2
    assert "unknown workload(s) 'nosuch'" in capsys.readouterr().err
    assert main(["bench", "seed", "--quick", "--nosuch", "balanced"]) == 2
    assert capsys.readouterr().err == "ringflow bench: error: unrecognized arguments: --nosuch balanced\n"
    # a command without such a list still refuses a word it does not take
    assert main(["trace", "a.json", "--json", "b.json"]) == 2
    assert "unrecognized arguments: b.json" in capsys.readouterr().err


_CTRL_C_AT_EXIT = """import atexit, os, signal, sys

def late():  # a clean-up at exit (a device closing, a finalizer) that a second Ctrl-C cuts short
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(10 ** 7):
        pass
    raise AssertionError("SIGINT did not interrupt the clean-up")

atexit.register(late)
sys.argv = ["ringflow", "plan", "--bytes", "1MiB"]
from _ringflow_entry import main
sys.exit(main())
"""


def test_a_ctrl_c_while_the_command_exits_shows_no_traceback(tmp_path):
    """A second Ctrl-C (a user pressing it twice) often lands while the process exits, in a
    clean-up registered with atexit or a weakref finalizer: Python printed 'Exception ignored in
    atexit callback' and a traceback. The clean-up is still cut short; nothing is printed."""
    env = {k: v for k, v in os.environ.items() if k not in ("RINGFLOW_DEVICE", "RINGFLOW_DEBUG")}
    env["PYTHONPATH"] = SRC
    proc = subprocess.run([sys.executable, "-c", _CTRL_C_AT_EXIT], capture_output=True, text=True, timeout=120,
                          env=env, cwd=tmp_path)
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    assert proc.stderr == "" and proc.returncode == 0, (proc.returncode, proc.stderr)
    assert "predicted total" in proc.stdout
