"""config.json -> ModelConfig, for the supported MoE architectures.

Keys are read as transformers writes them, in both the 4.x form (``rope_theta``
and ``rope_scaling`` at top level) and the 5.x form (``rope_parameters``).
Defaults for absent keys are those of the transformers config classes.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import ModelConfigError
from shm.fp8 import Fp8Error, block_size as fp8_block_size

ARCHITECTURES = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",  # DeepSeek-V3/R1, Kimi-K2 (model_type kimi_k2), Moonlight
    "DeepseekV2ForCausalLM": "deepseek_v2",  # DeepSeek-V2, V2-Lite, V2.5
    "Glm4MoeForCausalLM": "glm4_moe",  # GLM-4.5, GLM-4.5-Air
    "Qwen3NextForCausalLM": "qwen3_next",  # Qwen3-Next-80B-A3B: Gated DeltaNet and gated attention, 3:1
}
SUPPORTED_ROPE_TYPES = ("default", "linear")
MLA_ROPE_TYPES = ("default", "linear", "yarn")  # YaRN: DeepSeek's MLA architectures only, for now
SCORING_FUNCS = {"deepseek_v3": ("sigmoid",), "deepseek_v2": ("softmax",)}  # config.json's scoring_func
TOPK_METHODS = {"deepseek_v3": ("noaux_tc",), "deepseek_v2": ("greedy", "group_limited_greedy")}  # topk_method
MTP_ARCHS = ("deepseek_v3", "glm4_moe", "qwen3_next")  # the architectures whose multi-token-prediction layer runs

# transformers' config-class defaults for keys that may be absent
DEFAULTS = {
    "qwen3_moe": dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768, norm_topk_prob=False,
                      decoder_sparse_step=1, attention_bias=False, tie_word_embeddings=False),
    "mixtral": dict(rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=4096 * 32, norm_topk_prob=True,
                    decoder_sparse_step=1, attention_bias=False, tie_word_embeddings=False),
    "qwen2_moe": dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768, norm_topk_prob=False,
                      decoder_sparse_step=1, attention_bias=True, tie_word_embeddings=False),
    "deepseek_v3": dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096, norm_topk_prob=True,
                        attention_bias=False, tie_word_embeddings=False, n_group=8, topk_group=4, n_shared_experts=1,
                        routed_scaling_factor=2.5, first_k_dense_replace=3, moe_layer_freq=1, q_lora_rank=1536,
                        rope_interleave=True),
    # DeepseekV2Config: norm_topk_prob is not read by transformers' DeepseekV2TopkRouter; rope always interleaved
    "deepseek_v2": dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048, norm_topk_prob=False,
                        attention_bias=False, tie_word_embeddings=False, n_group=1, topk_group=1, n_shared_experts=2,
                        routed_scaling_factor=1.0, first_k_dense_replace=0, moe_layer_freq=1, q_lora_rank=1536,
                        rope_interleave=True),
    "glm4_moe": dict(rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=131072, norm_topk_prob=True,
                     attention_bias=False, tie_word_embeddings=False, n_group=1, topk_group=1, n_shared_experts=1,
                     routed_scaling_factor=1.0, first_k_dense_replace=1, use_qk_norm=False, partial_rotary_factor=0.5),
    "qwen3_next": dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768, norm_topk_prob=True,
                       decoder_sparse_step=1, attention_bias=False, tie_word_embeddings=False, head_dim=256,
                       partial_rotary_factor=0.25, full_attention_interval=4, linear_conv_kernel_dim=4,
                       linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                       linear_num_value_heads=32, shared_expert_intermediate_size=512),
}


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
    arch: str  # "qwen3_moe" | "mixtral" | "qwen2_moe"
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


def mtp_names(cfg: ModelConfig, holds: Callable[[str], bool]) -> MtpNames | None:
    """The names of the checkpoint's first multi-token-prediction layer (``holds``: whether it has a tensor), or None
    where it holds none: DeepSeek-V3's nextn names model.layers.L.{enorm,hnorm,eh_proj,shared_head.*,embed_tokens}
    beside a layer's usual ones (a GGUF file's blk.L.nextn.* are read under them, Qwen3-Next's too), or Qwen3-Next's
    mtp.{pre_fc_norm_embedding,pre_fc_norm_hidden,fc,norm} around the decoder layer mtp.layers.0."""
    L = cfg.num_layers
    p = f"model.layers.{L}"
    if cfg.arch not in MTP_ARCHS:
        return None
    if holds(f"{p}.eh_proj.weight"):
        return MtpNames(p, f"{p}.enorm.weight", f"{p}.hnorm.weight", f"{p}.eh_proj.weight",
                        f"{p}.shared_head.norm.weight", f"{p}.embed_tokens.weight", f"{p}.shared_head.head.weight")
    if cfg.arch == "qwen3_next" and holds("mtp.fc.weight"):
        return MtpNames("mtp.layers.0", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                        "mtp.fc.weight", "mtp.norm.weight", None, None)
    return None


def attach_mtp(cfg: ModelConfig, holds: Callable[[str], bool]) -> ModelConfig:
    """``cfg`` with its first multi-token-prediction layer where the checkpoint (``holds``: whether it has a tensor)
    holds one (mtp_names): DeepSeek-V3's and GLM-4.5's nextn layer or Qwen3-Next's MTP layer, run as layer id
    num_layers, MoE when it has a router, attention (not Gated DeltaNet) in Qwen3-Next. Checkpoints often leave it
    out though config.json counts it (num_nextn_predict_layers), so the tensors decide; a second one (no published
    model has it) is not run."""
    names = None if cfg.mtp_layers else mtp_names(cfg, holds)
    if names is None:
        return cfg
    return dataclasses.replace(cfg, mtp_layers=1, sparse_layers=(*cfg.sparse_layers,
                                                                 holds(f"{names.layer}.mlp.gate.weight")),
                               sliding_windows=(*cfg.sliding_windows, None),
                               linear_layers=(*cfg.linear_layers, False) if cfg.linear_layers else (),
                               mtp_chains_normed=cfg.arch == "qwen3_next")


def _field(cfg: dict, key: str, kind: type, *, default: object = ..., where: str = "config.json"):
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


def _bool(cfg: dict, key: str, default: bool) -> bool:
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ModelConfigError(f"config.json: field '{key}' is {value!r}; expected true or false")
    return value


def _arch(cfg: dict) -> str:
    archs = cfg.get("architectures")
    if not isinstance(archs, list) or not archs:
        raise ModelConfigError(
            f"config.json: field 'architectures' is {archs!r}; expected a list naming one of {', '.join(ARCHITECTURES)}"
        )
    name = archs[0]
    if name not in ARCHITECTURES:
        raise ModelConfigError(
            f"config.json: architecture '{name}' is not supported; expected one of {', '.join(ARCHITECTURES)}"
        )
    return ARCHITECTURES[name]


def _rope_scaling(cfg: dict) -> tuple[str, dict]:
    """(where, the scaling object) from either layout."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params:
        return "rope_parameters", params
    return "rope_scaling", cfg.get("rope_scaling") or {}


