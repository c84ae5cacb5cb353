"""Ray Data batches through a GPU: :class:`RayMapper`, a callable class for
``ray.data.Dataset.map_batches`` that streams each batch's columns through
:func:`~ringflow.stream_map` on its actor's device.

Nothing here imports Ray: Ray constructs the class in each actor and calls it with batches (a
dict of numpy arrays or a pandas DataFrame), so ``import ringflow`` and ``ringflow.RayMapper``
work without Ray installed; nor is pandas imported (a DataFrame batch comes from a process that
has imported it).
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import weakref
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ._checks import as_dtype
from ._device import ALL_GPUS, ENV_VAR, device as make_device, named_device
from ._device.protocol import Device, close_quietly
from ._errors import StageError, describe, unpicklable
from ._pipeline.engine import choose_engine
from ._pipeline.validate import COMPUTE_FORM, check_arity, check_not_masked, check_options
from ._pipeline.warm import WARM
from ._pipeline.whole_array import check_arrays, stream_map

# stream_map's keyword options a mapper passes through unchanged (device and keep_warm are its own)
PASSED_OPTIONS = ("chunk_bytes", "host", "engine", "inplace", "slots", "workers", "checked", "on_error",
                  "pinned_budget")


class RayMapper:
    """A callable class for ``ray.data.Dataset.map_batches``: each Ray actor makes its device
    once and streams every batch's selected columns through ``f`` with
    :func:`~ringflow.stream_map`, whose engine stays warm across the actor's batches.

    >>> ds = ds.map_batches(rf.RayMapper, fn_constructor_kwargs={"f": f, "columns": ["x"],
    ...                     "output_columns": ["y"]}, batch_format="numpy", batch_size=65536,
    ...                     num_gpus=1, compute=ray.data.ActorPoolStrategy(size=4))

    How columns map: one selected column is streamed as it is (shape ``(rows, ...)``, any
    numeric dtype); several are stacked side by side into one C-contiguous array of shape
    ``(rows, k, ...)`` (so ``f`` sees all of a row's columns in one chunk) and the result is split
    back, column ``i`` of the result going to ``output_columns[i]``. Output columns replace
    columns of the same name and are added otherwise; every other column passes through
    unchanged. A "numpy" batch (dict of arrays) comes back as a dict, a "pandas" batch
    (DataFrame) as a DataFrame.

    Args:
        f: the compute, ``f(x_chunk, y_chunk)`` as for :func:`~ringflow.stream_map`; it must
            pickle (Ray ships it to every actor).
        columns: the column name(s) to stream, a string or a sequence of strings; None takes
            every column of the batch.
        output_columns: where the result goes, one name per entry of ``columns``; None writes
            the results over ``columns``.
        dtype: the numeric numpy dtype, in this machine's byte order, the selected columns are
            cast to before streaming; None requires them to share one dtype, in this machine's
            byte order.
        id_column: a column whose values identify rows across the dataset; a failure then also
            names the first and last of them among the failed rows.
        device: a device spec (``"auto"``, ``"cuda"``, ``"cuda:N"``, ``"sim"``), made once in
            each actor; None reads ``RINGFLOW_DEVICE`` there, else ``"auto"``. Under Ray
            ``num_gpus=1``, ``"auto"``/``"cuda"`` is the actor's own GPU (Ray sets
            ``CUDA_VISIBLE_DEVICES``); in an actor without one, ``"auto"`` gives the simulated
            GPU (with a warning) and ``"cuda"`` raises. A mapper runs on one device: a list of
            them and ``"cuda:all"`` are refused (run one actor a GPU instead).
        device_options: keyword options for :func:`ringflow.device` (``profile``,
            ``seed``, ``array``, ...), as ``device`` takes them: ``"auto"`` takes all of
            these, ``"sim"`` refuses ``array`` (a GPU's option) and ``"cuda"`` takes only it.
        **options: :func:`~ringflow.stream_map`'s options ``chunk_bytes``, ``host``,
            ``engine``, ``inplace``, ``slots``, ``workers``, ``checked``, ``on_error``,
            ``pinned_budget``.

    Raises:
        TypeError, ValueError: a bad argument, when the mapper is constructed (the message
            names it and what it accepts).
        DeviceUnavailableError: ``device`` asks for CUDA and the actor has no usable GPU.
    """

    def __init__(self, f: Callable, columns: "str | Sequence[str] | None" = None,
                 output_columns: "str | Sequence[str] | None" = None, *, dtype: Any = None,
                 id_column: Optional[str] = None, device: Optional[str] = None,
                 device_options: Optional[dict] = None, **options: Any):
        if not callable(f):
            raise TypeError(f"RayMapper needs a callable f(x, y) as its first argument, got {type(f).__name__}")
        check_arity("RayMapper's first argument", f, 2, COMPUTE_FORM)
        self.f = f
        self.columns = _names("columns", columns)
        self.output_columns = _names("output_columns", output_columns)
        if self.output_columns is not None and self.columns is None:
            raise ValueError("output_columns needs columns: name the input columns whose results go to "
                             f"{list(self.output_columns)}")
        if self.output_columns is not None and len(self.output_columns) != len(self.columns):
            raise ValueError(f"output_columns must name one column per entry of columns: got "
                             f"{len(self.output_columns)} for {len(self.columns)} ({list(self.columns)})")
        if self.output_columns is not None and len(set(self.output_columns)) != len(self.output_columns):
            raise ValueError(f"output_columns names a column twice: {list(self.output_columns)}")
        self.dtype = None if dtype is None else as_dtype(dtype)
        if self.dtype is not None and self.dtype.kind not in "biufc":  # the kinds of column it streams
            raise TypeError(f"dtype must be a numeric numpy dtype (bool, integer, float or complex, e.g. 'float32'), "
                            f"got {self.dtype}")
        if self.dtype is not None and not self.dtype.isnative:
            # every batch would be cast to it and then refused by stream_map (GPU code reads numbers
            # in this machine's order only), in words about stream_map's x, not this argument
            raise TypeError(f"RayMapper's dtype: dtype {self.dtype} is in non-native byte order, which GPU code "
                            f"(CuPy, PyTorch, a CUDA kernel) would misread; pass "
                            f"dtype='{self.dtype.newbyteorder('=')}' instead")
        if id_column is not None and not isinstance(id_column, str):
            raise TypeError(f"id_column must be a column name (a string) or None, got {type(id_column).__name__}")
        self.id_column = id_column
        if isinstance(device, Device):
            raise TypeError("RayMapper's device must be a spec string such as 'auto', 'cuda' or 'sim' (or None): "
                            "each Ray actor makes its own device from it, and a Device does not travel between "
                            "processes")
        _check_one_device(device)
        if device_options is not None and not isinstance(device_options, dict):
            raise TypeError(f"device_options must be a dict of ringflow.device keyword options, got "
                            f"{type(device_options).__name__}")
        for key in device_options or {}:
            if not isinstance(key, str):  # (Python's own error names no argument)
                raise TypeError(f"device_options must map ringflow.device keyword names (strings) to values, got the "
                                f"key {key!r} ({type(key).__name__}); e.g. device_options={{'seed': 0}}")
        unknown = sorted(set(options) - set(PASSED_OPTIONS))
        if unknown:
            raise TypeError(f"RayMapper got unexpected keyword argument(s) {unknown}; it passes these to "
                            f"stream_map: {', '.join(PASSED_OPTIONS)}")
        # refuse bad options here, where the actor starts, not at the first batch
        opts = check_options(allow_auto_chunk=True, **{k: v for k, v in options.items() if k not in ("host", "engine")})
        host, engine = options.get("host", "auto"), options.get("engine", "auto")
        check_arrays(f, np.zeros(1, np.uint8), None, host, engine, "RayMapper")
        # engine='direct' where host='stage' or the options rule it out; host='auto' is decided for
        # each batch's arrays, so with it only what rules direct out whatever the host is known now
        choose_engine(engine, host, opts)
        self.options = options
        self.device = make_device(device, **(device_options or {}))
        self._closed = False
        # Ray ends an actor by ending its process. Release the kept engines and the device then
        # (or when the mapper is collected) through close(), which finishes each engine first; an
        # atexit hook registered now runs before the engines' own exit-time finalisers. A "sim:N"
        # is the process's, shared with every other user of that name: it stays open.
        self._at_exit = functools.partial(_release, self.device, close=not named_device(self.device))
        # collected unclosed, it also drops the exit-time hook, which would otherwise hold the
        # (closed) device until the process ends
        self._finalizer = weakref.finalize(self, _collected, self._at_exit)
        self._finalizer.atexit = False
        atexit.register(self._at_exit)

    def __call__(self, batch: Any) -> Any:
        """Stream one batch's columns through ``f``; returns the batch with the results in
        ``output_columns``, every chunk's result in place.

        Args:
            batch: a dict of numpy arrays (``batch_format="numpy"``) or a pandas DataFrame
                (``batch_format="pandas"``).

        Returns:
            The same kind of batch: the input's columns, with ``output_columns`` replaced or added.

        Raises:
            StageError: a chunk failed; its message names the stage, the batch's rows the chunk
                held and the device, and it carries ``stage``, ``index`` (the chunk),
                ``rows`` (``(start, stop)`` within the batch), ``batch_rows`` and ``ids``
                (the first and last ``id_column`` values of those rows, or None); the
                original is ``__cause__``. It pickles, so Ray reports it as the task's error.
            TypeError, ValueError: a batch that is neither kind, a missing or non-numeric
                column (or no ``id_column``), columns of different dtypes or shapes, or a column
                in non-native byte order, without ``dtype``.
            RuntimeError: the mapper is closed, or was closed while it mapped this batch.

        A column of arrays (a pandas tensor column, or one array object per row, every row of
        one shape) streams as one array of ``(rows, *shape)``; in a DataFrame, each result of
        more than one dimension goes back as a tensor column (Ray Data's ``TensorArray``), or
        as one array per row where the input was.
        """
        if self._closed or self.device.closed:
            raise RuntimeError("this RayMapper is closed (close() released its device); make a new one to map "
                               "more batches")
        frame = _is_dataframe(batch)
        if not frame and not isinstance(batch, dict):
            raise TypeError(f"RayMapper takes a batch as a dict of numpy arrays (batch_format='numpy') or a "
                            f"pandas DataFrame (batch_format='pandas'), got {type(batch).__name__}")
        if self.id_column is not None and self.id_column not in batch:
            # found only when a failure named no ids: refused before any work instead
            have = [str(c) for c in batch.keys()]
            raise ValueError(f"RayMapper: the batch has no id_column {self.id_column!r} (it has {have}); fix id_column=")
        names = self.columns if self.columns is not None else tuple(batch.keys())
        if not names:
            raise ValueError("RayMapper got a batch with no columns; pass columns=[...] naming what to stream")
        x, as_rows = self._gather(batch, names, frame)
        try:
            y = stream_map(self.f, x, device=self.device, keep_warm=True, **self.options)
        except Exception as exc:
            if self.device.closed:
                # closed on another thread meanwhile: the device's own words would advise making a
                # new device, which a mapper's caller cannot give it
                raise RuntimeError("this RayMapper was closed (close()) while it mapped this batch, so the batch has "
                                   "no result; close a mapper once its calls have returned, and make a new one to "
                                   "map more batches") from exc
            if isinstance(exc, StageError):
                raise self._failure(exc, x, batch, frame) from exc.__cause__
            raise
        outputs = self.output_columns if self.output_columns is not None else names
        if len(names) == 1:
            results = {outputs[0]: y}
        else:
            results = {name: np.ascontiguousarray(y[:, i]) for i, name in enumerate(outputs)}
        if frame:  # (not DataFrame.assign, which takes string names only)
            out = batch.copy(deep=False)
            for name, y in results.items():
                out[name] = _frame_column(y, as_rows)
            return out
        return {**batch, **results}

    def close(self) -> None:
        """Release this mapper's kept engines and its device (a ``"sim:N"`` stays open: the process
        keeps it for every user of that name); harmless twice. It also runs when the mapper is
        collected or the process exits (as a Ray actor's does)."""
        if hasattr(self, "_at_exit"):
            self._closed = True
            atexit.unregister(self._at_exit)
            self._finalizer()

    def __reduce__(self):
        """Refuse to pickle or copy: the mapper holds its process's device and kept engines.

        Raises:
            TypeError: always, naming the class to give Ray instead.
        """
        # Ray Data takes an instance given to map_batches for a plain function and pickles it for
        # its workers: without this the error named a lock deep inside the device
        raise TypeError("a RayMapper does not pickle or copy: it holds its process's device and engines. Give "
                        "Ray the class and its arguments, and each actor makes its own: "
                        "ds.map_batches(rf.RayMapper, fn_constructor_kwargs={'f': f, ...}, ...)")

    def __repr__(self) -> str:
        cols = "every column" if self.columns is None else list(self.columns)
        outs = "" if self.output_columns is None else f" -> {list(self.output_columns)}"
        return f"<RayMapper {getattr(self.f, '__name__', type(self.f).__name__)} on {cols}{outs}, {self.device.name}>"

    def _gather(self, batch: Any, names: Sequence[str], frame: bool) -> "tuple[np.ndarray, bool]":
        """The selected columns as one numpy array (stacked along axis 1 when several), and
        whether one of them was a column of array objects (its rows stacked here)."""
        cols = []
        as_rows = False
        for name in names:
            if name not in batch:
                have = [str(c) for c in batch.keys()]
                raise ValueError(f"RayMapper: the batch has no column {name!r} (it has {have}); fix columns=")
            if frame and list(batch.columns).count(name) > 1:  # batch[name] would be a DataFrame of them
                raise ValueError(f"RayMapper: the batch has {list(batch.columns).count(name)} columns named {name!r}; "
                                 "rename them so each name is one column")
            if frame and _is_nullable(batch[name].dtype) and bool(batch[name].isna().any()):
                raise TypeError(f"RayMapper streams numeric columns; column {name!r} of pandas' nullable dtype "
                                f"{batch[name].dtype} holds missing values, which have no numpy equivalent: fill "
                                "them first (e.g. .fillna(0))")
            col = batch[name].to_numpy() if frame else batch[name]
            check_not_masked(f"RayMapper: column {name!r}", col)
            if not isinstance(col, np.ndarray):
                try:
                    col = np.asarray(col)
                except (TypeError, ValueError) as exc:  # rows of several lengths, say: numpy names no column
                    raise ValueError(f"RayMapper: column {name!r} is not one numpy array ({exc}); give it as a numpy "
                                     "array, every row of one shape") from None
            if col.ndim == 0:
                raise TypeError(f"RayMapper streams columns of rows; column {name!r} is a single value "
                                f"(a 0-d array of {col.dtype}): give it as an array with one row per record")
            shapes = _row_shapes(col)
            if len(shapes) == 1:
                col, as_rows = self._stacked(name, col), True
            if col.dtype.hasobject or col.dtype.kind not in "biufc":
                if len(shapes) > 1:  # Ray Data's ragged tensor column
                    raise ValueError(f"RayMapper streams columns whose rows have one shape; column {name!r} holds "
                                     f"arrays of shapes {_shapes_seen(col)} (a ragged tensor column): pad or "
                                     "resize them to one shape in an earlier map_batches, or stream each row with "
                                     "rf.Pipeline")
                why = (" (a pandas column of objects, strings or nullable values; convert it to a numpy dtype "
                       "first, or use batch_format='numpy' for tensor columns)") if frame else ""
                pick = "" if self.columns is not None else "; name the columns to stream with columns=[...]"
                raise TypeError(f"RayMapper streams numeric columns; column {name!r} has dtype {col.dtype}{why}{pick}")
            if self.dtype is None and not col.dtype.isnative:
                # stream_map would refuse it as its x, which names no column; dtype= casts it
                raise TypeError(f"RayMapper: column {name!r} has dtype {col.dtype}, in non-native byte order, "
                                "which GPU code (CuPy, PyTorch, a CUDA kernel) would misread; pass "
                                f"dtype='{col.dtype.newbyteorder('=')}' to convert it")
            cols.append(col)
        if self.dtype is None:
            dtypes = {c.dtype for c in cols}
            if len(dtypes) > 1:
                found = ", ".join(f"{n}: {c.dtype}" for n, c in zip(names, cols))
                raise ValueError(f"RayMapper stacks columns {list(names)} into one array, but their dtypes differ "
                                 f"({found}); pass dtype= (e.g. dtype='float32') to cast them to one")
        if len(cols) == 1:
            return np.ascontiguousarray(cols[0], dtype=self.dtype), as_rows
        if len({len(c) for c in cols}) > 1:
            found = ", ".join(f"{n}: {len(c)} rows" for n, c in zip(names, cols))
            raise ValueError(f"RayMapper: the columns of one batch have one length each; got {found}")
        shapes = {c.shape for c in cols}
        if len(shapes) > 1:
            found = ", ".join(f"{n}: {c.shape}" for n, c in zip(names, cols))
            raise ValueError(f"RayMapper stacks columns {list(names)} side by side, so they need one shape per row "
                             f"({found}); map them with separate RayMappers instead")
        x = np.empty((cols[0].shape[0], len(cols), *cols[0].shape[1:]), self.dtype or cols[0].dtype)
        for i, c in enumerate(cols):
            x[:, i] = c
        return x, as_rows

    def _stacked(self, name: str, col: np.ndarray) -> np.ndarray:
        """A column of arrays of one shape as one array ``(rows, *shape)`` (a copy).

        Raises:
            ValueError: the rows' dtypes differ and no ``dtype`` was given.
        """
        dtypes = sorted({v.dtype for v in col.flat}, key=str)
        if len(dtypes) > 1 and self.dtype is None:
            raise ValueError(f"RayMapper: column {name!r} holds arrays of dtypes {', '.join(map(str, dtypes))}; "
                             "pass dtype= (e.g. dtype='float32') to cast them to one")
        return np.stack(list(col.flat)).astype(self.dtype or dtypes[0], copy=False)

    def _failure(self, exc: StageError, x: np.ndarray, batch: Any, frame: bool) -> "BatchStageError":
        """``exc`` restated in the batch's rows: those stream_map's engine says the failed chunk
        held (its ``rows``)."""
        rows = getattr(exc, "rows", None)
        start, stop = rows if rows is not None else (0, len(x))  # (one device: always there)
        ids = None
        if self.id_column is not None and self.id_column in batch and stop > start:
            col = batch[self.id_column].to_numpy() if frame else np.asarray(batch[self.id_column])
            if col.ndim >= 1 and len(col) == len(x):  # else its values are not the rows': no ids, the failure still said
                ids = (_plain(col[start]), _plain(col[stop - 1]))
        return BatchStageError(exc.stage, exc.index, (start, stop), len(x), ids, self.id_column, self.device.name,
                               exc.__cause__)


class BatchStageError(StageError):
    """A :class:`~ringflow.StageError` restated in a batch's rows: ``rows`` is the failed
    chunk's ``(start, stop)`` within the batch, ``batch_rows`` the batch's length, ``ids`` the
    first and last ``id_column`` values of those rows (or None), ``where`` the device's name.

    It pickles (Ray ships it from the actor to the driver); an original exception that does not
    pickle and unpickle travels as a RuntimeError carrying its type name and message."""

    def __init__(self, stage: str, index: int, rows: tuple, batch_rows: int, ids: Optional[tuple] = None,
                 id_column: Optional[str] = None, where: str = "", cause: Optional[BaseException] = None):
        super().__init__(stage, index, cause)
        self.rows, self.batch_rows, self.ids, self.id_column, self.where = tuple(rows), batch_rows, ids, id_column, where
        what = describe(cause) if cause is not None else "failed"
        span = f"rows {rows[0]}..{rows[1] - 1}" if rows[1] > rows[0] else "no rows"
        named = f"{id_column} {ids[0]!r}..{ids[1]!r}, " if ids is not None else ""
        on = f" on {where}" if where else ""
        self.args = (f"stage {stage!r} failed for {span} of a batch of {batch_rows} rows ({named}chunk {index}){on}: "
                     f"{what}",)

    def __str__(self) -> str:
        return self.args[0]

    def __reduce__(self):
        cause = self.__cause__
        if cause is not None:
            if unpicklable(cause) is not None:  # (one that pickles but does not load would fail this error's own)
                cause = RuntimeError(describe(cause))
        # the message as it was made, whatever stands in for the cause
        return (type(self), (self.stage, self.index, self.rows, self.batch_rows, self.ids, self.id_column,
                             self.where, cause), {"args": self.args})


def _check_one_device(device: Any) -> None:
    """Refuse a ``device`` that names no single device for the actor: anything but a spec string
    or None, and ``"cuda:all"`` (given, or read from ``RINGFLOW_DEVICE`` for None).

    Raises:
        TypeError: ``device`` is not a string (a list of devices included).
        ValueError: ``device`` is ``"cuda:all"``, or is None where ``RINGFLOW_DEVICE`` is.
    """
    # (ringflow.device's own errors name its spec argument, which the mapper's caller never
    # called, and send 'cuda:all' to stream_map, which the caller cannot reach through a mapper)
    how = ("each Ray actor streams its batches on one device: ask Ray for one GPU an actor with num_gpus=1 "
           "and pass 'auto' or 'cuda' (or None); to use several GPUs, run several actors "
           "(compute=ray.data.ActorPoolStrategy(size=N))")
    if device is not None and not isinstance(device, str):
        raise TypeError(f"RayMapper's device must be one device spec string such as 'auto', 'cuda', 'cuda:0' or "
                        f"'sim', or None; got {type(device).__name__} {device!r}: {how}")
    spec, where = (device, "") if device is not None else (os.environ.get(ENV_VAR), f" (from {ENV_VAR})")
    if isinstance(spec, str) and spec.strip() == ALL_GPUS:
        raise ValueError(f"RayMapper's device is {spec.strip()!r}{where}, which names every GPU, but a mapper runs "
                         f"on one device: {how}")


def _release(dev: Device, close: bool = True) -> None:
    """Close ``dev``'s kept engines, then ``dev`` where ``close`` (not a "sim:N" the process
    shares); never raises."""
    if not dev.closed:
        WARM.drop(dev)
        if close:
            close_quietly(dev, "device")


def _collected(release: Callable[[], None]) -> None:
    """A mapper's finalizer: unregister its exit-time hook ``release``, then run it; never raises."""
    atexit.unregister(release)
    release()


def _names(arg: str, value: Any) -> "tuple[str, ...] | None":
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (set, frozenset)):
        # its order, which stacks the columns and pairs them with output_columns, follows string
        # hashing, which differs from one process (one Ray actor) to the next
        raise TypeError(f"{arg} must be a column name or a list of column names, in order; got a "
                        f"{type(value).__name__}, whose order differs between processes: pass a list, e.g. "
                        f"{sorted(map(str, value))}")
    try:
        names = tuple(value)
    except TypeError:
        raise TypeError(f"{arg} must be a column name or a list of column names, got {type(value).__name__}") from None
    if not names or not all(isinstance(n, str) for n in names):
        raise TypeError(f"{arg} must be a non-empty list of column names (strings), got {list(names)!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"{arg} names a column twice: {list(names)}")
    return names


def _row_shapes(col: np.ndarray) -> set:
    """The shapes of a column of numeric arrays, one a row (empty for any other column): one
    shape is a tensor column to stack, several a ragged one."""
    if not (col.dtype.hasobject and col.ndim == 1 and col.size > 0
            and all(isinstance(v, np.ndarray) and v.dtype.kind in "biufc" for v in col.flat)):
        return set()
    return {v.shape for v in col.flat}


def _frame_column(y: np.ndarray, as_rows: bool) -> Any:
    """A result as a DataFrame column: as it is with one dimension; else Ray Data's tensor
    column (pandas takes no 2-D array as a column), or one array a row where the input came so
    or Ray is not installed."""
    if y.ndim == 1:
        return y
    if not as_rows:
        try:
            from ray.data.extensions import TensorArray
        except ImportError:
            pass
        else:
            return TensorArray(y)
    rows = np.empty(len(y), object)
    rows[:] = list(y)
    return rows


def _shapes_seen(col: np.ndarray, most: int = 3) -> str:
    """The first ``most`` distinct row shapes of a ragged column, for an error message."""
    seen: list = []
    for v in col.flat:
        if v.shape not in seen:
            seen.append(v.shape)
            if len(seen) == most:
                return ", ".join(map(str, seen)) + ", ..."
    return ", ".join(map(str, seen))


def _is_dataframe(batch: Any) -> bool:
    # a DataFrame exists only where pandas is imported already: never import it for a dict batch
    pandas = sys.modules.get("pandas")
    return pandas is not None and isinstance(batch, pandas.DataFrame)


def _plain(value: Any) -> Any:
    """A numpy scalar or array as the Python value or list (so messages and pickles carry no
    numpy types)."""
    return value.item() if isinstance(value, np.generic) else value.tolist() if isinstance(value, np.ndarray) else value


def _is_nullable(dtype: Any) -> bool:
    """Whether ``dtype`` is one of pandas' nullable dtypes (Int64, Float64, boolean, string...):
    their missing value is ``pandas.NA``."""
    pd = sys.modules.get("pandas")
    na = getattr(pd, "NA", None)
    return na is not None and getattr(dtype, "na_value", None) is na
