"""A GGUF file (or a split set) named and checked as the engine needs it (issue 15).

The ``gguf`` package (llama.cpp's own reader) parses the header and maps the
tensors. This module turns the metadata into the config.json keys the engine
parses (coordinator/model/model_config.py) and the tensor names into the
Hugging Face names the engine reads, and refuses what it cannot use, naming
the file, the tensor and the type, before anything loads:

    GgufFile(path)          path: file.gguf, or the first of name-00001-of-0000N.gguf
        .arch               general.architecture ("qwen3moe", "qwen2moe", "llama" with experts: Mixtral)
        .config()           {config.json key: value}
        .hf_names()         {Hugging Face tensor name: GGUF tensor name}; routed experts stacked:
                            model.layers.{i}.mlp.experts.{gate,up,down}_proj  [E, I, H] / [E, H, I]
        .shape(name)        numpy order (the reverse of ggml's ne)
        .float32(name)      the tensor dequantised (gguf.quants), numpy order (Mixtral's q and k un-permuted)

shm/gguf_checkpoint.py reads it as a Checkpoint for the engine and the node workers.
"""

from __future__ import annotations

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
}

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

    def _meta(self, key: str, default: object = ...) -> object:
        full = f"{self.arch}.{key}"
        if full in self.metadata:
            return self.metadata[full]
        if default is ...:
            raise GgufError(f"{self.path}: metadata {full} is missing")
        return default

    def config(self) -> dict:
        """The metadata as the config.json keys transformers writes for this architecture."""
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

    def hf_names(self) -> dict[str, str]:
        """{Hugging Face name: GGUF name} for every tensor of the file; an unknown tensor is an error."""
        layer_tensors = MIXTRAL_TENSORS if self.arch == "llama" else LAYER_TENSORS
        names = {}
        for name in self.tensors:
            if name in GLOBAL_TENSORS:
                names[GLOBAL_TENSORS[name]] = name
                continue
            m = re.match(r"^blk\.(\d+)\.(.+)$", name)
            if m is None or m[2] not in layer_tensors or (self.arch == "llama" and m[2] == "ffn_gate.weight"):
                raise GgufError(f"{self.tensors[name][0]}: tensor {name} is not one a {self.arch} model has")
            names[f"model.layers.{m[1]}.{layer_tensors[m[2]]}"] = name
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

    def shape(self, name: str) -> tuple[int, ...]:
        """Numpy order: ggml's ne reversed ([E, I, H] for ffn_gate_exps)."""
        return tuple(int(n) for n in reversed(self._tensor(name).shape))

    def type_name(self, name: str) -> str:
        return self._tensor(name).tensor_type.name

    def float32(self, name: str) -> np.ndarray:
        """The whole tensor, dequantised exactly as gguf.quants reads it, in numpy order."""
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
