"""The ``ringflow`` command line: ``ringflow demo | bench | doctor | trace | plan``.

Each subcommand is a small function taking the parsed arguments and returning an exit status.
A mistake on the command line or in a file it names is reported as one line on stderr,
``ringflow <command>: error: <what is wrong and what to change>``, never a traceback:

* exit 2: the command line itself (a bad option value, an unwritable output path);
* exit 1: the command failed (a file that is not a trace, a GPU that is not there, a dependency
  that will not import, ...);
* exit 130: interrupted (Ctrl-C).

Anything else is a bug in ringflow: one line says so, and ``RINGFLOW_DEBUG=1`` shows the
traceback. With stderr closed (``2>&-``) these lines are dropped, never written to stdout: the
exit status alone tells.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib.util
import io
import logging
import math
import os
import re
import stat
import sys
import tempfile
import warnings
from typing import Callable, Iterator, NoReturn

from ._errors import RingflowError, interrupt_behind
from ._files import controls_escaped

DEBUG_VAR = "RINGFLOW_DEBUG"
_DEVICE_HELP = "auto, cuda, cuda:N, sim or sim:N (default: $RINGFLOW_DEVICE, else auto)"


class UsageError(Exception):
    """A command-line value the parser could not check by itself (exit status 2)."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr: ``<prog>: error: <message>``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {_one_line(message)}\n")

    def _print_message(self, message: str, file=None) -> None:
        """Write the help, the version or an error, as argparse does; an OSError in writing
        stdout is raised (:func:`main` reports it), where argparse drops it: help or the version
        sent to a full disk printed nothing, and the command exited 0. One in writing stderr is
        still dropped: there is nowhere left to say it."""
        if not message:
            return
        file = file or sys.stderr
        if file is sys.stderr:
            with contextlib.suppress(AttributeError, OSError):
                file.write(message)
            return
        file.write(message)
        file.flush()  # (a buffered write fails only here, or at exit where nothing reports it)


# every character str.splitlines ends a line at (a terminal moves to a new line or back to the
# line's start at the first few): an error can hold a file's name or a key read from a file
_LINE_BREAK = re.compile(r"\s*[\n\r\v\f\x1c-\x1e\x85\u2028\u2029]\s*")


def _one_line(text: object) -> str:
    """``text`` as one line: each line break with the spaces around it made one space, and every
    other control character written as its escape (``\\x1b``), which a terminal would otherwise
    take as the start of a control sequence."""
    return controls_escaped(_LINE_BREAK.sub(" ", str(text)).strip())


def _describe(exc: BaseException) -> str:
    """One line for an expected error: OSError as 'path: reason', others by their message."""
    if isinstance(exc, OSError) and exc.strerror:
        # an empty file name is shown quoted: ': No such file' alone says nothing
        where = "" if exc.filename is None else f"{exc.filename or repr(exc.filename)}: "
        return _one_line(f"{where}{exc.strerror}")
    return _one_line(exc) or type(exc).__name__


# -- argument types: each raises ArgumentTypeError, which argparse reports as one line -----------------------------
def size(text: str) -> int:
    """A byte count as :func:`ringflow._planning_cli.parse_bytes` reads it (e.g. ``512MiB``).

    Raises:
        argparse.ArgumentTypeError: not a size, below 1 byte or above 8 PiB.
    """
    from ._planning_cli import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _whole_size(hint: str):
    """An argparse type: a :func:`size` that is a whole number of bytes (``1.5KiB`` is 1536;
    ``2.5`` is refused, not rounded down to 2: a row of an array is whole bytes), its errors
    ending with ``hint``; raises argparse.ArgumentTypeError for not a size, negative, below 1
    byte, above 8 PiB, or not a whole number of bytes."""
    def whole_size(text: str) -> int:
        from ._planning_cli import parse_bytes

        try:
            return parse_bytes(text, whole=True, hint=hint)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return whole_size


row_size = _whole_size("use e.g. 4, 1KiB or 4096: the bytes of one row of the array")
out_row_size = _whole_size("use e.g. 4, 1KiB or 4096: the bytes of the result for one row of the array")


def chunk_size(text: str) -> "int | str":
    """``auto`` or a :func:`size`."""
    return "auto" if str(text).strip().lower() == "auto" else size(text)


def _ascii_number(text: str, *, whole: bool) -> str:
    """``text`` without the spaces around it, where it is a number written in ASCII: digits with
    an optional leading ``-`` (which each option's range then refuses by name) and, unless
    ``whole``, a point and an exponent (:data:`ringflow._planning_cli.NUMBER`). int() and float()
    take more than a command line means: ``1_0``, ``+3``, other scripts' digits (``٣``, ``１２``),
    and float() ``nan`` and ``inf``.

    Raises:
        ValueError: anything else.
    """
    from ._planning_cli import NUMBER

    plain = str(text).strip()
    if not re.fullmatch(r"-?[0-9]+" if whole else rf"-?{NUMBER}", plain):
        raise ValueError(f"{text!r} is not a number written in ASCII digits")
    return plain


