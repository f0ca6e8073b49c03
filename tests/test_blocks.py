"""coordinator/host/blocks.py: a decode token's attention half of a layer in one compiled call gives the bits of
the separate calls (logits and cached keys and values), in every loop kind of the dense matrices, and is taken
only where it applies."""

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


def decode(eng, joined: bool, steps: int = 5):
    """The prompt prefilled, then ``steps`` greedy tokens one at a time, the blocks on or off: (each decode
    step's logits, the cache's keys and values of every layer, how many block calls ran)."""
    dec = eng.decoder
    blocks = dec.blocks
    calls = []
    if joined:
        dec.blocks = [None if b is None else counted(b, calls) for b in blocks]
    else:
        dec.blocks = [None] * len(blocks)
    try:
        cache = dec.new_cache()
        ids, out = PROMPT, []
        for _ in range(steps + 1):
            logits = dec.forward(StepBatch.of(ids, cache)).logits[0][-1]
            out.append(logits)
            ids = np.array([int(logits.argmax())], np.int64)
    finally:
        dec.blocks = blocks
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
