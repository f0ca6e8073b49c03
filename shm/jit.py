"""Where numba keeps the project's compiled code, and the options every cached jitted function takes.

One folder per build, shared by every checkout and process of the same build on this machine:

    <root>/                                 NUMBA_CACHE_DIR, else $XDG_CACHE_HOME/strata-numa/kernels
      <build key>/                          "<cpu>-<digest>": a build (BuildKey)
        node_worker/kernels/rows/ ...       numba's index (.nbi) and code (.nbc) files, per source module
        units/<unit>.json                   a compile unit finished (coordinator/warmup.py)
        compile.lock                        held by the process compiling into this folder

The build key digests what decides the compiled code: every source file that holds or inlines jitted code
(JIT_SOURCES: numba checks only the file of the function it loads, not the intrinsics and constants it
inlined from others), numba's, llvmlite's and Python's versions, the target CPU and its features (numba's
NUMBA_CPU_NAME / NUMBA_CPU_FEATURES where set). Not the checkout's path: numba's
own locator names a folder by the source's absolute path, so a second clone compiled everything again; here
(ProjectCacheLocator) a module's files sit under its path inside the project. numba writes each function's
index and code through a temporary file and a rename, and saves each function as soon as it is compiled, so
an interrupted compile keeps every function finished before it and never leaves a half-written file.

Import this module before any module that decorates a cached function (the option dicts below do).
"""

from __future__ import annotations

import hashlib
import os
import platform
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import llvmlite
import llvmlite.binding as llvm
import numba
from numba.core import config as numba_config
from numba.core.caching import UserProvidedCacheLocator

PROJECT = Path(__file__).resolve().parents[1]  # the folder holding coordinator/, node_worker/, shm/
# the files whose code the compiled functions hold: a change to any of them is a new build
JIT_SOURCES = ("node_worker/kernels/*.py", "node_worker/answer.py", "node_worker/membw.py", "shm/jit.py",
               "shm/doorbell.py", "shm/pool_io.py", "shm/pool_signal.py", "shm/formats/*.py",
               "coordinator/host/ops.py")

CACHED = dict(nogil=True, cache=True)  # every cached function's options (ProjectCacheLocator keeps its code)
FAST = dict(CACHED, fastmath=True)  # the kernels' options: fastmath where the IR does not fix the order


@lru_cache(maxsize=1)
def cache_root() -> Path:
    """The folder of every build's cache: NUMBA_CACHE_DIR where set, else the user's cache folder; read once, so
    a process keeps one cache whatever its environment becomes (its children are given it: child_env)."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return Path(os.environ["NUMBA_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "strata-numa" / "kernels"


def child_env() -> dict[str, str]:
    """The environment a process this one starts needs to use the same cache (the kernel compile, the node
    workers)."""
    return {"NUMBA_CACHE_DIR": str(cache_root())}


def target_features() -> frozenset[str]:
    """The CPU features numba compiles for, which choose the kernels' instructions (a 512-bit tile, an integer
    dot product, vdpbf16ps): numba's own rule, NUMBA_CPU_FEATURES where set (numba sets it empty for
    NUMBA_CPU_NAME=generic, the portable cache), else the host's. Only the features named with "+" count: a
    CPU name's implied ones are not listed, and leaving one out costs speed, where taking one the target
    lacks would stop LLVM or the CPU. Asking the host alone, NUMBA_CPU_NAME=haswell on an AVX-512 host
    emitted AVX-512 intrinsics into haswell code."""
    if numba_config.CPU_FEATURES is not None:
        return frozenset(f[1:] for f in numba_config.CPU_FEATURES.split(",") if f.startswith("+"))
    return frozenset(name for name, on in llvm.get_host_cpu_features().items() if on)


def target_cpu() -> str:
    """The CPU numba compiles for: NUMBA_CPU_NAME, else the host's (LLVM's name: "znver4", "sapphirerapids")."""
    return numba_config.CPU_NAME or llvm.get_host_cpu_name()


def source_files() -> list[Path]:
    """JIT_SOURCES' files, sorted by their path in the project."""
    return sorted({p for pattern in JIT_SOURCES for p in PROJECT.glob(pattern)}, key=lambda p: p.relative_to(PROJECT))


