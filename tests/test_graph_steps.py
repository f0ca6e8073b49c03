"""Graph-ready decode steps (coordinator/gpu/graph_steps.py) on the CPU: the device stand-in
(tests/device_standin.py) with the process pool driven from the "stream" (shm/pool_signal.py's host functions,
run in stream order). The same bits as eager steps, at most one synchronisation and no allocation a step once
its bucket is sized, and a worker killed inside a step loses nothing."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import numpy as np
import psutil
import pytest

import device_standin
from coordinator import Engine, EngineConfig
from coordinator.model.ops import MlaRows
from coordinator.model.step import StepBatch
from shm import doorbell

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("dev_shm_alone")]  # whole engines through the CUDA emulator, over node worker processes

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]
GEOMETRY = dict(hidden_size=256, moe_intermediate_size=256, dense_intermediate_size=256, head_dim=32, num_heads=4,
                num_kv_heads=2, vocab_size=320)
ARCHS = {
    "qwen3_moe": {},
    "qwen2_moe": {},
    "deepseek_v3": dict(kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, q_lora_rank=64,
                        n_group=2, topk_group=1, first_k_dense_replace=1),
    "glm4_moe": dict(n_group=2, topk_group=1, first_k_dense_replace=1),
}


def _run(model, graph: bool, split: bool, steps: int = 6, kv_dtype: str = "f32", dense_dtype: str = "f32", **extra):
    """Greedy decode after a prompt, the logits of each step, through the process pool."""
    config = EngineConfig(device="cuda", pool="process", graph=graph, numa_split=split, nodes=2 if split else None,
                          dense_dtype=dense_dtype, kv_dtype=kv_dtype, **extra)
    with Engine.open(model, config) as eng:
        assert (eng.graph is not None) == graph
        cache = eng.new_cache()
        logits = [eng.step(StepBatch.of(np.array(PROMPT), cache)).logits[0]]
        for _ in range(steps):
            logits.append(eng.step(StepBatch.of(np.array([int(logits[-1][-1].argmax())]), cache)).logits[0])
        if graph and eng.model_config.mla is not None:  # a decode step's MLA read the caches on the device
            assert eng.graph.mla_cached == (True, True)
        stats = eng.decoder.stats
        taken = eng.graph.steps if graph else 0
        if graph and extra.get("graph_capture", True):  # the prompt's shape once, the decode step's captured
            assert (eng.graph.captures, eng.graph.replays) == (1, steps - 2)
        return np.concatenate(logits), stats, taken


@pytest.mark.parametrize("arch", list(ARCHS))
def test_graph_ready_steps_equal_eager_steps_bitwise(gpu, tiny_model, arch):
    model = tiny_model(arch=arch, num_layers=2, **GEOMETRY, **ARCHS[arch])
    want, want_stats, _ = _run(model, graph=False, split=True)
    got, got_stats, taken = _run(model, graph=True, split=True)
    assert taken == 7  # every step: the prompt's 8 rows fit a bucket too
    assert np.array_equal(got, want)
    for name in ("routed_pairs", "skipped_pairs", "cpu_pairs", "cpu_expert_loads", "device_pairs"):
        assert getattr(got_stats, name) == getattr(want_stats, name), name
    assert got_stats.per_layer_expert.keys() == want_stats.per_layer_expert.keys()
    for layer, counts in want_stats.per_layer_expert.items():
        assert np.array_equal(got_stats.per_layer_expert[layer], counts)


def test_graph_ready_steps_read_a_compact_kv_b_as_it_lies(gpu, tiny_model, monkeypatch):
    """DeepSeek's dense weights in q8, kv_b among them: the absorbed attention reads kv_b's rows as they are
    stored (device_ops.CompactKvB: no float32 copy of it, nothing dequantised), eager and graph-ready steps alike,
    with the same bits."""
    from coordinator.gpu import format_kernels

    def refused(*args, **kwargs):
        raise AssertionError("a decode step dequantised a matrix")
    monkeypatch.setattr(format_kernels, "dequantize", refused)
    model = tiny_model(arch="deepseek_v3", num_layers=2, **GEOMETRY, **ARCHS["deepseek_v3"])
    want, _, _ = _run(model, graph=False, split=True, dense_dtype="q8")
    got, _, taken = _run(model, graph=True, split=True, dense_dtype="q8")
    assert taken == 7 and np.array_equal(got, want)


def test_graph_ready_steps_with_a_bf16_cache_and_one_node(gpu, tiny_model):
    """The bf16 KV cache stored by kv_store and read by the cached attention, the unsplit pool: still eager's bits."""
    model = tiny_model(num_layers=2, **GEOMETRY)
    want, _, _ = _run(model, graph=False, split=False, kv_dtype="bf16")
    got, _, taken = _run(model, graph=True, split=False, kv_dtype="bf16")
    assert taken == 7 and np.array_equal(got, want)


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])
def test_graph_ready_steps_with_hot_experts(gpu, tiny_model, arch):
    """Hot experts in their q8 format, their slots ordered on the device (DeviceExperts.run_split) between the ring
    and the wait: the eager steps' bits (the pairs split the same, the same slot order and sums)."""
    model = tiny_model(arch=arch, num_layers=2, **GEOMETRY, **ARCHS[arch])
    hot = dict(gpu_experts=4, expert_dtype="q8", activations="f32")
    want, want_stats, _ = _run(model, graph=False, split=True, **hot)
    got, got_stats, taken = _run(model, graph=True, split=True, **hot)
    assert taken == 7 and np.array_equal(got, want)
    assert got_stats.device_pairs == want_stats.device_pairs > 0 and got_stats.cpu_pairs == want_stats.cpu_pairs > 0
    assert got_stats.device_expert_loads == want_stats.device_expert_loads


