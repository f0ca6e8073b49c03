"""The ``strata`` command's entry point: Ctrl-C and SIGTERM are taken before anything else loads.

Python raises KeyboardInterrupt wherever the main thread is when SIGINT arrives, an import or a clean-up
included, and the command's modules take a second to import. So the handlers are set here first, with the
command's imports after them: the first SIGINT or SIGTERM raises KeyboardInterrupt, which unwinds the
command through its clean-up (the node workers stopped, their segments and the pool's folder removed; the
kernel compile stopped, keeping what it finished) to one empty line on stderr and the shell's 128 + the
signal; the next FORCE_AFTER are ignored so that the clean-up finishes, and the one after that ends the
process at once, saying what it may have left. Once the command has returned, its clean-up done, the signals
are ignored while the interpreter shuts down, so the exit status stays the command's. `strata chat` and
`strata serve` set handlers of their own while they wait for the user or serve (serve ignores them during its
teardown too).
"""

from __future__ import annotations

import os
import signal
import sys

FORCE_AFTER = 3  # signals ignored during the clean-up before one ends the process unclean
_received: list[int] = []


def _on_signal(signum, frame) -> None:
    _received.append(signum)
    if len(_received) == 1:
        sys.unraisablehook = _quiet  # what the interrupt leaves half-built (llvmlite's, mid-import) fails in __del__
        raise KeyboardInterrupt
    if len(_received) > 1 + FORCE_AFTER:
        os.write(2, b"\nstrata: stopped before its clean-up finished; `strata shm clean --all` removes what a "
                    b"stopped run left\n")
        os._exit(128 + _received[0])


def main() -> int:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_signal)
    try:
        from shm.threads_env import apply

        apply()  # before the command's imports load NumPy (OpenBLAS) and numba (libgomp)
        from .main import main as run

        code = run()
    except KeyboardInterrupt:  # before the command's own handling (an import), or raised past it
        print(file=sys.stderr)
        code = 130
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
    return 128 + _received[0] if _received else code


def _quiet(_unraisable) -> None:
    """After Ctrl-C: nothing is reported of the objects the interrupt cut short, as they are collected."""


if __name__ == "__main__":
    raise SystemExit(main())
