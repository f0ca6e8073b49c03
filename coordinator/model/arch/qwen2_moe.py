"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): grouped-query attention with q, k and v biases, a softmax
top-k router, and a shared expert behind a sigmoid gate."""

from __future__ import annotations

from pathlib import Path

from shm.gguf_file import GgufFile

from .base import Draw, Family, Geometry, ModelConfig, boolean, field, swiglu
from .qwen3_moe import qwen_gguf_config, qwen_moe_config


def shared_expert_tensors(draw: Draw, g: Geometry, moe: str) -> dict:
    """A gated shared expert under ``moe``: its MLP and the gate's one row."""
    return {**swiglu(draw, f"{moe}.shared_expert", g.shared_expert_intermediate_size, g.hidden_size),
            f"{moe}.shared_expert_gate.weight": draw.mat(1, g.hidden_size)}


def qkv_biases(draw: Draw, g: Geometry, prefix: str) -> dict:
    a, hd = f"{prefix}.self_attn", g.head_dim
    return {f"{a}.{n}_proj.bias": draw.small(size) for n, size in
            (("q", g.num_heads * hd), ("k", g.num_kv_heads * hd), ("v", g.num_kv_heads * hd))}


class Qwen2Moe(Family):
    name = "qwen2_moe"
    hf_class = "Qwen2MoeForCausalLM"
    defaults = dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768, norm_topk_prob=False,
                    decoder_sparse_step=1, attention_bias=True, tie_word_embeddings=False)
    gguf_arch = "qwen2moe"

    def parse(self, cfg: dict, model_dir: Path | None) -> ModelConfig:
        return qwen_moe_config(self, cfg, model_dir, "num_experts", qkv_bias=boolean(cfg, "qkv_bias", True),
                               shared=field(cfg, "shared_expert_intermediate_size", int))

    def gguf_config(self, f: GgufFile) -> dict:
        return {**qwen_gguf_config(self, f, norm_default=False),
                "shared_expert_intermediate_size": int(f.meta("expert_shared_feed_forward_length"))}

    def hf_config(self, g: Geometry, cfg: dict) -> dict:
        return {**super().hf_config(g, cfg), "shared_expert_intermediate_size": g.shared_expert_intermediate_size}

    def attention_tensors(self, draw: Draw, g: Geometry, layer: int, prefix: str) -> dict:
        return {**super().attention_tensors(draw, g, layer, prefix), **qkv_biases(draw, g, prefix)}

    def moe_tensors(self, draw: Draw, g: Geometry, moe: str) -> dict:
        return {**super().moe_tensors(draw, g, moe), **shared_expert_tensors(draw, g, moe)}


FAMILY = Qwen2Moe()
