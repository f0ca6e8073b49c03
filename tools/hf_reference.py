#!/usr/bin/env python
"""Build tiny random Hugging Face MoE checkpoints plus reference outputs.

Run with a Python that has torch + transformers (NOT needed by the engine or
its tests), e.g.:

    /work/hfenv/bin/python tools/hf_reference.py --out /work/hfref

For each case it writes DIR/<case>/ (config.json, generation_config.json,
*.safetensors [+ model.safetensors.index.json]) and DIR/<case>/reference.npz:

    input_ids      int64   [T]          fixed prompt
    logits         float32 [T, vocab]   one full forward of input_ids
    greedy_ids     int64   [8]          new tokens of generate(do_sample=False)
    greedy_logits  float32 [8, vocab]   raw logits that chose each new token
    full_logits    float32 [T+8, vocab] one full forward of prompt+greedy_ids

A case's prompt is PROMPT unless PROMPTS gives it another. Rebuilding some cases (--cases) leaves DIR/versions.json
as it is, writes DIR/<case>/versions.json and appends their summary to DIR/summary.txt.

All references are computed from the checkpoint *as saved* (reloaded with
from_pretrained(..., dtype=float32)), so bf16/f16 weight rounding is included.
Also writes DIR/versions.json and DIR/summary.txt.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import sys

import numpy as np

# The references come from transformers' own torch code: no kernels fetched from the Hub (Qwen3-Next's delta rule
# and causal conv1d; fla and causal-conv1d are not installed beside it either).
os.environ.setdefault("USE_HUB_KERNELS", "NO")

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors import safe_open
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

try:  # transformers >= 4.57
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
except ImportError:
    Qwen3NextConfig = Qwen3NextForCausalLM = None

SEED = 1234
VOCAB = 256
PROMPT = [1, 17, 42, 99, 3, 250, 128, 64, 7, 200, 31, 5]
NEW_TOKENS = 8

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=3,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    max_position_embeddings=512,
    hidden_act="silu",
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    use_cache=True,
)


def _rope(cls, theta):
    """Rope kwargs in whichever form this transformers' config class takes."""
    fields = set(inspect.signature(cls.__init__).parameters) | set(getattr(cls, "__dataclass_fields__", {}))
    if "rope_parameters" in fields:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": float(theta)}}
    return {"rope_theta": float(theta)}


def _qwen3(**kw):
    base = dict(
        COMMON,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
        attention_bias=False,
        use_sliding_window=False,
        sliding_window=None,
    )
    theta = kw.pop("theta", 1000000.0)
    base.update(_rope(Qwen3MoeConfig, theta))
    base.update(kw)
    return Qwen3MoeConfig(**base), Qwen3MoeForCausalLM


def _qwen2(**kw):
    base = dict(
        COMMON,
        intermediate_size=96,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
        use_sliding_window=False,
        sliding_window=None,
        qkv_bias=True,
    )
    theta = kw.pop("theta", 1000000.0)
    base.update(_rope(Qwen2MoeConfig, theta))
    base.update(kw)
    return Qwen2MoeConfig(**base), Qwen2MoeForCausalLM


def _mixtral(**kw):
    base = dict(
        COMMON,
        intermediate_size=48,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=None,
        tie_word_embeddings=False,
        router_jitter_noise=0.0,
    )
    theta = kw.pop("theta", 1000000.0)
    base.update(_rope(MixtralConfig, theta))
    base.update(kw)
    return MixtralConfig(**base), MixtralForCausalLM


# The DeepSeek miniatures' shared geometry: MLA sizes all different, 8 experts in 4 groups of which 2 are kept,
# top-3, one dense first layer.
DEEPSEEK_MINIATURE = dict(
    COMMON,
    num_attention_heads=4,
    num_key_value_heads=4,
    intermediate_size=96,
    moe_intermediate_size=64,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    kv_lora_rank=24,
    qk_nope_head_dim=12,
    qk_rope_head_dim=8,
    v_head_dim=20,
    tie_word_embeddings=False,
    attention_bias=False,
)
del DEEPSEEK_MINIATURE["head_dim"]


