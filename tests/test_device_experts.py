"""Device-resident (hot) experts, the expert profile and the device selection, on CPU-only machines."""

from __future__ import annotations

import json

import numpy as np
import pytest
from reference import Reference

from coordinator import Engine, EngineConfig
from coordinator.cli.main import main
from coordinator.cli.make_model import make_model
from coordinator.pool.hot_experts import expert_bytes
from coordinator.errors import ConfigValueError
from coordinator.gpu.probe import DeviceError, probe_cuda
from coordinator.pool.hot_experts import ExpertProfile, ProfileError, choose_device_experts

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("dev") / "m", seed=9)


@pytest.fixture(scope="module")
def reference_logits(model):
    with Engine.open(model, EngineConfig(pool="inproc")) as eng:
        return eng.logits(PROMPT)


def reference_routing(model):
    """(layer, expert) of every routed pair, counted by the independent float64 reference."""
    ref = Reference(model)
    pairs = []
    original = ref.moe

    def recording(i, x):
        c, t = ref.cfg, ref.t
        logits = t[f"model.layers.{i}.mlp.gate.weight"] @ x
        p = np.exp(logits - logits.max())
        pairs.extend((i, e) for e in sorted(range(c["num_experts"]), key=lambda e: -p[e])[:c["num_experts_per_tok"]])
        return original(i, x)

    ref.moe = recording
    ref.forward(PROMPT)
    return pairs


@pytest.mark.parametrize("count", [0, 5, 32])
@pytest.mark.parametrize("pool", ["inproc", "process"])
def test_outputs_agree_and_hit_rate_equals_independent_count(model, reference_logits, count, pool):
    split = dict(numa_split=True, nodes=2) if pool == "process" else {}
    with Engine.open(model, EngineConfig(pool=pool, gpu_experts=count, **split)) as eng:
        got = eng.logits(PROMPT)
        report = eng.expert_report()
        on_device = {(l, e) for l in eng.model_config.moe_layers for e in range(eng.model_config.num_experts)
                     if eng.decoder.on_device[l][e]}
    np.testing.assert_allclose(got, reference_logits, atol=2e-5, rtol=0)
    assert len(on_device) == count == report["device_experts"]["experts"]
    pairs = reference_routing(model)
    expected = sum((p in on_device) for p in pairs) / len(pairs)
    assert report["hit_rate"] == pytest.approx(expected)
    assert report["device_pairs"] + report["cpu_pairs"] == len(pairs)
    if count == 32:
        assert report["hit_rate"] == 1.0 and report["cpu_bytes_read"] == 0
    if count == 0:
        assert report["hit_rate"] == 0.0 and report["device_bytes_read"] == 0


def test_device_experts_leave_the_cpu_segments(model):
    with Engine.open(model, EngineConfig(pool="process", gpu_experts=8)) as eng:
        with_dev = eng.pool.health()[0]
    with Engine.open(model, EngineConfig(pool="process")) as eng:
        without = eng.pool.health()[0]
    assert with_dev["segment"] != without["segment"]  # another content, another name
    per_expert = 3 * 80 * 64 * 4  # the tiny model: I 80, H 64, float32
    assert without["segment_bytes"] - with_dev["segment_bytes"] == 8 * per_expert


