"""coordinator/host/blocks.py: a decode token's attention half of a layer in one compiled call, and its MoE half in
another, give the bits of the separate calls (logits and cached keys and values) and the same counters, in every
loop kind of the dense matrices, and are taken only where they apply."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from coordinator import Engine, EngineConfig
from coordinator.cli.make_model import make_model
from coordinator.host import packed
from coordinator.host.blocks import HostAttentionBlock
from coordinator.host.packed import PackedMatrix
from node_worker.kernels.dense import ONE_ROW_LOOPS, ROW_GROUPS, ROW_PLAIN, ROW_SUPER, SERIAL
from shm import formats
from coordinator.model.step import StepBatch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from kernel_bench import stored_rows  # noqa: E402  (random rows of a format: encoded, or a GGUF type's blocks)

FIXTURES = Path(__file__).parent / "fixtures" / "gguf"
PROMPT = np.array([5, 17, 99, 3, 42, 7, 250, 11], np.int64)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("blocks") / "qwen3", arch="qwen3_moe", seed=5)


def decode(eng, joined: bool, steps: int = 5, moe: bool = True):
    """The prompt prefilled, then ``steps`` greedy tokens one at a time, the attention blocks on or off (and the
    MoE blocks, which take the pairs an attention block routed, on or off with ``moe``): (each decode step's
    logits, the cache's keys and values of every layer, how many block calls ran)."""
    dec = eng.decoder
    blocks, moe_blocks = dec.blocks, dec.moe_blocks
    calls = []
    if joined:
        dec.blocks = [None if b is None else counted(b, calls) for b in blocks]
    else:
        dec.blocks = [None] * len(blocks)
    if not moe:
        dec.moe_blocks = [None] * len(moe_blocks)
    try:
        cache = dec.new_cache()
        ids, out = PROMPT, []
        for _ in range(steps + 1):
            logits = dec.forward(StepBatch.of(ids, cache)).logits[0][-1]
            out.append(logits)
            ids = np.array([int(logits.argmax())], np.int64)
    finally:
        dec.blocks, dec.moe_blocks = blocks, moe_blocks
    kv = [np.array(buf[: cache.length]) for i in range(len(blocks)) for buf in cache.buffers(i)]
    return out[1:], kv, len(calls)


def counted(block, calls):
    def call(*args):
        got = block(*args)
        calls.append(got is not None)
        return got
    return call


def check_same(path: Path, kinds: set, **settings) -> None:
    with Engine.open(path, EngineConfig(pool="inproc", device="cpu", **settings)) as eng:
        blocks = [b for b in eng.decoder.blocks if b is not None]
        assert blocks and {k % SERIAL for b in blocks for k in b.kinds} == kinds
        assert all(b.routed is not None for b in blocks)  # every layer's router in its block
        got, got_kv, calls = decode(eng, True)
        want, want_kv, none = decode(eng, False)
    layers = len(eng.decoder.blocks)
    assert calls == 5 * len(blocks) and none == 0 and layers == len(blocks)
    assert len({int(w.argmax()) for w in want}) > 1 and np.abs(want[0]).max() > 0
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
    assert all(np.array_equal(g, w) for g, w in zip(got_kv, want_kv))


@pytest.fixture(params=["serial", "parallel"])
def threads(request, monkeypatch):
    """The matrices' one-row loops on the calling thread (the fixtures' matrices are small) or over the threads."""
    monkeypatch.setattr(packed, "SERIAL_BYTES", 1 << 40 if request.param == "serial" else 0)
    return request.param


@pytest.mark.parametrize("fmt, activations, kinds", [("f32", "f32", {ROW_PLAIN}), ("q8", "q8", {ROW_GROUPS}),
                                                     ("q4", "q8", {ROW_PLAIN})])
def test_a_safetensors_models_decode_is_the_separate_calls_bits(model, fmt, activations, kinds, threads):
    check_same(model, kinds, dense_dtype=fmt, expert_dtype=fmt, activations=activations)


def test_a_llama_quantize_files_k_types_are_the_separate_calls_bits(threads):
    check_same(FIXTURES / "qwen3_moe_quant-Q4_K_M.gguf", {ROW_SUPER})


@pytest.mark.parametrize("fmt, int_act, kind", [("f32", False, ROW_PLAIN), ("q8", True, ROW_GROUPS),
                                                ("q4", True, ROW_PLAIN), ("q8", False, ROW_PLAIN),
                                                ("q4k", True, ROW_SUPER), ("iq4xs", True, ROW_SUPER)])
def test_a_loops_serial_twin_gives_its_bits(fmt, int_act, kind):
    """ONE_ROW_LOOPS[kind + SERIAL] is the same loop on the calling thread: the same bits."""
    rng = np.random.default_rng(3)
    m = PackedMatrix(formats.get(fmt), stored_rows(formats.get(fmt), 40, 256, rng), (40, 256), int_act)
    assert m.one_row_kind % SERIAL == kind
    x = rng.standard_normal((1, 256)).astype(np.float32)
    ks, fmt_id, data, row_bytes, R, K = m.one_row_args
    got = {}
    for k in (kind, kind + SERIAL):
        out = np.empty((1, R), np.float32)
        args = (ks, data, R, K, x, out) if kind == ROW_GROUPS else (ks, fmt_id, data, 0, row_bytes, R, K, x, out)
        ONE_ROW_LOOPS[k](*args)
        got[k] = out
    assert np.array_equal(got[kind], got[kind + SERIAL]) and np.abs(got[kind]).max() > 0
    assert np.allclose(got[kind], x @ m.decoded().T, rtol=0.05, atol=0.05 * np.abs(got[kind]).max())


@pytest.mark.parametrize("name", ["deepseek_v3_quant-Q8_0", "qwen3_next_quant-Q4_K_M"])
def test_layers_the_block_does_not_cover_take_the_separate_calls(name):
    """MLA, the Gated DeltaNet and gated attention have no block; the layers of it a model mixes in do."""
    with Engine.open(FIXTURES / f"{name}.gguf", EngineConfig(pool="inproc", device="cpu")) as eng:
        dec = eng.decoder
        assert all(b is None for lw, b in zip(dec.w.layers, dec.blocks)
                   if lw.mla is not None or lw.linear is not None or lw.q_gate is not None)
        assert any(lw.mla is not None or lw.linear is not None or lw.q_gate is not None for lw in dec.w.layers)


def test_several_rows_take_the_separate_calls(model):
    """A prompt's rows (or a batch's) are not one token: the step gives the block nothing to do."""
    with Engine.open(model, EngineConfig(pool="inproc", device="cpu")) as eng:
        dec = eng.decoder
        calls = []
        dec.blocks = [None if b is None else counted(b, calls) for b in dec.blocks]
        dec.forward(StepBatch.of(PROMPT, dec.new_cache()))
        assert calls == []
        dec.forward(StepBatch.of(PROMPT[:1], dec.new_cache()))
        assert calls and all(calls)


def test_arrays_that_are_not_float32_rows_are_given_back():
    """The entry point trusts its argument types: a row of another dtype or shape is refused before the call."""
    block = HostAttentionBlock.__new__(HostAttentionBlock)
    block.H, block._call = 8, None
    keys = np.zeros((3, 1, 4), np.float32)
    cos = np.ones((1, 4), np.float32)
    ok = np.zeros((1, 8), np.float32)
    assert block(ok.astype(np.float64), ok, keys, keys, cos, cos) is None
    assert block(ok, np.zeros((2, 8), np.float32), keys, keys, cos, cos) is None


# -- the MoE half ------------------------------------------------------------------------------------------------

def counters(eng) -> dict:
    """What an engine's users read of its routing and its pool: the decoder's counters and the pool's."""
    st, pool = eng.decoder.stats, eng.pool
    return {"routed": st.routed_pairs, "cpu_pairs": st.cpu_pairs, "loads": st.cpu_expert_loads,
            "device": st.device_pairs, "per_expert": {k: v.tolist() for k, v in st.per_layer_expert.items()},
            "requests": pool.stats["requests"], "bytes": pool.bytes_read}


def decode_counted(path: Path, moe: bool, **settings) -> tuple[list, dict, int]:
    """decode() on a fresh engine, the MoE blocks on or off: (logits, the counters it ends with, MoE block
    calls a layer)."""
    with Engine.open(path, EngineConfig(pool="inproc", device="cpu", **settings)) as eng:
        dec = eng.decoder
        calls = []
        dec.moe_blocks = [None if b is None else counted(b, calls) for b in dec.moe_blocks]
        logits, _, _ = decode(eng, True, moe=moe)
        assert all(calls)
        return logits, counters(eng), len(calls) / sum(b is not None for b in dec.moe_blocks)


@pytest.mark.parametrize("fmt", ["f32", "q8", "q4", "Q4_K_M"])
def test_the_moe_block_gives_the_pools_bits_and_counts(model, fmt):
    """The MoE half in one call (the node's layer kernel, the add and the next norm) gives the logits of the
    pool's request and the backend's add, and every counter the same: the router's choices per expert, the
    pool's requests and the expert bytes it read; for safetensors in each storage format and llama-quantize's
    file."""
    path, settings = (FIXTURES / "qwen3_moe_quant-Q4_K_M.gguf", {}) if fmt == "Q4_K_M" else (
        model, {"dense_dtype": fmt, "expert_dtype": fmt})
    got, got_counts, calls = decode_counted(path, True, **settings)
    want, want_counts, none = decode_counted(path, False, **settings)
    assert calls == 5 and none == 0  # each MoE layer's block at each of five decode steps
    assert len({int(w.argmax()) for w in want}) > 1
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
    assert got_counts == want_counts and got_counts["bytes"] > 0 and got_counts["routed"] > 0


def test_the_last_layers_rows_outlive_the_step(model):
    """The last layer's block gives new arrays (a step's final rows, the MTP layer's input, are read after the
    next step); the others reuse one pair of buffers."""
    with Engine.open(model, EngineConfig(pool="inproc", device="cpu")) as eng:
        dec = eng.decoder
        cache = dec.new_cache()
        dec.forward(StepBatch.of(PROMPT, cache))
        rows = []
        for token in (3, 4):
            out = dec.forward(StepBatch([(np.array([token], np.int64), cache)], hidden=True))
            rows.append(out.hidden[0])
        assert [b.fresh for b in dec.moe_blocks] == [False] * (len(dec.moe_blocks) - 1) + [True]
        assert not np.shares_memory(rows[0], rows[1]) and not np.array_equal(rows[0], rows[1])


@pytest.mark.parametrize("settings, why", [
    ({"numa_split": True, "nodes": 2}, "two virtual nodes: their partials summed in node order"),
    ({"pool": "process"}, "a worker process"),
    ({"gpu_experts": 8}, "experts kept beside the network (two of each MoE layer)"),
    ({"route_tail_skip": 0.3}, "pairs dropped by weight"),
])
def test_the_moe_block_is_taken_only_where_the_pool_takes_the_row_whole(model, settings, why):
    with Engine.open(model, EngineConfig(**{"pool": "inproc", "device": "cpu", **settings})) as eng:
        dec = eng.decoder
        calls = []
        dec.moe_blocks = [None if b is None else counted(b, calls) for b in dec.moe_blocks]
        cache = dec.new_cache()
        dec.forward(StepBatch.of(PROMPT, cache))
        dec.forward(StepBatch.of(PROMPT[:1], cache))
        assert calls == [], why
        assert eng.decoder.stats.routed_pairs > 0
        assert all(dec.has_device.values()) or "gpu_experts" not in settings


def test_the_moe_block_adds_the_shared_experts_output_as_the_decoder_does(model):
    """A layer with shared experts: y + the shared output, then the add and the norm, the decoder's order (the
    pool's partials, plus the shared experts' output, added to h by the backend's add_rms_norm)."""
    with Engine.open(model, EngineConfig(pool="inproc", device="cpu")) as eng:
        dec, rng = eng.decoder, np.random.default_rng(2)
        i = next(k for k, b in enumerate(dec.moe_blocks) if b is not None)
        block = dec.moe_blocks[i]
        h, m, shared = (rng.standard_normal((1, block.H)).astype(np.float32) for _ in range(3))
        ids = rng.choice(dec.cfg.num_experts, (1, block.k), replace=False).astype(np.int64)
        weights = rng.random((1, block.k)).astype(np.float32)
        got_h, got_a = (a.copy() for a in block(h, m, (ids, weights), shared))
        y = eng.pool.workers[0].compute(i, m, np.zeros(block.k, np.int64), ids[0], weights[0])
        want_h, want_a = dec.backend.add_rms_norm(h, y + shared, block.norm, dec.cfg.rms_norm_eps)
        assert np.array_equal(got_h, want_h) and np.array_equal(got_a, want_a)
        assert not np.array_equal(got_h, block(h, m, (ids, weights))[0])  # the shared row was added


def test_the_moe_block_names_a_routing_error_as_the_pool_does(model):
    """An expert id past the model's: the node's kernel refuses it (nothing computed), and the block raises the
    pool's ValueError naming it."""
    with Engine.open(model, EngineConfig(pool="inproc", device="cpu")) as eng:
        dec = eng.decoder
        block = next(b for b in dec.moe_blocks if b is not None)
        row = np.ones((1, block.H), np.float32)
        ids = np.full((1, block.k), dec.cfg.num_experts, np.int64)
        with pytest.raises(ValueError, match="expert id out of range"):
            block(row, row, (ids, np.ones((1, block.k), np.float32)))


def test_the_moe_block_is_loaded_at_open_from_the_experts_unit(model):
    """The experts compile unit compiles the MoE block (host/ops.warm_up_moe_block) on the types a block passes:
    Engine.open binds it from the disk cache, compiling nothing in the coordinator. In a fresh process, where
    nothing was loaded before."""
    import subprocess

    script = f"""
from coordinator.config import EngineConfig
from coordinator.engine import Engine
from coordinator.host import ops as host_ops
with Engine.open({str(model)!r}, EngineConfig(device="cpu", pool="inproc")) as eng:
    assert any(b is not None for b in eng.decoder.moe_blocks)
    eng.generate(list(range(1, 9)), max_new_tokens=3, stop_at_eos=False)
stats = host_ops.moe_block.stats
assert sum(stats.cache_hits.values()) >= 1 and not stats.cache_misses, (stats.cache_hits, stats.cache_misses)
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
