"""A Qwen3-Next GGUF file (llama.cpp's ``qwen3next``) as llama.cpp's own converter writes it: tests/fixtures/gguf/
qwen3_next_basic.gguf, made by tools/gguf_mla_fixtures.py (--cases qwen3_next_basic) from the safetensors fixture of
the same name. The converter regroups in_proj_qkvz into attn_qkv and attn_gate, stores -exp(A_log) and the
RMSNorms' weights plus 1; the engine reads the file into the weights it reads from the checkpoint, and gives the
checkpoint's logits and greedy tokens, in process and split over two node workers."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from coordinator.config import EngineConfig
from coordinator.engine import Engine
from coordinator.model.model_config import load_model_config, parse_model_config
from coordinator.model.weights import load_weights
from coordinator.model.arch import gguf_config
from coordinator.model.source import open_gguf
from shm.gguf_checkpoint import open_checkpoint

ROOT = Path(__file__).parent / "fixtures"
HF, GGUF = ROOT / "hf" / "qwen3_next_basic", ROOT / "gguf" / "qwen3_next_basic.gguf"


def relative(x: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))


def test_the_files_metadata_is_the_checkpoints_config():
    """Every ModelConfig field read from the file's metadata equals config.json's, but the norms' offset: the
    file's weights already hold 1 + weight."""
    want = load_model_config(HF)
    ck = open_gguf(GGUF)
    try:
        got = parse_model_config(gguf_config(ck.file))
    finally:
        ck.close()
    assert got.norm_offset == 0.0 and want.norm_offset == 1.0
    diff = {f.name: (getattr(got, f.name), getattr(want, f.name)) for f in dataclasses.fields(want)
            if f.name != "norm_offset" and getattr(got, f.name) != getattr(want, f.name)}
    assert diff == {}


def test_the_files_weights_are_the_checkpoints():
    """The Gated DeltaNet projections (regrouped by the converter, here by the loader), the conv, the norms
    (1 + weight either way) and everything else are the same float32 numbers; -exp(A_log) is torch's in the file
    and NumPy's from the checkpoint, within a float32 rounding."""
    cfg = load_model_config(HF)
    ck, gk = open_checkpoint(HF), open_gguf(GGUF)
    try:
        want, got = load_weights(cfg, ck), load_weights(dataclasses.replace(cfg, norm_offset=0.0), gk)
    finally:
        ck.close()
        gk.close()
    for i, (w, g) in enumerate(zip(want.layers, got.layers)):
        for f in dataclasses.fields(w):
            a, b = getattr(w, f.name), getattr(g, f.name)
            if f.name == "linear" and a is not None:
                for lf in dataclasses.fields(a):
                    x, y = getattr(a, lf.name), getattr(b, lf.name)
                    if lf.name == "a_neg":
                        np.testing.assert_allclose(y, x, rtol=2e-7)
                    else:
                        assert np.array_equal(x, y), (i, lf.name)
            elif isinstance(a, np.ndarray):
                assert np.array_equal(a, b), (i, f.name)
            elif f.name in ("dense_mlp", "shared_expert") and a is not None:
                assert all(np.array_equal(getattr(a, m), getattr(b, m)) for m in ("gate", "up", "down")), (i, f.name)
    assert np.array_equal(want.final_norm, got.final_norm) and np.array_equal(want.lm_head, got.lm_head)


def test_engine_on_the_file_equals_the_engine_on_the_checkpoint():
    """In process and split over two node workers: the file's logits within 1e-5 relative of the checkpoint's
    (the one difference, -exp(A_log)'s rounding), over the prompt and a decode step a token, the same greedy
    tokens, and transformers' logits within 1e-4 relative."""
    ref = np.load(HF / "reference.npz")
    prompt, greedy = ref["input_ids"].tolist(), ref["greedy_ids"].tolist()
    for split in ({}, dict(numa_split=True, nodes=2)):
        config = EngineConfig(pool="process" if split else "inproc", **split)
        with Engine.open(HF, config) as eng:
            want, want_steps = eng.logits(prompt), eng.logits(prompt + greedy, steps=True)
        with Engine.open(GGUF, config) as eng:
            assert eng.model_config.arch == "qwen3_next"
            got, got_steps = eng.logits(prompt), eng.logits(prompt + greedy, steps=True)
            ids = eng.generate(prompt, max_new_tokens=len(greedy), temperature=0.0, stop_at_eos=False)
        assert relative(got, want) < 1e-5 and relative(got_steps, want_steps) < 1e-5, split
        assert relative(got, ref["logits"]) < 1e-4, split
        assert ids == greedy, split
