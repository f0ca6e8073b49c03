"""BF16 and F16 files, sharded checkpoints: the same numbers as the F32 single file."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from coordinator import Engine
from coordinator.cli.make_model import make_model
from shm.checkpoint import INDEX_NAME, Checkpoint, bf16_to_f32
from shm.checkpoint_writer import f32_to_bf16, save_checkpoint

PROMPT = [10, 200, 33, 47, 99, 5]


def rounded(tensors, dtype):
    if dtype == "BF16":
        return {k: bf16_to_f32(f32_to_bf16(v)) for k, v in tensors.items()}
    return {k: v.astype(np.float16).astype(np.float32) for k, v in tensors.items()}


def rewrite(path, tensors, **kw):
    for f in path.glob("*.safetensors"):
        f.unlink()
    (path / INDEX_NAME).unlink(missing_ok=True)
    save_checkpoint(path, tensors, **kw)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe"])
@pytest.mark.parametrize("dtype", ["BF16", "F16"])
def test_half_precision_file_equals_f32_of_same_values(tmp_path, arch, dtype):
    src = make_model(tmp_path / "src", arch=arch, seed=3)
    values = rounded({n: Checkpoint(src).float32(n) for n in Checkpoint(src).names()}, dtype)
    f32_dir = make_model(tmp_path / "f32", arch=arch, seed=3)
    rewrite(f32_dir, values, dtype="F32")
    half_dir = make_model(tmp_path / "half", arch=arch, seed=3)
    rewrite(half_dir, values, dtype=dtype)
    assert Checkpoint(half_dir).dtypes() == {dtype}
    assert (half_dir / "model.safetensors").stat().st_size < 0.6 * (f32_dir / "model.safetensors").stat().st_size
    with Engine.open(f32_dir) as a, Engine.open(half_dir) as b:
        assert np.array_equal(a.logits(PROMPT), b.logits(PROMPT))


def test_bf16_conversion_is_exact_and_rounds_to_nearest_even():
    x = np.array([1.0, -2.5, 3.140625, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 65504.0], np.float32)
    back = bf16_to_f32(f32_to_bf16(x))
    assert np.array_equal(back[:3], x[:3])  # representable values survive
    assert back[3] == 1.0  # tie rounds to even (down)
    assert back[4] == 1.0 + 2**-6  # tie rounds to even (up)
    assert np.max(np.abs(back - x) / np.abs(x)) <= 2**-8


def test_writer_output_reads_with_the_safetensors_package(tmp_path):
    path = make_model(tmp_path / "m", seed=1)
    theirs = load_file(str(path / "model.safetensors"))
    ours = Checkpoint(path)
    assert sorted(theirs) == ours.names()
    for name, arr in theirs.items():
        assert np.array_equal(arr, ours.float32(name)), name


@pytest.mark.parametrize("dtype", ["F32", "BF16"])
def test_sharded_checkpoint_equals_single_file(tmp_path, dtype):
    single = make_model(tmp_path / "single", seed=2, dtype=dtype)
    sharded = make_model(tmp_path / "sharded", seed=2, dtype=dtype, max_shard_bytes=40_000)
    shards = sorted(sharded.glob("*.safetensors"))
    assert len(shards) >= 4 and not (sharded / "model.safetensors").exists()
    index = json.loads((sharded / INDEX_NAME).read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    with Engine.open(single) as a, Engine.open(sharded) as b:
        assert np.array_equal(a.logits(PROMPT), b.logits(PROMPT))


def test_row_slices_read_only_their_rows(tmp_path):
    """Checkpoint.rows returns exactly the slice, converted, for every dtype."""
    for dtype in ("F32", "F16", "BF16"):
        path = make_model(tmp_path / dtype, seed=4, dtype=dtype)
        ck = Checkpoint(path)
        name = "model.layers.1.mlp.experts.5.gate_proj.weight"
        whole = ck.float32(name)
        assert np.array_equal(ck.rows(name, 32, 80), whole[32:80])
        assert np.array_equal(ck.rows(name, 3, 9, axis=1), whole[:, 3:9])
