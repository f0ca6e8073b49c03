"""A GGUF file (or a split set) named and checked as the engine needs it (issue 15).

The ``gguf`` package (llama.cpp's own reader) parses the header and maps the
tensors. This module turns the metadata into the config.json keys the engine
parses (coordinator/model/model_config.py) and the tensor names into the
Hugging Face names the engine reads, and refuses what it cannot use, naming
the file, the tensor and the type, before anything loads:

    GgufFile(path)          path: file.gguf, or the first of name-00001-of-0000N.gguf
        .arch               general.architecture ("qwen3moe", "qwen2moe", "llama" with experts: Mixtral,
                            "deepseek2": DeepSeek-V2/V3/R1, Kimi-K2, "glm4moe": GLM-4.5, "qwen3next": Qwen3-Next)
        .config()           {config.json key: value}
        .hf_names()         {Hugging Face tensor name: GGUF tensor name}; routed experts stacked:
                            model.layers.{i}.mlp.experts.{gate,up,down}_proj  [E, I, H] / [E, H, I]
        .shape(name)        numpy order (the reverse of ggml's ne)
        .float32(name)      the tensor dequantised (gguf.quants), numpy order (Mixtral's q and k un-permuted;
                            a deepseek2 file's kv_b_proj put back together from attn_k_b and attn_v_b)

shm/gguf_checkpoint.py reads it as a Checkpoint for the engine and the node workers.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, quants

SPLIT = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")

# GGUF architecture -> (transformers class, whether top-k weights are renormalised as llama.cpp computes it)
ARCHITECTURES = {
    "qwen3moe": ("Qwen3MoeForCausalLM", True),
    "qwen2moe": ("Qwen2MoeForCausalLM", False),
    "llama": ("MixtralForCausalLM", True),  # with experts (llama.expert_count): Mixtral
    # DeepSeek-V2/V2-Lite/V3/R1, Kimi-K2: DeepseekV3ForCausalLM or DeepseekV2ForCausalLM by the gating function
    "deepseek2": ("DeepseekV3ForCausalLM", False),
    "glm4moe": ("Glm4MoeForCausalLM", False),  # GLM-4.5, GLM-4.5-Air
    "qwen3next": ("Qwen3NextForCausalLM", True),  # Qwen3-Next: llama.cpp renormalises its top-k weights
}
GATING_FUNCS = {1: "softmax", 2: "sigmoid"}  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE (3: sqrtsoftplus)

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
# Mixtral's names differ (block_sparse_moe); its q and k rows are permuted by the converter (unpermute_qk)
MIXTRAL_TENSORS = {**LAYER_TENSORS, "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
                   "ffn_gate_exps.weight": "block_sparse_moe.experts.gate_proj",
                   "ffn_up_exps.weight": "block_sparse_moe.experts.up_proj",
                   "ffn_down_exps.weight": "block_sparse_moe.experts.down_proj"}
# deepseek2 (multi-head latent attention) and glm4moe: their own names on top of LAYER_TENSORS
MLA_TENSORS = {
    **{k: v for k, v in LAYER_TENSORS.items() if "shexp" not in k},
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",  # older converters; newer ones split it (KV_B_PARTS)
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}
GLM4MOE_TENSORS = {**MLA_TENSORS, "post_attention_norm.weight": "post_attention_layernorm.weight"}
# qwen3next: Qwen3NextModel's converter writes in_proj_qkvz as attn_qkv (q, k, v rows, each grouped by head) and
# attn_gate (z), -exp(A_log) as ssm_a, conv1d squeezed to [C, K], and its RMSNorms' weights plus 1 (config()
# says so: norms_hold_one_plus_weight); the names below are the engine's for those forms
QWEN3NEXT_TENSORS = {
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
# the multi-token-prediction (nextn) layer's own tensors (gguf's MODEL_TENSOR.NEXTN_*), beside a whole layer's
NEXTN_TENSORS = {"nextn.eh_proj.weight": "eh_proj.weight", "nextn.enorm.weight": "enorm.weight",
                 "nextn.hnorm.weight": "hnorm.weight", "nextn.embed_tokens.weight": "embed_tokens.weight",
                 "nextn.shared_head_head.weight": "shared_head.head.weight",
                 "nextn.shared_head_norm.weight": "shared_head.norm.weight"}
# convert_hf_to_gguf.py's DeepseekV2Model splits kv_b_proj [nh*(dn+dv), c] per head into attn_k_b [nh, c, dn]
# (the key rows, transposed) and attn_v_b [nh, dv, c]; the engine reads kv_b_proj, put back together from both
KV_B_PARTS = ("attn_k_b.weight", "attn_v_b.weight")
GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}


def unpermute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of convert_hf_to_gguf.py's LlamaModel.permute: q or k rows [heads * head_dim, H] back in
    Hugging Face's order (each head's two rotary halves apart, not interleaved)."""
    return np.ascontiguousarray(w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2)
                                .reshape(w.shape))


