"""Hardware profiles: the model of a GPU and its host that the planner and the simulated GPU use.

A :class:`HardwareProfile` holds pinned copy bandwidth by size in each direction, both
directions at once, pageable copies, device memory, launch / copy / event overheads, host copy
rates by thread count, host registration and first-touch rates, the host's time per chunk of
ringflow's engines (the scheduler staging or not, the direct engine) where it was measured, and
the device's counts. A copy of ``n`` bytes takes ``n / bandwidth(n)``, the bandwidth read off
the bandwidth-by-size curve (log-log interpolation), so small copies are as slow as measured.

Profiles come from three places:

* built in, by name (:data:`PROFILES`): ``h200-pcie5`` from the figures measured on our H200,
  ``pcie4-x16`` the same GPU behind a PCIe Gen4 x16 link, and ``unit`` with round numbers for
  tests;
* measured: ``ringflow doctor --save`` measures this machine's GPU and writes a JSON file
  (:meth:`HardwareProfile.to_json`), by default into the per-GPU cache
  (:func:`cached_profile_path`), which a real GPU's ``Device.hardware`` reads
  (:func:`profile_for_gpu`);
* any such JSON file, by path: :func:`get_profile` takes a name, a profile or a path.
"""

from __future__ import annotations

import bisect
import dataclasses
import datetime
import errno
import functools
import json
import logging
import math
import numbers
import os
import re
import stat
import threading
from typing import Any, Optional

from .. import _jsontext as jsontext
from .._errors import RingflowError
from .._files import check_file_name, controls_escaped, is_special, write_whole

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

logger = logging.getLogger("ringflow")

SCHEMA = "ringflow-hardware-profile"
# 2 added staging_GBps (one rate, the most threads'; read as that rate for any number of threads);
# 3 made it a curve by threads; 4 added staged_chunk_host_s and direct_chunk_host_s; 5 added
# scheduled_chunk_host_s; 6 added register_call_s; 7 added one_side_chunk_host_s. A file of an
# older version is read with the fields it lacks unknown (None).
SCHEMA_VERSION = 7
CALIBRATE_VAR = "RINGFLOW_CALIBRATE"  # "1": measure a GPU with no cached profile on first use


class ProfileError(RingflowError, ValueError):
    """A hardware profile that cannot be used: a field missing, of the wrong type or out of
    range, or a file that is not a profile. The message names the file and the field."""


# -- the profile -------------------------------------------------------------------------------------------------------
# Field groups, for validation and for the JSON layout. Curves are (x, GB/s) points, x rising.
_BYTE_CURVES = ("h2d_curve", "d2h_curve")  # x: copy size in bytes
_THREAD_CURVES = ("host_copy_GBps", "first_touch_GBps")  # x: threads
_CURVES = _BYTE_CURVES + _THREAD_CURVES + ("staging_GBps",)  # staging_GBps: x threads, or None
_RATES = ("duplex_GBps", "pageable_h2d_GBps", "pageable_d2h_GBps", "device_GBps", "register_GBps",
          "register_fresh_GBps", "unregister_GBps")  # GB/s, > 0
_SECONDS = ("kernel_min_s", "launch_overhead_s", "copy_overhead_s", "event_overhead_s",
            "host_task_overhead_s")  # seconds, >= 0
_COUNTS = ("async_engine_count", "sm_count", "total_memory")  # ints >= 1
# what a profile may hold: far past any machine, yet short of what breaks the model's arithmetic
# (a rate of 1e300 GB/s made a copy take 0 s, and the planner divided by it)
_GBPS_RANGE = (1e-6, 1e6)  # a kilobyte a second to a petabyte a second
_SECONDS_MAX = 3600.0
_WHOLE_MAX = 1 << 62
PCIE_GTPS_MAX = 128.0  # GT/s a lane: PCIe 7.0's rate, the fastest PCIe has
PCIE_WIDTHS = (1, 2, 4, 8, 12, 16, 32)  # the link widths (lanes) PCIe has
_MACHINE = ("gpu_name", "driver", "pcie_link")  # where it was measured: the JSON's "machine"
_META = ("name", "measured_at") + _MACHINE
# model fields that a file of an older schema version does not hold: {field: first version}
_SINCE = {"staging_GBps": 2, "staged_chunk_host_s": 4, "direct_chunk_host_s": 4, "scheduled_chunk_host_s": 5,
          "register_call_s": 6, "one_side_chunk_host_s": 7}
