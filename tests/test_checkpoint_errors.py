"""Every way a checkpoint directory can be wrong produces an error that names what is wrong.

The tiny geometry (coordinator/model/arch/base.py's Geometry): hidden 64, 4 heads and 2 kv
heads of 16, so q_proj is [64, 64], k_proj/v_proj [32, 64]; 8 experts with
intermediate size 80, so an expert's down_proj is [64, 80]; vocab 320.
"""

from __future__ import annotations

import json
import mmap
import re

import numpy as np
import pytest

from coordinator import Engine, EngineConfig
from coordinator.errors import ModelConfigError
from coordinator.model.arch import BY_CLASS as ARCHITECTURES
from coordinator.model.arch.base import SUPPORTED_ROPE_TYPES
from shm.checkpoint import INDEX_NAME, SINGLE_NAME, Checkpoint, CheckpointError
from shm.checkpoint_writer import write_safetensors

PROMPT = [10, 200, 33, 47, 99, 5, 120, 7]


def open_engine(model_dir):
    engine = Engine.open(model_dir, EngineConfig())
    engine.close()
    return engine


def logits_of(model_dir):
    with Engine.open(model_dir, EngineConfig()) as engine:
        return engine.logits(PROMPT)


# -- config.json ----------------------------------------------------------------


def test_unsupported_architecture_is_named_with_the_supported_ones(tiny_model, checkpoint_tools):
    d = tiny_model()
    checkpoint_tools.config(d, lambda c: c.update(architectures=["LlamaForCausalLM"]))
    with pytest.raises(ModelConfigError, match="architecture 'LlamaForCausalLM' is not supported") as info:
        open_engine(d)
    for name in ARCHITECTURES:
        assert name in str(info.value)


def test_architectures_not_a_list_is_named(tiny_model, checkpoint_tools):
    d = tiny_model()
    checkpoint_tools.config(d, lambda c: c.update(architectures="Qwen3MoeForCausalLM"))
    with pytest.raises(ModelConfigError, match="field 'architectures'"):
        open_engine(d)


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                                   "num_experts_per_tok", "moe_intermediate_size", "intermediate_size"])
def test_missing_required_field_is_named(tiny_model, checkpoint_tools, field):
    d = tiny_model()
    checkpoint_tools.config(d, lambda c: c.pop(field))
    with pytest.raises(ModelConfigError, match=f"missing required field '{field}'"):
        open_engine(d)


@pytest.mark.parametrize("field", ["num_experts", "shared_expert_intermediate_size"])
def test_qwen2_moe_missing_field_is_named(tiny_model, checkpoint_tools, field):
    d = tiny_model(arch="qwen2_moe")
    checkpoint_tools.config(d, lambda c: c.pop(field))
    with pytest.raises(ModelConfigError, match=f"missing required field '{field}'"):
        open_engine(d)


def test_qwen3_moe_missing_expert_count_is_named(tiny_model, checkpoint_tools):
    # Qwen3-MoE accepts the 4.x key num_experts or the 5.x key num_local_experts
    d = tiny_model()
    checkpoint_tools.config(d, lambda c: c.pop("num_experts"))
    with pytest.raises(ModelConfigError, match="missing required field 'num_(local_)?experts'"):
        open_engine(d)


def test_qwen3_moe_num_local_experts_is_accepted(tiny_model, checkpoint_tools):
    d = tiny_model()
    checkpoint_tools.config(d, lambda c: c.update(num_local_experts=c.pop("num_experts")))
    with Engine.open(d) as engine:
        assert engine.model_config.num_experts == 8


def test_mixtral_missing_num_local_experts_is_named(tiny_model, checkpoint_tools):
    d = tiny_model(arch="mixtral")
    checkpoint_tools.config(d, lambda c: c.pop("num_local_experts"))
    with pytest.raises(ModelConfigError, match="missing required field 'num_local_experts'"):
        open_engine(d)


def test_wrong_type_in_field_is_named(tiny_model, checkpoint_tools):
    d = tiny_model()
    checkpoint_tools.config(d, lambda c: c.update(num_hidden_layers="four"))
    with pytest.raises(ModelConfigError, match=r"field 'num_hidden_layers' is 'four'; expected int"):
        open_engine(d)


