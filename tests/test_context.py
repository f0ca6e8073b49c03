"""A context (--ctx-size) the machine cannot hold is refused before the model loads, with the numbers
(coordinator/context.py); Qwen3-Next's KV cache counts its attention layers alone and its state is fixed."""

from __future__ import annotations

import pytest

from coordinator.cli.make_model import PRESETS, hf_config, make_model
from coordinator.config import EngineConfig
from coordinator.context import (GIB, STEP_DECODE_ROWS, ContextTooLarge, available_memory, check_context,
                                 context_needs)
from coordinator.engine import Engine
from coordinator.model.model_config import parse_model_config

QWEN3_NEXT = parse_model_config(hf_config("qwen3_next", PRESETS["qwen3-next"]()))


def test_qwen3_next_80b_keeps_keys_in_12_of_48_layers_and_a_fixed_state():
    assert QWEN3_NEXT.attention_layers == list(range(3, 48, 4))
    assert QWEN3_NEXT.kv_bytes_per_token == 12 * 2 * 2 * 256 * 4 == 49_152
    assert QWEN3_NEXT.state_bytes_per_sequence == 36 * (3 * (2 * 16 * 128 + 32 * 128) + 32 * 128 * 128) * 4


def test_262144_tokens_fit_where_they_fit_and_the_refusal_names_what_does():
    """At Qwen3-Next's 262,144 tokens one sequence's KV cache is 12 GiB and a one-node pool's buffers hold one step
    (a 512-token chunk and 64 decode rows, 10 pairs a row), whatever the context: held with 64 GiB available;
    with 8 GiB refused, naming the parts and a context that check_context then accepts."""
    need = check_context(QWEN3_NEXT, 262_144, 1, True, 64 * GIB, 64 * GIB)
    rows, H = 512 + STEP_DECODE_ROWS, QWEN3_NEXT.hidden_size
    assert need.kv_cache == 12 * GIB and 2 * rows * H * 4 < need.pool_segment < 2 * rows * H * 4 + rows * 10 * 12 + 2**20
    assert context_needs(QWEN3_NEXT, 8192, 1, True).pool_segment == need.pool_segment
    assert context_needs(QWEN3_NEXT, 64, 1, True).pool_segment < need.pool_segment  # never more rows than the context
    with pytest.raises(ContextTooLarge, match=r"262,144 tokens needs 12\.\d\d GiB .* 12\.00 GiB of KV cache") as info:
        check_context(QWEN3_NEXT, 262_144, 1, True, 8 * GIB, 64 * GIB)
    fits = int(str(info.value).split("--ctx-size ")[1].split(" ")[0].replace(",", ""))
    assert 0 < fits < 262_144 and fits % 1024 == 0
    check_context(QWEN3_NEXT, fits, 1, True, 8 * GIB, 64 * GIB)
    with pytest.raises(ContextTooLarge):
        check_context(QWEN3_NEXT, fits + 1024, 1, True, 8 * GIB, 64 * GIB)
    assert context_needs(QWEN3_NEXT, 1000, 2, False).pool_segment == 0  # an in-process pool has no segment


def test_the_engine_refuses_a_context_it_cannot_hold_before_loading(tmp_path):
    model = make_model(tmp_path / "m", arch="qwen3_next", seed=1)
    with pytest.raises(ContextTooLarge, match="KV cache for one sequence"):
        Engine.open(model, EngineConfig(pool="inproc", max_seq_len=10**12))


def test_available_memory_is_the_kernels_memavailable(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683784 kB\nMemFree:         1000 kB\nMemAvailable:   20216632 kB\n")
    assert available_memory(meminfo) == 20216632 * 1024
