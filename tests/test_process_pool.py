"""The process pool against the in-process pool on the same plan: bitwise, and under faults."""

from __future__ import annotations

import itertools
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import psutil
import pytest

from coordinator import Engine, EngineConfig
from coordinator.cli.make_model import make_model
from coordinator.cpu_experts import build_inproc_pool, plan_cpu_experts, pool_nodes, worker_job
from coordinator.errors import StepInterrupted
from coordinator.model.source import open_source
from coordinator.model.weights import load_weights
from coordinator.pool import PoolRequest
from coordinator.pool.process import PoolError, ProcessPool, WorkerDied, row_pieces
from node_worker import protocol as P
from node_worker.job import WorkerJob

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("dev_shm_alone")]  # node worker processes, killed and restarted

PROMPT = [72, 101, 108, 108, 111, 44, 32]


@pytest.fixture(scope="module")
def uneven_model(tmp_path_factory):
    # 200 rows: not a multiple of 32, so the slices of 2 and 3 nodes are uneven
    return make_model(tmp_path_factory.mktemp("uneven"), seed=11, moe_intermediate_size=200, num_layers=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny"), seed=5)


def random_request(rng, layer, T, k, E, H, cpu_experts):
    """T tokens, each routed to k distinct experts, of which only the CPU-side ones reach the pool."""
    x = rng.standard_normal((T, H)).astype(np.float32)
    tokens, experts, weights = [], [], []
    for t in range(T):
        for e in rng.choice(E, size=k, replace=False):
            if e in cpu_experts:
                tokens.append(t)
                experts.append(e)
                weights.append(rng.random())
    return PoolRequest(layer, x, np.array(tokens, np.int64), np.array(experts, np.int64),
                       np.array(weights, np.float32))


def pools_for(model_dir, nodes, threads, fmt="f32", activations=EngineConfig.activations):
    cfg = EngineConfig(pool="process", numa_split=True, nodes=nodes, worker_threads=threads, expert_dtype=fmt,
                       activations=activations)
    source = open_source(model_dir)
    cpu = plan_cpu_experts(source, cfg, load_weights(source.config, source.checkpoint).experts, pool_nodes(cfg))
    inproc = build_inproc_pool(source, cpu, threads=1, activations=activations)
    proc = ProcessPool(cpu.plan, list(cpu.nodes), worker_job(source, cpu, cfg, 4096), cfg)
    return source.config, cpu.plan, inproc, proc


NODES_THREADS = list(itertools.product([2, 3], [1, 2, 3]))
# tokens, experts per token, some experts on the device, layer (layer 1 collects into the coordinator's buffer)
REQUESTS = list(itertools.product([1, 2, 5, 33], [1, 2, 8], [False, True], [0, 1]))
MIN_COMPARISONS = 192
FORMATS = ["f32", "bf16", "q8", "q4", "bf16+bf16"]  # the last: bf16 experts by bf16 activations (kernels/bf16dp.py)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("nodes,threads", NODES_THREADS)
def test_process_pool_is_bitwise_equal_to_inproc(uneven_model, nodes, threads, fmt):
    fmt, _, activations = fmt.partition("+")
    mcfg, plan, inproc, proc = pools_for(uneven_model, nodes, threads, fmt, activations or "q8")
    try:
        assert len(plan.slices_for(200)) == nodes
        assert {s.rows for s in plan.slices_for(200)} != {200 // nodes}  # uneven
        assert {w.hello["expert_format"] for w in proc.workers} == {w.store.fmt for w in inproc.workers} == {fmt}
        rng = np.random.default_rng(nodes * 10 + threads)
        E, H = mcfg.num_experts, mcfg.hidden_size
        for T, k, device_resident, layer in REQUESTS:  # each one compared (an empty one is drawn again)
            cpu_experts = set(range(E)) - ({0, 3, 6} if device_resident else set())
            req = random_request(rng, layer, T, k, E, H, cpu_experts)
            while req.tokens.size == 0:  # all routed to the device: nothing for the pool
                req = random_request(rng, layer, T, k, E, H, cpu_experts)
            inproc.submit(req)
            want = inproc.collect()
            out = np.full((T, H), np.nan, np.float32) if layer == 1 else None  # the coordinator's buffer, or none
            proc.submit(req)
            got = proc.collect(out=out)
            assert got.shape == (T, H) and np.abs(want).max() > 0
            assert out is None or got is out
            assert np.array_equal(got, want), (fmt, nodes, threads, T, k, device_resident, layer)
    finally:
        proc.close()
        inproc.close()


def test_enough_bitwise_comparisons_ran():
    """Each parametrised run compares every one of REQUESTS, for every format: counted from the
    parametrisation itself, so this holds when run alone, not only after the runs filled a global."""
    assert len(NODES_THREADS) * len(REQUESTS) >= MIN_COMPARISONS, len(NODES_THREADS) * len(REQUESTS)


def test_row_pieces_cut_at_the_segments_rows_and_pairs():
    tokens = np.repeat(np.arange(10), [1, 3, 3, 0, 2, 3, 3, 1, 0, 2])  # [18] each row's pairs, rows in order
    assert row_pieces(tokens, 10, 10, 18) == [(0, 10)]  # fits: one piece, no counting
    assert row_pieces(tokens, 10, 4, 100) == [(0, 4), (4, 8), (8, 10)]
    pieces = row_pieces(tokens, 10, 10, 6)
    assert pieces == [(0, 2), (2, 5), (5, 7), (7, 10)]  # 1+3 pairs, 3+0+2, 3+3, 1+0+2: each at most 6
    assert all(np.isin(tokens, np.arange(lo, hi)).sum() <= 6 for lo, hi in pieces)
    with pytest.raises(PoolError, match="routes 3 pairs"):
        row_pieces(tokens, 10, 10, 2)
    with pytest.raises(PoolError, match="out of range"):
        row_pieces(np.array([0, 12], np.int64), 10, 4, 100)


def test_a_request_larger_than_the_segment_goes_in_pieces_with_the_same_bits(uneven_model):
    """A segment of 7 rows and 20 pairs: requests of up to 33 rows of 8 pairs each come back equal to the
    in-process pool's within float32 rounding (an expert's tokens are tiled by their count, which the pieces
    change), split over 2 nodes, in the coordinator's buffer or a new one; one that fits, bit for bit."""
    cfg = EngineConfig(pool="process", numa_split=True, nodes=2, worker_threads=1)
    source = open_source(uneven_model)
    cpu = plan_cpu_experts(source, cfg, load_weights(source.config, source.checkpoint).experts, pool_nodes(cfg))
    inproc = build_inproc_pool(source, cpu, threads=1)
    proc = ProcessPool(cpu.plan, list(cpu.nodes), worker_job(source, cpu, cfg, 7), cfg, max_pairs=20)
    try:
        assert proc.io.layout.max_tokens == 7 and proc.io.layout.max_pairs == 20
        rng = np.random.default_rng(3)
        E, H = source.config.num_experts, source.config.hidden_size
        before = proc.stats["requests"]
        for T, k, layer in [(33, 8, 0), (8, 2, 1), (5, 4, 0), (20, 1, 1), (4, 5, 0)]:
            req = random_request(rng, layer, T, k, E, H, set(range(E)))
            inproc.submit(req)
            want = inproc.collect()
            out = np.full((T, H), np.nan, np.float32) if layer == 1 else None
            proc.submit(req)
            got = proc.collect(out=out)
            assert out is None or got is out
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"{T} rows, {k} pairs each")
            assert T > 7 or T * k > 20 or np.array_equal(got, want)  # one piece: one request
        assert proc.stats["requests"] - before >= 33 * 8 // 20 + 2  # the pieces went one by one
    finally:
        proc.close()
        inproc.close()


def test_a_prompt_longer_than_the_segment_is_prefilled_in_pieces(tiny):
    """prefill_chunk 4: the segment holds 4 + 64 rows; a 100-token prompt in one pass (Engine.logits) gives the
    in-process pool's logits within float32 rounding, split over two nodes, and greedy decoding after it the
    same tokens."""
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 256, 100)]
    with Engine.open(tiny, EngineConfig(pool="process", numa_split=True, nodes=2, prefill_chunk=4)) as eng:
        assert eng.pool.io.layout.max_tokens == 68
        got = eng.logits(prompt)
        got_ids = eng.generate(prompt, max_new_tokens=8, stop_at_eos=False)
    with Engine.open(tiny, EngineConfig(pool="inproc", numa_split=True, nodes=2, prefill_chunk=4)) as eng:
        want = eng.logits(prompt)
        want_ids = eng.generate(prompt, max_new_tokens=8, stop_at_eos=False)
    assert got.shape[0] == 100
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert got_ids == want_ids


