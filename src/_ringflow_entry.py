"""The ``ringflow`` command's entry point (``[project.scripts]``), outside the ringflow package.

The command never shows a traceback: a Ctrl-C ends it with one line and exit status 130
(:mod:`ringflow._cli`). But a console script imports its target's module before it calls the
target, outside any ``try``, and importing any module of the ringflow package first runs the
package's ``__init__``, which imports numpy and the whole library: a Ctrl-C during that import
escaped as a traceback. This module imports nothing at all until :func:`main` runs, so the
package is imported inside its ``try``. ``python -m ringflow`` imports the package before
``ringflow.__main__`` runs: the package's ``__init__`` asks :func:`exit_if_starting` then.
"""

import sys

INTERRUPTED = 130  # the exit status of a command ended by Ctrl-C, as ringflow._cli returns it

# ringflow._cli's subcommands (a test keeps the two the same): the line said for a Ctrl-C before
# the command line is parsed names the command as the parsed command's line does
COMMANDS = ("doctor", "demo", "bench", "trace", "plan")


def main() -> int:
    """Run the command line (the ``ringflow`` script's target); returns the exit status."""
    try:
        from ringflow._cli import main as run

        status = run()
    except KeyboardInterrupt:
        return interrupted()
    if status == INTERRUPTED:  # (said by ringflow._cli, which caught the Ctrl-C)
        _forget_unhandled_interrupt()
    _quiet_interrupts_at_exit()
    return status


def _quiet_interrupts_at_exit() -> None:
    """From now on (the command has ended; the process exits), a Ctrl-C that cuts short a
    clean-up run at exit (an ``atexit`` callback, a weakref finalizer, the wait for threads)
    prints nothing: Python reports it as an exception it ignored, with a traceback, and a second
    Ctrl-C, pressed while the first ends the command, often lands there. Other such exceptions
    are reported as before."""
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            return
        previous(unraisable)

    sys.unraisablehook = hook


def _forget_unhandled_interrupt() -> None:
    """Clear CPython's mark of a KeyboardInterrupt left unhandled, which a Ctrl-C raised inside
    code that ``exec`` or ``eval`` ran from a string sets (dataclasses and namedtuple make
    their methods so, as a module is imported) even where a caller then handles it: ``python -m``
    checks the mark as it exits and, set, kills itself with SIGINT rather than exit with the
    status asked for. Each run of a string clears the mark as it starts; this one sets nothing."""
    exec("pass")


def interrupted() -> int:
    """Say that the command was interrupted, as ``ringflow._cli.main`` does; returns the status."""
    _forget_unhandled_interrupt()
    _quiet_interrupts_at_exit()
    command = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] in COMMANDS else None
    if sys.stderr is None:  # closed (2>&-): print(file=None) would write the line to stdout
        return INTERRUPTED
    try:
        print(f"ringflow {command}: interrupted" if command else "ringflow: interrupted", file=sys.stderr)
    except (KeyboardInterrupt, OSError):  # pressed again, or stderr is gone: the status says it
        pass
    return INTERRUPTED


def exit_if_starting() -> None:
    """Called by the ringflow package's ``__init__`` on a Ctrl-C during its import: where that
    import is ``python -m ringflow`` starting, exit as the command does; otherwise return (the
    importer gets its KeyboardInterrupt)."""
    if _run_module() == "ringflow":
        sys.exit(interrupted())


def _run_module() -> "str | None":
    """The module ``python -m`` is locating and about to run, or None. While ``-m`` locates its
    module (importing its packages), ``sys.argv[0]`` is ``"-m"`` (Python's documentation of
    ``-m``); the module's name is in ``sys.orig_argv``, after the interpreter's own options, read
    as CPython reads them: single letters may be clustered (``-Bm ringflow``, ``-OOmringflow``),
    and in a cluster the letters c, m, W and X take a value, the rest of the cluster or, where the
    cluster ends with the letter, the next argument."""
    if sys.argv[:1] != ["-m"]:
        return None
    args = getattr(sys, "orig_argv", [])[1:]
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--check-hash-based-pycs":  # (the one long option taking a value)
            i += 1
            continue
        if arg in ("-", "--") or not arg.startswith("-"):
            return None  # stdin or a script runs ("--" ends the options before a script): not a module
        if arg.startswith("--"):
            continue
        for at, letter in enumerate(arg[1:], start=2):  # (arg[at:] is the rest after the letter)
            if letter not in "cmWX":
                continue
            if at < len(arg):
                value = arg[at:]
            elif i < len(args):
                value = args[i]
                i += 1
            else:
                value = None
            if letter == "m":
                return value
            if letter == "c":
                return None  # a command runs: not a module
            break  # (W and X: the value ends the cluster)
    return None
