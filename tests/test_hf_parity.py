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