def test_split_vs_unsplit_and_whole_generate(tiny):
    with Engine.open(tiny, EngineConfig(pool="process")) as eng:
        single = eng.logits(PROMPT)
        assert len(eng.pool.workers) == 1 and eng.pool.health()[0]["slice_rows"] == [0, 80]
    with Engine.open(tiny, EngineConfig(pool="process", numa_split=True, nodes=2)) as eng:
        split = eng.logits(PROMPT)
        split_ids = eng.generate(PROMPT, max_new_tokens=12, stop_at_eos=False)
    with Engine.open(tiny, EngineConfig(pool="inproc", numa_split=True, nodes=2)) as eng:
        inproc_ids = eng.generate(PROMPT, max_new_tokens=12, stop_at_eos=False)
        assert np.array_equal(eng.logits(PROMPT), split)
    np.testing.assert_allclose(split, single, atol=2e-5, rtol=0)
    assert split_ids == inproc_ids


def _kill(pool, index, sig=signal.SIGKILL):
    w = pool.workers[index]
    os.kill(w.pid, sig)
    w.proc.wait(timeout=5)


def test_sigkill_mid_generation_restarts_and_output_is_identical(tiny):
    cfg = EngineConfig(pool="process", numa_split=True, nodes=2)
    with Engine.open(tiny, cfg) as eng:
        want = eng.generate(PROMPT, max_new_tokens=10, stop_at_eos=False)
        old_pid = eng.pool.workers[1].pid
        seen = []

        def kill_at_third(token):
            seen.append(token)
            if len(seen) == 3:
                _kill(eng.pool, 1)

        got = eng.generate(PROMPT, max_new_tokens=10, stop_at_eos=False, on_token=kill_at_third)
        health = eng.pool.health()
    assert got == want
    assert health[1]["pid"] != old_pid and health[1]["alive"] and health[1]["restarts"] == 1
    assert health[1]["reloaded"] is False  # reattached to its complete segment


