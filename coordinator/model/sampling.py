"""Choosing the next token from logits: greedy, temperature, top-k, top-p."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConfigValueError
from .ops import softmax


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ConfigValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ConfigValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ConfigValueError(f"top_p must be in (0, 1], got {self.top_p!r}")


def filtered_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """logits [V] -> the distribution sampled from, after temperature, top-k and top-p."""
    scaled = logits.astype(np.float64) / params.temperature
    if params.top_k and params.top_k < scaled.size:
        kth = np.partition(scaled, -params.top_k)[-params.top_k]
        scaled = np.where(scaled >= kth, scaled, -np.inf)
    probs = softmax(scaled)
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        mass_before = np.cumsum(probs[order]) - probs[order]  # of the more probable tokens
        # keep the smallest prefix whose mass reaches top_p: a token stays while
        # the tokens above it hold less than top_p (the first always stays)
        mask = np.zeros_like(probs, dtype=bool)
        mask[order[mass_before < params.top_p]] = True
        probs = np.where(mask, probs, 0.0)
        probs /= probs.sum()
    return probs


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        """logits [V] -> a token id."""
        if self.params.temperature == 0:
            return int(np.argmax(logits))
        probs = filtered_probs(logits, self.params)
        return int(self.rng.choice(probs.size, p=probs))
