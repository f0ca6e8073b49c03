"""What the compiled kernels share: numba's options and where their compiled code is kept.

numba's disk cache checks only the stamp of the file that holds a jitted
function, not of the modules whose intrinsics it inlines (simd.py, the format
readers): an edited reader would be served from a stale cache. So the cache
lives in a folder named by a digest of every kernel source, under the user's
cache folder (or NUMBA_CACHE_DIR when set): a change of any kernel compiles
anew, and a copy of the project elsewhere reuses the same compiled code. A lowering of the integer dot
products forced by STRATA_IDOT_LOWERING (idot.py) is part of the name too.
"""

from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path

import llvmlite.binding as llvm
import numba
from numba.core import config

from .. import kernel_threads  # noqa: F401  (libgomp's wait settings, before the first kernel runs)

JIT = dict(nogil=True, cache=True, fastmath=True)  # compiled once per machine, kept in the disk cache below


def target_features() -> frozenset[str]:
    """The CPU features numba compiles the kernels for, which choose their instructions (a 512-bit tile, an
    integer dot product, vdpbf16ps): numba's own rule, NUMBA_CPU_FEATURES where set (numba sets it empty for
    NUMBA_CPU_NAME=generic, the portable cache), else the host's. Only the features named with "+" count: a
    CPU name's implied ones are not listed, and leaving one out costs speed, where taking one the target
    lacks would stop LLVM or the CPU. Asking the host alone, NUMBA_CPU_NAME=haswell on an AVX-512 host
    emitted AVX-512 intrinsics into haswell code."""
    if config.CPU_FEATURES is not None:
        return frozenset(f[1:] for f in config.CPU_FEATURES.split(",") if f.startswith("+"))
    return frozenset(name for name, on in llvm.get_host_cpu_features().items() if on)


class KernelTargetError(RuntimeError):
    """The CPU numba would compile the kernels for cannot run them."""


def check_target(features: frozenset[str], machine: str) -> None:
    """Refuse an x86 target without F16C (the float16 scales of q8, q4 and the GGUF blocks are widened by
    vcvtph2ps; without it LLVM calls __extendhfsf2, which numba cannot link, and the process stops inside
    LLVM): every x86-64 CPU since 2013 has it, but NUMBA_CPU_NAME=generic (numba's portable cache) leaves it
    out. Other machines (aarch64) convert float16 in their base instructions."""
    if machine.lower() in ("x86_64", "amd64") and "f16c" not in features:
        raise KernelTargetError(
            f"the kernels are compiled for a CPU without F16C (NUMBA_CPU_NAME={config.CPU_NAME or 'the host'}, "
            f"NUMBA_CPU_FEATURES={config.CPU_FEATURES!r}): they need x86-64 with AVX2, FMA and F16C; unset "
            "NUMBA_CPU_NAME and NUMBA_CPU_FEATURES to compile for this host, or name a CPU that has them "
            "(NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=+avx2,+fma,+f16c for a cache any AVX2 host can use)")


check_target(target_features(), platform.machine())


def sources_digest() -> str:
    digest = hashlib.sha256(numba.__version__.encode() + os.environ.get("STRATA_IDOT_LOWERING", "").encode())
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def cache_dir() -> Path:
    root = os.environ.get("NUMBA_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "strata-numa", "numba")
    return Path(root) / f"kernels-{sources_digest()}"


CACHE_DIR = cache_dir()
numba.config.CACHE_DIR = str(CACHE_DIR)  # read when a cache=True function is decorated: import this module first
