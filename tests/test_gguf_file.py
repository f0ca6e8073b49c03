"""GGUF files named and checked: metadata -> config.json keys and tensor names -> Hugging Face names (by the
family: coordinator/model/arch/), clear errors; a node worker's view under the file's own names.

The files are written here with the gguf package's own writer from a tiny checkpoint of make-model, the
routed experts stacked and quantised to Q8_0 by gguf.quants, as llama.cpp's converter lays them out.
"""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.cli.make_model import make_model
from coordinator.model.arch import gguf_config
from coordinator.model.model_config import load_model_config, parse_model_config
from coordinator.model.source import open_gguf
from shm.checkpoint import Checkpoint
from shm.gguf_checkpoint import open_checkpoint
from shm.gguf_file import GgufError, GgufFile

from gguf_writer import write_gguf


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    ckpt = make_model(root / "m", seed=5, hidden_size=64, moe_intermediate_size=96)  # Q8_0 rows: 32s
    write_gguf(ckpt, root / "m.gguf")
    return ckpt, root / "m.gguf"


def test_the_metadata_gives_the_checkpoints_model_config(model):
    ckpt, path = model
    got = parse_model_config(gguf_config(GgufFile(path)))
    want = load_model_config(ckpt)
    for field in ("arch", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "rms_norm_eps", "rope_theta", "num_experts", "top_k", "norm_topk_prob", "moe_intermediate_size",
                  "qk_norm", "tie_word_embeddings", "sparse_layers"):
        assert getattr(got, field) == getattr(want, field), field


def test_every_tensor_has_its_hugging_face_name_and_the_values_of_the_checkpoint(model):
    ckpt, path = model
    g = open_gguf(path)
    f, names = g.file, {hf: src.name for hf, src in g.index.items()}
    ck = Checkpoint(ckpt)
    try:
        per_expert = {n for n in ck.names() if ".experts." in n}
        assert set(names) == (set(ck.names()) - per_expert) | {
            f"model.layers.{i}.mlp.experts.{p}" for i in range(gguf_config(f)["num_hidden_layers"])
            for p in ("gate_proj", "up_proj", "down_proj")}
        for hf, g in names.items():
            if ".experts." not in hf:
                assert f.type_name(g) == "F32"
                assert np.array_equal(f.float32(g), ck.float32(hf)), hf
        gate = f.float32(names["model.layers.0.mlp.experts.gate_proj"])  # [E, I, H], Q8_0 dequantised
        want = ck.float32("model.layers.0.mlp.experts.1.gate_proj.weight")
        assert gate.shape[1:] == want.shape
        np.testing.assert_allclose(gate[1], want, atol=np.abs(want).max() / 127)  # within a Q8_0 step
        assert not np.array_equal(gate[1], want)  # and truly quantised
    finally:
        ck.close()


def test_a_truncated_file_an_unknown_architecture_and_a_missing_part_are_named(model, tmp_path):
    ckpt, _ = model
    cut = tmp_path / "cut.gguf"
    write_gguf(ckpt, cut, drop=1000)
    with pytest.raises(GgufError, match="cut.gguf.*truncated"):
        GgufFile(cut)
    other = tmp_path / "other.gguf"
    write_gguf(ckpt, other, arch="gpt2")
    with pytest.raises(GgufError, match="architecture 'gpt2' is not supported; expected one of .*qwen3moe"):
        open_gguf(other)
    first = tmp_path / "big-00001-of-00002.gguf"
    first.write_bytes(other.read_bytes())
    with pytest.raises(GgufError, match="split in 2 parts, missing big-00002-of-00002.gguf"):
        GgufFile(first)
    with pytest.raises(GgufError, match="no such file"):
        GgufFile(tmp_path / "absent.gguf")


def test_a_node_worker_reads_the_file_under_its_own_names_the_engine_under_hugging_faces(model):
    """The node workers open the file with no model family (open_checkpoint): every tensor under its GGUF name,
    the same bytes the engine's view reads under the family's name (the job names the experts by file_name)."""
    _, path = model
    own, named = open_checkpoint(path), open_gguf(path)
    assert set(own.names()) == set(named.file.tensors)
    hf = "model.layers.0.mlp.experts.gate_proj"
    stored = named.file_name(hf)
    assert stored == "blk.0.ffn_gate_exps.weight"
    assert own.info(stored).dtype == named.info(hf).dtype == "Q8_0"
    assert np.array_equal(own.raw(stored), named.raw(hf))
    assert own.digest() == named.digest()