def _count_of(what: str, most: int, example: str):
    """An argparse type: a whole number of ``what``, 1 .. ``most``."""
    def count(text: str) -> int:
        try:
            n = int(_ascii_number(text, whole=True))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of {what} (use e.g. {example})") from None
        if not 1 <= n <= most:
            raise argparse.ArgumentTypeError(f"{text!r} {what}: give 1 to {most} (e.g. {example.split(',')[-1].strip()})")
        return n
    count.__name__ = what  # argparse names the type in some messages
    return count


workers = _count_of("workers", 1024, "1, 8 or 16")  # CPU workers
gpus = _count_of("GPUs", 64, "1, 2 or 8")  # GPUs of one host


def ms_per_gib(text: str) -> float:
    """Milliseconds of kernel time per GiB: a finite number, 0 .. 1e9."""
    try:
        value = float(_ascii_number(text, whole=False))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of milliseconds (use e.g. 0, 2.5 or 40)") from None
    if not math.isfinite(value) or not 0 <= value <= 1e9:
        raise argparse.ArgumentTypeError(f"{text!r} ms per GiB: give a number from 0 to 1e9 (e.g. 0, 2.5 or 40)")
    return value


def sim_profile(text: str) -> str:
    """The name of a hardware profile, or the path of a profile JSON file (checked when read)."""
    from ._device.hardware import PROFILES, looks_like_path

    if text not in PROFILES and not looks_like_path(text):
        raise argparse.ArgumentTypeError(f"unknown sim profile {text!r}; choose one of {', '.join(sorted(PROFILES))} "
                                         "or give a profile JSON file (ringflow doctor --save writes one)")
    return text


def device_spec(text: str) -> str:
    """A device spec as :func:`ringflow.device` takes it, checked for spelling only; returned
    without the spaces around it, which :func:`ringflow.device` drops too."""
    from ._device import parse_spec

    try:
        parse_spec(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; use auto, cuda, cuda:N (N = GPU index 0, 1, ...), "
                                         "sim or sim:N") from None
    return text.strip()


# -- output paths, checked before any work ----------------------------------------------------------------------------
def check_out_dir(path: str, option: str, writes: "tuple[str, ...]") -> str:
    """Check the folder ``path`` can be made (if missing) and written, without making it: its
    nearest existing ancestor must be a folder that takes a new file, and the path of the
    longest of the file names ``writes`` (what the command writes into it) must fit in it.

    Raises:
        UsageError: naming ``option`` and what to change.
    """
    if not path.strip():
        raise UsageError(f"argument {option}: give a folder name, not an empty string")
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"argument {option}: {path!r} is a file, not a folder; give a folder name")
    existing = os.path.abspath(path)
    # lexists, not exists: a link to nothing (missing, or a loop) is a name taken, which no
    # folder can be made at or under
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if os.path.islink(existing) and not os.path.exists(existing):
        raise UsageError(f"argument {option}: cannot make folder {path!r}: {existing!r} is a symbolic link to "
                         "nothing (missing, or a loop); give another folder name")
    if not os.path.isdir(existing):
        raise UsageError(f"argument {option}: cannot make folder {path!r}: {existing!r} is a file, not a folder")
    longest = max(writes, key=lambda name: len(os.fsencode(name)))
    problem = _name_problem(existing, os.path.relpath(os.path.abspath(path), existing), longest)
    if problem is not None:
        what = "make folder" if os.path.abspath(path) != existing else "write into folder"
        raise UsageError(f"argument {option}: cannot {what} {path!r}: {problem}; give a shorter folder name")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        # the OS's words without the file's name: that is the probe's own, made up here
        made = "" if os.path.abspath(path) == existing else f" to make folder {path!r}"
        raise UsageError(f"argument {option}: cannot write into {existing!r}{made} "
                         f"({exc.strerror or type(exc).__name__}); give another folder name") from None
    return path


def _name_problem(existing: str, missing: str, file_name: str) -> "str | None":
    """Why the folders ``missing`` (a relative path, ``.`` for none) cannot be made inside the
    folder ``existing``, or the file ``file_name`` written into the last of them, for the length
    of a name, or None: each name must fit the file system's longest name, and the file's whole
    path its longest path (makedirs, or the write, fails on either only when it gets there,
    after the run)."""
    try:
        longest_name = os.pathconf(existing, "PC_NAME_MAX")
        longest_path = os.pathconf(existing, "PC_PATH_MAX")
    except (OSError, ValueError):  # no limit known: makedirs and the write say what they find
        return None
    folder = existing
    if missing != os.curdir:
        for name in missing.split(os.sep):
            if len(os.fsencode(name)) > longest_name:
                return f"the name {name[:40]!r}... is longer than the {longest_name} bytes a name may have"
        folder = os.path.join(existing, missing)
    if len(os.fsencode(folder)) >= longest_path:
        return f"the path is longer than the {longest_path - 1} bytes a path may have"
    if len(os.fsencode(os.path.join(folder, file_name))) >= longest_path:
        return (f"the path of a file written into it (a name of {len(os.fsencode(file_name))} bytes) would be longer "
                f"than the {longest_path - 1} bytes a path may have")
    return None


