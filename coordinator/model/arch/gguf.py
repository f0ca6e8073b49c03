"""What the families share in reading a GGUF file (llama.cpp's convert_hf_to_gguf.py wrote it): the tensor names
most families use, the walk from a file's names to Hugging Face's, and the metadata keys most MoE families
write. A family's own file (Family.gguf_arch, gguf_config, gguf_layer_tensors, gguf_names) says what differs.
"""

from __future__ import annotations

import re
from typing import Mapping

from shm.gguf_checkpoint import Derived, Stored
from shm.gguf_file import GgufError, GgufFile

# per-layer GGUF tensor -> Hugging Face name (after "model.layers.{i}.")
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",  # a dense layer's MLP
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# the sigmoid-router families' (DeepSeek's, GLM-4.5's) on top of LAYER_TENSORS: shared_experts, a correction bias
GROUPED_TENSORS = {
    **{k: v for k, v in LAYER_TENSORS.items() if "shexp" not in k},
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}
# the multi-token-prediction (nextn) layer's own tensors (gguf's MODEL_TENSOR.NEXTN_*), beside a whole layer's
NEXTN_TENSORS = {"nextn.eh_proj.weight": "eh_proj.weight", "nextn.enorm.weight": "enorm.weight",
                 "nextn.hnorm.weight": "hnorm.weight", "nextn.embed_tokens.weight": "embed_tokens.weight",
                 "nextn.shared_head_head.weight": "shared_head.head.weight",
                 "nextn.shared_head_norm.weight": "shared_head.norm.weight"}
GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}
LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")


def hf_names(f: GgufFile, layer_tensors: Mapping[str, str], *, nextn: bool = False,
             skip: frozenset[str] = frozenset()) -> dict[str, Stored | Derived]:
    """{Hugging Face name: the file's tensor} for every tensor of the file by ``layer_tensors``; ``nextn``: the
    first multi-token-prediction layer (blk.<num_layers>) read under DeepSeek-V3's names, later ones left out;
    ``skip``: a layer's tensors the family reads otherwise. A tensor no table names is a GgufError."""
    layers = f.num_layers if nextn else None
    names: dict[str, Stored | Derived] = {}
    for name in f.tensors:
        if name in GLOBAL_TENSORS:
            names[GLOBAL_TENSORS[name]] = Stored(name)
            continue
        m = LAYER.match(name)
        if m is not None and layers is not None and int(m[1]) > layers:
            continue  # a second multi-token-prediction layer (nextn): the engine runs the first alone
        if m is not None and layers is not None and int(m[1]) == layers and m[2] in NEXTN_TENSORS:
            names[f"model.layers.{m[1]}.{NEXTN_TENSORS[m[2]]}"] = Stored(name)  # the first nextn layer's own
            continue
        if m is not None and m[2] in skip:
            continue
        if m is None or m[2] not in layer_tensors:
            raise GgufError(f"{f.tensors[name][0]}: tensor {name} is not one a {f.arch} model has")
        hf = f"model.layers.{m[1]}.{layer_tensors[m[2]]}"
        names[hf] = Stored(name)
    return names


def shared_keys(f: GgufFile) -> dict:
    """The config.json keys every family's file gives alike."""
    return {"vocab_size": f.vocab_size(), "hidden_size": f.integer("embedding_length"),
            "num_attention_heads": f.integer("attention.head_count"),
            "rms_norm_eps": float(f.meta("attention.layer_norm_rms_epsilon")),
            "max_position_embeddings": f.integer("context_length"),
            "tie_word_embeddings": "output.weight" not in f.tensors, "hidden_act": "silu", **f.token_ids()}


def gqa_keys(f: GgufFile, hf_class: str) -> dict:
    """The grouped-query-attention MoE families' keys (Qwen3-MoE's, Qwen2-MoE's, Mixtral's): their heads, rope and
    routed experts' count (the experts' size each family's own)."""
    cfg = shared_keys(f)
    heads = cfg["num_attention_heads"]
    cfg.update({
        "architectures": [hf_class],
        "num_hidden_layers": int(f.meta("block_count")),
        "num_key_value_heads": int(f.meta("attention.head_count_kv", heads)),
        "head_dim": int(f.meta("attention.key_length", cfg["hidden_size"] // heads)),
        "rope_theta": float(f.meta("rope.freq_base", 10000.0)),
        "num_experts": int(f.meta("expert_count")),
        "num_experts_per_tok": int(f.meta("expert_used_count")),
    })
    scaling = f.meta("rope.scaling.type", "none")
    if scaling not in ("none", None):
        cfg["rope_scaling"] = {"rope_type": scaling, "factor": float(f.meta("rope.scaling.factor", 1.0))}
    return cfg


def grouped_keys(f: GgufFile) -> dict:
    """The keys the grouped sigmoid-router families share (DeepSeek's, GLM-4.5's; llama.cpp's defaults where a key
    may be absent)."""
    return {
        **shared_keys(f),
        "num_hidden_layers": f.num_layers,
        "intermediate_size": f.integer("feed_forward_length"),
        "moe_intermediate_size": f.integer("expert_feed_forward_length"),
        "n_routed_experts": f.integer("expert_count"),
        "num_experts_per_tok": f.integer("expert_used_count"),
        "n_shared_experts": f.integer("expert_shared_count", 0),
        "first_k_dense_replace": f.integer("leading_dense_block_count", 0),
        "routed_scaling_factor": float(f.meta("expert_weights_scale", 1.0)),  # absent: no scaling
        "norm_topk_prob": bool(f.meta("expert_weights_norm", False)),
        "n_group": f.integer("expert_group_count", 1),
        "topk_group": f.integer("expert_group_used_count", 1),
        "rope_theta": float(f.meta("rope.freq_base", 10000.0)),
    }


def no_rope_scaling(f: GgufFile) -> None:
    """GgufError where the file scales its rope: the family's llama.cpp graph reads no scaling."""
    scaling = f.meta("rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise GgufError(f"{f.path}: metadata {f.arch}.rope.scaling.type {scaling!r} is not supported")
