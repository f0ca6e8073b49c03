"""The engine's decoder against the independent float64 reference (tests/reference.py)."""

from __future__ import annotations

import numpy as np
import pytest
from reference import Reference

from coordinator import Engine, EngineConfig
from coordinator.cli.make_model import make_model
from coordinator.model.step import StepBatch

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]  # "Hello, world"

VARIANTS = {
    "qwen3_moe": dict(arch="qwen3_moe"),
    "qwen3_moe_dense_mix": dict(arch="qwen3_moe", mlp_only_layers=(0,), decoder_sparse_step=1, norm_topk_prob=False,
                                tie_word_embeddings=True),
    "qwen3_moe_sparse_step2": dict(arch="qwen3_moe", decoder_sparse_step=2, top_k=1),
    "qwen3_moe_top8_mha": dict(arch="qwen3_moe", top_k=8, num_kv_heads=4, rope_theta=10000.0),
    "mixtral": dict(arch="mixtral"),
    "mixtral_gqa4": dict(arch="mixtral", num_heads=8, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5),
    "qwen2_moe": dict(arch="qwen2_moe"),
    "qwen2_moe_norm_dense": dict(arch="qwen2_moe", norm_topk_prob=True, mlp_only_layers=(1,)),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    opts = dict(VARIANTS[request.param])
    arch = opts.pop("arch")
    path = make_model(tmp_path_factory.mktemp(request.param), arch=arch, seed=7, **opts)
    return request.param, path


def test_logits_match_reference(variant):
    name, path = variant
    ref = Reference(path).forward(PROMPT)
    with Engine.open(path, EngineConfig(pool="inproc")) as eng:
        got = eng.logits(PROMPT)
    assert got.dtype == np.float32 and got.shape == ref.shape
    err = float(np.max(np.abs(got - ref)))
    assert err < 2e-4, f"{name}: max abs logit error {err:.2e}"
    # the check has teeth: the logits vary across tokens and vocabulary
    assert np.std(ref) > 0.5 and np.max(np.abs(np.diff(ref, axis=0))) > 0.1


def test_greedy_matches_reference(variant):
    name, path = variant
    ref = Reference(path)
    ids = list(PROMPT[:5])
    for _ in range(6):
        ids.append(int(np.argmax(ref.forward(ids)[-1])))
    with Engine.open(path) as eng:
        got = eng.generate(PROMPT[:5], max_new_tokens=6, temperature=0.0, stop_at_eos=False)
    assert got == ids[5:], name


def test_kv_cache_decode_equals_full_forward(variant):
    """Token-by-token decode through the cache gives the full forward's logits."""
    _, path = variant
    with Engine.open(path) as eng:
        full = eng.logits(PROMPT)
        cache = eng.decoder.new_cache()
        steps = [eng.step(StepBatch.of(np.array(PROMPT[:4]), cache, every_row=True)).logits[0][-1]]
        for tok in PROMPT[4:]:
            steps.append(eng.step(StepBatch.of(np.array([tok]), cache, every_row=True)).logits[0][-1])
    np.testing.assert_allclose(np.stack(steps), full[3:], atol=2e-5, rtol=0)


@pytest.mark.parametrize("nodes", [2, 3])
def test_split_plan_matches_unsplit_within_rounding(variant, nodes):
    _, path = variant
    with Engine.open(path) as eng:
        whole = eng.logits(PROMPT)
    with Engine.open(path, EngineConfig(numa_split=True, nodes=nodes)) as eng:
        assert len(eng.pool.plan.slices_for(eng.model_config.moe_intermediate_size)) >= 2
        split = eng.logits(PROMPT)
        again = eng.logits(PROMPT)
    np.testing.assert_allclose(split, whole, atol=2e-5, rtol=0)
    assert np.array_equal(split, again)  # deterministic


def test_fused_qkv_projection_matches_reference(variant):
    """The device side's fused QKV (one matrix, q/k/v views of it, norm + RoPE read from the output's column
    slices), driven here on NumPy: the reference's logits, prefill and token by token through the cache."""
    from coordinator.gpu.backend import fuse_qkv

    name, path = variant
    ref = Reference(path).forward(PROMPT)
    with Engine.open(path, EngineConfig(pool="inproc", batch_invariant=False)) as eng:  # float32 arrays, as a GPU's
        dec = eng.decoder
        for i, lw in enumerate(dec.w.layers):
            dec.w.layers[i], dec.qkv[i] = fuse_qkv(lw, np)
            assert np.shares_memory(dec.w.layers[i].v, dec.qkv[i].weight)
        got = eng.logits(PROMPT)
        cache = dec.new_cache()
        dec.forward(StepBatch.of(np.array(PROMPT[:4]), cache, every_row=True)).logits[0]
        steps = np.stack([dec.forward(StepBatch.of(np.array([tok]), cache, every_row=True)).logits[0][-1]
                          for tok in PROMPT[4:]])
    assert float(np.max(np.abs(got - ref))) < 2e-4, name
    assert float(np.max(np.abs(steps - ref[4:]))) < 2e-4, name
