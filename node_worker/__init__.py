"""The per-node process: protocol, task slicing, expert kernels, main loop."""

__all__ = ["NodeWorker"]


def __getattr__(name: str):
    """NodeWorker, imported on first use: the worker process (python -m node_worker) sets its thread variables
    before NumPy loads (__main__.py)."""
    if name == "NodeWorker":
        from .worker import NodeWorker

        return NodeWorker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
