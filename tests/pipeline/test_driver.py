"""The progress thread's command queue: commands posted without the pipeline's lock."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np

import ringflow as rf
from tests.helpers.threads import JOIN_S, join, start


def _pipe():
    dev = rf.device("sim", seed=3, chaos=True)
    return rf.Pipeline(lambda x, y: np.multiply(x, 2, out=y), device=dev, chunk_bytes=512, checked=True)


def test_a_posted_command_runs_on_the_progress_thread_and_the_poster_never_waits_for_the_lock():
    pipe = _pipe()
    driver = pipe._driver
    ran_on, handed = [], threading.Event()
    outcome: dict = {}
    holding, release = threading.Event(), threading.Event()

    def hold():
        with driver.lock:
            holding.set()
            release.wait(JOIN_S)

    holder = start(hold)
    assert holding.wait(JOIN_S)
    # posted while another thread holds the lock: returns at once (this thread would otherwise
    # wait for the holder, which waits for it)
    driver.post(lambda: ran_on.append(threading.current_thread()) or 42,
                lambda cmd: (outcome.update(value=cmd.value, error=cmd.error), handed.set()))
    assert not handed.is_set()
    release.set()
    join([holder])
    assert handed.wait(JOIN_S)
    assert ran_on == [driver.thread] and outcome == {"value": 42, "error": None}
    pipe.close()


def test_a_command_posted_after_the_progress_thread_ended_is_handed_back_unrun():
    pipe = _pipe()
    driver = pipe._driver
    pipe.close()
    assert driver.ended and not driver.thread.is_alive()
    ran, handed = [], []
    driver.post(lambda: ran.append(1), handed.append)  # would otherwise wait for ever
    assert ran == [] and len(handed) == 1 and not driver.commands
    assert isinstance(handed[0].error, RuntimeError) and "ended" in str(handed[0].error)


EXIT_SCRIPT = r"""
import atexit, threading

def progress_threads_at_exit():  # registered first, so it runs after ringflow's own exit hook
    alive = [t.name for t in threading.enumerate() if t.name.startswith("ringflow-progress") and t.is_alive()]
    print("alive at exit:", alive, flush=True)

atexit.register(progress_threads_at_exit)

import numpy as np
import ringflow as rf

pipe = rf.Pipeline(lambda x, y: np.multiply(x, 2, out=y), device=rf.device("sim", seed=1), chunk_bytes=1024,
                   deliver="device", slots=rf.SlotCounts(host_in=1, device_in=1, device_out=1, host_out=1))
held = pipe.submit(np.ones(4, np.float32)).result(timeout=10)
futs = [pipe.submit(np.ones(4, np.float32)) for _ in range(3)]  # waiting for the slot held
print("left open", flush=True)
"""


def test_interpreter_exit_ends_the_progress_thread_of_a_pipeline_left_open():
    # a daemon thread still running when the interpreter finalises is frozen holding whatever lock
    # it held: the collector's finalisers, on the main thread afterwards, then waited for ever
    proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=JOIN_S)
    assert proc.returncode == 0, proc.stderr
    assert "left open" in proc.stdout and "alive at exit: []" in proc.stdout, proc.stdout + proc.stderr


def test_the_wake_flag_is_an_event_whose_set_takes_no_python_lock():
    from ringflow._pipeline.driver import WakeFlag

    flag = WakeFlag()
    assert not flag.is_set() and flag.wait(0.01) is False  # times out unset
    flag.set()
    flag.set()  # twice: still one pending wake, no error
    assert flag.is_set() and flag.wait(0) and flag.wait(None)  # stays set until cleared
    flag.clear()
    assert not flag.is_set() and flag.wait(0.01) is False
    waiter = start(flag.wait, None)
    flag.set()  # from another thread: the waiter wakes
    assert join([waiter]) == [True]
    flag.clear()
    flag.clear()
    assert not flag.is_set()