def test_death_between_submit_and_collect_is_seen_by_the_sentinel(tiny):
    with Engine.open(tiny, EngineConfig(pool="process", numa_split=True, nodes=2)) as eng:
        x = np.ones((2, eng.model_config.hidden_size), np.float32)
        req = PoolRequest(0, x, np.array([0, 1]), np.array([1, 2]), np.array([0.5, 0.5], np.float32))
        eng.pool.submit(req)
        want = eng.pool.collect()
        w = eng.pool.workers[0]
        os.kill(w.pid, signal.SIGSTOP)  # it cannot answer before it dies
        eng.pool.submit(req)  # the send succeeds: the process is still there
        os.kill(w.pid, signal.SIGKILL)
        got = eng.pool.collect()  # only the sentinel can tell
        assert np.array_equal(got, want) and eng.pool.stats["restarts"] == 1


def test_killed_twice_fails_cleanly(tiny):
    with Engine.open(tiny, EngineConfig(pool="process", numa_split=True, nodes=2)) as eng:
        pids, seen = [], []

        def kill_each(token):
            seen.append(token)
            if len(seen) in (2, 3):
                pids.append(eng.pool.workers[0].pid)
                _kill(eng.pool, 0)

        with pytest.raises(WorkerDied) as info:
            eng.generate(PROMPT, max_new_tokens=10, stop_at_eos=False, on_token=kill_each)
    err = info.value
    assert err.node == 0 and err.pid == pids[-1] and "SIGKILL" in err.status
    assert "died twice within" in str(err)


def _raw_reply(pool, frames, name=""):
    w = pool.workers[0]
    pool.channel.sock.send_multipart([w.identity] + frames)
    assert pool.channel.sock.poll(5000), f"worker did not answer {name}"
    reply = pool.channel.sock.recv_multipart()
    return P.decode(reply[1:])


def test_garbage_and_oversized_frames_get_error_replies_and_worker_keeps_serving(tiny):
    """Malformed control messages (the socket's: the layers go through the data path) are answered with an ERROR
    naming the problem, and the worker serves on with the same numbers; the retired COMPUTE type is unknown."""
    with Engine.open(tiny, EngineConfig(pool="process")) as eng:
        pool = eng.pool
        want = eng.logits(PROMPT)
        good = P.encode_membw(P.MemBw(99, 1 << 20, 1))
        cases = {
            "garbage": [b"\x00garbage"],
            "version": [bytes([7, P.MsgType.MEMBW]), good[1]],
            "unknown type": [bytes([P.PROTOCOL_VERSION, ord("Z")])],
            "retired COMPUTE": [bytes([P.PROTOCOL_VERSION, ord("C")]), b"\0" * 24],
            "short header": [good[0], good[1][:-1]],
            "frame count": good + [b"extra"],
            "MEMBW range": [good[0], P.MEMBW_HDR.pack(99, 0, 1)],
            "worker-bound HELLO": P.encode_hello(P.Hello({"pid": 1})),
        }
        for name, frames in cases.items():
            reply = _raw_reply(pool, frames, name)
            assert isinstance(reply, P.Error) and not reply.fatal, name
            assert "bad message" in reply.message or "unexpected Hello" in reply.message, (name, reply.message)
        # a message beyond the size limit: refused with an error reply
        big = pool.job.max_message_bytes + 1
        reply = _raw_reply(pool, [good[0], b"\0" * big], "oversized")
        assert isinstance(reply, P.Error) and "exceed" in reply.message
        assert np.array_equal(eng.logits(PROMPT), want)  # still serving, same numbers
        assert pool.workers[0].proc.poll() is None


COORDINATOR = """
import sys
from coordinator import Engine, EngineConfig
eng = Engine.open(sys.argv[1], EngineConfig(pool="process", numa_split=True, nodes=2))
eng.logits([1, 2, 3])
print(" ".join(str(w.pid) for w in eng.pool.workers), flush=True)
sys.stdin.read()
"""


