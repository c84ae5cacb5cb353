"""The ``ringflow`` command line: ``ringflow demo | bench | doctor | trace | plan``.

Each subcommand is a small function taking the parsed arguments and returning an exit status.
"""

from __future__ import annotations

import argparse
import sys


def _doctor(args: argparse.Namespace) -> int:
    from ._doctor import doctor_command

    return doctor_command(json_out=args.json, device=args.device, output=args.output)


def _bench(args: argparse.Namespace) -> int:
    from ._bench.runner import run_bench
    from ._bench.workloads import WORKLOADS

    names = args.workloads or list(WORKLOADS)
    unknown = set(names) - set(WORKLOADS)
    if unknown:
        print(f"unknown workload(s) {sorted(unknown)}; choose from {', '.join(WORKLOADS)}", file=sys.stderr)
        return 2
    res = run_bench(args.device, names, quick=args.quick, out_dir=args.out, trace=args.trace, plot=args.plot)
    return 1 if any("error" in w for w in res["workloads"].values()) else 0


def _demo(args: argparse.Namespace) -> int:
    from ._demo import demo

    return demo(device=args.device, out_dir=args.out)


def _trace(args: argparse.Namespace) -> int:
    from ._trace.summary import print_summary

    return print_summary(args.file)


def _plan(args: argparse.Namespace) -> int:
    from ._planning_cli import plan_command

    return plan_command(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ringflow", description="Stream data through a GPU, every stage overlapped.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("doctor", help="show the GPU, versions and capabilities, and measure copy bandwidth and overlap")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of tables")
    p.add_argument("--device", default="auto", help="auto (default), cuda, cuda:N or sim")
    p.add_argument("--output", "-o", default=None, help="also write the JSON report to this file")
    p.set_defaults(func=_doctor)

    p = sub.add_parser("demo", help="the main job: a short pageable and seed comparison, with a trace and PNG")
    p.add_argument("--device", default="auto", help="auto (default: the GPU if usable, else the simulated H200), "
                   "cuda:N or sim")
    p.add_argument("--out", default="ringflow-demo", help="folder for the trace JSON and PNG")
    p.set_defaults(func=_demo)

    p = sub.add_parser("bench", help="named workloads against every baseline and the ideal bound")
    p.add_argument("workloads", nargs="*", help="seed, balanced, compute-bound, pageable, requests (default: all)")
    p.add_argument("--device", default="auto", help="auto, cuda:N or sim")
    p.add_argument("--quick", action="store_true", help="small sizes and few repeats")
    p.add_argument("--out", default=None, help="write the JSON results into this folder (e.g. bench/results)")
    p.add_argument("--trace", default=None, help="also write a Perfetto trace of a profiled run here")
    p.add_argument("--plot", default=None, help="also write a PNG Gantt chart of that run here")
    p.set_defaults(func=_bench)

    p = sub.add_parser("trace", help="summarise a saved Chrome/Perfetto trace")
    p.add_argument("file")
    p.set_defaults(func=_trace)

    p = sub.add_parser("plan", help="predict stage times, slot counts and chunk size for a workload")
    p.add_argument("--bytes", default="1GiB", help="total bytes to stream (e.g. 256MiB, 1GiB)")
    p.add_argument("--chunk", default="auto", help="chunk size (e.g. 8MiB) or auto")
    p.add_argument("--compute-ms-per-gib", type=float, default=0.0, help="kernel time per GiB of input")
    p.add_argument("--workers", type=int, default=8, help="CPU workers for prepare/consume")
    p.add_argument("--pinned", action="store_true", help="data already in pinned memory (no staging)")
    p.add_argument("--profile", default="h200-pcie5", help="the sim profile to predict with")
    p.add_argument("--compare", default=None, help="a bench JSON measured on the GPU: report the prediction error")
    p.set_defaults(func=_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
