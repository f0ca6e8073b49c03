"""DeepSeek-V3/R1 (Kimi-K2, Moonlight) and DeepSeek-V2 (V2-Lite, V2.5): multi-head latent attention (q in low rank,
a decoupled rope part, YaRN), a grouped router (V3: sigmoid with a correction bias, noaux_tc; V2: softmax,
greedy or group-limited), shared experts, dense first layers, and V3's multi-token-prediction (nextn) layer."""

from __future__ import annotations

from pathlib import Path

from shm.fp8 import Fp8Error, block_size as fp8_block_size

from ...errors import ModelConfigError
from .base import (MLA_ROPE_TYPES, Draw, Family, Geometry, GroupRouter, MLAConfig, ModelConfig, boolean, choice,
                   field, groups, positive, rope, shared_fields, silu_only, swiglu, yarn)


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
    mtp = False
    renormalises = False
    always_interleaved = True
    presets = {}
    makeable = False  # make-model writes V3's router keys


FAMILIES = (DeepseekV3(), DeepseekV2())