@dataclass(frozen=True)
class BuildKey:
    """What the compiled code depends on, and the folder named after it."""

    cpu: str
    features: tuple[str, ...]
    numba: str
    llvmlite: str
    python: str
    sources: str  # a digest of JIT_SOURCES' names and contents

    @property
    def digest(self) -> str:
        text = repr((self.cpu, self.features, self.numba, self.llvmlite, self.python, self.sources))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def name(self) -> str:
        """The build's folder name: "znver4-1a2b3c4d5e6f7a8b"."""
        return f"{self.cpu}-{self.digest}"

    def describe(self) -> str:
        return (f"CPU {self.cpu}, numba {self.numba}, llvmlite {self.llvmlite}, Python {self.python}, sources "
                f"{self.sources[:12]}")


@lru_cache(maxsize=1)
def build_key() -> BuildKey:
    digest = hashlib.sha256()
    for path in source_files():
        digest.update(str(path.relative_to(PROJECT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return BuildKey(target_cpu(), tuple(sorted(target_features())), numba.__version__, llvmlite.__version__,
                    platform.python_version(), digest.hexdigest())


def build_dir() -> Path:
    """This build's folder (cache_root() / build_key().name)."""
    return cache_root() / build_key().name


def finished_units(kind: str) -> list[str]:
    """The arguments of this build's finished compile units of one kind, read from their markers
    (units/<kind>.<arg>.json, written whole by coordinator/warmup.py): for "experts", the kernel sets' tags."""
    prefix = kind + "."
    try:
        names = os.listdir(build_dir() / "units")
    except OSError:
        return []
    return sorted(n[len(prefix):-len(".json")] for n in names if n.startswith(prefix) and n.endswith(".json"))


class ProjectCacheLocator(UserProvidedCacheLocator):
    """numba's cache locator for the project's modules: their files under build_dir(), at the module's path
    inside the project (node_worker/kernels/rows.py's in <build>/node_worker/kernels/rows/); numba checks each
    index against its source file's contents, not its path or time. Other files: numba's own locators."""

    def __init__(self, py_func, py_file):
        super().__init__(py_func, py_file)
        self._project_path = str(build_dir() / Path(py_file).resolve().relative_to(PROJECT).with_suffix(""))

    def get_cache_path(self):
        return self._project_path

    @classmethod
    def from_function(cls, py_func, py_file):
        try:
            Path(py_file).resolve().relative_to(PROJECT)
        except ValueError:
            return None
        self = cls(py_func, py_file)
        try:
            self.ensure_cache_path()
        except OSError:
            return None  # an unwritable cache folder: numba compiles without caching (coordinator/warmup.py says so)
        return self


def _use_project_locator() -> None:
    """Put ProjectCacheLocator first in numba's list (NUMBA_CACHE_LOCATOR_CLASSES, numba's documented setting,
    read when a cached function is decorated), the user's or numba's own list after it."""
    ours = f"{__name__}.{ProjectCacheLocator.__name__}"
    given = numba_config.CACHE_LOCATOR_CLASSES or os.environ.get("NUMBA_CACHE_LOCATOR_CLASSES", "")
    if given.split(",")[0].strip() == ours:
        return
    rest = given or ("UserProvidedCacheLocator,InTreeCacheLocator,UserWideCacheLocator,IPythonCacheLocator,"
                     "ZipCacheLocator")
    value = f"{ours},{rest}"
    os.environ["NUMBA_CACHE_LOCATOR_CLASSES"] = value  # numba re-reads its settings from the environment
    numba_config.CACHE_LOCATOR_CLASSES = value


_use_project_locator()
