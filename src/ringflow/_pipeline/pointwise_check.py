"""Checked mode's test of a compute's pointwise promise on the simulated GPU.

A pointwise compute (``pointwise=True``: element ``i`` of the output depends on element ``i`` of
the input alone) gets one launch over all the items sharing a chunk. A compute that breaks the
promise (a sum, a sort, a stencil, a normalisation) gives each item a result that depends on its
neighbours, silently, on a GPU. With ``checked=True`` on the simulated GPU, where the compute
runs on numpy arrays, each shared launch also runs the compute on each item alone and fails the
launch's items where the two differ.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np


def checked_pointwise(compute: Callable, parts: Sequence[tuple[int, int, int]], *, inplace: bool,
                      broken: Callable[[int, Exception], None]) -> Callable:
    """``compute`` for one launch over items sharing a chunk, that, given numpy arrays (the
    simulated GPU), also runs it on each item alone and compares. ``parts``: each item's
    ``(index, start, end)`` in elements of the launch's flat arrays. Given other arrays (a GPU's)
    it runs ``compute`` alone, and a kernel's fast launch path, which a GPU takes instead of
    calling it, is kept.

    The returned callable raises what ``compute`` raises over the whole launch, and a
    BaseException that is not an Exception (an interrupt) from a run alone. Where an item's
    result in the shared launch is not its result alone (floats compared to a relative 1e-5,
    integers exactly), or its run alone raises an Exception, it calls ``broken(index, error)``
    for that item, ``error`` a ValueError naming the item and ``pointwise=True`` (with the
    exception raised alone as its ``__cause__``), and returns normally: the other items'
    results stand."""
    def run(x: Any, y: Any) -> Any:
        if not isinstance(x, np.ndarray):
            return compute(x, y)
        inputs = [(index, start, end, x[start:end].copy()) for index, start, end in parts]
        result = compute(x, y)
        for index, start, end, alone_in in inputs:
            alone = alone_in if inplace else np.empty_like(alone_in)
            try:
                compute(alone_in, alone)
            except Exception as err:  # noqa: BLE001 - the item's own failure, not its neighbours'
                # the shared launch gave every item a result: one item's run alone raising
                # says nothing of the others, and an interrupt stays an interrupt
                error = ValueError(f"the compute was made with pointwise=True, and ran over item {index} alone "
                                   f"(checked mode's test of that promise on the simulated GPU) it raised "
                                   f"where the launch shared with other items did not: {err!r}")
                error.__cause__ = err
                broken(index, error)
                continue
            if not _same(y[start:end], alone):
                broken(index, ValueError(
                    f"the compute was made with pointwise=True, but item {index}'s result in a launch "
                    f"shared with other items differs from its result alone: each element of its output "
                    f"depends on more than the same element of its input (a sum, a sort, a stencil); "
                    f"drop pointwise=True (checked mode on the simulated GPU found this)"))
        return result

    # a kernel's fast launch path is kept: a GPU takes it (the test needs numpy arrays: the
    # simulated GPU calls ``run`` itself), so checked mode launches there as it did
    for name in ("__name__", "__qualname__", "sim_seconds", "pointwise", "__ringflow_launch__",
                 "_ringflow_writes_into_y"):
        if hasattr(compute, name):
            setattr(run, name, getattr(compute, name))
    return run


def _same(shared: np.ndarray, alone: np.ndarray) -> bool:
    if shared.dtype.kind in "fc":
        return bool(np.allclose(shared, alone, rtol=1e-5, atol=0.0, equal_nan=True))
    return bool(np.array_equal(shared, alone))