def out_file_problem(path: str) -> "tuple[str, str] | None":
    """What keeps the file ``path`` from being written, as ``(what is wrong, what to change)``, or
    None where it can be: its folder exists and takes a new file, and it is neither a folder nor
    a device, pipe or socket. Nothing is left behind. The caller puts the two into a message of
    its own (:func:`check_out_file` for a file option; the demo for a file it writes into a
    folder option), so each message is built once.

    Args:
        path: the file name to check.
    """
    if not path.strip():
        return "an empty string is not a file name", "give a file name"
    # one look at what the name holds: a run beside this one checking the same name makes it and
    # removes it, so two looks could each see another state (a file, then none)
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        st = None  # missing (or beyond a missing folder, a file, a link to nothing): checked below
    if st is not None and stat.S_ISDIR(st.st_mode):
        return f"{path!r} is a folder", "give a file name inside it"
    if st is not None and not stat.S_ISREG(st.st_mode):
        return f"{path!r} is not a regular file", "give the name of a file to write"
    if st is not None:
        # opened for writing (and closed unchanged) rather than asked about: the error says both
        # whether this process may write it and whether it is gone since (non-blocking: in case
        # it became a pipe meanwhile)
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except FileNotFoundError:  # removed since the look: another run's check of the same new name
            st = None
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                return f"cannot write {path!r} ({exc.strerror})", "give another file name"
            return f"cannot write {path!r} ({_describe(exc)})", "give another file name"
    if st is not None:
        # the file is written whole: a new file beside it, moved over it, so its folder must take one
        folder = os.path.dirname(path) or os.curdir
        try:
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as exc:
            return (f"cannot write {path!r}: its folder {folder!r} takes no new file "
                    f"({exc.strerror or type(exc).__name__})", "give a file name in another folder")
        return None
    if path.endswith((os.sep, "/")):
        return f"{path!r} ends with a slash", "give a file name, not a folder"
    if os.path.islink(path):
        return (f"{path!r} is a symbolic link to nothing that can be written (missing, or a loop)",
                "give another file name")
    # the folder as the system will resolve it ("missing/../x" needs "missing"), not as abspath folds it
    folder = os.path.dirname(path) or os.curdir
    if not os.path.isdir(folder):
        if os.path.exists(folder):
            return f"cannot write {path!r}: {folder!r} is a file, not a folder", "give a file name in a folder"
        return f"cannot write {path!r}: {folder!r} does not exist", "create it first"
    try:  # the very name, made and removed: a name too long, say, is found now, not after the run
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        os.unlink(path)
    except FileExistsError:  # made meanwhile (another run's check of the same name): a name the folder takes
        return None
    except OSError as exc:
        return f"cannot write {path!r} ({_describe(exc)})", "give another file name"
    return None


def check_out_file(path: str, option: str) -> str:
    """Check the file ``path``, given to ``option``, can be written (see :func:`out_file_problem`).

    Args:
        path: the file name given.
        option: the option it was given to (``"--trace"``), named in the message.

    Raises:
        UsageError: naming ``option``, what is wrong and what to change.
    """
    problem = out_file_problem(path)
    if problem is not None:
        wrong, change = problem
        raise UsageError(f"argument {option}: {wrong}; {change}")
    return path


def check_distinct(outputs: dict) -> None:
    """Refuse two options naming the same file (or a file and the folder it is, for --out):
    the second write would replace or fail on the first after the whole run.

    Args:
        outputs: option name -> path, or None where the option was not given.

    Raises:
        UsageError: naming both options.
    """
    seen: dict = {}
    for option, path in outputs.items():
        if path is None:
            continue
        key = os.path.realpath(path)
        if key in seen:
            raise UsageError(f"argument {option}: {path!r} is also given to {seen[key]}; give each its own file")
        seen[key] = option


