"""Choosing the next token from logits: penalties, greedy, temperature, top-k, top-p, min-p; and logprobs.

The order, as vLLM's: the repetition penalty, then the frequency and presence
penalties on the raw logits (``penalized``); greedy takes the argmax of those,
sampling divides them by the temperature, keeps the top-k, then the top-p
prefix, then the tokens at least min-p times as probable as the most probable
one (``filtered_probs``). Every step is skipped when its parameter is off, so
the defaults cost nothing and choose exactly what plain greedy/temperature
sampling chooses.
"""

from __future__ import annotations

import numpy as np

from .ops import softmax
from .sampling_params import SamplingParams


def penalized(logits: np.ndarray, params: SamplingParams, prompt_counts: np.ndarray,
              output_counts: np.ndarray) -> np.ndarray:
    """logits [V] -> the logits after the penalties (float64), or ``logits`` itself when they are all off.

    ``prompt_counts`` and ``output_counts`` [V] count each id in the prompt and among the generated tokens.
    Repetition (HF/vLLM): the logit of every id in the prompt or the output is divided by
    ``repetition_penalty`` when positive and multiplied by it otherwise. Then (OpenAI/vLLM)
    ``frequency_penalty * count`` and ``presence_penalty`` (once) come off every id generated so far. Then
    each (id, bias) of ``logit_bias`` is added.
    """
    if not params.penalized:
        return logits
    out = logits.astype(np.float64)
    if params.repetition_penalty != 1:
        r = params.repetition_penalty
        seen = (prompt_counts > 0) | (output_counts > 0)
        out = np.where(seen, np.where(out > 0, out / r, out * r), out)
    if params.frequency_penalty:
        out -= params.frequency_penalty * output_counts
    if params.presence_penalty:
        out -= params.presence_penalty * (output_counts > 0)
    for token, bias in params.logit_bias:  # OpenAI's logit_bias: added last, so it steers greedy decoding too
        out[token] += bias
    return out


def filtered_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """logits [V] -> the distribution sampled from, after temperature, top-k, top-p and min-p."""
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
    if params.min_p > 0:  # renormalising above does not move the ratios to the most probable token
        probs = np.where(probs >= params.min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
    return probs


def top_logprobs(logits: np.ndarray, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """logits [V] -> (log-probability of ``token``, the ``n`` most likely (id, log-probability) pairs, most
    likely first, ties by id), from the float64 log-softmax of ``logits``."""
    x = logits.astype(np.float64)
    m = x.max()
    lp = x - (m + np.log(np.exp(x - m).sum()))
    n = min(n, lp.size)
    if n <= 0:
        return float(lp[token]), []
    top = np.argpartition(-lp, n - 1)[:n]
    top = top[np.lexsort((top, -lp[top]))]
    return float(lp[token]), [(int(i), float(lp[i])) for i in top]


class Sampler:
    """Chooses the tokens of one sequence; counts what the penalties need (the prompt's ids, the ones chosen
    so far) when one is on; keeps the choice inside a grammar when given a ``constraint`` (grammar.py)."""

    def __init__(self, params: SamplingParams, prompt_ids=(), constraint=None):
        self.params = params
        self.constraint = constraint
        self.rng = np.random.default_rng(params.seed)
        self._prompt_ids = np.asarray(list(prompt_ids), np.int64) if params.penalized else None
        self.prompt_counts: np.ndarray | None = None  # [V], made on the first call (it knows V) when a penalty is on
        self.output_counts: np.ndarray | None = None

    def adjusted(self, logits: np.ndarray) -> np.ndarray:
        """logits [V] -> the logits this sampler chooses from (after the penalties)."""
        if not self.params.penalized:
            return logits
        if self.output_counts is None:
            v = logits.shape[-1]
            ids = self._prompt_ids
            self.prompt_counts = np.bincount(ids[(ids >= 0) & (ids < v)], minlength=v)
            self.output_counts = np.zeros(v, np.int64)
        return penalized(logits, self.params, self.prompt_counts, self.output_counts)

    def choose(self, logits: np.ndarray, draft: int | None = None) -> tuple[int, np.ndarray]:
        """logits [V] -> (the token id, the penalised logits it was chosen from, before the grammar's mask: the
        logprobs' distribution); the token is counted and the grammar advanced past it.

        ``draft`` (speculative decoding, coordinator/speculative.py): a token proposed with certainty. Greedy
        decoding ignores it (the caller compares). Sampling takes it with its probability p(draft) under the
        distribution sampled from, and otherwise draws from that distribution without it, renormalised: the
        token's distribution is the same as without a draft."""
        adjusted = self.adjusted(logits)
        allowed = adjusted if self.constraint is None else self.constraint.mask(adjusted)
        if self.params.temperature == 0:
            token = int(np.argmax(allowed))
        else:
            probs = filtered_probs(allowed, self.params)
            if draft is not None and self.rng.random() < probs[draft]:
                token = draft
            else:
                if draft is not None:  # rejected, so p(draft) < 1 and the rest has mass
                    probs = probs.copy()
                    probs[draft] = 0.0
                    probs /= probs.sum()
                token = int(self.rng.choice(probs.size, p=probs))
        if self.output_counts is not None:
            self.output_counts[token] += 1
        if self.constraint is not None:
            self.constraint.accept(token)
        return token, adjusted

    def __call__(self, logits: np.ndarray) -> int:
        """logits [V] -> a token id."""
        return self.choose(logits)[0]