def _shapes_of_steps(eng) -> list[np.ndarray]:
    """Steps of several shapes, each shape again later: one sequence's decode row, its three rows with every
    row's logits (a verify of two drafts), two sequences' decode rows together; the logits of each."""
    a, b = eng.new_cache(), eng.new_cache()
    out = [eng.step(StepBatch.of(np.array(PROMPT), a)).logits[0],
           eng.step(StepBatch.of(np.array(PROMPT[:5]), b)).logits[0]]
    for step in range(9):
        token = int(out[-1][-1].argmax())
        if step % 3 == 0:
            out.append(eng.step(StepBatch.of(np.array([token]), a)).logits[0])
        elif step % 3 == 1:
            out.append(eng.step(StepBatch.of(np.array([token, 7, 9]), a, every_row=True)).logits[0])
        else:
            out += eng.step(StepBatch([(np.array([token]), a), (np.array([token]), b)])).logits
    return out


def test_each_shape_of_step_replays_a_graph_of_its_own(gpu, tiny_model):
    """Steps of three shapes interleaved, each captured on its second step and replayed on its third: the logits
    are the eager steps' bits, and each graph writes its own rows' counts for the pool's host functions again
    (StreamLink.restore) after a step of another shape wrote others."""
    model = tiny_model(arch="deepseek_v3", num_layers=2, **GEOMETRY, **ARCHS["deepseek_v3"])
    want, got, graph = _baseline_and_captured(model, _shapes_of_steps, dict(graph=False))
    assert (graph.captures, graph.replays) == (3, 3)
    assert len(got) == len(want) and all(np.array_equal(g, w) for g, w in zip(got, want))


def _wide_batches(eng) -> list[np.ndarray]:
    """Ten sequences decoded together (more than the 8 arrays CuPy concatenates without uploading a pointer
    table), then again with every row of two-row steps' first sequence asked for: the logits of each step."""
    caches = [eng.new_cache() for _ in range(10)]
    out = eng.step(StepBatch([(np.array(PROMPT[:2 + k % 5]), c) for k, c in enumerate(caches)])).logits
    for step in range(4):
        out = eng.step(StepBatch([(np.array([int(o[-1].argmax())]), c) for o, c in zip(out, caches)])).logits
    got = list(out)
    for step in range(3):
        seqs = [(np.array([int(o[-1].argmax()), 5]), c) for o, c in zip(out, caches)]
        out = eng.step(StepBatch(seqs, all_rows=frozenset({0}))).logits  # 2 + 9 rows from lm_head: a gather
        got += out
    return got


def test_a_batch_of_ten_sequences_replays_its_graphs(gpu, tiny_model):
    """Ten one-row sequences a step, then ten two-row ones with one sequence's every row: each shape captured on
    its second step and replayed after, the eager steps' bits."""
    model = tiny_model(num_layers=2, **GEOMETRY)
    want, got, graph = _baseline_and_captured(model, _wide_batches, dict(graph=False))
    assert (graph.captures, graph.replays, len(graph.failed)) == (2, 3, 0)
    assert len(got) == len(want) == 40 and all(np.array_equal(g, w) for g, w in zip(got, want))


def _baseline_and_captured(model, run, baseline: dict):
    """``run(eng)`` on the split process pool with ``baseline``'s settings, then with steps replayed as graphs:
    (the first's result, the second's, the second's GraphSteps)."""
    config = dict(device="cuda", pool="process", numa_split=True, nodes=2, dense_dtype="f32", kv_dtype="f32")
    with Engine.open(model, EngineConfig(**baseline, **config)) as eng:
        want = run(eng)
    with Engine.open(model, EngineConfig(**config)) as eng:
        return want, run(eng), eng.graph


def _drafted_pair(eng) -> dict[str, list[int]]:
    """Two requests decoded together by the scheduler with prompt-lookup drafts: their tokens."""
    from coordinator.request import GenerateRequest
    from coordinator.scheduler import Scheduler

    out: dict[str, list[int]] = {}

    def emit(_client, event):
        if event["type"] == "final":
            out[event["id"]] = list(event["ids"])

    sched = Scheduler(eng, emit, speculative="ngram", draft_max=3)
    for i in range(2):
        sched.add(b"c", GenerateRequest(id=f"r{i}", prompt_ids=tuple(PROMPT * 2)[i:], max_new_tokens=16,
                                        stream=False))
    while sched.busy:
        sched.step()
    return out


def test_the_scheduler_with_drafts_replays_graphs_with_the_queued_steps_tokens(gpu, tiny_model):
    """Two requests with prompt-lookup drafts (steps of one to eight rows, every drafted row's logits) through the
    scheduler: the tokens of steps replayed as graphs are those of steps queued launch by launch."""
    want, got, graph = _baseline_and_captured(tiny_model(num_layers=2, **GEOMETRY), _drafted_pair,
                                              dict(graph_capture=False))
    assert graph.captures >= 2 and graph.replays > 0, (graph.captures, graph.replays)
    assert got == want and len(got) == 2


def test_a_shape_the_driver_will_not_capture_is_queued_each_step(gpu, tiny_model, monkeypatch, caplog):
    """end_capture refusing the step (as CUDA does for work a graph cannot hold): a warning naming the shape, the
    step queued launch by launch then and after, the same logits."""
    model = tiny_model(num_layers=2, **GEOMETRY)
    want, _, _ = _run(model, graph=False, split=False)

    end_capture = device_standin._Stream.end_capture

    def refused(self):
        end_capture(self)  # the stream leaves capture, as CUDA's failed end does
        raise device_standin.CUDARuntimeError(900)

    monkeypatch.setattr(device_standin._Stream, "end_capture", refused)
    config = EngineConfig(device="cuda", pool="process", dense_dtype="f32", kv_dtype="f32")
    with Engine.open(model, config) as eng:
        cache = eng.new_cache()
        logits = [eng.step(StepBatch.of(np.array(PROMPT), cache)).logits[0]]
        for _ in range(6):
            logits.append(eng.step(StepBatch.of(np.array([int(logits[-1][-1].argmax())]), cache)).logits[0])
        graph = eng.graph
        assert (graph.captures, graph.replays, graph.steps, len(graph.failed)) == (0, 0, 7, 1)
    assert np.array_equal(np.concatenate(logits), want)
    assert "not captured as a CUDA graph" in caplog.text


