"""Folders the engine writes into (a model make-model writes, the kernel cache): whether they can be written."""

from __future__ import annotations

import os
from pathlib import Path


def write_problem(folder: Path) -> str:
    """'' when ``folder`` (made, with its parents, if absent) takes a new file, else why not, in the OS's words
    ("Permission denied", "Read-only file system", "No such file or directory" under /proc)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".strata-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
        return ""
    except OSError as exc:
        return exc.strerror or str(exc)
