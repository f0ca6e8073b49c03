"""The first run: the kernels compiled once, in one child process, before any worker starts; a cache shared by
every checkout of the same sources, keyed by their contents; what a compile finished kept through a Ctrl-C;
and a start stopped at any moment (Ctrl-C, a start timeout) leaving no segment, folder, process or traceback.

The tests that need an empty cache give their processes one of their own (NUMBA_CACHE_DIR) and pay a compile
of the f32 kernels (tens of seconds on two cores)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from coordinator.cli.make_model import make_model
from coordinator.config import ENV_VARS
from coordinator.warmup import Unit, engine_units, marker
from leftovers import pool_folders_left, pool_folders_now, segments_left, segments_now
from node_worker.kernels.kernel_set import KernelSet, for_formats
from shm import jit

pytestmark = pytest.mark.usefixtures("dev_shm_alone")  # SIGKILLs, cleans or counts segments

REPO = Path(__file__).resolve().parents[1]
UNIT_LINE = re.compile(r"^  \[(\d+)/(\d+)\] (.+): (\d+\.\d) s, (\d+) functions compiled$")


def clean_env(cache: Path | None = None, **extra) -> dict:
    """The test process's environment without STRATA_* settings, with a kernel cache of its own when given."""
    env = {k: v for k, v in os.environ.items() if k not in {var for var, _ in ENV_VARS.values()}}
    env.pop("NUMBA_CACHE_DIR", None)
    if cache is not None:
        env["NUMBA_CACHE_DIR"] = str(cache)
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def strata(*args: str, env: dict, cwd: Path = REPO, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coordinator", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600, **kwargs)


def build_folder(cache: Path, env: dict, cwd: Path = REPO) -> Path:
    """The build folder a process with ``env`` (started in ``cwd``) uses under ``cache``."""
    code = "from shm import jit; print(jit.build_dir())"
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, check=True)
    folder = Path(out.stdout.strip())
    assert folder.parent == cache
    return folder


LOADED = """
import json, sys
from coordinator import Engine, EngineConfig
from shm import compile_log
import coordinator
cfg = EngineConfig(pool="process", numa_split=True, nodes=2)
with Engine.open(sys.argv[1], cfg) as eng:
    workers = [w.hello["compiled"] for w in eng.pool.workers]
    eng.generate([1, 2, 3], max_new_tokens=2)
print(json.dumps({"coordinator": compile_log.compiled(), "workers": workers, "source": coordinator.__file__}))
"""


