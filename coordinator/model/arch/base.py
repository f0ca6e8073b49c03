"""What every model family shares: the model's configuration (ModelConfig and its parts), the readers of
config.json's keys every family uses, a make-model geometry and weight drawer, and Family, the base of each
family's file (coordinator/model/arch/<family>.py, as llama.cpp's src/models/). (What the families share in
reading GGUF files: gguf.py.)

Keys are read as transformers writes them, in both the 4.x form (``rope_theta`` and ``rope_scaling`` at top
level) and the 5.x form (``rope_parameters``). Defaults for absent keys are those of the transformers config
classes (each family's ``defaults``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from shm.gguf_checkpoint import Derived, Stored
from shm.gguf_file import GgufFile

from ...errors import ModelConfigError
from .gguf import LAYER_TENSORS, hf_names

SUPPORTED_ROPE_TYPES = ("default", "linear")
MLA_ROPE_TYPES = ("default", "linear", "yarn")  # YaRN: DeepSeek's MLA architectures only, for now


@dataclass(frozen=True)
class YarnConfig:
    """YaRN rope scaling (transformers' _compute_yarn_parameters; DeepSeek's YarnRotaryEmbedding)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    truncate: bool
    attention_factor: float  # multiplies cos and sin


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): low-rank q and kv, a decoupled rope part."""

    q_lora_rank: int | None  # None: one q_proj (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # rope on (x0, x1), (x2, x3), ... pairs (transformers' apply_rotary_pos_emb_interleave)
    softmax_scale: float  # qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class GroupRouter:
    """DeepSeek-V3's router (GLM-4.5's too): sigmoid scores, a correction bias for the choice only, group-limited
    top-k. DeepSeek-V2's: softmax scores, no bias, groups scored by their best expert (n_group 1: plain greedy)."""

    n_group: int
    topk_group: int
    routed_scaling_factor: float
    scoring: str = "sigmoid"  # "sigmoid" (with e_score_correction_bias) | "softmax" (DeepSeek-V2)


