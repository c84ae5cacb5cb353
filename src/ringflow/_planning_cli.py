"""``ringflow plan``: predicted stage times, slots, chunk size and bound for a workload."""

from __future__ import annotations

import dataclasses
import decimal
import functools
import json
import math
import re
from typing import Any

from . import _jsontext as jsontext
from ._files import is_special, printable, too_large

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30,
          "t": 1 << 40, "tib": 1 << 40, "p": 1 << 50, "pib": 1 << 50, "kb": 10**3, "mb": 10**6, "gb": 10**9,
          "tb": 10**12, "pb": 10**15}
# a number as the command line takes one: ASCII digits, a point, an exponent (\d, int() and float() take any
# script's digits too, such as '٣' or '１２', and int() and float() digits grouped by '_')
NUMBER = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
_SIZE = re.compile(rf"\s*({NUMBER})\s*([a-zA-Z]*)\s*")
MAX_BYTES = 1 << 53  # 8 PiB: far beyond any host's memory, and exact as a float
SIZE_HINT = "use e.g. 512MiB, 1GiB or 1073741824"


def parse_bytes(text: str, *, whole: bool = False, hint: str = SIZE_HINT) -> int:
    """A byte count written as a number with an optional unit: B, KiB, MiB, GiB, TiB, PiB
    (K, M, G, T, P mean the same), kB, MB, GB, TB, PB; any case; ``1e6`` and ``1.5GiB`` too.
    ``whole``: a count that is not a whole number of bytes is refused rather than rounded down.
    ``hint``: the examples the messages end with.

    Returns:
        The size in bytes, fractions of a byte rounded down: 1 .. 8 PiB.

    Raises:
        ValueError: not a size, negative, less than 1 byte, more than 8 PiB, or (``whole``) not a
            whole number of bytes (the message says which).
    """
    m = _SIZE.fullmatch(str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        plain = str(text).strip()
        if plain.startswith("-") and _SIZE.fullmatch(plain[1:]):  # (the sign is all that is wrong)
            raise ValueError(f"{text!r} is negative; give at least 1 byte ({hint})")
        raise ValueError(f"{text!r} is not a size ({hint})")
    # exact decimal arithmetic: a float would round sizes just above the maximum down into range
    number = _decimal(m.group(1))
    if number > MAX_BYTES:  # a unit only makes it larger; checked first, so no huge power is built
        raise ValueError(f"{text!r} is too large; sizes go up to 8 PiB ({hint})")
    if number.adjusted() < -20:  # below a byte in any unit (the largest is 2**50 < 1e16)
        value = decimal.Decimal(0)
    else:
        with decimal.localcontext() as ctx:
            ctx.prec = len(number.as_tuple().digits) + 20  # room for every digit of the product
            ctx.traps[decimal.Inexact] = True
            value = number * _UNITS[unit]
    if value > MAX_BYTES:
        raise ValueError(f"{text!r} is too large; sizes go up to 8 PiB ({hint})")
    if value < 1:
        raise ValueError(f"{text!r} is less than 1 byte; give at least 1 byte ({hint})")
    if whole and value != int(value):
        raise ValueError(f"{text!r} is not a whole number of bytes ({hint})")
    return int(value)


def _decimal(number: str) -> decimal.Decimal:
    """``number`` (digits, a point, an exponent: as :data:`_SIZE` matches it) as a Decimal. One
    whose exponent is beyond what Decimal holds (past 10**18 either way, where it raises
    InvalidOperation, no ValueError) is 0 where its digits are all zeros, else a stand-in just
    as far out: above the largest size for a positive exponent, below a byte for a negative."""
    try:
        return decimal.Decimal(number)
    except decimal.InvalidOperation:
        digits, _, exponent = number.lower().partition("e")
        if decimal.Decimal(digits) == 0:
            return decimal.Decimal(0)
        return decimal.Decimal("1e-100") if exponent.startswith("-") else decimal.Decimal(MAX_BYTES + 1)


def read_bench_rows(path: str) -> list[tuple[str, dict[str, Any]]]:
    """The ``(workload, row)`` pairs of a bench JSON (as ``ringflow bench --out`` writes).

    Raises:
        ValueError: naming ``--compare``: the file cannot be read, is not JSON, or is not shaped
            like a bench result (the message says where).
    """
    if is_special(path):
        raise ValueError(f"--compare {path!r} is not a regular file; give a bench JSON from ringflow bench --out")
    try:
        with open(path, encoding=jsontext.ENCODING) as fh:
            data = jsontext.loads(fh.read())
    except IsADirectoryError:
        raise ValueError(f"--compare {path!r} is a folder; give a bench JSON file inside it") from None
    except UnicodeDecodeError:
        raise ValueError(f"--compare {path!r} is not a text file; give a bench JSON from ringflow bench --out") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--compare {path!r} is not JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); "
                         "give a bench JSON from ringflow bench --out") from None
    except MemoryError:
        raise ValueError(f"--compare {too_large(path)}; give a bench JSON from ringflow bench --out") from None
    except OSError as exc:  # missing, unreadable: the OS's words alone name neither the option nor the fix
        raise ValueError(f"--compare {path!r}: cannot read it ({exc.strerror or exc}); give a bench JSON from "
                         "ringflow bench --out") from None
    workloads = data.get("workloads") if isinstance(data, dict) else None
    if not isinstance(workloads, dict):
        raise ValueError(f"--compare {path!r} is not a bench result: it has no 'workloads' table "
                         "(write one with ringflow bench --out FOLDER)")
    out = []
    for name, w in workloads.items():
        if not isinstance(w, dict):
            raise ValueError(f"--compare {path!r}: workload {name!r} is not a table (a JSON object holding its 'rows')")
        rows = w.get("rows", [])
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ValueError(f"--compare {path!r}: workload {name!r} has 'rows' that are not a list of tables")
        out.extend((name, r) for r in rows)
    return out


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def plan_command(args) -> int:
    """Print the plan for ``args`` (the parsed ``ringflow plan`` options, sizes already in bytes).

    Returns:
        0.

    Raises:
        ValueError: the ``--compare`` file cannot be read or is not a bench result.
        ValueError: ``--profile`` names no built-in profile, or a file that is not a valid
            profile (:class:`~ringflow._device.hardware.ProfileError`, naming the field).
        ValueError: the device rings of ``--chunk`` do not fit the profile's ``total_memory``, or
            with ``--chunk auto`` those of no chunk do (naming chunk_bytes and total_memory); the
            rings checked are those allocated (``--pinned`` on the direct engine: grown to whole
            copy groups).
        ValueError: ``--engine direct`` without both sides ``--pinned`` (the command line refuses
            it before this is called).
        ValueError: ``--bytes`` is not a whole number of rows of ``--row-bytes``, or ``--chunk``
            is smaller than a row of the input or of the result (the command line refuses these
            before this is called).

    A chunk is whole rows of ``--row-bytes`` (a given ``--chunk`` is cut down to whole rows of
    the wider of the input and the result, as stream_map cuts it), and so is each GPU's share
    with ``--devices``. ``--out-row-bytes``: the result's bytes for a row of the input (None: as
    many); every prediction printed, the chunk choice and the memory check count them, the
    device rings as the engine that runs the job allocates them (device-in slots of the input,
    device-out slots of the result; on the scheduler each on a 256-byte boundary; on the direct
    engine packed, in rings of whole copy groups).

    ``--engine`` (``args.engine``; missing: ``"auto"``): the engine that runs the job. Staged data
    always runs on the scheduler; ``--pinned`` data on the direct engine (``"auto"``,
    ``"direct"``) or on the scheduler (``"pipeline"``, as ``stream_map(..., engine="pipeline")``
    or ``on_error="continue"`` runs it: the scheduler's host time per chunk unstaged, its device
    rings as it allocates them over the caller's pinned memory). Every figure printed, the chunk
    choice and the memory check are that engine's.

    ``--pinned`` (``args.pinned``): ``"both"`` (or True), ``"in"``, ``"out"`` or None: the sides
    that are the caller's pinned memory, used in place. The others are staged, and the planner is
    given that pair of sides (``host_stages``): one side staged costs one host copy and one pool
    hand-off a chunk, and only its ring counts as pinned memory; a pinned side's host ring is
    printed as none of its own.
    """
    from rich.console import Console
    from rich.table import Table

    from . import _plan as plan
    from ._device.hardware import PROFILES, get_profile
    from ._pipeline.sizing import copy_group, default_register_budget, planned_slots

    # read once: the planner is then given the profile itself, never the file again
    profile = get_profile(args.profile)
    where = "" if isinstance(args.profile, str) and args.profile in PROFILES else f" (from {args.profile})"
    total = args.bytes if isinstance(args.bytes, int) else parse_bytes(args.bytes)
    engine = getattr(args, "engine", None) or "auto"
    pinned = pinned_sides(args.pinned)
    if engine == "direct" and not all(pinned):
        raise ValueError("--engine direct needs pinned data on both sides; pass --pinned, or --engine pipeline or auto")
    # the sides staged through pinned rings (host_stages of the planner): those not pinned already
    staged = (not pinned[0], not pinned[1])
    # the scheduler runs every job that stages a side and, asked to, a pinned one; the direct engine the
    # other pinned ones
    scheduled = any(staged) or engine == "pipeline"
    compare = read_bench_rows(args.compare) if args.compare is not None else []
    per_byte = args.compute_ms_per_gib * 1e-3 / (1 << 30)
    row = getattr(args, "row_bytes", 1) or 1
    out_row = getattr(args, "out_row_bytes", None) or row
    out_ratio = out_row / row  # (a chunk of whole rows makes exactly out_ratio times its bytes)
    if total % row:
        raise ValueError(f"--bytes {total} is not a whole number of rows of --row-bytes {row}")
    if args.chunk == "auto":
        choice = plan.choose_chunk_bytes(profile, total, compute_s_per_byte=per_byte, workers=args.workers,
                                         host_stages=staged, align=row, out_ratio=out_ratio, scheduler=scheduled)
        chunk = choice.chunk_bytes
    else:
        # a whole array is never cut in chunks larger than itself, and a chunk is whole rows (as
        # stream_map and MapJob cut it: a given chunk bounds a slot, which holds the input's
        # rows and, apart, the result's, so it is cut in rows of the wider of the two)
        given = args.chunk if isinstance(args.chunk, int) else parse_bytes(args.chunk)
        if given < row:
            raise ValueError(f"--chunk {given} bytes is smaller than a row (--row-bytes {row})")
        if given < out_row:
            raise ValueError(f"--chunk {given} bytes is smaller than a row of the result (--out-row-bytes {out_row})")
        chunk = min(total, given // max(row, out_row) * row)
        choice = None
    out_total, out_chunk = total // row * out_row, chunk // row * out_row
    t, predicted = plan.predict_seconds(profile, total, chunk, compute_s_per_byte=per_byte, workers=args.workers,
                                        host_stages=staged, out_ratio=out_ratio, scheduler=scheduled)
    n = -(-total // chunk)
    slots = plan.plan_slots(t)
    # a whole array's pipeline keeps no more slots in a ring than it has chunks (resolve_slots)
    slots = dataclasses.replace(slots, slots=plan.cap_slots(slots.slots, n))
    # what stream_map's engine allocates for this job: planned by its own functions, so the two cannot differ
    # (the device rings' slack, a staging slot per worker; pinned data: host rings of the caller's memory, and
    # on the direct engine device rings of whole copy groups, which the scheduler never groups)
    allocated = planned_slots(profile, chunk, False, args.workers, plan.kernel_cost(0.0, per_byte, chunk),
                              external=pinned, bulk=True, max_chunks=n, out_bytes=out_chunk)
    if not scheduled:
        allocated = copy_group(profile, chunk, n, allocated, planned=True, inplace=False, out_bytes=out_chunk)[1]
    # the device rings checked are those allocated and printed, at the slot sizes and layout of the engine that
    # runs the job (device_slot_bytes, ring_bytes: the scheduler's slots on 256-byte boundaries, the direct
    # engine's packed)
    din, dout = allocated.device_in, allocated.device_out
    in_slot, out_slot = plan.device_slot_bytes(chunk, out_chunk, scheduler=scheduled)
    need = plan.ring_bytes(din, in_slot, scheduler=scheduled) + plan.ring_bytes(dout, out_slot, scheduler=scheduled)
    if need > profile.total_memory:  # (a chosen chunk's rings fit: choose_chunk_bytes and copy_group see to it)
        raise ValueError(f"--chunk {chunk} bytes: its device rings ({din} device-in and {dout} device-out slots) "
                         f"need {need:.0f} bytes, more than the total_memory of {profile.total_memory} bytes of "
                         f"profile {profile.name}{where}; give a smaller --chunk, or --chunk auto to plan one that fits")
    console = Console()
    # names from the profile and the bench file are the user's text, not markup
    rows = f" ({total // row} rows of {_human(row)})" if row > 1 else ""
    table = Table(title=printable(f"{_human(total)}{rows} in chunks of {chunk / 2**20:g} MiB x {n} on profile "
                               f"{profile.name}{where}"))
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("engine", "pipeline (the scheduler)" if scheduled else "direct")
    table.add_row("staged", {(True, True): "input and result", (True, False): "input (the result pinned)",
                             (False, True): "result (the input pinned)", (False, False): "nothing (both pinned)"}[staged])
    if out_row != row:
        table.add_row("result", f"{_human(out_total)} ({_human(out_row)} a row)")
    for stage, sec in t.as_dict().items():
        table.add_row(f"{stage} per chunk", f"{sec * 1e3:.4f} ms")
    table.add_row("bottleneck", slots.bottleneck)
    if any(staged):
        table.add_row("workers copying at once", f"{t.workers} of {args.workers}")
    for ring in ("host_in", "device_in", "device_out", "host_out"):
        if ring in HOST_RINGS and pinned[HOST_RINGS.index(ring)]:
            # no pinned ring of its own: the copy engines use the caller's memory in place
            table.add_row(f"slots {ring}", "none: the caller's pinned memory, in place")
            continue
        # the slots allocated, and those the ring's lifetime needs at the bottleneck interval where they differ
        count, wanted = getattr(allocated, ring), getattr(slots.slots, ring)
        table.add_row(f"slots {ring}", f"{count} (lifetime {slots.lifetimes.get(ring, 0) * 1e3:.3f} ms"
                      + (f"; {wanted} at the interval)" if wanted != count else ")"))
    # the host's time per chunk of the engine that runs the job (host_seconds_per_chunk), and where it came from
    table.add_row("host time per chunk", f"{t.scheduler * 1e3:.4f} ms")
    table.add_row("host time per chunk from", host_time_from(profile, staged, scheduled))
    table.add_row("predicted total", f"{predicted * 1e3:.3f} ms")
    if any(staged) and profile.staging_GBps is not None:
        floor = plan.staging_floor_seconds(profile, total * staged[0], out_total * staged[1])
        table.add_row("host memory floor", f"{floor * 1e3:.3f} ms")
    if any(staged):
        # what host="auto" would do with such ordinary memory: a call pins around itself, a job once,
        # and neither more than auto's default bound on this host (no pinned_budget is planned here)
        bound = default_register_budget()
        strategy = functools.partial(plan.choose_host_strategy, profile, total, out_total, workers=args.workers,
                                     out_is_fresh=True, pinned=pinned, compute_s_per_byte=per_byte, align=row,
                                     chunk_bytes=None if choice is not None else chunk, scheduler=engine == "pipeline",
                                     pinned_budget=bound)
        for what, pins_once in (("host='auto', a call", False), ("host='auto', a MapJob's call", True)):
            s = strategy(pins_once=pins_once)
            over = (f" (registering is faster but would pin more than auto's bound on this host, {_human(bound)}: "
                    f"a pinned_budget raises it)" if s.choice == "stage" and s.register_s < s.stage_s else "")
            table.add_row(what, f"{s.choice}: staged {s.stage_s * 1e3:.3f}, registered {s.register_s * 1e3:.3f} ms"
                          + over)
    devices = getattr(args, "devices", 1) or 1
    if devices > 1:
        # with --chunk auto each shard plans its chunk for its own share, as a job over several devices does
        many = plan.predict_devices(profile, total, "auto" if choice is not None else chunk, devices,
                                    compute_s_per_byte=per_byte, workers=args.workers, host_stages=staged,
                                    row_bytes=row, out_ratio=out_ratio, scheduler=scheduled)
        # the rows are split, not the chunks: a GPU's share may be less than a chunk; no more GPUs than rows get one
        on = (f"on {devices} GPUs of this host" if many.devices == devices else
              f"on {many.devices} of {devices} GPUs of this host (a shard needs a {'row' if row > 1 else 'byte'})")
        table.add_row(on, f"{many.predicted_s * 1e3:.3f} ms ({many.speedup:.2f}x one)")
        table.add_row(f"  each GPU's share alone ({_human(many.share_bytes)})",
                      f"{many.per_device_s * 1e3:.3f} ms in {-(-many.share_bytes // many.share_chunk_bytes)} chunks "
                      f"of {_human(many.share_chunk_bytes)}")
        table.add_row("  the host's shared copies", f"{many.host_floor_s * 1e3:.3f} ms")
    console.print(table)
    if profile.gpu_name:
        console.print(printable(f"profile {profile.name}: measured on {profile.gpu_name} (driver "
                             f"{profile.driver or 'unknown'})" + (f" at {profile.measured_at}" if profile.measured_at else "")))
    if choice is not None:
        console.print("candidates: " + ", ".join(f"{c / 2**20:g} MiB: {s * 1e3:.2f} ms" for c, _, s in choice.table))
    for name, row in compare:
        if _number(row.get("chunk_bytes")) and _number(row.get("predicted_ms")) and _number(row.get("ms_median")):
            err = row["predicted_ms"] / row["ms_median"] - 1
            console.print(printable(f"{name} {row.get('name', '?')}: predicted {row['predicted_ms']:.3f} ms, measured "
                                 f"{row['ms_median']:.3f} ms, error {err * 100:+.1f}%"))
    return 0


# the host rings, input side first (as pinned_sides and the planner's host_stages pair name the sides)
HOST_RINGS = ("host_in", "host_out")


def pinned_sides(pinned: "str | bool | None") -> tuple[bool, bool]:
    """``(input pinned, result pinned)`` of ``--pinned``: ``"both"`` (or True: the flag alone),
    ``"in"``, ``"out"``, or None/False (neither: both sides staged)."""
    if pinned is True or pinned == "both":
        return True, True
    return pinned == "in", pinned == "out"


# how a one-side job's host time per chunk is derived (_plan.host_time_per_chunk's sources), in
# ringflow plan's words
_DERIVED = {
    "midpoint": "midpoint of staged_chunk_host_s and scheduled_chunk_host_s",
    "staged less a hand-off": "staged_chunk_host_s less the planner's fit of a pool hand-off, at least half of it",
    "scheduled plus a hand-off": "scheduled_chunk_host_s plus the planner's fit of a pool hand-off",
}


def host_time_from(profile, host_stages, scheduled: bool) -> str:
    """Where the host's time per chunk of a job (``_plan.host_seconds_per_chunk``, its arguments
    as there) comes from, in the words ``ringflow plan`` prints: a field of ``profile``, the
    fields a job staging one side derives it from, or the planner's fit (the H200's host: the
    built-in profiles' and older files')."""
    from . import _plan as plan

    _, source = plan.host_time_per_chunk(profile, host_stages, scheduler=scheduled)
    if source is None:
        return "the planner's fit"
    if source in _DERIVED:
        return f"this profile ({_DERIVED[source]}: one side staged)"
    return f"this profile ({source})"


def _human(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"
