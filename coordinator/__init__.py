"""The GPU-side process: model, engine loop, expert pools, CLI."""

import os

# OpenBLAS's idle threads spin for 2**28 rounds after each call (its default timeout) on the CPUs that numba's
# kernels take next: after the attention's BLAS calls a prefill MoE layer took 135 ms instead of 85 on this
# 2-vCPU machine, and the whole 64-token prefill 760-900 ms instead of 470-540 (Q4_K_M file). 2**4 rounds
# (the least OpenBLAS takes) puts them to sleep at once. Read when NumPy loads OpenBLAS, so set here before any
# import of it; the user's own setting wins. (libgomp's, OMP_WAIT_POLICY: node_worker/kernels/common.py.)
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

__all__ = ["Engine", "EngineConfig"]


def __getattr__(name: str):
    """Engine and EngineConfig, imported on first use: a process that runs one module of the package (the
    kernel compile, python -m coordinator.warmup) does not load the engine first."""
    if name == "Engine":
        from .engine import Engine

        return Engine
    if name == "EngineConfig":
        from .config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
