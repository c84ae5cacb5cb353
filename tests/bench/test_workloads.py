"""Helpers of the bench's workloads (``ringflow._bench.workloads``)."""

from __future__ import annotations

import types

from ringflow._bench import workloads


def test_a_chunk_size_is_held_to_the_lowest_bound_of_its_profiled_calls():
    """One profiled call whose copies ran slow gives a high bound that unprofiled calls beat;
    the lowest over several calls is kept."""
    bounds = iter([6.53e-3, 5.40e-3, 5.52e-3])
    before = []
    rep = workloads.lowest_bound_report(lambda: types.SimpleNamespace(ideal_s=next(bounds)), calls=3,
                                        before=lambda: before.append(1))
    assert rep.ideal_s == 5.40e-3 and len(before) == 3
    one = workloads.lowest_bound_report(lambda: types.SimpleNamespace(ideal_s=1.0), calls=0, before=lambda: None)
    assert one.ideal_s == 1.0  # at least one call
