"""Shared fixtures: tiny random checkpoints written under the test's tmp_path."""

from __future__ import annotations

from shm.threads_env import apply

apply()  # the tests run with the thread settings of the strata command, set before NumPy loads

import contextlib  # noqa: E402
import fcntl  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path

import numpy as np
import pytest
from served import Served, start_server, stop_server

from coordinator.cli.make_model import make_model
from coordinator.config import EngineConfig
from coordinator.engine import Engine
from shm.checkpoint import INDEX_NAME, Checkpoint
from shm.checkpoint_writer import save_checkpoint


# -- tiers: ./tools/test.sh --quick leaves out the tests marked slow --------------------------------------------
# Slow: a test that starts processes (strata commands, servers, node workers), compiles into an empty cache, or
# drives a whole engine through the CUDA emulator; a module marks itself (pytestmark), a test its own, and a
# test that takes one of these fixtures is marked here.
SLOW_FIXTURES = {"serve", "server", "gpu"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def tiny_model(tmp_path):
    """make_model under tmp_path: ``tiny_model(name="m", arch=..., seed=..., **geometry)`` -> its dir."""
    def make(name: str = "m", **kwargs) -> Path:
        return make_model(tmp_path / name, **kwargs)
    return make


def read_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint as an owned float32 copy (safe to delete the files afterwards)."""
    ckpt = Checkpoint(model_dir)
    try:
        return {name: np.array(ckpt.float32(name)) for name in ckpt.names()}
    finally:
        ckpt.close()


def rewrite_checkpoint(model_dir: Path, tensors: dict[str, np.ndarray], **kwargs) -> None:
    """Replace a checkpoint's safetensors (and index) by ``tensors``; unlink first so no live map is truncated."""
    for f in Path(model_dir).glob("*.safetensors"):
        f.unlink()
    (Path(model_dir) / INDEX_NAME).unlink(missing_ok=True)
    save_checkpoint(model_dir, tensors, **kwargs)


def edit_config(model_dir: Path, edit) -> None:
    """Load config.json, call ``edit(cfg)`` on the dict, write it back."""
    path = Path(model_dir) / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg))


@pytest.fixture
def checkpoint_tools():
    """The helpers above, for tests that rewrite a checkpoint or its config."""
    class Tools:
        read = staticmethod(read_tensors)
        rewrite = staticmethod(rewrite_checkpoint)
        config = staticmethod(edit_config)
    return Tools


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
SESSION_HANDLERS = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}  # as the pytest process began


@pytest.fixture(autouse=True)
def stop_signals_kept():
    """SIGINT's and SIGTERM's handlers as the pytest process began, around each test: serve() and the command's
    entry run in-process leave them ignored for their caller's teardown (serving/server.py, cli/entry.py), in a
    test or in a module's fixture, and a child Python started later would inherit the ignored SIGINT and never see
    a KeyboardInterrupt."""
    for sig, handler in SESSION_HANDLERS.items():
        signal.signal(sig, handler)
    yield
    for sig, handler in SESSION_HANDLERS.items():
        signal.signal(sig, handler)


@pytest.fixture(scope="session", autouse=True)
def every_kernel_loop_compiled_once():
    """Every experts loop compiled once per activation mode before any test (KernelSet.everything): each engine
    and node worker after it runs that set (kernel_set.compiled_cover), so a fresh cache pays one compile per
    format, not one per mix of formats the fixtures hold. The tests of compiling itself use caches of their own."""
    from coordinator.warmup import Unit, ensure_compiled
    from node_worker.kernels.kernel_set import KernelSet

    ensure_compiled([Unit.experts(KernelSet.everything(int_act)) for int_act in (False, True)], quiet=True)


DEV_SHM_LOCK = "strata-tests-dev-shm.lock"  # in the temp folder: every pytest process on this machine takes it