def _step_counts(model, split: bool, capture: bool = False) -> dict[str, int]:
    """What the fourth graph-ready decode step asks of the GPU (the second of its shape planned its memory in the
    buffer made at open; with ``capture`` the third captured it, the fourth launches its graph)."""
    config = EngineConfig(device="cuda", pool="process", numa_split=split, nodes=2 if split else None,
                          graph_capture=capture)
    with Engine.open(model, config) as eng:
        cache = eng.new_cache()
        eng.step(StepBatch.of(np.array([72, 101, 108, 108]), cache)).logits[0]
        for token in (111, 44):
            eng.step(StepBatch.of(np.array([token]), cache)).logits[0]
        with device_standin.counting() as counts:
            eng.step(StepBatch.of(np.array([32]), cache)).logits[0]
        graph = eng.graph
        assert graph.steps == 4 and graph.arena.stats.pool_allocations == 0 and graph.arena.stats.generation == 1
        assert (graph.captures, graph.replays) == ((1, 1) if capture else (0, 0))
        kinds = ("launches", "allocations", "uploads", "downloads", "syncs", "host_functions", "graph_launches")
        return {k: counts[k] for k in kinds} | {"moe_layers": len(eng.model_config.moe_layers)}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_graph_ready_step_waits_once_and_allocates_nothing(gpu, tiny_model, arch):
    """The issue's budget: at most 2 synchronisations and 0 allocations a step; a layer adds none of either, and
    two host functions (ring and wait). Captured, the step is one graph launch, the tables' upload and the wait:
    no launch, allocation or host function queued from Python, whatever the layers."""
    one = _step_counts(tiny_model(f"{arch}-1", arch=arch, num_layers=1, **GEOMETRY, **ARCHS[arch]), split=True)
    two = _step_counts(tiny_model(f"{arch}-2", arch=arch, num_layers=2, **GEOMETRY, **ARCHS[arch]), split=True)
    for counts in (one, two):
        assert counts["syncs"] <= 2 and counts["allocations"] == 0, counts
    assert two["syncs"] == one["syncs"]
    for counts in (one, two):  # ring and wait, each MoE layer
        assert counts["host_functions"] == 2 * counts["moe_layers"] and counts["graph_launches"] == 0, counts
    assert two["launches"] > one["launches"]  # the counter sees the second layer
    captured = _step_counts(tiny_model(f"{arch}-2", arch=arch, num_layers=2, **GEOMETRY, **ARCHS[arch]), split=True,
                            capture=True)
    assert captured["graph_launches"] == 1 and captured["syncs"] == 1, captured
    assert captured["launches"] == captured["allocations"] == captured["host_functions"] == 0, captured
    assert captured["uploads"] == 1 and captured["downloads"] == 0, captured  # the tables; the logits: in the graph


def _generate(model, fault=None, **config):
    """12 greedy tokens through graph-ready steps, ``fault(eng)`` called after the third token; the engine's
    pool health and graph-step counters after."""
    cfg = EngineConfig(device="cuda", pool="process", numa_split=True, nodes=2, **config)
    with Engine.open(model, cfg) as eng:
        seen = []

        def on_token(token):
            seen.append(token)
            if fault is not None and len(seen) == 3:
                fault(eng)

        ids = eng.generate(PROMPT, max_new_tokens=12, stop_at_eos=False, on_token=on_token)
        return ids, eng.pool.health(), eng.graph.steps, eng.graph.redone


def _stop_then_kill_when_asked(eng, kill: bool):
    """Worker 1 stopped now; a thread kills it once the next step's first request has reached it (the step is
    then waiting for it inside the stream's wait host function), or leaves it stopped (hung) when not ``kill``."""
    w = eng.pool.workers[1]
    os.kill(w.pid, signal.SIGSTOP)
    if not kill:
        return
    io, pid, asked_before = eng.pool.io, w.pid, eng.pool.io.asked(1)

    def killer():
        while io.asked(1) == asked_before:
            doorbell.spin_pause()
        os.kill(pid, signal.SIGKILL)

    threading.Thread(target=killer, daemon=True).start()


@pytest.mark.parametrize("kill", [True, False], ids=["killed", "hung"])
def test_a_worker_dead_or_hung_inside_a_step_loses_nothing(gpu, tiny_model, kill):
    """The wait host function sees the death (its pidfd) or the silence (the hang deadline), the step is voided,
    the pool restarts the worker and the step is redone eagerly: the same tokens as without a fault."""
    model = tiny_model(num_layers=2, **GEOMETRY)
    want, _, _, _ = _generate(model, worker_hang_timeout=1.0)
    pid_before = []

    def fault(eng):
        pid_before.append(eng.pool.workers[1].pid)
        _stop_then_kill_when_asked(eng, kill)

    got, health, steps, redone = _generate(model, fault, worker_hang_timeout=1.0)
    assert got == want
    assert redone == 1 and steps >= 10
    assert health[1]["alive"] and health[1]["restarts"] == 1 and health[1]["pid"] != pid_before[0]
    assert ("hung" in health[1]["last_error"]) != kill
    assert not psutil.pid_exists(pid_before[0]) or psutil.Process(pid_before[0]).status() == psutil.STATUS_ZOMBIE


