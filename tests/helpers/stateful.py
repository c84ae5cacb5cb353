"""Hypothesis settings for the pipeline's state machines: each file's own example and step counts
in the default run (the core machine and the threaded one derandomized, so CI repeats them), and
one switch for a soak on any machine: ``RINGFLOW_SM_SEED=1`` explores new random sequences in every
state machine (with pytest's ``--hypothesis-seed=N``, a chosen one), and ``RINGFLOW_SM_EXAMPLES``
sets every machine's number of examples.

    RINGFLOW_SM_SEED=1 RINGFLOW_SM_EXAMPLES=400 python -m pytest -q tests/pipeline -k machine
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings


def machine_settings(examples: int, steps: int, *, derandomize: bool = False) -> settings:
    """Settings for one state machine: ``examples`` examples of up to ``steps`` rules each, no
    deadline, unless the environment asks for a soak (see the module docstring)."""
    soak = os.environ.get("RINGFLOW_SM_SEED") is not None
    count = os.environ.get("RINGFLOW_SM_EXAMPLES")
    return settings(max_examples=int(count) if count else examples, stateful_step_count=steps, deadline=None,
                    derandomize=derandomize and not soak,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
