"""Module-level prepare functions for ``Pipeline(processes=True)`` tests: worker processes get
them by reference, so they cannot live inside a test."""

from __future__ import annotations

import collections
import os
import select
import signal
import threading
import time

import numpy as np


def ramp(item: int) -> np.ndarray:
    """A float32 array of ``item % 97 + 1`` elements counting up from ``item``."""
    return np.arange(item, item + item % 97 + 1, dtype=np.float32)


def ramp_and_pid(item: int) -> np.ndarray:
    """Element 0: the worker's process id (as float64); then :func:`ramp` of ``item``."""
    return np.concatenate([[float(os.getpid())], ramp(item).astype(np.float64)])


def fails_on_7(item: int) -> np.ndarray:
    if item == 7:
        raise ValueError("item 7 is broken")
    return ramp(item)


def not_an_array(item: int):
    return [item]


def not_anything(item: int):
    return f"item {item}"


def uint16_on_3(item: int) -> np.ndarray:
    """:func:`ramp`, but uint16 zeros for item 3."""
    return np.zeros(4, np.uint16) if item == 3 else ramp(item)


def uint16_leaf_on_3(item: int):
    """:func:`ramp` in a dict, with a uint16 leaf beside it for item 3."""
    return {"a": ramp(item), "b": np.zeros(4, np.uint16)} if item == 3 else {"a": ramp(item)}


def too_big(item: int) -> np.ndarray:
    return np.zeros(1 << 20, np.uint8)


def dies_on_3(item: int) -> np.ndarray:
    """Kills its worker process on item 3 (a crash, not an exception)."""
    if item == 3:
        os._exit(7)
    return ramp(item)


def ramp_in_slot(item: int) -> np.ndarray:
    """:func:`ramp` built in the item's pinned slot (``ringflow.host.empty_slot``)."""
    import ringflow as rf

    n = item % 97 + 1
    out = rf.host.empty_slot((n,), np.float32)
    out[:] = np.arange(item, item + n, dtype=np.float32)
    return out


