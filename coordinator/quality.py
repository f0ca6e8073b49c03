"""How far one computation's next-token logits are from a reference's (the formats' quality figures)."""

from __future__ import annotations

import numpy as np


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def compare_logits(ref: np.ndarray, got: np.ndarray) -> dict:
    """ref, got [positions, V]: the max relative logits error (max |Δ| over max |ref|), the mean
    KL(ref || got) of the next-token distributions and the top-1 agreement."""
    lp, lq = log_softmax(ref), log_softmax(got)
    return {"max_rel_logits_error": float(np.abs(got - ref).max() / np.abs(ref).max()),
            "mean_kl": float((np.exp(lp) * (lp - lq)).sum(axis=-1).mean()),
            "top1_agreement": float((ref.argmax(-1) == got.argmax(-1)).mean()), "positions": int(ref.shape[0])}
