"""Mixtral (8x7B, 8x22B): grouped-query attention, every layer a softmax top-k MoE block (block_sparse_moe, its
experts' w1, w3, w2), an optional sliding window on every layer."""

from __future__ import annotations

from pathlib import Path

from shm.gguf_checkpoint import Derived, Stored
from shm.gguf_file import GgufError, GgufFile

from .base import (Family, Geometry, ModelConfig, check_top_k, field, gqa_fields, gqa_geometry, shared_fields,
                   silu_only, sliding_windows, boolean)
from .gguf import LAYER_TENSORS, gqa_keys, hf_names

# a llama file's names: block_sparse_moe's router and experts, and no dense MLP
GGUF_TENSORS = {**{k: v for k, v in LAYER_TENSORS.items() if k != "ffn_gate.weight"},
                "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
                "ffn_gate_exps.weight": "block_sparse_moe.experts.gate_proj",
                "ffn_up_exps.weight": "block_sparse_moe.experts.up_proj",
                "ffn_down_exps.weight": "block_sparse_moe.experts.down_proj"}


def with_experts(f: GgufFile) -> GgufFile:
    """The file, where it is a MoE model: a llama file of experts (llama.expert_count) is a Mixtral."""
    if not f.meta("expert_count", 0):
        raise GgufError(f"{f.path}: a llama model without experts (llama.expert_count): not a MoE model")
    return f


class Mixtral(Family):
    name = "mixtral"
    hf_class = "MixtralForCausalLM"
    defaults = dict(rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=4096 * 32, norm_topk_prob=True,
                    decoder_sparse_step=1, attention_bias=False, tie_word_embeddings=False)
    moe_block = "block_sparse_moe"
    expert_names = ("w1", "w3", "w2")
    presets = {"mixtral-8x7b": lambda: Geometry(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32,
                                                num_kv_heads=8, head_dim=128, num_experts=8, top_k=2,
                                                moe_intermediate_size=14336, rms_norm_eps=1e-5,
                                                max_position_embeddings=32768)}
    gguf_arch = "llama"  # with experts
    gguf_layer_tensors = GGUF_TENSORS

    def parse(self, cfg: dict, model_dir: Path | None) -> ModelConfig:
        d = self.defaults
        silu_only(cfg)
        hidden, layers, heads, kv_heads, head_dim = gqa_geometry(cfg)
        num_experts = field(cfg, "num_local_experts", int)
        inter = field(cfg, "intermediate_size", int)
        top_k = field(cfg, "num_experts_per_tok", int)
        check_top_k(top_k, num_experts)
        return ModelConfig(
            arch=self.name,
            **shared_fields(cfg, d, model_dir),
            **gqa_fields(cfg, d, hidden, layers, heads, kv_heads, head_dim),
            qkv_bias=boolean(cfg, "attention_bias", d["attention_bias"]),
            qk_norm=False,
            num_experts=num_experts,
            top_k=top_k,
            norm_topk_prob=True,
            moe_intermediate_size=inter,
            dense_intermediate_size=inter,
            shared_expert_intermediate_size=0,
            sparse_layers=(True,) * layers,
            sliding_windows=sliding_windows(cfg, layers, every_layer=True),
        )

    def gguf_config(self, f: GgufFile) -> dict:
        cfg = gqa_keys(with_experts(f), self.hf_class)  # the experts' size is the feed-forward length
        cfg["num_local_experts"] = cfg.pop("num_experts")
        cfg["intermediate_size"] = int(f.meta("feed_forward_length"))
        return cfg

    def gguf_names(self, f: GgufFile) -> dict[str, Stored | Derived]:
        """Its names, q's and k's rows read back in Hugging Face's order: the converter permuted them per head
        (LlamaModel.permute)."""
        names = hf_names(with_experts(f), self.gguf_layer_tensors)
        heads = int(f.meta("attention.head_count"))
        kv_heads = int(f.meta("attention.head_count_kv", heads))
        for hf, src in names.items():
            for suffix, n in ((".attn_q.weight", heads), (".attn_k.weight", kv_heads)):
                if src.name.endswith(suffix):
                    names[hf] = Stored(src.name, n)
        return names

    def hf_config(self, g: Geometry, cfg: dict) -> dict:
        cfg.update(num_local_experts=g.num_experts, intermediate_size=g.moe_intermediate_size, sliding_window=None,
                   router_aux_loss_coef=0.02)
        return cfg

    def is_sparse(self, g: Geometry, layer: int) -> bool:
        return True


FAMILY = Mixtral()