def test_bool_is_not_an_int_field(tiny_model, checkpoint_tools):
    d = tiny_model()
    checkpoint_tools.config(d, lambda c: c.update(hidden_size=True))
    with pytest.raises(ModelConfigError, match=r"field 'hidden_size' is True; expected int"):
        open_engine(d)


def test_negative_int_field_is_named(tiny_model, checkpoint_tools):
    d = tiny_model()
    checkpoint_tools.config(d, lambda c: c.update(vocab_size=-5))
    with pytest.raises(ModelConfigError, match=r"field 'vocab_size' is -5; expected a non-negative integer"):
        open_engine(d)


def _supported_rope_pattern() -> str:
    return re.escape(", ".join(SUPPORTED_ROPE_TYPES))


@pytest.mark.parametrize(
    "edit, where",
    [
        (lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4}), "rope_scaling"),
        (lambda c: (c.pop("rope_theta"), c.pop("rope_scaling"),
                    c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6})), "rope_parameters"),
        (lambda c: c.update(rope_scaling={"type": "yarn", "factor": 4}), "rope_scaling"),  # 4.x legacy key
    ],
    ids=["4.x-rope_scaling", "5.x-rope_parameters", "4.x-legacy-type-key"],
)
def test_unsupported_rope_type_is_named_in_both_layouts(tiny_model, checkpoint_tools, edit, where):
    d = tiny_model()
    checkpoint_tools.config(d, edit)
    with pytest.raises(ModelConfigError, match=rf"{where}\.rope_type 'yarn' is not supported") as info:
        open_engine(d)
    assert re.search(_supported_rope_pattern(), str(info.value))
    assert "default" in str(info.value) and "linear" in str(info.value)


@pytest.mark.parametrize("scaling", [{"type": "linear"}, {"rope_type": "linear", "factor": 0},
                                     {"rope_type": "linear", "factor": "2"}])
def test_linear_rope_without_a_positive_factor_names_factor(tiny_model, checkpoint_tools, scaling):
    d = tiny_model()
    checkpoint_tools.config(d, lambda c: c.update(rope_scaling=scaling))
    with pytest.raises(ModelConfigError, match=r"rope_scaling\.factor is .*; expected a positive number"):
        open_engine(d)


def test_rope_scaling_not_an_object_is_named(tiny_model, checkpoint_tools):
    d = tiny_model()
    checkpoint_tools.config(d, lambda c: c.update(rope_scaling="linear"))
    with pytest.raises(ModelConfigError, match="field 'rope_scaling' is 'linear'"):
        open_engine(d)


def _to_rope_parameters(theta):
    def edit(cfg):
        cfg.pop("rope_theta")
        cfg.pop("rope_scaling", None)
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    return edit


def test_rope_parameters_layout_is_read(tiny_model, checkpoint_tools):
    theta = 1e6  # make_model's rope_theta
    top_level = tiny_model("top", seed=4)
    assert json.loads((top_level / "config.json").read_text())["rope_theta"] == theta
    v5 = tiny_model("v5", seed=4)
    checkpoint_tools.config(v5, _to_rope_parameters(theta))
    assert "rope_theta" not in json.loads((v5 / "config.json").read_text())
    other_theta = tiny_model("other", seed=4)
    checkpoint_tools.config(other_theta, _to_rope_parameters(1e4))

    with Engine.open(v5) as engine:
        assert engine.model_config.rope_theta == theta
        assert engine.model_config.rope_type == "default"
    reference = logits_of(top_level)
    assert np.array_equal(logits_of(v5), reference)
    # the value is really read: another theta changes every position past the first
    changed = logits_of(other_theta)
    assert np.array_equal(changed[0], reference[0])  # position 0: rope is the identity
    assert not np.allclose(changed[1:], reference[1:])


def test_rope_parameters_linear_factor_is_read(tiny_model, checkpoint_tools):
    d = tiny_model()
    checkpoint_tools.config(d, lambda c: (c.pop("rope_theta"), c.update(
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5})))
    with Engine.open(d) as engine:
        cfg = engine.model_config
        assert (cfg.rope_type, cfg.rope_factor, cfg.rope_theta) == ("linear", 2.0, 5e5)