# seconds > 0, or None
_MEASURED_SECONDS = ("staged_chunk_host_s", "scheduled_chunk_host_s", "direct_chunk_host_s", "register_call_s",
                     "one_side_chunk_host_s")


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """The performance model of one GPU and its host (see the module doc).

    Constructing one checks every field: a curve of no points, a negative or non-finite
    bandwidth, a count below 1 or a value of the wrong type raises :class:`ProfileError`.
    """

    name: str
    # (bytes, GB/s) points of a pinned copy's bandwidth by size, one direction alone.
    h2d_curve: tuple[tuple[int, float], ...]
    d2h_curve: tuple[tuple[int, float], ...]
    duplex_GBps: float  # H2D + D2H together, when both run at once (they share the link)
    pageable_h2d_GBps: float
    pageable_d2h_GBps: float
    device_GBps: float  # device memory, counting bytes read plus written (memory-bound kernels)
    kernel_min_s: float  # the shortest a kernel takes on the device
    launch_overhead_s: float  # host time to enqueue a kernel
    copy_overhead_s: float  # host time to enqueue a copy
    event_overhead_s: float  # host time to record / query an event or wait on one
    host_copy_GBps: tuple[tuple[int, float], ...]  # (threads, GB/s) pageable -> pinned memcpy
    host_task_overhead_s: float  # scheduling cost of one host task
    register_GBps: float  # cudaHostRegister of memory already touched
    register_fresh_GBps: float  # cudaHostRegister of never-touched memory (it faults pages in)
    unregister_GBps: float
    first_touch_GBps: tuple[tuple[int, float], ...]  # (threads, GB/s) first write to fresh pages
    async_engine_count: int
    sm_count: int
    compute_capability: tuple[int, int]
    total_memory: int
    chaos_spread: float = 0.25  # with chaos on, durations vary by up to this fraction
    # (threads, GB/s): input bytes a second that so many threads stage in and out at once (some
    # copy touched pageable memory into pinned memory, the rest pinned memory into fresh pageable
    # pages) while the GPU copies as many bytes each way; every part shares the host's memory.
    # None: not measured (a profile written before it was).
    staging_GBps: Optional[tuple[tuple[int, float], ...]] = None
    # The host's seconds per chunk of a long run of small chunks through ringflow's engines: the
    # scheduled engine staging pageable memory (its enqueues, event queries and hand-offs to CPU
    # workers), the scheduled engine on pinned memory (engine="pipeline": its enqueues and event
    # queries, no hand-offs), and the direct engine on pinned memory (its enqueueing). The CPU's
    # speed sets them, not the GPU's. None: not measured (the planner then uses its own fit).
    staged_chunk_host_s: Optional[float] = None
    direct_chunk_host_s: Optional[float] = None
    scheduled_chunk_host_s: Optional[float] = None
    # The same for the scheduled engine staging one side, the other pinned memory it uses in
    # place: one pool task a chunk, whose cost between the unstaged and the staged figures
    # differs from host to host. None: not measured (the planner derives it from the two).
    one_side_chunk_host_s: Optional[float] = None
    # The host's seconds to register one page in place and unregister it: what a registration
    # costs beyond its bytes at register_GBps and unregister_GBps, paid once per array pinned.
    # None: not measured (the planner then counts registration by its bytes alone).
    register_call_s: Optional[float] = None
    pcie_link: "tuple[float, int] | None" = None  # (GT/s per lane, lanes) of the GPU's host link, if known
    gpu_name: Optional[str] = None  # the GPU it was measured on (None for a model)
    driver: Optional[str] = None  # that GPU's driver version
    measured_at: Optional[str] = None  # ISO 8601 date and time of the measurement

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = _check_field(f.name, getattr(self, f.name), f"HardwareProfile.{f.name}")
            object.__setattr__(self, f.name, value)

    def copy_GBps(self, direction: str, nbytes: int) -> float:
        """Bandwidth of one pinned copy of ``nbytes`` running alone (direction 'h2d' or 'd2h')."""
        curve = self.h2d_curve if direction == "h2d" else self.d2h_curve
        return _interp_loglog(curve, nbytes)

    def host_copy_rate(self, threads: int) -> float:
        """GB/s of host memcpy with ``threads`` threads copying at once (all threads together)."""
        return _interp_loglog(self.host_copy_GBps, max(1, threads))

    def staging_rate(self, threads: int) -> "float | None":
        """GB/s of input that ``threads`` threads stage in and out at once beside the GPU's copies
        (``staging_GBps`` read at that many threads; None where the profile has no such figure)."""
        return None if self.staging_GBps is None else _interp_loglog(self.staging_GBps, max(1, threads))

    def staging_copy_rate(self, threads: int) -> float:
        """GB/s of the staged path's host copies with ``threads`` threads copying at once (all
        threads together): :meth:`host_copy_rate`, but no more than twice :meth:`staging_rate`
        where the profile has it, since copies in and out of pinned memory that run beside the
        GPU's copies (and the fresh output's first touch) move no more bytes than that."""
        rate = self.host_copy_rate(threads)
        staging = self.staging_rate(threads)
        return rate if staging is None else min(rate, 2 * staging)

    def staging_floor_rate(self) -> "float | None":
        """The most GB/s of input the host stages in and out at once with any number of threads
        (the fastest point of ``staging_GBps``; None where the profile has no such figure)."""
        return None if self.staging_GBps is None else max(rate for _, rate in self.staging_GBps)

    def register_seconds(self, nbytes: int) -> float:
        """Host seconds to pin ``nbytes`` of touched memory in place (one array): its bytes at
        ``register_GBps`` and half of ``register_call_s`` (the other half is the unpinning's)."""
        return nbytes / (self.register_GBps * 1e9) + (self.register_call_s or 0.0) / 2

    def unregister_seconds(self, nbytes: int) -> float:
        """Host seconds to unpin an array of ``nbytes``: its bytes at ``unregister_GBps`` and the
        other half of ``register_call_s``."""
        return nbytes / (self.unregister_GBps * 1e9) + (self.register_call_s or 0.0) / 2

    def first_touch_rate(self, threads: int) -> float:
        """GB/s of first writes to fresh pages with ``threads`` threads (all threads together)."""
        return _interp_loglog(self.first_touch_GBps, max(1, threads))

    def kernel_seconds(self, touched_bytes: int) -> float:
        """Seconds a kernel that declares no cost of its own (no ``sim_seconds``) takes on the device:
        its bytes read plus written at ``device_GBps`` (a memory-bound pass), and at least
        ``kernel_min_s``. The simulated GPU charges a launch this, and the planner plans it."""
        return max(self.kernel_min_s, touched_bytes / (self.device_GBps * 1e9))

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # -- JSON ------------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The profile as its JSON document (:meth:`to_json`), a dict of plain JSON values."""
        model = {}
        for f in dataclasses.fields(self):
            if f.name in _META:
                continue
            value = getattr(self, f.name)
            model[f.name] = [list(p) for p in value] if f.name in _CURVES and value is not None else (
                list(value) if isinstance(value, tuple) else value)
        link = None if self.pcie_link is None else {"GTps": self.pcie_link[0], "width": self.pcie_link[1]}
        return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "name": self.name, "date": self.measured_at,
                "machine": {"gpu": self.gpu_name, "driver": self.driver, "pcie_link": link}, "model": model}

    def to_json(self) -> str:
        """The profile as JSON text: ``schema``, ``schema_version``, ``name``, ``date`` (when
        measured, ISO 8601), ``machine`` (``gpu``, ``driver``, ``pcie_link``: ``GTps`` per lane
        and ``width`` in lanes) and ``model`` (every other field, bandwidths in GB/s = 1e9 B/s,
        times in seconds, curves as ``[x, GB/s]`` pairs). :meth:`from_json` reads it back."""
        text = json.dumps(self.to_dict(), indent=2)
        # one line per [x, y] point or [major, minor] pair: a curve reads as a table
        return re.sub(r"\[\n\s*([-+.\deE]+),\n\s*([-+.\deE]+)\n\s*\]", r"[\1, \2]", text) + "\n"

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "hardware profile") -> "HardwareProfile":
        """A profile from its JSON document (as :meth:`to_dict` makes it), every field checked.

        Args:
            data: the parsed JSON.
            source: what to call the document in errors (a file name, say).

        Raises:
            ProfileError: not a profile, a newer schema version, a field missing, unknown, of
                the wrong type or out of range (the message names ``source`` and the field).
        """
        hint = "write one with ringflow doctor --save"
        if not isinstance(data, dict):
            raise ProfileError(f"{source}: not a hardware profile (a JSON {_json_type(data)}, not an object); {hint}")
        if data.get("schema") != SCHEMA:
            what = ("a ringflow doctor report, not a hardware profile" if "measurements" in data or "versions" in data
                    else f"not a hardware profile ('schema' is {data.get('schema')!r}, not {SCHEMA!r})")
            raise ProfileError(f"{source}: {what}; {hint}")
        version = data.get("schema_version")
        if isinstance(version, bool) or not isinstance(version, int):
            raise ProfileError(f"{source}: 'schema_version' must be a whole number, got {version!r}")
        if version > SCHEMA_VERSION:
            raise ProfileError(f"{source}: written by a newer ringflow (schema_version {version}; this one reads "
                               f"up to {SCHEMA_VERSION}): upgrade ringflow or measure again with ringflow doctor --save")
        if version < 1:
            raise ProfileError(f"{source}: 'schema_version' must be 1 or more, got {version}")
        _require(data, ("schema", "schema_version", "name", "date", "machine", "model"), "", source)
        machine, model = data["machine"], data["model"]
        for key, part in (("machine", machine), ("model", model)):
            if not isinstance(part, dict):
                raise ProfileError(f"{source}: '{key}' must be a JSON object, got {_json_type(part)} {part!r:.60}")
        _require(machine, ("gpu", "driver", "pcie_link"), "machine.", source)
        model_fields = [f.name for f in dataclasses.fields(cls)
                        if f.name not in _META and _SINCE.get(f.name, 1) <= version]
        _require(model, model_fields, "model.", source)
        link = machine["pcie_link"]
        if link is not None:
            if not isinstance(link, dict):
                raise ProfileError(f"{source}: 'machine.pcie_link' must be null or an object with GTps and width, "
                                   f"got {_json_type(link)} {link!r:.60}")
            _require(link, ("GTps", "width"), "machine.pcie_link.", source)
            link = (link["GTps"], link["width"])
        values = {"name": data["name"], "measured_at": data["date"], "gpu_name": machine["gpu"],
                  "driver": machine["driver"], "pcie_link": link, **model}
        if version == 2 and model["staging_GBps"] is not None:
            # one rate, measured with the most threads: read as that rate for any number of
            # threads (how version 2 planned with it), each thread's own memcpy rate still a cap
            values["staging_GBps"] = [[1, _rate(model["staging_GBps"], f"{source}: 'model.staging_GBps'")]]
        where = {"name": "name", "measured_at": "date", "gpu_name": "machine.gpu", "driver": "machine.driver",
                 "pcie_link": "machine.pcie_link"}
        checked = {k: _check_field(k, v, f"{source}: '{where.get(k, 'model.' + k)}'") for k, v in values.items()}
        return cls(**checked)

    @classmethod
    def from_json(cls, text: "str | bytes", *, source: str = "hardware profile") -> "HardwareProfile":
        """A profile from :meth:`to_json`'s text; see :meth:`from_dict`.

        A str is the JSON text itself: a byte order mark at its start is refused, saying how many
        it holds (bytes may start with one, as a file may).

        Raises:
            ProfileError: the text is not JSON, gives a key twice in one object, or is not a
                valid profile (the message says where).
        """
        return cls._from_text(text, source=source, decoded_file=False)

    @classmethod
    def _from_text(cls, text: "str | bytes", *, source: str, decoded_file: bool) -> "HardwareProfile":
        """:meth:`from_json`; with ``decoded_file``, a str is a file's text as :data:`jsontext.ENCODING`
        decodes it (its first byte order mark skipped), so a message about marks counts the file's.

        Raises:
            ProfileError: as :meth:`from_json`.
        """
        try:
            data = jsontext.loads(text, unique_keys=True, decoded_file=decoded_file)
        except json.JSONDecodeError as exc:
            raise ProfileError(f"{source}: not JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); "
                               "a hardware profile is the JSON file ringflow doctor --save writes") from None
        except jsontext.DuplicateKeyError as exc:
            # JSON readers keep one of the values and drop the other without a word: which was
            # meant is the file's writer's to say
            raise ProfileError(f"{source}: key '{controls_escaped(exc.key)}' appears more than once in one object; "
                               "keep one of them, with the value you mean") from None
        except (UnicodeDecodeError, TypeError):
            raise ProfileError(f"{source}: not a text file; a hardware profile is the JSON file ringflow doctor "
                               "--save writes") from None
        return cls.from_dict(data, source=source)

    def save(self, path: "str | os.PathLike") -> str:
        """Write :meth:`to_json` to ``path`` (replacing it whole: a reader never sees half a file).

        Returns:
            ``path`` as a string.

        Raises:
            OSError: the file cannot be written (the error names it).
        """
        return write_whole(path, self.to_json())