class NeedsTwoArguments(Exception):
    """Pickles, but cannot be unpickled: pickle rebuilds it from ``args``, one argument."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class HoldsALambda(Exception):
    """Cannot be pickled at all: it holds a lambda."""

    def __init__(self, message: str):
        super().__init__(message)
        self.check = lambda: None


def fails_on_5_unpicklably(item: int) -> np.ndarray:
    """Item 5 raises an exception that cannot travel back from a worker process (unpickling it fails)."""
    if item == 5:
        raise NeedsTwoArguments("item 5 is broken", 5)
    return ramp(item)


def fails_on_5_with_a_lambda(item: int) -> np.ndarray:
    """Item 5 raises an exception that cannot be pickled in the worker process."""
    if item == 5:
        raise HoldsALambda("item 5 is broken")
    return ramp(item)


def segfaults_on_3(item: int) -> np.ndarray:
    """Kills its worker process with SIGSEGV on item 3 (as a crash in a C extension would)."""
    if item == 3:
        os.kill(os.getpid(), signal.SIGSEGV)
    return ramp(item)


def killed_on_3(item: int) -> np.ndarray:
    """Its worker process is SIGKILLed on item 3 (as the kernel's OOM killer does)."""
    if item == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return ramp(item)


def reports_then_waits(item) -> np.ndarray:
    """An int: :func:`ramp` of it. A ``(n, ready, go)`` tuple: writes the worker's pid to the FIFO
    at ``ready``, then waits for a line on the FIFO at ``go`` and returns :func:`ramp` of ``n``;
    with ``go`` None it never returns (a prepare stuck for good)."""
    if isinstance(item, int):
        return ramp(item)
    n, ready, go = item
    with open(ready, "w") as fifo:
        fifo.write(f"{os.getpid()}\n")
    if go is None:
        threading.Event().wait()
    with open(go) as fifo:
        fifo.readline()
    return ramp(n)


# real seconds a worker is given to report before the test calls it a hang: long, since a worker
# process starting on a loaded 2-CPU machine may take seconds (a passing test never waits it out)
HANG_S = 60.0


class Fifo:
    """A named pipe under ``folder`` that the test reads (a worker reports on it) or writes (a
    worker waits on it), with a timeout, so a test that fails does not hang."""

    def __init__(self, folder, name: str):
        self.path = str(folder / name)
        os.mkfifo(self.path)

    def read_line(self, timeout: float = HANG_S) -> str:
        """The first line a worker writes (opening it for writing blocks the worker until now).

        Raises:
            TimeoutError: nothing came within ``timeout`` seconds.
        """
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            data = b""
            deadline = time.monotonic() + timeout
            while not data.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    raise TimeoutError(f"nothing was written to {self.path} within {timeout} s")
                chunk = os.read(fd, 64)
                if not chunk and not data:
                    continue  # (no writer yet: select reports EOF until one opens it)
                data += chunk
            return data.decode().strip()
        finally:
            os.close(fd)

    def write_line(self, text: str = "go", timeout: float = HANG_S) -> None:
        """Write one line for a worker waiting on the FIFO (its reader).

        Raises:
            TimeoutError: no reader opened it within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError:  # ENXIO: no reader yet
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nobody opened {self.path} for reading within {timeout} s") from None
                select.select([], [], [], 0.005)
        try:
            os.write(fd, f"{text}\n".encode())
        finally:
            os.close(fd)


def dies_or_waits(item) -> np.ndarray:
    """``"die"``: kills its worker process (exit code 7); anything else: :func:`reports_then_waits`."""
    if item == "die":
        os._exit(7)
    return reports_then_waits(item)


class EndsItsWorkerAsItStarts:
    """A prepare whose unpickling, in each worker process as it starts, ends that process (exit
    code 3): as a worker that cannot start does (a script without a ``__main__`` guard, run again
    in the worker, or a module that does not import there)."""

    def __call__(self, item: int) -> np.ndarray:
        return ramp(item)

    def __reduce__(self):
        return os._exit, (3,)


class ArrivesBroken:
    """An item that pickles but cannot be unpickled (pickle rebuilds it with one argument, its
    ``__init__`` takes two): it fails in the worker process that receives it."""

    def __init__(self, n: int, why: str):
        self.n = n

    def __reduce__(self):
        return ArrivesBroken, (self.n,)


def ramp_of_n(item) -> np.ndarray:
    """:func:`ramp` of ``item.n`` for an object with an ``n``, else of ``item``."""
    return ramp(getattr(item, "n", item))


_KEPT: dict = {}  # keeps_its_first_slot's array, per worker process


def keeps_its_first_slot(item: int) -> np.ndarray:
    """Fills an ``empty_slot`` array with ``item``, but returns the one its worker's first
    prepare got (kept past that prepare's return: the pipeline's memory, another item's slot
    once that slot is reused), filled with ``item`` too where it is that same slot."""
    import ringflow as rf

    out = rf.host.empty_slot((8,), np.float32)
    out[:] = item
    return _KEPT.setdefault("first", out)


# made under another name than the one it is bound to: pickle looks a class up by the name it was
# made with, so it cannot pickle this one (a thread's prepare may return it all the same)
Misnamed = collections.namedtuple("NotItsName", "x y")


def misnamed_on_3(item: int):
    """:func:`ramp` of ``item`` and of ``item + 1`` in a :data:`Misnamed` named tuple for item 3
    (a structure a worker process cannot send back), in a plain tuple for the others."""
    pair = (ramp(item), ramp(item + 1))
    return Misnamed(*pair) if item == 3 else pair


def _with_a_thread_that_never_ends(prepare):
    """``prepare``, after starting a thread that never ends and is no daemon (as some libraries
    start one at import): the worker process that unpickles it cannot exit by itself."""
    threading.Thread(target=threading.Event().wait, name="never-ends").start()
    return prepare


class KeepsItsWorkerFromExiting:
    """:func:`ramp`, unpickled in each worker process as :func:`ramp` with a thread that never
    ends started beside it: told to exit, a worker stays until it is killed."""

    def __call__(self, item: int) -> np.ndarray:
        return ramp(item)

    def __reduce__(self):
        return _with_a_thread_that_never_ends, (ramp,)


def _made_here(name: str, source: str):
    """The module ``name``, made from ``source`` in this process the first time it is asked for
    and registered in ``sys.modules``: its classes pickle here by their module's name, but a
    process that did not make it (the pipeline's) cannot import that name to unpickle them."""
    import sys
    import types

    module = sys.modules.get(name)
    if module is None:
        module = types.ModuleType(name)
        exec(source, module.__dict__)  # noqa: S102 - a fixed class definition, the test's own
        sys.modules[name] = module
    return module


def raises_a_class_of_its_worker_on_3(item: int) -> np.ndarray:
    """Item 3 raises an exception whose class only its worker process has (made there at run
    time): it pickles and unpickles there, but the pipeline's process cannot unpickle it."""
    if item == 3:
        module = _made_here("ringflow_test_worker_only_errors", "class OnlyInTheWorker(Exception):\n    pass\n")
        raise module.OnlyInTheWorker("item 3 is broken")
    return ramp(item)


def returns_a_class_of_its_worker_on_3(item: int):
    """:func:`ramp` of ``item`` and of ``item + 1``: in a named tuple whose type only its worker
    process has (made there at run time) for item 3, in a plain tuple for the others."""
    pair = (ramp(item), ramp(item + 1))
    if item != 3:
        return pair
    module = _made_here("ringflow_test_worker_only_pairs",
                        "import collections\nPair = collections.namedtuple('Pair', 'x y')\n")
    return module.Pair(*pair)


class RebuiltAsAnInt(Exception):
    """Pickles and unpickles, but as the int 5, not as an exception (its ``__reduce__`` says so)."""

    def __reduce__(self):
        return int, (5,)


def fails_on_5_rebuilt_as_an_int(item: int) -> np.ndarray:
    """Item 5 raises an exception that comes back from a worker process as an int."""
    if item == 5:
        raise RebuiltAsAnInt("item 5 is broken")
    return ramp(item)


def reports_its_pid_then_hangs(item) -> np.ndarray:
    """An int: :func:`ramp` of it. A ``(folder, how)`` pair: makes an empty file named by the
    worker's pid in ``folder``, then never returns: ``"sleep"`` waits in a call that lets go of
    the GIL, ``"spin"`` loops in Python."""
    if isinstance(item, int):
        return ramp(item)
    folder, how = item
    os.close(os.open(os.path.join(folder, str(os.getpid())), os.O_CREAT | os.O_WRONLY, 0o600))
    if how == "sleep":
        threading.Event().wait()
    while True:
        pass