def test_hidden_act_other_than_silu_is_named(tiny_model, checkpoint_tools):
    d = tiny_model()
    checkpoint_tools.config(d, lambda c: c.update(hidden_act="gelu"))
    with pytest.raises(ModelConfigError, match="hidden_act 'gelu' is not supported; expected 'silu'"):
        open_engine(d)


def test_no_config_json_is_named(tiny_model):
    d = tiny_model()
    (d / "config.json").unlink()
    with pytest.raises(ModelConfigError, match=re.escape(str(d / "config.json")) + ": not found, and no GGUF file"):
        open_engine(d)


def test_a_missing_model_path_is_named_as_missing(tmp_path):
    """-m tiny.gguf that does not exist: the file is named as missing (not "tiny.gguf/config.json: not found");
    an empty folder's message names both kinds of model."""
    from coordinator.engine import open_source
    from shm.gguf_file import GgufError

    with pytest.raises(GgufError, match=re.escape(str(tmp_path / "tiny.gguf")) + ": no such file"):
        open_source(tmp_path / "tiny.gguf")
    with pytest.raises(ModelConfigError, match=re.escape(str(tmp_path / "absent")) + ": no such model folder or file"):
        open_source(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelConfigError, match="config.json: not found, and no GGUF file"):
        open_source(tmp_path / "empty")


def test_config_json_not_json_is_named(tiny_model):
    d = tiny_model()
    (d / "config.json").write_text("{ this is not json")
    with pytest.raises(ModelConfigError, match=re.escape(str(d / "config.json")) + ": not valid JSON"):
        open_engine(d)


def test_config_json_not_an_object(tiny_model):
    d = tiny_model()
    (d / "config.json").write_text("[1, 2, 3]")
    with pytest.raises(ModelConfigError, match="expected a JSON object"):
        open_engine(d)


# -- tensors ------------------------------------------------------------------


@pytest.mark.parametrize(
    "arch, name, shape",
    [
        ("qwen3_moe", "model.layers.1.self_attn.k_proj.weight", [32, 64]),
        ("qwen3_moe", "model.layers.0.mlp.experts.3.down_proj.weight", [64, 80]),
        ("qwen3_moe", "model.layers.2.mlp.experts.7.gate_proj.weight", [80, 64]),
        ("qwen3_moe", "model.layers.3.self_attn.q_norm.weight", [16]),
        ("qwen3_moe", "model.layers.0.mlp.gate.weight", [8, 64]),
        ("qwen3_moe", "model.embed_tokens.weight", [320, 64]),
        ("qwen3_moe", "model.norm.weight", [64]),
        ("mixtral", "model.layers.0.block_sparse_moe.experts.3.w2.weight", [64, 80]),
        ("qwen2_moe", "model.layers.0.self_attn.q_proj.bias", [64]),
        ("qwen2_moe", "model.layers.1.self_attn.v_proj.bias", [32]),
        ("qwen2_moe", "model.layers.0.mlp.shared_expert.down_proj.weight", [64, 96]),
        ("qwen2_moe", "model.layers.0.mlp.shared_expert_gate.weight", [1, 64]),
    ],
)
def test_missing_tensor_is_named_with_its_expected_shape(tiny_model, checkpoint_tools, arch, name, shape):
    d = tiny_model(arch=arch)
    tensors = checkpoint_tools.read(d)
    assert name in tensors  # the test removes a tensor that was really there
    del tensors[name]
    checkpoint_tools.rewrite(d, tensors)
    with pytest.raises(CheckpointError, match=re.escape(f"missing tensor {name!r}: expected shape {shape}")):
        open_engine(d)