def _check_plot_type(path: str) -> None:
    """The chart needs matplotlib, and a file type it writes (PNG when the name has none)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError("argument --plot: the chart needs matplotlib: pip install 'ringflow[plot]'")
    from ._trace.plot import plot_format

    try:
        plot_format(path, "argument --plot")  # (before the run: a chart it cannot write would lose its results)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def check_gpu_usable(device: "str | None") -> None:
    """Refuse ``device`` (a spec, or None for ``RINGFLOW_DEVICE``) where it names a CUDA GPU and
    none is usable, with the option to give instead; the library's own message advises a Python
    caller (``device('sim')``).

    Raises:
        DeviceUnavailableError: naming the device, the setting it came from and ``--device sim``.
        TypeError, ValueError: ``device`` (or ``RINGFLOW_DEVICE``) is not a device spec.
    """
    from ._device import ENV_VAR, DeviceUnavailableError, cuda_available, parse_spec

    if parse_spec(device)[0] != "cuda":
        return
    usable, reason = cuda_available()
    if not usable:
        given = device if device is not None else os.environ.get(ENV_VAR, "").strip()
        named = f"--device {device}" if device is not None else f"{ENV_VAR}={given}"
        raise DeviceUnavailableError(f"device {given!r} ({named}) is not usable: {reason}; use --device sim or "
                                     "--device auto (the simulated GPU where there is none)")


# -- the subcommands --------------------------------------------------------------------------------------------------
def _doctor(args: argparse.Namespace) -> int:
    from ._doctor import doctor_command, save_without_path_problem

    if args.save is True:  # (before the report: a mistake on the command line costs no work)
        problem = save_without_path_problem(args.device)
        if problem is not None:
            raise UsageError(f"argument --save: {problem}")
    if args.output is not None:
        check_out_file(args.output, "--output")
    if isinstance(args.save, str):
        check_out_file(args.save, "--save")
        check_distinct({"--output": args.output, "--save": args.save})
    return doctor_command(json_out=args.json, device=args.device, output=args.output, save=args.save)


def _bench(args: argparse.Namespace) -> int:
    from ._bench.workloads import BY_NAME_ONLY, WORKLOADS

    # each once, in the order first named: a second run would only replace the first's results
    names = list(dict.fromkeys(args.workloads)) or list(WORKLOADS)
    unknown = sorted(set(names) - set(WORKLOADS + BY_NAME_ONLY))
    if unknown:
        raise UsageError(f"unknown workload(s) {', '.join(map(repr, unknown))}; choose from "
                         f"{', '.join(WORKLOADS + BY_NAME_ONLY)}")
    if args.out is not None:
        from ._bench.runner import LONGEST_RESULT_NAME

        check_out_dir(args.out, "--out", (LONGEST_RESULT_NAME,))
    if args.trace is not None:
        check_out_file(args.trace, "--trace")
    if args.plot is not None:
        check_out_file(args.plot, "--plot")
        _check_plot_type(args.plot)
    check_distinct({"--out": args.out, "--trace": args.trace, "--plot": args.plot})
    check_gpu_usable(args.device)
    from ._bench import runner

    res = runner.run_bench(args.device, names, quick=args.quick, out_dir=args.out, trace=args.trace, plot=args.plot)
    return 1 if any("error" in w for w in res["workloads"].values()) else 0


def _demo(args: argparse.Namespace) -> int:
    from ._demo import PLOT_FILE, TRACE_FILE, demo

    check_out_dir(args.out, "--out", (TRACE_FILE, PLOT_FILE))
    if os.path.isdir(args.out):  # the files it will write there, checked before the run, not after it
        for name in (TRACE_FILE, PLOT_FILE):
            problem = out_file_problem(os.path.join(args.out, name))
            if problem is not None:
                # what is wrong with the file; the change to make is to the folder option, not the file
                raise UsageError(f"argument --out: the demo writes {name} into {args.out!r}, but {problem[0]}; "
                                 "give another folder")
    check_gpu_usable(args.device)
    return demo(device=args.device, out_dir=args.out)


def _trace(args: argparse.Namespace) -> int:
    from ._trace.summary import print_summary

    if not args.file.strip():
        # (the OS's words alone, "'': No such file or directory", say nothing to change)
        raise UsageError("argument file: an empty string is not a file name; give a trace JSON written by "
                         "Report.save_trace or ringflow bench --trace")
    try:
        return print_summary(args.file, json_out=args.json)
    except OSError as exc:
        if exc.filename != args.file or getattr(exc, "ringflow_stdout", False):
            raise
        # missing, unreadable: the OS's words alone name neither the argument nor the fix
        raise ValueError(f"argument file: cannot read {args.file!r} ({exc.strerror or type(exc).__name__}); give a "
                         "trace JSON written by Report.save_trace or ringflow bench --trace") from None


def _plan(args: argparse.Namespace) -> int:
    from ._planning_cli import plan_command

    if args.compare is not None and not args.compare.strip():
        # (else taken for no --compare: the plan would run without the comparison asked for)
        raise UsageError("argument --compare: an empty string is not a file name; give a bench JSON from "
                         "ringflow bench --out")
    # (each option is checked alone by its type; these are checked together: an array is whole
    # rows, and stream_map refuses a chunk smaller than a row)
    row, out_row = args.row_bytes or 1, args.out_row_bytes
    if out_row is not None and args.row_bytes is None:
        # a result's bytes a row mean nothing without the row: a default of a byte would read
        # "--out-row-bytes 4KiB" as 4 KiB of result for every byte of input
        raise UsageError(f"argument --out-row-bytes: give --row-bytes too, the bytes of the row of the array that "
                         f"makes {out_row} bytes of result (--row-bytes 1 for {out_row} bytes a byte of input)")
    if args.bytes % row:
        raise UsageError(f"argument --row-bytes: --bytes {args.bytes} is not a whole number of rows of {row} bytes; "
                         "give the bytes of a row of the array, and --bytes a multiple of it")
    if args.engine == "direct" and args.pinned != "both":
        # (staged data is copied through pinned rings on CPU workers, which only the scheduler does)
        raise UsageError("argument --engine: the direct engine needs pinned data on both sides; pass --pinned, or "
                         "--engine pipeline or auto")
    if args.chunk != "auto" and args.chunk < row:
        raise UsageError(f"argument --chunk: {args.chunk} bytes is smaller than a row (--row-bytes {row}); give a "
                         "chunk of a row at least, or --chunk auto")
    if args.chunk != "auto" and out_row is not None and args.chunk < out_row:
        # (stream_map refuses it too: a chunk's slot holds a row of the result at least)
        raise UsageError(f"argument --chunk: {args.chunk} bytes is smaller than a row of the result (--out-row-bytes "
                         f"{out_row}); give a chunk of a result row at least, or --chunk auto")
    return plan_command(args)


def build_parser() -> argparse.ArgumentParser:
    from ._version import __version__

    parser = _Parser(prog="ringflow", description="Stream data through a GPU, every stage overlapped.",
                     epilog=f"Errors are one line; set {DEBUG_VAR}=1 to see a traceback.")
    parser.add_argument("--version", action="version", version=f"ringflow {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("doctor", help="show the GPU, versions and capabilities, and measure copy bandwidth and overlap")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of tables")
    p.add_argument("--device", type=device_spec, default=None, help=_DEVICE_HELP)
    p.add_argument("--output", "-o", default=None, help="also write the JSON report to this file")
    p.add_argument("--save", nargs="?", const=True, default=None, metavar="PATH",
                   help="also measure launch, host copy and registration costs and save this GPU's hardware "
                        "profile: to PATH, or without PATH to the per-GPU cache that ringflow plans with on "
                        "this GPU model and driver")
    p.set_defaults(func=_doctor)

    p = sub.add_parser("demo", help="the main job: a short pageable and seed comparison, with a trace and PNG")
    p.add_argument("--device", type=device_spec, default=None, help=_DEVICE_HELP + "; without a usable GPU, "
                   "auto runs the simulated H200")
    p.add_argument("--out", default="ringflow-demo", help="folder for the trace JSON and PNG (made if missing; default: ringflow-demo)")
    p.set_defaults(func=_demo)

    p = sub.add_parser("bench", help="named workloads against every baseline and the ideal bound")
    p.add_argument("workloads", nargs="*", help="seed, balanced, compute-bound, pageable, requests (default: these five); "
                   "feed (batches of images fed to a model on the GPU, against PyTorch's DataLoader) "
                   "runs only when named: ringflow bench feed")
    p.add_argument("--device", type=device_spec, default=None, help=_DEVICE_HELP)
    p.add_argument("--quick", action="store_true", help="small sizes and few repeats")
    p.add_argument("--out", default=None, help="write the JSON results into this folder (e.g. bench/results)")
    p.add_argument("--trace", default=None, help="also write a Perfetto trace of a profiled run to this file")
    p.add_argument("--plot", default=None, help="also write a Gantt chart of that run to this file (PNG; the extension picks another "
                   "format matplotlib writes, such as .svg or .pdf)")
    p.set_defaults(func=_bench)

    p = sub.add_parser("trace", help="summarise a saved Chrome/Perfetto trace")
    p.add_argument("file", help="a trace JSON written by Report.save_trace or ringflow bench --trace")
    p.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    p.set_defaults(func=_trace)

    p = sub.add_parser("plan", help="predict stage times, slot counts and chunk size for a workload")
    p.add_argument("--bytes", type=size, default="1GiB", help="total bytes to stream (e.g. 512MiB, 1GiB or 1073741824; default 1GiB)")
    p.add_argument("--chunk", type=chunk_size, default="auto", help="chunk size (e.g. 8MiB) or auto (default)")
    p.add_argument("--compute-ms-per-gib", type=ms_per_gib, default=0.0, help="kernel time per GiB of input, ms")
    p.add_argument("--workers", type=workers, default=8, help="CPU workers for prepare/consume (default 8)")
    p.add_argument("--pinned", nargs="?", choices=("in", "out", "both"), const="both", default=None,
                   help="data already in pinned memory, used in place: both sides (--pinned alone: no staging), "
                        "or only the input (in) or the result (out), the other side staged")
    p.add_argument("--engine", choices=("auto", "direct", "pipeline"), default="auto",
                   help="the engine that runs the job: auto (default) as stream_map picks it, staged data on "
                        "the scheduler and --pinned data on the direct engine; pipeline runs --pinned data on the "
                        "scheduler too, as engine='pipeline' or on_error='continue' does; direct needs --pinned")
    p.add_argument("--devices", type=gpus, default=1,
                   help="also predict the job split over this many GPUs of one host (default 1)")
    p.add_argument("--row-bytes", type=row_size, default=None,
                   help="bytes of one row of the array (e.g. 4KiB; default 1): chunks and each GPU's share are "
                        "whole rows; --bytes must be a multiple of it")
    p.add_argument("--out-row-bytes", type=out_row_size, default=None,
                   help="bytes of the result for one row of the array (e.g. 16KiB; needs --row-bytes; default: "
                        "as many as the row's): the copy back, the consume and the rings are planned for them")
    p.add_argument("--profile", type=sim_profile, default="h200-pcie5",
                   help="the hardware profile to predict with: a name (h200-pcie5, pcie4-x16) or a profile JSON "
                        "file from ringflow doctor --save (default h200-pcie5)")
    p.add_argument("--compare", default=None, help="a bench JSON measured on the GPU: report the prediction error")
    p.set_defaults(func=_plan)
    parser._ringflow_commands = sub.choices  # type: ignore[attr-defined]
    return parser


@contextlib.contextmanager
def _warnings_as_lines(prog: str) -> Iterator[None]:
    """Show each warning, and each record of the ``"ringflow"`` logger at WARNING or above (from
    any thread: the library logs a fallback it took, a setting it could not use), as one stderr
    line, ``<prog>: warning: <message>``. The library's logger has only a NullHandler, so without
    this its warnings reached no one on the command line. A record of another library's logger
    that finds no handler (matplotlib's, say), which Python's last-resort handler would write
    bare, is such a line too."""
    def show(message, category, filename, lineno, file=None, line=None):
        print(f"{prog}: warning: {_one_line(message)}", file=sys.stderr)

    handler = _LineHandler(prog)
    library = logging.getLogger("ringflow")
    library.addHandler(handler)
    last_resort = logging.lastResort
    logging.lastResort = handler
    try:
        with warnings.catch_warnings():
            warnings.showwarning = show
            yield
    finally:
        library.removeHandler(handler)
        if logging.lastResort is handler:
            logging.lastResort = last_resort


class _LineHandler(logging.Handler):
    """A ``logging`` handler writing each record at WARNING or above as one stderr line."""

    def __init__(self, prog: str):
        super().__init__(logging.WARNING)
        self.prog = prog

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a record whose arguments do not fit its format
            message = str(record.msg)
        with contextlib.suppress(OSError, ValueError):  # stderr closed: nowhere left to say it
            print(f"{self.prog}: warning: {_one_line(message)}", file=sys.stderr)


STDOUT = "standard output"  # the file name of an OSError in writing stdout (main says so)


class _NamedStdout:
    """``sys.stdout`` while a command runs: an OSError in writing or flushing it (a full disk
    under a redirect) carries the file name :data:`STDOUT`, where the OS's words alone named
    nothing; anything else is the stream's own."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError as exc:
            raise _named(exc) from None

    def writelines(self, lines):
        try:
            return self._stream.writelines(lines)
        except OSError as exc:
            raise _named(exc) from None

    def flush(self):
        try:
            return self._stream.flush()
        except OSError as exc:
            raise _named(exc) from None

    def __getattr__(self, name):
        return getattr(self._stream, name)


class _ClosedStdout(io.TextIOBase):
    """``sys.stdout`` for a process started with its stdout closed (``>&-``), where Python sets
    it to None and every print is dropped: each write fails as a write to a closed descriptor does."""

    def write(self, text):
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))


