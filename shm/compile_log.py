"""Which functions numba compiled in this process (not loaded from the cache): for the compile's progress line,
and for a node worker to say in its HELLO that it only loaded what the coordinator compiled before it.

numba broadcasts a "numba:compile" event around each function it compiles, and none for one it loads from
the disk cache (numba/core/dispatcher.py), so counting the ends counts the compiles.
"""

from __future__ import annotations

import threading

from numba.core import event


class _Recorder(event.Listener):
    def __init__(self):
        self.lock = threading.Lock()
        self.compiled: list[str] = []  # qualified names, in the order they finished
        self.current: list[str] = []  # the compiles under way, outermost first

    def on_start(self, ev):
        with self.lock:
            self.current.append(_name(ev))

    def on_end(self, ev):
        with self.lock:
            name = _name(ev)
            if name in self.current:
                self.current.remove(name)
            self.compiled.append(name)  # a failed compile too (numba's Event.is_failed is inverted in 0.68)


def _name(ev) -> str:
    fn = getattr(ev.data.get("dispatcher"), "py_func", None)
    return f"{fn.__module__}.{fn.__qualname__}" if fn is not None else "?"


_recorder = _Recorder()
event.register("numba:compile", _recorder)


def compiled() -> list[str]:
    """The functions compiled in this process so far, in order (a function compiled for two signatures: twice)."""
    with _recorder.lock:
        return list(_recorder.compiled)


def compiling() -> str:
    """The innermost function being compiled now, or ''."""
    with _recorder.lock:
        return _recorder.current[-1] if _recorder.current else ""