@pytest.mark.slow
def test_a_first_run_compiles_once_in_a_child_and_every_process_then_loads_the_cache(tmp_path):
    """A cold split generate: one line naming what is compiled and why, one line per unit as it finishes, its
    marker written; then a second run and a copy of the project in another folder (a second clone) load it all:
    no compile line, and neither the coordinator nor a node worker compiles a function."""
    cache = tmp_path / "cache"
    env = clean_env(cache)
    model = make_model(tmp_path / "m", seed=0)
    first = strata("generate", "-m", str(model), "--prompt-ids", "1,2,3", "-n", "4", "--numa-split", "--nodes", "2",
                   env=env)
    assert first.returncode == 0, first.stderr
    lines = first.stderr.splitlines()
    head = next(i for i, line in enumerate(lines) if "compiling CPU kernels" in line)
    names = ["host loops", "doorbells", "experts (f32)", "dense matrices (f32)"]  # the last: batch-invariant rows
    assert ", ".join(names) in lines[head] and "first run of this build" in lines[head]
    units = [UNIT_LINE.match(line) for line in lines[head + 1:head + 1 + len(names)]]
    assert all(units), lines
    assert [u[3] for u in units] == names and all(int(u[5]) > 0 for u in units)
    assert "Traceback" not in first.stderr and "compiled" not in " ".join(lines[head + 1 + len(names):])  # none later
    folder = build_folder(cache, env)
    for unit in (Unit("host"), Unit("doorbells"), Unit.experts(KernelSet.of(["f32"], True)),
                 Unit.dense(KernelSet.of(["f32"], False))):
        info = marker(unit, folder)
        assert info is not None and info["functions"] > 0 and info["peak_mb"] > 0, unit

    again = strata("generate", "-m", str(model), "--prompt-ids", "1,2,3", "-n", "4", "--numa-split", "--nodes", "2",
                   env=env)
    assert again.returncode == 0 and "compiling" not in again.stderr, again.stderr
    assert again.stdout == first.stdout  # the same tokens
    loaded = json.loads(subprocess.run([sys.executable, "-c", LOADED, str(model)], cwd=REPO, env=env,
                                       capture_output=True, text=True, check=True).stdout)
    assert loaded["coordinator"] == [] and loaded["workers"] == [[], []], loaded

    clone = tmp_path / "elsewhere" / "clone"  # another checkout of the same sources
    for package in ("coordinator", "node_worker", "shm"):
        shutil.copytree(REPO / package, clone / package, ignore=shutil.ignore_patterns("__pycache__"))
    clone_env = {**env, "PYTHONPATH": str(clone)}
    assert build_folder(cache, clone_env, cwd=tmp_path) == folder
    loaded = json.loads(subprocess.run([sys.executable, "-c", LOADED, str(model)], cwd=tmp_path, env=clone_env,
                                       capture_output=True, text=True, check=True).stdout)
    assert loaded["source"].startswith(str(clone))
    assert loaded["coordinator"] == [] and loaded["workers"] == [[], []], loaded

    listed = strata("cache", env=env)
    assert listed.returncode == 0 and str(cache) in listed.stdout and folder.name in listed.stdout
    assert all(label in listed.stdout for label in ("host loops", "doorbells", "experts (f32)"))
    cleared = strata("cache", "clear", env=env)
    assert cleared.returncode == 0 and "removed 1 build folder" in cleared.stdout and not folder.exists()
    assert "nothing compiled yet" in strata("cache", env=env).stdout