class _ClosedStderr(io.TextIOBase):
    """``sys.stderr`` for a process started with its stderr closed (``2>&-``), where Python sets
    it to None and ``print(..., file=None)`` writes to stdout: an error or warning line would land
    in the command's output. Each write is dropped: there is nowhere left to say it, and the exit
    status still tells."""

    def write(self, text):
        return len(text)


def _named(exc: OSError) -> OSError:
    """``exc`` (of its own type: a BrokenPipeError stays one) with the file name :data:`STDOUT`,
    where it has an errno and no file name."""
    if exc.filename is not None or exc.errno is None:
        return exc
    named = type(exc)(exc.errno, exc.strerror, STDOUT)
    named.ringflow_stdout = True  # (a file of that name given to an option is not this)
    return named


# the error handlers of a text stream that fail on a character its encoding cannot show
_FAILING_HANDLERS = ("strict", "surrogateescape")


@contextlib.contextmanager
def _stdout_for_the_command() -> Iterator[None]:
    """Within the block, print characters stdout's encoding cannot show as escapes (``\\u2014``)
    instead of failing, as Python's stderr does, and name stdout in an error writing it
    (:class:`_NamedStdout`), a closed one too (:class:`_ClosedStdout`); stdout and its error
    handler are restored after."""
    # an ASCII or Latin-1 stdout (PYTHONIOENCODING, a POSIX locale without UTF-8, an old console)
    # cannot show a report's dashes and ellipses or a file's name: the first one failed the
    # command, after all its work. Python gives such a stdout "surrogateescape" in the POSIX
    # locale, which fails on them as "strict" does.
    stream = sys.stdout
    errors = getattr(stream, "errors", None)
    if errors not in _FAILING_HANDLERS:
        errors = None
    try:
        if errors is not None:
            stream.reconfigure(errors="backslashreplace")
    except (AttributeError, ValueError, OSError):  # not a text stream that takes a new handler
        errors = None
    named = sys.stdout = _NamedStdout(stream if stream is not None else _ClosedStdout())
    try:
        yield
    finally:
        if sys.stdout is named:
            sys.stdout = stream
        if errors is not None:
            with contextlib.suppress(AttributeError, ValueError, OSError):
                stream.reconfigure(errors=errors)


