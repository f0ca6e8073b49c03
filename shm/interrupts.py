"""Clean-up that a Ctrl-C cannot cut in half: SIGINT and SIGTERM held back while resources are released.

Python runs a signal's handler in the main thread between two bytecodes, wherever it is; a KeyboardInterrupt
raised in the middle of a pool's close left a worker running or a segment in /dev/shm. ``deferred`` blocks
both signals for the calling thread (the kernel keeps them pending) and unblocks them after the block, when
the handler runs and the interrupt goes on from there. Only the main thread receives Python's signals, so
elsewhere it does nothing.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

HELD = {signal.SIGINT, signal.SIGTERM}


@contextmanager
def deferred():
    """Hold SIGINT and SIGTERM for the duration of the block (in the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
