"""MkDocs hooks: the command line page shows ``ringflow --help`` as the installed code prints it.

A page line ``<!-- ringflow-help: ARGS -->`` becomes a text block with the help of
``ringflow ARGS`` (``ARGS`` empty for the top level), so the page cannot drift from the parser.
"""

from __future__ import annotations

import os
import re
import sys

HELP = re.compile(r"^<!-- ringflow-help:(?P<args>[^>]*)-->$", re.MULTILINE)
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _parser():
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")
    if src not in sys.path:
        sys.path.insert(0, src)
    from ringflow._cli import build_parser

    return build_parser()


def _help(args: list[str]) -> str:
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal's width
    os.environ["NO_COLOR"] = "1"
    parser = _parser()
    for name in args:
        sub = next(a for a in parser._subparsers._group_actions if a.choices)  # noqa: SLF001
        if name not in sub.choices:
            raise ValueError(f"docs: no ringflow subcommand {name!r}; known: {sorted(sub.choices)}")
        parser = sub.choices[name]
    return ANSI.sub("", parser.format_help()).rstrip()


def on_page_markdown(markdown: str, page, config, files) -> str:
    return HELP.sub(lambda m: "```text\n" + _help(m.group("args").split()) + "\n```", markdown)