@contextlib.contextmanager
def _stderr_for_the_command() -> Iterator[None]:
    """Within the block, a closed stderr (``sys.stderr`` None) is a :class:`_ClosedStderr`, so
    that the error and warning lines, the traceback ``RINGFLOW_DEBUG`` asks for and argparse's
    messages are dropped rather than printed to stdout; restored after."""
    if sys.stderr is not None:
        yield
        return
    closed = sys.stderr = _ClosedStderr()
    try:
        yield
    finally:
        if sys.stderr is closed:
            sys.stderr = None


def _traceback_if(debug: bool) -> None:
    """Print the exception being handled, with its traceback, when ``RINGFLOW_DEBUG`` asks."""
    if debug:
        import traceback

        traceback.print_exc()


def main(argv: "list[str] | None" = None) -> int:
    """Run the command line; returns the exit status (see the module docstring)."""
    with _stderr_for_the_command():
        parser = build_parser()
        debug = os.environ.get(DEBUG_VAR, "").strip() not in ("", "0")
        parsed: list = []
        words = _negatives_joined(sys.argv[1:] if argv is None else list(argv), parser)
        argv = words
        # a subcommand's help names it, as its errors do; the top-level parser takes only options
        named = words[0] if words and words[0] in parser._ringflow_commands else None  # type: ignore[attr-defined]
        status = _guarded(f"ringflow {named}" if named else "ringflow", debug, lambda: _parse(parser, argv, parsed))
        if not parsed:
            return status
        args = parsed[0]
        return _guarded(f"ringflow {args.command}", debug, lambda: args.func(args))