def test_coordinator_sigkill_takes_workers_and_next_start_reattaches(tiny):
    import subprocess
    import sys

    import psutil

    from shm.segments import list_segments

    coord = subprocess.Popen([sys.executable, "-c", COORDINATOR, str(tiny)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in coord.stdout.readline().split()]
        assert len(pids) == 2
        workers = [psutil.Process(p) for p in pids]
        assert [s.name.startswith("/strata.pool.") for s in list_segments()
                if s.header and s.header.owner_pid == coord.pid] == [True]  # its data path, mapped by both
        coord.kill()
        coord.wait(timeout=5)
        t0 = time.monotonic()
        gone, alive = psutil.wait_procs(workers, timeout=5)
        assert not alive, f"workers still running 5 s after the coordinator died: {[p.pid for p in alive]}"
        assert time.monotonic() - t0 < 5
        # SIGTERM from the parent watch: they ran their clean-up, so no segment is left
        left = [s for s in list_segments() if s.header and s.header.owner_pid in pids]
        assert left == []
        # the data path's segment, the dead coordinator's, goes with its workers
        assert [s.name for s in list_segments() if s.header and s.header.owner_pid == coord.pid] == []
    finally:
        if coord.poll() is None:
            coord.kill()
        coord.stdin.close()
        coord.stdout.close()
    killed_dirs = [d for d in Path(tempfile.gettempdir()).glob("strata-pool-*")
                   if json.loads((d / "owner.json").read_text())["pid"] == coord.pid]
    assert len(killed_dirs) == 1  # a SIGKILL leaves its pool folder ...
    with Engine.open(tiny, EngineConfig(pool="process", numa_split=True, nodes=2)) as eng:
        assert eng.logits([1, 2, 3]).shape[0] == 3
        assert not killed_dirs[0].exists()  # ... and the next start removes it, its owner being gone
        assert eng.pool.channel.dir.exists()


def test_next_start_handles_segments_a_sigkill_left(tiny):
    """Workers SIGKILLed with their coordinator leave complete segments; the next start reattaches."""
    import subprocess
    import sys

    import psutil

    coord = subprocess.Popen([sys.executable, "-c", COORDINATOR, str(tiny)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in coord.stdout.readline().split()]
    for p in pids:
        os.kill(p, signal.SIGKILL)
    psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=5)
    coord.kill()
    coord.wait(timeout=5)
    coord.stdin.close()
    coord.stdout.close()
    with Engine.open(tiny, EngineConfig(pool="process", numa_split=True, nodes=2)) as eng:
        health = eng.pool.health()
        assert [h["reloaded"] for h in health] == [False, False]
        assert eng.logits([1, 2, 3]).shape[0] == 3


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_worker_sigterm_or_sigint_removes_its_segment(tiny, sig):
    from shm.segments import SegmentError, read_header

    with Engine.open(tiny, EngineConfig(pool="process", numa_split=True, nodes=2)) as eng:
        name = eng.pool.workers[0].hello["segment"]
        assert read_header(name).complete
        os.kill(eng.pool.workers[0].pid, sig)
        assert eng.pool.workers[0].proc.wait(timeout=5) == 128 + sig
        with pytest.raises(SegmentError, match="does not exist"):
            read_header(name)


def test_spin_setting_reaches_both_sides_and_changes_nothing(tiny):
    with Engine.open(tiny, EngineConfig(pool="process", pool_spin_us=200.0)) as eng:
        assert eng.pool.channel.spin_s == 200e-6  # the coordinator's side
        args = eng.pool.workers[0].proc.args
        job = WorkerJob.from_json(open(args[args.index("--job") + 1]).read())  # what the worker reads
        assert job.spin_us == 200.0
        spun = eng.logits(PROMPT)
    with Engine.open(tiny, EngineConfig(pool="inproc")) as eng:
        assert np.array_equal(eng.logits(PROMPT), spun)


def _fresh_python(code: str, *args: str, env: dict[str, str] | None = None) -> str:
    """The last line ``code`` prints in a fresh interpreter without the wait settings of this one, plus ``env``
    (libgomp reads them once a process, so each case needs its own)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code, *args], env=dict(clean, **(env or {})), capture_output=True,
                         text=True, check=True, cwd=Path(__file__).resolve().parents[1])
    return out.stdout.splitlines()[-1]


def _kernel_wait_settings(env: dict[str, str]) -> dict:
    """What the entry points' thread settings and node_worker.kernel_threads make of ``env`` in a fresh
    interpreter."""
    return json.loads(_fresh_python("import json, os; from shm import threads_env; threads_env.apply(); "
                                    "from node_worker import kernel_threads as k; from shm.formats import ExpertFormats; P = ExpertFormats.parse; "
                                    "out = {'spin': os.environ.get('GOMP_SPINCOUNT'), 'worker': k.worker_env(P('q4')), "
                                    "'bf16_worker': k.worker_env(P('bf16/bf16/bf16;1=q8/q8/q8')), "
                                    "'f32_worker': k.worker_env(P('f32;1=bf16'))}; "
                                    "out['settled'] = [k.settle(False), k.settle(True)]; print(json.dumps(out))",
                                    env=env))


def test_kernel_threads_spin_in_workers_and_coordinators_with_kernels_unless_the_user_chose(tiny, monkeypatch):
    # the first engine's pool and dense matrices settle it once: no kernels of its own (False) -> 0, for good
    # workers: spinning (and sleeping as a team between layers) unless every expert matrix is f32 or bf16
    assert _kernel_wait_settings({}) == {"spin": "10000", "worker": {"GOMP_SPINCOUNT": "10000"},
                                         "bf16_worker": {"GOMP_SPINCOUNT": "10000"},
                                         "f32_worker": {"GOMP_SPINCOUNT": "0"}, "settled": ["0", "0"]}
    assert _kernel_wait_settings({"OMP_WAIT_POLICY": "ACTIVE"}) == {"spin": None, "worker": {}, "bf16_worker": {},
                                                                    "f32_worker": {}, "settled": [None, None]}
    assert _kernel_wait_settings({"GOMP_SPINCOUNT": "500"}) == {"spin": "500", "worker": {}, "bf16_worker": {},
                                                                "f32_worker": {}, "settled": ["500", "500"]}
    from coordinator.pool import supervisor
    from node_worker import kernel_threads

    envs = []  # the environment each worker is started with (its /proc environ is overwritten by its title)
    real_popen = subprocess.Popen

    def popen(cmd, env=None, **kw):
        envs.append(env)
        return real_popen(cmd, env=env, **kw)

    monkeypatch.setattr(supervisor.subprocess, "Popen", popen)
    with Engine.open(tiny, EngineConfig(pool="process")) as eng:
        assert len(eng.logits(PROMPT)) == len(PROMPT)
    assert len(envs) == 1
    assert kernel_threads._settled  # Engine.open chose this process's spin
    want = "0" if not kernel_threads.USER_SET else os.environ.get("GOMP_SPINCOUNT")  # f32 experts
    assert envs[0].get("GOMP_SPINCOUNT") == want and envs[0]["OPENBLAS_NUM_THREADS"] == "1"


def _futex_sleepers(pid: int) -> dict[int, int]:
    """Of process ``pid``'s threads asleep in futex(FUTEX_WAIT) on a shared word (not libgomp's own, private
    sleeps), how many on each address."""
    counts: dict[int, int] = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{task}/syscall").read_text().split()
        except OSError:  # the thread ended
            continue
        if len(fields) > 3 and fields[0] == "202" and int(fields[2], 16) == 0:  # SYS_futex (x86_64), FUTEX_WAIT
            counts[int(fields[1], 16)] = counts.get(int(fields[1], 16), 0) + 1
    return counts


@pytest.mark.skipif(platform.machine() != "x86_64" or (os.cpu_count() or 1) < 2,
                    reason="reads x86_64 syscall numbers; needs two CPUs for a team of two")
def test_a_worker_waits_for_the_next_layer_with_its_whole_team_asleep_on_its_doorbell(tiny):
    with Engine.open(tiny, EngineConfig(pool="process", worker_threads=2, expert_dtype="q8")) as eng:
        assert len(eng.logits(PROMPT)) == len(PROMPT)  # the worker's team has run a layer's kernel
        pid = eng.pool.workers[0].pid
        deadline = time.monotonic() + 30
        while max(_futex_sleepers(pid).values(), default=0) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # polling the worker's state, not waiting for it to act
        assert max(_futex_sleepers(pid).values(), default=0) == 2, _futex_sleepers(pid)
        assert len(eng.logits(PROMPT)) == len(PROMPT)  # and one ring wakes it for the next


@pytest.mark.parametrize("pool, spin", [("inproc", "10000"), ("process", "0")])
def test_the_first_engine_settles_the_coordinators_spin_by_its_pool(tiny, pool, spin):
    code = ("import os, sys; from coordinator import Engine, EngineConfig; "
            f"e = Engine.open(sys.argv[1], EngineConfig(pool={pool!r})); e.close(); "
            "print(os.environ.get('GOMP_SPINCOUNT'))")
    assert _fresh_python(code, str(tiny)) == spin  # the tiny model's dense matrices are float32: no kernels of theirs


@pytest.mark.parametrize("dense, team", [("f32", False), ("q8", True)])
def test_a_coordinator_with_kernels_of_its_own_waits_with_its_team(tiny, dense, team):
    with Engine.open(tiny, EngineConfig(pool="process", dense_dtype=dense, device="cpu")) as eng:
        assert eng.pool.kernel_team is team  # engine.runs_decode_kernels: numba's team sleeps on the doorbell too
        assert len(eng.logits(PROMPT)) == len(PROMPT)


@pytest.mark.parametrize("pool, backend, dense, gguf, runs", [
    ("inproc", "numpy", "f32", False, True), ("process", "numpy", "f32", False, False),
    ("process", "numpy", "auto", True, True), ("process", "numpy", "auto", False, False),
    ("process", "numpy", "f32", True, False), ("process", "numpy", "q4", False, True),
    ("process", "cupy", "auto", True, False)])
def test_which_coordinators_run_decode_kernels(pool, backend, dense, gguf, runs):
    from coordinator.engine import runs_decode_kernels

    assert runs_decode_kernels(EngineConfig(pool=pool, dense_dtype=dense), backend == "cupy", gguf) is runs


def test_route_tail_skip_drops_low_weight_pairs_and_counts_them(tiny):
    from reference import Reference

    with Engine.open(tiny, EngineConfig(route_tail_skip=0.3)) as eng:
        skipped_logits = eng.logits(PROMPT)
        stats = eng.decoder.stats
        assert stats.routed_pairs == len(PROMPT) * eng.model_config.top_k * len(eng.model_config.moe_layers)
        assert 0 < stats.skipped_pairs < stats.routed_pairs
    ref = Reference(tiny)
    # the reference with the same rule: weights below 0.3 dropped, the rest left as they are
    original = ref.moe

    def moe_with_skip(i, x):
        import numpy as np
        c, t = ref.cfg, ref.t
        p = f"model.layers.{i}.mlp"
        logits = t[f"{p}.gate.weight"] @ x
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        top = sorted(range(c["num_experts"]), key=lambda e: -probs[e])[:c["num_experts_per_tok"]]
        w = probs[top] / probs[top].sum()
        out = np.zeros(ref.H)
        for e, we in zip(top, w):
            if we >= 0.3:
                g, u, d = (t[f"{p}.experts.{e}.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj"))
                out += we * (d @ ((g @ x) / (1 + np.exp(-(g @ x))) * (u @ x)))
        return out

    ref.moe = moe_with_skip
    assert np.max(np.abs(ref.forward(PROMPT) - skipped_logits)) < 2e-4
    ref.moe = original
    assert np.max(np.abs(ref.forward(PROMPT) - skipped_logits)) > 1e-3  # skipping changed the output


# -- after any pool error the pool is clean (issue 11, item 2) -----------------


def layer(pool, req):
    pool.submit(req)
    return pool.collect()


@contextmanager
def split_pool(model, **settings):
    """A process pool over 2 (virtual) nodes, one layer's request, and its answer before any fault."""
    with Engine.open(model, EngineConfig(pool="process", numa_split=True, nodes=2, **settings)) as eng:
        req = _layer_request(eng)
        yield eng.pool, req, layer(eng.pool, req)


