"""An array that speaks DLPack and nothing else, for the item tests of the pipeline (on the CPU)
and of the CUDA backend (on the GPU)."""

from __future__ import annotations


class DLPackOnly:
    """Wraps an array and hands on its ``__dlpack__`` and ``__dlpack_device__``, nothing else (as a
    torch CPU tensor or a JAX array is seen by a pipeline)."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()
