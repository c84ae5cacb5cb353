"""Every committed run of bench/cpp_rounds.py as one Markdown table (src/ringflow/_bench/rounds.py):
per result file the card, the commit, and for each workload and face the median round ratio
against the C++ program and the rounds at or below 1.00. docs/performance.md holds its output.

    python3 bench/rounds_table.py [--results bench/results]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from ringflow._bench.rounds import rounds_table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(pathlib.Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    print(rounds_table(pathlib.Path(args.results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
