"""Which array module the coordinator's device side runs on.

``cuda`` needs CuPy and a device that answers; ``auto`` takes them when present
and otherwise runs the device side on the CPU (NumPy). On a machine with no
NVIDIA device that is the expected path and is said only with -v; where a GPU is
there but CuPy is missing or broken, one ``strata:`` line says why and how to use
it, once per machine state (the reason is kept in the user's cache folder, and a
new reason says it again), then only with -v.
"""

from __future__ import annotations

import logging
import os
import sys
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


def nvidia_device_present(root: Path = Path("/")) -> bool:
    """Whether the machine has an NVIDIA GPU at all, whatever CuPy says: the driver's /proc/driver/nvidia/gpus
    entries, or a /dev/nvidia0 node (a container given the device without the driver's /proc)."""
    gpus = root / "proc" / "driver" / "nvidia" / "gpus"
    try:
        if any(gpus.iterdir()):
            return True
    except OSError:
        pass
    return (root / "dev" / "nvidia0").exists()


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
        if nvidia_device_present():
            _say_no_gpu(why)
        else:  # no GPU at all: the CPU is the expected path
            log.info("no NVIDIA GPU: the device side runs on the CPU with NumPy")
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
    if known:
        log.info("no usable GPU (%s): the device side runs on the CPU with NumPy", why)
        return
    print(f"strata: an NVIDIA GPU is here but unused: {why}; the device side runs on the CPU (--device cpu "
          "to choose that, --device cuda to be refused instead)", file=sys.stderr, flush=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(why)
    except OSError as exc:
        log.debug("could not remember the GPU state in %s: %s", path, exc)