@dataclass(frozen=True)
class LinearAttnConfig:
    """Qwen3-Next's Gated DeltaNet layers: q and k heads (key_heads of key_head_dim), v heads (value_heads of
    value_head_dim, a whole multiple of key_heads), a causal depthwise conv of conv_kernel taps over q, k and v."""

    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q's, k's, then v's."""
        return 2 * self.key_heads * self.key_head_dim + self.value_heads * self.value_head_dim

    @property
    def state_floats(self) -> int:
        """One layer's fixed state per sequence: the conv's last conv_kernel - 1 inputs and the recurrent state
        [value_heads, key_head_dim, value_head_dim]."""
        return (self.conv_kernel - 1) * self.conv_dim + self.value_heads * self.key_head_dim * self.value_head_dim


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # the family's name (Family.name: "qwen3_moe", "deepseek_v3", ...)
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str
    rope_factor: float  # position divisor for "linear"; 1.0 otherwise
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    moe_intermediate_size: int
    dense_intermediate_size: int
    shared_expert_intermediate_size: int  # 0 = no shared expert
    sparse_layers: tuple[bool, ...]  # per layer: MoE (True) or dense MLP (False); the MTP layer's last
    sliding_windows: tuple[int | None, ...]  # per layer: window length or None; the MTP layer's last
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    shared_expert_gate: bool = True  # qwen2_moe's sigmoid gate on the shared expert; DeepSeek's have none
    rotary_dim: int = 0  # glm4_moe's partial rotary: the first rotary_dim of each head rotated; 0 = all
    mla: MLAConfig | None = None  # deepseek_v3: attention is MLA (num_kv_heads, head_dim unused)
    yarn: YarnConfig | None = None  # rope_type "yarn"
    group_router: GroupRouter | None = None  # deepseek_v3: sigmoid, grouped; else softmax top-k
    linear: LinearAttnConfig | None = None  # qwen3_next: the Gated DeltaNet layers' geometry
    linear_layers: tuple[bool, ...] = ()  # per layer (MTP last): Gated DeltaNet (True) or attention; (): all attention
    attn_output_gate: bool = False  # qwen3_next: q_proj also gives a per-head sigmoid gate on attention's output
    norm_offset: float = 0.0  # added to the RMSNorms' weights at load: 1.0 for qwen3_next's (1 + weight) norms
    mtp_layers: int = 0  # 1: the checkpoint's multi-token-prediction layer runs as layer id num_layers (attach_mtp)
    # the MTP layer takes the model's rows after its final norm (as vLLM and SGLang feed every MTP layer) and chains
    # its own output: qwen3_next's after mtp.norm, DeepSeek-V3's and GLM-4.5's before shared_head.norm (theirs too)
    mtp_chains_normed: bool = False

    def is_linear(self, layer: int) -> bool:
        """Whether ``layer`` is a Gated DeltaNet layer (no KV cache, a fixed state per sequence)."""
        return bool(self.linear_layers) and self.linear_layers[layer]

    @property
    def attention_layers(self) -> list[int]:
        """The layers that keep a KV cache."""
        return [i for i in range(self.num_layers) if not self.is_linear(i)]

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes the KV cache holds per token over the attention layers (float32): MLA keeps the compressed
        latent and the rope key, (kv_lora_rank + qk_rope_head_dim) a layer; the others 2 x kv heads x head_dim."""
        per_layer = (self.mla.kv_lora_rank + self.mla.qk_rope_head_dim if self.mla is not None
                     else 2 * self.num_kv_heads * self.head_dim)
        return len(self.attention_layers) * per_layer * 4

    @property
    def state_bytes_per_sequence(self) -> int:
        """Bytes of the Gated DeltaNet layers' fixed state per sequence (float32; 0 without such layers)."""
        return 0 if self.linear is None else sum(self.linear_layers) * self.linear.state_floats * 4

    @property
    def moe_layers(self) -> list[int]:
        """The MoE layers' ids, the MTP layer's (num_layers) among them when it has routed experts."""
        return [i for i, sparse in enumerate(self.sparse_layers) if sparse]


@dataclass(frozen=True)
class MtpNames:
    """Where a checkpoint holds its multi-token-prediction layer: the decoder layer's prefix and the module's own
    tensors (embed and head None: the model's own)."""

    layer: str  # model.layers.L (DeepSeek-V3's and GLM-4.5's nextn layer, any GGUF file's) or mtp.layers.0
    enorm: str  # the norm on the next token's embedding
    hnorm: str  # the norm on the model's hidden state
    eh_proj: str  # [H, 2H] on [enorm(embedding) ; hnorm(hidden)]
    head_norm: str  # the norm before the head
    embed: str | None
    head: str | None


