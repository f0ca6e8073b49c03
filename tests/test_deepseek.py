"""DeepSeek-V3's parts on their own: the grouped sigmoid router against a float64 loop, YaRN's frequencies,
the config errors, the latent cache's size. Parity with transformers is in test_hf_parity.py."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from coordinator import Engine, EngineConfig
from coordinator.cli.main import main
from coordinator.errors import ModelConfigError
from coordinator.host import backend as host
from coordinator.model import ops
from coordinator.model.ops import RouterSpec
from coordinator.model.model_config import load_model_config, parse_model_config
from coordinator.model.step import StepBatch

FIXTURE = Path(__file__).parent / "fixtures" / "hf" / "deepseek_v3_basic"


def route_reference(logits, bias, k, n_group, topk_group, normalize, scaling):
    """DeepseekV3TopkRouter, one token at a time in float64."""
    T, E = logits.shape
    size = E // n_group
    ids, weights = [], []
    for t in range(T):
        scores = [1.0 / (1.0 + math.exp(-float(v))) for v in logits[t]]
        choice = [s + float(b) for s, b in zip(scores, bias)]
        group_scores = [sum(sorted(choice[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: -group_scores[g])[:topk_group]
        allowed = [e for e in range(E) if e // size in groups]
        chosen = sorted(allowed, key=lambda e: -choice[e])[:k]
        w = [scores[e] for e in chosen]
        if normalize:
            w = [v / (sum(w) + 1e-20) for v in w]
        ids.append(chosen)
        weights.append([v * scaling for v in w])
    return np.array(ids), np.array(weights)


@pytest.mark.parametrize("E, k, n_group, topk_group, normalize, scaling",
                         [(16, 4, 4, 2, True, 2.5), (8, 3, 4, 2, False, 1.0), (12, 2, 1, 1, True, 1.8)])
def test_grouped_router_matches_a_float64_loop(E, k, n_group, topk_group, normalize, scaling):
    rng = np.random.default_rng(E + k)
    logits = rng.normal(0, 2, (40, E)).astype(np.float32)
    bias = rng.normal(0, 0.3, E).astype(np.float32)
    ids, weights = host.route(logits, bias, RouterSpec(k, n_group, topk_group, False, normalize, scaling, True))
    want_ids, want_w = route_reference(logits, bias, k, n_group, topk_group, normalize, scaling)
    assert ids.dtype == np.int64 and weights.dtype == np.float32
    assert np.array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_w, rtol=2e-6, atol=1e-7)
    # the bias moved the choice and (with groups) the group limit excluded experts a plain top-k would take
    plain = np.argsort(-(1 / (1 + np.exp(-logits.astype(np.float64)))), axis=-1, kind="stable")[:, :k]
    assert (np.sort(plain, -1) != np.sort(ids, -1)).any()
    if n_group > topk_group:
        biased = np.argsort(-(1 / (1 + np.exp(-logits.astype(np.float64))) + bias), axis=-1, kind="stable")[:, :k]
        assert (np.sort(biased, -1) != np.sort(ids, -1)).any()


def test_yarn_frequencies_as_transformers_computes_them():
    """_compute_yarn_parameters written out for DeepSeek-V3's rope_scaling (factor 40, original 4096)."""
    dim, theta, factor, orig = 64, 10000.0, 40.0, 4096
    got = ops.yarn_inv_freq(dim, theta, factor, orig, 32, 1, truncate=True)

    def cdim(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(cdim(32)), 0), min(math.ceil(cdim(1)), dim - 1)
    want = []
    for i in range(dim // 2):
        base = 1.0 / theta ** (2 * i / dim)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        want.append(base / factor * ramp + base * (1 - ramp))
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert got[0] == 1.0 and got[-1] == pytest.approx(want[-1]) and got[-1] < 1.0 / theta ** ((dim - 2) / dim)


def _bad_copy(tmp_path, **changes) -> Path:
    model = tmp_path / "m"
    shutil.copytree(FIXTURE, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(changes)
    (model / "config.json").write_text(json.dumps(cfg))
    return model


@pytest.mark.parametrize("key, value, accepted", [("scoring_func", "softmax", "'sigmoid'"),
                                                  ("topk_method", "group_limited_greedy", "'noaux_tc'")])
def test_unknown_scoring_or_topk_method_is_refused_before_any_worker(tmp_path, key, value, accepted):
    model = _bad_copy(tmp_path, **{key: value})
    with pytest.raises(ModelConfigError) as err:
        Engine.open(model, EngineConfig(pool="process", numa_split=True, nodes=2))
    assert f"'{key}'" in str(err.value) and repr(value) in str(err.value) and accepted in str(err.value)


def test_group_geometry_is_checked(tmp_path):
    with pytest.raises(ModelConfigError, match="not a multiple of n_group 3"):
        load_model_config(_bad_copy(tmp_path, n_group=3))


def test_the_cache_holds_the_latent_and_the_rope_key():
    cfg = load_model_config(FIXTURE)
    m = cfg.mla
    want = cfg.num_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * 4  # float32
    assert cfg.kv_bytes_per_token == want == 3 * (24 + 8) * 4
    assert want < cfg.num_layers * 2 * cfg.num_heads * m.qk_head_dim * 4  # far below full K and V
    with Engine.open(FIXTURE, EngineConfig()) as eng:
        assert eng.decoder.new_cache().bytes_per_token == want


def test_generate_json_reports_the_cache_bytes_per_token(capsys):
    ref = np.load(FIXTURE / "reference.npz")
    prompt = ",".join(str(t) for t in ref["input_ids"])
    assert main(["generate", "--model", str(FIXTURE), "--prompt-ids", prompt, "-n", "3", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert doc["kv_bytes_per_token"] == 3 * (24 + 8) * 4
    assert doc["ids"] == ref["greedy_ids"][:3].tolist()


# DeepSeek-V3's config.json as the Hub has it (remote-code form: rope_scaling with "type", top-level rope_theta)
HUB_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "ep_size": 1, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8,
    "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "attention_bias": False, "bos_token_id": 0, "eos_token_id": 1,
}


def test_the_hub_config_of_deepseek_v3():
    cfg = parse_model_config(HUB_V3)
    assert cfg.arch == "deepseek_v3" and cfg.sparse_layers[:4] == (False, False, False, True) and all(
        cfg.sparse_layers[3:])
    assert cfg.kv_bytes_per_token == 61 * (512 + 64) * 4  # not 61 * 2 * 128 * 192 * 4
    assert cfg.mla.softmax_scale == pytest.approx(192**-0.5 * (0.1 * math.log(40) + 1) ** 2)
    assert cfg.yarn.attention_factor == 1.0 and cfg.yarn.original_max_position_embeddings == 4096
    assert (cfg.group_router.n_group, cfg.group_router.topk_group, cfg.top_k) == (8, 4, 8)
    assert cfg.shared_expert_intermediate_size == 2048 and not cfg.shared_expert_gate
    fp8 = dict(HUB_V3, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]})
    assert parse_model_config(fp8) == cfg  # FP8 weights: read and dequantised by the checkpoint (test_fp8.py)


def test_the_4x_config_form_reads_as_the_5x_form():
    cfg = json.loads((FIXTURE / "config.json").read_text())
    legacy = dict(cfg)
    rp = legacy.pop("rope_parameters")
    legacy["rope_theta"] = rp["rope_theta"]
    legacy["rope_scaling"] = {"type": "yarn", **{k: v for k, v in rp.items() if k not in ("rope_theta", "rope_type")}}
    assert parse_model_config(legacy) == parse_model_config(cfg)


@pytest.mark.parametrize("absorb", [True, False])
def test_both_attention_forms_match_transformers(absorb):
    """The absorbed form (the latents never expanded) and the expanded one, each forced for prefill and decode."""
    ref = np.load(FIXTURE / "reference.npz")
    ids = ref["input_ids"].tolist() + ref["greedy_ids"].tolist()
    with Engine.open(FIXTURE, EngineConfig()) as eng:
        eng.decoder.mla_absorb = absorb
        assert float(np.max(np.abs(eng.logits(ids) - ref["full_logits"]))) < 2e-4
        assert float(np.max(np.abs(eng.logits(ids, steps=True) - ref["full_logits"]))) < 2e-4
        cache = eng.decoder.new_cache()  # chunks over cached latents, as the server's chunked prefill runs them
        chunks = [eng.step(StepBatch.of(np.array(c, np.int64), cache, every_row=True)).logits[0]
                  for c in (ids[:5], ids[5:13], ids[13:])]
        assert float(np.max(np.abs(np.concatenate(chunks) - ref["full_logits"]))) < 2e-4
        cache = eng.decoder.new_cache()  # last_only: the last layer takes each sequence's last query alone
        for a, b in ((0, 5), (5, 13), (13, len(ids))):
            last = eng.step(StepBatch.of(np.array(ids[a:b], np.int64), cache)).logits[0]  # [1, V]
            assert float(np.max(np.abs(last[0] - ref["full_logits"][b - 1]))) < 2e-4
        pair = eng.step(StepBatch([(np.array(ids[:n], np.int64), eng.decoder.new_cache()) for n in (7, 4)])).logits
        for got, n in zip(pair, (7, 4)):
            assert float(np.max(np.abs(got[0] - ref["full_logits"][n - 1]))) < 2e-4
    assert eng.decoder.absorbed(1, 64) is absorb


def route_reference_v2(logits, k, n_group, topk_group, scaling):
    """DeepseekV2TopkRouter (group_limited_greedy; n_group 1: greedy), one token at a time in float64."""
    T, E = logits.shape
    size = E // n_group
    ids, weights = [], []
    for t in range(T):
        z = [math.exp(float(v) - float(max(logits[t]))) for v in logits[t]]
        scores = [v / sum(z) for v in z]
        groups = sorted(range(n_group), key=lambda g: -max(scores[g * size:(g + 1) * size]))[:topk_group]
        chosen = sorted((e for e in range(E) if e // size in groups), key=lambda e: -scores[e])[:k]
        ids.append(chosen)
        weights.append([scores[e] * scaling for e in chosen])
    return np.array(ids), np.array(weights)


@pytest.mark.parametrize("E, k, n_group, topk_group, scaling", [(16, 4, 4, 2, 16.0), (12, 3, 1, 1, 1.0)])
def test_deepseek_v2_softmax_router_matches_a_float64_loop(E, k, n_group, topk_group, scaling):
    rng = np.random.default_rng(E + k)
    logits = rng.normal(0, 2, (40, E)).astype(np.float32)
    ids, weights = host.route(logits, None, RouterSpec(k, n_group, topk_group, True, False, scaling, True))
    want_ids, want_w = route_reference_v2(logits, k, n_group, topk_group, scaling)
    assert np.array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_w, rtol=2e-6, atol=1e-7)
    if n_group > topk_group:  # the group limit excluded experts a plain top-k would take
        plain = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
        assert (np.sort(plain, -1) != np.sort(ids, -1)).any()


def test_deepseek_v2_config_reads_transformers_defaults():
    """V2-Lite's Hub form: greedy (groups unused), no q_lora_rank; norm_topk_prob is not applied (transformers'
    DeepseekV2TopkRouter never normalises), rope always interleaved."""
    cfg = json.loads((FIXTURE.parent / "deepseek_v2_lite" / "config.json").read_text())
    cfg.update(topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=True)
    c = parse_model_config(cfg)
    assert (c.arch, c.mla.q_lora_rank, c.mla.rope_interleave, c.norm_topk_prob) == ("deepseek_v2", None, True, False)
    assert (c.group_router.n_group, c.group_router.scoring, c.sparse_layers) == (1, "softmax", (False, True, True))
    with pytest.raises(ModelConfigError, match="topk_method"):
        parse_model_config(dict(cfg, topk_method="noaux_tc"))


GLM45_AIR_HUB = {  # zai-org/GLM-4.5-Air's config.json (the keys the engine reads)
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "first_k_dense_replace": 1, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 10944, "max_position_embeddings": 131072,
    "moe_intermediate_size": 1408, "n_group": 1, "n_routed_experts": 128, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 96, "num_experts_per_tok": 8, "num_hidden_layers": 46,
    "num_key_value_heads": 8, "num_nextn_predict_layers": 1, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 1000000, "routed_scaling_factor": 1.0, "tie_word_embeddings": False,
    "topk_group": 1, "use_qk_norm": False, "vocab_size": 151552, "eos_token_id": [151329, 151336, 151338],
}


def test_the_hub_config_of_glm_4_5_air():
    """Top-level partial_rotary_factor (the 4.x form; transformers 5 writes it in rope_parameters), head_dim not
    hidden / heads, one dense first layer, the sigmoid router with the correction bias, an ungated shared expert."""
    c = parse_model_config(GLM45_AIR_HUB)
    assert (c.arch, c.head_dim, c.rotary_dim, c.rope_theta, c.qkv_bias, c.qk_norm) == \
        ("glm4_moe", 128, 64, 1e6, True, False)
    assert (c.sparse_layers[:2], c.shared_expert_intermediate_size, c.shared_expert_gate) == ((False, True), 1408, False)
    assert (c.group_router.scoring, c.group_router.n_group, c.norm_topk_prob) == ("sigmoid", 1, True)
    assert c.kv_bytes_per_token == 46 * 2 * 8 * 128 * 4
    with pytest.raises(ModelConfigError, match="partial_rotary_factor"):
        parse_model_config(dict(GLM45_AIR_HUB, partial_rotary_factor=0.01))  # 1 dim
    with pytest.raises(ModelConfigError, match="quantization_config 'compressed-tensors'"):
        parse_model_config(dict(GLM45_AIR_HUB, quantization_config={"quant_method": "compressed-tensors"}))


@pytest.mark.parametrize("preset, arch, hub, billions", [("deepseek-v3", "deepseek_v3", "HUB_V3", 671.0),
                                                         ("glm-4.5-air", "glm4_moe", "GLM45_AIR_HUB", 106.9)])
def test_make_model_presets_are_the_hub_geometries(preset, arch, hub, billions):
    """strata make-model's presets read as the Hub's config.json does (all but the tokens' ids), 671B and 107B
    parameters without the MTP layer; --layers 1 keeps one MoE layer."""
    from dataclasses import replace

    from coordinator.cli.make_model import PRESET_ARCH, PRESETS, hf_config, parameter_count

    g = PRESETS[preset]()
    ours, want = parse_model_config(hf_config(arch, g)), parse_model_config(globals()[hub])
    assert PRESET_ARCH[preset] == arch
    assert replace(ours, bos_token_id=None, eos_token_ids=()) == replace(want, bos_token_id=None, eos_token_ids=())
    assert parameter_count(arch, g) / 1e9 == pytest.approx(billions, abs=0.1)
    assert parse_model_config(hf_config(arch, replace(g, num_layers=1))).sparse_layers == (True,)


def test_make_model_deepseek_v3_preset_shrunk_loads_and_generates(tmp_path):
    from coordinator.cli.make_model import make_model

    out = make_model(tmp_path / "m", preset="deepseek-v3", num_layers=2, hidden_size=64, num_heads=4, num_experts=16,
                     moe_intermediate_size=32, dense_intermediate_size=64, q_lora_rank=24, kv_lora_rank=32,
                     qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=320)
    cfg = load_model_config(out)
    assert cfg.group_router.n_group == 8 and cfg.yarn.factor == 40.0 and cfg.sparse_layers == (False, True)
    with Engine.open(out, EngineConfig()) as eng:
        assert len(eng.generate([1, 2, 3], max_new_tokens=4, temperature=0.0, stop_at_eos=False)) == 4