def _json_type(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number" if isinstance(value, (int, float)) else type(value).__name__)


def _require(obj: dict, names, prefix: str, source: str) -> None:
    missing = [n for n in names if n not in obj]
    if missing:
        raise ProfileError(f"{source}: missing field(s) {', '.join(prefix + n for n in missing)}; measure again with "
                           "ringflow doctor --save, or copy them from a built-in profile's to_json()")
    unknown = sorted(set(obj) - set(names))
    if unknown:
        # a key is the file's text: its control characters (a line break, an escape sequence) are
        # shown as escapes, not passed on to split the message or drive the terminal printing it
        shown = ", ".join(controls_escaped(prefix + n) for n in unknown)
        raise ProfileError(f"{source}: unknown field(s) {shown}; remove them (is a name misspelt?)")


def _real(value: Any, where: str, *, positive: bool, within: Optional[tuple] = None) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ProfileError(f"{where} must be a number, got {_json_type(value)} {value!r:.60}")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "more than 0" if positive else "0 or more"
        raise ProfileError(f"{where} must be a finite number {bound}, got {value!r}")
    if within is not None and not within[0] <= value <= within[1]:
        raise ProfileError(f"{where} must be from {within[0]:g} to {within[1]:g}, got {value!r}")
    return value


def _rate(value: Any, where: str) -> float:
    return _real(value, where, positive=True, within=_GBPS_RANGE)


def _whole(value: Any, where: str, *, least: int) -> int:
    if isinstance(value, float) and math.isinf(value):  # how the file's reader gives a number past a float's range
        bound = f"at most {_WHOLE_MAX}" if value > 0 else f"at least {least}"
        raise ProfileError(f"{where} must be {bound}, got a number past a float's range")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ProfileError(f"{where} must be a whole number, got {_json_type(value)} {value!r:.60}")
    if value < least:
        raise ProfileError(f"{where} must be at least {least}, got {value}")
    if value > _WHOLE_MAX:
        raise ProfileError(f"{where} must be at most {_WHOLE_MAX}, got {value:.3g}")
    return int(value)


def _curve(value: Any, where: str, x_name: str) -> tuple[tuple[int, float], ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise ProfileError(f"{where} must be a non-empty list of [{x_name}, GB/s] pairs, got {value!r:.60}")
    points = []
    for i, p in enumerate(value):
        if not isinstance(p, (list, tuple)) or len(p) != 2:
            raise ProfileError(f"{where}[{i}] must be a [{x_name}, GB/s] pair, got {p!r:.60}")
        x = _whole(p[0], f"{where}[{i}][0] ({x_name})", least=1)
        if points and x <= points[-1][0]:
            raise ProfileError(f"{where}: the {x_name} must rise from point to point, but point {i} has {x} after "
                               f"{points[-1][0]}")
        points.append((x, _rate(p[1], f"{where}[{i}][1] (GB/s)")))
    # Below its first point a curve is extrapolated: a smaller copy takes as long as the first
    # point's, fewer threads copy at its rate a thread. A first point far out made every copy on
    # the simulated GPU last so long in virtual time that simulating it took hours.
    x0, rate0 = points[0]
    if x_name == "bytes" and x0 / (rate0 * 1e9) > _SECONDS_MAX:
        raise ProfileError(f"{where}[0]: a copy of {x0} bytes at {rate0:g} GB/s takes {x0 / (rate0 * 1e9):.2g} s, "
                           f"and every smaller copy as long; give a first point that copies in at most "
                           f"{_SECONDS_MAX:g} s (a smaller size, or a higher rate)")
    if x_name == "threads" and rate0 / x0 < _GBPS_RANGE[0]:
        raise ProfileError(f"{where}[0]: {rate0:g} GB/s over {x0} threads is {rate0 / x0:.2g} GB/s a thread, the "
                           f"rate of each of fewer threads; give a first point of at least {_GBPS_RANGE[0]:g} GB/s "
                           "a thread (fewer threads, or a higher rate)")
    return tuple(points)


def _check_field(name: str, value: Any, where: str) -> Any:
    """``value`` checked for field ``name`` (and made the type the field holds); raises
    :class:`ProfileError` naming ``where``."""
    if name in _BYTE_CURVES:
        return _curve(value, where, "bytes")
    if name in _THREAD_CURVES:
        return _curve(value, where, "threads")
    if name in _RATES:
        return _rate(value, where)
    if name in _SECONDS:
        return _real(value, where, positive=False, within=(0.0, _SECONDS_MAX))
    if name in _COUNTS:
        return _whole(value, where, least=1)
    if name == "compute_capability":
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise ProfileError(f"{where} must be a [major, minor] pair, got {value!r:.60}")
        return (_whole(value[0], f"{where}[0]", least=0), _whole(value[1], f"{where}[1]", least=0))
    if name == "staging_GBps":
        return None if value is None else _curve(value, where, "threads")
    if name in _MEASURED_SECONDS:
        return None if value is None else _real(value, where, positive=True, within=(0.0, _SECONDS_MAX))
    if name == "chaos_spread":
        spread = _real(value, where, positive=False)
        if spread >= 1:
            raise ProfileError(f"{where} must be below 1 (a fraction of each duration), got {spread}")
        return spread
    if name == "pcie_link":
        if value is None:
            return None
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise ProfileError(f"{where} must be None or a (GT/s per lane, lanes) pair, got {value!r:.60}")
        rate, width = _real(value[0], f"{where} GTps", positive=True), _whole(value[1], f"{where} width", least=1)
        if rate > PCIE_GTPS_MAX:
            raise ProfileError(f"{where} GTps must be at most {PCIE_GTPS_MAX:g}, got {rate!r} (GT/s a lane; "
                               f"PCIe 7.0 runs {PCIE_GTPS_MAX:g})")
        if width not in PCIE_WIDTHS:
            raise ProfileError(f"{where} width must be one of {', '.join(map(str, PCIE_WIDTHS))} (lanes), got {width}")
        return rate, width
    if name == "name":
        if not isinstance(value, str) or not value.strip():
            raise ProfileError(f"{where} must be a non-empty string, got {value!r:.60}")
        return value
    if name in ("gpu_name", "driver"):
        if value is not None and not isinstance(value, str):
            raise ProfileError(f"{where} must be a string or null, got {_json_type(value)} {value!r:.60}")
        return value
    if name == "measured_at":
        if value is None:
            return None
        try:
            datetime.datetime.fromisoformat(value)
        except (TypeError, ValueError):
            raise ProfileError(f"{where} must be an ISO 8601 date such as 2026-12-01T09:30:00+00:00, "
                               f"got {value!r:.60}") from None
        return value
    raise ProfileError(f"{where}: no such field")  # a field added to the class without a check


def _interp_loglog(points: tuple[tuple[int, float], ...], x: float) -> float:
    xs = [p[0] for p in points]
    if x <= xs[0]:
        # below the first measured size the copy is latency-bound: time stays ~constant
        return points[0][1] * x / xs[0]
    if x >= xs[-1]:
        return points[-1][1]
    i = bisect.bisect_right(xs, x) - 1
    (x0, y0), (x1, y1) = points[i], points[i + 1]
    t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))


