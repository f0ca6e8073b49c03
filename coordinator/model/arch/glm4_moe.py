"""GLM-4.5 (GLM-4.5-Air): grouped-query attention with partial rotary, q, k and v biases and an optional QK norm;
DeepSeek-V3's sigmoid router (correction bias, groups) and shared experts, dense first layers, a nextn layer
(transformers' Glm4MoeConfig)."""

from __future__ import annotations

from pathlib import Path

from shm.gguf_file import GgufError, GgufFile

from ...errors import ModelConfigError
from .base import (Draw, Family, Geometry, GroupRouter, ModelConfig, boolean, field, gqa_fields, groups,
                   head_counts, positive, rotary_dim, shared_fields, silu_only)
from .deepseek_v3 import grouped_config, grouped_moe_tensors
from .gguf import GROUPED_TENSORS, grouped_keys, no_rope_scaling
from .qwen2_moe import qkv_biases


class Glm4Moe(Family):
    name = "glm4_moe"
    hf_class = "Glm4MoeForCausalLM"
    defaults = dict(rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=131072, norm_topk_prob=True,
                    attention_bias=False, tie_word_embeddings=False, n_group=1, topk_group=1, n_shared_experts=1,
                    routed_scaling_factor=1.0, first_k_dense_replace=1, use_qk_norm=False, partial_rotary_factor=0.5)
    mtp = True
    presets = {  # zai-org/GLM-4.5-Air's config.json
        "glm-4.5-air": lambda: Geometry(vocab_size=151552, hidden_size=4096, num_layers=46, num_heads=96,
                                        num_kv_heads=8, head_dim=128, num_experts=128, top_k=8,
                                        moe_intermediate_size=1408, dense_intermediate_size=10944, n_shared_experts=1,
                                        first_k_dense_replace=1, routed_scaling_factor=1.0, partial_rotary_factor=0.5,
                                        use_qk_norm=False, norm_topk_prob=True, rope_theta=1e6, rms_norm_eps=1e-5,
                                        max_position_embeddings=131072)}
    gguf_arch = "glm4moe"
    gguf_layer_tensors = {**GROUPED_TENSORS, "post_attention_norm.weight": "post_attention_layernorm.weight"}
    gguf_nextn = True

    def gguf_config(self, f: GgufFile) -> dict:
        """GLM-4.5 as llama.cpp reads a glm4moe file (src/models/glm4-moe.cpp)."""
        cfg = grouped_keys(f)
        if f.gating("sigmoid") != "sigmoid":
            raise GgufError(f"{f.path}: metadata {f.arch}.expert_gating_func is not 2 (sigmoid): GLM-4.5's "
                            "router is sigmoid")
        heads = cfg["num_attention_heads"]
        head_dim = f.integer("attention.key_length", cfg["hidden_size"] // heads)
        rope_dim = f.integer("rope.dimension_count", head_dim // 2)
        if not 0 < rope_dim <= head_dim:
            raise GgufError(f"{f.path}: metadata {f.arch}.rope.dimension_count {rope_dim} for heads of {head_dim}")
        no_rope_scaling(f)
        cfg.update(architectures=[self.hf_class], num_key_value_heads=f.integer("attention.head_count_kv", heads),
                   head_dim=head_dim, partial_rotary_factor=rope_dim / head_dim,
                   attention_bias=f.has_layer_tensor(".attn_q.bias"),
                   use_qk_norm=f.has_layer_tensor(".attn_q_norm.weight"))
        return cfg

    def parse(self, cfg: dict, model_dir: Path | None) -> ModelConfig:
        d = self.defaults
        silu_only(cfg)
        quant = cfg.get("quantization_config")
        if isinstance(quant, dict) and quant:  # GLM-4.5's FP8 checkpoints (compressed-tensors): not read yet
            raise ModelConfigError(f"config.json: quantization_config {quant.get('quant_method')!r} is not "
                                   "supported for glm4_moe yet; use the BF16 checkpoint")
        hidden = positive(cfg, "hidden_size")
        layers = positive(cfg, "num_hidden_layers")
        heads, kv_heads = head_counts(cfg)
        head_dim = positive(cfg, "head_dim", hidden // heads)
        rotary = rotary_dim(cfg, d, head_dim)
        num_experts = positive(cfg, "n_routed_experts")
        top_k = positive(cfg, "num_experts_per_tok")
        n_group, topk_group = groups(cfg, d, num_experts, top_k)
        first_dense = field(cfg, "first_k_dense_replace", int, default=d["first_k_dense_replace"])
        moe_inter = positive(cfg, "moe_intermediate_size")
        return ModelConfig(
            arch=self.name,
            **shared_fields(cfg, d, model_dir),
            **gqa_fields(cfg, d, hidden, layers, heads, kv_heads, head_dim),
            qkv_bias=boolean(cfg, "attention_bias", d["attention_bias"]),
            qk_norm=boolean(cfg, "use_qk_norm", d["use_qk_norm"]),
            num_experts=num_experts,
            top_k=top_k,
            norm_topk_prob=boolean(cfg, "norm_topk_prob", d["norm_topk_prob"]),
            moe_intermediate_size=moe_inter,
            dense_intermediate_size=positive(cfg, "intermediate_size"),
            shared_expert_intermediate_size=moe_inter * field(cfg, "n_shared_experts", int,
                                                              default=d["n_shared_experts"]),
            sparse_layers=tuple(i >= first_dense for i in range(layers)),
            sliding_windows=(None,) * layers,
            shared_expert_gate=False,
            rotary_dim=0 if rotary == head_dim else rotary,
            group_router=GroupRouter(n_group, topk_group,
                                     field(cfg, "routed_scaling_factor", float, default=d["routed_scaling_factor"])),
        )

    def hf_config(self, g: Geometry, cfg: dict) -> dict:
        grouped_config(g, cfg)
        cfg.update(attention_bias=True, use_qk_norm=g.use_qk_norm, partial_rotary_factor=g.partial_rotary_factor)
        return cfg

    def is_sparse(self, g: Geometry, layer: int) -> bool:
        return layer >= g.dense_layers

    def attention_tensors(self, draw: Draw, g: Geometry, layer: int, prefix: str) -> dict:
        t = {**super().attention_tensors(draw, g, layer, prefix), **qkv_biases(draw, g, prefix)}
        if g.use_qk_norm:
            a = f"{prefix}.self_attn"
            t.update({f"{a}.q_norm.weight": draw.norm(g.head_dim), f"{a}.k_norm.weight": draw.norm(g.head_dim)})
        return t

    def moe_tensors(self, draw: Draw, g: Geometry, moe: str) -> dict:
        return grouped_moe_tensors(self, draw, g, moe)


FAMILY = Glm4Moe()