def _negatives_joined(words: list, parser: argparse.ArgumentParser) -> list:
    """``words`` with each long option that takes a value followed by a negative value
    (``--bytes -1KiB``) joined into one word (``--bytes=-1KiB``): argparse takes a word that
    starts with ``-`` and is not a plain number for an option, and says only "expected one
    argument", naming no value, where the option's own check names the value and what it takes
    (``-inf`` and ``-nan`` as well). No option of this command line is spelt ``-`` and a digit,
    ``-i`` or ``-n``. A flag (``--json``) is left
    alone, as is everything after ``--``: the word after either is a file's or a workload's
    name (``ringflow trace -- -5``)."""
    takes_value = _options_taking_a_value(parser, words[0] if words else None)
    joined: list = []
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--":  # the end of the options: the rest are as written
            joined.extend(words[i:])
            break
        if (isinstance(word, str) and "=" not in word and takes_value(word) and i + 1 < len(words)
                and isinstance(words[i + 1], str) and _NEGATIVE.match(words[i + 1])):
            joined.append(f"{word}={words[i + 1]}")
            i += 2
            continue
        joined.append(word)
        i += 1
    return joined


def _options_taking_a_value(parser: argparse.ArgumentParser, command: object) -> "Callable[[str], bool]":
    """Whether a word names a long option of ``parser`` or of its subcommand ``command`` that
    takes a value: spelt whole, or cut short as argparse reads it (the start of one option only)."""
    commands = parser._ringflow_commands  # type: ignore[attr-defined]
    parsers = [parser] + ([commands[command]] if isinstance(command, str) and command in commands else [])
    options = {}
    for p in parsers:
        for action in p._actions:
            for name in action.option_strings:
                if name.startswith("--"):
                    options[name] = action.nargs != 0
    def takes_value(word: str) -> bool:
        if not word.startswith("--") or word == "--":
            return False
        if word in options:
            return options[word]
        starting = [name for name in options if name.startswith(word)]
        return len(starting) == 1 and options[starting[0]]
    return takes_value