@pytest.mark.slow
def test_an_interrupted_compile_keeps_the_units_it_finished(tmp_path):
    """Ctrl-C during the second unit: exit status 130, no traceback, the first unit's marker kept, no half-written
    file in the cache; the next run compiles the second unit alone (the two cheapest units: the cold compile is
    the subject, not its size)."""
    cache = tmp_path / "cache"
    env = clean_env(cache)
    proc = subprocess.Popen([sys.executable, "-m", "coordinator.warmup", "doorbells", "host"], cwd=REPO, env=env,
                            stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            if "doorbells:" in line:
                break
        proc.send_signal(signal.SIGINT)
        rest = proc.stderr.read()
        assert proc.wait(60) == 130
    finally:
        proc.kill()
    assert "Traceback" not in rest
    folder = build_folder(cache, env)
    assert marker(Unit("doorbells"), folder) is not None and marker(Unit("host"), folder) is None
    assert not [p for p in folder.rglob("*") if ".tmp" in p.name]
    rerun = subprocess.run([sys.executable, "-m", "coordinator.warmup", "doorbells", "host"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    assert [m[3] for m in map(UNIT_LINE.match, rerun.stderr.splitlines()) if m] == ["host loops"]


SIGNAL_INSIDE_POPEN = """
import os, signal, subprocess, sys
import psutil
from coordinator import warmup

signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal's Python has it, whatever this inherited
real = subprocess.Popen
children = []


def popen(*args, **kwargs):
    # a SIGINT that arrived just before the signals were blocked has its Python handler run here, inside Popen
    # after the fork (Python runs a handler at its next bytecode boundary, wherever that is)
    child = real(*args, **kwargs)
    children.append(child.pid)
    signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
    return child


warmup.subprocess.Popen = popen
try:
    warmup.ensure_compiled([warmup.Unit("doorbells")], quiet=True)
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted")
alive = [pid for pid in children if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
for pid in alive:
    os.kill(pid, signal.SIGKILL)
print("alive", alive)
"""


def test_a_signal_while_the_compile_child_starts_stops_the_child_too(tmp_path):
    """SIGINT whose handler runs inside Popen, after the fork (Python runs handlers between bytecodes): the compile
    is interrupted and its child stopped with it. Before, the KeyboardInterrupt left Popen before the child was
    known, and the child compiled on with no parent (seen in test_a_split_generate_stopped_at_any_moment_...
    [compiling])."""
    done = subprocess.run([sys.executable, "-c", SIGNAL_INSIDE_POPEN], cwd=REPO, env=clean_env(tmp_path / "cache"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["interrupted", "alive []"], done.stdout + done.stderr


@pytest.mark.slow
def test_two_compiles_into_one_build_take_turns(tmp_path):
    """A second process compiling into the same build folder waits for the first (it says whom it waits for)
    and then finds the unit compiled: the unit is compiled once."""
    cache = tmp_path / "cache"
    env = clean_env(cache)
    first = subprocess.Popen([sys.executable, "-m", "coordinator.warmup", "host"], cwd=REPO, env=env,
                             stderr=subprocess.PIPE, text=True)
    lock = build_folder(cache, env) / "compile.lock"
    deadline = time.monotonic() + 60
    while not (lock.exists() and lock.read_text().startswith("pid")) and first.poll() is None:
        assert time.monotonic() < deadline, "the first compile never took the lock"
        time.sleep(0.01)
    second = subprocess.run([sys.executable, "-m", "coordinator.warmup", "host"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0 and second.returncode == 0
    compiled = [m for text in (err, second.stderr) for m in map(UNIT_LINE.match, text.splitlines()) if m]
    assert len(compiled) == 1, (err, second.stderr)
    if compiled[0].string in err:  # the second started while the first held the lock
        assert f"waiting for pid {first.pid}" in second.stderr


@pytest.mark.slow
def test_the_build_key_follows_the_sources_not_their_folder(tmp_path):
    """Two copies of the project in different folders name the same build; an edited kernel names another."""
    def key(root: Path) -> str:
        out = subprocess.run([sys.executable, "-c", "from shm import jit; print(jit.build_key().name)"], cwd=tmp_path,
                             env={**clean_env(tmp_path / "c"), "PYTHONPATH": str(root)}, capture_output=True,
                             text=True, check=True)
        return out.stdout.strip()

    copy = tmp_path / "a" / "copy"
    for package in ("coordinator", "node_worker", "shm"):
        shutil.copytree(REPO / package, copy / package, ignore=shutil.ignore_patterns("__pycache__"))
    assert key(copy) == key(REPO)
    rows = copy / "node_worker" / "kernels" / "rows.py"
    rows.write_text(rows.read_text() + "\n# an edit\n")
    assert key(copy) != key(REPO)


def test_every_module_with_compiled_code_is_part_of_the_build_key():
    """Every module that compiles (a numba decorator, an intrinsic) is in JIT_SOURCES, and so is every module of
    the project they import at the top (whose constants their code holds): an edit to any of them is a new
    build, never a stale cache."""
    import source_imports

    covered = set(jit.source_files())
    known = source_imports.project_modules()
    compiles = [p for p in known.values() if re.search(r"@(njit|intrinsic|register_jitable|vectorize)\b", p.read_text())]
    assert compiles and not [str(p.relative_to(REPO)) for p in compiles if p not in covered]

    # pool_io is in the key for the constants answer.py holds; its segment plumbing (shm.segments) is Python only
    python_only = {REPO / "shm" / "segments.py"}
    uncovered = []
    for path in covered:
        files = {known.get(i.target(known)) for i in source_imports.imports(path) if i.top_level}
        uncovered += [(str(path.relative_to(REPO)), str(f.relative_to(REPO))) for f in files
                      if f is not None and f not in covered and f not in python_only]
    assert not uncovered, uncovered


def test_a_kernel_set_generates_its_own_formats_loops_alone():
    """The kernel set is a compile-time argument: a function specialised for f32 holds no switch case of
    another format's loop, one for every format holds them all; the format names map to the loops
    EngineConfig.activations takes."""
    import numba
    import numpy as np
    from numba import njit

    from node_worker.kernels import simd

    @njit(cache=False)
    def four_rows(ks, fmt, data, x):
        return simd.dot4(ks, fmt, data, 0, 0, 0, 0, x.size, x)

    data, x = np.zeros(1024, np.uint8), np.zeros(32, np.float32)
    f32, every = KernelSet.of(["f32"], True), KernelSet.everything()
    for ks in (f32, every):
        assert four_rows(ks, 0, data, x) == (0.0, 0.0, 0.0, 0.0)
    ir = {str(sig[0]): four_rows.inspect_llvm(sig) for sig in four_rows.signatures}
    assert set(re.findall(r"format\.(\w+):", ir[str(numba.typeof(f32))])) - {"done"} == {"f32"}
    assert set(re.findall(r"format\.(\w+):", ir[str(numba.typeof(every))])) - {"done"} == set(simd.FORMATS)
    assert f32.int_act is False  # f32 has no integer loop: one set whatever the activations
    assert for_formats(["bf16"], "bf16") == KernelSet(("bf16dp",), False)
    assert for_formats(["q6k", "q4k", "q4k"], "q8") == KernelSet(("q4k", "q6k"), True)
    assert for_formats(["q4k"], "f32") == KernelSet(("q4k",), False)
    assert KernelSet.from_tag(for_formats(["q4k", "q6k"], "q8").tag) == KernelSet(("q4k", "q6k"), True)
    assert engine_units("process", f32, ["q8", "f32"]) == [Unit("host"), Unit("doorbells"), Unit("experts", "f32"),
                                                           Unit("encode", "q8")]
    assert [u.name for u in engine_units("inproc", None)] == ["host"]
    assert [u.name for u in engine_units("process", f32, gpu=True)] == ["host", "doorbells", "stream", "experts/f32"]
    assert Unit.parse("stream") == Unit("stream") and Unit("stream").label == "stream host functions"


def test_a_compiled_set_that_covers_a_models_formats_is_run_instead_of_compiling_its_own(monkeypatch, tmp_path):
    """compiled_cover: the model's own set where this build compiled it; else the smallest compiled set holding
    its loops in the same activation mode (an integer set would take integer loops a float run must not); else
    its own, to be compiled. The suite's engines run KernelSet.everything (conftest compiles it first)."""
    from node_worker.kernels import kernel_set

    q4k_q6k = for_formats(["q4k", "q6k"], "q8")
    every, every_f = KernelSet.everything(True), KernelSet.everything(False)
    wider = KernelSet.of(["q4k", "q5k", "q6k"], True)
    for compiled, want in [([], q4k_q6k), ([every.tag], every), ([every.tag, wider.tag], wider),
                           ([every.tag, wider.tag, q4k_q6k.tag], q4k_q6k), ([every_f.tag], q4k_q6k),
                           (["q4k-gone.i8", every.tag], every)]:
        monkeypatch.setattr(kernel_set, "finished_units", lambda kind, tags=compiled: list(tags) if kind == "experts"
                            else [])
        assert kernel_set.compiled_cover(q4k_q6k) == want, compiled
    monkeypatch.undo()
    assert kernel_set.compiled_cover(for_formats(["q4k"], "f32")) == every_f  # this session's cache
    assert every.covers(q4k_q6k) and not every.covers(for_formats(["q4k"], "f32"))
    from coordinator import Engine, EngineConfig

    own = for_formats(["f32"], "f32")  # make_model's experts
    with Engine.open(make_model(tmp_path / "m", seed=3), EngineConfig(pool="inproc")) as eng:
        ran = {w.kernels for w in eng.pool.workers}
    # the float set the suite compiled, or the f32 set alone where this cache holds it (a demo's first run
    # compiled it): no integer loops either way
    assert ran == {kernel_set.compiled_cover(own)} and ran <= {every_f, own}, ran


# -- stopped starts leave nothing behind -----------------------------------------------------------------------

def leftovers(pid: int, segments_before: set[str], folders_before: set[Path], children=()) -> list[str]:
    """What a stopped ``strata`` run (pid) left: its workers or compile (``children``: the processes it had
    started, seen before it was stopped), segments, pool folders."""
    left = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if f"--parent-pid {pid}" in cmd or ("coordinator.warmup" in cmd and p.ppid() == pid):
            left.append(f"process {p.pid}: {cmd}")
    for child in children:
        try:
            if child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
                left.append(f"process {child.pid}: {' '.join(child.cmdline())}")
        except psutil.Error:
            pass
    ours = {pid} | {c.pid for c in children}
    left += [f"segment {name}" for name in segments_left(segments_before, ours)]
    left += [f"folder {d}" for d in pool_folders_left(folders_before, ours)]
    return left


def interrupted(args: list[str], env: dict, when, signum=signal.SIGINT, group: bool = False) -> tuple[int, str]:
    """Start ``strata ARGS``, wait for ``when(proc, stderr so far)`` to be true, send the signal (to the process
    group, as a terminal's Ctrl-C, when ``group``), and return its exit status and stderr."""
    import tempfile

    before, folders = segments_now(), pool_folders_now()
    err_path = Path(tempfile.mkstemp(suffix=".err")[1])
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "coordinator", *args], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                stderr=err, stdin=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not when(proc, err_path.read_text()):
            assert proc.poll() is None, f"ended before the moment: {err_path.read_text()}"
            assert time.monotonic() < deadline, "the moment never came"
            time.sleep(0.02)
        try:
            children = psutil.Process(proc.pid).children(recursive=True)  # its workers and compile, if started
        except psutil.Error:
            children = []
        if group:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = err_path.read_text()
    err_path.unlink()
    deadline = time.monotonic() + 10  # the workers' own exit, after their parent's
    while (left := leftovers(proc.pid, before, folders, children)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, left
    return code, text


def has_worker(proc, _err: str) -> bool:
    """A node worker has started (its command line says so until it names itself strata-node<N>)."""
    try:
        return any("node_worker" in " ".join(c.cmdline()) or "strata-node" in " ".join(c.cmdline())
                   for c in psutil.Process(proc.pid).children())
    except psutil.Error:
        return False


def handles_sigterm(proc, _err: str) -> bool:
    """The entry point has set its handlers (cli/entry.py: SIGTERM is caught, which the interpreter alone does not
    do), so the command's imports are under way: the interpreter's own start is not what a test interrupts."""
    try:
        status = Path(f"/proc/{proc.pid}/status").read_text()
    except OSError:
        return False
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def has_segment(proc, _err: str) -> bool:
    return any(p.name.startswith("strata.") and not p.name.startswith("strata.pool") and has_worker(proc, _err)
               for p in Path("/dev/shm").glob("strata.*"))


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["importing", "compiling", "workers starting", "segments filled", "generating"])
def test_a_split_generate_stopped_at_any_moment_leaves_nothing_and_no_traceback(tmp_path, moment):
    """SIGINT (as `kill -INT`) at each phase of `generate --numa-split --nodes 2`: during the imports, the kernel
    compile (an empty cache), the workers' start, their segments' fill, the generation. Exit status 130, no
    traceback, and no worker, compile, segment or pool folder left."""
    model = make_model(tmp_path / "m", seed=0, num_layers=2)
    cold = moment in ("importing", "compiling")
    env = clean_env(tmp_path / "cache" if cold else None)
    args = ["generate", "-m", str(model), "--prompt", "Once upon a time", "--numa-split", "--nodes", "2", "-n",
            "4" if cold else "4000"]  # warm: long enough a run to catch each moment of it
    if not cold:  # compiled beforehand: the start itself is what is interrupted
        assert strata(*args[:-1], "1", env=env).returncode == 0
    when = {"importing": handles_sigterm,
            "compiling": lambda p, e: "compiling CPU kernels" in e,
            "workers starting": has_worker,
            "segments filled": has_segment,
            "generating": lambda p, e: "pool process" in e}[moment]
    code, err = interrupted(args, env, when)
    assert code == 130, err
    assert "Traceback" not in err and "Exception ignored" not in err, err


CALLBACK_STOP = """
import ctypes, signal, sys
from coordinator.warmup import end_at_once_when_stopped
signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal's Python has it, whatever this inherited
if sys.argv[1] == "child":
    end_at_once_when_stopped()
libc = ctypes.CDLL(None)
compare = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int))

def stopped_inside(a, b):  # numba's object-cache notifications run as such callbacks, called by LLVM
    signal.raise_signal(signal.SIGINT)
    return a[0] - b[0]

values = (ctypes.c_int * 2)(2, 1)
libc.qsort(values, 2, ctypes.sizeof(ctypes.c_int), compare(stopped_inside))
print("went on after the stop")
"""


@pytest.mark.slow
@pytest.mark.parametrize("handlers", ["child", "python"])
def test_a_stop_inside_a_ctypes_callback_ends_the_compile_child_at_once(handlers):
    """The compile child's handlers end it where a signal finds it, inside a callback from C as elsewhere: status
    130, nothing printed. Python's own handler there raises a KeyboardInterrupt that ctypes prints as "Exception
    ignored" and the process goes on (numba's compile then fails on a missing object): the race a terminal's Ctrl-C
    lost 5 s into a cold compile."""
    out = subprocess.run([sys.executable, "-c", CALLBACK_STOP, handlers], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    if handlers == "child":
        assert (out.returncode, out.stdout, out.stderr) == (130, "", "")
    else:
        assert "Exception ignored" in out.stderr and "went on" in out.stdout


@pytest.mark.slow
def test_importing_the_command_and_the_engine_compiles_nothing(tmp_path):
    """On an empty cache, importing the command and the engine compiles no function in that process: a compile in
    the command's own process is one a Ctrl-C can land in, inside numba's callbacks (the compile child does them
    all). The stream's host functions compile on first use."""
    code = ("import json; from coordinator.cli import main; from coordinator import engine; "
            "from shm import compile_log, pool_signal; imported = compile_log.compiled(); pool_signal.ring_address(); "
            "print(json.dumps([imported, compile_log.compiled()]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(tmp_path / "cache"),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    imported, used = json.loads(out.stdout)
    assert imported == [] and any("ring" in name for name in used), (imported, used)


@pytest.mark.slow
@pytest.mark.parametrize("seconds", [1, 2, 5, 10])
def test_a_terminals_ctrl_c_during_a_cold_split_generate_prints_no_traceback(tmp_path, seconds):
    """Ctrl-C as a terminal sends it (the whole process group: the command and its compile child at once) 1, 2, 5
    and 10 s into a cold `generate --numa-split --nodes 2`, whatever it is doing then (importing, compiling):
    exit status 130, no traceback, no "Exception ignored" from numba's callbacks, no compile error, nothing left;
    the units the compile finished are kept."""
    model = make_model(tmp_path / "m", seed=0, num_layers=2)
    cache = tmp_path / "cache"
    env = clean_env(cache)
    start = time.monotonic()
    code, err = interrupted(["generate", "-m", str(model), "--prompt", "Once", "--numa-split", "--nodes", "2", "-n",
                             "4"], env, lambda p, e: time.monotonic() - start >= seconds, group=True)
    assert code == 130, err
    assert "Traceback" not in err and "Exception ignored" not in err and "error" not in err, err
    markers = list(cache.glob("*/units/*.json"))
    assert all(json.loads(m.read_text())["functions"] >= 0 for m in markers)  # whole, where any was written


@pytest.mark.slow
def test_chat_stopped_at_its_prompt_by_a_terminals_ctrl_c_leaves_nothing(tmp_path):
    """Ctrl-C at chat's idle prompt, as a terminal sends it (the whole process group): the chat ends with 130,
    no "Exception ignored" from a worker, nothing left (the node workers run in sessions of their own)."""
    model = make_model(tmp_path / "m", seed=0, num_layers=2)
    env = clean_env()
    args = ["chat", "-m", str(model), "--numa-split", "--nodes", "2"]
    code, err = interrupted(args, env, lambda p, e: "chat: /help" in e, group=True)
    assert code == 130 and "Traceback" not in err and "Exception ignored" not in err, err


@pytest.mark.slow
def test_a_worker_start_timeout_leaves_nothing(tmp_path):
    """Workers that do not say HELLO within STRATA_WORKER_START_TIMEOUT: the error names the nodes and the
    setting, and the workers, their segments and the pool's folder are gone."""
    model = make_model(tmp_path / "m", seed=0, num_layers=2)
    env = clean_env()
    assert strata("generate", "-m", str(model), "--prompt-ids", "1", "-n", "1", env=env).returncode == 0  # compiled
    before, folders = segments_now(), pool_folders_now()
    out = strata("generate", "-m", str(model), "--prompt-ids", "1", "-n", "1", "--numa-split", "--nodes", "2",
                 env={**env, "STRATA_WORKER_START_TIMEOUT": "0.2"})
    assert out.returncode == 2, out.stderr
    assert re.search(r"node 0 \(pid \d+\), node 1 \(pid \d+\) did not finish starting within 0s", out.stderr)
    assert "STRATA_WORKER_START_TIMEOUT" in out.stderr and "Traceback" not in out.stderr
    assert not segments_left(before)  # the run has ended: any segment of its processes has a dead owner
    assert not pool_folders_left(folders)


@pytest.mark.slow
def test_a_worker_gone_before_its_hello_has_its_segment_removed(tmp_path):
    """The supervisor's clean-up knows a worker's segment by name (model, plan, node) without its HELLO: a
    worker stopped while filling it (dead, its segment half-written) leaves nothing."""
    from coordinator.pool.supervisor import Supervisor, WorkerHandle
    from shm import segments
    from shm.topology import Node

    name = segments.segment_name("m" * 16, "p" * 16, 3)
    code = ("import sys; from shm import segments; "
            f"segments.create({name!r}, 3, {'m' * 16!r}, {'p' * 16!r}, {{'kind': 'test'}}, 4096)")
    child = subprocess.Popen([sys.executable, "-c", code], cwd=REPO)  # makes it, then exits without unlinking
    assert child.wait(60) == 0
    try:
        assert not segments.read_header(name).complete
        sup = Supervisor.__new__(Supervisor)
        sup.plan_digest, sup.model_digest, sup.keep_shm = "p" * 16, "m" * 16, True  # kept: a complete one only
        handle = WorkerHandle(Node(3, (0,), None, None), b"node3")
        handle.proc = child
        sup.remove_orphan_segment(handle)
        with pytest.raises(segments.SegmentError, match="does not exist"):
            segments.read_header(name)
    finally:
        segments.unlink(name)


@pytest.mark.slow
def test_a_cache_that_cannot_be_written_or_fills_up_is_named(tmp_path, monkeypatch, capsys):
    """An unwritable cache folder and a full disk while numba writes: one line each naming the folder and the
    cause (exit status 2), and the engine's start says the compile failed, pointing at it."""
    out = subprocess.run([sys.executable, "-m", "coordinator.warmup", "host"], cwd=REPO,
                         env=clean_env(Path("/proc/self/strata-cache")), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "the kernel cache folder /proc/self/strata-cache/" in out.stderr and "cannot be written" in out.stderr
    assert "NUMBA_CACHE_DIR" in out.stderr

    import errno

    from coordinator import warmup

    def full(self) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(warmup.Unit, "compile", full)
    monkeypatch.setattr(warmup, "missing", lambda units: list(units))
    assert warmup.main(["host", "-q"]) == 2
    err = capsys.readouterr().err
    assert "writing the kernel cache in" in err and "failed: No space left on device" in err