def _number(where: str, key: str, value, *, positive: bool = True) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or (positive and value <= 0):
        raise ModelConfigError(f"config.json: {where}.{key} is {value!r}; expected a positive number")
    return float(value)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's mscale (Eq. 21): 0.1 * mscale * ln(scale) + 1, or 1 when scale <= 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(cfg: dict, max_pos: int) -> tuple[YarnConfig, float]:
    """(the YaRN parameters, the softmax-scale multiplier MLA folds in: mscale(factor, mscale_all_dim)²)."""
    where, s = _rope_scaling(cfg)
    orig = s.get("original_max_position_embeddings")
    if not isinstance(orig, int) or isinstance(orig, bool) or orig <= 0:
        raise ModelConfigError(f"config.json: {where}.original_max_position_embeddings is {orig!r}; expected a "
                               "positive integer (YaRN needs it)")
    factor = s.get("factor")
    factor = max_pos / orig if factor is None else _number(where, "factor", factor)
    mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
    for key, value in (("mscale", mscale), ("mscale_all_dim", mscale_all_dim)):
        if value is not None:
            _number(where, key, value, positive=False)
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)
    attention_factor = _number(where, "attention_factor", attention_factor)
    beta_fast = _number(where, "beta_fast", s.get("beta_fast") or 32)
    beta_slow = _number(where, "beta_slow", s.get("beta_slow") or 1)
    truncate = s.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ModelConfigError(f"config.json: {where}.truncate is {truncate!r}; expected true or false")
    all_dim = yarn_get_mscale(factor, mscale_all_dim) ** 2 if mscale_all_dim else 1.0
    return YarnConfig(factor, orig, beta_fast, beta_slow, truncate, attention_factor), all_dim


