"""config.json -> ModelConfig, for the three supported MoE architectures.

Keys are read as transformers writes them, in both the 4.x form (``rope_theta``
and ``rope_scaling`` at top level) and the 5.x form (``rope_parameters``).
Defaults for absent keys are those of the transformers config classes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelConfigError

ARCHITECTURES = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
}
SUPPORTED_ROPE_TYPES = ("default", "linear")

# transformers' config-class defaults for keys that may be absent
DEFAULTS = {
    "qwen3_moe": dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768, norm_topk_prob=False,
                      decoder_sparse_step=1, attention_bias=False, tie_word_embeddings=False),
    "mixtral": dict(rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=4096 * 32, norm_topk_prob=True,
                    decoder_sparse_step=1, attention_bias=False, tie_word_embeddings=False),
    "qwen2_moe": dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768, norm_topk_prob=False,
                      decoder_sparse_step=1, attention_bias=True, tie_word_embeddings=False),
}


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
    sparse_layers: tuple[bool, ...]  # per layer: MoE (True) or dense MLP (False)
    sliding_windows: tuple[int | None, ...]  # per layer: window length or None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, sparse in enumerate(self.sparse_layers) if sparse]


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


def _rope(cfg: dict, default_theta: float) -> tuple[float, str, float]:
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
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"config.json: {where}.rope_type '{rope_type}' is not supported; expected one of "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
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


def parse_model_config(cfg: dict, model_dir: Path | None = None) -> ModelConfig:
    if not isinstance(cfg, dict):
        raise ModelConfigError("config.json: expected a JSON object")
    arch = _arch(cfg)
    d = DEFAULTS[arch]
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"config.json: hidden_act '{act}' is not supported; expected 'silu'")
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
    theta, rope_type, factor = _rope(cfg, d["rope_theta"])
    if arch == "qwen2_moe":
        qkv_bias = _bool(cfg, "qkv_bias", True)
    else:
        qkv_bias = _bool(cfg, "attention_bias", d["attention_bias"])
    return ModelConfig(
        arch=arch,
        vocab_size=_field(cfg, "vocab_size", int),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_field(cfg, "rms_norm_eps", float, default=d["rms_norm_eps"]),
        rope_theta=theta,
        rope_type=rope_type,
        rope_factor=factor,
        max_position_embeddings=_field(cfg, "max_position_embeddings", int, default=d["max_position_embeddings"]),
        tie_word_embeddings=_bool(cfg, "tie_word_embeddings", d["tie_word_embeddings"]),
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
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg, model_dir),
    )


def load_model_config(model_dir: str | Path) -> ModelConfig:
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelConfigError(f"{path}: not found; a model directory needs config.json") from None
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{path}: not valid JSON: {exc}") from exc
    return parse_model_config(cfg, model_dir)
