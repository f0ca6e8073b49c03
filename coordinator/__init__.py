"""The GPU-side process: model, engine loop, expert pools, CLI."""

# Importing the package sets nothing in the environment: the entry points set the thread variables
# (shm/threads_env.py), which a program using the library sets by calling shm.threads_env.apply() first.

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