@pytest.mark.parametrize("T, k, E", [(7, 4, 16), (64, 8, 300)])
def test_split_pairs_is_the_hosts_routing_split(gpu, T, k, E):
    """compact.split_pairs against the decoder's host bookkeeping (Decoder._route's): router order, the tail skip
    (a NaN weight skipped as the host's comparison skips it), device experts apart, and the counters; a decode
    step's few pairs, and more pairs and experts than the block has threads."""
    from coordinator.gpu import compact

    rng = np.random.default_rng(0)
    skip = 0.2
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.uint32)  # [T, k]
    weights = rng.random((T, k)).astype(np.float32)
    weights[2, 1] = np.nan
    packed = np.concatenate([ids, weights.view(np.uint32)], axis=1)  # [T, 2k]
    on_device = rng.random(E) < 0.3
    counts, totals = gpu.zeros(E, np.int64), gpu.zeros(compact.TOTALS, np.int64)
    for _ in range(2):  # the counters add up over calls
        got = compact.split_pairs(gpu.asarray(packed), k, gpu.asarray(on_device.astype(np.uint8)), skip, counts,
                                  totals)
    tokens, experts, w = np.repeat(np.arange(T), k), ids.reshape(-1).astype(np.int64), weights.reshape(-1)
    keep = w >= skip
    dev = on_device[experts]
    for side, mask in (("cpu", keep & ~dev), ("dev", keep & dev)):
        n = int(getattr(got, f"{side}_count")[0])
        assert n == mask.sum()
        assert np.array_equal(np.asarray(getattr(got, f"{side}_tokens"))[:n], tokens[mask])
        assert np.array_equal(np.asarray(getattr(got, f"{side}_experts"))[:n], experts[mask])
        assert np.array_equal(np.asarray(getattr(got, f"{side}_weights"))[:n], w[mask])
    assert np.array_equal(np.asarray(counts), 2 * np.bincount(experts, minlength=E))
    want = [T * k, (~keep).sum(), (keep & ~dev).sum(), len(set(experts[keep & ~dev])), (keep & dev).sum(),
            len(set(experts[keep & dev]))]
    assert np.asarray(totals).tolist() == [2 * v for v in want]


@pytest.mark.parametrize("T, k, n", [(3, 2, 5), (64, 8, 400)])
def test_the_slot_order_is_the_hosts_lexsort(gpu, T, k, n):
    """strata_order_slots (DeviceExperts.run_split's) against DeviceExperts.run's host order: the first n of T*k
    pairs by (expert, token), each slot's row, table row and weight, and each token's slots in slot order."""
    from coordinator.gpu import experts as device_experts

    rng = np.random.default_rng(5)
    P, E = T * k, 40
    tokens = np.sort(rng.integers(0, T, P)).astype(np.int32)
    chosen = rng.integers(0, E, P).astype(np.int32)
    weights = rng.random(P).astype(np.float32)
    index = rng.permutation(E).astype(np.int32)
    i32 = np.int32
    outs = [gpu.empty(P, i32) for _ in range(2)] + [gpu.empty(P, np.float32), gpu.empty(P, i32),
                                                     gpu.empty(T + 1, i32), gpu.empty(P, i32), gpu.empty(P, i32)]
    device_experts.cuda_module().get_function("strata_order_slots")((1,), (device_experts.ORDER_THREADS,), (
        *map(gpu.asarray, (tokens, chosen, weights, np.array([n], np.int64), index)), i32(T), i32(P), *outs),
        shared_mem=2 * P * 4)
    slot_rows, slot_matrix, slot_weights, by_token, start, ids, _ = (np.asarray(o) for o in outs)
    order = np.lexsort((tokens[:n], chosen[:n]))  # DeviceExperts.run's
    assert np.array_equal(slot_rows[:n], tokens[:n][order]) and not slot_rows[n:].any()
    assert np.array_equal(slot_matrix[:n], index[chosen[:n][order]]) and not slot_matrix[n:].any()
    assert np.array_equal(slot_weights[:n], weights[:n][order]) and np.array_equal(ids, np.arange(P))
    assert np.array_equal(start, np.concatenate([[0], np.cumsum(np.bincount(slot_rows[:n], minlength=T))]))
    for t in range(T):
        assert np.array_equal(by_token[start[t]:start[t + 1]], np.flatnonzero(slot_rows[:n] == t)), t


def test_sum_partials_adds_in_the_eager_order(gpu):
    """Y_0 + Y_1 + Y_2, then the device experts', then the shared experts': the host's float32 adds, bit for bit
    (float32 addition is not associative, so another order would differ)."""
    from coordinator.gpu import compact
    from coordinator.pool.base import sum_in_node_order

    rng = np.random.default_rng(1)
    parts = (rng.standard_normal((3, 5, 40)) * 10.0 ** rng.integers(-3, 4, (3, 5, 40))).astype(np.float32)
    extra, more = (rng.standard_normal((5, 40)).astype(np.float32) for _ in range(2))
    want = (sum_in_node_order(list(parts)) + extra) + more
    got = compact.sum_partials(gpu.asarray(parts), gpu.asarray(extra), gpu.asarray(more))
    assert np.array_equal(np.asarray(got), want)
    assert np.array_equal(np.asarray(compact.sum_partials(gpu.asarray(parts))), sum_in_node_order(list(parts)))
    assert not np.array_equal(parts[0] + (parts[1] + parts[2]), sum_in_node_order(list(parts)))  # order shows


def test_a_nodes_error_answer_inside_a_step_raises_and_the_next_step_runs(gpu, tiny_model, monkeypatch):
    """A routing weight that is not finite makes the nodes answer an error (layer_moe checks the routing): the
    wait host function records it, the step raises the eager path's PoolError with the node's message, the
    cache keeps none of the step's positions, and the next step gives the fault-free logits."""
    from coordinator.gpu import compact
    from coordinator.pool.channel import PoolError

    model = tiny_model(num_layers=2, **GEOMETRY)
    cfg = EngineConfig(device="cuda", pool="process", numa_split=True, nodes=2, dense_dtype="f32", kv_dtype="f32")
    with Engine.open(model, cfg) as eng:
        cache = eng.new_cache()
        want = eng.step(StepBatch.of(np.array(PROMPT), cache)).logits[0]
        cache.truncate(0)
        split_pairs = compact.split_pairs

        def poisoned(*args, **kwargs):
            got = split_pairs(*args, **kwargs)
            got.cpu_weights[0] = np.float32(np.nan)
            return got

        monkeypatch.setattr(compact, "split_pairs", poisoned)
        with pytest.raises(PoolError, match="finite"):
            eng.step(StepBatch.of(np.array(PROMPT), cache)).logits[0]
        assert cache.length == 0
        monkeypatch.setattr(compact, "split_pairs", split_pairs)
        assert np.array_equal(eng.step(StepBatch.of(np.array(PROMPT), cache)).logits[0], want)
        assert eng.graph.steps == 2


