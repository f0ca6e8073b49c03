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
from pathlib import Path

import numba

from .. import kernel_threads  # noqa: F401  (libgomp's wait settings, before the first kernel runs)

JIT = dict(nogil=True, cache=True, fastmath=True)  # compiled once per machine, kept in the disk cache below


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