# -- built-in profiles ---------------------------------------------------------------------------------------------
H200_PCIE5 = HardwareProfile(
    name="h200-pcie5",
    h2d_curve=((64 * KiB, 2.5), (256 * KiB, 10.4), (1 * MiB, 26.8), (4 * MiB, 43.1), (16 * MiB, 49.4),
               (256 * MiB, 54.8)),
    d2h_curve=((64 * KiB, 2.5), (256 * KiB, 10.4), (1 * MiB, 26.8), (4 * MiB, 43.1), (16 * MiB, 49.4),
               (256 * MiB, 54.7)),
    duplex_GBps=98.4,
    pageable_h2d_GBps=15.9,
    pageable_d2h_GBps=11.3,
    device_GBps=4300.0,
    kernel_min_s=2.0e-6,
    launch_overhead_s=11.0e-6,
    copy_overhead_s=4.0e-6,
    event_overhead_s=1.0e-6,
    host_copy_GBps=((1, 10.0), (4, 21.0), (8, 31.4), (16, 41.1)),
    host_task_overhead_s=5.0e-6,
    register_GBps=GiB / 34e-3 / 1e9,
    register_fresh_GBps=GiB / 140e-3 / 1e9,
    unregister_GBps=GiB / 21e-3 / 1e9,
    first_touch_GBps=((1, GiB / 284e-3 / 1e9), (16, GiB / 34e-3 / 1e9)),
    async_engine_count=3,
    sm_count=132,
    compute_capability=(9, 0),
    total_memory=141 * 10**9,
    pcie_link=(32.0, 16),  # PCIe Gen5 x16
    # (threads, GB/s): the H200 host's own curve, measured by ringflow doctor --save on it
    staging_GBps=((1, 2.76), (2, 5.13), (4, 9.09), (8, 12.4), (16, 16.9)),
)