def _layer_request(eng):
    x = np.ones((2, eng.model_config.hidden_size), np.float32)
    return PoolRequest(0, x, np.array([0, 1]), np.array([1, 2]), np.array([0.5, 0.5], np.float32))


def test_a_failed_ask_leaves_no_pending_state(tiny, monkeypatch):
    """Node 1 cannot be asked (its restart refused): submit raises, and the next one starts afresh."""
    with split_pool(tiny) as (pool, req, want):
        real = pool.supervisor.ensure_running

        def refuse_node1(w):
            if w is pool.workers[1]:
                raise WorkerDied(1, w.pid, "exited", "its restart was refused")
            real(w)

        monkeypatch.setattr(pool.supervisor, "ensure_running", refuse_node1)
        with pytest.raises(WorkerDied, match="its restart was refused"):
            pool.submit(req)
        monkeypatch.setattr(pool.supervisor, "ensure_running", real)
        # not "submit() called twice": the failed submit left nothing behind
        assert np.array_equal(layer(pool, req), want)


def test_ask_racing_a_kill_restarts_the_worker(tiny, monkeypatch):
    """Killed, but not yet seen dead when it is asked (the check before the ask passes): its pidfd shows the
    death while the coordinator waits; it is restarted and asked again."""
    with split_pool(tiny) as (pool, req, want):
        w = pool.workers[1]
        old_pid = w.pid
        real_dead, real_ask = type(w).dead, pool.io.ask
        state = {"asked": False}

        def not_reaped_yet(self):
            return False if self is w and not state["asked"] else real_dead(self)

        def ask(index, seq):
            if index == 1:
                state["asked"] = True
            real_ask(index, seq)

        monkeypatch.setattr(type(w), "dead", not_reaped_yet)
        monkeypatch.setattr(pool.io, "ask", ask)
        os.kill(w.pid, signal.SIGKILL)
        assert np.array_equal(layer(pool, req), want)
        assert state["asked"] and w.pid != old_pid and pool.health()[1]["deaths"] == 1


