"""The CPU kernels compiled once per build, in one short-lived process, before anything runs them.

numba compiles a function the first time it is called. Left to that, every node worker of a fresh cache
compiled every kernel at once, for minutes and gigabytes each, inside the worker start timeout. Instead the
coordinator names the compile units a run needs (Engine.open: the experts' formats, the dense matrices' ...)
and, when a unit's marker is missing from this build's cache folder (shm/jit.py), runs this module as a child
process (ensure_compiled). The child compiles the missing units one after another, shows each on stderr,
writes each unit's marker as it finishes and exits, giving back the compiler's memory. Every other process
(the coordinator, the node workers) then only loads the compiled code.

    host            the decoder's host loops (norms, top-k, RoPE, attention)    the coordinator
    doorbells       futex doorbells and atomics                                 both sides of a process pool
    stream          the pool's ring and wait as CUDA host functions             a GPU coordinator, process pool
    experts/TAG     a node's MoE layer, its answer and its STREAM read, for     node workers, an in-process pool
                    kernel set TAG, and the host's MoE block on it
    dense/TAG       the packed dense matrices of one format (kernel set TAG)    the coordinator without a GPU
    encode/FMT      q8 or q4 quantisation of float weights                      wherever such weights are stored

A marker, <build>/units/<kind>.<arg>.json, records the unit's seconds, the functions compiled and the child's
peak memory (`strata cache` lists them). One process at a time compiles into a build folder (compile.lock);
another waits for it and then finds its units done. Interrupted (Ctrl-C), the child keeps every function it
finished (numba saves each as soon as it is compiled) and the next run compiles only the rest.
"""

from __future__ import annotations

import os
import signal

STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def end_at_once_when_stopped() -> None:
    """The compile child's handlers: SIGINT or SIGTERM ends the process where it is, with status 128 + the signal,
    raising nothing (a KeyboardInterrupt raised inside numba's ctypes callbacks is printed as "Exception ignored"
    and the compile then fails on a missing object)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, frame: os._exit(128 + signum))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # its parent blocks them while it starts it


if __name__ == "__main__":  # the compile child: stopped at any moment it just ends (what it finished stays)
    end_at_once_when_stopped()
    from shm.threads_env import apply

    apply()  # before NumPy and numba load

import argparse
import fcntl
import json
import resource
import shutil
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence, TextIO

from shm import compile_log, jit
from shm.paths import write_problem

from .errors import StrataError

if TYPE_CHECKING:
    from node_worker.kernels.kernel_set import KernelSet

KINDS = ("host", "doorbells", "stream", "experts", "dense", "encode")
LOCK_NAME = "compile.lock"
STOP_WAIT_S = 10.0  # for an interrupted compile child to end before it is killed
TICK_S = 0.25  # the terminal's progress line is redrawn this often


class KernelCompileError(StrataError):
    """The kernels could not be compiled (the reason is named)."""


@dataclass(frozen=True)
class Unit:
    """One compile unit: ``kind`` (KINDS) and its argument (a kernel set's tag, or a format name)."""

    kind: str
    arg: str = ""

    @classmethod
    def parse(cls, name: str) -> Unit:
        kind, _, arg = name.partition("/")
        if kind not in KINDS or (kind in ("experts", "dense", "encode")) != bool(arg):
            raise ValueError(f"no compile unit {name!r} (known: host, doorbells, stream, experts/TAG, dense/TAG, encode/FMT)")
        return cls(kind, arg)

    @classmethod
    def experts(cls, kernels) -> Unit:
        return cls("experts", kernels.tag)

    @classmethod
    def dense(cls, kernels) -> Unit:
        return cls("dense", kernels.tag)

    @property
    def name(self) -> str:
        return f"{self.kind}/{self.arg}" if self.arg else self.kind

    @property
    def label(self) -> str:
        """For people: "experts (q4k, q6k; int8 activations)"."""
        if self.kind in ("experts", "dense"):
            from node_worker.kernels.kernel_set import KernelSet

            what = "experts" if self.kind == "experts" else "dense matrices"
            return f"{what} ({KernelSet.from_tag(self.arg).label})"
        return {"host": "host loops", "doorbells": "doorbells", "stream": "stream host functions"}.get(
            self.kind, f"{self.arg} encoder")

    def compile(self) -> None:
        """Compile (or load) the unit's functions in this process, by calling them as the engine does."""
        if self.kind == "host":
            from .host import ops as host_ops

            host_ops.warm_up()
        elif self.kind == "doorbells":
            from shm import doorbell

            doorbell.warm_up()
        elif self.kind == "stream":
            from shm import pool_signal

            pool_signal.warm_up()
        elif self.kind == "encode":
            from shm.formats import encode

            encode.warm_up(self.arg)
        else:
            from node_worker import answer
            from node_worker.kernels import dense, layer
            from node_worker.kernels.kernel_set import KernelSet

            kernels = KernelSet.from_tag(self.arg)
            if self.kind == "experts":
                from node_worker import membw

                from .host import ops as host_ops

                layer.warm_up(kernels)
                host_ops.warm_up_moe_block(kernels)  # an in-process node's decode row (host/blocks.py)
                answer.warm_up(kernels)
                membw.warm_up()  # the node's STREAM read, for a benchmark
            else:
                dense.warm_up(kernels)


def engine_units(pool: str, expert_kernels, encoders: Iterable[str] = (), gpu: bool = False) -> list[Unit]:
    """What an engine needs before it loads: the host loops, the doorbells (a process pool) and the stream's host
    functions (a process pool driven from the GPU's stream), the experts' layer for kernel set ``expert_kernels``
    (None: no CPU experts), and the q8 or q4 encoders that fill weights."""
    units = [Unit("host")]
    if pool == "process":
        units += [Unit("doorbells"), *([Unit("stream")] if gpu else [])]
    if expert_kernels is not None:
        units.append(Unit.experts(expert_kernels))
    units += [Unit("encode", name) for name in sorted(set(encoders)) if name in ("q8", "q4")]
    return units


# -- markers --------------------------------------------------------------------------------------------------

def marker_path(unit: Unit, folder: Path | None = None) -> Path:
    return (folder or jit.build_dir()) / "units" / f"{unit.name.replace('/', '.')}.json"


def marker(unit: Unit, folder: Path | None = None) -> dict | None:
    """The unit's marker (what its compile took), or None when this build has not compiled it."""
    try:
        return json.loads(marker_path(unit, folder).read_text())
    except (OSError, ValueError):
        return None


def _write_marker(unit: Unit, info: dict) -> None:
    path = marker_path(unit)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)  # whole or absent: a marker is never half-written


