"""Buffer counts from lifetimes, the ideal bound, and the stage-time model.

A ring needs as many slots as chunks are alive in it at once when the pipeline runs at its
bottleneck interval ``T`` (Little's law): ``ceil(lifetime / T)``. A slot's lifetime runs from
the latest moment it must be taken, so that the stage it feeds is not delayed, to the moment
the CPU sees its last operation complete:

==============  =============================================  ============================
ring            taken when                                       free when
==============  =============================================  ============================
host-in         prepare starts                                   its H2D completes
device-in       its H2D is enqueued                              compute completes
device-out      compute must be enqueued (by its H2D's end)      its D2H completes
host-out        D2H must be enqueued (by compute's end)          the consumer returns
device in-place its H2D is enqueued                              its D2H completes
==============  =============================================  ============================

so ``host_in = P + H``, ``device_in = H + C``, ``device_out = C + D``, ``host_out = D + K``
(in place: ``H + C + D``), each plus the hand-off latency of the host noticing a completion.
``T`` is the slowest stage, where the CPU stages share a pool of ``workers`` threads so they
contribute ``(P + K) / workers``. Double buffering is not assumed: two slots suffice only when
a lifetime spans at most two intervals.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

from ._checks import check_count
from ._device.hardware import HardwareProfile, get_profile

STAGES = ("prepare", "h2d", "compute", "d2h", "consume")

# The most slots one ring may have. A ring needs about as many slots as its lifetime spans
# bottleneck intervals, a handful; each slot is a chunk's buffer, so a count far above this is a
# mistake that would take memory for buffers no stage can keep busy.
MAX_SLOTS = 1 << 16
_SLOTS_HINT = (f"; give each ring 1 to {MAX_SLOTS} slots (device_out 0 for an in-place compute), "
               "or slots=None to have them planned")


@dataclasses.dataclass(frozen=True)
class SlotCounts:
    """Slots per ring: host-in, device-in, device-out (0 when compute is in place: device-in
    aliases device-out) and host-out, each from 1 (0 for device-out) to :data:`MAX_SLOTS`,
    checked when made (see ``__post_init__``)."""

    host_in: int
    device_in: int
    device_out: int  # 0 when compute is in place (device-in aliases device-out)
    host_out: int

    def __post_init__(self) -> None:
        """Checks each count and stores it as a plain int (a numpy integer's sums wrap around,
        and what the pipeline derives from them must be ints too). Every pipeline takes a
        SlotCounts as made, so this is the one check of its counts.

        Raises:
            TypeError: a count that is not an integer (a bool, a float, a string).
            ValueError: a count below 1 (below 0 for ``device_out``) or above :data:`MAX_SLOTS`.
        """
        for name in ("host_in", "device_in", "device_out", "host_out"):
            count = check_count(f"slots.{name}", getattr(self, name), minimum=0 if name == "device_out" else 1,
                                maximum=MAX_SLOTS, hint=_SLOTS_HINT)
            object.__setattr__(self, name, count)  # frozen: set once, here

    @property
    def pinned_slots(self) -> int:
        """Slots of pinned host memory: ``host_in + host_out``."""
        return self.host_in + self.host_out

    def minus(self, ring: str) -> "SlotCounts":
        """The same counts with one slot fewer of ``ring`` (to show it was needed)."""
        return dataclasses.replace(self, **{ring: getattr(self, ring) - 1})


@dataclasses.dataclass(frozen=True)
class StageTimes:
    """Seconds one chunk spends in each stage running alone (copies at their concurrent rate)."""

    prepare: float
    h2d: float
    compute: float
    d2h: float
    consume: float
    workers: int = 1  # the CPU pool's threads running its stages at once (the modelled: copying_threads)
    handoff: float = 0.0  # from an operation completing to the host enqueueing the next
    scheduler: float = 0.0  # host time the scheduler thread spends per chunk (a resource too)

    def as_dict(self) -> dict[str, float]:
        return {s: getattr(self, s) for s in STAGES}

    @property
    def cpu_interval(self) -> float:
        return (self.prepare + self.consume) / self.workers

    @property
    def interval(self) -> float:
        """The steady interval between chunks: the slowest resource."""
        return max(self.h2d, self.compute, self.d2h, self.cpu_interval, self.scheduler)

    @property
    def bottleneck(self) -> str:
        options = {"h2d": self.h2d, "compute": self.compute, "d2h": self.d2h, "cpu (prepare+consume)": self.cpu_interval,
                   "scheduler (host)": self.scheduler}
        return max(options, key=options.get)


@dataclasses.dataclass(frozen=True)
class SlotPlan:
    slots: SlotCounts
    interval: float
    bottleneck: str
    lifetimes: dict

    def describe(self) -> str:
        parts = [f"{k}={getattr(self.slots, k)} (lifetime {v * 1e3:.3f} ms)" for k, v in self.lifetimes.items()]
        return f"interval {self.interval * 1e3:.3f} ms ({self.bottleneck}); " + ", ".join(parts)


def slots_for(lifetime: float, interval: float) -> int:
    if interval <= 0:
        return 1
    return max(1, math.ceil(lifetime / interval - 1e-9))


def plan_slots(times: StageTimes, *, inplace: bool = False) -> SlotPlan:
    """Slot counts that let the pipeline run at its bottleneck interval (see module doc)."""
    t, h = times, times.handoff
    T = t.interval
    lifetimes = {"host_in": t.prepare + t.h2d + h}
    if inplace:
        lifetimes["device_in"] = t.h2d + t.compute + t.d2h + h
    else:
        lifetimes["device_in"] = t.h2d + t.compute + h
        lifetimes["device_out"] = t.compute + t.d2h + h
    lifetimes["host_out"] = t.d2h + t.consume + h
    counts = {k: slots_for(v, T) for k, v in lifetimes.items()}
    counts.setdefault("device_out", 0)
    return SlotPlan(SlotCounts(**counts), T, t.bottleneck, lifetimes)


def cap_slots(counts: SlotCounts, chunks: int) -> SlotCounts:
    """``counts`` with no ring above ``chunks`` slots (a ring of 0 stays 0): a job of ``chunks``
    chunks never has more than that many alive in one ring."""
    return SlotCounts(*(min(c, chunks) if c else 0 for c in
                        (counts.host_in, counts.device_in, counts.device_out, counts.host_out)))


def with_device_slack(counts: SlotCounts, *, inplace: bool) -> SlotCounts:
    """Device rings sized for any compute time, plus one slot of slack.

    A device slot is reused in GPU order: it is busy for the GPU time of the stages it spans
    (in place: H2D, compute and D2H; device-in: H2D and compute; device-out: compute and D2H),
    and each stage takes at most one bottleneck interval, so ``stages`` slots keep the streams
    fed whatever the compute costs, and one more absorbs jitter between them. A planned count
    rests on a compute time that is only a guess before the first launch (a simulator model,
    or none), and a device slot is cheap next to a GPU's memory (docs/design.md, "Slot
    lifetimes", has what a wrong guess cost on the H200)."""
    if inplace:
        return dataclasses.replace(counts, device_in=max(counts.device_in, 4))
    return dataclasses.replace(counts, device_in=max(counts.device_in, 3), device_out=max(counts.device_out, 3))


def device_ring_slots(counts: SlotCounts, chunks: int, *, inplace: bool = False) -> tuple[int, int]:
    """(device-in, device-out) slots a job of ``chunks`` chunks planned at ``counts`` allocates:
    each ring with its slack (:func:`with_device_slack`), none above ``chunks`` slots. An
    in-place compute (``inplace``) allocates its one ring as device-in and no device-out slot."""
    ring = with_device_slack(counts, inplace=inplace)
    return min(chunks, ring.device_in), 0 if inplace else min(chunks, ring.device_out)