def test_profile_round_trips_and_places_the_hottest(model, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello there\nAnother prompt, longer than the first\n")
    out = tmp_path / "profile.json"
    assert main(["profile", "--model", str(model), "--prompts", str(prompts), "--out", str(out),
                 "--max-new-tokens", "4", "--pool", "inproc"]) == 0
    doc = json.loads(out.read_text())
    assert doc["format"] == "strata-expert-profile" and doc["prompts"] == 2
    with Engine.open(model) as eng:
        digest, layers, E = eng.ckpt.digest(), eng.model_config.moe_layers, eng.model_config.num_experts
    prof = ExpertProfile.load(out, digest, layers, E)
    again = tmp_path / "again.json"
    prof.save(again)
    assert ExpertProfile.load(again, digest, layers, E) == prof
    total = sum(sum(v) for v in prof.counts.values())
    assert total > 0 and total % 2 == 0  # top-2: every routed token adds two pairs
    chosen, label = choose_device_experts(layers, E, 1, prof, gpu_experts=3)
    hottest = sorted(((c, l, e) for l, row in prof.counts.items() for e, c in enumerate(row)),
                     key=lambda t: (-t[0], t[1], t[2]))[:3]
    assert chosen == {(l, e) for _, l, e in hottest} and label.startswith("profiled")
    with Engine.open(model, EngineConfig(expert_profile=str(out), gpu_experts=3)) as eng:
        assert eng.device_placement["chosen"].startswith("profiled") and eng.device_placement["experts"] == 3


def test_mismatched_profiles_are_refused_with_the_reason(model, tmp_path):
    with Engine.open(model) as eng:
        prof = eng.profile()
        digest, layers, E = eng.ckpt.digest(), eng.model_config.moe_layers, eng.model_config.num_experts
    path = tmp_path / "p.json"
    prof.save(path)
    with pytest.raises(ProfileError, match="made for model .* not this model"):
        ExpertProfile.load(path, "0" * 16, layers, E)
    doc = json.loads(path.read_text())
    for edit, reason in ((dict(num_experts=E + 1), "experts per layer"), (dict(format="x"), "not a strata"),
                         (dict(version=99), "version 99"), (dict(counts={"0": [1] * E}), "MoE layers are")):
        (tmp_path / "bad.json").write_text(json.dumps({**doc, **edit}))
        with pytest.raises(ProfileError, match=reason):
            ExpertProfile.load(tmp_path / "bad.json", digest, layers, E)
    other = make_model(tmp_path / "other", seed=10)
    with pytest.raises(ProfileError, match="not this model"):
        Engine.open(other, EngineConfig(expert_profile=str(path), gpu_experts=2))


@pytest.mark.parametrize("gb", [0.0, 0.0001, 0.0005, 0.00123, 1.0])
def test_gpu_expert_memory_never_places_more_than_it_allows(model, tmp_path, gb):
    with Engine.open(model) as eng:
        eng.logits(PROMPT)
        eng.profile().save(tmp_path / "p.json")
        per = expert_bytes(eng.model_config)
        total = len(eng.model_config.moe_layers) * eng.model_config.num_experts
    with Engine.open(model, EngineConfig(expert_profile=str(tmp_path / "p.json"), gpu_expert_memory=gb)) as eng:
        placed = eng.device_placement
    assert placed["bytes"] <= gb * 1e9
    assert placed["experts"] == min(total, int(gb * 1e9 // per))


def test_unprofiled_choice_is_per_layer_by_index_and_labelled():
    chosen, label = choose_device_experts([0, 1, 2], 8, 1, None, gpu_experts=7)
    assert chosen == {(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1)}
    assert label == "unprofiled, by index: experts 0-1 of every MoE layer and expert 2 of the first MoE layer"
    assert choose_device_experts([0], 8, 1, None) == (frozenset(), "none")
    with pytest.raises(ValueError, match=r"gpu_experts 25: the model has 24 routed experts \(3 MoE layers x 8\); "
                                         r"ask for 0 to 24"):
        choose_device_experts([0, 1, 2], 8, 1, None, gpu_experts=25)


def test_more_device_experts_than_the_model_has_are_refused_and_the_choice_is_said(model, capsys):
    from coordinator.cli.main import main

    assert main(["generate", "-m", str(model), "--prompt-ids", "3,4", "-n", "2", "--pool", "inproc",
                 "--gpu-experts", "99"]) == 2
    assert "gpu_experts 99: the model has 32 routed experts (4 MoE layers x 8)" in capsys.readouterr().err
    assert main(["generate", "-m", str(model), "--prompt-ids", "3,4", "-n", "2", "--pool", "inproc",
                 "--gpu-experts", "6"]) == 0
    assert ("holds 6 experts whole (unprofiled, by index: expert 0 of every MoE layer and expert 1 of the first 2 "
            "MoE layers)") in capsys.readouterr().err


def test_device_selection_errors_name_what_is_missing(model):
    usable, why = probe_cuda()
    if usable:
        pytest.skip("a GPU is present")
    with pytest.raises(DeviceError, match="--device cuda: "):
        Engine.open(model, EngineConfig(device="cuda"))
    with pytest.raises(ConfigValueError, match="needs expert_profile"):
        EngineConfig(gpu_expert_memory=1.0)
    with pytest.raises(ConfigValueError, match="not both"):
        EngineConfig(gpu_experts=1, gpu_expert_memory=1.0, expert_profile="x")