@contextlib.contextmanager
def dev_shm_held():
    """An exclusive lock among the suite's processes (pytest -n workers, another checkout's run)."""
    with open(Path(tempfile.gettempdir()) / DEV_SHM_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture
def dev_shm_alone():
    """/dev/shm's strata segments and the pool folders to this test alone while it runs: taken by the tests that
    SIGKILL strata processes (their segments outlive them, owner dead, until a restart adopts them), that clean
    every dead owner's segment (`shm clean --all`), or that look for leftovers among all of them; the other
    tests of a parallel run (./tools/test.sh runs two) go on beside them."""
    with dev_shm_held():
        yield


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind():
    """After the whole suite: no strata segment in /dev/shm and no node worker process of ours."""
    from leftovers import pool_folders_now, segments_now

    before, dirs_before = segments_now(), pool_folders_now()
    yield
    with dev_shm_held():  # no test of a parallel worker between its SIGKILL and its restart
        check_nothing_left(before, dirs_before)


def check_nothing_left(before: set[str], dirs_before: set[Path]) -> None:
    import os

    import psutil

    from leftovers import pool_folders_left, segments_left

    me = psutil.Process(os.getpid())
    ours = {os.getpid()} | {p.pid for p in me.children(recursive=True)}
    left = segments_left(before, ours)  # another live program's are not ours

    def is_worker(p) -> bool:
        try:
            cmd = " ".join(p.cmdline())
            return "node_worker" in cmd or cmd.startswith("strata-node") or p.name().startswith("strata-node")
        except psutil.Error:
            return False

    workers = [p for p in me.children(recursive=True) if is_worker(p)]
    dirs_left = pool_folders_left(dirs_before, ours)
    assert not left, f"segments leaked by the suite: {left}"
    assert not dirs_left, f"pool folders leaked by the suite: {dirs_left}"
    assert not workers, f"node worker processes left running: {[w.pid for w in workers]}"


# -- `strata serve` as a subprocess: shared by test_server, test_server_faults, test_client_limits ----------


@pytest.fixture(scope="module")
def serve_model(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("serve") / "m", seed=0)


@pytest.fixture(scope="module")
def serve_engine(serve_model):
    """The served model in this process: the reference for greedy outputs."""
    eng = Engine.open(serve_model, EngineConfig(pool="inproc"))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def serve_logdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("serve-logs")


@pytest.fixture(scope="module")
def server(serve_model, serve_logdir):
    """One shared inproc server with default limits."""
    s = start_server(serve_model, serve_logdir)
    yield s
    assert stop_server(s) == 0, s.stderr()


@pytest.fixture
def serve(serve_model, serve_logdir):
    """Start a server of one's own: ``serve(*flags, bind=..., pool=...)``; stopped with SIGTERM at teardown."""
    started: list[Served] = []

    def start(*args, **kwargs) -> Served:
        s = start_server(serve_model, serve_logdir, *args, **kwargs)
        started.append(s)
        return s

    yield start
    for s in started:
        stop_server(s)


@pytest.fixture(params=[pytest.param("cuda", marks=pytest.mark.gpu), "emulated"])
def cp(request, tmp_path_factory, monkeypatch):
    """CuPy on a GPU, or the kernel emulator's stand-in for it (tests/cuda_emulator.py): the kernel modules
    (device_ops, device/format_kernels, device/experts, device/router) import ``cupy`` when called."""
    import sys

    import cuda_emulator
    import device_standin
    from coordinator.gpu.probe import probe_cuda

    if request.param == "cuda":
        usable, why = probe_cuda()
        if not usable:
            pytest.skip(f"no usable GPU: {why}")
        import cupy

        yield cupy
        return
    ok, why = cuda_emulator.available()
    if not ok:
        pytest.skip(why)
    monkeypatch.setitem(sys.modules, "cupy", cuda_emulator.cupy_shim(cuda_emulator.cache_dir()))
    device_standin.clear_kernel_caches()
    yield sys.modules["cupy"]
    device_standin.clear_kernel_caches()  # the next user gets the real module's kernels


@pytest.fixture
def gpu(tmp_path_factory, monkeypatch):
    """The whole engine's GPU path on the CPU: tests/device_standin.py's CuPy, every kernel emulated."""
    import cuda_emulator
    import device_standin

    ok, why = cuda_emulator.available()
    if not ok:
        pytest.skip(why)
    with device_standin.installed(cuda_emulator.cache_dir(), monkeypatch) as standin:
        yield standin