def _rope(cfg: dict, default_theta: float, types: tuple[str, ...] = SUPPORTED_ROPE_TYPES) -> tuple[float, str, float]:
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


def _sliding_windows(cfg: dict, arch: str, num_layers: int) -> tuple[int | None, ...]:
    layer_types = cfg.get("layer_types")
    window = cfg.get("sliding_window")
    if arch == "mixtral":
        uses = [window is not None] * num_layers
    elif isinstance(layer_types, list) and len(layer_types) == num_layers:
        uses = [t == "sliding_attention" for t in layer_types]
    else:
        first = cfg.get("max_window_layers", num_layers)
        uses = [bool(cfg.get("use_sliding_window")) and i >= first for i in range(num_layers)]
    if any(uses) and (not isinstance(window, int) or window <= 0):
        raise ModelConfigError(f"config.json: field 'sliding_window' is {window!r}; expected a positive integer")
    return tuple(window if u else None for u in uses)


def _eos_ids(cfg: dict, model_dir: Path | None) -> tuple[int, ...]:
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


def _choice(cfg: dict, key: str, arch: str, accepted: tuple[str, ...]) -> str:
    value = cfg.get(key)
    if value is None:
        return accepted[0]
    if value not in accepted:
        raise ModelConfigError(f"config.json: field '{key}' is {value!r}, which {arch} does not support; accepted: "
                               f"{', '.join(repr(a) for a in accepted)}")
    return value


def _positive(cfg: dict, key: str, default: object = ...) -> int:
    value = _field(cfg, key, int, default=default)
    if value == 0:
        raise ModelConfigError(f"config.json: field '{key}' is 0; expected a positive integer")
    return value


def _shared_fields(cfg: dict, d: dict, model_dir: Path | None) -> dict:
    """The ModelConfig fields every architecture reads alike."""
    return dict(vocab_size=_positive(cfg, "vocab_size"),
                rms_norm_eps=_field(cfg, "rms_norm_eps", float, default=d["rms_norm_eps"]),
                tie_word_embeddings=_bool(cfg, "tie_word_embeddings", d["tie_word_embeddings"]),
                bos_token_id=cfg.get("bos_token_id"), eos_token_ids=_eos_ids(cfg, model_dir))


def _gqa_fields(cfg: dict, d: dict, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int) -> dict:
    """The attention geometry and rope of the architectures with grouped-query attention (not MLA's)."""
    theta, rope_type, factor = _rope(cfg, d["rope_theta"])
    return dict(hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                rope_theta=theta, rope_type=rope_type, rope_factor=factor,
                max_position_embeddings=_field(cfg, "max_position_embeddings", int,
                                               default=d["max_position_embeddings"]))


def _silu_only(cfg: dict) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"config.json: hidden_act '{act}' is not supported; expected 'silu'")


