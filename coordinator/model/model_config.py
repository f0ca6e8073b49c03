"""config.json -> ModelConfig: the family config.json names (coordinator/model/arch/, a file a family) reads it.

The configuration's types live in arch/base.py and are named here too, where the rest of the coordinator takes
them from; each family's defaults are transformers' config classes'.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable

from ..errors import ModelConfigError
from .arch import FAMILIES, family, of_config
from .arch.base import GroupRouter, LinearAttnConfig, MLAConfig, ModelConfig, MtpNames, YarnConfig, yarn_get_mscale

MTP_ARCHS = tuple(name for name, f in FAMILIES.items() if f.mtp)  # the families whose MTP layer runs

__all__ = ["GroupRouter", "LinearAttnConfig", "MLAConfig", "ModelConfig", "MtpNames", "YarnConfig", "MTP_ARCHS",
           "attach_mtp", "load_model_config", "mtp_names", "parse_model_config", "yarn_get_mscale"]


def mtp_names(cfg: ModelConfig, holds: Callable[[str], bool]) -> MtpNames | None:
    """The names of the checkpoint's first multi-token-prediction layer (``holds``: whether it has a tensor), or None
    where it holds none: DeepSeek-V3's nextn names model.layers.L.{enorm,hnorm,eh_proj,shared_head.*,embed_tokens}
    beside a layer's usual ones (a GGUF file's blk.L.nextn.* are read under them, Qwen3-Next's too), or Qwen3-Next's
    mtp.{pre_fc_norm_embedding,pre_fc_norm_hidden,fc,norm} around the decoder layer mtp.layers.0."""
    return family(cfg.arch).mtp_names(cfg, holds)


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
                               mtp_chains_normed=family(cfg.arch).mtp_chains_normed)


def parse_model_config(cfg: dict, model_dir: Path | None = None) -> ModelConfig:
    if not isinstance(cfg, dict):
        raise ModelConfigError("config.json: expected a JSON object")
    return of_config(cfg).parse(cfg, model_dir)


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
