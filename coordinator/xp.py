"""The array module of an array: CuPy for device arrays, NumPy otherwise.

The decoder's ops call ``xp_of(x)`` so the same code runs on either. Host
helpers move arrays across (``to_host``, ``to_device``).
"""

from __future__ import annotations

import numpy as np

try:  # CuPy is an optional extra
    import cupy as _cupy
except Exception:  # not installed, or a CUDA install that does not load
    _cupy = None


def xp_of(*arrays):
    if _cupy is not None:
        return _cupy.get_array_module(*arrays)
    return np


def module(backend: str):
    """'numpy' | 'cupy' -> the module."""
    if backend == "cupy":
        if _cupy is None:
            raise RuntimeError("CuPy is not importable")
        return _cupy
    return np


def to_host(a) -> np.ndarray:
    if _cupy is not None and isinstance(a, _cupy.ndarray):
        return _cupy.asnumpy(a)
    return np.asarray(a)


def to_device(a, backend: str):
    return module(backend).asarray(a)