# How much longer a host-side call takes on the host a Gen4 GPU sits in (see pcie4_x16).
GEN4_HOST_CALL_FACTOR = 1.25


def pcie4_x16(base: HardwareProfile = H200_PCIE5) -> HardwareProfile:
    """``base`` (a Gen5 x16 profile) behind a PCIe Gen4 x16 link, on the host such a GPU sits in.

    Assumptions:

    * The link: Gen4 moves half of Gen5's bytes per second per lane with the same encoding, so a
      pinned copy of any size, in either direction, runs at half ``base``'s bandwidth (the
      by-size curves halved point by point), and both directions at once at half its duplex
      rate.
    * Pageable copies: the driver stages them through its own pinned buffer, a host pass in
      series with the link, so the host's share of ``base``'s pageable time is kept and the
      link's share doubled.
    * Host-side calls: a Gen4 host's CPU is a generation older, so enqueueing a kernel or a copy,
      recording or querying an event, and scheduling a host task each take
      :data:`GEN4_HOST_CALL_FACTOR` times ``base``'s time.
    * Unchanged: the GPU (its memory bandwidth, shortest kernel, copy engines, SMs, memory) and
      the host's memory rates (memcpy by threads, registration, first touch, staging in and out
      at once), which depend on the memory system rather than the link.

    Returns:
        the profile, named ``pcie4-x16``, with ``pcie_link`` (16.0 GT/s, 16 lanes).
    """
    def halve(curve):
        return tuple((n, rate / 2) for n, rate in curve)

    def pageable(rate: float, link: float) -> float:
        host_s_per_byte = 1 / rate - 1 / link  # what the link leaves of base's pageable time
        return 1 / (host_s_per_byte + 2 / link)

    slower = GEN4_HOST_CALL_FACTOR
    return dataclasses.replace(
        base, name="pcie4-x16", h2d_curve=halve(base.h2d_curve), d2h_curve=halve(base.d2h_curve),
        duplex_GBps=base.duplex_GBps / 2,
        pageable_h2d_GBps=pageable(base.pageable_h2d_GBps, base.h2d_curve[-1][1]),
        pageable_d2h_GBps=pageable(base.pageable_d2h_GBps, base.d2h_curve[-1][1]),
        launch_overhead_s=base.launch_overhead_s * slower, copy_overhead_s=base.copy_overhead_s * slower,
        event_overhead_s=base.event_overhead_s * slower, host_task_overhead_s=base.host_task_overhead_s * slower,
        pcie_link=(16.0, 16), gpu_name=None, driver=None, measured_at=None)