def test_dense_layer_mlp_missing_is_named(tiny_model, checkpoint_tools):
    d = tiny_model(mlp_only_layers=(1,))
    tensors = checkpoint_tools.read(d)
    name = "model.layers.1.mlp.up_proj.weight"
    del tensors[name]
    checkpoint_tools.rewrite(d, tensors)
    with pytest.raises(CheckpointError, match=re.escape(f"missing tensor {name!r}: expected shape [128, 64]")):
        open_engine(d)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("model.layers.1.self_attn.k_proj.weight", [32, 64]),
        ("model.layers.0.mlp.experts.3.down_proj.weight", [64, 80]),  # checked without being read
    ],
)
def test_misshaped_tensor_names_actual_and_expected_shape(tiny_model, checkpoint_tools, name, expected):
    d = tiny_model()
    tensors = checkpoint_tools.read(d)
    tensors[name] = np.ascontiguousarray(tensors[name].T)
    checkpoint_tools.rewrite(d, tensors)
    actual = expected[::-1]
    with pytest.raises(CheckpointError, match=re.escape(f"tensor {name!r} has shape {actual}; expected {expected}")):
        open_engine(d)


@pytest.mark.parametrize("name", ["model.norm.weight", "model.layers.0.self_attn.q_proj.weight",
                                  "model.layers.1.mlp.experts.2.up_proj.weight"])
def test_int_tensor_where_float_expected_is_named(tiny_model, checkpoint_tools, name):
    d = tiny_model()
    tensors = checkpoint_tools.read(d)
    for f in d.glob("*.safetensors"):
        f.unlink()
    raw = {n: ("F32", a) for n, a in tensors.items()}
    raw[name] = ("I32", np.round(tensors[name] * 100).astype("<i4"))
    write_safetensors(d / SINGLE_NAME, raw)
    assert Checkpoint(d).info(name).dtype == "I32"
    with pytest.raises(CheckpointError, match=re.escape(f"tensor {name!r} has dtype I32; expected one of F32")):
        open_engine(d)


def test_tie_false_without_lm_head_names_lm_head(tiny_model, checkpoint_tools):
    d = tiny_model()
    tensors = checkpoint_tools.read(d)
    del tensors["lm_head.weight"]
    checkpoint_tools.rewrite(d, tensors)
    with pytest.raises(CheckpointError, match=r"missing tensor 'lm_head.weight': expected shape \[320, 64\].*"
                                              r"tie_word_embeddings=false"):
        open_engine(d)


