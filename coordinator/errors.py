"""Exception types a user of the engine can catch."""

from __future__ import annotations

from shm.checkpoint import CheckpointError


class StrataError(Exception):
    """Base of the engine's own errors."""


class ModelConfigError(StrataError, ValueError):
    """config.json names an architecture or setting the engine does not support, or lacks one it needs."""


class ConfigValueError(StrataError, ValueError):
    """An EngineConfig field, CLI flag or STRATA_* variable has a value that is not allowed."""


__all__ = ["CheckpointError", "ConfigValueError", "ModelConfigError", "StrataError"]


class StepInterrupted(StrataError):
    """The serving loop stopped a step while it waited on the pool (the server is shutting down)."""


__all__ += ["StepInterrupted"]