class GgufError(ValueError):
    """A GGUF file the engine cannot use; the message names the file, and the tensor and type where one is at fault."""


def part_paths(path: str | Path) -> list[Path]:
    """Every part of a split file, given its first (name-00001-of-0000N.gguf); [path] otherwise."""
    path = Path(path)
    if not path.is_file():
        raise GgufError(f"{path}: no such file")
    m = SPLIT.match(path.name)
    if m is None:
        return [path]
    if int(m["index"]) != 1:
        raise GgufError(f"{path}: part {int(m['index'])} of a split file; give the first part (-00001-of-...)")
    count = int(m["count"])
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise GgufError(f"{path}: split in {count} parts, missing {', '.join(missing)}")
    return parts


def metadata_value(field):
    """A metadata field as a Python value (str, number, bool or list); a float32 as the shortest decimal that
    reads back to it (1e-06, not 9.99999997e-07: the value the converter was given)."""
    value = field.contents()
    if isinstance(value, float) and field.types and field.types[0] == GGUFValueType.FLOAT32:
        return float(str(np.float32(value)))
    return value


class GgufFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.metadata: dict[str, object] = {}
        self.tensors: dict[str, tuple[Path, object]] = {}  # GGUF name -> (its file, gguf ReaderTensor)
        for part in part_paths(path):
            try:
                reader = GGUFReader(part)
            except (ValueError, IndexError, OSError) as exc:
                raise GgufError(f"{part}: not a readable GGUF file ({exc}); truncated or not GGUF?") from exc
            for key, field in reader.fields.items():
                if not key.startswith("GGUF."):
                    self.metadata.setdefault(key, metadata_value(field))
            for t in reader.tensors:
                if t.name in self.tensors:
                    raise GgufError(f"{part}: tensor {t.name} is also in {self.tensors[t.name][0].name}")
                if t.data.nbytes != t.n_bytes:  # the mapping ended before the tensor did
                    raise GgufError(f"{part}: tensor {t.name} ({t.tensor_type.name}) needs {t.n_bytes} bytes, the "
                                    f"file holds {t.data.nbytes}: truncated")
                self.tensors[t.name] = (part, t)
        self.arch = str(self.metadata.get("general.architecture", ""))
        if self.arch not in ARCHITECTURES:
            raise GgufError(f"{self.path}: architecture {self.arch!r} is not supported; expected one of "
                            f"{', '.join(ARCHITECTURES)}")
        if self.arch == "llama" and not self._meta("expert_count", 0):
            raise GgufError(f"{self.path}: a llama model without experts (llama.expert_count): not a MoE model")
        # deepseek2's kv_b_proj, when the converter split it: {virtual GGUF name: (attn_k_b, attn_v_b)}
        self.joined: dict[str, tuple[str, str]] = {}
        if self.arch == "deepseek2":
            for name in list(self.tensors):
                m = re.match(r"^blk\.(\d+)\.attn_k_b\.weight$", name)
                if m is None or f"blk.{m[1]}.attn_kv_b.weight" in self.tensors:
                    continue  # some converters wrote attn_kv_b beside the split pair: read it
                v_name = f"blk.{m[1]}.{KV_B_PARTS[1]}"
                if v_name not in self.tensors:
                    raise GgufError(f"{self.tensors[name][0]}: tensor {name} without {v_name}: kv_b_proj cannot be "
                                    "put back together")
                self.joined[f"blk.{m[1]}.attn_kv_b.weight"] = (name, v_name)
        if self.arch in ("deepseek2", "glm4moe", "qwen3next"):
            self.config()  # the metadata checked now, before any worker starts

    @property
    def num_layers(self) -> int:
        """The decoder layers the engine runs: block_count less the multi-token-prediction layers some
        converters append (glm4moe's nextn_predict_layers)."""
        return int(self._meta("block_count")) - int(self._meta("nextn_predict_layers", 0))

    def _meta(self, key: str, default: object = ...) -> object:
        full = f"{self.arch}.{key}"
        if full in self.metadata:
            return self.metadata[full]
        if default is ...:
            raise GgufError(f"{self.path}: metadata {full} is missing")
        return default

    def config(self) -> dict:
        """The metadata as the config.json keys transformers writes for this architecture."""
        if self.arch == "deepseek2":
            return self._config_deepseek2()
        if self.arch == "glm4moe":
            return self._config_glm4moe()
        if self.arch == "qwen3next":
            return self._config_qwen3next()
        cls, norm_default = ARCHITECTURES[self.arch]
        heads = int(self._meta("attention.head_count"))
        hidden = int(self._meta("embedding_length"))
        layers = int(self._meta("block_count"))
        vocab = self._meta("vocab_size", None)
        if vocab is None:
            tokens = self.metadata.get("tokenizer.ggml.tokens")
            vocab = len(tokens) if tokens is not None else self.shape("token_embd.weight")[0]
        cfg = {
            "architectures": [cls],
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": int(self._meta("attention.head_count_kv", heads)),
            "head_dim": int(self._meta("attention.key_length", hidden // heads)),
            "rms_norm_eps": float(self._meta("attention.layer_norm_rms_epsilon")),
            "rope_theta": float(self._meta("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self._meta("context_length")),
            "num_experts": int(self._meta("expert_count")),
            "num_experts_per_tok": int(self._meta("expert_used_count")),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "hidden_act": "silu",
        }
        if self.arch == "llama":  # Mixtral: the experts' size is the feed-forward length
            cfg["num_local_experts"] = cfg.pop("num_experts")
            cfg["intermediate_size"] = int(self._meta("feed_forward_length"))
        else:
            cfg["moe_intermediate_size"] = int(self._meta("expert_feed_forward_length"))
            cfg["intermediate_size"] = int(self._meta("feed_forward_length", cfg["moe_intermediate_size"]))
            cfg["norm_topk_prob"] = bool(self._meta("expert_weights_norm", norm_default))
        if self.arch == "qwen2moe":
            cfg["shared_expert_intermediate_size"] = int(self._meta("expert_shared_feed_forward_length"))
        scaling = self._meta("rope.scaling.type", "none")
        if scaling not in ("none", None):
            cfg["rope_scaling"] = {"rope_type": scaling, "factor": float(self._meta("rope.scaling.factor", 1.0))}
        for key, hf in (("tokenizer.ggml.bos_token_id", "bos_token_id"), ("tokenizer.ggml.eos_token_id",
                                                                           "eos_token_id")):
            if key in self.metadata:
                cfg[hf] = int(self.metadata[key])
        return cfg

    def _int(self, key: str, default: object = ...) -> int:
        value = self._meta(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise GgufError(f"{self.path}: metadata {self.arch}.{key} is {value!r}; expected an integer")
        return value

    def _common_moe(self) -> dict:
        """The keys deepseek2 and glm4moe share (llama.cpp's defaults where a key may be absent)."""
        cfg = {
            "vocab_size": self._vocab(),
            "hidden_size": self._int("embedding_length"),
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self._int("attention.head_count"),
            "rms_norm_eps": float(self._meta("attention.layer_norm_rms_epsilon")),
            "max_position_embeddings": self._int("context_length"),
            "intermediate_size": self._int("feed_forward_length"),
            "moe_intermediate_size": self._int("expert_feed_forward_length"),
            "n_routed_experts": self._int("expert_count"),
            "num_experts_per_tok": self._int("expert_used_count"),
            "n_shared_experts": self._int("expert_shared_count", 0),
            "first_k_dense_replace": self._int("leading_dense_block_count", 0),
            "routed_scaling_factor": float(self._meta("expert_weights_scale", 1.0)),  # absent: no scaling
            "norm_topk_prob": bool(self._meta("expert_weights_norm", False)),
            "n_group": self._int("expert_group_count", 1),
            "topk_group": self._int("expert_group_used_count", 1),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "hidden_act": "silu",
            "rope_theta": float(self._meta("rope.freq_base", 10000.0)),
        }
        for key, hf in (("tokenizer.ggml.bos_token_id", "bos_token_id"), ("tokenizer.ggml.eos_token_id",
                                                                           "eos_token_id")):
            if key in self.metadata:
                cfg[hf] = int(self.metadata[key])
        return cfg

    def _vocab(self) -> int:
        vocab = self._meta("vocab_size", None)
        if vocab is None:
            tokens = self.metadata.get("tokenizer.ggml.tokens")
            vocab = len(tokens) if tokens is not None else self.shape("token_embd.weight")[0]
        return int(vocab)

    def _gating(self, default: str) -> str:
        func = self._meta("expert_gating_func", None)
        if func is None:
            return default
        if func not in GATING_FUNCS:
            raise GgufError(f"{self.path}: metadata {self.arch}.expert_gating_func is {func!r}; supported: "
                            + ", ".join(f"{k} ({v})" for k, v in GATING_FUNCS.items()))
        return GATING_FUNCS[func]

    def _has(self, suffix: str) -> bool:
        return any(name.startswith("blk.") and name.endswith(suffix) for name in self.tensors)

    def _refuse(self, key: str, why: str) -> None:
        if f"{self.arch}.{key}" in self.metadata:
            raise GgufError(f"{self.path}: metadata {self.arch}.{key} = {self.metadata[f'{self.arch}.{key}']!r}: "
                            f"{why}")

    def _config_deepseek2(self) -> dict:
        """DeepSeek-V2/V3 as llama.cpp reads a deepseek2 file (src/models/deepseek2.cpp, llama-context.cpp)."""
        cfg = self._common_moe()
        scoring = self._gating("softmax")  # absent: softmax, as llama.cpp reads DeepSeek-V2 files
        cfg["architectures"] = ["DeepseekV3ForCausalLM" if scoring == "sigmoid" else "DeepseekV2ForCausalLM"]
        cfg["scoring_func"] = scoring
        if scoring == "softmax":
            if self._has(".exp_probs_b.bias"):
                raise GgufError(f"{self.path}: a softmax router (expert_gating_func 1 or absent) with a correction "
                                "bias (exp_probs_b): no DeepSeek-V2 model has one; not supported")
            if cfg["norm_topk_prob"]:
                raise GgufError(f"{self.path}: metadata {self.arch}.expert_weights_norm true with a softmax router "
                                "(DeepSeek-V2 never normalises its top-k weights): not supported")
            # groups scored by their best expert (transformers' DeepseekV2 group_limited_greedy)
            cfg["topk_method"] = "group_limited_greedy" if cfg["n_group"] > 1 else "greedy"
        else:
            cfg["topk_method"] = "noaux_tc"
        cfg["moe_layer_freq"] = 1
        kv_lora = self._int("attention.kv_lora_rank")
        rope_dim = self._int("rope.dimension_count")
        # newer converters write the MLA head sizes as *_mla (key_length then is kv_lora_rank + rope: the
        # absorbed form's); older ones as key_length and value_length themselves
        k_len = self._int("attention.key_length_mla", None) if f"{self.arch}.attention.key_length_mla" in \
            self.metadata else self._int("attention.key_length")
        v_len = self._int("attention.value_length_mla", None) if f"{self.arch}.attention.value_length_mla" in \
            self.metadata else self._int("attention.value_length")
        if k_len <= rope_dim:
            raise GgufError(f"{self.path}: metadata {self.arch}.attention.key_length(_mla) {k_len} is not more than "
                            f"{self.arch}.rope.dimension_count {rope_dim}")
        q_lora = self._meta("attention.q_lora_rank", None)
        cfg.update(kv_lora_rank=kv_lora, qk_rope_head_dim=rope_dim, qk_nope_head_dim=k_len - rope_dim,
                   v_head_dim=v_len, q_lora_rank=None if not q_lora else self._int("attention.q_lora_rank"),
                   rope_interleave=True)  # llama.cpp ropes deepseek2 on adjacent pairs (LLAMA_ROPE_TYPE_NORM)
        self._refuse("attention.temperature_scale", "attention temperature tuning (Mistral-Large) is not supported")
        self._refuse("rope.scaling.attn_factor", "a rope attention factor is not supported")
        self._refuse("rope.scaling.yarn_ext_factor", "a YaRN extrapolation factor is not supported")
        scaling = self._meta("rope.scaling.type", "none")
        if scaling == "yarn":
            factor = float(self._meta("rope.scaling.factor"))
            rope = {"rope_type": "yarn", "factor": factor,
                    "original_max_position_embeddings": self._int("rope.scaling.original_context_length"),
                    "beta_fast": float(self._meta("rope.scaling.yarn_beta_fast", 32.0)),
                    "beta_slow": float(self._meta("rope.scaling.yarn_beta_slow", 1.0))}
            log_mul = self._meta("rope.scaling.yarn_log_multiplier", None)
            if log_mul:  # 0.1 x mscale_all_dim; llama.cpp takes mscale = mscale_all_dim for deepseek2
                m_all = float(str(np.float32(float(log_mul) / 0.1)))  # 0.707, as config.json had it
                rope.update(mscale=m_all, mscale_all_dim=m_all)
            else:  # llama.cpp: cos and sin x mscale(factor), and the softmax scale x mscale(factor)^2
                rope.update(mscale_all_dim=1.0, attention_factor=0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
            cfg["rope_scaling"] = rope
        elif scaling == "linear":
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(self._meta("rope.scaling.factor"))}
        elif scaling not in ("none", None):
            raise GgufError(f"{self.path}: metadata {self.arch}.rope.scaling.type {scaling!r} is not supported "
                            "(none, linear, yarn)")
        return cfg

    def _config_glm4moe(self) -> dict:
        """GLM-4.5 as llama.cpp reads a glm4moe file (src/models/glm4-moe.cpp)."""
        cfg = self._common_moe()
        if self._gating("sigmoid") != "sigmoid":
            raise GgufError(f"{self.path}: metadata {self.arch}.expert_gating_func is not 2 (sigmoid): GLM-4.5's "
                            "router is sigmoid")
        heads = cfg["num_attention_heads"]
        head_dim = self._int("attention.key_length", cfg["hidden_size"] // heads)
        rope_dim = self._int("rope.dimension_count", head_dim // 2)
        if not 0 < rope_dim <= head_dim:
            raise GgufError(f"{self.path}: metadata {self.arch}.rope.dimension_count {rope_dim} for heads of "
                            f"{head_dim}")
        scaling = self._meta("rope.scaling.type", "none")
        if scaling not in ("none", None):
            raise GgufError(f"{self.path}: metadata {self.arch}.rope.scaling.type {scaling!r} is not supported")
        cfg.update(architectures=["Glm4MoeForCausalLM"],
                   num_key_value_heads=self._int("attention.head_count_kv", heads), head_dim=head_dim,
                   partial_rotary_factor=rope_dim / head_dim,
                   attention_bias=self._has(".attn_q.bias"), use_qk_norm=self._has(".attn_q_norm.weight"))
        return cfg

    def _config_qwen3next(self) -> dict:
        """Qwen3-Next as llama.cpp reads a qwen3next file (src/models/qwen3next.cpp): the Gated DeltaNet geometry
        from the ssm keys, the layers' kinds from attention.recurrent_layers (or full_attention_interval), a
        softmax router whose top-k weights are renormalised, partial rotary from rope.dimension_count."""
        heads = self._int("attention.head_count")
        head_dim = self._int("attention.key_length", self._int("embedding_length") // heads)
        rope_dim = self._int("rope.dimension_count", head_dim // 4)
        value_heads = self._int("ssm.time_step_rank")
        inner = self._int("ssm.inner_size")
        if not 0 < rope_dim <= head_dim or inner % value_heads:
            raise GgufError(f"{self.path}: metadata {self.arch}.rope.dimension_count {rope_dim} (heads of {head_dim}) "
                            f"or ssm.inner_size {inner} over ssm.time_step_rank {value_heads} does not fit")
        scaling = self._meta("rope.scaling.type", "none")
        if scaling not in ("none", None):
            raise GgufError(f"{self.path}: metadata {self.arch}.rope.scaling.type {scaling!r} is not supported")
        self._refuse("expert_weights_scale", "a scale on the routed experts' weights is not Qwen3-Next's")
        recurrent = self._meta("attention.recurrent_layers", None)
        if recurrent is None:
            interval = self._int("full_attention_interval", 4)
            recurrent = [(i + 1) % interval != 0 for i in range(self.num_layers)]
        cfg = {
            "architectures": ["Qwen3NextForCausalLM"],
            "vocab_size": self._vocab(),
            "hidden_size": self._int("embedding_length"),
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": heads,
            "num_key_value_heads": self._int("attention.head_count_kv", heads),
            "head_dim": head_dim,
            "rms_norm_eps": float(self._meta("attention.layer_norm_rms_epsilon")),
            "rope_parameters": {"rope_type": "default", "rope_theta": float(self._meta("rope.freq_base", 10000.0)),
                                "partial_rotary_factor": rope_dim / head_dim},
            "max_position_embeddings": self._int("context_length"),
            "intermediate_size": self._int("feed_forward_length"),
            "moe_intermediate_size": self._int("expert_feed_forward_length"),
            "shared_expert_intermediate_size": self._int("expert_shared_feed_forward_length"),
            "num_experts": self._int("expert_count"),
            "num_experts_per_tok": self._int("expert_used_count"),
            "norm_topk_prob": True,
            "linear_conv_kernel_dim": self._int("ssm.conv_kernel"),
            "linear_key_head_dim": self._int("ssm.state_size"),
            "linear_num_key_heads": self._int("ssm.group_count"),
            "linear_num_value_heads": value_heads,
            "linear_value_head_dim": inner // value_heads,
            "layer_types": ["linear_attention" if r else "full_attention" for r in list(recurrent)[:self.num_layers]],
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "hidden_act": "silu",
            "norms_hold_one_plus_weight": True,
        }
        for key, hf in (("tokenizer.ggml.bos_token_id", "bos_token_id"), ("tokenizer.ggml.eos_token_id",
                                                                           "eos_token_id")):
            if key in self.metadata:
                cfg[hf] = int(self.metadata[key])
        return cfg

    def hf_names(self) -> dict[str, str]:
        """{Hugging Face name: GGUF name} for every tensor of the file; an unknown tensor is an error."""
        layer_tensors = {"llama": MIXTRAL_TENSORS, "deepseek2": MLA_TENSORS, "glm4moe": GLM4MOE_TENSORS,
                         "qwen3next": QWEN3NEXT_TENSORS}.get(self.arch, LAYER_TENSORS)
        layers = self.num_layers if self.arch in ("deepseek2", "glm4moe", "qwen3next") else None
        names = {}
        for name in [*self.tensors, *self.joined]:
            if name in GLOBAL_TENSORS:
                names[GLOBAL_TENSORS[name]] = name
                continue
            m = re.match(r"^blk\.(\d+)\.(.+)$", name)
            if m is not None and layers is not None and int(m[1]) > layers:
                continue  # a second multi-token-prediction layer (nextn): the engine runs the first alone
            if m is not None and layers is not None and int(m[1]) == layers and m[2] in NEXTN_TENSORS:
                names[f"model.layers.{m[1]}.{NEXTN_TENSORS[m[2]]}"] = name  # the first nextn layer's own
                continue
            if m is not None and self.arch == "deepseek2" and m[2] in KV_B_PARTS:
                continue  # read as kv_b_proj (self.joined, or the file's own attn_kv_b)
            if m is None or m[2] not in layer_tensors or (self.arch == "llama" and m[2] == "ffn_gate.weight"):
                where = self.tensors[name][0] if name in self.tensors else self.path
                raise GgufError(f"{where}: tensor {name} is not one a {self.arch} model has")
            hf = f"model.layers.{m[1]}.{layer_tensors[m[2]]}"
            if hf in names:
                raise GgufError(f"{self.path}: tensors {names[hf]} and {name} are both {hf} (attn_kv_b beside "
                                "attn_k_b/attn_v_b?)")
            names[hf] = name
        return names

    def qk_heads(self, name: str) -> int | None:
        """For a Mixtral (llama) file, the heads over which the converter permuted this q or k matrix's rows
        (rotary halves interleaved for ggml's rope); None for every other tensor."""
        if self.arch != "llama":
            return None
        if name.endswith(".attn_q.weight"):
            return int(self._meta("attention.head_count"))
        if name.endswith(".attn_k.weight"):
            return int(self._meta("attention.head_count_kv", self._meta("attention.head_count")))
        return None

    def row_order(self, name: str) -> np.ndarray | None:
        """The file's row of each row float32 gives (a Mixtral file's q and k: unpermute_qk's order), None where
        they are the same."""
        heads = self.qk_heads(name)
        if heads is None:
            return None
        return unpermute_qk(np.arange(self.shape(name)[0])[:, None], heads)[:, 0]

    def shape(self, name: str) -> tuple[int, ...]:
        """Numpy order: ggml's ne reversed ([E, I, H] for ffn_gate_exps)."""
        if name in self.joined:
            k_b, v_b = (self.shape(n) for n in self.joined[name])  # [nh, c, dn], [nh, dv, c]
            if len(k_b) != 3 or len(v_b) != 3 or k_b[0] != v_b[0] or k_b[1] != v_b[2]:
                raise GgufError(f"{self.path}: {self.joined[name][0]} {list(k_b)} and {self.joined[name][1]} "
                                f"{list(v_b)} are not [heads, kv_lora_rank, nope] and [heads, v, kv_lora_rank]")
            return (k_b[0] * (k_b[2] + v_b[1]), k_b[1])
        return tuple(int(n) for n in reversed(self._tensor(name).shape))

    def type_name(self, name: str) -> str:
        return "F32" if name in self.joined else self._tensor(name).tensor_type.name

    def float32(self, name: str) -> np.ndarray:
        """The whole tensor, dequantised exactly as gguf.quants reads it, in numpy order."""
        if name in self.joined:  # kv_b_proj: per head, the dn key rows (attn_k_b transposed), then the dv values
            shape = self.shape(name)
            k_b, v_b = (self.float32(n) for n in self.joined[name])
            return np.ascontiguousarray(np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(shape))
        t = self._tensor(name)
        try:
            out = quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as exc:
            raise GgufError(f"{self.tensors[name][0]}: tensor {name} has type {t.tensor_type.name}, which cannot be "
                            f"read ({exc})") from exc
        out = np.asarray(out, np.float32).reshape(self.shape(name))
        heads = self.qk_heads(name)
        return out if heads is None else unpermute_qk(out, heads)

    def _tensor(self, name: str):
        if name not in self.tensors:
            raise GgufError(f"{self.path}: no tensor {name}")
        return self.tensors[name][1]
