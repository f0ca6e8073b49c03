"""What one decode step asks of a GPU, counted on the CPU (tests/device_standin.py's COUNTS): kernel launches,
allocations, host<->device copies and synchronisations, per step and per layer, for each architecture.

The per-layer figure is the difference between a 2-layer and a 1-layer model's step; the rest of the step
(embedding, final norm, lm_head, the logits' download) is the 1-layer step less one layer. BUDGETS holds
today's counts: a change that asks more of the GPU per decode step fails here, and one that asks less lowers
the budget with it."""

from __future__ import annotations

import numpy as np
import pytest

import device_standin
from coordinator import Engine, EngineConfig
from coordinator.model.step import StepBatch

KINDS = ("launches", "allocations", "uploads", "downloads", "syncs")
GEOMETRY = dict(hidden_size=256, moe_intermediate_size=256, dense_intermediate_size=256, head_dim=32, num_heads=4,
                num_kv_heads=2, vocab_size=320)
ARCHS = {
    "qwen3_moe": {},
    "qwen2_moe": {},
    "mixtral": {},
    "deepseek_v3": dict(kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, q_lora_rank=64,
                        n_group=2, topk_group=1),
    "glm4_moe": dict(n_group=2, topk_group=1),
}
# a decode step's counts: a layer with every expert on the CPU, the rest of the step, and a layer with hot experts
# (8, or 4 for the grouped routers' models, over the model; how many a layer serves follows the routing). GQA's
# attention is two launches, split over the keys then merged (device_ops.gqa_attention), with its partials and
# their (max, sum) in place of the context-long scores.
BUDGETS = {
    "qwen3_moe": {
        "layer": dict(launches=12, allocations=14, uploads=1, downloads=2, syncs=3),
        "rest": dict(launches=3, allocations=7, uploads=4, downloads=1, syncs=1),
        "layer with hot experts": dict(launches=19, allocations=26, uploads=6, downloads=1, syncs=1),
    },
    "qwen2_moe": {
        "layer": dict(launches=24, allocations=26, uploads=1, downloads=2, syncs=3),
        "rest": dict(launches=3, allocations=7, uploads=4, downloads=1, syncs=1),
        "layer with hot experts": dict(launches=31, allocations=38, uploads=6, downloads=1, syncs=1),
    },
    "mixtral": {
        "layer": dict(launches=12, allocations=14, uploads=1, downloads=2, syncs=3),
        "rest": dict(launches=3, allocations=7, uploads=4, downloads=1, syncs=1),
        "layer with hot experts": dict(launches=17, allocations=26, uploads=8, downloads=3, syncs=5),
    },
    "deepseek_v3": {
        "layer": dict(launches=23, allocations=23, uploads=1, downloads=2, syncs=3),
        "rest": dict(launches=3, allocations=7, uploads=4, downloads=1, syncs=1),
        "layer with hot experts": dict(launches=29, allocations=35, uploads=7, downloads=2, syncs=3),
    },
    "glm4_moe": {
        "layer": dict(launches=18, allocations=20, uploads=1, downloads=2, syncs=3),
        "rest": dict(launches=3, allocations=7, uploads=4, downloads=1, syncs=1),
        "layer with hot experts": dict(launches=23, allocations=32, uploads=8, downloads=3, syncs=5),
    },
}


def step_counts(model, **config) -> dict[str, int]:
    """What the third decode step after a 4-token prompt asks of the GPU (the first ones load kernels)."""
    with Engine.open(model, EngineConfig(device="cuda", pool="inproc", **config)) as eng:
        cache = eng.new_cache()
        eng.step(StepBatch.of(np.array([72, 101, 108, 108]), cache)).logits[0]
        for token in (111, 44):
            eng.step(StepBatch.of(np.array([token]), cache)).logits[0]
        with device_standin.counting() as counts:
            eng.step(StepBatch.of(np.array([32]), cache)).logits[0]
        return {k: counts[k] for k in KINDS}


def layer_and_rest(tiny_model, arch: str, **config) -> tuple[dict, dict]:
    one = step_counts(tiny_model(f"{arch}-1", arch=arch, num_layers=1, **GEOMETRY, **ARCHS[arch]), **config)
    two = step_counts(tiny_model(f"{arch}-2", arch=arch, num_layers=2, **GEOMETRY, **ARCHS[arch]), **config)
    layer = {k: two[k] - one[k] for k in KINDS}
    return layer, {k: one[k] - layer[k] for k in KINDS}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_decode_step_stays_within_its_budget(gpu, tiny_model, arch):
    layer, rest = layer_and_rest(tiny_model, arch)
    hot_layer, _ = layer_and_rest(tiny_model, arch, gpu_experts=8 if arch not in ("deepseek_v3", "glm4_moe") else 4)
    got = {"layer": layer, "rest": rest, "layer with hot experts": hot_layer}
    budget = BUDGETS[arch]
    for part, counts in got.items():
        for kind in KINDS:
            assert counts[kind] <= budget[part][kind], (arch, part, kind, counts, budget[part])
    assert layer["launches"] > 0 and layer["syncs"] > 0  # the counter sees the step (a stand-in that counts)


def test_one_more_call_a_layer_is_seen(gpu, tiny_model, monkeypatch):
    """The counts are the code's: one more CuPy allocation and fill in each MoE layer raises the per-layer
    figures by one each, which the budgets above would refuse."""
    from coordinator.model.decoder import Decoder

    before, _ = layer_and_rest(tiny_model, "qwen3_moe")
    moe = Decoder.moe
    monkeypatch.setattr(Decoder, "moe",
                        lambda self, i, lw, x, routed=None: moe(self, i, lw, x, routed) + self.xp.zeros_like(x))
    after, _ = layer_and_rest(tiny_model, "qwen3_moe")
    assert after["allocations"] == before["allocations"] + 2  # zeros_like's and the sum's
    assert after["launches"] == before["launches"] + 2  # the fill and the add
