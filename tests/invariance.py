"""Helpers of the tests that a row's result does not depend on the rows beside it (issue 62)."""

from __future__ import annotations

import numpy as np


def first_token_alone_and_beside(worker, hidden: int, counts: tuple[int, ...],
                                 seed: int = 7) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """A node worker's partial output for token 0 computed alone, and beside T - 1 other tokens for each T in
    ``counts`` (token 0 to experts 0 and 1, the others to two of experts 0-2: some share its experts, some not);
    the worker is closed after."""
    rng = np.random.default_rng(seed)
    n = max(counts)
    x = rng.standard_normal((n, hidden)).astype(np.float32)
    pairs = np.array([(0, 1)] + [(t % 3, (t + 1) % 3) for t in range(1, n)])
    w = rng.random(2 * n).astype(np.float32)

    def token_0(T: int) -> np.ndarray:
        return worker.compute(0, x[:T], np.repeat(np.arange(T), 2), pairs[:T].reshape(-1), w[:2 * T])[0].copy()

    try:
        return token_0(1), {T: token_0(T) for T in counts}
    finally:
        worker.close()