_NEGATIVE = re.compile(r"-(?:\.?\d|inf|nan)", re.IGNORECASE)  # a negative number, or what float() reads as one


def _parse(parser: argparse.ArgumentParser, argv: "list[str] | None", parsed: list) -> int:
    """Parse ``argv``, appending the arguments of a command to run to ``parsed``; returns the
    exit status where there is none to run (help, the version, a usage error, no command)."""
    try:
        args, extra = parser.parse_known_args(argv)
        commands = parser._ringflow_commands  # type: ignore[attr-defined]
        command = commands.get(getattr(args, "command", None))
        if extra and command is not None:
            extra = _more_positional_words(command, args, extra)
        if extra:  # reported by the subcommand's parser, so the message names the subcommand
            (command or parser).error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # --help, --version, or a one-line usage error already printed
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    parsed.append(args)
    return 0


def _more_positional_words(command: argparse.ArgumentParser, args: argparse.Namespace, extra: list) -> list:
    """``extra`` (the words the parser left over) less those that belong to ``command``'s list of
    positional words (bench's workloads), which are added to it: argparse fills such a list from
    the first run of positional words only, and left ``balanced`` in ``bench seed --quick
    balanced`` over, as if unknown. Everything after ``--`` is such a word; everything after an
    unknown option stays with it."""
    lists = [a for a in command._actions if not a.option_strings and a.nargs == "*"]
    if len(lists) != 1:
        return extra
    dest = lists[0].dest
    words, rest = [], []
    for i, word in enumerate(extra):
        if word == "--":  # the end of the options: the rest are positional words
            words.extend(extra[i + 1:])
            break
        if isinstance(word, str) and word.startswith("-") and not _NEGATIVE.match(word):
            rest = extra[i:]
            break
        words.append(word)
    setattr(args, dest, list(getattr(args, dest) or []) + words)
    return rest


# what to install for a module that would not import: the extra that brings it, where one does
_EXTRA_FOR = {"cuda": "'ringflow[cuda]'", "nvtx": "'ringflow[cuda]'", "matplotlib": "'ringflow[plot]'",
              "ray": "'ringflow[ray]'"}


def _guarded(prog: str, debug: bool, work: "Callable[[], int]") -> int:
    """Run ``work`` (parsing the command line, or a command) and return its exit status; an
    error it raises is one line on stderr, ``<prog>: error: ...``, and its status (see the module
    docstring); warnings are lines too, and an error writing stdout is named as one."""
    try:
        with _warnings_as_lines(prog), _stdout_for_the_command():
            try:
                return work()
            except Exception as exc:  # a Ctrl-C the simulated GPU reported as a launch's error is a Ctrl-C
                interrupt = interrupt_behind(exc)
                if interrupt is None:
                    raise
                raise interrupt from None
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (e.g. `| head`): nothing more to say
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except UsageError as exc:
        print(f"{prog}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except MemoryError as exc:  # a resource the machine lacks, not a bug
        _traceback_if(debug)
        detail = f" ({_describe(exc)})" if str(exc) else ""
        print(f"{prog}: error: out of memory{detail}; free memory, or ask for less (smaller sizes, fewer "
              "items, a shorter run's files)", file=sys.stderr)
        return 1
    except (RingflowError, ValueError, TypeError, OSError) as exc:
        _traceback_if(debug)
        if getattr(exc, "ringflow_stdout", False):
            print(f"{prog}: error: cannot write the output to standard output ({exc.strerror}); send it where it "
                  "can be written", file=sys.stderr)
            return 1
        print(f"{prog}: error: {_describe(exc)}", file=sys.stderr)
        return 1
    except ImportError as exc:  # a broken install (a dependency missing or unloadable), not a bug
        _traceback_if(debug)
        module = (exc.name or "").split(".")[0]
        what = f"the module {module!r}" if module else "a module"
        fix = f"pip install {_EXTRA_FOR.get(module, module)}" if module else "pip install --force-reinstall ringflow"
        print(f"{prog}: error: {what} cannot be imported ({_describe(exc)}); {fix}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - the last resort: a bug, said in one line
        _traceback_if(debug)
        print(f"{prog}: internal error (a bug in ringflow): {type(exc).__name__}: {_describe(exc)}; "
              f"run again with {DEBUG_VAR}=1 to see the traceback", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
