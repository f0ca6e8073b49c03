"""The GPU-side process: model, engine loop, expert pools, CLI."""

from .config import EngineConfig
from .engine import Engine

__all__ = ["Engine", "EngineConfig"]