PCIE4_X16 = pcie4_x16()

# A small, round-numbered profile for tests whose expected values are computed by hand:
# 1 GB/s copies of any size, 2 GB/s when both directions run, no launch, copy, event or host-task
# overheads. It has no measured host time per chunk, so the planner charges each engine its built-in
# fit, and the simulated GPU's staged whole-array jobs the scheduler's (_plan.host_seconds_per_chunk).
UNIT_TEST = HardwareProfile(
    name="unit",
    h2d_curve=((1, 1.0), (1 << 40, 1.0)),
    d2h_curve=((1, 1.0), (1 << 40, 1.0)),
    duplex_GBps=2.0,
    pageable_h2d_GBps=0.5,
    pageable_d2h_GBps=0.5,
    device_GBps=10.0,
    kernel_min_s=0.0,
    launch_overhead_s=0.0,
    copy_overhead_s=0.0,
    event_overhead_s=0.0,
    host_copy_GBps=((1, 1.0), (2, 2.0), (4, 4.0), (8, 8.0), (16, 16.0)),
    host_task_overhead_s=0.0,
    register_GBps=1.0,
    register_fresh_GBps=0.5,
    unregister_GBps=1.0,
    first_touch_GBps=((1, 1.0), (16, 16.0)),
    async_engine_count=2,
    sm_count=1,
    compute_capability=(0, 0),
    total_memory=1 << 34,
    chaos_spread=0.25,
)

PROFILES: dict[str, HardwareProfile] = {p.name: p for p in (H200_PCIE5, PCIE4_X16, UNIT_TEST)}
DEFAULT_PROFILE = "h200-pcie5"


# -- files -------------------------------------------------------------------------------------------------------------
# by real path: (the file's version, profile) of the version last read (one a file: a profile
# rewritten again and again is not kept version after version)
_loaded: dict[str, tuple[tuple[int, int, int, int, int], HardwareProfile]] = {}
_MAX_FILE_BYTES = 1 << 20  # a profile is a few kilobytes: anything this large is some other file
_loaded_lock = threading.Lock()


