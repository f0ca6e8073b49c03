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


class HostStaging:
    """Reusable pinned host buffers for the rows that go to the CPU pool.

    With CuPy the rows are copied from the device into a page-locked buffer that
    grows as needed and is reused by every layer (a pool request is finished,
    its frames sent, before the next layer stages). With NumPy the rows are
    already on the host and come back as they are.
    """

    def __init__(self, backend: str):
        self.backend = backend
        self._buf: np.ndarray | None = None  # flat, pinned

    def rows_to_host(self, a) -> np.ndarray:
        if self.backend != "cupy":
            return np.ascontiguousarray(a)
        import cupyx

        n = a.size
        if self._buf is None or self._buf.size < n or self._buf.dtype != a.dtype:
            self._buf = cupyx.empty_pinned((max(n, 1 << 16),), dtype=a.dtype)
        out = self._buf[:n].reshape(a.shape)
        a.get(out=out)
        return out
