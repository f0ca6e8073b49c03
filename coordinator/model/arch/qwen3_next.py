"""Qwen3-Next (Qwen3-Next-80B-A3B): three Gated DeltaNet layers to one gated attention layer (layer_types or
full_attention_interval), Qwen3-MoE's router with Qwen2-MoE's sigmoid-gated shared expert, RMSNorms that multiply by
(1 + weight), and an MTP layer of its own names (mtp.fc, mtp.layers.0) (transformers' Qwen3NextConfig)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from shm.gguf_file import GgufError, GgufFile

from ...errors import ModelConfigError
from .base import (Draw, Family, Geometry, LinearAttnConfig, ModelConfig, MtpNames, boolean, field, gqa_fields,
                   head_counts, positive, rotary_dim, shared_fields, silu_only, sparse_by_step)
from .gguf import LAYER_TENSORS, no_rope_scaling, shared_keys
from .qwen2_moe import shared_expert_tensors

# Qwen3NextModel's converter writes in_proj_qkvz as attn_qkv (q, k, v rows, each grouped by head) and attn_gate (z),
# -exp(A_log) as ssm_a, conv1d squeezed to [C, K], and its RMSNorms' weights plus 1 (gguf_config says so:
# norms_hold_one_plus_weight); the names below are the engine's for those forms (model/weights.py reads them)
GGUF_TENSORS = {
    **LAYER_TENSORS,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_a": "linear_attn.A_neg",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}


def linear_attention_keys(f: GgufFile, num_layers: int) -> dict:
    """The Gated DeltaNet geometry from the ssm keys, and the layers' kinds from attention.recurrent_layers (or
    full_attention_interval)."""
    value_heads = f.integer("ssm.time_step_rank")
    inner = f.integer("ssm.inner_size")
    if inner % value_heads:
        raise GgufError(f"{f.path}: metadata {f.arch}.ssm.inner_size {inner} over ssm.time_step_rank {value_heads} "
                        "does not fit")
    recurrent = f.meta("attention.recurrent_layers", None)
    if recurrent is None:
        interval = f.integer("full_attention_interval", 4)
        recurrent = [(i + 1) % interval != 0 for i in range(num_layers)]
    return {"linear_conv_kernel_dim": f.integer("ssm.conv_kernel"), "linear_key_head_dim": f.integer("ssm.state_size"),
            "linear_num_key_heads": f.integer("ssm.group_count"), "linear_num_value_heads": value_heads,
            "linear_value_head_dim": inner // value_heads,
            "layer_types": ["linear_attention" if r else "full_attention" for r in list(recurrent)[:num_layers]]}


def linear_shapes(g: Geometry) -> dict[str, tuple[int, ...]]:
    """The Gated DeltaNet tensors (linear_attn.NAME) and their shapes."""
    H, hk, hv = g.hidden_size, g.linear_num_key_heads, g.linear_num_value_heads
    key, value = hk * g.linear_key_head_dim, hv * g.linear_value_head_dim
    return {"in_proj_qkvz.weight": (2 * key + 2 * value, H), "in_proj_ba.weight": (2 * hv, H),
            "conv1d.weight": (2 * key + value, 1, g.linear_conv_kernel_dim), "dt_bias": (hv,), "A_log": (hv,),
            "norm.weight": (g.linear_value_head_dim,), "out_proj.weight": (H, value)}


class Qwen3Next(Family):
    name = "qwen3_next"
    hf_class = "Qwen3NextForCausalLM"
    defaults = dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768, norm_topk_prob=True,
                    decoder_sparse_step=1, attention_bias=False, tie_word_embeddings=False, head_dim=256,
                    partial_rotary_factor=0.25, full_attention_interval=4, linear_conv_kernel_dim=4,
                    linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                    linear_num_value_heads=32, shared_expert_intermediate_size=512)
    mtp = True
    mtp_chains_normed = True
    norm_centre = 1.0
    made_norm_topk_prob = True
    presets = {
        # Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (--layers 4 keeps three Gated DeltaNet layers and one
        # attention layer; --experts fewer keeps it within a small machine's memory)
        "qwen3-next": lambda: Geometry(vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=16,
                                       num_kv_heads=2, head_dim=256, num_experts=512, top_k=10,
                                       moe_intermediate_size=512, dense_intermediate_size=5632,
                                       shared_expert_intermediate_size=512, norm_topk_prob=True, rope_theta=1e7,
                                       partial_rotary_factor=0.25, max_position_embeddings=262144,
                                       linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                                       linear_value_head_dim=128)}
    gguf_arch = "qwen3next"
    gguf_layer_tensors = GGUF_TENSORS
    gguf_nextn = True

    def gguf_config(self, f: GgufFile) -> dict:
        """Qwen3-Next as llama.cpp reads a qwen3next file (src/models/qwen3next.cpp): a softmax router whose top-k
        weights are renormalised, partial rotary from rope.dimension_count, the Gated DeltaNet's keys."""
        cfg = shared_keys(f)
        heads = cfg["num_attention_heads"]
        head_dim = f.integer("attention.key_length", cfg["hidden_size"] // heads)
        rope_dim = f.integer("rope.dimension_count", head_dim // 4)
        if not 0 < rope_dim <= head_dim:
            raise GgufError(f"{f.path}: metadata {f.arch}.rope.dimension_count {rope_dim} (heads of {head_dim}) "
                            "does not fit")
        no_rope_scaling(f)
        f.refuse("expert_weights_scale", "a scale on the routed experts' weights is not Qwen3-Next's")
        cfg.update({
            "architectures": [self.hf_class],
            "num_hidden_layers": f.num_layers,
            "num_key_value_heads": f.integer("attention.head_count_kv", heads),
            "head_dim": head_dim,
            "rope_parameters": {"rope_type": "default", "rope_theta": float(f.meta("rope.freq_base", 10000.0)),
                                "partial_rotary_factor": rope_dim / head_dim},
            "intermediate_size": f.integer("feed_forward_length"),
            "moe_intermediate_size": f.integer("expert_feed_forward_length"),
            "shared_expert_intermediate_size": f.integer("expert_shared_feed_forward_length"),
            "num_experts": f.integer("expert_count"),
            "num_experts_per_tok": f.integer("expert_used_count"),
            "norm_topk_prob": True,
            **linear_attention_keys(f, f.num_layers),
            "norms_hold_one_plus_weight": True,
        })
        return cfg

    def parse(self, cfg: dict, model_dir: Path | None) -> ModelConfig:
        d = self.defaults
        silu_only(cfg)
        hidden = positive(cfg, "hidden_size")
        layers = positive(cfg, "num_hidden_layers")
        heads, kv_heads = head_counts(cfg)
        head_dim = positive(cfg, "head_dim", d["head_dim"])
        rotary = rotary_dim(cfg, d, head_dim)
        types = cfg.get("layer_types")
        if types is None:
            interval = positive(cfg, "full_attention_interval", d["full_attention_interval"])
            types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
        if not isinstance(types, list) or len(types) != layers or not set(types) <= {"linear_attention",
                                                                                    "full_attention"}:
            raise ModelConfigError(f"config.json: layer_types is {types!r}; expected {layers} entries, each "
                                   "'linear_attention' or 'full_attention'")
        linear = LinearAttnConfig(*(positive(cfg, k, d[k]) for k in (
            "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
            "linear_conv_kernel_dim")))
        if linear.value_heads % linear.key_heads:
            raise ModelConfigError(f"config.json: linear_num_value_heads {linear.value_heads} must be a multiple of "
                                   f"linear_num_key_heads {linear.key_heads}")
        num_experts = positive(cfg, "num_experts")
        top_k = positive(cfg, "num_experts_per_tok")
        if top_k > num_experts:
            raise ModelConfigError(f"config.json: num_experts_per_tok {top_k} is more than num_experts {num_experts}")
        return ModelConfig(
            arch=self.name,
            **shared_fields(cfg, d, model_dir),
            **gqa_fields(cfg, d, hidden, layers, heads, kv_heads, head_dim),
            qkv_bias=boolean(cfg, "attention_bias", d["attention_bias"]),
            qk_norm=True,
            num_experts=num_experts,
            top_k=top_k,
            norm_topk_prob=boolean(cfg, "norm_topk_prob", d["norm_topk_prob"]),
            moe_intermediate_size=positive(cfg, "moe_intermediate_size"),
            dense_intermediate_size=positive(cfg, "intermediate_size"),
            shared_expert_intermediate_size=field(cfg, "shared_expert_intermediate_size", int,
                                                  default=d["shared_expert_intermediate_size"]),
            sparse_layers=sparse_by_step(cfg, d, layers),
            sliding_windows=(None,) * layers,
            rotary_dim=0 if rotary == head_dim else rotary,
            linear=linear,
            linear_layers=tuple(t == "linear_attention" for t in types),
            attn_output_gate=True,
            # a GGUF file's norms already hold 1 + weight (llama.cpp's converter adds it)
            norm_offset=0.0 if boolean(cfg, "norms_hold_one_plus_weight", False) else 1.0,
        )

    def mtp_names(self, cfg: ModelConfig, holds: Callable[[str], bool]) -> MtpNames | None:
        """DeepSeek-V3's nextn names (a GGUF file's), or its own: mtp.{pre_fc_norm_embedding,pre_fc_norm_hidden,fc,
        norm} around the decoder layer mtp.layers.0."""
        names = super().mtp_names(cfg, holds)
        if names is None and holds("mtp.fc.weight"):
            return MtpNames("mtp.layers.0", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                            "mtp.fc.weight", "mtp.norm.weight", None, None)
        return names

    def mtp_tensor_names(self, cfg: ModelConfig) -> str:
        return f"{super().mtp_tensor_names(cfg)} or mtp.fc"

    # -- make-model ------------------------------------------------------------------------------------------------
    def is_linear(self, g: Geometry, layer: int) -> bool:
        """Whether ``layer`` is a Gated DeltaNet layer; the MTP layer (layer id num_layers) is attention."""
        return layer < g.num_layers and (layer + 1) % g.full_attention_interval != 0

    def hf_config(self, g: Geometry, cfg: dict) -> dict:
        super().hf_config(g, cfg)
        cfg.update(shared_expert_intermediate_size=g.shared_expert_intermediate_size, attention_bias=False,
                   partial_rotary_factor=g.partial_rotary_factor,
                   layer_types=["linear_attention" if self.is_linear(g, i) else "full_attention"
                                for i in range(g.num_layers)],
                   **{k: getattr(g, k) for k in ("linear_num_key_heads", "linear_num_value_heads",
                                                 "linear_key_head_dim", "linear_value_head_dim",
                                                 "linear_conv_kernel_dim")})
        for k in ("use_sliding_window", "sliding_window", "max_window_layers"):
            del cfg[k]
        return cfg

    def layer_prefix(self, g: Geometry, layer: int) -> str:
        return f"mtp.layers.{layer - g.num_layers}" if layer >= g.num_layers else f"model.layers.{layer}"

    def attention_tensors(self, draw: Draw, g: Geometry, layer: int, prefix: str) -> dict:
        """A Gated DeltaNet layer's tensors, or gated attention: q_proj's rows twice (queries and the gate), the
        q and k norms."""
        if self.is_linear(g, layer):
            return {f"{prefix}.linear_attn.{n}": self._linear_tensor(draw, n, shape)
                    for n, shape in linear_shapes(g).items()}
        a, hd, H = f"{prefix}.self_attn", g.head_dim, g.hidden_size
        return {f"{a}.q_proj.weight": draw.mat(2 * g.num_heads * hd, H),
                f"{a}.k_proj.weight": draw.mat(g.num_kv_heads * hd, H),
                f"{a}.v_proj.weight": draw.mat(g.num_kv_heads * hd, H),
                f"{a}.o_proj.weight": draw.mat(H, g.num_heads * hd),
                f"{a}.q_norm.weight": draw.norm(hd, self.norm_centre),
                f"{a}.k_norm.weight": draw.norm(hd, self.norm_centre)}

    @staticmethod
    def _linear_tensor(draw: Draw, name: str, shape: tuple[int, ...]):
        """Projections scaled as mat's, A_log as transformers draws it, dt_bias and the gated norm near 1."""
        if name == "A_log":
            return draw.uniform_log(shape, 1.0, 16.0)
        if name in ("dt_bias", "norm.weight"):
            return draw.norm(shape[0])
        if name == "conv1d.weight":
            return draw.small(shape, 0.5)
        return draw.mat(*shape)

    def moe_tensors(self, draw: Draw, g: Geometry, moe: str) -> dict:
        return {**super().moe_tensors(draw, g, moe), **shared_expert_tensors(draw, g, moe)}

    def mtp_tensors(self, draw: Draw, g: Geometry, t: dict, layer: int) -> dict:
        """Its own names, one set; its embedding and head are the model's."""
        H, c = g.hidden_size, self.norm_centre
        return {"mtp.pre_fc_norm_embedding.weight": draw.norm(H, c), "mtp.pre_fc_norm_hidden.weight": draw.norm(H, c),
                "mtp.fc.weight": draw.mat(H, 2 * H), "mtp.norm.weight": draw.norm(H, c)}


FAMILY = Qwen3Next()