def test_refused_restart_is_tried_again_after_its_window(tiny):
    with split_pool(tiny, worker_restart_window=600.0) as (pool, req, want):
        _kill(pool, 0)
        assert np.array_equal(layer(pool, req), want)  # first death: restarted at the check before the send
        _kill(pool, 0)
        with pytest.raises(WorkerDied, match="died twice within 600s"):
            pool.submit(req)
        for _ in range(2):  # refused again while the window lasts, quickly, and never "called twice"
            with pytest.raises(WorkerDied, match="next restart is tried in"):
                pool.submit(req)
        h = pool.health()[0]
        assert not h["alive"] and h["state"].startswith("down: restart refused") and "SIGKILL" in h["last_error"]
        pool.maintain()  # not due yet: stays down
        assert not pool.health()[0]["alive"]
        pool.workers[0].retry_at = time.monotonic() - 1  # the window has passed
        pool.maintain()
        h = pool.health()[0]
        assert h["alive"] and h["state"] == "ok" and h["deaths"] == 2
        assert np.array_equal(layer(pool, req), want)


def test_deaths_not_starts_are_counted(tiny):
    """Two deaths further apart than the window are each restarted; the start itself is no death."""
    with split_pool(tiny, worker_restart_window=600.0) as (pool, req, want):
        _kill(pool, 1)
        assert np.array_equal(layer(pool, req), want)
        w = pool.workers[1]
        w.deaths = [t - 601 for t in w.deaths]  # the first death is now outside the window
        _kill(pool, 1)
        # its restart (a start within the window) does not count against it
        assert np.array_equal(layer(pool, req), want)
        assert pool.health()[1]["deaths"] == 2 and pool.health()[1]["restarts"] == 2