@pytest.mark.parametrize("bf16", [False, True], ids=["f32", "bf16"])
@pytest.mark.parametrize("window", [None, 3])
def test_cached_attention_is_the_masked_attention_bitwise(gpu, bf16, window):
    """kv_store + gqa_attention_cached (places, positions and lengths read from device tables, the mask made in
    the kernel) against the cache's extend + gqa_attention with ops.attention_mask, three sequences of 1, 3 and 2
    new rows over 5, 0 and 9 cached ones, every row's queries and the last rows' alone."""
    from coordinator.gpu.format_kernels import address
    from coordinator.model import ops
    from coordinator.gpu import ops as device_ops
    from coordinator.model.kv_cache import CacheLayout, KVCache

    rng = np.random.default_rng(2)
    nh, nkv, hd = 4, 2, 32
    cached, new = [5, 0, 9], [1, 3, 2]
    dtype = "bf16" if bf16 else "f32"
    caches = [KVCache(CacheLayout(1, nkv, hd, dtype=dtype), 16, gpu, device_ops.to_bf16) for _ in cached]
    for cache, n in zip(caches, cached):
        if n:
            cache.extend(0, *(gpu.asarray(rng.standard_normal((n, nkv, hd)).astype(np.float32)) for _ in range(2)))
            cache.advance(n)
    N = sum(new)
    q = gpu.asarray(rng.standard_normal((N, nh, hd)).astype(np.float32))
    qkv = gpu.asarray(rng.standard_normal((N, 3, nkv * hd)).astype(np.float32))  # k and v as column slices
    k, v = qkv[:, 0].reshape(N, nkv, hd), qkv[:, 1].reshape(N, nkv, hd)
    bounds = np.cumsum([0] + new)
    row_seq = np.repeat(np.arange(3), new)
    row_pos = np.concatenate([np.arange(c, c + n) for c, n in zip(cached, new)])
    tables = [np.array([address(c.buffers(0)[0]) for c in caches]), np.array([address(c.buffers(0)[1]) for c in caches]),
              row_seq, row_pos, np.arange(3), np.array(cached) + np.array(new) - 1, np.array(cached) + np.array(new)]
    k_ptrs, v_ptrs, rs, rp, ls, lp, sl = (gpu.asarray(t.astype(np.int64)) for t in tables)
    want_rows, want_last = [], []  # the eager path's, on copies of the caches
    for s, cache in enumerate(caches):
        keys, values = cache.extend(0, *(a[bounds[s]:bounds[s + 1]].copy() for a in (k, v)))
        mask = gpu.asarray(ops.attention_mask(row_pos[bounds[s]:bounds[s + 1]], np.arange(keys.shape[0]), window))
        want_rows.append(np.asarray(device_ops.gqa_attention(q[bounds[s]:bounds[s + 1]], keys, values, mask,
                                                             hd ** -0.5)))
        want_last.append(want_rows[-1][-1:])
        cache.truncate(cached[s])
    before = [np.asarray(c.buffers(0)[0]).copy() for c in caches]
    for c, n, m in zip(caches, cached, new):
        c.buffers(0)[0][n:n + m] = 0  # the store must write what extend wrote
    device_ops.kv_store(k, v, k_ptrs, v_ptrs, rs, rp, bf16)
    for c, b, n, m in zip(caches, before, cached, new):
        assert np.array_equal(np.asarray(c.buffers(0)[0])[n:n + m], b[n:n + m])
    got = device_ops.gqa_attention_cached(q, (k_ptrs, v_ptrs, rs, rp, sl), window, hd ** -0.5, nkv, 16, bf16)
    assert np.array_equal(np.asarray(got), np.concatenate(want_rows))
    last = gpu.asarray(np.asarray(q)[bounds[1:] - 1])
    got = device_ops.gqa_attention_cached(last, (k_ptrs, v_ptrs, ls, lp, sl), window, hd ** -0.5, nkv, 16, bf16)
    assert np.array_equal(np.asarray(got), np.concatenate(want_last))


def test_mtp_drafts_over_graph_ready_steps(gpu, tmp_path):
    """MTP drafts take the main model's hidden rows from graph-ready steps (Decoder._graph_step copies them out of
    the step's buffer: rows kept while drafting pauses would otherwise be overwritten by a later step of the same
    bucket): greedy with drafts is greedy."""
    from coordinator.cli.make_model import make_model

    model = make_model(tmp_path / "mtp", arch="deepseek_v3", seed=2, num_nextn_predict_layers=1)
    cfg = EngineConfig(device="cuda", pool="process", numa_split=True, nodes=2, activations="f32", dense_dtype="f32",
                       kv_dtype="f32")
    with Engine.open(model, cfg) as eng:
        assert eng.has_mtp and eng.graph is not None
        plain = eng.generate(PROMPT, max_new_tokens=16, stop_at_eos=False)
        before = eng.graph.steps
        drafted = eng.generate_full(PROMPT, max_new_tokens=16, stop_at_eos=False, speculative="mtp")
        assert drafted.ids == plain and drafted.timings["drafted_tokens"] > 0
        assert eng.graph.steps > before


