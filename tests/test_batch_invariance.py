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


@pytest.mark.slow
def test_a_served_request_gets_the_same_greedy_answer_alone_and_among_8(tmp_path):
    """`strata serve` on a Q4_K_M file: a greedy request's answer sent alone, and its tokens' log-probabilities to
    the last bit, are what it gets among 8 concurrent ones (each stream open before any goes on: the server
    steps them together)."""
    import threading

    import openai
    from served import start_server, stop_server

    s = start_server(FIXTURES / "qwen3_moe_quant-Q4_K_M.gguf", tmp_path, "--http", "127.0.0.1:0")
    try:
        client = openai.OpenAI(base_url=s.http_url + "/v1", api_key="none", max_retries=0, timeout=120)
        prompts = [[int(t) for t in A[:6]]] + [[int(t) for t in ids] for ids in OTHERS]  # 8, A's first

        def ask(prompt: list[int], stream: bool = False, started: threading.Barrier | None = None) -> tuple:
            """(the text, each token's log-probability)."""
            r = client.completions.create(model="qwen3_moe_quant-Q4_K_M.gguf", prompt=prompt, max_tokens=40,
                                          temperature=0, logprobs=1, stream=stream)
            if not stream:
                return r.choices[0].text, tuple(r.choices[0].logprobs.token_logprobs)
            pieces, logprobs = [], []
            for n, chunk in enumerate(r):
                pieces.append(chunk.choices[0].text)
                if chunk.choices[0].logprobs is not None:
                    logprobs += chunk.choices[0].logprobs.token_logprobs
                if n == 0 and started is not None:
                    started.wait()  # every stream open before any goes on
            return "".join(pieces), tuple(logprobs)

        alone = ask(prompts[0])
        answers: list = [None] * len(prompts)
        started = threading.Barrier(len(prompts), timeout=120)

        def run(i: int) -> None:
            try:
                answers[i] = ask(prompts[i], stream=True, started=started)
            except BaseException as exc:  # noqa: BLE001 - checked below, in the test's thread
                started.abort()
                answers[i] = exc

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
    finally:
        assert stop_server(s) == 0, s.stderr()
    assert all(isinstance(a, tuple) for a in answers), answers
    assert alone[0] and len(alone[1]) == 40 and answers[0] == alone
    assert len({text for text, _ in answers}) > 1  # the others asked other things
