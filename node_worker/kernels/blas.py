"""Expert math, shared by the in-process pool and the node worker processes.

A node holds rows R of each expert's intermediate dimension; its partial output
for tokens x is ``(silu(x·W_gate[R]ᵀ) ⊙ (x·W_up[R]ᵀ)) · W_down[:, R]ᵀ``. Summed
over the nodes of a plan this is the whole expert.
"""

from __future__ import annotations

import numpy as np


def sigmoid(x: np.ndarray) -> np.ndarray:
    # tanh form: no overflow for large |x|
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def swiglu_partial(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down_t: np.ndarray) -> np.ndarray:
    """x [n, H]; gate, up, down_t [R, H] -> this slice's contribution [n, H]."""
    g = x @ gate.T  # [n, R]
    u = x @ up.T  # [n, R]
    return (silu(g) * u) @ down_t  # [n, H]
