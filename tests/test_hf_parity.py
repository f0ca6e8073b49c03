"""Against checkpoints and outputs written by Hugging Face transformers itself.

tests/fixtures/hf/ was made by `tools/hf_reference.py` (transformers and torch
versions in versions.json): random tiny models of each architecture, saved with
save_pretrained (F32, F16, BF16, sharded, 4.x- and 5.x-style config.json), with
the logits and greedy continuation transformers computed from the saved files.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from coordinator import Engine, EngineConfig
from coordinator.request import GenerateRequest
from coordinator.scheduler import Scheduler

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
CASES = sorted(p.name for p in FIXTURES.iterdir() if (p / "reference.npz").exists()) if FIXTURES.is_dir() else []


def test_fixture_set_is_present():
    archs = {c.split("_")[0] for c in CASES}
    assert {"qwen3", "mixtral", "qwen2"} <= archs, CASES


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("split", [None, 2])
def test_logits_and_greedy_match_transformers(case, split):
    ref = np.load(FIXTURES / case / "reference.npz")
    prompt = ref["input_ids"].tolist()
    config = EngineConfig(numa_split=True, nodes=split) if split else EngineConfig()
    with Engine.open(FIXTURES / case, config) as eng:
        logits = eng.logits(prompt)
        err = float(np.max(np.abs(logits - ref["logits"])))
        assert err < 2e-4, f"{case}: max abs logit error {err:.2e} vs transformers"
        full = eng.logits(prompt + ref["greedy_ids"].tolist())
        assert float(np.max(np.abs(full - ref["full_logits"]))) < 2e-4
        greedy = eng.generate(prompt, max_new_tokens=len(ref["greedy_ids"]), temperature=0.0, stop_at_eos=False)
    assert greedy == ref["greedy_ids"].tolist(), case


DEEPSEEK = [c for c in CASES if c.startswith(("deepseek_v3", "deepseek_v2", "glm4_moe"))]


@pytest.mark.slow
@pytest.mark.parametrize("case", DEEPSEEK)
def test_deepseek_node_workers_single_and_split_over_2_and_3(case):
    """Node worker processes, one holding whole experts and 2 or 3 holding rows: within 2e-4 of transformers,
    greedy identical, decode steps (the absorbed attention on the cached latents) too, and the split bitwise
    equal to the in-process pool on the same plan."""
    ref = np.load(FIXTURES / case / "reference.npz")
    prompt, greedy = ref["input_ids"].tolist(), ref["greedy_ids"].tolist()
    for nodes in (None, 2, 3):
        split = dict(numa_split=True, nodes=nodes) if nodes else {}
        with Engine.open(FIXTURES / case, EngineConfig(pool="process", **split)) as eng:
            logits = eng.logits(prompt)
            steps = eng.logits(prompt + greedy, steps=True)
            ids = eng.generate(prompt, max_new_tokens=len(greedy), temperature=0.0, stop_at_eos=False)
        assert float(np.max(np.abs(logits - ref["logits"]))) < 2e-4, (case, nodes)
        assert float(np.max(np.abs(steps - ref["full_logits"]))) < 2e-4, (case, nodes)
        assert ids == greedy, (case, nodes)
        with Engine.open(FIXTURES / case, EngineConfig(pool="inproc", **split)) as eng:
            assert np.array_equal(eng.logits(prompt), logits), (case, nodes)
            assert np.array_equal(eng.logits(prompt + greedy, steps=True), steps), (case, nodes)


QWEN3_NEXT = [c for c in CASES if c.startswith("qwen3_next")]


def relative(x: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))


def served_greedy(eng, prompt: list[int], new: int, prefill_chunk: int) -> tuple[list[int], int]:
    """The serving loop's greedy tokens with the prompt prefilled ``prefill_chunk`` tokens a step, and its steps."""
    out = {}
    sched = Scheduler(eng, lambda _c, ev: out.update(ev) if ev["type"] == "final" else None, max_active=1,
                      max_queued=1, prefill_chunk=prefill_chunk)
    sched.add(b"c", GenerateRequest(id="r", prompt_ids=tuple(prompt), max_new_tokens=new, temperature=0.0,
                                    ignore_eos=True, stream=False))
    while sched.busy:
        sched.step()
    return out["ids"], sched.stats["steps"]


@pytest.mark.slow
@pytest.mark.parametrize("case", QWEN3_NEXT)
def test_qwen3_next_node_workers_single_and_split_chunked_prefill(case):
    """Qwen3-Next (Gated DeltaNet and gated attention, 3:1), its 150-token prompt longer than two of the delta rule's
    64-token chunks: node worker processes, one holding whole experts and two holding rows, give transformers'
    logits within 1e-4 relative, over the prompt at once and a decode step a token (the recurrent form); greedy
    generation, its prompt prefilled 48 tokens a step (each piece continuing the states the last left), is
    transformers' greedy; the split is bitwise equal to the in-process pool on the same plan.

    transformers' own cached generation (greedy_logits) is not compared: with transformers 5.25 it differs from
    its full forward by up to 0.46 (summary.txt's max|kvcache-full|); its greedy tokens equal the full forward's
    argmax, and those are compared."""
    ref = np.load(FIXTURES / case / "reference.npz")
    prompt, greedy = ref["input_ids"].tolist(), ref["greedy_ids"].tolist()
    assert len(prompt) > 2 * 64
    for nodes in (None, 2):
        split = dict(numa_split=True, nodes=nodes) if nodes else {}
        with Engine.open(FIXTURES / case, EngineConfig(pool="process", **split)) as eng:
            logits = eng.logits(prompt)
            steps = eng.logits(prompt + greedy, steps=True)
            ids, n_steps = served_greedy(eng, prompt, len(greedy), prefill_chunk=48)
            whole = eng.generate(prompt, max_new_tokens=len(greedy), temperature=0.0, stop_at_eos=False)
        assert relative(logits, ref["logits"]) < 1e-4, (case, nodes)
        assert relative(steps, ref["full_logits"]) < 1e-4, (case, nodes)
        assert ids == greedy and whole == greedy, (case, nodes)
        assert n_steps == -(-len(prompt) // 48) + len(greedy) - 1, n_steps  # the prompt took 4 steps
        with Engine.open(FIXTURES / case, EngineConfig(pool="inproc", **split)) as eng:
            assert np.array_equal(eng.logits(prompt), logits), (case, nodes)
            assert np.array_equal(eng.logits(prompt + greedy, steps=True), steps), (case, nodes)
