"""DeepSeek-V3/R1 (Kimi-K2, Moonlight) and DeepSeek-V2 (V2-Lite, V2.5): multi-head latent attention (q in low rank,
a decoupled rope part, YaRN), a grouped router (V3: sigmoid with a correction bias, noaux_tc; V2: softmax,
greedy or group-limited), shared experts, dense first layers, and V3's multi-token-prediction (nextn) layer."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shm.fp8 import Fp8Error, block_size as fp8_block_size
from shm.gguf_checkpoint import Derived, Stored
from shm.gguf_file import GgufError, GgufFile

from ...errors import ModelConfigError
from .base import (MLA_ROPE_TYPES, Draw, Family, Geometry, GroupRouter, MLAConfig, ModelConfig, boolean, choice,
                   field, groups, positive, rope, shared_fields, silu_only, swiglu, yarn)
from .gguf import GROUPED_TENSORS, LAYER, grouped_keys, hf_names

# a deepseek2 file's layer tensors: the grouped router's, and multi-head latent attention's
GGUF_TENSORS = {
    **GROUPED_TENSORS,
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",  # older converters; newer ones split it (KvB)
}
KV_B_PARTS = ("attn_k_b.weight", "attn_v_b.weight")


@dataclass(frozen=True)
class KvB:
    """kv_b_proj [nh * (dn + dv), c], which convert_hf_to_gguf.py's DeepseekV2Model splits per head into attn_k_b
    [nh, c, dn] (the key rows, transposed) and attn_v_b [nh, dv, c]: put back together (shm's Derived)."""

    k_b: str
    v_b: str

    @property
    def parts(self) -> tuple[str, str]:
        return self.k_b, self.v_b

    def shape(self, f: GgufFile) -> tuple[int, int]:
        k_b, v_b = f.shape(self.k_b), f.shape(self.v_b)  # [nh, c, dn], [nh, dv, c]
        if len(k_b) != 3 or len(v_b) != 3 or k_b[0] != v_b[0] or k_b[1] != v_b[2]:
            raise GgufError(f"{f.path}: {self.k_b} {list(k_b)} and {self.v_b} {list(v_b)} are not [heads, "
                            "kv_lora_rank, nope] and [heads, v, kv_lora_rank]")
        return (k_b[0] * (k_b[2] + v_b[1]), k_b[1])

    def float32(self, f: GgufFile) -> np.ndarray:
        """Per head, the dn key rows (attn_k_b transposed), then the dv values."""
        shape = self.shape(f)
        k_b, v_b = f.float32(self.k_b), f.float32(self.v_b)
        return np.ascontiguousarray(np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(shape))


def split_kv_b(f: GgufFile) -> dict[str, KvB]:
    """{Hugging Face name: KvB} for each layer (the first nextn one included) whose kv_b_proj the converter split;
    a converter that wrote attn_kv_b beside the pair is read as attn_kv_b."""
    joined = {}
    for name in f.tensors:
        m = LAYER.match(name)
        if m is None or m[2] != KV_B_PARTS[0] or f"blk.{m[1]}.attn_kv_b.weight" in f.tensors:
            continue
        v_name = f"blk.{m[1]}.{KV_B_PARTS[1]}"
        if v_name not in f.tensors:
            raise GgufError(f"{f.tensors[name][0]}: tensor {name} without {v_name}: kv_b_proj cannot be put back "
                            "together")
        if int(m[1]) <= f.num_layers:  # a second nextn layer's is not read
            joined[f"model.layers.{m[1]}.self_attn.kv_b_proj.weight"] = KvB(name, v_name)
    return joined


def yarn_keys(f: GgufFile) -> dict:
    """rope_scaling for a deepseek2 file's YaRN, as llama.cpp applies it."""
    factor = float(f.meta("rope.scaling.factor"))
    rope = {"rope_type": "yarn", "factor": factor,
            "original_max_position_embeddings": f.integer("rope.scaling.original_context_length"),
            "beta_fast": float(f.meta("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(f.meta("rope.scaling.yarn_beta_slow", 1.0))}
    log_mul = f.meta("rope.scaling.yarn_log_multiplier", None)
    if log_mul:  # 0.1 x mscale_all_dim; llama.cpp takes mscale = mscale_all_dim for deepseek2
        m_all = float(str(np.float32(float(log_mul) / 0.1)))  # 0.707, as config.json had it
        rope.update(mscale=m_all, mscale_all_dim=m_all)
    else:  # llama.cpp: cos and sin x mscale(factor), and the softmax scale x mscale(factor)^2
        rope.update(mscale_all_dim=1.0, attention_factor=0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return rope


def router_keys(f: GgufFile, norm_topk_prob: bool) -> dict:
    """V3's sigmoid router or V2's softmax one, by expert_gating_func (absent: softmax, as llama.cpp reads
    DeepSeek-V2 files)."""
    scoring = f.gating("softmax")
    if scoring == "sigmoid":
        return {"architectures": ["DeepseekV3ForCausalLM"], "scoring_func": scoring, "topk_method": "noaux_tc"}
    if f.has_layer_tensor(".exp_probs_b.bias"):
        raise GgufError(f"{f.path}: a softmax router (expert_gating_func 1 or absent) with a correction bias "
                        "(exp_probs_b): no DeepSeek-V2 model has one; not supported")
    if norm_topk_prob:
        raise GgufError(f"{f.path}: metadata {f.arch}.expert_weights_norm true with a softmax router (DeepSeek-V2 "
                        "never normalises its top-k weights): not supported")
    # groups scored by their best expert (transformers' DeepseekV2 group_limited_greedy)
    method = "group_limited_greedy" if f.integer("expert_group_count", 1) > 1 else "greedy"
    return {"architectures": ["DeepseekV2ForCausalLM"], "scoring_func": scoring, "topk_method": method}


def mla_keys(f: GgufFile) -> dict:
    """Multi-head latent attention's sizes. Newer converters write the head sizes as *_mla (key_length then is
    kv_lora_rank + rope: the absorbed form's); older ones as key_length and value_length themselves."""
    kv_lora = f.integer("attention.kv_lora_rank")
    rope_dim = f.integer("rope.dimension_count")
    k_len = f.integer("attention.key_length_mla" if f.holds("attention.key_length_mla") else "attention.key_length")
    v_len = f.integer("attention.value_length_mla" if f.holds("attention.value_length_mla")
                      else "attention.value_length")
    if k_len <= rope_dim:
        raise GgufError(f"{f.path}: metadata {f.arch}.attention.key_length(_mla) {k_len} is not more than "
                        f"{f.arch}.rope.dimension_count {rope_dim}")
    q_lora = f.meta("attention.q_lora_rank", None)
    return dict(kv_lora_rank=kv_lora, qk_rope_head_dim=rope_dim, qk_nope_head_dim=k_len - rope_dim, v_head_dim=v_len,
                q_lora_rank=None if not q_lora else f.integer("attention.q_lora_rank"),
                rope_interleave=True)  # llama.cpp ropes deepseek2 on adjacent pairs (LLAMA_ROPE_TYPE_NORM)


def grouped_config(g: Geometry, cfg: dict) -> dict:
    """The sigmoid-router families' config.json keys (DeepSeek-V3's, GLM-4.5's): groups, shared experts, dense first
    layers, the nextn layers."""
    cfg.update(n_routed_experts=g.num_experts, moe_intermediate_size=g.moe_intermediate_size,
               intermediate_size=g.dense_intermediate_size, n_group=g.n_group, topk_group=g.topk_group,
               routed_scaling_factor=g.routed_scaling_factor, n_shared_experts=g.n_shared_experts,
               first_k_dense_replace=g.dense_layers, norm_topk_prob=g.norm_topk_prob is not False,
               num_nextn_predict_layers=g.num_nextn_predict_layers)
    return cfg


def grouped_moe_tensors(family: Family, draw: Draw, g: Geometry, moe: str) -> dict:
    """The router, its correction bias, the routed experts and the shared experts (n_shared_experts of
    moe_intermediate_size, one MLP)."""
    t = Family.moe_tensors(family, draw, g, moe)
    t[f"{moe}.gate.e_score_correction_bias"] = draw.small(g.num_experts)
    t.update(swiglu(draw, f"{moe}.shared_experts", g.moe_intermediate_size * g.n_shared_experts, g.hidden_size))
    return t


def mla_shapes(g: Geometry) -> dict[str, tuple[int, ...]]:
    """The MLA attention's tensors (self_attn.NAME.weight) and their shapes."""
    H, nh, qk = g.hidden_size, g.num_heads, g.qk_nope_head_dim + g.qk_rope_head_dim
    q = ({"q_a_proj": (g.q_lora_rank, H), "q_a_layernorm": (g.q_lora_rank,), "q_b_proj": (nh * qk, g.q_lora_rank)}
         if g.q_lora_rank else {"q_proj": (nh * qk, H)})
    return {**q, "kv_a_proj_with_mqa": (g.kv_lora_rank + g.qk_rope_head_dim, H),
            "kv_a_layernorm": (g.kv_lora_rank,),
            "kv_b_proj": (nh * (g.qk_nope_head_dim + g.v_head_dim), g.kv_lora_rank), "o_proj": (H, nh * g.v_head_dim)}


class DeepseekV3(Family):
    name = "deepseek_v3"
    hf_class = "DeepseekV3ForCausalLM"
    defaults = dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096, norm_topk_prob=True,
                    attention_bias=False, tie_word_embeddings=False, n_group=8, topk_group=4, n_shared_experts=1,
                    routed_scaling_factor=2.5, first_k_dense_replace=3, moe_layer_freq=1, q_lora_rank=1536,
                    rope_interleave=True)
    scoring_funcs = ("sigmoid",)  # config.json's scoring_func
    topk_methods = ("noaux_tc",)  # its topk_method
    mtp = True
    presets = {
        # deepseek-ai/DeepSeek-V3's config.json (BF16 weights; one MoE layer is 256 x 3 x 7168 x 2048: 22.5 GB)
        "deepseek-v3": lambda: Geometry(vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128,
                                        num_kv_heads=128, head_dim=192, num_experts=256, top_k=8,
                                        moe_intermediate_size=2048, dense_intermediate_size=18432, n_group=8,
                                        topk_group=4, routed_scaling_factor=2.5, n_shared_experts=1,
                                        first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512,
                                        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, yarn_factor=40.0,
                                        yarn_original_max_position_embeddings=4096, norm_topk_prob=True,
                                        rope_theta=10000.0, max_position_embeddings=163840)}
    gguf_arch = "deepseek2"  # DeepSeek-V2/V2-Lite/V3/R1, Kimi-K2: V3 or V2 by the gating function
    gguf_layer_tensors = GGUF_TENSORS
    gguf_nextn = True

    def gguf_config(self, f: GgufFile) -> dict:
        """DeepSeek-V2/V3 as llama.cpp reads a deepseek2 file (src/models/deepseek2.cpp, llama-context.cpp)."""
        cfg = grouped_keys(f)
        cfg.update(router_keys(f, cfg["norm_topk_prob"]), moe_layer_freq=1, **mla_keys(f))
        f.refuse("attention.temperature_scale", "attention temperature tuning (Mistral-Large) is not supported")
        f.refuse("rope.scaling.attn_factor", "a rope attention factor is not supported")
        f.refuse("rope.scaling.yarn_ext_factor", "a YaRN extrapolation factor is not supported")
        scaling = f.meta("rope.scaling.type", "none")
        if scaling == "yarn":
            cfg["rope_scaling"] = yarn_keys(f)
        elif scaling == "linear":
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(f.meta("rope.scaling.factor"))}
        elif scaling not in ("none", None):
            raise GgufError(f"{f.path}: metadata {f.arch}.rope.scaling.type {scaling!r} is not supported "
                            "(none, linear, yarn)")
        return cfg

    def gguf_names(self, f: GgufFile) -> dict[str, Stored | Derived]:
        """Its names, kv_b_proj put back together where the converter split it."""
        return {**hf_names(f, self.gguf_layer_tensors, nextn=True, skip=frozenset(KV_B_PARTS)), **split_kv_b(f)}

    def parse(self, cfg: dict, model_dir: Path | None) -> ModelConfig:
        """DeepSeek-V3's config.json (the Hub's remote-code form and transformers 5's DeepseekV3Config alike)."""
        d, arch = self.defaults, self.name
        silu_only(cfg)
        scoring = choice(cfg, "scoring_func", arch, self.scoring_funcs)
        greedy = choice(cfg, "topk_method", arch, self.topk_methods) == "greedy"
        try:  # FP8 block-scaled weights (DeepSeek-V3/R1): read and dequantised by shm/checkpoint.py
            fp8_block_size(cfg.get("quantization_config"))
        except Fp8Error as exc:
            raise ModelConfigError(str(exc)) from None
        if boolean(cfg, "attention_bias", d["attention_bias"]):
            raise ModelConfigError(f"config.json: attention_bias true is not supported for {arch} (no DeepSeek "
                                   "checkpoint has it)")
        hidden = positive(cfg, "hidden_size")
        layers = positive(cfg, "num_hidden_layers")
        heads = positive(cfg, "num_attention_heads")
        q_lora_rank = cfg.get("q_lora_rank", d["q_lora_rank"])
        if q_lora_rank is not None:
            q_lora_rank = positive(cfg, "q_lora_rank")
        kv_lora_rank = positive(cfg, "kv_lora_rank")
        nope = positive(cfg, "qk_nope_head_dim")
        rope_dim = positive(cfg, "qk_rope_head_dim")
        v_dim = positive(cfg, "v_head_dim")
        if rope_dim % 2:
            raise ModelConfigError(f"config.json: qk_rope_head_dim {rope_dim} must be even")
        num_experts = positive(cfg, "n_routed_experts")
        top_k = positive(cfg, "num_experts_per_tok")
        n_group, topk_group = (1, 1) if greedy else groups(cfg, d, num_experts, top_k)  # plain top-k: no groups
        scaling = field(cfg, "routed_scaling_factor", float, default=d["routed_scaling_factor"])
        shared = field(cfg, "n_shared_experts", int, default=d["n_shared_experts"])
        first_dense = field(cfg, "first_k_dense_replace", int, default=d["first_k_dense_replace"])
        freq = positive(cfg, "moe_layer_freq", d["moe_layer_freq"])
        max_pos = field(cfg, "max_position_embeddings", int, default=d["max_position_embeddings"])
        theta, rope_type, factor = rope(cfg, d["rope_theta"], MLA_ROPE_TYPES)
        softmax_scale = (nope + rope_dim) ** -0.5
        yarn_config = None
        if rope_type == "yarn":
            yarn_config, all_dim = yarn(cfg, max_pos)
            softmax_scale *= all_dim
            factor = 1.0
        moe_inter = positive(cfg, "moe_intermediate_size")
        return ModelConfig(
            arch=arch,
            **shared_fields(cfg, d, model_dir),
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=nope + rope_dim,
            rope_theta=theta,
            rope_type=rope_type,
            rope_factor=factor,
            max_position_embeddings=max_pos,
            qkv_bias=False,
            qk_norm=False,
            num_experts=num_experts,
            top_k=top_k,
            norm_topk_prob=boolean(cfg, "norm_topk_prob", d["norm_topk_prob"]) and self.renormalises,
            moe_intermediate_size=moe_inter,
            dense_intermediate_size=positive(cfg, "intermediate_size"),
            shared_expert_intermediate_size=moe_inter * shared,
            sparse_layers=tuple(i >= first_dense and i % freq == 0 for i in range(layers)),
            sliding_windows=(None,) * layers,
            shared_expert_gate=False,
            mla=MLAConfig(q_lora_rank, kv_lora_rank, nope, rope_dim, v_dim,
                          boolean(cfg, "rope_interleave", d["rope_interleave"]) or self.always_interleaved,
                          softmax_scale),
            yarn=yarn_config,
            group_router=GroupRouter(n_group, topk_group, scaling, scoring),
        )

    renormalises = True  # norm_topk_prob is read (DeepseekV2TopkRouter reads none)
    always_interleaved = False  # rope on adjacent pairs whatever rope_interleave says (DeepSeek-V2's)

    def hf_config(self, g: Geometry, cfg: dict) -> dict:
        grouped_config(g, cfg)
        del cfg["head_dim"]
        cfg.update(num_key_value_heads=g.num_heads, q_lora_rank=g.q_lora_rank, kv_lora_rank=g.kv_lora_rank,
                   qk_nope_head_dim=g.qk_nope_head_dim, qk_rope_head_dim=g.qk_rope_head_dim,
                   v_head_dim=g.v_head_dim, topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1,
                   attention_bias=False)
        if g.yarn_factor is not None:
            cfg["rope_scaling"] = {"type": "yarn", "factor": g.yarn_factor, "beta_fast": 32, "beta_slow": 1,
                                   "mscale": 1.0, "mscale_all_dim": 1.0,
                                   "original_max_position_embeddings": g.yarn_original_max_position_embeddings}
        return cfg

    def is_sparse(self, g: Geometry, layer: int) -> bool:
        return layer >= g.dense_layers

    def attention_tensors(self, draw: Draw, g: Geometry, layer: int, prefix: str) -> dict:
        return {f"{prefix}.self_attn.{n}.weight": draw.mat(*shape) if len(shape) == 2 else draw.norm(shape[0])
                for n, shape in mla_shapes(g).items()}

    def moe_tensors(self, draw: Draw, g: Geometry, moe: str) -> dict:
        return grouped_moe_tensors(self, draw, g, moe)

    def mtp_tensors(self, draw: Draw, g: Geometry, t: dict, layer: int) -> dict:
        """Its nextn module, and the copies of the embedding and head DeepSeek-V3's checkpoint stores beside it."""
        p = f"model.layers.{layer}"
        return {**super().mtp_tensors(draw, g, t, layer), f"{p}.embed_tokens.weight": t["model.embed_tokens.weight"],
                f"{p}.shared_head.head.weight": t.get("lm_head.weight", t["model.embed_tokens.weight"])}


class DeepseekV2(DeepseekV3):
    name = "deepseek_v2"
    hf_class = "DeepseekV2ForCausalLM"
    # DeepseekV2Config: norm_topk_prob is not read by transformers' DeepseekV2TopkRouter; rope always interleaved
    defaults = dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048, norm_topk_prob=False,
                    attention_bias=False, tie_word_embeddings=False, n_group=1, topk_group=1, n_shared_experts=2,
                    routed_scaling_factor=1.0, first_k_dense_replace=0, moe_layer_freq=1, q_lora_rank=1536,
                    rope_interleave=True)
    scoring_funcs = ("softmax",)
    topk_methods = ("greedy", "group_limited_greedy")
    gguf_arch = ""  # a deepseek2 file is read by DeepseekV3, whose config names V2 where its router is V2's
    mtp = False
    renormalises = False
    always_interleaved = True
    presets = {}
    makeable = False  # make-model writes V3's router keys


FAMILIES = (DeepseekV3(), DeepseekV2())
