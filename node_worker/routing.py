"""Grouping routed (token, expert, weight) triples by expert, deterministically."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ExpertGroup:
    expert: int
    tokens: np.ndarray  # [n] int64 row indices into X, ascending
    weights: np.ndarray  # [n] float32 routing weights


def group_by_expert(tokens: np.ndarray, experts: np.ndarray, weights: np.ndarray) -> list[ExpertGroup]:
    """Triples [P] -> one group per expert, experts ascending, tokens ascending within each."""
    order = np.lexsort((tokens, experts))  # by expert, then token
    experts_sorted = experts[order]
    bounds = np.flatnonzero(np.diff(experts_sorted)) + 1
    groups = []
    for idx in np.split(order, bounds):
        if idx.size:
            groups.append(ExpertGroup(int(experts[idx[0]]), tokens[idx], weights[idx]))
    return groups
