"""SamplingParams: how one sequence's tokens are chosen (sampling.py chooses them).

Apart from the sampler so that what only names the parameters (coordinator/request.py, the command line's
flags) does not load the array code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigValueError


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a token's bias


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None
    min_p: float = 0.0  # 0 = off; keep tokens with p >= min_p * max p
    presence_penalty: float = 0.0  # 0 = off; subtracted once from each id already generated
    frequency_penalty: float = 0.0  # 0 = off; subtracted per occurrence among the generated ids
    repetition_penalty: float = 1.0  # 1 = off; divides positive (multiplies negative) logits of prompt/generated ids
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), after the penalties

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ConfigValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ConfigValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ConfigValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (_number(self.min_p) and 0 <= self.min_p <= 1):
            raise ConfigValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _number(getattr(self, name)):
                raise ConfigValueError(f"{name} must be a finite number, got {getattr(self, name)!r}")
        if not (_number(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ConfigValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for pair in self.logit_bias:
            if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], int) and pair[0] >= 0
                    and _number(pair[1]) and -MAX_LOGIT_BIAS <= pair[1] <= MAX_LOGIT_BIAS):
                raise ConfigValueError(f"logit_bias holds (token id, bias in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]) "
                                       f"pairs, got {pair!r}")

    @property
    def penalized(self) -> bool:
        """Whether any penalty or bias is on (else the logits are used as they come)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1 or self.logit_bias)
