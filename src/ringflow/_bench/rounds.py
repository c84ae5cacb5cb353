"""Every committed run of the rounds against the C++ program (``bench/cpp_rounds.py``), one row
each: the card, the commit whose source ran, and for each workload and face the median of the
rounds' time ratios (ringflow's best over the C++ program's best, measured in the same round)
and how many rounds were at or below 1.00.

A result file may hold rounds of two sources (an A/B run against a base): only those of the
file's own source count, never a ``base``'s. Rows differ in commit and host as well as card, so
the table shows the spread of machines and code, not a controlled comparison; a controlled one
is an A/B run of two sources interleaved on one machine.
"""

from __future__ import annotations

import json
import pathlib
import re
import statistics
from typing import Any, Iterator, NamedTuple

WORKLOADS = ("seed", "balanced", "compute-bound")
FACES = ("MapJob", "stream_map")


class RoundsRow(NamedTuple):
    """One result file's rounds: its name, when its first rounds began (ISO 8601, else the file's
    date), card, commit (None where the name gives none), and per ``(workload, face)`` the round
    ratios in the file's order."""

    file: str
    when: str
    card: str
    commit: "str | None"
    ratios: dict


def _rounds_documents(node: Any, base: bool = False) -> Iterator[dict]:
    """The documents of ``bench/cpp_rounds.py`` inside a result (a dict whose ``workloads`` hold
    ``rounds`` lists), skipping any under a ``base`` key (an A/B run's other source)."""
    if isinstance(node, dict):
        workloads = node.get("workloads")
        if isinstance(workloads, list) and workloads and isinstance(workloads[0], dict) \
                and isinstance(workloads[0].get("rounds"), list):
            if not base:
                yield node
            return
        for key, value in node.items():
            yield from _rounds_documents(value, base or key == "base")
    elif isinstance(node, list):
        for value in node:
            yield from _rounds_documents(value, base)


def _card(machine: str) -> str:
    """``"H100"``/``"H200"`` (the model in an NVIDIA machine string), else the string itself."""
    found = re.search(r"\b([A-Z]\d{2,3}[A-Z]?)\b", machine)
    return found.group(1) if found else machine


def rounds_row(path: pathlib.Path) -> "RoundsRow | None":
    """The row of the result file at ``path``, or None where it holds no rounds of its own source.

    Raises:
        OSError, ValueError: the file cannot be read or is not JSON.
    """
    result = json.loads(path.read_text())
    ratios: dict = {(w, f): [] for w in WORKLOADS for f in FACES}
    machine = when = None
    for doc in _rounds_documents(result):
        machine = machine or doc.get("machine")
        when = when or doc.get("date")
        for workload in doc["workloads"]:
            for rnd in workload["rounds"]:
                for face in FACES:
                    if (workload["workload"], face) in ratios:
                        ratios[workload["workload"], face].append(rnd["ratio"][face])
    if not any(ratios.values()):
        return None
    machine = result.get("machine") or machine or "?"
    commit = re.search(r"-at-([0-9a-f]{7,40})\.json$", path.name)
    return RoundsRow(path.name, when or result.get("date") or "?", _card(machine), commit.group(1) if commit else None,
                     ratios)


def rounds_rows(results: pathlib.Path) -> list[RoundsRow]:
    """Every row of the result files in ``results``, in the order they ran."""
    rows = [row for path in sorted(results.glob("*.json")) if (row := rounds_row(path)) is not None]
    return sorted(rows, key=lambda row: (row.when, row.file))


def _cell(ratios: list) -> str:
    if not ratios:
        return "-"
    at_or_below = sum(r <= 1.0 for r in ratios)
    return f"{statistics.median(ratios):.3f} ({at_or_below}/{len(ratios)})"


def rounds_table(results: pathlib.Path) -> str:
    """The rows of ``results`` as a Markdown table: each cell the median ratio and, in brackets,
    the rounds at or below 1.00 of the rounds run."""
    head = ["date", "card", "commit"] + [f"{w} `{f}`" for w in WORKLOADS for f in FACES]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for row in rounds_rows(results):
        cells = [row.when[:10], row.card, f"`{row.commit}`" if row.commit else row.file]
        cells += [_cell(row.ratios[w, f]) for w in WORKLOADS for f in FACES]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
