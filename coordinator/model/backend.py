"""Which array module the coordinator's device side runs on.

``cuda`` needs CuPy and a device that answers; ``auto`` takes them when present
and otherwise says that the device side runs on the CPU (NumPy): as a warning
once per machine state (the reason is kept in the user's cache folder, and a
new reason warns again), then only with -v.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ..errors import StrataError

log = logging.getLogger(__name__)
_warned = False


class DeviceError(StrataError):
    """--device cuda was asked for and no usable GPU is there; the message says what is missing."""


def probe_cuda() -> tuple[bool, str]:
    """(usable, why not)."""
    try:
        import cupy
    except ImportError:
        return False, "CuPy is not installed (pip install 'strata-numa[gpu]')"
    except Exception as exc:  # a broken CUDA install raises at import
        return False, f"CuPy does not import: {exc}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return False, f"the CUDA driver does not answer: {exc}"
    if count < 1:
        return False, "no CUDA device is visible"
    return True, ""


def select_device(device: str) -> str:
    """'auto' | 'cpu' | 'cuda' -> the backend used: 'numpy' or 'cupy'."""
    global _warned
    if device == "cpu":
        return "numpy"
    usable, why = probe_cuda()
    if device == "cuda":
        if not usable:
            raise DeviceError(f"--device cuda: {why}")
        return "cupy"
    if not usable and not _warned:
        _say_no_gpu(why)
        _warned = True
    return "cupy" if usable else "numpy"


def state_file() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "strata-numa" / "no-gpu"


def _say_no_gpu(why: str) -> None:
    path = state_file()
    try:
        known = path.read_text() == why
    except OSError:
        known = False
    (log.info if known else log.warning)("no usable GPU (%s): the device side runs on the CPU with NumPy", why)
    if not known:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(why)
        except OSError as exc:
            log.debug("could not remember the GPU state in %s: %s", path, exc)
