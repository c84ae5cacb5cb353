"""How big a pipeline's rings are and how many CPU workers it gets: given by the caller, or
planned from the device's hardware model (:mod:`ringflow._plan`)."""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable, Optional

from .. import _plan as plan
from .._device import host_pool
from .._device.protocol import Device
from .._plan import SlotCounts
from .stages import sim_seconds_for

DEFAULT_CHUNK_BYTES = 8 << 20

# Note (why host="auto" has a default bound): registering pins a whole array, and a MapJob keeps
# it pinned for the job's life, where staging pins only its rings. Pinned pages cannot be paged
# out or moved, so a process that pins most of the host's memory leaves the rest of the system to
# the out-of-memory killer. An explicit host="register" pins what it is told; host="auto" is
# the library's own choice, so without a pinned_budget it registers at most a quarter of
# physical memory for one call or job on one device, and stages larger arrays.


# Host-in slots per CPU worker for a user's prepare, and the pinned bytes they may take. One slot
# per worker and one more left the workers idle whenever a slow item held back the ones after it
# (docs/design.md, "CPU workers", has the measurement).
PREPARE_SLOTS_PER_WORKER = 2
PREPARE_SLOTS_PINNED_CAP = 512 << 20


def resolve_slots(device: Device, slots, chunk_bytes: int, inplace: bool, workers: int, compute: Callable,
                  external=(False, False), bulk: bool = False, max_chunks: Optional[int] = None,
                  user_prepare: bool = False, out_bytes: Optional[int] = None) -> SlotCounts:
    """The slot counts: given, or planned (:func:`planned_slots`) for the device's hardware model and
    the compute's cost (its ``sim_seconds`` for a chunk of ``chunk_bytes``). ``slots`` given as
    counts are kept as they are, even above ``max_chunks``. ``out_bytes``: a chunk's result
    bytes, where the caller knows them (None: as many as its input's, ``chunk_bytes``).

    Raises:
        TypeError: ``slots`` is not None, an int or a SlotCounts.
    """
    if isinstance(slots, SlotCounts):
        return slots
    if isinstance(slots, bool):
        raise TypeError("slots must be None, an int or a SlotCounts")
    if isinstance(slots, int):
        return SlotCounts(slots, slots, 0 if inplace else slots, slots)
    if slots is not None:
        raise TypeError(f"slots must be None, an int or a SlotCounts, got {type(slots).__name__}")
    guess = sim_seconds_for(getattr(compute, "sim_seconds", None), chunk_bytes)
    return planned_slots(device.hardware, chunk_bytes, inplace, workers, guess, external=external, bulk=bulk,
                         max_chunks=max_chunks, user_prepare=user_prepare, out_bytes=out_bytes)