def _groups(cfg: dict, d: dict, num_experts: int, top_k: int) -> tuple[int, int]:
    """(n_group, topk_group) of a group-limited router, checked: groups divide the experts, the kept groups
    hold the top-k."""
    n_group = _positive(cfg, "n_group", d["n_group"])
    topk_group = _positive(cfg, "topk_group", d["topk_group"])
    if num_experts % n_group:
        raise ModelConfigError(f"config.json: n_routed_experts {num_experts} is not a multiple of n_group {n_group}")
    if topk_group > n_group:
        raise ModelConfigError(f"config.json: topk_group {topk_group} is more than n_group {n_group}")
    if top_k > topk_group * (num_experts // n_group):
        raise ModelConfigError(
            f"config.json: num_experts_per_tok {top_k} is more than the experts of topk_group {topk_group} groups "
            f"({topk_group * (num_experts // n_group)})")
    return n_group, topk_group


def _parse_deepseek_v3(cfg: dict, model_dir: Path | None, arch: str) -> ModelConfig:
    """DeepSeek-V3's config.json (the Hub's remote-code form and transformers 5's DeepseekV3Config alike)."""
    d = DEFAULTS[arch]
    _silu_only(cfg)
    scoring = _choice(cfg, "scoring_func", arch, SCORING_FUNCS[arch])
    greedy = _choice(cfg, "topk_method", arch, TOPK_METHODS[arch]) == "greedy"
    try:  # FP8 block-scaled weights (DeepSeek-V3/R1): read and dequantised by shm/checkpoint.py
        fp8_block_size(cfg.get("quantization_config"))
    except Fp8Error as exc:
        raise ModelConfigError(str(exc)) from None
    if _bool(cfg, "attention_bias", d["attention_bias"]):
        raise ModelConfigError(f"config.json: attention_bias true is not supported for {arch} (no DeepSeek "
                               "checkpoint has it)")
    hidden = _positive(cfg, "hidden_size")
    layers = _positive(cfg, "num_hidden_layers")
    heads = _positive(cfg, "num_attention_heads")
    q_lora_rank = cfg.get("q_lora_rank", d["q_lora_rank"])
    if q_lora_rank is not None:
        q_lora_rank = _positive(cfg, "q_lora_rank")
    kv_lora_rank = _positive(cfg, "kv_lora_rank")
    nope = _positive(cfg, "qk_nope_head_dim")
    rope_dim = _positive(cfg, "qk_rope_head_dim")
    v_dim = _positive(cfg, "v_head_dim")
    if rope_dim % 2:
        raise ModelConfigError(f"config.json: qk_rope_head_dim {rope_dim} must be even")
    num_experts = _positive(cfg, "n_routed_experts")
    top_k = _positive(cfg, "num_experts_per_tok")
    n_group, topk_group = (1, 1) if greedy else _groups(cfg, d, num_experts, top_k)  # plain top-k: no groups
    scaling = _field(cfg, "routed_scaling_factor", float, default=d["routed_scaling_factor"])
    shared = _field(cfg, "n_shared_experts", int, default=d["n_shared_experts"])
    first_dense = _field(cfg, "first_k_dense_replace", int, default=d["first_k_dense_replace"])
    freq = _positive(cfg, "moe_layer_freq", d["moe_layer_freq"])
    max_pos = _field(cfg, "max_position_embeddings", int, default=d["max_position_embeddings"])
    theta, rope_type, factor = _rope(cfg, d["rope_theta"], MLA_ROPE_TYPES)
    softmax_scale = (nope + rope_dim) ** -0.5
    yarn = None
    if rope_type == "yarn":
        yarn, all_dim = _yarn(cfg, max_pos)
        softmax_scale *= all_dim
        factor = 1.0
    moe_inter = _positive(cfg, "moe_intermediate_size")
    return ModelConfig(
        arch=arch,
        **_shared_fields(cfg, d, model_dir),
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
        norm_topk_prob=_bool(cfg, "norm_topk_prob", d["norm_topk_prob"]) and arch == "deepseek_v3",
        moe_intermediate_size=moe_inter,
        dense_intermediate_size=_positive(cfg, "intermediate_size"),
        shared_expert_intermediate_size=moe_inter * shared,
        sparse_layers=tuple(i >= first_dense and i % freq == 0 for i in range(layers)),
        sliding_windows=(None,) * layers,
        shared_expert_gate=False,
        mla=MLAConfig(q_lora_rank, kv_lora_rank, nope, rope_dim, v_dim,
                      _bool(cfg, "rope_interleave", d["rope_interleave"]) or arch == "deepseek_v2", softmax_scale),
        yarn=yarn,
        group_router=GroupRouter(n_group, topk_group, scaling, scoring),
    )


def _parse_glm4_moe(cfg: dict, model_dir: Path | None, arch: str) -> ModelConfig:
    """GLM-4.5's config.json: GQA with partial rotary, q/k/v biases, optional QK norm; DeepSeek-V3's sigmoid
    router (correction bias, groups) and shared experts; dense first layers (transformers' Glm4MoeConfig)."""
    d = DEFAULTS[arch]
    _silu_only(cfg)
    quant = cfg.get("quantization_config")
    if isinstance(quant, dict) and quant:  # GLM-4.5's FP8 checkpoints (compressed-tensors): not read yet
        raise ModelConfigError(f"config.json: quantization_config {quant.get('quant_method')!r} is not supported "
                               "for glm4_moe yet; use the BF16 checkpoint")
    hidden = _positive(cfg, "hidden_size")
    layers = _positive(cfg, "num_hidden_layers")
    heads, kv_heads = _head_counts(cfg)
    head_dim = _positive(cfg, "head_dim", hidden // heads)
    rotary_dim = _rotary_dim(cfg, d, head_dim)
    num_experts = _positive(cfg, "n_routed_experts")
    top_k = _positive(cfg, "num_experts_per_tok")
    n_group, topk_group = _groups(cfg, d, num_experts, top_k)
    first_dense = _field(cfg, "first_k_dense_replace", int, default=d["first_k_dense_replace"])
    moe_inter = _positive(cfg, "moe_intermediate_size")
    return ModelConfig(
        arch=arch,
        **_shared_fields(cfg, d, model_dir),
        **_gqa_fields(cfg, d, hidden, layers, heads, kv_heads, head_dim),
        qkv_bias=_bool(cfg, "attention_bias", d["attention_bias"]),
        qk_norm=_bool(cfg, "use_qk_norm", d["use_qk_norm"]),
        num_experts=num_experts,
        top_k=top_k,
        norm_topk_prob=_bool(cfg, "norm_topk_prob", d["norm_topk_prob"]),
        moe_intermediate_size=moe_inter,
        dense_intermediate_size=_positive(cfg, "intermediate_size"),
        shared_expert_intermediate_size=moe_inter * _field(cfg, "n_shared_experts", int, default=d["n_shared_experts"]),
        sparse_layers=tuple(i >= first_dense for i in range(layers)),
        sliding_windows=(None,) * layers,
        shared_expert_gate=False,
        rotary_dim=0 if rotary_dim == head_dim else rotary_dim,
        group_router=GroupRouter(n_group, topk_group,
                                 _field(cfg, "routed_scaling_factor", float, default=d["routed_scaling_factor"])),
    )


def _rotary_dim(cfg: dict, d: dict, head_dim: int) -> int:
    """The rotated dims of a head from partial_rotary_factor (rope_scaling's, the config's, else the default)."""
    where, scaling_obj = _rope_scaling(cfg)
    factor = scaling_obj.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    factor = d["partial_rotary_factor"] if factor is None else _number(where, "partial_rotary_factor", factor)
    rotary_dim = int(head_dim * factor)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ModelConfigError(f"config.json: partial_rotary_factor {factor} gives {rotary_dim} rotary dims of "
                               f"head_dim {head_dim}; expected a positive even number")
    return rotary_dim


def _head_counts(cfg: dict) -> tuple[int, int]:
    """(num_attention_heads, num_key_value_heads), the first a multiple of the second."""
    heads = _positive(cfg, "num_attention_heads")
    kv_heads = _positive(cfg, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise ModelConfigError(f"config.json: num_attention_heads {heads} must be a multiple of num_key_value_heads "
                               f"{kv_heads}")
    return heads, kv_heads


def _parse_qwen3_next(cfg: dict, model_dir: Path | None, arch: str) -> ModelConfig:
    """Qwen3-Next's config.json (transformers' Qwen3NextConfig): layer_types (or full_attention_interval) sets
    which layers are Gated DeltaNet and which gated attention; Qwen3-MoE's router with a sigmoid-gated shared
    expert, as Qwen2-MoE's."""
    d = DEFAULTS[arch]
    _silu_only(cfg)
    hidden = _positive(cfg, "hidden_size")
    layers = _positive(cfg, "num_hidden_layers")
    heads, kv_heads = _head_counts(cfg)
    head_dim = _positive(cfg, "head_dim", d["head_dim"])
    rotary_dim = _rotary_dim(cfg, d, head_dim)
    types = cfg.get("layer_types")
    if types is None:
        interval = _positive(cfg, "full_attention_interval", d["full_attention_interval"])
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or not set(types) <= {"linear_attention",
                                                                                "full_attention"}:
        raise ModelConfigError(f"config.json: layer_types is {types!r}; expected {layers} entries, each "
                               "'linear_attention' or 'full_attention'")
    linear = LinearAttnConfig(*(_positive(cfg, k, d[k]) for k in (
        "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
        "linear_conv_kernel_dim")))
    if linear.value_heads % linear.key_heads:
        raise ModelConfigError(f"config.json: linear_num_value_heads {linear.value_heads} must be a multiple of "
                               f"linear_num_key_heads {linear.key_heads}")
    num_experts = _positive(cfg, "num_experts")
    top_k = _positive(cfg, "num_experts_per_tok")
    if top_k > num_experts:
        raise ModelConfigError(f"config.json: num_experts_per_tok {top_k} is more than num_experts {num_experts}")
    step = _positive(cfg, "decoder_sparse_step", d["decoder_sparse_step"])
    mlp_only = cfg.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(isinstance(i, int) for i in mlp_only):
        raise ModelConfigError(f"config.json: mlp_only_layers is {mlp_only!r}; expected a list of layer indices")
    return ModelConfig(
        arch=arch,
        **_shared_fields(cfg, d, model_dir),
        **_gqa_fields(cfg, d, hidden, layers, heads, kv_heads, head_dim),
        qkv_bias=_bool(cfg, "attention_bias", d["attention_bias"]),
        qk_norm=True,
        num_experts=num_experts,
        top_k=top_k,
        norm_topk_prob=_bool(cfg, "norm_topk_prob", d["norm_topk_prob"]),
        moe_intermediate_size=_positive(cfg, "moe_intermediate_size"),
        dense_intermediate_size=_positive(cfg, "intermediate_size"),
        shared_expert_intermediate_size=_field(cfg, "shared_expert_intermediate_size", int,
                                               default=d["shared_expert_intermediate_size"]),
        sparse_layers=tuple(i not in mlp_only and (i + 1) % step == 0 for i in range(layers)),
        sliding_windows=(None,) * layers,
        rotary_dim=0 if rotary_dim == head_dim else rotary_dim,
        linear=linear,
        linear_layers=tuple(t == "linear_attention" for t in types),
        attn_output_gate=True,
        # a GGUF file's norms already hold 1 + weight (llama.cpp's converter adds it)
        norm_offset=0.0 if _bool(cfg, "norms_hold_one_plus_weight", False) else 1.0,
    )


def parse_model_config(cfg: dict, model_dir: Path | None = None) -> ModelConfig:
    if not isinstance(cfg, dict):
        raise ModelConfigError("config.json: expected a JSON object")
    arch = _arch(cfg)
    if arch == "qwen3_next":
        return _parse_qwen3_next(cfg, model_dir, arch)
    if arch in ("deepseek_v3", "deepseek_v2"):
        return _parse_deepseek_v3(cfg, model_dir, arch)
    if arch == "glm4_moe":
        return _parse_glm4_moe(cfg, model_dir, arch)
    d = DEFAULTS[arch]
    _silu_only(cfg)
    hidden = _field(cfg, "hidden_size", int)
    layers = _field(cfg, "num_hidden_layers", int)
    heads = _field(cfg, "num_attention_heads", int)
    kv_heads = _field(cfg, "num_key_value_heads", int, default=heads)
    if heads == 0 or kv_heads == 0 or heads % kv_heads:
        raise ModelConfigError(
            f"config.json: num_attention_heads {heads} must be a positive multiple of num_key_value_heads {kv_heads}"
        )
    head_dim = _field(cfg, "head_dim", int, default=hidden // heads if heads else 0)
    if head_dim == 0 or head_dim % 2:
        raise ModelConfigError(f"config.json: head_dim {head_dim} must be a positive even number")
    if arch == "mixtral":
        num_experts = _field(cfg, "num_local_experts", int)
        moe_inter = _field(cfg, "intermediate_size", int)
        dense_inter = moe_inter
        shared_inter = 0
    else:
        # transformers 5 writes Qwen3-MoE's expert count as num_local_experts
        if arch == "qwen3_moe" and cfg.get("num_experts") is None and cfg.get("num_local_experts") is None:
            raise ModelConfigError("config.json: missing required field 'num_experts' (transformers 5 writes "
                                   "'num_local_experts')")
        qwen3_v5 = arch == "qwen3_moe" and cfg.get("num_experts") is None
        key = "num_local_experts" if qwen3_v5 else "num_experts"
        num_experts = _field(cfg, key, int)
        moe_inter = _field(cfg, "moe_intermediate_size", int)
        dense_inter = _field(cfg, "intermediate_size", int)
        shared_inter = _field(cfg, "shared_expert_intermediate_size", int) if arch == "qwen2_moe" else 0
    top_k = _field(cfg, "num_experts_per_tok", int)
    if num_experts == 0 or not 1 <= top_k <= num_experts:
        raise ModelConfigError(
            f"config.json: num_experts_per_tok {top_k} must be between 1 and the number of experts ({num_experts})"
        )
    if arch == "mixtral":
        sparse = tuple(True for _ in range(layers))
    else:
        step = _field(cfg, "decoder_sparse_step", int, default=d["decoder_sparse_step"])
        if step == 0:
            raise ModelConfigError("config.json: decoder_sparse_step is 0; expected a positive integer")
        mlp_only = cfg.get("mlp_only_layers") or []
        if not isinstance(mlp_only, list) or not all(isinstance(i, int) for i in mlp_only):
            raise ModelConfigError(f"config.json: mlp_only_layers is {mlp_only!r}; expected a list of layer indices")
        sparse = tuple(i not in mlp_only and (i + 1) % step == 0 for i in range(layers))
    if arch == "qwen2_moe":
        qkv_bias = _bool(cfg, "qkv_bias", True)
    else:
        qkv_bias = _bool(cfg, "attention_bias", d["attention_bias"])
    return ModelConfig(
        arch=arch,
        **_shared_fields(cfg, d, model_dir),
        **_gqa_fields(cfg, d, hidden, layers, heads, kv_heads, head_dim),
        qkv_bias=qkv_bias,
        qk_norm=arch == "qwen3_moe",
        num_experts=num_experts,
        top_k=top_k,
        norm_topk_prob=_bool(cfg, "norm_topk_prob", d["norm_topk_prob"]) if arch != "mixtral" else True,
        moe_intermediate_size=moe_inter,
        dense_intermediate_size=dense_inter,
        shared_expert_intermediate_size=shared_inter,
        sparse_layers=sparse,
        sliding_windows=_sliding_windows(cfg, arch, layers),
    )


def load_model_config(model_dir: str | Path) -> ModelConfig:
    model_dir = Path(model_dir)
    if not model_dir.exists():
        raise ModelConfigError(f"{model_dir}: no such model folder or file: give a checkpoint folder (config.json "
                               "and safetensors) or a GGUF file (.gguf)")
    path = model_dir / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelConfigError(f"{path}: not found, and no GGUF file (.gguf) beside it: a model is a checkpoint "
                               "folder (config.json and safetensors), a GGUF file, or a folder holding one") from None
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{path}: not valid JSON: {exc}") from exc
    return parse_model_config(cfg, model_dir)
