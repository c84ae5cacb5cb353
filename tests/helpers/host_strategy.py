"""Stage or register: a profile on which the choice turns on the job, and the layouts a test's
calls planned."""

from __future__ import annotations

import dataclasses

from ringflow import _plan as plan


def slow_staged_chunks(**changes):
    """The h200-pcie5 profile on a host whose scheduler spends 627 µs on a staged chunk, 209 µs on
    an unstaged one and whose direct engine spends 68 µs a chunk: a staged run of small chunks is
    bound by that host time, so registering wins at 1 MiB chunks and staging at 8 MiB for one
    call of 64 MiB or more. ``changes``: other fields to replace."""
    return dataclasses.replace(plan.get_profile("h200-pcie5"), name="slow-staged-chunks", staged_chunk_host_s=627e-6,
                               scheduled_chunk_host_s=209e-6, direct_chunk_host_s=68e-6, **changes)


def layouts_planned(monkeypatch) -> list:
    """A list that every whole-array layout planned from now on (``MapLayout.plan``, one per call,
    job or shard) is appended to, in order, for the rest of the test."""
    from ringflow._pipeline import whole_array

    seen: list = []
    layout_plan = whole_array.MapLayout.plan
    monkeypatch.setattr(whole_array.MapLayout, "plan", lambda *a, **k: seen.append(layout_plan(*a, **k)) or seen[-1])
    return seen
