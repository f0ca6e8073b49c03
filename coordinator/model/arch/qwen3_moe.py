"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): grouped-query attention with per-head q and k norms, a softmax
top-k router over its experts, no shared expert."""

from __future__ import annotations

from pathlib import Path

from shm.gguf_file import GgufFile

from ...errors import ModelConfigError
from .base import (Draw, Family, Geometry, ModelConfig, boolean, check_top_k, field, gqa_fields, gqa_geometry,
                   shared_fields, silu_only, sliding_windows, sparse_by_step)
from .gguf import gqa_keys


def qwen_moe_config(family: Family, cfg: dict, model_dir: Path | None, experts_key: str, *, shared: int = 0,
                    qkv_bias: bool = False, qk_norm: bool = False) -> ModelConfig:
    """A Qwen-style MoE config.json (Qwen3-MoE's, Qwen2-MoE's): grouped-query attention, ``experts_key``'s routed
    experts of moe_intermediate_size, dense layers of intermediate_size by decoder_sparse_step and
    mlp_only_layers, ``shared``: the shared expert's size (0: none)."""
    d = family.defaults
    silu_only(cfg)
    hidden, layers, heads, kv_heads, head_dim = gqa_geometry(cfg)
    num_experts = field(cfg, experts_key, int)
    top_k = field(cfg, "num_experts_per_tok", int)
    check_top_k(top_k, num_experts)
    return ModelConfig(
        arch=family.name,
        **shared_fields(cfg, d, model_dir),
        **gqa_fields(cfg, d, hidden, layers, heads, kv_heads, head_dim),
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        num_experts=num_experts,
        top_k=top_k,
        norm_topk_prob=boolean(cfg, "norm_topk_prob", d["norm_topk_prob"]),
        moe_intermediate_size=field(cfg, "moe_intermediate_size", int),
        dense_intermediate_size=field(cfg, "intermediate_size", int),
        shared_expert_intermediate_size=shared,
        sparse_layers=sparse_by_step(cfg, d, layers),
        sliding_windows=sliding_windows(cfg, layers),
    )


def qwen_gguf_config(family: Family, f: GgufFile, norm_default: bool) -> dict:
    """A Qwen-style MoE GGUF file's keys; ``norm_default``: whether llama.cpp renormalises the top-k weights where
    the file does not say (expert_weights_norm)."""
    cfg = gqa_keys(f, family.hf_class)
    cfg["moe_intermediate_size"] = int(f.meta("expert_feed_forward_length"))
    cfg["intermediate_size"] = int(f.meta("feed_forward_length", cfg["moe_intermediate_size"]))
    cfg["norm_topk_prob"] = bool(f.meta("expert_weights_norm", norm_default))
    return cfg


class Qwen3Moe(Family):
    name = "qwen3_moe"
    hf_class = "Qwen3MoeForCausalLM"
    defaults = dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768, norm_topk_prob=False,
                    decoder_sparse_step=1, attention_bias=False, tie_word_embeddings=False)
    made_norm_topk_prob = True
    presets = {"qwen3-30b-a3b": lambda: Geometry(vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32,
                                                 num_kv_heads=4, head_dim=128, num_experts=128, top_k=8,
                                                 moe_intermediate_size=768, dense_intermediate_size=6144,
                                                 rope_theta=1e6, max_position_embeddings=40960)}
    gguf_arch = "qwen3moe"

    def parse(self, cfg: dict, model_dir: Path | None) -> ModelConfig:
        if cfg.get("num_experts") is None and cfg.get("num_local_experts") is None:
            raise ModelConfigError("config.json: missing required field 'num_experts' (transformers 5 writes "
                                   "'num_local_experts')")
        key = "num_local_experts" if cfg.get("num_experts") is None else "num_experts"  # transformers 5's name
        return qwen_moe_config(self, cfg, model_dir, key, qk_norm=True,
                               qkv_bias=boolean(cfg, "attention_bias", self.defaults["attention_bias"]))

    def gguf_config(self, f: GgufFile) -> dict:
        return qwen_gguf_config(self, f, norm_default=True)

    def hf_config(self, g: Geometry, cfg: dict) -> dict:
        return {**super().hf_config(g, cfg), "attention_bias": False}

    def attention_tensors(self, draw: Draw, g: Geometry, layer: int, prefix: str) -> dict:
        a = f"{prefix}.self_attn"
        return {**super().attention_tensors(draw, g, layer, prefix), f"{a}.q_norm.weight": draw.norm(g.head_dim),
                f"{a}.k_norm.weight": draw.norm(g.head_dim)}


FAMILY = Qwen3Moe()
