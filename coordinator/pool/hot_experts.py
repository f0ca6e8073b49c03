"""Which experts stay whole on the device: the frozen expert profile and the choice from it.

A profile counts, per MoE layer and expert, the (token, expert) pairs the router
chose over a set of prompts. Its JSON form::

    {"format": "strata-expert-profile", "version": 1,
     "model_digest": "...", "plan_digest": "...", "num_layers": L, "num_experts": E,
     "prompts": n, "tokens": t,
     "counts": {"<layer>": [c_0, ..., c_{E-1}], ...}}

A profile is refused, with the reason, when it is from another model or its
shape does not fit this one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from shm.checkpoint import Checkpoint
from shm.expert_source import read_expert_slice

from ..config import EngineConfig
from ..errors import StrataError
from ..model.model_config import ModelConfig
from ..model.weights import MLPWeights

PROFILE_FORMAT = "strata-expert-profile"
PROFILE_VERSION = 1


class ProfileError(StrataError):
    """An expert profile is unreadable or belongs to another model."""


@dataclass(frozen=True)
class ExpertProfile:
    model_digest: str
    plan_digest: str
    num_layers: int
    num_experts: int
    counts: dict[int, tuple[int, ...]]  # MoE layer -> pairs routed to each expert
    prompts: int = 0
    tokens: int = 0

    def to_json(self) -> dict:
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "model_digest": self.model_digest,
                "plan_digest": self.plan_digest, "num_layers": self.num_layers, "num_experts": self.num_experts,
                "prompts": self.prompts, "tokens": self.tokens,
                "counts": {str(k): list(v) for k, v in sorted(self.counts.items())}}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | Path, model_digest: str, moe_layers: list[int], num_experts: int) -> "ExpertProfile":
        where = f"expert profile {path}"
        try:
            doc = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ProfileError(f"{where}: not found") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise ProfileError(f"{where}: not readable JSON: {exc}") from None
        if not isinstance(doc, dict) or doc.get("format") != PROFILE_FORMAT:
            raise ProfileError(f"{where}: not a strata expert profile (format {doc.get('format')!r})"
                               if isinstance(doc, dict) else f"{where}: not a JSON object")
        if doc.get("version") != PROFILE_VERSION:
            raise ProfileError(f"{where}: version {doc.get('version')!r}; this build reads {PROFILE_VERSION}")
        if doc.get("model_digest") != model_digest:
            raise ProfileError(f"{where}: made for model {doc.get('model_digest')}, not this model ({model_digest}); "
                               "make a new one with `strata profile`")
        if doc.get("num_experts") != num_experts:
            raise ProfileError(f"{where}: counts {doc.get('num_experts')} experts per layer; this model has "
                               f"{num_experts}")
        try:
            counts = {int(k): tuple(int(c) for c in v) for k, v in doc["counts"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ProfileError(f"{where}: malformed counts: {exc}") from None
        if sorted(counts) != sorted(moe_layers):
            raise ProfileError(f"{where}: counts layers {sorted(counts)}; this model's MoE layers are {moe_layers}")
        bad = [k for k, v in counts.items() if len(v) != num_experts or min(v) < 0]
        if bad:
            raise ProfileError(f"{where}: layer {bad[0]} does not hold {num_experts} non-negative counts")
        return cls(model_digest, doc.get("plan_digest", ""), int(doc.get("num_layers", 0)), num_experts, counts,
                   int(doc.get("prompts", 0)), int(doc.get("tokens", 0)))


def choose_device_experts(moe_layers: list[int], num_experts: int, expert_bytes: int,
                          profile: ExpertProfile | None = None, gpu_experts: int | None = None,
                          gpu_memory_bytes: int | None = None) -> tuple[frozenset[tuple[int, int]], str]:
    """(the (layer, expert) pairs kept whole on the device, how they were chosen)."""
    total = len(moe_layers) * num_experts
    if gpu_experts is not None and not 0 <= gpu_experts <= total:
        raise ValueError(f"gpu_experts {gpu_experts}: the model has {total} routed experts ({len(moe_layers)} MoE "
                         f"layers x {num_experts}); ask for 0 to {total}")
    if gpu_experts is None and gpu_memory_bytes is None:
        return frozenset(), "none"
    budget = total if gpu_experts is None else min(gpu_experts, total)
    if gpu_memory_bytes is not None:
        budget = min(budget, int(gpu_memory_bytes // expert_bytes))
    if budget <= 0:
        return frozenset(), "none"
    if profile is None:
        # unprofiled: per layer by index, the same number in every layer (earlier layers take the remainder)
        per, extra = divmod(budget, len(moe_layers))
        chosen = [(layer, e) for k, layer in enumerate(moe_layers) for e in range(per + (1 if k < extra else 0))]
        every = f"experts 0-{per - 1} of every MoE layer" if per > 1 else "expert 0 of every MoE layer" if per else ""
        more = f"expert {per} of the first {extra} MoE layers" if extra > 1 else \
            f"expert {per} of the first MoE layer" if extra else ""
        return frozenset(chosen), f"unprofiled, by index: {' and '.join(p for p in (every, more) if p)}"
    ranked = sorted(((c, layer, e) for layer, row in profile.counts.items() for e, c in enumerate(row)),
                    key=lambda t: (-t[0], t[1], t[2]))  # hottest first; ties by layer, then expert
    return frozenset((layer, e) for _, layer, e in ranked[:budget]), "profiled (hottest over all layers)"


def expert_bytes(mcfg: ModelConfig) -> int:
    """float32 bytes of one whole routed expert (gate, up, down)."""
    return 3 * mcfg.moe_intermediate_size * mcfg.hidden_size * 4


def device_expert_set(mcfg: ModelConfig, ckpt: Checkpoint, config: EngineConfig, one_expert: int | None = None,
                      memory: int | None = None):
    """(the experts kept whole on the device, how they were chosen); ``one_expert``: an expert's bytes where
    the device side holds them (a GPU's storage formats; None: float32, the NumPy side's); ``memory``: the
    bytes they may take (None: config.gpu_expert_memory's)."""
    profile = None
    if config.expert_profile:
        profile = ExpertProfile.load(config.expert_profile, ckpt.digest(), mcfg.moe_layers, mcfg.num_experts)
    if memory is None and config.gpu_expert_memory is not None:
        memory = int(config.gpu_expert_memory * 1e9)
    return choose_device_experts(mcfg.moe_layers, mcfg.num_experts, one_expert or expert_bytes(mcfg), profile,
                                 config.gpu_experts, memory)


def whole_expert(ckpt: Checkpoint, refs, mcfg: ModelConfig) -> MLPWeights:
    """The routed expert's whole float32 matrices, for the device side."""
    part = read_expert_slice(ckpt, refs, 0, mcfg.moe_intermediate_size)
    return MLPWeights(part.gate, part.up, part.down)
