"""The progress thread's command queue: commands posted without the pipeline's lock."""

from __future__ import annotations

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
