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


# -- an engine's logits for one sequence A, computed in steps of every shape ---------------------------------------
rng = np.random.default_rng(0)
A = rng.integers(3, 250, 70)  # the sequence watched: long enough for a chunk of 64
OTHERS = [rng.integers(3, 250, n) for n in (5, 9, 3, 17, 2, 11, 7)]  # the sequences beside it


def alone(eng, n: int = len(A)) -> np.ndarray:
    """A's logits, one token a step: [n, V]."""
    from coordinator.model.step import StepBatch

    cache = eng.new_cache()
    return np.array([eng.step(StepBatch.of(np.array([t]), cache)).logits[0][-1] for t in A[:n]])


def beside(eng, k: int, n: int = len(A)) -> np.ndarray:
    """A's logits, one token a step in a batch with k other sequences (prefilled first, then a token a step)."""
    from coordinator.model.step import StepBatch

    cache, others = eng.new_cache(), [eng.new_cache() for _ in range(k)]
    for ids, c in zip(OTHERS, others):
        eng.step(StepBatch.of(ids, c))
    out = []
    for i, t in enumerate(A[:n]):
        seqs = [(np.array([t]), cache)] + [(OTHERS[j][i % len(OTHERS[j])][None], others[j]) for j in range(k)]
        out.append(eng.step(StepBatch(seqs)).logits[0][-1])
    return np.array(out)


def chunked(eng, size: int, n: int = len(A)) -> np.ndarray:
    """A's logits for every row, ``size`` rows a step (a prefill in chunks)."""
    from coordinator.model.step import StepBatch

    cache, out = eng.new_cache(), []
    for s in range(0, n, size):
        out.extend(eng.step(StepBatch.of(A[s:min(s + size, n)], cache, every_row=True)).logits[0])
    return np.array(out)


def drafted(eng, n: int = len(A)) -> np.ndarray:
    """A's logits as a drafting step sees them: a token and 1 to 4 drafts a step, beside two other sequences."""
    from coordinator.model.step import StepBatch

    cache, others = eng.new_cache(), [eng.new_cache() for _ in range(2)]
    for ids, c in zip(OTHERS, others):
        eng.step(StepBatch.of(ids, c))
    out, s, width = [], 0, 1
    while s < n:
        rows = A[s:min(s + width, n)]
        seqs = [(rows, cache)] + [(OTHERS[j][s % len(OTHERS[j])][None], others[j]) for j in range(2)]
        out.extend(eng.step(StepBatch(seqs, all_rows=frozenset({0}))).logits[0])
        s += len(rows)
        width = width % 5 + 1  # 1, 2, 3, 4, 5 rows: a token and up to 4 drafts
    return np.array(out)


def every_step_shape(eng, n: int = len(A)) -> dict[str, np.ndarray]:
    """A's logits in every step shape the issue names, by name."""
    return {"batch of 3": beside(eng, 2, n), "batch of 8": beside(eng, 7, n), "drafts": drafted(eng, n),
            **{f"chunks of {size}": chunked(eng, size, n) for size in (1, 7, 64)}}


def unequal(got: np.ndarray, want: np.ndarray) -> list[int]:
    """The rows whose bits differ."""
    return [i for i in range(len(want)) if not np.array_equal(got[i], want[i])]
