"""``Pipeline(like=...)``: results as another framework's arrays over the same memory (no copy)."""

from __future__ import annotations

from typing import Any, Callable, Optional

LIKES = ("numpy", "torch", "cupy")


def converter(like: Optional[str], deliver: str, device: Any) -> Optional[Callable[[Any], Any]]:
    """A function turning one result array into ``like``'s array over the same memory, or None
    (results as they are: numpy on the host, the device's framework on the device). A device
    result becomes an array of ``device``'s own GPU, whichever GPU is current where it is made.

    Raises:
        ValueError: ``like`` is not one of :data:`LIKES`, does not fit ``deliver`` (CuPy arrays
            live on the device, numpy arrays on the host), asks for device arrays of the
            simulated GPU, or its framework cannot be imported.
    """
    if like is None:
        return None
    if not isinstance(like, str) or like not in LIKES:  # (an array's `in` compares its elements)
        raise ValueError(f"like must be one of {', '.join(map(repr, LIKES))} or None, got {like!r}")
    if deliver == "host":
        if like == "cupy":
            raise ValueError("like='cupy' needs deliver='device': CuPy arrays live on the GPU; on the host "
                             "choose like='numpy' or like='torch'")
        if like == "numpy":
            return None
        return _host_tensor(_import("torch", like))
    if like == "numpy":
        raise ValueError("like='numpy' cannot hold results on the device; choose 'cupy' or 'torch', or "
                         "deliver='host'")
    if device.backend != "cuda":
        raise ValueError(f"like={like!r} with deliver='device' needs a CUDA GPU; on the simulated GPU a "
                         "delivered array is a launch argument")
    if like == "cupy":
        cupy = _import("cupy", like)
        return cupy.asarray
    torch = _import("torch", like)
    # by index: "cuda" is PyTorch's current GPU, and a result of another one would be copied there
    where = f"cuda:{device.index}"
    return lambda a: torch.as_tensor(a, device=where)


def _host_tensor(torch: Any) -> Callable[[Any], Any]:
    """``torch.from_numpy`` over a result viewed as its dtype's own numpy type: numpy has two
    scalar types for one 64-bit integer dtype (``np.ulonglong`` and ``np.ulong`` on Linux, equal
    as dtypes), and PyTorch takes only one of each pair. A result PyTorch refuses (unsigned
    16-, 32- and 64-bit ones in older releases) raises TypeError naming ``like`` and the dtype."""
    import numpy as np

    def convert(a: Any) -> Any:
        own = np.dtype(a.dtype.str)  # the dtype's sized type: the one PyTorch knows
        try:
            return torch.from_numpy(a if a.dtype.type is own.type else a.view(own))
        except (TypeError, ValueError, RuntimeError) as exc:  # what from_numpy raises varies
            raise TypeError(f"like='torch': a result of dtype {a.dtype} cannot be a tensor of this PyTorch "
                            f"{torch.__version__} ({exc}); return a dtype it has from the compute, or leave like "
                            f"unset and convert the numpy result yourself") from exc

    return convert


def _import(name: str, like: str) -> Any:
    try:
        return __import__(name)
    except Exception as exc:  # noqa: BLE001 - a broken install fails its import with an OSError (a missing library)
        raise ValueError(f"like={like!r} needs {name}, which cannot be imported here ({exc}); install it "
                         f"or leave like unset") from None


def convert_tree(value: Any, convert: Callable[[Any], Any]) -> Any:
    """``convert`` applied to every array of ``value`` (one array, or a tuple, list or dict of them)."""
    from .trees import flatten, unflatten

    leaves, tree = flatten(value)
    return unflatten(tree, [convert(leaf) for leaf in leaves])