def field(cfg: dict, key: str, kind: type, *, default: object = ..., where: str = "config.json"):
    if key not in cfg or cfg[key] is None:
        if default is ...:
            raise ModelConfigError(f"{where}: missing required field '{key}'")
        return default
    value = cfg[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise ModelConfigError(f"{where}: field '{key}' is {value!r}; expected {kind.__name__}")
    if kind is int and value < 0:
        raise ModelConfigError(f"{where}: field '{key}' is {value}; expected a non-negative integer")
    return value


def boolean(cfg: dict, key: str, default: bool) -> bool:
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ModelConfigError(f"config.json: field '{key}' is {value!r}; expected true or false")
    return value


def rope_scaling(cfg: dict) -> tuple[str, dict]:
    """(where, the scaling object) from either layout."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params:
        return "rope_parameters", params
    return "rope_scaling", cfg.get("rope_scaling") or {}


def number(where: str, key: str, value, *, positive: bool = True) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or (positive and value <= 0):
        raise ModelConfigError(f"config.json: {where}.{key} is {value!r}; expected a positive number")
    return float(value)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's mscale (Eq. 21): 0.1 * mscale * ln(scale) + 1, or 1 when scale <= 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn(cfg: dict, max_pos: int) -> tuple[YarnConfig, float]:
    """(the YaRN parameters, the softmax-scale multiplier MLA folds in: mscale(factor, mscale_all_dim)²)."""
    where, s = rope_scaling(cfg)
    orig = s.get("original_max_position_embeddings")
    if not isinstance(orig, int) or isinstance(orig, bool) or orig <= 0:
        raise ModelConfigError(f"config.json: {where}.original_max_position_embeddings is {orig!r}; expected a "
                               "positive integer (YaRN needs it)")
    factor = s.get("factor")
    factor = max_pos / orig if factor is None else number(where, "factor", factor)
    mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
    for key, value in (("mscale", mscale), ("mscale_all_dim", mscale_all_dim)):
        if value is not None:
            number(where, key, value, positive=False)
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)
    attention_factor = number(where, "attention_factor", attention_factor)
    beta_fast = number(where, "beta_fast", s.get("beta_fast") or 32)
    beta_slow = number(where, "beta_slow", s.get("beta_slow") or 1)
    truncate = s.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ModelConfigError(f"config.json: {where}.truncate is {truncate!r}; expected true or false")
    all_dim = yarn_get_mscale(factor, mscale_all_dim) ** 2 if mscale_all_dim else 1.0
    return YarnConfig(factor, orig, beta_fast, beta_slow, truncate, attention_factor), all_dim


def rope(cfg: dict, default_theta: float, types: tuple[str, ...] = SUPPORTED_ROPE_TYPES) -> tuple[float, str, float]:
    """(theta, type, linear factor) from either the 4.x or the 5.x layout."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params:
        where = "rope_parameters"
        theta = params.get("rope_theta", cfg.get("rope_theta", default_theta))
        scaling = params
    else:
        where = "rope_scaling"
        theta = cfg.get("rope_theta", default_theta)
        scaling = cfg.get("rope_scaling") or {}
    if not isinstance(scaling, dict):
        raise ModelConfigError(f"config.json: field '{where}' is {scaling!r}; expected an object or null")
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if rope_type not in types:
        raise ModelConfigError(
            f"config.json: {where}.rope_type '{rope_type}' is not supported; expected one of "
            f"{', '.join(types)}"
        )
    factor = 1.0
    if rope_type == "linear":
        factor = scaling.get("factor")
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
            raise ModelConfigError(f"config.json: {where}.factor is {factor!r}; expected a positive number")
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise ModelConfigError(f"config.json: rope_theta is {theta!r}; expected a positive number")
    return float(theta), rope_type, float(factor)


def sliding_windows(cfg: dict, num_layers: int, every_layer: bool = False) -> tuple[int | None, ...]:
    """Each layer's sliding window or None: ``every_layer`` (Mixtral's) where sliding_window is set, else as
    layer_types, or use_sliding_window from max_window_layers on, say."""
    layer_types = cfg.get("layer_types")
    window = cfg.get("sliding_window")
    if every_layer:
        uses = [window is not None] * num_layers
    elif isinstance(layer_types, list) and len(layer_types) == num_layers:
        uses = [t == "sliding_attention" for t in layer_types]
    else:
        first = cfg.get("max_window_layers", num_layers)
        uses = [bool(cfg.get("use_sliding_window")) and i >= first for i in range(num_layers)]
    if any(uses) and (not isinstance(window, int) or window <= 0):
        raise ModelConfigError(f"config.json: field 'sliding_window' is {window!r}; expected a positive integer")
    return tuple(window if u else None for u in uses)


def eos_ids(cfg: dict, model_dir: Path | None) -> tuple[int, ...]:
    value = cfg.get("eos_token_id")
    gen_path = model_dir / "generation_config.json" if model_dir else None
    if gen_path is not None and gen_path.is_file():
        try:
            gen = json.loads(gen_path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"{gen_path}: not valid JSON: {exc}") from exc
        if gen.get("eos_token_id") is not None:
            value = gen["eos_token_id"]
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ModelConfigError(f"config.json: eos_token_id is {value!r}; expected an integer or a list of integers")
    return tuple(ids)


def choice(cfg: dict, key: str, arch: str, accepted: tuple[str, ...]) -> str:
    value = cfg.get(key)
    if value is None:
        return accepted[0]
    if value not in accepted:
        raise ModelConfigError(f"config.json: field '{key}' is {value!r}, which {arch} does not support; accepted: "
                               f"{', '.join(repr(a) for a in accepted)}")
    return value


def positive(cfg: dict, key: str, default: object = ...) -> int:
    value = field(cfg, key, int, default=default)
    if value == 0:
        raise ModelConfigError(f"config.json: field '{key}' is 0; expected a positive integer")
    return value


def shared_fields(cfg: dict, d: dict, model_dir: Path | None) -> dict:
    """The ModelConfig fields every architecture reads alike."""
    return dict(vocab_size=positive(cfg, "vocab_size"),
                rms_norm_eps=field(cfg, "rms_norm_eps", float, default=d["rms_norm_eps"]),
                tie_word_embeddings=boolean(cfg, "tie_word_embeddings", d["tie_word_embeddings"]),
                bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids(cfg, model_dir))


def gqa_fields(cfg: dict, d: dict, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int) -> dict:
    """The attention geometry and rope of the architectures with grouped-query attention (not MLA's)."""
    theta, rope_type, factor = rope(cfg, d["rope_theta"])
    return dict(hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                rope_theta=theta, rope_type=rope_type, rope_factor=factor,
                max_position_embeddings=field(cfg, "max_position_embeddings", int,
                                               default=d["max_position_embeddings"]))


def silu_only(cfg: dict) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"config.json: hidden_act '{act}' is not supported; expected 'silu'")