def planned_slots(profile: "str | plan.HardwareProfile", chunk_bytes: int, inplace: bool, workers: int,
                  compute_s: Optional[float], external=(False, False), bulk: bool = False,
                  max_chunks: Optional[int] = None, user_prepare: bool = False,
                  out_bytes: Optional[int] = None) -> SlotCounts:
    """The slot counts a pipeline plans from modelled stage times on ``profile`` (device rings
    with slack), for chunks of ``chunk_bytes`` in whose results are ``out_bytes`` (None: as
    many as the input's), and a kernel of ``compute_s`` seconds a chunk (None: unknown). The
    copy in and prepare are modelled at the input's bytes, the copy back and consume at the
    result's. The pinned caps below count each host slot at its stride as the scheduler allocates
    it in slots of the larger of the two: a host-in slot at the input's bytes
    (:func:`plan.host_in_slot`; in place, ``inplace``, at the larger), a host-out slot at the
    result's (:func:`plan.host_out_slot`).
    ``bulk`` (a whole array, stream_map): staging rings also get a slot per worker, for
    throughput; a stream of requests keeps the planned rings, whose shorter queues keep
    latency down. A job of known length (``max_chunks``, a whole array) never gets more slots in a
    ring than it has chunks. ``user_prepare``: the items go through the
    caller's ``prepare``, whose cost the model cannot know and which varies from item to item:
    the host-in ring gets two slots per worker (:data:`PREPARE_SLOTS_PER_WORKER`), so a worker
    starts its next item while its last one waits its turn behind a slower one (results go out
    in order), as a DataLoader's ``prefetch_factor=2`` does; at most
    :data:`PREPARE_SLOTS_PINNED_CAP` bytes of host-in slots, never fewer than two."""
    if out_bytes is not None:  # a result of no bytes is modelled as one: the copy model's rates are per size
        out_bytes = max(1, out_bytes)
    slot = max(chunk_bytes, out_bytes or 0)
    times = plan.model_stage_times(profile, chunk_bytes, compute=compute_s, workers=workers, out_bytes=out_bytes)
    if compute_s is None:  # unknown compute: plan for one as long as a copy (a balanced pipeline)
        times = dataclasses.replace(times, compute=max(times.compute, times.h2d))
    # the caller's pinned memory: prepare and consume only describe the chunk
    overhead = plan.get_profile(profile).host_task_overhead_s
    if external[0]:
        times = dataclasses.replace(times, prepare=overhead)
    if external[1]:
        times = dataclasses.replace(times, consume=overhead)
    counts = plan.with_device_slack(plan.plan_slots(times, inplace=inplace).slots, inplace=inplace)
    in_slot = plan.host_in_slot(slot, chunk_bytes, inplace)[1]
    if bulk and not external[0] and not external[1]:  # both host rings are staging rings
        # with_worker_slots caps a pair of slots of its chunk_bytes: the mean of the two strides
        pair = in_slot + plan.host_out_slot(slot, out_bytes)[1]
        counts = plan.with_worker_slots(counts, workers, -(-pair // 2), profile)
    if user_prepare:
        floor = min(PREPARE_SLOTS_PER_WORKER * workers, max(2, PREPARE_SLOTS_PINNED_CAP // in_slot))
        counts = dataclasses.replace(counts, host_in=max(counts.host_in, floor))
    if max_chunks is not None:
        counts = plan.cap_slots(counts, max_chunks)
    return counts


# Device slots added for results delivered on the device: the consumer holds one while its step
# runs and the next is being computed, beyond what the plan counted for the d2h it replaces.
LENT_SLACK = 2


def lent_slots(counts: SlotCounts, inplace: bool) -> SlotCounts:
    """Planned slots for results delivered on the device (``deliver="device"``): the ring the
    compute writes gets :data:`LENT_SLACK` slots more (the consumer holds results while it
    works), and the unused host-out ring one slot."""
    if inplace:
        return dataclasses.replace(counts, device_in=counts.device_in + LENT_SLACK, host_out=1)
    return dataclasses.replace(counts, device_out=counts.device_out + LENT_SLACK, host_out=1)


def fit_pinned_budget(counts: SlotCounts, chunk_bytes: int, budget: int, *, explicit: bool,
                      out_bytes: Optional[int] = None, in_bytes: Optional[int] = None,
                      inplace: bool = False) -> SlotCounts:
    """Slot counts whose pinned rings (host-in + host-out) fit ``budget`` bytes, each slot
    counted at its stride as the scheduler allocates it: a host-in slot for inputs of
    ``in_bytes`` known up front (None: not known, or ``inplace``: a chunk's bytes;
    :func:`plan.host_in_slot`), a host-out slot for results of ``out_bytes`` (None: not known,
    a chunk's bytes; :func:`plan.host_out_slot`).

    Planned counts shrink, the larger ring first (the pipeline then runs below its bottleneck
    rate, never above its memory); counts the caller gave explicitly are refused instead.

    Raises:
        ValueError: explicit counts that do not fit, or a budget below one slot each way.
    """
    in_slot = plan.host_in_slot(chunk_bytes, in_bytes, inplace)[1]
    out_slot = plan.host_out_slot(chunk_bytes, out_bytes)[1]

    def pinned(c: SlotCounts) -> int:
        return c.host_in * in_slot + c.host_out * out_slot

    if pinned(counts) <= budget:
        return counts
    if explicit or in_slot + out_slot > budget:
        sizes = (f"slots of {in_slot} bytes" if out_slot == in_slot else
                 f"slots of {in_slot} and {out_slot} bytes")
        raise ValueError(f"the pinned rings need {pinned(counts)} bytes ({counts.host_in} host-in + {counts.host_out} "
                         f"host-out {sizes}) but pinned_budget is {budget}; raise pinned_budget, "
                         "lower chunk_bytes, or give fewer slots")
    while pinned(counts) > budget:
        ring = "host_in" if counts.host_in >= counts.host_out else "host_out"
        counts = counts.minus(ring)
    return counts


@functools.lru_cache(maxsize=1)
def host_cpus() -> int:
    """The host's CPUs, asked of the system once: every whole-array call plans its workers, and
    ``os.cpu_count`` reads the system each time."""
    return os.cpu_count() or 2


def default_workers(dev: Device, bulk: bool = True) -> int:
    """CPU workers for prepare/consume (see docs/design.md, "CPU workers", for the measurements).

    A whole-array job (``bulk``) splits one large copy over many chunks at once and staging
    copies release the GIL, so it gets a worker per core but one (left to the thread that
    enqueues). A stream of requests has only a few chunks in its CPU stages at a time, and every
    busy worker competes for the GIL at each hand-off, so it gets at most 4."""
    if dev.backend == "sim":
        return 4
    cores = max(1, min(16, host_cpus() - 1))
    return cores if bulk else min(4, cores)


# -- copy groups (the direct engine) ----------------------------------------------------------------
COPY_RATE_SHARE = 0.75  # a copy this share of the profile's best rate is big enough to move alone
# the first group's copy in and the last one's copy out overlap nothing else: with this many
# groups at least, they are a small part of the job
MIN_COPY_GROUPS = 16
RING_GROUPS = 4  # a planned ring holds a group copying in, one computing, one copying out, and slack
GROUP_COMPUTE_STREAMS = 4  # planned compute streams for grouped chunks, at most


def copy_group(profile: "str | plan.HardwareProfile", chunk_bytes: int, n_chunks: int, slots: SlotCounts, *,
               planned: bool, inplace: bool, out_bytes: Optional[int] = None) -> tuple[int, SlotCounts]:
    """How many consecutive chunks the direct engine moves with one copy each way, and the device
    rings that allows. Every copy costs the copy engine a fixed time, which the hardware
    profile's copy curve shows as a lower rate for small copies: chunks are grouped up to the
    smallest copy the curve moves at :data:`COPY_RATE_SHARE` of its best rate, leaving at least
    :data:`MIN_COPY_GROUPS` groups. A group's slots follow one another in the ring, so a ring
    holds a whole number of groups: ``planned`` rings grow to :data:`RING_GROUPS` groups, with
    fewer chunks a group where those rings would not fit the profile's ``total_memory`` (no
    group: the rings as planned); given rings keep their size and the group shrinks until two
    fit. ``profile``: the device's hardware model (``Device.hardware``). A device-in slot holds
    a chunk's ``chunk_bytes``, a device-out slot its result's ``out_bytes`` (None: as many), as
    the direct engine allocates them; the group is sized by the larger of the two copies."""
    profile = plan.get_profile(profile)
    out_bytes = chunk_bytes if out_bytes is None or inplace else out_bytes  # (in place: the result is the input)
    curve = profile.h2d_curve
    best = profile.copy_GBps("h2d", curve[-1][0])
    enough = next((size for size, _ in curve if profile.copy_GBps("h2d", size) >= COPY_RATE_SHARE * best),
                  curve[-1][0])
    # (a planned ring grows to RING_GROUPS groups, which must stay within a SlotCounts' range)
    group = min(max(1, enough // max(1, chunk_bytes, out_bytes)), -(-n_chunks // MIN_COPY_GROUPS),
                plan.MAX_SLOTS // RING_GROUPS)
    if group <= 1:
        return 1, slots
    rings = [slots.device_in] + ([] if inplace else [slots.device_out])
    if planned:
        # the grown rings must fit the device's memory, as the planned ones do (choose_chunk_bytes):
        # where they would not, fewer chunks a group
        while True:
            grown = [-(-max(n, RING_GROUPS * group) // group) * group for n in rings]
            need = grown[0] * chunk_bytes + (slots.device_out * chunk_bytes if inplace else grown[1] * out_bytes)
            if need <= profile.total_memory:
                break
            group -= 1
            if group <= 1:
                return 1, slots
        return group, dataclasses.replace(slots, device_in=grown[0],
                                          device_out=slots.device_out if inplace else grown[1])
    while group > 1 and any(n % group or n < 2 * group for n in rings):
        group -= 1
    return group, slots


def compute_streams_for(given: Optional[int], group: int, bound: Optional[bool] = None) -> int:
    """The direct engine's compute streams: ``given``, or planned (None): for chunks moved in
    copy groups one per chunk of a group up to :data:`GROUP_COMPUTE_STREAMS` (a group's chunks
    arrive together, and their kernels are short: on one stream each would wait for the one
    before it, with the GPU mostly idle); for a compute-bound job (``bound``, see
    :func:`is_compute_bound`) :data:`COMPUTE_BOUND_STREAMS`; else one."""
    if given is not None:
        return given
    if group > 1:
        return min(GROUP_COMPUTE_STREAMS, group)
    return COMPUTE_BOUND_STREAMS if bound else 1


# -- compute-bound jobs -----------------------------------------------------------------------------
# See docs/design.md, "Compute-bound jobs", for the measurements behind these.
COMPUTE_BOUND_SHARE = 2.0  # a kernel this many times its chunk's longer copy makes a job compute-bound
# Kernels of a compute-bound job get this many streams: the next chunk's kernel fills the SMs that
# the last wave of the one before leaves idle. More streams share the GPU among more kernels at
# once, so each finishes later and the copy out behind it waits: two buy what four do.
COMPUTE_BOUND_STREAMS = 2
TAPER_MIN_BYTES = 512 << 10  # a compute-bound job's first and last chunks, at least
TAPER_STEPS = 4  # halvings of the chunk at each end, at most


def is_compute_bound(kernel_s: float, h2d_s: float, d2h_s: float) -> bool:
    """Whether a chunk's kernel takes :data:`COMPUTE_BOUND_SHARE` times its longer copy or more
    (all in seconds): the copies then wait for the kernels, never the other way round."""
    return kernel_s >= COMPUTE_BOUND_SHARE * max(h2d_s, d2h_s)


def planned_compute_bound(device: Device, compute: Callable, in_bytes: int, out_bytes: int) -> Optional[bool]:
    """:func:`is_compute_bound` for a chunk of ``in_bytes`` in and ``out_bytes`` out, its copies
    from the device's hardware model and its kernel from the compute's cost (its ``sim_seconds``
    attribute); None when that cost is unknown (the direct engine then measures it)."""
    kernel = sim_seconds_for(getattr(compute, "sim_seconds", None), in_bytes)
    if kernel is None:
        return None
    return is_compute_bound(kernel, *_copy_seconds(device.hardware, in_bytes, out_bytes))


def fixed_cost(compute: Callable, nbytes: int, shortest: int) -> bool:
    """Whether the compute declares one kernel time for chunks from ``shortest`` bytes (the
    shortest chunk a :func:`taper` would make) to ``nbytes``: its ``sim_seconds`` is a number, or
    a function of a chunk's bytes that returns the same seconds at both sizes (a cost that does
    not fall as a chunk grows is then the same for every chunk between). False without a cost,
    where ``shortest`` is not below ``nbytes`` (no shorter chunk to compare), and where the
    function raises or returns no valid seconds at either size (the job's own reads of it report
    that). A function is called at most twice; an interrupt it raises propagates."""
    cost = getattr(compute, "sim_seconds", None)
    if cost is None or not callable(cost):
        return cost is not None
    if not 0 < shortest < nbytes:
        return False
    try:
        return sim_seconds_for(cost, nbytes) == sim_seconds_for(cost, shortest)
    except ValueError:  # (sim_seconds_for's: the function raised, or gave no seconds)
        return False


# (id(profile), in bytes, out bytes) -> (profile, h2d s, d2h s): every stream_map call plans its
# layout, and the copy model's curve lookups cost more than the rest of that plan
_COPY_SECONDS: dict = {}
_COPY_SECONDS_MAX = 256


def _copy_seconds(profile, in_bytes: int, out_bytes: int) -> tuple[float, float]:
    """The modelled H2D and D2H times (seconds) of a chunk of ``in_bytes`` in and ``out_bytes``
    out on ``profile``, remembered per profile object and sizes."""
    key = (id(profile), in_bytes, out_bytes)
    hit = _COPY_SECONDS.get(key)
    if hit is None or hit[0] is not profile:  # a new profile may reuse a collected one's id
        times = plan.model_stage_times(profile, in_bytes, out_bytes=out_bytes)
        if len(_COPY_SECONDS) >= _COPY_SECONDS_MAX:
            _COPY_SECONDS.clear()
        hit = _COPY_SECONDS[key] = (profile, times.h2d, times.d2h)
    return hit[1], hit[2]


def taper(rows: int, row_bytes: int, *, kernel_s: Optional[float] = None,
          kernel_min_s: float = 0.0) -> tuple[int, ...]:
    """The rows of a compute-bound job's first chunks, ascending (its last ones mirror them):
    ``rows`` halved up to :data:`TAPER_STEPS` times, none below :data:`TAPER_MIN_BYTES`; empty
    when no halving fits. With ``kernel_s`` (the seconds a chunk of ``rows`` takes to compute),
    none whose kernel, in proportion to its rows, would take less than ``kernel_min_s`` (the
    profile's shortest kernel): a kernel at that floor takes no less for fewer bytes, so such a
    chunk would shorten nothing and add a kernel of the floor's length.

    Why: a compute-bound job's kernels cannot start before the first chunk is in, nor can the
    last result leave before the last kernel ends; those two copies and the last kernel overlap
    nothing else. Short chunks at the ends shorten them; whole chunks between keep the
    per-chunk costs of the rest as they were. A compute whose declared cost is one time for a
    chunk and for the taper's shortest chunk (:func:`fixed_cost`) is not tapered at all: no shorter
    chunk has a shorter kernel."""
    head = []
    r = rows // 2
    while (len(head) < TAPER_STEPS and r >= 1 and r * row_bytes >= TAPER_MIN_BYTES
           and (kernel_s is None or r * kernel_s >= rows * kernel_min_s)):
        head.append(r)
        r //= 2
    return tuple(head[::-1])


def chunk_sizes(length: int, rows: int, head: tuple[int, ...] = ()) -> list[int]:
    """Rows per chunk for ``length`` rows in chunks of ``rows``: the ``head`` chunks first and
    the same in reverse last (a :func:`taper`), whole chunks between, the one short chunk (if
    any) last of those; without a taper, or where one would leave no whole chunk, chunks of
    ``rows`` with the last one short."""
    if not head or length < 2 * sum(head) + rows:
        return [rows] * (length // rows) + ([length % rows] if length % rows else [])
    middle = length - 2 * sum(head)
    return [*head, *[rows] * (middle // rows), *([middle % rows] if middle % rows else []), *head[::-1]]


def default_register_budget() -> int:
    """The most bytes ``host="auto"`` registers for one call or job on one device where no
    ``pinned_budget`` is given: a quarter of the host's physical memory (4 GiB where the system
    does not say how much it has)."""
    return host_pool.quarter_of_memory()


def register_budget(options: dict) -> int:
    """The most bytes ``host="auto"`` registers for a call or job of ``options``: its
    ``pinned_budget``, else :func:`default_register_budget`."""
    budget = options.get("pinned_budget")
    return default_register_budget() if budget is None else budget