def missing(units: Iterable[Unit]) -> list[Unit]:
    """The units this build has not compiled, each once, in order."""
    return [u for u in dict.fromkeys(units) if marker(u) is None]


# -- the parent's side ------------------------------------------------------------------------------------------

def ensure_compiled(units: Iterable[Unit], quiet: bool = False) -> list[Unit]:
    """Compile the units this build lacks, in a child process (this module's main), and return them ([] when
    every one was compiled before: nothing runs). One line says what and why first, unless ``quiet``; the
    child shows its progress. Ctrl-C (or SIGTERM) stops the child too, which keeps what it finished."""
    todo = missing(units)
    if not todo:
        return []
    if not quiet:
        key = jit.build_key()
        print(f"strata: compiling CPU kernels for {', '.join(u.label for u in todo)} (first run of this build on "
              f"this CPU, {key.cpu}; cached in {jit.build_dir()} for next time)", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "coordinator.warmup", *(u.name for u in todo), *(["-q"] if quiet else [])]
    started: list[subprocess.Popen] = []  # the child, held here from the moment it exists
    try:
        noted = _start(cmd, started)
        if noted:  # a stop signal came while the child started: its own handler now, the child known
            signal.raise_signal(noted[0])
        code = started[0].wait()
    except BaseException:
        for child in started:
            _stop(child)
        raise
    if code != 0:
        raise KernelCompileError(f"compiling the CPU kernels failed (exit status {code}); the reason is above")
    return todo