def test_step_tables_read_a_caches_addresses_again_after_it_grew(gpu):
    """StepTables keeps each cache's buffer addresses between steps and reads them again once a buffer moved."""
    from coordinator.gpu.format_kernels import address
    from coordinator.gpu.graph_steps import StepTables
    from coordinator.model.kv_cache import CacheLayout, KVCache

    tables = StepTables(2, gpu)
    cache = KVCache(CacheLayout(2, 2, 16), capacity=4, xp=gpu)
    seqs = [(np.array([1, 2, 3]), cache)]

    def written():
        k_ptrs = np.asarray(tables.layer(0, False)[0])[:1], np.asarray(tables.layer(1, False)[0])[:1]
        return [int(k_ptrs[0][0]), int(k_ptrs[1][0])]

    tables.fill(seqs)
    assert written() == [address(cache.buffers(layer)[0]) for layer in range(2)]
    cache.reserve(64)  # the buffers move
    tables.fill(seqs)
    assert written() == [address(cache.buffers(layer)[0]) for layer in range(2)]


@pytest.mark.parametrize("bf16", [False, True], ids=["f32", "bf16"])
def test_cached_mla_attention_is_the_absorbed_attention_bitwise(gpu, bf16):
    """kv_store of latents and rope keys + mla_attention_absorbed_cached (places, positions, lengths and chunks read
    from device tables, the causal mask made in the kernel) against the cache's extend + mla_attention_absorbed
    with ops.attention_mask's mask, per sequence as the eager step calls it: three sequences of 1, 3 and 2 new
    rows over 70, 0 and 130 cached ones (several chunks each where the keys pass MLA_CHUNK_MIN), every row's
    queries and the last rows' alone; and with each row's own chunks (batch invariance), each row's call alone."""
    from coordinator.gpu.format_kernels import address
    from coordinator.model import ops
    from coordinator.gpu import ops as device_ops
    from coordinator.model.kv_cache import CacheLayout, KVCache

    rng = np.random.default_rng(3)
    nh, dn, dr, c, dv, cap = 4, 16, 8, 32, 16, 160
    cached, new = [70, 0, 130], [1, 3, 2]
    dtype = "bf16" if bf16 else "f32"
    caches = [KVCache(CacheLayout(1, latent=(c, dr), dtype=dtype), cap, gpu, device_ops.to_bf16) for _ in cached]
    for cache, n in zip(caches, cached):
        if n:
            cache.extend(0, *(gpu.asarray(rng.standard_normal((n, d)).astype(np.float32)) for d in (c, dr)))
            cache.advance(n)
    N, B = sum(new), len(new)
    q = gpu.asarray(rng.standard_normal((N, nh, dn + dr)).astype(np.float32))  # q_nope, q_rope as column slices
    ckv = gpu.asarray(rng.standard_normal((N, c + dr)).astype(np.float32))  # latent and rope key as column slices
    w_uk = gpu.asarray(rng.standard_normal((nh, dn, c)).astype(np.float32) * 0.3)
    w_uv = gpu.asarray(rng.standard_normal((nh, dv, c)).astype(np.float32) * 0.3)
    scale = (dn + dr) ** -0.5
    bounds = np.cumsum([0] + new)
    row_pos = np.concatenate([np.arange(a, a + n) for a, n in zip(cached, new)])
    lengths = np.array(cached) + np.array(new)
    chunks = [device_ops.mla_splits(n, nh, S, c, dr)[1] for n, S in zip(new, lengths)]
    last_chunks = [device_ops.mla_splits(1, nh, S, c, dr)[1] for S in lengths]
    assert max(device_ops.mla_splits(1, nh, S, c, dr)[0] for S in lengths) > 1  # the chunks' merge is exercised
    w_uv_t = w_uv.transpose(0, 2, 1)
    want_rows, want_last = [], []  # the eager path's, on the caches, then forgotten
    for s, cache in enumerate(caches):
        r = slice(bounds[s], bounds[s + 1])
        lat, kr = cache.extend(0, ckv[r, :c], ckv[r, c:])
        mask = ops.attention_mask(row_pos[r], np.arange(lat.shape[0]), None)
        want_rows.append(np.asarray(device_ops.mla_attention_absorbed(MlaRows(q[r, :, :dn], q[r, :, dn:], lat, kr),
                                                                      w_uk, w_uv_t, gpu.asarray(mask), scale)))
        last = slice(bounds[s + 1] - 1, bounds[s + 1])
        want_last.append(np.asarray(device_ops.mla_attention_absorbed(
            MlaRows(q[last, :, :dn], q[last, :, dn:], lat, kr), w_uk, w_uv_t, gpu.asarray(mask[-1:]), scale)))
        cache.truncate(cached[s])
    stored = [[np.asarray(b).copy() for b in c.buffers(0)] for c in caches]
    for cache, n, m in zip(caches, cached, new):
        for b in cache.buffers(0):
            b[n:n + m] = 0  # the store must write what extend wrote
    tables = [np.array([address(c.buffers(0)[0]) for c in caches]), np.array([address(c.buffers(0)[1]) for c in caches]),
              np.repeat(np.arange(B), new), row_pos, np.arange(B), lengths - 1, lengths, np.repeat(chunks, new),
              np.array(last_chunks)]
    lp, rp, rs, pos, ls, lpos, sl, ch, lch = (gpu.asarray(t.astype(np.int64)) for t in tables)
    device_ops.kv_store(ckv[:, :c], ckv[:, c:], lp, rp, rs, pos, bf16)
    for cache, want in zip(caches, stored):
        for b, w in zip(cache.buffers(0), want):
            assert np.array_equal(np.asarray(b), w)
    got = device_ops.mla_attention_absorbed_cached(q[..., :dn], q[..., dn:], (lp, rp, rs, pos, sl, ch), w_uk, w_uv_t,
                                                   scale, cap, bf16)
    assert np.array_equal(np.asarray(got), np.concatenate(want_rows))
    lq = gpu.asarray(np.asarray(q)[bounds[1:] - 1])
    got = device_ops.mla_attention_absorbed_cached(lq[..., :dn], lq[..., dn:], (lp, rp, ls, lpos, sl, lch), w_uk,
                                                   w_uv_t, scale, cap, bf16)
    assert np.array_equal(np.asarray(got), np.concatenate(want_last))
    # batch-invariant: each row's chunks its own alone's (mla_splits of one query over its position + 1 keys), the
    # bits of that row's eager call alone over the keys it sees
    alone_chunks = gpu.asarray(np.array([device_ops.mla_splits(1, nh, p + 1, c, dr)[1] for p in row_pos], np.int64))
    got = np.asarray(device_ops.mla_attention_absorbed_cached(q[..., :dn], q[..., dn:], (lp, rp, rs, pos, sl,
                                                                                          alone_chunks),
                                                              w_uk, w_uv_t, scale, cap, bf16))
    row_seq = np.repeat(np.arange(B), new)
    for t, p in enumerate(row_pos):
        lat, kr = (b[:p + 1] for b in caches[row_seq[t]].buffers(0))
        alone = device_ops.mla_attention_absorbed(MlaRows(q[t:t + 1, :, :dn], q[t:t + 1, :, dn:], lat, kr), w_uk,
                                                  w_uv_t, gpu.asarray(np.ones((1, p + 1), bool)), scale)
        assert np.array_equal(got[t:t + 1], np.asarray(alone)), (t, p)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_graph_step_caches_are_reserved_to_the_context_and_never_move(gpu, tiny_model, arch):
    """The first graph-ready step reserves its cache to max_seq_len, exactly: from then on no buffer moves
    (KVCache.moves, every buffer's address) and the attention's scores' rows are that long every step, while the
    cache takes the bytes the GPU memory plan counts for its KV cache (coordinator/gpu/vram.py)."""
    from coordinator.gpu.format_kernels import address

    model = tiny_model(arch=arch, num_layers=2, **GEOMETRY, **ARCHS[arch])
    config = EngineConfig(device="cuda", pool="process", numa_split=True, nodes=2, dense_dtype="f32", kv_dtype="bf16",
                          max_seq_len=160)
    with Engine.open(model, config) as eng:
        cache, graph = eng.new_cache(), eng.graph
        prompt = np.arange(60) * 5 % 320  # 60 rows: one step, within the largest bucket
        logits = eng.step(StepBatch.of(prompt, cache)).logits[0]
        moves = cache.moves
        addresses = [address(b) for layer in range(2) for b in cache.buffers(layer)]
        assert cache.capacity == 160 and cache.nbytes == eng.gpu_memory.kv
        for _ in range(8):  # past the 64 tokens a cache made for 64 grows at when it is not reserved
            logits = eng.step(StepBatch.of(np.array([int(logits[-1].argmax())]), cache)).logits[0]
            assert cache.moves == moves and graph.tables.score_stride == 160
        assert [address(b) for layer in range(2) for b in cache.buffers(layer)] == addresses
        assert cache.length == 68 and graph.steps == 9