def test_hung_worker_is_killed_restarted_and_the_layer_retried(tiny):
    with split_pool(tiny, worker_hang_timeout=1.0) as (pool, req, want):
        w = pool.workers[0]
        stopped = w.pid
        hook_calls = []
        pool.wait_hook = lambda: hook_calls.append(pool.health()[0]["state"])
        os.kill(stopped, signal.SIGSTOP)
        pool.submit(req)
        got = pool.collect()
        assert np.array_equal(got, want)
        assert w.pid != stopped and not psutil.pid_exists(stopped)  # killed and reaped
        h = pool.health()[0]
        assert h["deaths"] == 1 and "hung" in h["last_error"]
        assert len(hook_calls) >= 5  # the caller was called back all the while


def test_wait_hook_can_abandon_a_wait_and_the_pool_stays_usable(tiny):
    with split_pool(tiny) as (pool, req, want):
        w = pool.workers[1]
        os.kill(w.pid, signal.SIGSTOP)

        def stop_now():
            raise StepInterrupted("stop")

        pool.wait_hook = stop_now
        pool.submit(req)
        with pytest.raises(StepInterrupted):
            pool.collect()
        os.kill(w.pid, signal.SIGCONT)
        pool.wait_hook = None
        assert np.array_equal(layer(pool, req), want)  # the abandoned request's late reply is not taken for this one


def test_close_ends_a_stopped_worker_quickly(tiny):
    eng = Engine.open(tiny, EngineConfig(pool="process", numa_split=True, nodes=2))
    pids = [w.pid for w in eng.pool.workers]
    segs = [w.hello.get("segment") for w in eng.pool.workers]
    os.kill(pids[0], signal.SIGSTOP)
    t0 = time.monotonic()
    eng.close()
    assert time.monotonic() - t0 < 5.0
    for pid in pids:
        assert not psutil.pid_exists(pid)
    from shm import segments
    for name in segs:
        with pytest.raises(segments.SegmentError):
            segments.read_header(name)


def test_worker_killed_while_the_coordinator_spins(tiny):
    """The coordinator spins on the partials (a 60 s spin budget) when the worker dies mid-layer: the death is
    seen within the spin, the worker restarted and asked again, and the result is the same."""
    cfg = EngineConfig(pool="process", numa_split=True, nodes=2, pool_spin_us=60e6)
    with Engine.open(tiny, cfg) as eng:
        x = np.ones((2, eng.model_config.hidden_size), np.float32)
        req = PoolRequest(0, x, np.array([0, 1]), np.array([1, 2]), np.array([0.5, 0.5], np.float32))
        eng.pool.submit(req)
        want = eng.pool.collect()
        w = eng.pool.workers[1]
        os.kill(w.pid, signal.SIGSTOP)  # asked, it cannot answer
        eng.pool.submit(req)
        os.kill(w.pid, signal.SIGKILL)
        t0 = time.monotonic()
        got = eng.pool.collect()
        assert time.monotonic() - t0 < 30  # not after the spin: while it
        assert np.array_equal(got, want) and eng.pool.stats["restarts"] == 1