def _file_version(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """What tells one version of a file from another, from its ``os.stat``: device, inode,
    modification and change times (ns) and size. The inode tells apart a file saved over the old
    one (as :meth:`HardwareProfile.save` does) with the same size and modification time, which a
    coarse clock or a copy that keeps the time (``cp -p``) gives; the change time, which no one
    can set back, a file rewritten in place with its size and modification time kept (``cp -p``
    onto an existing file)."""
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size


def save_profile(profile: HardwareProfile, path: "str | os.PathLike") -> str:
    """Write ``profile`` as JSON to ``path``; see :meth:`HardwareProfile.save`."""
    if not isinstance(profile, HardwareProfile):
        raise TypeError(f"save_profile(profile): expected a HardwareProfile, got {type(profile).__name__}")
    return profile.save(path)


def load_profile(path: "str | os.PathLike") -> HardwareProfile:
    """The profile in the JSON file at ``path`` (as ``ringflow doctor --save`` writes it).

    A file is read once while it keeps its device, inode, size and modification time.

    Raises:
        ProfileError: the file is missing, a folder, not JSON or not a valid profile (the
            message names the file and, for a bad field, the field).
        TypeError: ``path`` is not a file name (a str, bytes or os.PathLike).
    """
    check_file_name(path, "load_profile")
    path = os.fspath(path)
    try:
        st = os.stat(path)
    except (OSError, ValueError) as exc:  # a ValueError: a NUL byte in the name
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__
        raise ProfileError(f"hardware profile {path!r}: cannot read it ({reason}); "
                           "give the path of a profile JSON (ringflow doctor --save writes one) or a name: "
                           f"{', '.join(sorted(PROFILES))}") from None
    real, version = os.path.realpath(path), _file_version(st)
    with _loaded_lock:
        hit = _loaded.get(real)
    if hit is not None and hit[0] == version:
        return hit[1]
    if os.path.isdir(path):
        raise ProfileError(f"hardware profile {path!r} is a folder; give a profile JSON file inside it")
    if is_special(path):
        raise ProfileError(f"hardware profile {path!r} is not a regular file; give the JSON file ringflow "
                           "doctor --save writes")
    if st.st_size > _MAX_FILE_BYTES:
        raise ProfileError(f"hardware profile {path!r} is {st.st_size} bytes, too large for a profile (a few "
                           "kilobytes); give the JSON file ringflow doctor --save writes")
    try:
        with open(path, "rb") as fh:
            raw = fh.read(_MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ProfileError(f"hardware profile {path!r}: cannot read it ({exc.strerror or type(exc).__name__})") from None
    try:
        text = raw.decode(jsontext.ENCODING)
    except UnicodeDecodeError:
        raise ProfileError(f"hardware profile {path!r}: not a text file; a hardware profile is the JSON file "
                           "ringflow doctor --save writes") from None
    profile = HardwareProfile._from_text(text, source=f"hardware profile {path!r}", decoded_file=True)
    with _loaded_lock:
        _loaded[real] = (version, profile)
    return profile


def looks_like_path(text: str) -> bool:
    """Whether ``text``, which names no built-in profile, is meant as a file: it holds a path
    separator, ends in ``.json``, starts with ``~`` or names an existing file."""
    return (os.sep in text or (os.altsep is not None and os.altsep in text) or text.lower().endswith(".json")
            or text.startswith("~") or os.path.isfile(text))


def get_profile(profile: "str | os.PathLike | HardwareProfile") -> HardwareProfile:
    """The hardware profile that ``profile`` names.

    Args:
        profile: a :class:`HardwareProfile` (returned as is), the name of a built-in profile
            (:data:`PROFILES`), or the path of a profile JSON file (a ``str`` that contains a
            path separator, ends in ``.json`` or names an existing file, or an ``os.PathLike``).

    Raises:
        ValueError: an unknown name (the message lists the names); :class:`ProfileError` (a
            ValueError) for a file that cannot be read or is not a valid profile.
        TypeError: ``profile`` is none of these.
    """
    if isinstance(profile, HardwareProfile):
        return profile
    if isinstance(profile, str):
        hit = PROFILES.get(profile)
        if hit is not None:
            return hit
        if looks_like_path(profile):
            return load_profile(os.path.expanduser(profile))
        raise ValueError(f"unknown sim profile {profile!r}; choose one of {sorted(PROFILES)}, pass a HardwareProfile, "
                         "or give the path of a profile JSON file (ringflow doctor --save writes one)")
    if isinstance(profile, os.PathLike):
        return load_profile(profile)
    raise TypeError(f"profile must be a profile name ({', '.join(sorted(PROFILES))}), a HardwareProfile or the path "
                    f"of a profile JSON file, got {type(profile).__name__}")


# -- the per-GPU cache -------------------------------------------------------------------------------------------------
def cache_dir() -> str:
    """Where measured profiles are cached: ``$XDG_CACHE_HOME/ringflow/profiles``, or
    ``~/.cache/ringflow/profiles`` when ``XDG_CACHE_HOME`` is unset or not an absolute path."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ringflow", "profiles")


def slug(text: str) -> str:
    """``text`` in lower case with every run of characters other than letters, digits and dots
    made one ``-`` ("NVIDIA H200" -> "nvidia-h200")."""
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-.") or "unknown"


def cached_profile_path(gpu_name: str, driver: "str | None") -> str:
    """The cache file of the profile measured on a ``gpu_name`` GPU under driver ``driver``:
    ``<cache_dir()>/<slug(gpu_name)>-<slug(driver)>.json``."""
    return os.path.join(cache_dir(), f"{slug(gpu_name)}-{slug(driver or 'unknown-driver')}.json")


@functools.lru_cache(maxsize=1)
def gpu_driver_version() -> "str | None":
    """The GPU driver's version ("580.159.03" from NVML; the CUDA driver API version, "cuda-13.0",
    where NVML is missing), or None without a driver. Never raises."""
    try:
        from cuda.core import system

        return ".".join(map(str, system.get_kernel_mode_driver_version()))
    except Exception:  # noqa: BLE001 - NVML missing: the driver API's version instead
        pass
    try:
        from cuda.bindings import driver

        err, v = driver.cuDriverGetVersion()
        if int(err) == 0:
            return f"cuda-{v // 1000}.{v % 1000 // 10}"
    except Exception:  # noqa: BLE001 - no driver here
        pass
    return None


def _check_measured_on(profile: HardwareProfile, path: str, gpu_name: str, driver: "str | None") -> None:
    """Check that ``profile``, read from the cache file ``path``, was measured on the GPU asked
    for: a GPU name or driver it records must be ``gpu_name`` or ``driver`` (one it leaves out,
    as a model does, is not checked).

    Raises:
        ProfileError: it records another GPU or driver (the message names the file and both).
    """
    if profile.gpu_name in (None, gpu_name) and profile.driver in (None, driver):
        return

    def machine(name: "str | None", drv: "str | None") -> str:
        return f"{name or 'a GPU it does not name'}" + (f" (driver {drv})" if drv else "")

    raise ProfileError(f"hardware profile {path!r} was measured on {machine(profile.gpu_name, profile.driver)}, "
                       f"not on the {machine(gpu_name, driver)} it is cached for")


_for_gpu: dict[tuple, tuple] = {}  # (gpu, driver, path) -> (file state, profile): one lookup per file version
_for_gpu_lock = threading.Lock()


def profile_for_gpu(gpu_name: str, driver: "str | None" = None, *, device: Any = None) -> HardwareProfile:
    """The hardware model of a real GPU: the profile cached for its model and driver.

    Looks for :func:`cached_profile_path` (``ringflow doctor --save`` writes it). When there is
    none: with ``RINGFLOW_CALIBRATE=1`` in the environment and ``device`` given, that device is
    measured now (seconds of copies and host work, once per GPU model and driver) and the profile
    saved there; otherwise the ``h200-pcie5`` profile, with one note on the ``"ringflow"``
    logger. A cached file that cannot be used (not a valid profile, or one that records another
    GPU model, or another driver, than the one asked for) is logged as a warning, once while the
    file is unchanged, and ``h200-pcie5`` used; so is a folder, device, pipe or socket at that
    path, which the warning says to remove (``ringflow doctor --save`` cannot write over it), and a
    path that cannot be looked at (a symbolic link that leads to no file or loops), which is
    neither measured over nor taken for a missing profile.

    Args:
        gpu_name: the GPU's name as CUDA reports it ("NVIDIA H200").
        driver: its driver version; None reads :func:`gpu_driver_version`.
        device: the CUDA device to measure when calibrating on first use.

    Returns:
        the profile (the same object while the file is unchanged).
    """
    driver = gpu_driver_version() if driver is None else driver
    path = cached_profile_path(gpu_name, driver)
    unreadable: "OSError | None" = None
    try:
        st: "os.stat_result | None" = os.stat(path)
    except OSError as exc:
        st, unreadable = None, exc
    # state None: nothing there. A symbolic link that leads to no file or loops, or a path this
    # user cannot look into, is not that: it is the user's, not to be measured over or called missing
    state: "tuple | None" = None if st is None else _file_version(st)
    if unreadable is not None:
        try:
            link: "tuple | None" = _file_version(os.lstat(path))
        except OSError:
            link = None
        if link is not None or unreadable.errno not in (errno.ENOENT, errno.ENOTDIR):
            state = ("unreadable", unreadable.errno, link)
    key = (gpu_name, driver, path)
    with _for_gpu_lock:
        seen = _for_gpu.get(key)
        if seen is not None and seen[0] == state:
            return seen[1]
        if unreadable is not None and state is not None:
            reason = unreadable.strerror or type(unreadable).__name__
            logger.warning("ringflow: the cached hardware profile %r: cannot read it (%s); planning with the "
                           "h200-pcie5 profile. To plan with this GPU's own figures, mend or remove it (a symbolic "
                           "link that leads to no file, or loops), then run `ringflow doctor --save` on this GPU",
                           path, reason)
            _for_gpu[key] = (state, H200_PCIE5)
            return H200_PCIE5
        if state is None and device is not None and os.environ.get(CALIBRATE_VAR, "").strip() == "1":
            from .._doctor import calibrate

            logger.info("ringflow: no hardware profile cached for %s (driver %s); measuring one now "
                        "(%s=1)", gpu_name, driver, CALIBRATE_VAR)
            try:
                profile = calibrate(device, path)
                _for_gpu[key] = (_file_version(os.stat(path)), profile)
                return profile
            except Exception as exc:  # noqa: BLE001 - a failed measurement must not fail the caller's job
                logger.warning("ringflow: measuring %s's hardware profile failed (%s: %s); planning with the "
                               "h200-pcie5 profile", gpu_name, type(exc).__name__, exc)
                _for_gpu[key] = (state, H200_PCIE5)
                return H200_PCIE5
        if state is None:
            logger.info("ringflow: no hardware profile cached for %s (driver %s) at %s; planning with the "
                        "h200-pcie5 profile. Run `ringflow doctor --save` once on this machine (or set %s=1) "
                        "to plan with this GPU's own figures", gpu_name, driver, path, CALIBRATE_VAR)
            profile = H200_PCIE5
        elif not stat.S_ISREG(st.st_mode):
            # doctor --save replaces a file, and cannot replace a folder or a pipe: the advice for
            # a bad file (measure again, or delete it) would leave this warning on every run
            what = "a folder" if stat.S_ISDIR(st.st_mode) else "a device, pipe or socket"
            logger.warning("ringflow: the cached hardware profile %r is not a file but %s, which `ringflow doctor "
                           "--save` cannot write over; planning with the h200-pcie5 profile. To plan with this GPU's "
                           "own figures, remove it, then run `ringflow doctor --save` on this GPU", path, what)
            profile = H200_PCIE5
        else:
            try:
                profile = load_profile(path)
                _check_measured_on(profile, path, gpu_name, driver)
            except ProfileError as exc:
                logger.warning("ringflow: %s; planning with the h200-pcie5 profile. Run `ringflow doctor --save` "
                               "on this GPU to measure it again, or delete that file", exc)
                profile = H200_PCIE5
        _for_gpu[key] = (state, profile)
        return profile
