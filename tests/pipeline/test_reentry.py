"""A pipeline used from inside its own stages, and after fork(): a clear error, never a wait for itself.

A stage that waits for its own pipeline waits for itself: on a real GPU that is a hang (the
stage's worker never returns), or, from a compute on the progress thread, the scheduler stepped
from inside its own step. On the simulated GPU, where stages run on the progress thread, it used
to surface as the simulator's 'a host task must not block' or as a nested step; here each such
call must fail its chunk with a RuntimeError naming the call and the stage, and leave a pipeline
that closes clean.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import ringflow as rf
from ringflow._errors import StageError
from tests.helpers.pipeline_checks import closed_clean
from tests.helpers.threads import bounded

STAGES = ("prepare", "compute", "consume", "item_nbytes")

# what a stage does to its own pipeline (``held["pipe"]``) or to its own chunk's future
CALLS = {
    "submit()": lambda held: held["pipe"].submit(np.ones(4)),
    "map()": lambda held: list(held["pipe"].map([np.ones(4)])),
    "cancel()": lambda held: held["pipe"].cancel(),
    "close()": lambda held: held["pipe"].close(),
    "ChunkFuture.result()": lambda held: held["future"].result(),
    "ChunkFuture.exception()": lambda held: held["future"].exception(),
    "ChunkFuture.cancel()": lambda held: held["future"].cancel(),
    "__exit__": lambda held: held["pipe"].__exit__(ValueError, ValueError("x"), None),
}


def _pipe_calling(stage: str, act, seed: int = 3, devices: int = 1, devs: "list | None" = None):
    """A pipeline on the simulated GPU (over ``devices`` of them), or on ``devs``, one of whose
    stages runs ``act(held)``."""
    devs = devs or [rf.device("sim", seed=seed + i, chaos=True) for i in range(devices)]
    held: dict = {}

    real_act = act

    def act(held):
        if not held.get("quiet"):
            real_act(held)

    def f(x, y):
        if stage == "compute":
            act(held)
        y[...] = x * 2

    options: dict = {"chunk_bytes": 256, "slots": 2, "checked": True, "on_error": "continue"}
    if stage == "prepare":
        options["prepare"] = lambda item: (act(held), item)[1]
    elif stage == "consume":
        options["consume"] = lambda index, item, r: (act(held), np.array(r))[1]
    elif stage == "item_nbytes":
        options["prepare"] = lambda item: item
        options["item_nbytes"] = lambda item: (act(held), item.nbytes)[1]
    pipe = rf.Pipeline(f, device=devs[0] if devices == 1 else devs, **options)
    held["pipe"] = pipe
    return devs, pipe, held



@pytest.mark.parametrize("devices", (1, 2), ids=("one-device", "two-devices"))
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("call", list(CALLS))
def test_a_stage_waiting_for_its_own_pipeline_fails_its_chunk_naming_the_call_and_the_stage(stage, call, devices):
    # over two devices a stage of one device's part waits on the whole pipeline all the same
    devs, pipe, held = _pipe_calling(stage, CALLS[call], devices=devices)
    # the simulated GPU's progress thread runs only once someone waits: the stage runs after
    # the future is in ``held``
    held["future"] = fut = pipe.submit(np.arange(4.0))
    with pytest.raises(StageError) as err:
        bounded(lambda: fut.result(timeout=60), timeout=60)
    cause = err.value.__cause__
    assert isinstance(cause, RuntimeError), repr(cause)
    assert f"{call} was called from inside this pipeline's own {stage}" in str(cause)
    assert "would wait for itself" in str(cause)
    assert err.value.stage == stage
    # the pipeline goes on (on_error="continue"): a later item whose stage calls nothing is delivered
    held["quiet"] = True
    assert list(pipe.submit(np.arange(4.0)).result(timeout=60)) == [0.0, 2.0, 4.0, 6.0]
    closed_clean(devs, pipe)


@pytest.mark.gpu
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("call", ["submit()", "map()", "cancel()", "close()", "__exit__"])
def test_on_a_gpu_a_stage_waiting_for_its_own_pipeline_fails_its_chunk(cuda_device, stage, call):
    # there prepare and consume run on worker threads and compute on the progress thread: each
    # used to hang for good (a worker, or the progress thread, waiting for itself)
    devs, pipe, held = _pipe_calling(stage, CALLS[call], devs=[cuda_device])
    fut = pipe.submit(np.arange(4.0))
    with pytest.raises(StageError) as err:
        bounded(lambda: fut.result(timeout=60), timeout=60)
    assert f"{call} was called from inside this pipeline's own {stage}" in str(err.value.__cause__)
    held["quiet"] = True
    assert list(bounded(lambda: pipe.submit(np.arange(4.0)).result(timeout=60), timeout=60)) == [0.0, 2.0, 4.0, 6.0]
    bounded(pipe.close)
    s = pipe.stats()
    assert s.in_flight == 0 and s.accepted == s.delivered + s.failed + s.cancelled == 2, s


@pytest.mark.parametrize("stage", ("prepare", "compute", "consume"))
def test_a_stage_may_read_its_own_pipeline_and_the_result_of_a_chunk_already_ended(stage):
    seen: list = []

    def act(held):
        if "ended" in held:
            p = held["pipe"]
            seen.append((p.stats().accepted, len(p.failures), float(held["ended"].result()[0])))

    devs, pipe, held = _pipe_calling(stage, act)
    first = pipe.submit(np.full(4, 5.0))
    assert first.result(timeout=60)[0] == 10.0
    held["ended"] = first
    second = pipe.submit(np.full(4, 7.0))
    assert second.result(timeout=60)[0] == 14.0
    assert seen == [(2, 0, 10.0)]
    closed_clean(devs, pipe)


@pytest.mark.parametrize("devices", (1, 2), ids=("one-device", "two-devices"))
@pytest.mark.parametrize("call", ("job()", "job.close()"))
def test_a_mapjob_called_or_closed_from_inside_its_own_f(devices, call):
    # over two devices f runs on a shard's thread while the caller holds the job: a call of the
    # job from there used to wait for that caller forever
    held: dict = {}

    def f(x, y):
        if held.get("act"):
            held["act"] = False
            if call == "job()":
                held["job"]()
            else:
                held["job"].close()
        y[...] = x + 1

    x = np.arange(4096, dtype=np.float32)
    device = rf.device("sim", seed=5) if devices == 1 else [rf.device("sim", seed=5 + i) for i in range(devices)]
    job = rf.MapJob(f, x, device=device, chunk_bytes=1024)
    held["job"] = job
    assert (bounded(job) == x + 1).all()
    held["act"] = True
    if call == "job()":
        with pytest.raises(StageError) as err:
            bounded(job)
        cause = err.value.__cause__
        assert isinstance(cause, RuntimeError), repr(cause)
        assert "MapJob() was called from inside this job's own f" in str(cause)
    else:
        assert (bounded(job) == x + 1).all()  # the call f closed the job in ends first
    assert job.closed
    with pytest.raises(RuntimeError, match="closed"):
        job()


_FORK_CHILD = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    import ringflow as rf
    from tests.helpers.forks import leave_child

    def f(x, y):
        y[...] = x * 2

    pipe = rf.Pipeline(f, device=rf.device("sim"), chunk_bytes=256)
    done = pipe.submit(np.arange(4.0))
    assert list(done.result(timeout=60)) == [0.0, 2.0, 4.0, 6.0]
    job = rf.MapJob(f, np.arange(64.0), device=rf.device("sim"), chunk_bytes=128)
    job()
    spread = rf.Pipeline(f, device=[rf.device("sim"), rf.device("sim")], chunk_bytes=256)
    assert list(spread.submit(np.arange(4.0)).result(timeout=60)) == [0.0, 2.0, 4.0, 6.0]
    pid = os.fork()
    if pid == 0:
        signal.alarm(30)  # a hang in the child ends it, and the parent sees the signal
        lines = []
        for name, call in (("submit", lambda: pipe.submit(np.arange(4.0))),
                           ("map", lambda: list(pipe.map([np.arange(4.0)]))),
                           ("job", job),
                           ("spread", lambda: spread.submit(np.arange(4.0)))):
            try:
                call()
                lines.append(f"{name}: accepted")
            except RuntimeError as exc:
                lines.append(f"{name}: {exc}")
        lines.append("ended result: " + str(done.result().tolist()))
        pipe.close()
        job.close()
        spread.close()
        lines.append("closed")
        leave_child(lines)
    _, status = os.waitpid(pid, 0)
    print("child status", status)
    assert list(pipe.submit(np.arange(4.0)).result(timeout=60)) == [0.0, 2.0, 4.0, 6.0]
    job()
    assert list(spread.submit(np.arange(4.0)).result(timeout=60)) == [0.0, 2.0, 4.0, 6.0]
    pipe.close()
    job.close()
    spread.close()
    print("parent ok")
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
def test_a_pipeline_in_a_forked_child_refuses_naming_fork_and_the_parent_goes_on():
    run = subprocess.run([sys.executable, "-c", _FORK_CHILD], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONWARNINGS": "ignore::DeprecationWarning"})
    out = run.stdout
    assert run.returncode == 0, run.stderr[-2000:]
    assert "child status 0" in out, out + run.stderr[-2000:]
    for name, what in (("submit", "Pipeline"), ("map", "Pipeline"), ("job", "MapJob"), ("spread", "Pipeline")):
        assert f"{name}: this {what} was made in a parent process before fork()" in out, out
    assert "ended result: [0.0, 2.0, 4.0, 6.0]" in out and "closed" in out and "parent ok" in out, out