def _start(cmd: list[str], started: list) -> list[int]:
    """Start the compile child into ``started``; the stop signals that came meanwhile. A stop signal while it
    starts must not raise before the caller holds the child, or the child would outlive this process: Python runs
    a signal's handler between bytecodes, which may be inside Popen after the fork. So the stop signals' handlers
    only note them until the child is in ``started``, and the signals are blocked while it forks, so that it
    starts with them blocked too (it unblocks them once its own handlers are set: end_at_once_when_stopped)."""
    noted: list[int] = []
    handlers = {sig: signal.signal(sig, lambda signum, frame: noted.append(signum)) for sig in STOP_SIGNALS}
    try:
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            started.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL,
                                            env=dict(os.environ, PYTHONUNBUFFERED="1", **jit.child_env())))
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # one blocked meanwhile is noted now
        return noted
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _stop(child: subprocess.Popen) -> None:
    """End an interrupted compile: SIGTERM (it ends at once and keeps what it finished), then SIGKILL."""
    if child.poll() is None:
        try:
            child.send_signal(signal.SIGTERM)
            child.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            child.kill()
        except BaseException:
            child.kill()
            child.wait()
            raise
    child.wait()


# -- the child's side ------------------------------------------------------------------------------------------

@contextmanager
def _compile_lock(folder: Path, out: TextIO | None):
    """Hold the build folder's compile lock; while another process holds it, say so once and wait."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / LOCK_NAME, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            if out is not None:
                print(f"  waiting for {holder}, compiling into the same cache", file=out, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()}")
        f.flush()
        try:
            yield
        finally:
            f.truncate(0)
            fcntl.flock(f, fcntl.LOCK_UN)


class _Line:
    """A unit's progress: on a terminal one line redrawn every TICK_S (seconds so far, the function being
    compiled), ended by the result; elsewhere the result alone, one plain line per unit."""

    def __init__(self, label: str, out: TextIO | None):
        self.label, self.out = label, out
        self.before = len(compile_log.compiled())
        self.tty = out is not None and out.isatty()
        self.start = time.monotonic()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._tick, daemon=True) if self.tty else None

    def __enter__(self) -> _Line:
        if self.thread is not None:
            self.thread.start()
        return self

    def _tick(self) -> None:
        while not self.stopped.wait(TICK_S):
            done = len(compile_log.compiled()) - self.before
            now = compile_log.compiling().rsplit(".", 1)[-1]
            self.out.write(f"\r  {self.label}  {time.monotonic() - self.start:4.0f} s  {done:3d} functions  {now}\x1b[K")
            self.out.flush()

    def done(self, text: str) -> None:
        self._end()
        if self.out is not None:
            start, clear = ("\r", "\x1b[K") if self.tty else ("", "")
            self.out.write(f"{start}  {self.label}: {text}{clear}\n")
            self.out.flush()

    def _end(self) -> None:
        self.stopped.set()
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def __exit__(self, *exc) -> None:
        self._end()
        if exc[0] is not None and self.tty:
            self.out.write("\n")
            self.out.flush()


def peak_mb() -> float:
    """This process's peak resident memory so far, MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def compile_units(units: Sequence[Unit], out: TextIO | None = sys.stderr) -> list[dict]:
    """Compile the units this build lacks, here, one after another (their progress on ``out``; None: silent),
    each unit's marker written as it finishes; returns their markers."""
    folder = jit.build_dir()
    done = []
    with _compile_lock(folder, out):
        todo = missing(units)  # again: a process that held the lock may have compiled some
        for k, unit in enumerate(todo, 1):
            with _Line(f"[{k}/{len(todo)}] {unit.label}", out) as line:
                unit.compile()
                seconds = time.monotonic() - line.start
                functions = len(compile_log.compiled()) - line.before
                info = {"unit": unit.name, "label": unit.label, "seconds": round(seconds, 2), "functions": functions,
                        "peak_mb": round(peak_mb()), "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
                _write_marker(unit, info)
                line.done(f"{seconds:.1f} s, {functions} functions compiled")
            done.append(info)
    return done


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m coordinator.warmup",
                                description="compile CPU kernel units into this build's cache (Engine.open runs it)")
    p.add_argument("units", nargs="+", help="host, doorbells, experts/TAG, dense/TAG, encode/FMT")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
    args = p.parse_args(argv)
    try:
        units = [Unit.parse(name) for name in args.units]
    except ValueError as exc:
        print(f"strata: error: {exc}", file=sys.stderr)
        return 2
    problem = write_problem(jit.build_dir())
    if problem:
        print(f"strata: error: the kernel cache folder {jit.build_dir()} cannot be written ({problem}); set "
              "NUMBA_CACHE_DIR to a writable folder", file=sys.stderr)
        return 2
    try:
        compile_units(units, None if args.quiet else sys.stderr)
    except KeyboardInterrupt:  # main() called where Python's own SIGINT handler stands (not as the compile child)
        return 130
    except OSError as exc:  # the cache folder filled up or went away while numba wrote to it
        print(f"strata: error: writing the kernel cache in {jit.build_dir()} failed: {exc.strerror or exc}",
              file=sys.stderr)
        return 2
    except Exception as exc:  # numba or LLVM refused a kernel: a bug of ours, named in one line
        print(f"strata: error: compiling the kernels failed: {type(exc).__name__}: {str(exc).splitlines()[0]}",
              file=sys.stderr)
        return 2
    return 0


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def cache_report() -> dict:
    """Where the kernel cache is, this build's folder and what it has compiled (its markers), and the other
    builds' folders (other sources, numba versions or CPUs), with their sizes: `strata cache`."""
    root, current = jit.cache_root(), jit.build_dir()
    units = []
    if (current / "units").is_dir():
        for path in sorted((current / "units").glob("*.json")):
            try:
                units.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
    units.sort(key=lambda u: u.get("finished", ""))
    others = [f for f in sorted(root.iterdir()) if f.is_dir() and f != current] if root.is_dir() else []
    others += [f for f in legacy_folders() if f.is_dir()]
    return {"root": str(root), "build": current.name, "describe": jit.build_key().describe(),
            "build_bytes": folder_bytes(current) if current.is_dir() else 0, "units": units,
            "other_builds": [{"folder": str(f.relative_to(root)) if f.parent == root else str(f),
                              "bytes": folder_bytes(f)} for f in others]}