def _two_recorded_steps(eng, cache, logits):
    """The launch and copy records (device_standin.recording) of two consecutive one-row decode steps."""
    records = []
    for _ in range(2):
        with device_standin.recording() as events:
            logits = eng.step(StepBatch.of(np.array([int(logits[-1].argmax())]), cache)).logits[0]
        records.append(events)
    return records


def _first_difference(a: list, b: list):
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return k, x, y
    return None if len(a) == len(b) else (min(len(a), len(b)), len(a), len(b))


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_consecutive_steps_of_a_bucket_queue_the_same_launches(gpu, tiny_model, arch):
    """Two decode steps of one bucket ask the device for the same launches and copies, with the same grids, the
    same device addresses and scalars, and host copies only from page-locked buffers at fixed places: what lets one
    captured CUDA graph replay every step of the bucket."""
    model = tiny_model(arch=arch, num_layers=2, **GEOMETRY, **ARCHS[arch])
    config = EngineConfig(device="cuda", pool="process", numa_split=True, nodes=2, dense_dtype="f32", kv_dtype="bf16",
                          max_seq_len=96, graph_capture=False)  # the launches Python queues, not a graph's replay
    with Engine.open(model, config) as eng:
        cache = eng.new_cache()
        logits = eng.step(StepBatch.of(np.array(PROMPT), cache)).logits[0]
        logits = eng.step(StepBatch.of(np.array([int(logits[-1].argmax())]), cache)).logits[0]  # sizes bucket 1
        first, second = _two_recorded_steps(eng, cache, logits)
        assert len(first) > 20 and any(e[0] == "host_function" for e in first)
        assert _first_difference(first, second) is None


