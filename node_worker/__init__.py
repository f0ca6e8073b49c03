"""The per-node process: protocol, task slicing, expert kernels, main loop."""

from .worker import NodeWorker

__all__ = ["NodeWorker"]