def _deepseek_v3(**kw):
    """DeepSeek-V3 geometry in miniature: MLA (q and kv low rank, decoupled rope), YaRN with DeepSeek-V3's mscale
    keys, one dense first layer, grouped sigmoid routing (4 groups, 2 kept) with a non-zero correction bias."""
    base = dict(DEEPSEEK_MINIATURE, n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                q_lora_rank=40, rope_interleave=True, max_position_embeddings=5120)
    rope = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, mscale=1.0, mscale_all_dim=1.0,
                beta_fast=32, beta_slow=1, original_max_position_embeddings=128)
    rope.update(kw.pop("rope", {}))
    base["rope_parameters"] = rope
    base.update(kw)
    return DeepseekV3Config(**base), DeepseekV3ForCausalLM


def _deepseek_v2(**kw):
    """DeepSeek-V2-Lite in miniature: MLA with one q_proj (q_lora_rank null), complex (interleaved) rope, softmax
    router with group-limited greedy top-k (4 groups, 2 kept: group limiting excludes experts), scaled weights,
    shared experts, one dense first layer."""
    base = dict(DEEPSEEK_MINIATURE, n_shared_experts=2, topk_method="group_limited_greedy", norm_topk_prob=False,
                routed_scaling_factor=1.7, q_lora_rank=None)
    base["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    base.update(kw)
    return DeepseekV2Config(**base), DeepseekV2ForCausalLM


def _glm4_moe(**kw):
    """GLM-4.5 in miniature: GQA with q/k/v biases, QK norm, partial rotary 0.5, V3's sigmoid router with a
    correction bias (4 groups, 2 kept), a shared expert, one dense first layer."""
    base = dict(
        COMMON,
        intermediate_size=96,
        moe_intermediate_size=64,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        attention_bias=True,
        use_qk_norm=True,
        tie_word_embeddings=False,
    )
    base["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    base.update(kw)
    return Glm4MoeConfig(**base), Glm4MoeForCausalLM


def _qwen3_next(**kw):
    """Qwen3-Next in miniature: three Gated DeltaNet layers then one gated full-attention layer (the 3:1 pattern),
    two value heads per key head and key/value head dims that differ (so a transposed state shows), partial rotary
    0.25, 8 experts top-2 and a gated shared expert on every layer."""
    base = dict(
        COMMON,
        num_hidden_layers=4,
        intermediate_size=96,
        moe_intermediate_size=64,  # two blocks of 32 rows: a split over 2 nodes
        shared_expert_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
        attention_bias=False,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        full_attention_interval=4,
    )
    base["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    base.update(kw)
    return Qwen3NextConfig(**base), Qwen3NextForCausalLM


# hidden 256, heads of 128, experts and the shared expert of 256 rows: every matrix's rows whole super-blocks
QUANTISABLE = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128, intermediate_size=256,
                   moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2, initializer_range=0.03)
SHARED = dict(shared_expert_intermediate_size=256)
# the DeepSeek and GLM miniatures' own names: 4 routed experts in 2 groups of which 1 is kept, one shared expert
GROUPED_QUANTISABLE = dict({k: v for k, v in QUANTISABLE.items() if k != "num_experts"}, n_routed_experts=4,
                           n_group=2, topk_group=1, num_hidden_layers=2)
# MLA with every row length a multiple of 256 (q_b's and kv_a's: the ranks; o_proj's: 2 heads x 128)
MLA_QUANTISABLE = dict({k: v for k, v in GROUPED_QUANTISABLE.items() if k != "head_dim"}, num_key_value_heads=2,
                       q_lora_rank=256, kv_lora_rank=256, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)

# Non-zero e_score_correction_bias per MoE layer (transformers initialises it to zeros), set after init.
BIAS_STD = {"deepseek_v3_basic": 0.3, "deepseek_v3_no_q_lora": 0.3, "glm4_moe_basic": 0.3, "glm4_moe_quant": 0.3,
            "deepseek_v3_quant": 0.3}


# name -> (builder, save dtype, max_shard_size)
CASES = {
    "qwen3_moe_basic": (lambda: _qwen3(), torch.float32, None),
    "qwen3_moe_dense_mix": (
        lambda: _qwen3(
            num_hidden_layers=4,
            mlp_only_layers=[0],
            decoder_sparse_step=2,
            norm_topk_prob=False,
            tie_word_embeddings=True,
        ),
        torch.float32,
        None,
    ),
    "qwen3_moe_bf16_sharded": (lambda: _qwen3(), torch.bfloat16, "20KB"),
    "qwen3_moe_rope_theta": (
        lambda: _qwen3(theta=10000.0, max_position_embeddings=2048, num_experts_per_tok=4),
        torch.float32,
        None,
    ),
    # Same weights as qwen3_moe_rope_theta (same seed/config) but config.json in
    # the 4.x/Hub form; reference recomputed after transformers reads that form.
    "qwen3_moe_hubstyle_config": (
        lambda: _qwen3(theta=10000.0, max_position_embeddings=2048, num_experts_per_tok=4),
        torch.float32,
        None,
    ),
    "mixtral_basic": (lambda: _mixtral(), torch.float32, None),
    "mixtral_f16": (lambda: _mixtral(num_hidden_layers=4), torch.float16, None),
    "qwen2_moe_basic": (lambda: _qwen2(), torch.float32, None),
    "qwen2_moe_topk_norm": (
        lambda: _qwen2(norm_topk_prob=True, mlp_only_layers=[1], num_experts_per_tok=1),
        torch.float32,
        None,
    ),
    "deepseek_v3_basic": (lambda: _deepseek_v3(), torch.bfloat16, None),
    # q_proj instead of q_a/q_b (DeepSeek-V2-Lite's form), rope_interleave off, a YaRN attention factor != 1,
    # norm_topk_prob off
    "deepseek_v3_no_q_lora": (
        lambda: _deepseek_v3(q_lora_rank=None, num_hidden_layers=2, rope_interleave=False, norm_topk_prob=False,
                             routed_scaling_factor=1.5, rope=dict(mscale=1.0, mscale_all_dim=0.707),
                             moe_intermediate_size=96),  # 3 blocks of 32 rows: a split over 3 nodes
        torch.bfloat16,
        None,
    ),
    "deepseek_v2_lite": (lambda: _deepseek_v2(), torch.bfloat16, None),
    "glm4_moe_basic": (lambda: _glm4_moe(), torch.bfloat16, None),
    "qwen3_next_basic": (lambda: _qwen3_next(), torch.float32, None),
    # Rows of whole 256-weight super-blocks in every matrix, so llama-quantize's K types and IQ4_XS take every one
    # of them with no fallback type (tools/gguf_quant_fixtures.py; the safetensors are not committed, the
    # quantised GGUF files are)
    "qwen3_next_quant": (lambda: _qwen3_next(**QUANTISABLE, **SHARED, linear_key_head_dim=128,
                                             linear_value_head_dim=128, linear_num_key_heads=1,
                                             linear_num_value_heads=2), torch.float32, None),
    "qwen2_moe_quant": (lambda: _qwen2(**QUANTISABLE, **SHARED, num_hidden_layers=2), torch.float32, None),
    "qwen3_moe_quant": (lambda: _qwen3(**QUANTISABLE, num_hidden_layers=2), torch.float32, None),
    "mixtral_quant": (lambda: _mixtral(**{k: v for k, v in QUANTISABLE.items() if k not in (
        "num_experts", "moe_intermediate_size")}, num_local_experts=4, num_hidden_layers=2), torch.float32, None),
    "glm4_moe_quant": (lambda: _glm4_moe(**GROUPED_QUANTISABLE), torch.float32, None),
    "deepseek_v3_quant": (lambda: _deepseek_v3(**MLA_QUANTISABLE), torch.float32, None),
}

# Cases whose prompt is longer than PROMPT: Qwen3-Next's is 150 tokens, more than two of the delta rule's 64-token
# chunks and more than one of the engine's prefill chunks in its test.
PROMPTS = {"qwen3_next_basic": np.random.RandomState(7).randint(0, VOCAB, 150).tolist()}

# Qwen3-Next initialises its norms to zero ((1 + weight) is applied) and its dt_bias to one: these are drawn at
# random instead, so that a norm read without the 1 or a missing dt_bias shows in the logits.
RANDOM_VECTORS = {"qwen3_next_basic": 0.2, "qwen3_next_quant": 0.2}


# Cases whose config.json is rewritten after save into the transformers-4.x /
# Hub form (top-level rope_theta, num_experts, torch_dtype) before reloading.
LEGACY_CONFIG = {"qwen3_moe_hubstyle_config"}


def _legacyfy_config(path):
    fn = os.path.join(path, "config.json")
    with open(fn) as f:
        cfg = json.load(f)
    rp = cfg.pop("rope_parameters", None)
    if rp:
        cfg["rope_theta"] = rp["rope_theta"]
        if rp.get("rope_type", "default") != "default":
            cfg["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
        else:
            cfg["rope_scaling"] = None
    if cfg.get("model_type") in ("qwen3_moe", "qwen2_moe") and "num_local_experts" in cfg:
        cfg["num_experts"] = cfg.pop("num_local_experts")
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    cfg["transformers_version"] = "4.51.0"
    with open(fn, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def _load_kw(dtype):
    # transformers 5 renamed torch_dtype -> dtype
    return {"dtype": dtype} if int(transformers.__version__.split(".")[0]) >= 5 else {"torch_dtype": dtype}


def _router_check(model, ids):
    """Return a short string describing router softmax spread per MoE layer."""
    out = []
    hooks = []

    def mk(i):
        def hook(mod, inp, outp):
            logits = outp[0] if isinstance(outp, tuple) else outp
            if hasattr(mod, "e_score_correction_bias"):  # DeepSeek: how often the group limit changed the choice
                biased = logits.float().sigmoid() + mod.e_score_correction_bias
                plain = set(map(tuple, biased.topk(mod.top_k, dim=-1)[1].sort(-1)[0].tolist()))
                chosen = outp[2].sort(-1)[0].tolist()
                changed = sum(tuple(c) not in plain for c in chosen)
                out.append(f"L{i}: group limit changed {changed}/{len(chosen)} tokens' experts")
                return
            p = torch.softmax(logits.float(), dim=-1)
            out.append(f"L{i}: max_p={p.max().item():.3f} min_p={p.min().item():.3f}")

        return hook

    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            hooks.append(gate.register_forward_hook(mk(i)))
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return "; ".join(out)


def build_case(name, out_dir, summary):
    builder, save_dtype, shard = CASES[name]
    torch.manual_seed(SEED)
    config, cls = builder()
    config._attn_implementation = "eager"
    model = cls(config).eval()
    if name in BIAS_STD:
        with torch.no_grad():
            for layer in model.model.layers:
                gate = getattr(layer.mlp, "gate", None)
                if gate is not None and hasattr(gate, "e_score_correction_bias"):
                    gate.e_score_correction_bias.normal_(0.0, BIAS_STD[name])
    if name in RANDOM_VECTORS:
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if p.ndim == 1 and not pname.endswith("A_log"):
                    p.normal_(0.0, RANDOM_VECTORS[name]).add_(1.0 if pname.endswith("dt_bias") else 0.0)
    model = model.to(save_dtype)
    path = os.path.join(out_dir, name)
    if os.path.isdir(path):
        shutil.rmtree(path)
    save_kw = {"safe_serialization": True}
    if shard:
        save_kw["max_shard_size"] = shard
    try:
        model.save_pretrained(path, **save_kw)
    except TypeError:
        save_kw.pop("safe_serialization")
        model.save_pretrained(path, **save_kw)
    del model

    # Reference from the checkpoint as saved, upcast to float32.
    if name in LEGACY_CONFIG:
        _legacyfy_config(path)
    ref, info = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", output_loading_info=True, **_load_kw(torch.float32)
    )
    ref = ref.eval()
    bad = {k: v for k, v in info.items() if v}
    assert not bad, f"{name}: reload not clean: {bad}"
    prompt = PROMPTS.get(name, PROMPT)
    ids = torch.tensor([prompt], dtype=torch.long)
    with torch.no_grad():
        logits = ref(ids).logits[0].float().numpy()
        gen = ref.generate(
            ids,
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=0,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
            use_cache=True,
        )
        new = gen.sequences[0, len(prompt):]
        assert new.numel() == NEW_TOKENS, new
        greedy_logits = torch.stack([l[0] for l in gen.logits]).float().numpy()
        full = ref(gen.sequences).logits[0].float().numpy()
    # consistency: greedy tokens are the argmax of the full-forward logits
    argmax_ok = bool(np.array_equal(full[len(prompt) - 1 : -1].argmax(-1), new.numpy()))
    kv_diff = float(np.abs(full[len(prompt) - 1 : -1] - greedy_logits).max())
    np.savez(
        os.path.join(path, "reference.npz"),
        input_ids=np.array(prompt, dtype=np.int64),
        logits=logits.astype(np.float32),
        greedy_ids=new.numpy().astype(np.int64),
        greedy_logits=greedy_logits.astype(np.float32),
        full_logits=full.astype(np.float32),
    )

    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    rope_keys = {k: cfg[k] for k in ("rope_theta", "rope_parameters", "rope_scaling") if k in cfg}
    rope_keys["_as_loaded"] = getattr(ref.config, "rope_parameters", None) or getattr(ref.config, "rope_theta", None)
    files = sorted(os.listdir(path))
    names = {}
    for fn in files:
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(path, fn), "pt") as f:
                for k in f.keys():
                    sl = f.get_slice(k)
                    names[k] = (tuple(sl.get_shape()), sl.get_dtype(), fn)
    lines = [f"== {name}"]
    lines.append(f"architectures={cfg.get('architectures')} model_type={cfg.get('model_type')} "
                 f"dtype={cfg.get('dtype', cfg.get('torch_dtype'))}")
    lines.append(f"rope keys: {json.dumps(rope_keys)}")
    lines.append("other config: " + json.dumps({k: cfg.get(k) for k in (
        "max_position_embeddings", "num_experts", "num_local_experts", "num_experts_per_tok",
        "norm_topk_prob", "decoder_sparse_step", "dtype", "torch_dtype", "mlp_only_layers", "tie_word_embeddings",
        "moe_intermediate_size", "intermediate_size", "shared_expert_intermediate_size",
        "head_dim", "qkv_bias", "attention_bias", "sliding_window", "use_sliding_window") if k in cfg}))
    lines.append(f"files: {files}")
    lines.append(f"num tensors: {len(names)}; lm_head present: {'lm_head.weight' in names}")
    lines.append("non-layer tensors:")
    for k in sorted(names):
        if ".layers." not in k:
            lines.append(f"  {k} {list(names[k][0])} {names[k][1]} ({names[k][2]})")
    for li in sorted({int(k.split(".layers.")[1].split(".")[0]) for k in names if ".layers." in k}):
        layer_keys = sorted(k for k in names if f".layers.{li}." in k)
        # print layer 0 in full; for other layers, only if structurally different from layer 0
        if li == 0 or any("experts.1." in k for k in layer_keys) != any(
            "experts.1." in k for k in names if ".layers.0." in k
        ) or (li > 0 and len(layer_keys) != len([k for k in names if ".layers.0." in k])):
            lines.append(f"layer {li} tensors:")
            for k in layer_keys:
                if ".experts." in k and not any(f".experts.{e}." in k for e in (0, 1)) and k.split(".experts.")[1][0].isdigit():
                    continue
                lines.append(f"  {k} {list(names[k][0])} {names[k][1]}")
            n_exp = len({k.split(".experts.")[1].split(".")[0] for k in layer_keys if ".experts." in k and k.split(".experts.")[1][0].isdigit()})
            if n_exp:
                lines.append(f"  (... per-expert tensors for {n_exp} experts; experts 0,1 shown)")
    lines.append(f"router spread: {_router_check(ref, ids)}")
    lines.append(f"logits: std={logits.std():.4f} min={logits.min():.4f} max={logits.max():.4f}; "
                 f"greedy_ids={new.tolist()}; greedy==argmax(full)={argmax_ok}; "
                 f"max|kvcache-full|={kv_diff:.2e}")
    summary.extend(lines + [""])
    print("\n".join(lines), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    summary = []
    for name in args.cases:
        build_case(name, args.out, summary)
    import safetensors

    versions = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "numpy": np.__version__,
        "python": sys.version.split()[0],
        "seed": SEED,
        "prompt": PROMPT,
        "new_tokens": NEW_TOKENS,
    }
    if set(args.cases) != set(CASES):  # some cases rebuilt: their versions beside them, their summary appended
        for name in args.cases:
            with open(os.path.join(args.out, name, "versions.json"), "w") as f:
                json.dump(dict(versions, prompt=PROMPTS.get(name, PROMPT)), f, indent=2)
        with open(os.path.join(args.out, "summary.txt"), "a") as f:
            f.write(f"(rebuilt alone with transformers {transformers.__version__} torch {torch.__version__})\n")
            f.write("\n".join(summary))
        return
    with open(os.path.join(args.out, "versions.json"), "w") as f:
        json.dump(versions, f, indent=2)
    with open(os.path.join(args.out, "summary.txt"), "w") as f:
        f.write(f"transformers {transformers.__version__} torch {torch.__version__}\n\n")
        f.write("\n".join(summary))


if __name__ == "__main__":
    main()