def groups(cfg: dict, d: dict, num_experts: int, top_k: int) -> tuple[int, int]:
    """(n_group, topk_group) of a group-limited router, checked: groups divide the experts, the kept groups
    hold the top-k."""
    n_group = positive(cfg, "n_group", d["n_group"])
    topk_group = positive(cfg, "topk_group", d["topk_group"])
    if num_experts % n_group:
        raise ModelConfigError(f"config.json: n_routed_experts {num_experts} is not a multiple of n_group {n_group}")
    if topk_group > n_group:
        raise ModelConfigError(f"config.json: topk_group {topk_group} is more than n_group {n_group}")
    if top_k > topk_group * (num_experts // n_group):
        raise ModelConfigError(
            f"config.json: num_experts_per_tok {top_k} is more than the experts of topk_group {topk_group} groups "
            f"({topk_group * (num_experts // n_group)})")
    return n_group, topk_group


def rotary_dim(cfg: dict, d: dict, head_dim: int) -> int:
    """The rotated dims of a head from partial_rotary_factor (rope_scaling's, the config's, else the default)."""
    where, scaling_obj = rope_scaling(cfg)
    factor = scaling_obj.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    factor = d["partial_rotary_factor"] if factor is None else number(where, "partial_rotary_factor", factor)
    rotary_dim = int(head_dim * factor)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ModelConfigError(f"config.json: partial_rotary_factor {factor} gives {rotary_dim} rotary dims of "
                               f"head_dim {head_dim}; expected a positive even number")
    return rotary_dim


def head_counts(cfg: dict) -> tuple[int, int]:
    """(num_attention_heads, num_key_value_heads), the first a multiple of the second."""
    heads = positive(cfg, "num_attention_heads")
    kv_heads = positive(cfg, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise ModelConfigError(f"config.json: num_attention_heads {heads} must be a multiple of num_key_value_heads "
                               f"{kv_heads}")
    return heads, kv_heads




def check_top_k(top_k: int, num_experts: int) -> None:
    if num_experts == 0 or not 1 <= top_k <= num_experts:
        raise ModelConfigError(
            f"config.json: num_experts_per_tok {top_k} must be between 1 and the number of experts ({num_experts})")


def sparse_by_step(cfg: dict, d: dict, layers: int) -> tuple[bool, ...]:
    """Each layer MoE or dense: every decoder_sparse_step-th layer not in mlp_only_layers (Qwen's rule)."""
    step = positive(cfg, "decoder_sparse_step", d["decoder_sparse_step"])
    mlp_only = cfg.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(isinstance(i, int) for i in mlp_only):
        raise ModelConfigError(f"config.json: mlp_only_layers is {mlp_only!r}; expected a list of layer indices")
    return tuple(i not in mlp_only and (i + 1) % step == 0 for i in range(layers))


def gqa_geometry(cfg: dict) -> tuple[int, int, int, int, int]:
    """(hidden, layers, heads, kv heads, head_dim) of a grouped-query-attention model, checked."""
    hidden = field(cfg, "hidden_size", int)
    layers = field(cfg, "num_hidden_layers", int)
    heads = field(cfg, "num_attention_heads", int)
    kv_heads = field(cfg, "num_key_value_heads", int, default=heads)
    if heads == 0 or kv_heads == 0 or heads % kv_heads:
        raise ModelConfigError(
            f"config.json: num_attention_heads {heads} must be a positive multiple of num_key_value_heads {kv_heads}")
    head_dim = field(cfg, "head_dim", int, default=hidden // heads if heads else 0)
    if head_dim == 0 or head_dim % 2:
        raise ModelConfigError(f"config.json: head_dim {head_dim} must be a positive even number")
    return hidden, layers, heads, kv_heads, head_dim


# -- make-model: a geometry, and the weights drawn for it ----------------------------------------------------------

@dataclass(frozen=True)
class Geometry:
    """What a make-model preset fixes (``strata make-model``; each family's presets, coordinator/cli/make_model.py)."""

    vocab_size: int = 320
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    num_experts: int = 8
    top_k: int = 2
    moe_intermediate_size: int = 80  # 2.5 blocks of 32: slices are uneven
    dense_intermediate_size: int = 128
    shared_expert_intermediate_size: int = 96  # qwen2_moe only
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    norm_topk_prob: bool | None = None  # None: the architecture's usual choice
    tie_word_embeddings: bool = False
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    # deepseek_v3 and glm4_moe: the sigmoid router's groups, shared experts (moe_intermediate_size each), and the
    # dense first layers (at most num_layers - 1, so that --layers N keeps one MoE layer)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 1
    first_k_dense_replace: int = 0
    # deepseek_v3's MLA (head_dim and num_kv_heads unused) and YaRN (None: plain rope)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    yarn_factor: float | None = None
    yarn_original_max_position_embeddings: int = 4096
    # glm4_moe (qwen3_next: 0.25)
    partial_rotary_factor: float = 0.5
    use_qk_norm: bool = False
    # qwen3_next's Gated DeltaNet layers: every full_attention_interval-th layer is attention, the others these
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    linear_conv_kernel_dim: int = 4
    full_attention_interval: int = 4
    # deepseek_v3 and glm4_moe: 1 writes the multi-token-prediction (nextn) layer, layer id num_layers; qwen3_next:
    # its MTP layer, mtp.layers.0 and mtp.{fc,pre_fc_norm_embedding,pre_fc_norm_hidden,norm}
    num_nextn_predict_layers: int = 0

    @property
    def dense_layers(self) -> int:
        """The dense first layers written: first_k_dense_replace, less any that would leave no MoE layer."""
        return max(0, min(self.first_k_dense_replace, self.num_layers - 1))


class Draw:
    """A checkpoint's weights drawn from one seeded generator, float32; with ``shapes_only`` no values, only
    read-only zero views of each shape (a parameter count without the memory)."""

    def __init__(self, seed: int, shapes_only: bool = False):
        self.rng, self.shapes_only = np.random.default_rng(seed), shapes_only

    def _empty(self, shape) -> np.ndarray:
        return np.broadcast_to(np.float32(0), shape)

    def mat(self, rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        if self.shapes_only:
            return self._empty((rows, cols))
        return (self.rng.standard_normal((rows, cols)) * gain / np.sqrt(cols)).astype(np.float32)

    def norm(self, n: int, centre: float = 0.0) -> np.ndarray:
        """A norm's weight near 1 (less ``centre``: a family that stores weight - 1)."""
        if self.shapes_only:
            return self._empty((n,))
        return (1.0 + 0.1 * self.rng.standard_normal(n)).astype(np.float32) - np.float32(centre)

    def small(self, shape, scale: float = 0.1) -> np.ndarray:
        """Biases and the like: scale x standard normal."""
        if self.shapes_only:
            return self._empty(shape)
        return (scale * self.rng.standard_normal(shape)).astype(np.float32)

    def uniform_log(self, shape, low: float, high: float) -> np.ndarray:
        """log of uniform(low, high) values (A_log as transformers draws it)."""
        if self.shapes_only:
            return self._empty(shape)
        return np.log(self.rng.uniform(low, high, shape)).astype(np.float32)


def swiglu(draw: Draw, prefix: str, inter: int, hidden: int, names=("gate_proj", "up_proj", "down_proj")) -> dict:
    """An MLP's three matrices under ``prefix``: gate and up [inter, hidden], down [hidden, inter]."""
    gate, up, down = (f"{prefix}.{name}.weight" for name in names)
    return {gate: draw.mat(inter, hidden), up: draw.mat(inter, hidden), down: draw.mat(hidden, inter)}


# -- a family ------------------------------------------------------------------------------------------------------

class Family:
    """One model family (llama.cpp's src/models/<family>.cpp): its config.json, its tensors' names, its
    multi-token-prediction layer, and what ``strata make-model`` writes for it. The defaults here are the
    grouped-query-attention MoE families' (Qwen's names); a family's file overrides what differs, and adding a
    family is adding a file to this package."""

    name: str = ""  # ModelConfig.arch
    hf_class: str = ""  # config.json's architectures[0] as transformers writes it
    hf_aliases: tuple[str, ...] = ()  # other class names read as this family
    defaults: dict = {}  # transformers' config-class defaults for keys that may be absent
    moe_block: str = "mlp"  # a MoE layer's block: model.layers.N.<moe_block>.{gate,experts}
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    mtp: bool = False  # its multi-token-prediction layer runs (DeepSeek-V3's nextn names, mtp_names)
    mtp_chains_normed: bool = False  # the MTP layer chains its rows after its head's norm (Qwen3-Next)
    norm_centre: float = 0.0  # make-model: the norms store weight - norm_centre (1: Qwen3-Next's 1 + weight)
    made_norm_topk_prob: bool = False  # make-model: norm_topk_prob where the geometry leaves it to the family
    presets: dict[str, Callable[[], Geometry]] = {}  # make-model presets of a real model of the family
    makeable: bool = True  # strata make-model writes it (--arch)
    gguf_arch: str = ""  # general.architecture of the family's GGUF files ("": none is read as this family)
    gguf_layer_tensors: dict[str, str] = LAYER_TENSORS  # a layer's GGUF tensor (after blk.N.) -> Hugging Face name
    gguf_nextn: bool = False  # its GGUF files may append multi-token-prediction layers (nextn_predict_layers)

    def parse(self, cfg: dict, model_dir: Path | None) -> ModelConfig:
        raise NotImplementedError

    # -- GGUF files ------------------------------------------------------------------------------------------------
    def gguf_config(self, f: GgufFile) -> dict:
        """config.json's keys from a GGUF file's metadata, as llama.cpp reads the family's files; GgufError for
        what it cannot read."""
        raise NotImplementedError

    def gguf_names(self, f: GgufFile) -> dict[str, Stored | Derived]:
        """{Hugging Face name: the file's tensor} (shm/gguf_checkpoint.py); a tensor the family lacks: GgufError."""
        return hf_names(f, self.gguf_layer_tensors, nextn=self.gguf_nextn)

    def mtp_names(self, cfg: ModelConfig, holds: Callable[[str], bool]) -> MtpNames | None:
        """The checkpoint's MTP layer's names where it holds one: DeepSeek-V3's nextn names model.layers.L.*
        beside a layer's usual ones (a GGUF file's blk.L.nextn.* are read under them)."""
        p = f"model.layers.{cfg.num_layers}"
        if not self.mtp or not holds(f"{p}.eh_proj.weight"):
            return None
        return MtpNames(p, f"{p}.enorm.weight", f"{p}.hnorm.weight", f"{p}.eh_proj.weight",
                        f"{p}.shared_head.norm.weight", f"{p}.embed_tokens.weight", f"{p}.shared_head.head.weight")

    def mtp_tensor_names(self, cfg: ModelConfig) -> str:
        """The tensor an MTP layer of this family is known by, for a message that says it is missing."""
        return f"model.layers.{cfg.num_layers}.eh_proj"

    # -- make-model ------------------------------------------------------------------------------------------------
    def hf_config(self, g: Geometry, cfg: dict) -> dict:
        """config.json for ``g``: ``cfg`` (the keys every family writes alike) with the family's own."""
        norm = g.norm_topk_prob if g.norm_topk_prob is not None else self.made_norm_topk_prob
        cfg.update(num_experts=g.num_experts, moe_intermediate_size=g.moe_intermediate_size,
                   intermediate_size=g.dense_intermediate_size, decoder_sparse_step=g.decoder_sparse_step,
                   mlp_only_layers=list(g.mlp_only_layers), norm_topk_prob=norm, use_sliding_window=False,
                   sliding_window=None, max_window_layers=g.num_layers)
        return cfg

    def is_sparse(self, g: Geometry, layer: int) -> bool:
        return layer not in g.mlp_only_layers and (layer + 1) % g.decoder_sparse_step == 0

    def layer_prefix(self, g: Geometry, layer: int) -> str:
        return f"model.layers.{layer}"

    def attention_tensors(self, draw: Draw, g: Geometry, layer: int, prefix: str) -> dict:
        """A layer's token mixer under ``prefix`` (model.layers.N): q, k, v and o projections."""
        a, hd, H = f"{prefix}.self_attn", g.head_dim, g.hidden_size
        return {f"{a}.q_proj.weight": draw.mat(g.num_heads * hd, H),
                f"{a}.k_proj.weight": draw.mat(g.num_kv_heads * hd, H),
                f"{a}.v_proj.weight": draw.mat(g.num_kv_heads * hd, H),
                f"{a}.o_proj.weight": draw.mat(H, g.num_heads * hd)}

    def moe_tensors(self, draw: Draw, g: Geometry, moe: str) -> dict:
        """A MoE block under ``moe``: the router (peaked routing) and the routed experts."""
        t = {f"{moe}.gate.weight": draw.mat(g.num_experts, g.hidden_size, gain=3.0)}
        for e in range(g.num_experts):
            t.update(swiglu(draw, f"{moe}.experts.{e}", g.moe_intermediate_size, g.hidden_size, self.expert_names))
        return t

    def mtp_tensors(self, draw: Draw, g: Geometry, t: dict, layer: int) -> dict:
        """The MTP module's own tensors beside its decoder layer ``layer`` (DeepSeek-V3's nextn names)."""
        p, H = f"model.layers.{layer}", g.hidden_size
        return {f"{p}.enorm.weight": draw.norm(H), f"{p}.hnorm.weight": draw.norm(H),
                f"{p}.eh_proj.weight": draw.mat(H, 2 * H), f"{p}.shared_head.norm.weight": draw.norm(H)}