def device_slot_bytes(in_bytes: float, out_bytes: float, *, scheduler: bool) -> tuple[float, float]:
    """``(device-in, device-out)`` bytes of a slot, as the engine that runs the job allocates them,
    for chunks of ``in_bytes`` whose results are ``out_bytes``.

    Either engine gives a device-in slot a chunk's input and a device-out slot its result: the
    direct engine (``scheduler=False``) as they are, the scheduler (``scheduler=True``: a staged
    job, or ``engine="pipeline"`` or ``on_error="continue"`` on pinned memory) at least one byte
    each (:func:`scheduler_slot`, for a whole-array job, whose chunks' input and result bytes are
    both known up front). The engines lay their rings out otherwise (:func:`ring_bytes`). Neither
    holds for an in-place compute, whose one ring's slots hold a chunk."""
    if scheduler:
        return max(1, in_bytes), max(1, out_bytes)
    return in_bytes, out_bytes


# The scheduler starts each of its device slots, each result-sized host-out slot and each item
# sharing a chunk on a multiple of this many bytes, whatever their sizes (a GPU kernel reads an
# array only from an address aligned to its dtype, and a packed result's leaves stay aligned);
# the direct engine's slots are whole rows of the caller's arrays, packed one after another.
SLOT_ALIGN = 256


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`SLOT_ALIGN`."""
    return -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN


def ring_bytes(count: int, slot_bytes: float, *, scheduler: bool) -> float:
    """Bytes of device memory one ring of ``count`` slots of ``slot_bytes`` takes, as the engine
    that runs the job allocates it: the direct engine (``scheduler=False``) packs its slots,
    ``count * slot_bytes``; the scheduler starts each slot on a multiple of
    :data:`SLOT_ALIGN` bytes, the last ending at its own bytes. 0 for no slots."""
    if count <= 0:
        return 0
    if not scheduler:
        return count * slot_bytes
    return (count - 1) * aligned(math.ceil(slot_bytes)) + slot_bytes


def device_ring_bytes(counts: SlotCounts, chunk_bytes: int, chunks: int, *, out_ratio: float = 1.0,
                      scheduler: bool = False, inplace: bool = False) -> float:
    """Bytes of device memory the device rings of :func:`device_ring_slots` take, on the engine
    ``scheduler`` says (the scheduler, or the direct engine), each slot as
    :func:`device_slot_bytes` says for chunks of ``chunk_bytes`` and results of ``out_ratio``
    bytes per input byte, each ring laid out as :func:`ring_bytes` says. An in-place compute
    (``inplace``) counts its one ring, each slot the larger of a chunk's input and result."""
    din, dout = device_ring_slots(counts, chunks, inplace=inplace)
    if inplace:
        return ring_bytes(din, chunk_bytes * max(1.0, out_ratio), scheduler=scheduler)
    in_slot, out_slot = device_slot_bytes(chunk_bytes, chunk_bytes * out_ratio, scheduler=scheduler)
    return ring_bytes(din, in_slot, scheduler=scheduler) + ring_bytes(dout, out_slot, scheduler=scheduler)


def scheduler_slot(chunk_bytes: int, nbytes: "int | None") -> int:
    """Bytes of a slot of one of the scheduler's rings for chunks of ``chunk_bytes`` whose data in
    that ring (a chunk's input, or its result) is ``nbytes`` at most, where every chunk's is known
    before the job starts (None: not known): ``nbytes`` where smaller than a chunk (at least 1),
    else ``chunk_bytes``. A device ring's slots start :func:`aligned` of that apart
    (:func:`ring_bytes`), a host ring's as :func:`host_out_slot` says. An in-place ring's slot holds
    a chunk's input and its result, so it is ``chunk_bytes`` whatever either is."""
    if nbytes is None or nbytes >= chunk_bytes:
        return chunk_bytes
    return max(1, nbytes)


def host_out_slot(chunk_bytes: int, out_bytes: "int | None") -> tuple[int, int]:
    """``(bytes, stride)`` of a host-out slot as the scheduler allocates its ring for chunks of
    ``chunk_bytes`` whose results are ``out_bytes`` at most, where every result's bytes are known
    before the job starts (None: not known): a chunk's bytes where the result is no smaller or
    not known, else the result's (at least 1), the slots :data:`SLOT_ALIGN` apart (never
    farther than a chunk). The stride is what each slot counts against a pinned budget."""
    n = scheduler_slot(chunk_bytes, out_bytes)
    return n, n if n == chunk_bytes else min(chunk_bytes, aligned(n))


def host_in_slot(chunk_bytes: int, in_bytes: "int | None", inplace: bool = False) -> tuple[int, int]:
    """``(bytes, stride)`` of a host-in slot as the scheduler allocates its ring for chunks of
    ``chunk_bytes`` whose inputs are ``in_bytes`` at most, where every input's bytes are known
    before the job starts (None: not known): only the input is staged into a host-in slot, so a
    slot holds the input's bytes where smaller than a chunk (at least 1), the slots
    :data:`SLOT_ALIGN` apart (never farther than a chunk); a chunk's bytes where the input is no
    smaller, not known, or the compute is in place (``inplace``). The stride is what each slot
    counts against a pinned budget."""
    return host_out_slot(chunk_bytes, None if inplace else in_bytes)


WORKER_SLOTS_PINNED_CAP = 256 << 20  # pinned bytes the one-slot-per-worker floor may take


