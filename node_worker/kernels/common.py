"""What the compiled kernels share: numba's options and the CPU they are compiled for.

The compiled code is kept by shm/jit.py (one folder per build: the kernel sources, numba's version and the
target CPU), so a change of any kernel compiles anew and another checkout of the same sources reuses it.
"""

from __future__ import annotations

import platform
import types

from numba.core import config

from shm.jit import FAST, target_features

JIT = FAST  # nogil, cached (shm/jit.py's folder), fastmath where the IR does not fix the order

__all__ = ["JIT", "KernelTargetError", "check_target", "serial_twin", "target_features"]


def serial_twin(kernel, name: str):
    """``kernel``'s Python function compiled without parallel=True, named ``name``: its prange loops run on the
    calling thread, the same loop bodies in the same order, for work smaller than a parallel region's start.
    The name keeps numba's cache files of the two apart (numba names them by the function's qualified name)."""
    from numba import njit

    f = kernel.py_func
    twin = types.FunctionType(f.__code__, f.__globals__, name, f.__defaults__, f.__closure__)
    twin.__qualname__, twin.__module__, twin.__doc__ = name, f.__module__, f.__doc__
    return njit(**JIT)(twin)


class KernelTargetError(RuntimeError):
    """The CPU numba would compile the kernels for cannot run them."""


def check_target(features: frozenset[str], machine: str) -> None:
    """Refuse an x86 target without F16C (the float16 scales of q8, q4 and the GGUF blocks are widened by
    vcvtph2ps; without it LLVM calls __extendhfsf2, which numba cannot link, and the process stops inside
    LLVM): every x86-64 CPU since 2013 has it, but NUMBA_CPU_NAME=generic (numba's portable cache) leaves it
    out. Other machines (aarch64) convert float16 in their base instructions."""
    if machine.lower() in ("x86_64", "amd64") and "f16c" not in features:
        raise KernelTargetError(
            f"the kernels are compiled for a CPU without F16C (NUMBA_CPU_NAME={config.CPU_NAME or 'the host'}, "
            f"NUMBA_CPU_FEATURES={config.CPU_FEATURES!r}): they need x86-64 with AVX2, FMA and F16C; unset "
            "NUMBA_CPU_NAME and NUMBA_CPU_FEATURES to compile for this host, or name a CPU that has them "
            "(NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=+avx2,+fma,+f16c for a cache any AVX2 host can use)")


check_target(target_features(), platform.machine())