@pytest.mark.parametrize("spin_us", [60e6, 0.0])
def test_a_spinning_coordinator_gives_its_cpu_away_each_round(tiny, monkeypatch, spin_us):
    """Spinning on the partials, the coordinator yields its CPU at each round (doorbell.spin_pause), so a
    worker thread waiting for that CPU runs (on this 2-vCPU host the worker's team shares the coordinator's
    CPUs). The worker is stopped until the coordinator has paused 20 times: its partial can only come after
    those rounds, and equals the one computed before. Without a spin there is no round to pause in: the
    coordinator sleeps on its doorbell."""
    from shm import doorbell

    with Engine.open(tiny, EngineConfig(pool="process", pool_spin_us=spin_us)) as eng:
        x = np.ones((2, eng.model_config.hidden_size), np.float32)
        req = PoolRequest(0, x, np.array([0, 1]), np.array([1, 2]), np.array([0.5, 0.5], np.float32))
        eng.pool.submit(req)
        want = eng.pool.collect()
        pid, pauses = eng.pool.workers[0].pid, []

        def pause():
            pauses.append(1)
            if len(pauses) == 20:
                os.kill(pid, signal.SIGCONT)

        monkeypatch.setattr(doorbell, "spin_pause", pause)
        if spin_us:
            os.kill(pid, signal.SIGSTOP)  # asked, it cannot answer until the coordinator has paused 20 times
        eng.pool.submit(req)
        got = eng.pool.collect()
        assert np.array_equal(got, want) and eng.pool.stats["restarts"] == 0
        assert len(pauses) >= 20 if spin_us else pauses == []


SPINNING_COORDINATOR = """
import sys
from coordinator import Engine, EngineConfig
eng = Engine.open(sys.argv[1], EngineConfig(pool="process", numa_split=True, nodes=2, pool_spin_us=60e6))
eng.logits([1, 2, 3])
print(" ".join(str(w.pid) for w in eng.pool.workers), flush=True)
sys.stdin.read()
"""


def test_coordinator_killed_while_its_workers_spin(tiny):
    """Workers spinning on their request words (a 60 s spin budget) when the coordinator is SIGKILLed: they
    exit within 5 s and leave no segment, the data path's included."""
    import subprocess
    import sys

    import psutil

    from shm.segments import list_segments

    coord = subprocess.Popen([sys.executable, "-c", SPINNING_COORDINATOR, str(tiny)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in coord.stdout.readline().split()]
        workers = [psutil.Process(p) for p in pids]
        assert all(p.status() == psutil.STATUS_RUNNING for p in workers)  # spinning, not asleep
        coord.kill()
        coord.wait(timeout=5)
        gone, alive = psutil.wait_procs(workers, timeout=5)
        assert not alive, f"workers still running 5 s after the coordinator died: {[p.pid for p in alive]}"
        owners = set(pids) | {coord.pid}
        assert [s.name for s in list_segments() if s.header and s.header.owner_pid in owners] == []
    finally:
        if coord.poll() is None:
            coord.kill()
        coord.stdin.close()
        coord.stdout.close()
    for d in Path(tempfile.gettempdir()).glob("strata-pool-*"):  # the pool folder its SIGKILL left
        if json.loads((d / "owner.json").read_text())["pid"] == coord.pid:
            shutil.rmtree(d)


def test_a_bad_request_in_the_data_path_gets_an_error_and_the_worker_serves_on(tiny):
    """Requests written straight into the data-path segment with bad fields (rows past the limit, a layer that
    is not MoE, an expert id out of range, a NaN weight, an unknown kind): each is refused by the worker's
    fixed-size checks with a PoolError naming the problem, and the next good request is answered."""
    from shm import pool_io

    with split_pool(tiny) as (pool, req, want):
        io = pool.io
        cases = {
            "rows outside": dict(T=io.layout.max_tokens + 1),
            "not a MoE layer": dict(layer=10_000),
            "expert id out of range": dict(experts=[1, 99]),
            "routing weights must be finite": dict(weights=[0.5, np.nan]),
            "unknown request kind 7": dict(kind=7),
        }
        for problem, bad in cases.items():
            pool._rid += 1
            io.post(pool._rid, bad.get("layer", req.layer), req.x, req.tokens, np.array(bad.get("experts", req.experts)),
                    np.array(bad.get("weights", req.weights), np.float32), kind=bad.get("kind", pool_io.KIND_COMPUTE))
            if "T" in bad:
                io.request[pool_io.REQ_T] = bad["T"]
            for w in pool.workers:
                pool._ask(w, pool._rid)
            with pytest.raises(PoolError, match=problem):
                pool._wait_for_partials(pool._rid, 2)
            pool._waiting = {}
        assert np.array_equal(layer(pool, req), want)
        assert all(h["alive"] and h["restarts"] == 0 for h in pool.health())