def with_worker_slots(counts: SlotCounts, workers: int, chunk_bytes: int,
                      profile: "str | HardwareProfile") -> SlotCounts:
    """Staging rings with at least one slot per CPU worker in each direction, counting the
    workers that can copy at once to any gain (:func:`fastest_copy_threads`: more would copy no
    faster, and more chunks staged at once only make each copy slower).

    A worker can only copy a chunk that holds a host slot. The plan's per-thread copy rate is
    measured with the threads alone; in a pipeline they contend with each other, with the
    copy engines and with page faults of a fresh output, so chunks stay in the CPU stages
    longer than planned and a ring sized by the plan leaves workers idle (docs/design.md,
    "CPU workers", has the runs). The floor takes at most ``WORKER_SLOTS_PINNED_CAP`` of pinned
    memory for both rings (large chunks get fewer slots: a worker is busy longer with each)."""
    floor = min(fastest_copy_threads(profile, workers), max(1, WORKER_SLOTS_PINNED_CAP // (2 * chunk_bytes)))
    return dataclasses.replace(counts, host_in=max(counts.host_in, floor), host_out=max(counts.host_out, floor))


def ideal_total(times: StageTimes, n: int) -> float:
    """A lower bound on the wall time of ``n`` chunks of these stage times: no schedule beats it.

    Each stage runs on a resource of some parallelism: the H2D copy engine, the compute stream
    and the D2H copy engine take one chunk at a time; prepare and consume share the pool of
    ``workers`` CPU threads, each of which takes one chunk's stage at a time; the scheduler's
    host time per chunk is a resource of one. A chunk passes its stages in order, so before a
    resource can start anything the first chunk has spent the stages before it, and after the
    resource's last piece of work that chunk still has the stages after it. With ``L`` the sum
    of the five stage times (one chunk's latency, the pipeline's fill and drain) the bound is the
    largest of:

    * ``L``;
    * for each stage ``s`` of time ``t`` on ``W`` lanes (``W = 1`` for the copies and compute,
      ``workers`` for prepare and consume): ``L + (ceil(n / W) - 1) * t``, the stages before it,
      its ``n`` chunks with some lane taking ``ceil(n / W)`` of them, and the stages after it;
    * for the CPU pool as a whole (its first work, a prepare, needs nothing before it; its last,
      a consume, nothing after): ``n * (prepare + consume) / workers``, or the
      ``ceil(2n / workers)`` shortest of its ``2n`` pieces, which some thread must take;
    * ``n * scheduler``.

    As ``n`` grows the bound rises by the steady interval per chunk: the largest work per chunk
    of a resource over its parallelism (:attr:`StageTimes.interval`). The copy and compute
    terms are ``sum + (n - 1) * stage``; the CPU pool's needs no fill, since its threads run
    earlier chunks' consumes while later chunks are prepared, and its stages' terms count
    ``workers`` chunks side by side. Copy times are those of the steady state: when both
    directions run at once they share the link, so they are taken at the duplex rate.

    Args:
        times: seconds per chunk of each stage, ``workers`` the CPU pool's threads, ``scheduler``
            the host seconds per chunk.
        n: chunks (0 or less gives 0).

    Returns:
        seconds.
    """
    if n <= 0:
        return 0.0
    t = times.as_dict()
    workers = max(1, times.workers)
    lanes = {"prepare": workers, "h2d": 1, "compute": 1, "d2h": 1, "consume": workers}
    latency = sum(t.values())
    short, long = sorted((t["prepare"], t["consume"]))
    k = math.ceil(2 * n / workers)  # the pieces some thread of the pool takes
    pool = max(n * (short + long) / workers, min(k, n) * short + max(0, k - n) * long)
    bound = max(latency, pool, n * times.scheduler)
    before = 0.0
    for stage in STAGES:
        after = latency - before - t[stage]
        bound = max(bound, before + math.ceil(n / lanes[stage]) * t[stage] + after)
        before += t[stage]
    return bound


# host_stages of a planning function: a bool (both sides staged, or neither) or (input staged, result staged)
HostStages = bool | tuple[bool, bool]


def staged_sides(host_stages: HostStages) -> tuple[bool, bool]:
    """``(input staged, result staged)`` of a planning function's ``host_stages``: a bool stages
    both sides or neither; a pair of bools names each side (a job whose one side is the caller's
    pinned memory, used in place, and whose other is staged through a pinned ring).

    Raises:
        ValueError: ``host_stages`` is neither a bool nor a tuple of two bools (naming it).
    """
    if isinstance(host_stages, bool):
        return host_stages, host_stages
    if (isinstance(host_stages, tuple) and len(host_stages) == 2
            and all(isinstance(side, bool) for side in host_stages)):
        return host_stages[0], host_stages[1]
    raise ValueError(f"host_stages must be a bool (both sides staged, or neither) or a pair of bools (input staged, "
                     f"result staged), got {host_stages!r}")


def host_stage_seconds(profile: "str | HardwareProfile", nbytes: int, threads: int) -> float:
    """Seconds one host task takes to copy ``nbytes`` while ``threads`` threads copy at once
    (itself included): its scheduling cost plus the bytes at its share of the host copy rate."""
    p = get_profile(profile)
    threads = max(1, threads)
    return p.host_task_overhead_s + nbytes / (p.staging_copy_rate(threads) / threads * 1e9)


def fastest_copy_threads(profile: "str | HardwareProfile", workers: int) -> int:
    """The fewest threads, of up to ``workers``, at which the profile's host copy rate (all
    threads together) is at its highest."""
    return _fastest_copy_threads(get_profile(profile), max(1, int(workers)))


def fastest_staging_threads(profile: "str | HardwareProfile", workers: int) -> int:
    """The fewest threads, of up to ``workers``, at which the staged path's host copies move the
    most bytes a second (``HardwareProfile.staging_copy_rate``: memcpy, capped by what so many
    threads stage beside the GPU's copies)."""
    return _fastest_copy_threads(get_profile(profile), max(1, int(workers)), staged=True)


@functools.lru_cache(maxsize=256)
def _fastest_copy_threads(p: HardwareProfile, workers: int, *, staged: bool = False) -> int:
    # (remembered: the planner asks once a candidate chunk size, and a profile is immutable)
    # each curve is monotone between its points (log-log interpolation, flat past its ends), so
    # a rate's highest value for up to ``workers`` threads is at one of them or at ``workers``
    # (the staged rate, the lower of two curves, could peak where they cross between points:
    # not looked for, since staging grows with threads wherever it has been measured)
    points = p.host_copy_GBps + ((p.staging_GBps or ()) if staged else ())
    counts = {int(t) for t, _ in points if 1 <= t <= workers} | {workers}
    rate = p.staging_copy_rate if staged else p.host_copy_rate
    return max(sorted(counts), key=lambda t: (rate(t), -t))


def copying_threads(profile: "str | HardwareProfile", in_bytes: int, out_bytes: int, workers: int,
                    pace: float, *, host_stages: HostStages = True) -> int:
    """How many of a pool's ``workers`` threads copy at once in a long run of chunks.

    A worker takes a chunk's copy in or copy out only when the pipeline has one for it, and the
    pipeline has one ready every ``pace`` seconds (its slowest other resource: a copy engine,
    the compute stream, the scheduler's host time). By Little's law the threads busy at once are
    the CPU stages' time per chunk over that interval, and each copies at its share of the host's
    rate for that many threads: the fewest threads whose copies of a chunk's ``in_bytes`` and
    ``out_bytes``, spread over them, keep up with ``pace``. When none keeps up, the CPU stages
    are the bottleneck, and as many copy as the host's copy rate grows with: the fewest threads
    at which the memcpy curve reaches its highest rate for up to ``workers`` threads
    (:func:`fastest_copy_threads`), or more where the staged path's rate still grows past them
    (:func:`fastest_staging_threads`: page faults and the GPU's copies leave memory bandwidth
    that more threads use). More copying at once would move no more bytes a second and make
    each copy slower, and the staging rings, sized from these times, hold no more chunks than
    that.

    ``host_stages``: the sides staged (:func:`staged_sides`): only a staged side's copy is a
    worker's task; a side used in place is none. With neither side staged, both are counted
    (the count a job staging both would have: the pool then copies nothing either way).

    The search halves the range, which assumes the host's aggregate copy rate does not fall as
    threads are added (the profile's curves are measured that way; where a measured curve dips,
    the answer is a count that keeps up, not always the fewest).

    Raises:
        ValueError: ``host_stages`` that :func:`staged_sides` refuses.
    """
    p = get_profile(profile)
    sides = staged_sides(host_stages)
    if not any(sides):
        sides = (True, True)
    most = max(fastest_copy_threads(p, workers), fastest_staging_threads(p, workers))
    nbytes = in_bytes * sides[0] + out_bytes * sides[1]
    tasks = sum(sides) * p.host_task_overhead_s

    def keeps_up(threads: int) -> bool:  # the chunk's host_stage_seconds of its staged sides, over the threads
        return (tasks + nbytes * threads / (p.staging_copy_rate(threads) * 1e9)) / threads <= pace

    if not keeps_up(most):
        return most
    low, high = 1, most  # keeps_up(high) holds
    while low < high:
        mid = (low + high) // 2
        if keeps_up(mid):
            high = mid
        else:
            low = mid + 1
    return low


def model_stage_times(profile: "str | HardwareProfile", chunk_bytes: int, *, compute: Optional[float] = None,
                      prepare: Optional[float] = None, consume: Optional[float] = None, workers: int = 1,
                      out_bytes: Optional[int] = None, scheduler: float = 0.0) -> StageTimes:
    """Per-chunk stage times predicted by a profile.

    Copies use the bandwidth-by-size curve; when both directions run (the steady state) they
    share the link's duplex bandwidth. ``compute`` defaults to what the simulated GPU charges a
    kernel that declares no cost (``HardwareProfile.kernel_seconds`` of the input and output
    bytes: a memory-bound pass, at least the profile's shortest kernel); ``prepare``/``consume``
    default to one memcpy of the chunk at the per-thread host copy rate of the pool's threads
    that copy at once: of ``workers``, those that the copies, the
    kernel and ``scheduler`` (the host's seconds per chunk) keep busy (:func:`copying_threads`;
    all of them when either host stage is given).

    The host's time per chunk is at least ``scheduler`` and at least the hand-off (an event and
    an enqueue, which every chunk costs the one thread that enqueues): chunks come no closer
    together than that, and a ring holds no more of them than its lifetime spans such intervals
    (a profile whose copies take a minute to enqueue needs no ring of a slot a millisecond)."""
    p = get_profile(profile)
    n_in, n_out = chunk_bytes, out_bytes if out_bytes is not None else chunk_bytes
    handoff = p.event_overhead_s + max(p.copy_overhead_s, p.launch_overhead_s)
    scheduler = max(scheduler, handoff)
    r_h = p.copy_GBps("h2d", n_in) * 1e9
    r_d = p.copy_GBps("d2h", n_out) * 1e9
    scale = min(1.0, p.duplex_GBps * 1e9 / (r_h + r_d))
    h2d, d2h = n_in / (r_h * scale), n_out / (r_d * scale)
    if compute is None:
        compute = p.kernel_seconds(n_in + n_out)
    busy = workers
    if prepare is None and consume is None:  # both copies modelled: idle workers take no share
        busy = copying_threads(p, n_in, n_out, workers, max(h2d, compute, d2h, scheduler))
    return StageTimes(
        prepare=prepare if prepare is not None else host_stage_seconds(p, n_in, busy),
        h2d=h2d,
        compute=compute,
        d2h=d2h,
        consume=consume if consume is not None else host_stage_seconds(p, n_out, busy),
        workers=busy,
        handoff=handoff,
        scheduler=scheduler,
    )


@dataclasses.dataclass(frozen=True)
class HostStrategy:
    """How an ordinary (pageable) numpy source and destination reach the copy engines: the
    choice, and each strategy's predicted time for the whole job (seconds)."""

    choice: str  # "stage" or "register"
    stage_s: float
    register_s: float

    def describe(self) -> str:
        return (f"{self.choice}: staging through the pinned rings ~{self.stage_s * 1e3:.1f} ms, "
                f"registering in place ~{self.register_s * 1e3:.1f} ms")


def choose_host_strategy(profile: "str | HardwareProfile", nbytes_in: int, nbytes_out: int, *, workers: int,
                         out_is_fresh: bool, pinned: tuple = (False, False), chunk_bytes: Optional[int] = None,
                         compute_s_per_byte: Optional[float] = 0.0, compute_s_per_chunk: Optional[float] = 0.0,
                         scheduler: bool = False, align: int = 1, pins_once: bool = False,
                         same_memory: bool = False, pinned_budget: Optional[int] = None) -> HostStrategy:
    """Stage or register, whichever the profile predicts the faster for the whole job, or with
    ``pins_once`` for each call of a job that pins its arrays once for all its calls.

    Staging runs on the scheduler, its workers copying each side not already pinned through a
    pinned ring: :func:`predict_seconds` with those sides staged (``host_stages``), which counts
    the host copies and the scheduler's host time per chunk. Registering pins each such side in
    place before the job (a fresh output first-touched in parallel first, since registering it
    faults its pages in one thread) and unpins it after, and runs the job unstaged in between:
    the registration and unregistration at the profile's rates and its fixed cost per array
    (``register_call_s``, where measured), plus :func:`predict_seconds` unstaged. A side
    already pinned (``pinned``: input, output) is used in place either way. With neither side
    left to pin, both predictions are 0 and the choice is ``"stage"`` (nothing is staged).

    A job called again and again over the same arrays (a ``MapJob``) registers them once, when it
    is set up, as a staged one allocates its rings once: with ``pins_once`` the pinning,
    unpinning and first touch are that set-up, left out as the rings' allocation is, and the
    choice is the faster call (``register_s`` is the unstaged run alone).

    Args:
        profile: a profile, or its name or file.
        nbytes_in: the input's bytes.
        nbytes_out: the result's bytes.
        workers: the CPU workers that copy (staging) and first-touch (registering).
        out_is_fresh: whether the result is a new array (registering first-touches it).
        pinned: whether the input and the result are pinned memory already.
        chunk_bytes: the job's chunk (bytes); None: each strategy at the chunk
            :func:`choose_chunk_bytes` picks for it (``chunk_bytes="auto"``).
        compute_s_per_byte: the kernel's seconds per input byte, as :func:`predict_seconds` takes it.
        compute_s_per_chunk: the kernel's seconds per launch, as :func:`predict_seconds` takes it.
        scheduler: whether the scheduler runs the registered job too (``engine="pipeline"`` or
            ``on_error="continue"``); a staged one always runs on it.
        align: the bytes a chunk is a whole multiple of (a row), as :func:`choose_chunk_bytes` takes it.
        pins_once: whether the registration serves every call of a job (``MapJob``) rather than one.
        same_memory: whether the result is the input's memory (``out=x``): registering pins it once,
            staging still copies it in and out.
        pinned_budget: the most bytes of pinned memory the job may take (None: no bound): where
            registering would pin more, the choice is ``"stage"``, whatever the predictions.
    """
    p = get_profile(profile)
    sides = (not pinned[0], not pinned[1])
    to_pin = nbytes_in * sides[0] + nbytes_out * sides[1]
    if not to_pin:
        return HostStrategy("stage", 0.0, 0.0)
    # the arrays to register (their bytes): one where the result is the input's memory
    arrays = (nbytes_in,) if same_memory else tuple(n for n, side in zip((nbytes_in, nbytes_out), sides) if side)
    out_ratio = nbytes_out / nbytes_in if nbytes_in else 1.0
    costs = dict(compute_s_per_byte=compute_s_per_byte, compute_s_per_chunk=compute_s_per_chunk, workers=workers,
                 out_ratio=out_ratio)

    def run_seconds(host_stages: HostStages, on_scheduler: bool) -> float:
        if chunk_bytes is None:
            return choose_chunk_bytes(p, nbytes_in, host_stages=host_stages, scheduler=on_scheduler, align=align,
                                      **costs).predicted_s
        return predict_seconds(p, nbytes_in, chunk_bytes, host_stages=host_stages, scheduler=on_scheduler,
                               **costs)[1]

    stage = run_seconds(sides, True)
    register = run_seconds(False, scheduler)
    if not pins_once:
        register += sum(p.register_seconds(n) + p.unregister_seconds(n) for n in arrays)
        if out_is_fresh and sides[1]:
            register += nbytes_out / (p.first_touch_rate(workers) * 1e9)
    # registering pins the whole of each array: a budget for pinned memory bounds it as it bounds the rings
    within = pinned_budget is None or sum(arrays) <= pinned_budget
    return HostStrategy("register" if register < stage and within else "stage", stage, register)


# The host's costs per chunk, parameters of the chunk-size model. Each was fitted to profiled runs
# on the H200; docs/design.md ("Calibration notes") gives the runs and the fits. A profile that
# measured its host's time per chunk of an engine replaces that engine's fit (host_seconds_per_chunk).
# The scheduler's time per chunk: enqueues, event queries, pool hand-offs. It is the whole of the
# scheduler's cost for a job it runs unstaged (engine="pipeline", or on_error="continue", on pinned
# memory).
SCHEDULER_S_PER_CHUNK = 140e-6
# Each CPU stage a chunk runs on the worker pool (staging's copy in and copy out) adds a hand-off
# to a worker and back, and its completion, to the scheduler's time per chunk.
SCHEDULER_S_PER_HOST_TASK = 138e-6
# A job whose copy engines use the caller's memory in place runs on the direct engine, whose host
# cost is its enqueueing.
DIRECT_S_PER_CHUNK = 60e-6
# Choosing a staged chunk among near ties. Candidates predicted within PREDICTION_TIE of the
# fastest are ones the model cannot tell apart: its staged predictions miss by more than that on
# real hosts. Among them the planner takes the one that stays fastest if the scheduler's time per
# chunk is HOST_LOAD_MARGIN times the profile's. The profile measures that time with small chunks
# and few workers copying; with large chunks and many workers the workers' copies slow the
# scheduler's own Python (docs/performance.md, "a staged chunk among near ties"), so of two sizes the
# model calls equal, the one with fewer chunks is the one a loaded scheduler does not bound. The
# direct engine has no workers copying beside it, and keeps the fastest prediction.
PREDICTION_TIE = 0.02
HOST_LOAD_MARGIN = 2.0
# Copies queued back to back on a copy engine, as a pipeline queues them, stream at the link's
# rate and lose a small fixed cost each -- unlike one copy timed alone, which the profile's
# bandwidth-by-size curve describes (launch latency included).
QUEUED_COPY_OVERHEAD_S = 8e-6


def host_seconds_per_chunk(profile: "str | HardwareProfile", host_stages: HostStages, *,
                           scheduler: Optional[bool] = None) -> float:
    """The host's time per chunk (seconds) of the engine that runs a job, which the prediction
    counts as a resource of its own.

    Four cases: the scheduler staging both sides (``host_stages`` true: its enqueues, event
    queries and the hand-offs of two pool tasks), the scheduler staging one side (``host_stages``
    a pair with one side true: one pool task's hand-off), the scheduler not staging (``scheduler``
    without ``host_stages``: ``engine="pipeline"``, or ``on_error="continue"``, on pinned memory;
    its enqueues and event queries), and the direct engine (neither: its enqueueing). Each whole
    case is the profile's measured figure where it has one (``staged_chunk_host_s``,
    ``scheduled_chunk_host_s``, ``direct_chunk_host_s``: ``ringflow doctor --save``), else the
    fit above (``SCHEDULER_S_PER_CHUNK + 2 * SCHEDULER_S_PER_HOST_TASK``,
    ``SCHEDULER_S_PER_CHUNK``, ``DIRECT_S_PER_CHUNK``).

    The one-side case is the profile's ``one_side_chunk_host_s`` where it measured it. Else it
    is derived: each staged side adds one hand-off to the unstaged scheduler's time, so it is the
    midpoint ``scheduled + (staged - scheduled) / 2`` of
    ``staged_chunk_host_s`` and ``scheduled_chunk_host_s`` where the profile measured both;
    ``staged_chunk_host_s - SCHEDULER_S_PER_HOST_TASK`` (at least half of it) where it measured
    only that; ``scheduled_chunk_host_s + SCHEDULER_S_PER_HOST_TASK`` where only that; else the
    fit ``SCHEDULER_S_PER_CHUNK + SCHEDULER_S_PER_HOST_TASK``.

    Args:
        profile: a profile, or its name or file.
        host_stages: whether the job stages its arrays through pinned rings on the host: a bool
            (both sides, or neither) or a pair ``(input, result)`` (:func:`staged_sides`).
        scheduler: whether the scheduler runs the job; None: as ``host_stages`` says (the
            scheduler runs every job that stages a side, the direct engine an unstaged one by default).

    Raises:
        ValueError: ``host_stages`` staging a side with ``scheduler=False`` (only the scheduler
            stages), or not a bool or a pair of bools.
    """
    return host_time_per_chunk(profile, host_stages, scheduler=scheduler)[0]


def host_time_per_chunk(profile: "str | HardwareProfile", host_stages: HostStages, *,
                        scheduler: Optional[bool] = None) -> tuple[float, Optional[str]]:
    """``(seconds, source)``: :func:`host_seconds_per_chunk` (its arguments as there) and where
    that figure comes from: the profile field it is (``"staged_chunk_host_s"``, ...), for a job
    staging one side without ``one_side_chunk_host_s`` how it is derived (``"midpoint"``,
    ``"staged less a hand-off"``, ``"scheduled plus a hand-off"``), or None for the fit.

    Raises:
        as :func:`host_seconds_per_chunk`.
    """
    field, fit = host_time_source(host_stages, scheduler)
    p = get_profile(profile)
    if isinstance(field, str):
        measured = getattr(p, field)
        return (fit, None) if measured is None else (measured, field)
    if p.one_side_chunk_host_s is not None:
        return p.one_side_chunk_host_s, "one_side_chunk_host_s"
    staged, scheduled = (getattr(p, name) for name in field)
    if staged is not None and scheduled is not None:
        return scheduled + (staged - scheduled) / 2, "midpoint"
    if staged is not None:
        # the fit's hand-off is its host's; on a host whose whole staged figure is under two of
        # them it would take away more than one hand-off costs there
        return max(staged - SCHEDULER_S_PER_HOST_TASK, staged / 2), "staged less a hand-off"
    if scheduled is not None:
        return scheduled + SCHEDULER_S_PER_HOST_TASK, "scheduled plus a hand-off"
    return fit, None


# the profile fields a one-side job's host time per chunk is derived from (host_seconds_per_chunk)
ONE_SIDE_HOST_FIELDS = ("staged_chunk_host_s", "scheduled_chunk_host_s")


def host_time_source(host_stages: HostStages,
                     scheduler: Optional[bool] = None) -> tuple["str | tuple[str, str]", float]:
    """``(field, fit)`` behind :func:`host_seconds_per_chunk` for the engine that runs a job (its
    arguments as there): the :class:`HardwareProfile` field holding that engine's measured host
    time per chunk, and the fit (seconds) used where the profile has none. For a job staging one
    side, ``field`` is the pair :data:`ONE_SIDE_HOST_FIELDS` (``staged_chunk_host_s``,
    ``scheduled_chunk_host_s``) that its figure is derived from (:func:`host_seconds_per_chunk`
    says how), and ``fit`` is the fit of one hand-off.

    Raises:
        ValueError: ``host_stages`` staging a side with ``scheduler=False`` (only the scheduler
            stages), or not a bool or a pair of bools.
    """
    sides = staged_sides(host_stages)
    scheduled = any(sides) if scheduler is None else bool(scheduler)
    if any(sides) and not scheduled:
        raise ValueError(f"host_stages={host_stages!r} needs scheduler=True or None: only the scheduler stages a job")
    if all(sides):
        return "staged_chunk_host_s", SCHEDULER_S_PER_CHUNK + 2 * SCHEDULER_S_PER_HOST_TASK
    if any(sides):
        return ONE_SIDE_HOST_FIELDS, SCHEDULER_S_PER_CHUNK + SCHEDULER_S_PER_HOST_TASK
    if scheduled:
        return "scheduled_chunk_host_s", SCHEDULER_S_PER_CHUNK
    return "direct_chunk_host_s", DIRECT_S_PER_CHUNK


def queued_stage_times(profile: "str | HardwareProfile", chunk_bytes: int, *, compute: Optional[float],
                       workers: int, out_ratio: float = 1.0, scheduler: float = 0.0,
                       host_stages: HostStages = True) -> StageTimes:
    """Per-chunk stage times of a long run of chunks: copies at the link's streaming rate
    (shared when both directions run) plus :data:`QUEUED_COPY_OVERHEAD_S`, kernels (``compute``
    seconds; None: a compute of no declared cost, timed as :func:`model_stage_times` times it)
    plus the profile's launch overhead (each waits on an event from another stream); host stages as in
    :func:`model_stage_times`, for the workers that these copies, the kernel and ``scheduler``
    (the host's seconds per chunk) keep busy. ``out_ratio``: a chunk's result bytes per input
    byte. ``host_stages``: the sides staged (:func:`staged_sides`); one side staged copies that
    side alone (on as many threads as its copy keeps busy: :func:`copying_threads`), and the
    other costs a host task's overhead, as an unstaged side does in :func:`predict_seconds`.
    Neither side staged: both are timed as copies (:func:`predict_seconds` replaces them)."""
    p = get_profile(profile)
    sides = staged_sides(host_stages)
    peak_h = p.copy_GBps("h2d", p.h2d_curve[-1][0]) * 1e9
    peak_d = p.copy_GBps("d2h", p.d2h_curve[-1][0]) * 1e9
    share = min(1.0, p.duplex_GBps * 1e9 / (peak_h + peak_d))
    out_bytes = max(1, round(chunk_bytes * out_ratio))
    # (its copies, kernel and host stages are replaced below: given host stages, it does not
    # look for the copying threads, which the queued times decide)
    t = model_stage_times(p, chunk_bytes, compute=compute, workers=workers, out_bytes=out_bytes, prepare=0.0,
                          consume=0.0, scheduler=scheduler)
    scheduler, compute = t.scheduler, t.compute  # (at least the hand-off; a compute of no cost: as modelled)
    h2d, d2h = chunk_bytes / (peak_h * share), out_bytes / (peak_d * share)
    if out_ratio != 1.0:  # the shorter direction ends first; the other then has the link to itself
        if h2d > d2h:
            h2d = d2h + (chunk_bytes - peak_h * share * d2h) / peak_h
        else:
            d2h = h2d + (out_bytes - peak_d * share * h2d) / peak_d
    h2d, d2h, compute = h2d + QUEUED_COPY_OVERHEAD_S, d2h + QUEUED_COPY_OVERHEAD_S, compute + p.launch_overhead_s
    busy = copying_threads(p, chunk_bytes, out_bytes, workers, max(h2d, compute, d2h, scheduler),
                           host_stages=sides)
    one_side = any(sides) and not all(sides)
    prepare = p.host_task_overhead_s if one_side and not sides[0] else host_stage_seconds(p, chunk_bytes, busy)
    consume = p.host_task_overhead_s if one_side and not sides[1] else host_stage_seconds(p, out_bytes, busy)
    return dataclasses.replace(t, h2d=h2d, d2h=d2h, compute=compute, scheduler=scheduler, workers=busy,
                               prepare=prepare, consume=consume)


def predict_seconds(profile: "str | HardwareProfile", total_bytes: int, chunk_bytes: int, *,
                    compute_s_per_byte: Optional[float] = 0.0, workers: int = 1,
                    host_stages: HostStages = True, out_ratio: float = 1.0,
                    compute_s_per_chunk: Optional[float] = 0.0,
                    scheduler: Optional[bool] = None) -> tuple[StageTimes, float]:
    """(per-chunk stage times, predicted wall seconds) of streaming ``total_bytes`` in chunks of
    ``chunk_bytes`` (a chunk over ``total_bytes`` is one of ``total_bytes``): the bound of the
    five stages (:func:`queued_stage_times`) plus the host's time per chunk as a sixth resource
    (it overlaps the GPU until it becomes the bottleneck with small chunks). The host stages
    copy at the profile's ``staging_copy_rate`` (their copies, the fresh output's first touch
    and the GPU's copies share the host's memory), so a staged prediction is about
    :func:`staging_floor_seconds` at the least. With ``host_stages=False`` the copy engines use
    the caller's pinned memory (no staging); a pair ``(input, result)`` of bools stages only the
    sides it names (:func:`staged_sides`): the other is the caller's pinned memory, used in
    place, and costs a host task's overhead, and the scheduler's time per chunk has one pool
    hand-off (:func:`host_seconds_per_chunk`).
    ``scheduler``: whether the scheduler runs the job, which sets the host's time per chunk
    (:func:`host_seconds_per_chunk`); None: as ``host_stages`` says (an unstaged job on the
    direct engine). ``out_ratio``: result bytes per input byte (the copy back and the consume
    move that many). A chunk's kernel takes ``compute_s_per_chunk`` plus ``compute_s_per_byte``
    for each of its input bytes; with both None the compute declares no cost (no ``sim_seconds``),
    and its kernel takes what the simulated GPU charges such a launch
    (``HardwareProfile.kernel_seconds`` of the chunk's input and result bytes).

    Raises:
        ValueError: ``host_stages`` staging a side with ``scheduler=False`` (only the scheduler
            stages), or not a bool or a pair of bools.
    """
    p = get_profile(profile)
    sides = staged_sides(host_stages)
    if 0 < total_bytes < chunk_bytes:  # the data makes one chunk of its own size
        chunk_bytes = total_bytes
    n = -(-total_bytes // chunk_bytes)
    t = queued_stage_times(p, chunk_bytes, compute=kernel_cost(compute_s_per_chunk, compute_s_per_byte, chunk_bytes),
                           workers=workers, out_ratio=out_ratio,
                           scheduler=host_seconds_per_chunk(p, sides, scheduler=scheduler), host_stages=sides)
    if not any(sides):
        t = dataclasses.replace(t, prepare=p.host_task_overhead_s, consume=p.host_task_overhead_s)
    return t, predicted_total(t, n)


def kernel_cost(per_chunk: Optional[float], per_byte: Optional[float], chunk_bytes: int) -> Optional[float]:
    """A chunk's kernel seconds from a compute's declared cost: ``per_chunk`` plus ``per_byte``
    for each of its ``chunk_bytes`` input bytes, either None read as 0; None when both are None
    (the compute declares no cost: the model then times its kernel as the simulated GPU does)."""
    if per_chunk is None and per_byte is None:
        return None
    return (per_chunk or 0.0) + (per_byte or 0.0) * chunk_bytes


def staging_floor_seconds(profile: "str | HardwareProfile", in_bytes: int, out_bytes: int) -> float:
    """The least time the host's memory allows for staging ``in_bytes`` in and ``out_bytes`` out
    (seconds), whatever the pipeline and however many threads copy: the profile's fastest
    staging rate (``HardwareProfile.staging_floor_rate``) counts the bytes of one direction
    while as many move the other way, so the two directions' mean is charged at it. 0 where the
    profile has no such figure (written before it was measured). A side not staged (the
    caller's pinned memory, used in place) moves no bytes on the host: pass 0 for it."""
    rate = get_profile(profile).staging_floor_rate()
    if rate is None:
        return 0.0
    return (in_bytes + out_bytes) / 2 / (rate * 1e9)


def split_rows(length: int, parts: int, rows: int) -> list[tuple[int, int]]:
    """``min(parts, length)`` contiguous ``(start, stop)`` ranges covering ``range(length)``,
    balanced by rows: each boundary is the even split's rounded, moved to the nearest multiple of
    ``rows`` (a chunk boundary) when that is at most an eighth of a chunk away and every shard
    holds at least one chunk; so no shard gets a short chunk that balance does not call for."""
    parts = max(1, min(parts, length))
    snap = length >= parts * rows  # every shard at least one whole chunk
    tolerance = rows // 8
    bounds = [0]
    for i in range(1, parts):
        target = (i * length + parts // 2) // parts
        nearest = (target + rows // 2) // rows * rows
        bounds.append(nearest if snap and abs(nearest - target) <= tolerance else target)
    bounds.append(length)
    return list(zip(bounds, bounds[1:]))


@dataclasses.dataclass(frozen=True)
class DevicesPrediction:
    """What several GPUs of one host should take for one whole-array job (see :func:`predict_devices`).

    Attributes:
        devices: how many GPUs get work: those asked for, at most one a row of the job (a shard
            holds a row at least, so no more GPUs than rows get one).
        share_bytes: the bytes of the largest GPU's share, a whole number of rows: the even share,
            or a little more where the split moved a boundary to a chunk's edge (:func:`split_rows`).
        share_chunk_bytes: the chunk each GPU's share is cut in (whole rows, at most the share).
        per_device_s: one GPU's time for its share of the rows, as if alone (s).
        host_floor_s: the time the host's shared memory and CPUs need for the job's host work
            with every worker of every GPU (s); 0 when nothing is staged.
        predicted_s: the larger of the two (s).
        one_device_s: the job's time on one GPU (s).
    """

    devices: int
    share_bytes: int
    per_device_s: float
    host_floor_s: float
    predicted_s: float
    one_device_s: float
    share_chunk_bytes: int

    @property
    def speedup(self) -> float:
        return self.one_device_s / self.predicted_s if self.predicted_s > 0 else float("inf")


def predict_devices(profile: "str | HardwareProfile", total_bytes: int, chunk_bytes: "int | str", devices: int, *,
                    compute_s_per_byte: float = 0.0, workers: int = 1, host_stages: HostStages = True,
                    row_bytes: int = 1, out_ratio: float = 1.0,
                    scheduler: Optional[bool] = None) -> DevicesPrediction:
    """The time ``devices`` GPUs of one host should take for a job of ``total_bytes`` in rows of
    ``row_bytes``, its rows split as the shards split them (:func:`split_rows`: evenly, each
    boundary moved to a chunk's edge where one is within an eighth of a chunk).

    Each GPU has its own link, streams and workers, so each shard takes what one GPU takes for its
    share (:func:`predict_seconds`), and the job what its largest share takes. The host's memory
    and CPUs are shared: a staged job copies every byte twice on the host (in to pinned, out of
    it), and all the GPUs' workers together
    copy at most at the profile's ``staging_copy_rate`` for that many threads (so the whole job
    takes at least :func:`staging_floor_seconds`). The prediction is the larger of the two.
    ``host_stages``: a bool, or a pair ``(input, result)`` staging only the sides it names
    (:func:`staged_sides`): the host then copies only those sides' bytes.
    ``out_ratio``: the result's bytes per input byte (the copies back, the consumes, the host's
    copies out and the chunk choice count them); ``chunk_bytes`` and the shares are the input's.

    A whole-array job over several devices splits its rows, not its chunks (a GPU's shard may be
    one chunk smaller than ``chunk_bytes``), and gives no device an empty shard: a share is
    about ``rows / devices`` whole rows, and with more devices than rows only as many as there
    are rows get work, and only their workers copy. A chunk is whole rows too: a given
    ``chunk_bytes`` (the input's bytes of a chunk) is cut down to whole rows of ``row_bytes``.
    stream_map's ``chunk_bytes`` bounds a slot instead, cut in rows of the wider of a row and its
    result: for a result larger than its input pass that job's input bytes of a chunk,
    ``chunk_bytes // out_row_bytes * row_bytes`` (as ``ringflow plan`` does). ``chunk_bytes="auto"``:
    each share is cut in the chunk :func:`choose_chunk_bytes` picks (in whole rows) for the
    share's bytes, as a whole-array job over several devices plans one for a shard's share
    (``sharded.plan_shards``), and the job on one GPU in the chunk it picks for the whole job.
    ``row_bytes``: the bytes of a row (of the input, along the axis the job is cut on); the
    default, a row of a byte, splits the job's bytes. ``scheduler``: whether the scheduler runs
    each shard (as :func:`predict_seconds` takes it); None: as ``host_stages`` says.

    Raises:
        ValueError: ``devices`` or ``row_bytes`` is not an int >= 1, ``total_bytes`` is not a
            whole number of rows, a given ``chunk_bytes`` is smaller than a row (each message
            names the argument), ``host_stages`` staging a side with ``scheduler=False``, or
            ``host_stages`` not a bool or a pair of bools.
    """
    sides = staged_sides(host_stages)
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be an int >= 1, got {devices!r}")
    if isinstance(row_bytes, bool) or not isinstance(row_bytes, int) or row_bytes < 1:
        raise ValueError(f"row_bytes must be an int >= 1, got {row_bytes!r}")
    if total_bytes % row_bytes:
        raise ValueError(f"total_bytes ({total_bytes}) is not a whole number of rows of row_bytes ({row_bytes}); "
                         "an array's bytes are its rows'")
    if chunk_bytes != "auto" and chunk_bytes < row_bytes:
        raise ValueError(f"chunk_bytes ({chunk_bytes}) is smaller than a row (row_bytes {row_bytes}); a chunk holds "
                         "a row at least")
    p = get_profile(profile)
    rows = total_bytes // row_bytes
    devices = min(devices, rows)  # (as the shards' split_rows: no more parts than rows)
    share = -(-rows // devices) * row_bytes
    if chunk_bytes == "auto":
        def chunk_for(nbytes: int) -> int:
            return choose_chunk_bytes(p, nbytes, compute_s_per_byte=compute_s_per_byte, workers=workers,
                                      host_stages=sides, align=row_bytes, out_ratio=out_ratio,
                                      scheduler=scheduler).chunk_bytes

        chunk_bytes, share_chunk = chunk_for(total_bytes), chunk_for(share)
    else:
        chunk_bytes = chunk_bytes // row_bytes * row_bytes
        share_chunk = min(chunk_bytes, share)
    # the shards' boundaries move to a chunk's edge where one is near (split_rows): the job takes
    # as long as its largest shard, which may be a little more than the even share
    share = max(b - a for a, b in split_rows(rows, devices, share_chunk // row_bytes)) * row_bytes
    _, per_device = predict_seconds(p, share, share_chunk, compute_s_per_byte=compute_s_per_byte,
                                    workers=workers, host_stages=sides, out_ratio=out_ratio, scheduler=scheduler)
    _, one = predict_seconds(p, total_bytes, chunk_bytes, compute_s_per_byte=compute_s_per_byte, workers=workers,
                             host_stages=sides, out_ratio=out_ratio, scheduler=scheduler)
    # the host copies each staged input byte into pinned memory and each staged result byte out of it
    host_bytes = total_bytes * (sides[0] + out_ratio * sides[1])
    floor = host_bytes / (p.staging_copy_rate(workers * devices) * 1e9) if any(sides) else 0.0
    return DevicesPrediction(devices, share, per_device, floor, max(per_device, floor), one, share_chunk)


def predicted_total(times: StageTimes, n: int) -> float:
    """The planner's prediction (not a bound) of the wall time of ``n`` chunks: the first chunk
    traverses every stage, the rest follow one steady interval apart. Unlike
    :func:`ideal_total` it charges every chunk size the pipeline's fill, which is what makes
    very large staged chunks slow in practice (their pinned rings and first touch are not
    modelled otherwise)."""
    if n <= 0:
        return 0.0
    return sum(times.as_dict().values()) + times.scheduler + (n - 1) * times.interval


@dataclasses.dataclass(frozen=True)
class ChunkChoice:
    chunk_bytes: int
    chunks: int
    predicted_s: float
    table: tuple  # (chunk_bytes, chunks, predicted seconds) for every candidate

    def describe(self) -> str:
        return (f"chunk {self.chunk_bytes / 2**20:g} MiB x {self.chunks}: predicted "
                f"{self.predicted_s * 1e3:.3f} ms")


def choose_chunk_bytes(profile: "str | HardwareProfile", total_bytes: int, *,
                       compute_s_per_byte: Optional[float] = 0.0, workers: int = 1, host_stages: HostStages = True,
                       pinned_budget: Optional[int] = None, align: int = 1, candidates: Optional[list] = None,
                       out_ratio: float = 1.0, compute_s_per_chunk: Optional[float] = 0.0,
                       scheduler: Optional[bool] = None, inplace: bool = False) -> ChunkChoice:
    """The chunk size (of the input) minimising the predicted wall time of ``total_bytes`` of
    input, whose results are ``out_ratio`` bytes per input byte.

    Small chunks copy slowly (the bandwidth-by-size curve) and pay the per-chunk host cost many
    times; large chunks leave the pipeline's fill and drain (the first chunk traverses every
    stage alone) a large share. Each candidate is predicted as ``predicted_total`` over its chunk
    count plus the per-chunk scheduling cost; the planned slots must fit ``pinned_budget`` (each
    host-in slot counted at a chunk's input bytes, each host-out slot at its result's, as the
    scheduler allocates them: :func:`host_in_slot`, :func:`host_out_slot`), and
    the device rings (with their slack: :func:`device_ring_bytes`, at the slot sizes of the
    engine that runs the job) the profile's ``total_memory``. ``scheduler``: whether the
    scheduler runs the job (each device slot on a :data:`SLOT_ALIGN` boundary:
    :func:`device_slot_bytes` and :func:`ring_bytes`; the host's time per chunk the scheduler's:
    :func:`host_seconds_per_chunk`), as it runs every staged job and, asked to, an unstaged one;
    None: as ``host_stages`` says. ``inplace``: the compute writes its result
    over its input, so slots are planned for one device ring (:func:`device_ring_bytes`).
    When no candidate's device rings fit, smaller chunks are tried, halving (whole multiples of
    ``align``, a row's bytes), and the largest that fits is chosen (``candidates`` given: none).
    ``host_stages=False`` when the copy engines read the caller's pinned memory directly; a pair
    ``(input, result)`` when only the sides it names are staged (:func:`staged_sides`), each
    candidate predicted so and only the staged sides' rings counted against ``pinned_budget``. A
    chunk's kernel takes ``compute_s_per_chunk`` plus ``compute_s_per_byte`` per input byte (both
    None: a compute of no declared cost, timed as :func:`predict_seconds` times it).

    Raises:
        ValueError: ``total_bytes`` is not positive; ``host_stages`` not a bool or a pair of
            bools, or staging a side with ``scheduler=False`` (only the scheduler stages); no
            chunk's planned pinned rings fit
            ``pinned_budget``; or the device rings of no chunk (down to ``align`` bytes, or of no
            given candidate) fit the profile's ``total_memory`` (the message names chunk_bytes
            and total_memory).
    """
    sides = staged_sides(host_stages)
    if total_bytes <= 0:
        raise ValueError("total_bytes must be positive")
    # the answer depends only on the profile's values and these arguments: a call evaluates 13
    # candidates, too much Python to pay on every stream_map(chunk_bytes="auto"). A profile is
    # remembered by its values (a GPU's measured profile is an object, not a name), and a file is
    # read on every call, so a profile saved again is planned from what it holds now.
    return _choose_chunk_bytes(get_profile(profile), int(total_bytes), _seconds_or_none(compute_s_per_byte),
                               int(workers), sides, pinned_budget, int(align),
                               tuple(candidates) if candidates else None, float(out_ratio),
                               _seconds_or_none(compute_s_per_chunk),
                               any(sides) if scheduler is None else bool(scheduler), bool(inplace))


def _seconds_or_none(value: Optional[float]) -> Optional[float]:
    return None if value is None else float(value)


@functools.lru_cache(maxsize=256)
def _choose_chunk_bytes(profile, total_bytes, compute_s_per_byte, workers, sides, pinned_budget, align,
                        candidates, out_ratio, compute_s_per_chunk, scheduler, inplace=False) -> ChunkChoice:
    cands = candidates or [1 << k for k in range(16, 29)]
    rows, too_large = [], []  # too_large: (chunk, its device rings' bytes, their slots) fitting no device
    seen = set()

    def consider(c: int) -> None:
        if c in seen:  # candidates above the total all become the total: predict and list it once
            return
        seen.add(c)
        n = -(-total_bytes // c)
        t, predicted = predict_seconds(profile, total_bytes, c, compute_s_per_byte=compute_s_per_byte,
                                       workers=workers, host_stages=sides, out_ratio=out_ratio,
                                       compute_s_per_chunk=compute_s_per_chunk, scheduler=scheduler)
        plan = plan_slots(t, inplace=inplace)
        # each host slot at its stride as the scheduler allocates it in slots of the larger of a
        # chunk's input and result: host-in holds the input alone, host-out the result. A side
        # not staged has no pinned ring of its own: its host ring is the caller's memory
        slot = c * max(1.0, out_ratio)
        pinned = (sides[0] * plan.slots.host_in * host_in_slot(slot, c)[1]
                  + sides[1] * plan.slots.host_out * host_out_slot(slot, round(c * out_ratio))[1])
        if pinned_budget is not None and any(sides) and pinned > pinned_budget:
            return
        # the device rings (with their slack, no more slots than chunks), at the slot sizes of the
        # engine that runs the job, must fit the device's memory: a chunk whose rings cannot be
        # allocated is no choice
        device = device_ring_bytes(plan.slots, c, n, out_ratio=out_ratio, scheduler=scheduler, inplace=inplace)
        if device > profile.total_memory:
            too_large.append((c, device, device_ring_slots(plan.slots, n, inplace=inplace)))
            return
        rows.append((c, n, predicted))

    for c in cands:
        consider(max(align, (min(c, total_bytes) // align) * align))
    if not rows and too_large and candidates is None:
        # no candidate's rings fit the device: smaller chunks (halving, whole rows), the largest that fits
        c = min(seen)
        while not rows and c > align:
            c = max(align, c // 2 // align * align)
            consider(c)
    if not rows and too_large:
        c, need, (din, dout) = min(too_large)
        what = " (the smallest candidate)" if candidates is not None else (
            " (one row, the smallest)" if c == align > 1 else " (the smallest)")
        fix = ("give smaller candidates, or leave them to the planner" if candidates is not None else
               "plan for a device with more memory (a hardware profile of a larger total_memory)"
               + (", or rows of fewer bytes" if c == align > 1 else ""))
        raise ValueError(f"no chunk fits the device's memory: chunk_bytes of {c} bytes{what} needs {need:.0f} bytes "
                         f"of device rings ({din} device-in and {dout} device-out slots), more than the hardware "
                         f"profile's total_memory of {profile.total_memory} bytes; {fix}")
    if not rows:
        raise ValueError(f"no chunk size's planned pinned rings fit a pinned_budget of {pinned_budget} bytes; raise "
                         "pinned_budget, or give chunk_bytes (planned rings then shrink to fit the budget)")
    best = min(rows, key=lambda r: (r[2], -r[0]))
    near = [r for r in rows if r[2] <= best[2] * (1 + PREDICTION_TIE)]
    if any(sides) and len(near) > 1:  # (see "Choosing a staged chunk among near ties")
        # every field a staged figure may come from, so that a one-side job's (measured, or the
        # midpoint of the other two) is the margin times its own too
        margin = HOST_LOAD_MARGIN * host_seconds_per_chunk(profile, sides)
        loaded = dataclasses.replace(profile, staged_chunk_host_s=margin, scheduled_chunk_host_s=margin,
                                     one_side_chunk_host_s=margin)

        def under_load(row: tuple) -> tuple:
            _, seconds = predict_seconds(loaded, total_bytes, row[0], compute_s_per_byte=compute_s_per_byte,
                                         workers=workers, host_stages=sides, out_ratio=out_ratio,
                                         compute_s_per_chunk=compute_s_per_chunk)
            return seconds, row[2], -row[0]

        best = min(near, key=under_load)
    return ChunkChoice(best[0], best[1], best[2], tuple(rows))