def test_tie_true_without_lm_head_uses_the_embedding(tiny_model, checkpoint_tools):
    tied = tiny_model("tied", seed=6, tie_word_embeddings=True)
    assert "lm_head.weight" not in Checkpoint(tied)
    # same seed, untied: every other tensor is drawn identically; give it lm_head = embedding
    explicit = tiny_model("explicit", seed=6)
    untied_logits = logits_of(explicit)
    tensors = checkpoint_tools.read(explicit)
    assert np.array_equal(tensors["model.embed_tokens.weight"], Checkpoint(tied).float32("model.embed_tokens.weight"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    checkpoint_tools.rewrite(explicit, tensors)

    with Engine.open(tied) as engine:
        assert engine.model_config.tie_word_embeddings is True
        tied_logits = engine.logits(PROMPT)
    assert np.array_equal(tied_logits, logits_of(explicit))
    assert not np.allclose(tied_logits, untied_logits)  # the head really changed


# -- files --------------------------------------------------------------------


def test_truncated_safetensors_names_the_file(tiny_model):
    d = tiny_model()
    path = d / SINGLE_NAME
    data = path.read_bytes()
    path.write_bytes(data[:-17])
    with pytest.raises(CheckpointError, match=re.escape(str(path)) + r".*truncated or damaged"):
        open_engine(d)


def test_truncated_into_the_header_names_the_file(tiny_model):
    d = tiny_model()
    path = d / SINGLE_NAME
    data = path.read_bytes()
    path.write_bytes(data[:100])
    with pytest.raises(CheckpointError, match=re.escape(str(path)) + r".*truncated"):
        open_engine(d)


def test_tiny_file_names_the_file(tiny_model):
    d = tiny_model()
    path = d / SINGLE_NAME
    path.write_bytes(b"\x01\x02\x03")
    with pytest.raises(CheckpointError, match=re.escape(str(path)) + ": 3 bytes is too short"):
        open_engine(d)


def test_random_bytes_name_the_file(tiny_model):
    d = tiny_model()
    path = d / SINGLE_NAME
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(CheckpointError, match=re.escape(str(path))):
        open_engine(d)


def test_garbage_header_with_plausible_length_names_the_file(tiny_model):
    d = tiny_model()
    path = d / SINGLE_NAME
    garbage = np.random.default_rng(1).bytes(256)
    path.write_bytes(len(garbage).to_bytes(8, "little") + garbage + b"\0" * 64)
    with pytest.raises(CheckpointError, match=re.escape(str(path)) + ": header is not valid JSON"):
        open_engine(d)


def _sharded(tiny_model):
    d = tiny_model("sharded", max_shard_bytes=400_000)
    index = json.loads((d / INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2
    return d, index, shards


def test_index_naming_a_missing_shard_is_named(tiny_model):
    d, index, shards = _sharded(tiny_model)
    (d / shards[-1]).unlink()
    with pytest.raises(CheckpointError, match=re.escape(f"names shard(s) that do not exist: {shards[-1]}")):
        open_engine(d)


def test_index_listing_a_tensor_in_the_wrong_shard_is_named(tiny_model):
    d, index, shards = _sharded(tiny_model)
    name = next(n for n, s in index["weight_map"].items() if s == shards[0])
    index["weight_map"][name] = shards[1]
    (d / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=re.escape(f"lists tensor {name!r} in {shards[1]}, but it is in {shards[0]}")):
        open_engine(d)


def test_index_listing_a_tensor_no_shard_holds_is_named(tiny_model):
    d, index, shards = _sharded(tiny_model)
    index["weight_map"]["model.layers.9.ghost.weight"] = shards[0]
    (d / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.9\.ghost\.weight'.*no shard holds it"):
        open_engine(d)


def test_index_without_weight_map_is_named(tiny_model):
    d, index, shards = _sharded(tiny_model)
    (d / INDEX_NAME).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match=re.escape(str(d / INDEX_NAME)) + ".*weight_map"):
        open_engine(d)


def test_no_safetensors_at_all_is_named(tiny_model):
    d = tiny_model()
    (d / SINGLE_NAME).unlink()
    with pytest.raises(CheckpointError, match=re.escape(str(d)) + r": no \*\.safetensors file"):
        open_engine(d)


def test_tensor_stored_twice_is_named(tiny_model, checkpoint_tools):
    d = tiny_model()
    tensors = checkpoint_tools.read(d)
    write_safetensors(d / "extra.safetensors", {"model.norm.weight": ("F32", tensors["model.norm.weight"])})
    with pytest.raises(CheckpointError, match=r"tensor 'model\.norm\.weight' is stored twice"):
        open_engine(d)


def test_model_dir_that_does_not_exist(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ModelConfigError, match=re.escape(str(missing))):
        open_engine(missing)


# -- zero-copy F32 ------------------------------------------------------------------


def test_f32_tensors_are_read_only_views_of_the_map(tiny_model):
    d = tiny_model()
    ckpt = Checkpoint(d)
    name = "model.layers.0.self_attn.q_proj.weight"
    a, b = ckpt.float32(name), ckpt.float32(name)
    assert a.dtype == np.float32 and a.shape == (64, 64)
    assert a.flags.writeable is False
    assert np.shares_memory(a, b)
    assert np.shares_memory(a, ckpt.raw(name))
    base = a
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap)
    with pytest.raises(ValueError):
        a[0, 0] = 1.0


def test_engine_weights_share_the_mapped_file(tiny_model):
    """A float32 checkpoint's embedding is read in place; its dense matrices too where BLAS may take them (no
    batch invariance); batch-invariant, they are copied into the f32 rows of the invariant loops."""
    d = tiny_model()
    with Engine.open(d, EngineConfig(batch_invariant=False)) as engine:
        w = engine.decoder.w
        assert np.shares_memory(w.embed, engine.ckpt.raw("model.embed_tokens.weight"))
        assert np.shares_memory(w.layers[2].k, engine.ckpt.raw("model.layers.2.self_attn.k_proj.weight"))
        assert not w.layers[2].k.flags.writeable
    with Engine.open(d) as engine:
        w = engine.decoder.w
        assert np.shares_memory(w.embed, engine.ckpt.raw("model.embed_tokens.weight"))
        assert w.layers[2].k.fmt.NAME == "f32" and np.array_equal(
            w.layers[2].k.decoded(), engine.ckpt.raw("model.layers.2.self_attn.k_proj.weight"))