def test_a_step_that_uploads_a_fresh_array_queues_different_copies(gpu, tiny_model, monkeypatch):
    """The records see what a captured graph could not replay: the embedding rows uploaded from a new host array
    each step (the eager path's way) in place of the page-locked staging."""
    from coordinator.gpu.graph_steps import GraphSteps

    monkeypatch.setattr(GraphSteps, "embed", lambda self, rows: self.xp.asarray(self.embed_host[:rows].copy()))
    model = tiny_model(num_layers=1, **GEOMETRY)
    config = EngineConfig(device="cuda", pool="process", dense_dtype="f32", max_seq_len=96, graph_capture=False)
    with Engine.open(model, config) as eng:
        cache = eng.new_cache()
        logits = eng.step(StepBatch.of(np.array(PROMPT), cache)).logits[0]
        logits = eng.step(StepBatch.of(np.array([int(logits[-1].argmax())]), cache)).logits[0]
        first, second = _two_recorded_steps(eng, cache, logits)
        k, a, b = _first_difference(first, second)
        assert a[0] == b[0] == "upload" and a[1][0] == b[1][0] == "pageable" and a[2] == b[2]  # same place, new source


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_step_memory_does_not_grow_with_layers_and_is_within_the_plan(gpu, tmp_path, arch):
    """tools/gpu_step_memory.py's run through the stand-in: the step buffer's plan peak for 1-, 4- and 8-row steps
    is the same with 8 layers as with 4 (memory a layer frees is the next one's) and within the plan's step memory
    for that many rows (vram.step_bytes for these 2 nodes: at most 3 times over, less its rounding allowance);
    the buffer made at
    open is never grown, no step takes a pool block, every shape is captured and replayed."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import gpu_step_memory  # noqa: E402  (tools/gpu_step_memory.py)

    from coordinator.gpu import vram
    from coordinator.model.source import open_source

    runs = [gpu_step_memory.measure(layers, 512, tmp_path, arch=arch, **GEOMETRY, **ARCHS[arch]) for layers in (4, 8)]
    assert gpu_step_memory.problems(runs) == []
    cfg = open_source(tmp_path / "m4").config
    for rows in gpu_step_memory.ROWS:
        peak, planned = runs[0]["peaks"][str(rows)], vram.step_bytes(cfg, rows, 512, nodes=2)
        assert peak <= planned and planned - vram.STEP_SLACK <= 3 * peak, (rows, peak, planned)


def _refuse_registration(cp, monkeypatch):
    def refused(ptr, size, flags):
        raise device_standin.CUDARuntimeError(801)
    monkeypatch.setattr(cp.cuda.runtime, "hostRegister", refused)


def _no_libcuda(cp, monkeypatch):
    from coordinator.gpu import transfer as xp

    def missing():
        raise OSError("libcuda.so.1: cannot open shared object file: No such file or directory")
    monkeypatch.setattr(xp, "_driver", missing)


def _host_function_lost(cp, monkeypatch):
    from coordinator.gpu import transfer as xp

    monkeypatch.setattr(xp, "launch_host_func", lambda fn, data: None)


FAULTS = {
    "host registration refused": (_refuse_registration, "could not be registered with the device "
                                                         "(CUDARuntimeError: cudaErrorNotSupported"),
    "no libcuda": (_no_libcuda, "the CUDA driver library could not be loaded (libcuda.so.1: cannot open"),
    "CuPy 12": (lambda cp, monkeypatch: monkeypatch.setattr(cp, "__version__", "12.3.0"),
                "CuPy 12.3.0 is older than 13.0"),
    "a host function that never runs": (_host_function_lost, "a host function queued on a stream did not run"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_what_the_driver_refuses_at_open_leaves_eager_steps_and_one_warning(gpu, tiny_model, monkeypatch, caplog,
                                                                             fault):
    """A refused cudaHostRegister of the pool's segment, a missing libcuda, a CuPy too old, a host function that
    does not run: checked at open, one warning line naming the cause, the engine opens with eager steps (the pool's
    segment unregistered again) and decodes what it decodes without graph-ready steps."""
    model = tiny_model(num_layers=2, **GEOMETRY)
    want, _, _ = _run(model, graph=False, split=False)
    inject, cause = FAULTS[fault]
    inject(gpu, monkeypatch)
    config = EngineConfig(device="cuda", pool="process", dense_dtype="f32", kv_dtype="f32")
    with caplog.at_level("WARNING"), Engine.open(model, config) as eng:
        assert eng.graph is None and eng.pool._link is None
        segment = eng.pool.io.segment.data
        assert segment.ctypes.data not in device_standin._PINNED  # registered, then given up; or never
        cache = eng.new_cache()
        logits = [eng.step(StepBatch.of(np.array(PROMPT), cache)).logits[0]]
        for _ in range(6):
            logits.append(eng.step(StepBatch.of(np.array([int(logits[-1][-1].argmax())]), cache)).logits[0])
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "decode steps run eagerly" in warnings[0] and cause in warnings[0], warnings
    assert np.array_equal(np.concatenate(logits), want)


@pytest.mark.parametrize("arch, invariant", [("qwen3_moe", True), ("deepseek_v3", True), ("qwen3_moe", False)],
                         ids=["qwen3_moe", "deepseek_v3", "qwen3_moe-variable"])
def test_a_sequences_logits_are_the_same_bits_in_any_graph_step(gpu, tiny_model, arch, invariant):
    """Batch invariance on the GPU's path (issue 62), graph-ready steps through the process pool: a sequence's
    logits decoded alone, beside two other sequences, with drafts (several of its rows a step: MLA's cached
    attention with each row's own chunks) and prefilled in chunks of 7, over 70 keys (MLA's keys in two chunks),
    bit for bit: the matrices by the matrix x vector kernel at any row count, each attention row split over its
    own keys. Without batch invariance (the f32 matrices plain arrays, for cuBLAS) some rows differ: what the
    check catches."""
    from invariance import alone, beside, chunked, drafted, unequal

    model = tiny_model(arch=arch, num_layers=2, **GEOMETRY, **ARCHS[arch])
    n = 70
    with Engine.open(model, EngineConfig(device="cuda", pool="process", nodes=1, batch_invariant=invariant)) as eng:
        assert eng.graph is not None
        want = alone(eng, n)
        got = {"batch of 3": beside(eng, 2, n), "drafts": drafted(eng, n), "chunks of 7": chunked(eng, 7, n)}
        assert eng.graph.steps > 0
    differ = {how: unequal(logits, want) for how, logits in got.items()}
    if invariant:
        assert differ == {how: [] for how in got}
    else:
        assert any(differ.values())


def test_a_qwen3_next_sequences_logits_are_the_same_bits_in_any_gpu_step(gpu, tiny_model):
    """Qwen3-Next on the GPU (eager steps: its Gated DeltaNet's kernel walks a sequence's tokens in order, a block
    a (sequence, head)): a sequence's logits alone, beside two others, with drafts and in chunks of 7, bit for
    bit."""
    from invariance import alone, beside, chunked, drafted, unequal

    model = tiny_model(arch="qwen3_next", num_layers=4, seed=5)
    n = 24
    with Engine.open(model, EngineConfig(device="cuda", pool="inproc")) as eng:
        want = alone(eng, n)
        got = {"batch of 3": beside(eng, 2, n), "drafts": drafted(eng, n), "chunks of 7": chunked(eng, 7, n)}
    assert {how: unequal(logits, want) for how, logits in got.items()} == {how: [] for how in got}
