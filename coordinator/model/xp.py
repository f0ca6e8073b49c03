"""The array module of an array: NumPy, or a GPU's (CuPy) where a backend registered it at open.

The network's reference ops call ``xp_of(x)`` so the same code runs on either; this module imports no GPU
library: coordinator/gpu/backend.py registers CuPy when the GPU backend is chosen (``register``).
"""

from __future__ import annotations

import numpy as np

_MODULES: list = []  # array modules other than NumPy (CuPy), registered by the backends that use them


def register(module) -> None:
    """Make ``module``'s arrays (``module.ndarray``) known to xp_of, is_device and to_host (a module without its
    own array type, a kernel test's shim of NumPy arrays, changes nothing)."""
    if module is not np and hasattr(module, "ndarray") and module not in _MODULES:
        _MODULES.append(module)


def xp_of(*arrays):
    """The module of the arrays: the registered one whose ndarray the first non-NumPy array is, else NumPy."""
    for m in _MODULES:
        if any(isinstance(a, m.ndarray) and type(a) is not np.ndarray for a in arrays):
            return m
    return np


def is_device(a) -> bool:
    """An array of a registered GPU module (CuPy's)."""
    return any(isinstance(a, m.ndarray) and type(a) is not np.ndarray for m in _MODULES)


def to_host(a) -> np.ndarray:
    """A host NumPy array of ``a`` (a device array copied down, and the copy waited for)."""
    for m in _MODULES:
        if isinstance(a, m.ndarray) and type(a) is not np.ndarray:
            return m.asnumpy(a)
    return np.asarray(a)
