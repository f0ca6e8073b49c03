"""A row's result does not depend on the rows beside it (issue 62): one sequence's logits decoded alone, in a
batch of 3 or 8 sequences, with drafts (several rows of it at once) and prefilled in chunks, bit for bit, on
GGUF files llama.cpp's converter and llama-quantize made (K types and IQ4_XS: their experts' and dense
matrices' integer loops sum each (row, token) in one order), through every pool. Not yet so: Q8_0's and
Q4_0's integer loops (isimd.py, iblock.py, rows8.py), float32 dense matrices taken by BLAS (a safetensors
model's on the host, and every matrix's by float activations past 8 rows), a K type's dense matrices past 96
rows (BLAS on decoded tiles: a prefill in chunks of 96 tokens or more), MLA, Qwen3-Next's chunked linear attention
and the GPU's kernels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from coordinator import Engine, EngineConfig
from coordinator.model.step import StepBatch

FIXTURES = Path(__file__).parent / "fixtures" / "gguf"
rng = np.random.default_rng(0)
A = rng.integers(3, 250, 20)  # the sequence watched
OTHERS = [rng.integers(3, 250, n) for n in (5, 9, 3, 17, 2, 11, 7)]  # the sequences beside it


def alone(eng) -> np.ndarray:
    """A's logits, one token a step: [len(A), V]."""
    cache = eng.new_cache()
    return np.array([eng.step(StepBatch.of(np.array([t]), cache)).logits[0][-1] for t in A])


def beside(eng, k: int) -> np.ndarray:
    """A's logits, one token a step in a batch with k other sequences (prefilled first, then a token a step)."""
    cache, others = eng.new_cache(), [eng.new_cache() for _ in range(k)]
    for ids, c in zip(OTHERS, others):
        eng.step(StepBatch.of(ids, c))
    out = []
    for i, t in enumerate(A):
        seqs = [(np.array([t]), cache)] + [(OTHERS[j][i % len(OTHERS[j])][None], others[j]) for j in range(k)]
        out.append(eng.step(StepBatch(seqs)).logits[0][-1])
    return np.array(out)


def chunked(eng, n: int) -> np.ndarray:
    """A's logits for every row, n rows a step (a prefill in chunks of n; drafts are such steps too)."""
    cache, out = eng.new_cache(), []
    for s in range(0, len(A), n):
        out.extend(eng.step(StepBatch.of(A[s:s + n], cache, every_row=True)).logits[0])
    return np.array(out)


def drafted(eng) -> np.ndarray:
    """A's logits as a drafting step sees them: a token and 1 to 4 drafts a step, beside two other sequences."""
    cache, others = eng.new_cache(), [eng.new_cache() for _ in range(2)]
    for ids, c in zip(OTHERS, others):
        eng.step(StepBatch.of(ids, c))
    out, s, width = [], 0, 1
    while s < len(A):
        rows = A[s:s + width]
        seqs = [(rows, cache)] + [(OTHERS[j][s % len(OTHERS[j])][None], others[j]) for j in range(2)]
        out.extend(eng.step(StepBatch(seqs, all_rows=frozenset({0}))).logits[0])
        s += len(rows)
        width = width % 5 + 1  # 1, 2, 3, 4, 5 rows: a token and up to 4 drafts
    return np.array(out)


def unequal(got: np.ndarray, want: np.ndarray) -> list[int]:
    return [i for i in range(len(want)) if not np.array_equal(got[i], want[i])]


@pytest.mark.parametrize("name", ["qwen3_moe_quant-Q4_K_M", "qwen3_moe_quant-IQ4_XS", "qwen2_moe_quant-Q4_K_M",
                                  "mixtral_quant-Q4_K_M"])
def test_a_sequences_logits_are_the_same_bits_in_any_step(name):
    """With the default integer activations (activations f32 takes BLAS on decoded tiles past 8 rows, whose
    sums change with the row count: not yet invariant)."""
    with Engine.open(FIXTURES / f"{name}.gguf", EngineConfig(pool="inproc", device="cpu")) as eng:
        want = alone(eng)
        got = {"batch of 3": beside(eng, 2), "batch of 8": beside(eng, 7), "drafts": drafted(eng),
               **{f"chunks of {n}": chunked(eng, n) for n in (1, 7, 20)}}
    assert np.abs(want).max() > 0 and len({w.argmax() for w in want}) > 1
    assert {how: unequal(logits, want) for how, logits in got.items()} == {how: [] for how in got}


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["single", "split"])
def test_the_same_bits_through_the_node_workers(pool):
    """The process pool's workers (one, or two virtual nodes each holding half of every expert's rows, their
    partials added in node order) give a row the same bits in any step, and the in-process pool's bits."""
    path = FIXTURES / "qwen3_moe_quant-Q4_K_M.gguf"
    with Engine.open(path, EngineConfig(pool="inproc", device="cpu")) as eng:
        inproc = alone(eng)
    split = dict(numa_split=True, nodes=2) if pool == "split" else dict(nodes=1)
    with Engine.open(path, EngineConfig(pool="process", device="cpu", **split)) as eng:
        want = alone(eng)
        got = {"batch of 8": beside(eng, 7), "drafts": drafted(eng), "chunks of 7": chunked(eng, 7)}
    if pool == "single":
        assert unequal(want, inproc) == []
    assert {how: unequal(logits, want) for how, logits in got.items()} == {how: [] for how in got}
