"""The bench's step split (coordinator/cli/step_split.py): each part's own time and bytes, the wrappers gone after."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from coordinator.cli import step_split
from coordinator.cli.make_model import make_model
from coordinator.config import EngineConfig
from coordinator.engine import Engine
from coordinator.host.packed import PackedMatrix, RowExactMatrix, dense_matrices
from coordinator.model.sampling import Sampler
from coordinator.model.step import EagerStep


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = Engine.open(make_model(tmp_path_factory.mktemp("split") / "m", seed=3), EngineConfig(pool="inproc"))
    yield eng
    eng.close()


def test_a_part_counts_its_own_time_not_the_parts_nested_in_it(monkeypatch):
    ticks = iter([0, 10, 30, 100])  # outer starts, inner starts, inner ends, outer ends
    monkeypatch.setattr(step_split.time, "perf_counter_ns", lambda: next(ticks))
    timer = step_split.PartTimer()
    inner = timer.wrap("inner", lambda: None, lambda args: 7)
    outer = timer.wrap("outer", lambda: inner())
    outer()
    assert dict(timer.ns) == {"inner": 20, "outer": 80}
    assert dict(timer.bytes) == {"inner": 7} and timer.calls == 2


def test_the_split_of_decode_steps_adds_up_to_the_step_and_counts_the_bytes_read(engine):
    prompt = list(range(5, 17))
    split = step_split.measure(engine, prompt, 6)
    assert split["tokens"] == 6
    parts = split["parts"]
    assert list(parts) == list(step_split.PARTS)
    # every layer's attention half in its block (host/blocks.py): the separate attention calls never run
    blocks = [b for b in engine.decoder.blocks if b is not None]
    assert len(blocks) == engine.model_config.num_layers and parts["attention"]["us"] == 0
    assert all(p["us"] > 0 for name, p in parts.items() if name != "attention")
    assert sum(p["us"] for p in parts.values()) + split["overhead_us"] + split["wrappers_us"] == pytest.approx(
        split["step_us"])
    # every packed dense matrix once a token: the blocks' attention projections, the dense MLPs, the lm_head
    dense = {id(getattr(o, n)): getattr(o, n) for o, n in dense_matrices(engine.decoder.w) if getattr(o, n) is not None}
    assert all(isinstance(m, PackedMatrix) for m in dense.values())
    in_blocks = sum(b.matrix_bytes for b in blocks)
    assert parts["dense"]["mb"] == pytest.approx((sum(m.nbytes for m in dense.values()) - in_blocks) / 1e6)
    cfg = engine.model_config  # the keys and values of positions len(prompt) + 1 .. + 6, once a step
    kv = np.arange(len(prompt) + 1, len(prompt) + 7).mean() * cfg.kv_bytes_per_token
    assert parts["attention block"]["mb"] == pytest.approx((in_blocks + kv) / 1e6)
    assert parts["attention"]["mb"] == pytest.approx(0)
    assert parts["experts"]["mb"] > 0 and parts["experts"]["gb_per_s"] > 0
    assert split["overhead_per_layer_us"] == pytest.approx(split["overhead_us"] / cfg.num_layers)


def test_the_wrappers_are_gone_after_the_split(engine):
    before = (PackedMatrix.matmul_t, RowExactMatrix.matmul_t, Sampler.choose, EagerStep.attend,
              EagerStep.attention_block, step_split.decoder_module.linear_attention.layer)
    step_split.measure(engine, [5, 6, 7], 2)
    after = (PackedMatrix.matmul_t, RowExactMatrix.matmul_t, Sampler.choose, EagerStep.attend,
             EagerStep.attention_block, step_split.decoder_module.linear_attention.layer)
    assert after == before
    for owner in (engine.decoder.backend, engine.decoder.pool):
        assert not set(vars(owner)) & {*step_split.NORM_CALLS, *step_split.ATTENTION_CALLS, "submit", "collect"}


def test_a_gpu_step_is_not_split():
    eng = SimpleNamespace(decoder=SimpleNamespace(backend=SimpleNamespace(gpu=True)))
    assert step_split.measure(eng, [1, 2], 4) is None


def test_the_markdown_gives_each_part_against_the_roofline(engine):
    split = step_split.with_roofline(step_split.measure(engine, [5, 6, 7], 3), 10.0)
    dense = split["parts"]["dense"]
    assert dense["of_roofline"] == pytest.approx(dense["gb_per_s"] / 10.0)
    text = "\n".join(step_split.markdown("inproc", split))
    assert "| dense |" in text and "per-layer overhead" in text
    assert step_split.markdown("inproc", None) == []