def legacy_folders() -> list[Path]:
    """The cache of the versions before build folders (strata-numa/numba/kernels-<digest>), beside the root."""
    old = jit.cache_root().parent / "numba"
    return [old] if not os.environ.get("NUMBA_CACHE_DIR") and old.is_dir() else []


def remove_build_folders(root: Path, keep: str | None = None) -> list[Path]:
    """Remove the build folders under ``root`` (all, or all but ``keep``'s name) and the older versions' cache
    (legacy_folders); the ones removed. A folder whose compile lock another process holds is left alone."""
    removed = []
    for folder in [*(sorted(root.iterdir()) if root.is_dir() else []), *legacy_folders()]:
        if not folder.is_dir() or folder.name == keep:
            continue
        lock = folder / LOCK_NAME
        if lock.exists():
            with open(lock, "a") as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                shutil.rmtree(folder, ignore_errors=True)
        else:
            shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


if __name__ == "__main__":
    # Stopped (Ctrl-C, which a terminal sends the parent and this child alike, or the parent's SIGTERM), the child
    # ends at once, as during its imports: numba writes each compiled function's cache file whole (a temporary
    # renamed) and a unit's marker is written the same way, so what is finished stays. A KeyboardInterrupt instead
    # would be raised inside numba's ctypes callbacks, which print it as "Exception ignored" and then fail.
    raise SystemExit(main())


class Compiles:
    """ensure_compiled for an engine's start, the seconds spent where something was compiled added up."""

    def __init__(self, quiet: bool):
        self.quiet, self.seconds = quiet, 0.0

    def __call__(self, units) -> None:
        start = time.perf_counter()
        if ensure_compiled(units, self.quiet):
            self.seconds += time.perf_counter() - start


def warm_up_host(dense_kernels: Sequence["KernelSet"] = ()) -> None:
    """Load (or compile) the host loops this engine's requests call, before the first one: the decoder's row
    loops (host_ops: all of them on a NumPy device side) and, with dense
    matrices kept packed, their kernels (one kernel set per format)."""
    from node_worker.kernels import dense

    from .host import ops as host_ops

    host_ops.warm_up()
    for kernels in dense_kernels:
        dense.warm_up(kernels)
