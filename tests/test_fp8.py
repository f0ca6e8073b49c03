"""FP8 checkpoints (issue 16): DeepSeek-V3/R1's F8_E4M3 weights with 128x128 block scales (``_scale_inv``).

The decoding table against the e4m3fn definition (float64, one code at a time) and against torch's
float8_e4m3fn conversion (tests/fixtures/hf/deepseek_v3_fp8/fp8_reference.npz, written by
tools/fp8_fixture.py); the block scaling, ragged last blocks and windows included, against a float64 loop;
the fixture's dequantised weights against torch's, bit for bit; the engine on the FP8 checkpoint against the
engine on its dequantised float32 copy (in-process, node workers split over 2, the expert formats) and against
transformers on the dequantised model; every way the FP8 parts can be wrong, named before any worker starts.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import numpy as np
import psutil
import pytest

from coordinator import Engine, EngineConfig
from coordinator.errors import ModelConfigError
from coordinator.model.model_config import parse_model_config
from shm import fp8
from shm import formats
from shm.checkpoint import SINGLE_NAME, Checkpoint, CheckpointError
from shm.checkpoint_writer import write_safetensors

FIXTURE = Path(__file__).parent / "fixtures" / "hf" / "deepseek_v3_fp8"
TORCH = np.load(FIXTURE / "fp8_reference.npz")


def e4m3fn_reference(code: int) -> float:
    """The e4m3fn definition, one byte, in float64: sign, 4 exponent bits (bias 7), 3 mantissa bits,
    exponent 0 subnormal; S.1111.111 is NaN and there is no infinity."""
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    if e == 0:
        return sign * m * 2.0 ** -9  # m/8 * 2^(1-7)
    return sign * (8 + m) * 2.0 ** (e - 10)  # (1 + m/8) * 2^(e-7)


def test_every_code_decodes_as_e4m3fn_defines_it_and_as_torch_converts_it():
    want = np.array([e4m3fn_reference(c) for c in range(256)])
    got = fp8.E4M3FN
    assert got.dtype == np.float32 and got.shape == (256,)
    nan = np.isnan(want)
    assert np.flatnonzero(nan).tolist() == [0x7F, 0xFF] and np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].astype(np.float64), want[~nan])  # exact: each value is a float32
    assert np.array_equal(np.signbit(got[~nan]), np.signbit(want[~nan]))  # 0x80 is -0.0
    assert got[0x7E] == 448.0 and got[0xFE] == -448.0 and got[0x01] == 2.0 ** -9 and got[0x08] == 2.0 ** -6
    torch_table = TORCH["e4m3fn"]
    assert np.array_equal(np.isnan(torch_table), nan)
    assert np.array_equal(torch_table[~nan].view(np.uint32), got[~nan].view(np.uint32))  # bit for bit, -0.0 too
    codes = np.arange(256, dtype=np.uint8).reshape(16, 16)
    assert np.array_equal(fp8.decode(codes), got.reshape(16, 16), equal_nan=True)


def dequantize_reference(codes: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """float64 loop over the blocks: value(code) * scale of the block, rounded once to float32."""
    out = np.empty(codes.shape, np.float32)
    br, bc = block
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            part = codes[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            values = np.array([[e4m3fn_reference(int(c)) for c in row] for row in part])
            out[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = values * float(scale[i, j])
    return out


@pytest.mark.parametrize("shape, block", [((300, 200), (128, 128)), ((256, 128), (128, 128)),
                                          ((70, 90), (48, 40)), ((5, 3), (128, 128))])
def test_block_scaling_with_ragged_last_blocks_against_a_float64_loop(shape, block):
    rng = np.random.default_rng(shape[0])
    codes = rng.integers(0, 256, shape, dtype=np.uint8)
    grid = fp8.scale_shape(shape, block)
    assert grid == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    scale = (rng.random(grid) * 10.0 ** rng.integers(-6, 2, grid)).astype(np.float32)  # arbitrary float32 scales
    want = dequantize_reference(codes, scale, block)
    full = fp8.dequantize(codes, scale, block)
    assert full.dtype == np.float32
    assert np.array_equal(full, want, equal_nan=True)
    m = fp8.Fp8Matrix(codes, scale, block)
    assert m.shape == shape and np.array_equal(np.asarray(m), want, equal_nan=True)
    for _ in range(20):  # windows that start and end inside blocks, as a node's rows or down's columns
        r0, r1 = sorted(rng.integers(0, shape[0] + 1, 2))
        c0, c1 = sorted(rng.integers(0, shape[1] + 1, 2))
        window = m[r0:r1, c0:c1]
        assert window.shape == (r1 - r0, c1 - c0)
        assert np.array_equal(np.asarray(window), want[r0:r1, c0:c1], equal_nan=True)
        assert np.array_equal(np.asarray(window[1:, ...]), want[r0:r1, c0:c1][1:], equal_nan=True)
        dest = np.empty((r1 - r0, c1 - c0), np.float32)
        dest[...] = window  # as shm/expert_source.py fills a node's f32 rows
        assert np.array_equal(dest, want[r0:r1, c0:c1], equal_nan=True)
    row = int(rng.integers(0, shape[0]))
    assert np.array_equal(np.asarray(m[row]), want[row], equal_nan=True)
    assert np.array_equal(np.asarray(m[:, -1]), want[:, -1], equal_nan=True)


def test_the_fixture_dequantises_bit_for_bit_as_torch():
    ckpt = Checkpoint(FIXTURE)
    names = TORCH["names"].tolist()
    assert ckpt.fp8_block == tuple(TORCH["block"]) == (48, 40)
    assert len(names) == 72 and all(ckpt.info(n).dtype == "F8_E4M3" for n in names)
    for name, digest in zip(names, TORCH["sha256"].tolist()):
        w = ckpt.float32(name)
        assert w.dtype == np.float32 and w.shape == ckpt.info(name).shape
        assert hashlib.sha256(w.tobytes()).hexdigest() == digest, name
        rows = ckpt.rows(name, 5, 29)  # a slice reads its window only, as the nodes do
        assert np.array_equal(rows, w[5:29]) and np.array_equal(ckpt.rows(name, 3, 17, axis=1), w[:, 3:17])
    # what DeepSeek's checkpoints keep unquantised is kept: embeddings, lm_head, norms, the router
    kept = [n for n in ckpt.names() if n not in names]
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.1.mlp.gate.weight",
            "model.layers.1.mlp.gate.e_score_correction_bias"} <= set(kept)
    assert all(ckpt.info(n).dtype == "BF16" for n in kept)
    assert not any(n.endswith("_scale_inv") for n in ckpt.names())  # the scales go with their weights
    assert all(n + "_scale_inv" in ckpt for n in names)
    ckpt.close()


def test_auto_keeps_fp8_experts_exactly_as_f32():
    assert formats.resolve("auto", "F8_E4M3", 64).NAME == "f32"


def dequantised_copy(tmp_path: Path) -> Path:
    """The fixture with every FP8 matrix replaced by its float32 weights (as read here, which the test above
    shows are torch's bit for bit) and no quantization_config: the reference model for the engine."""
    out = tmp_path / "dequantised"
    out.mkdir()
    ckpt = Checkpoint(FIXTURE)
    tensors = {}
    for name in ckpt.names():
        info = ckpt.info(name)
        if info.dtype == "F8_E4M3":
            tensors[name] = ("F32", np.array(ckpt.float32(name)))
        else:
            tensors[name] = (info.dtype, np.array(ckpt.raw(name)))
    ckpt.close()
    write_safetensors(out / SINGLE_NAME, tensors)
    cfg = json.loads((FIXTURE / "config.json").read_text())
    del cfg["quantization_config"]
    (out / "config.json").write_text(json.dumps(cfg))
    shutil.copy(FIXTURE / "generation_config.json", out)
    return out


def close(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal to float32 rounding: 1e-6 of the largest logit."""
    return float(np.max(np.abs(a - b))) <= 1e-6 * float(np.max(np.abs(b)))


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory):
    return dequantised_copy(tmp_path_factory.mktemp("fp8"))


@pytest.mark.parametrize("config", [dict(), dict(pool="process", numa_split=True, nodes=2)],
                         ids=["inproc", "process-split-2"])
def test_fp8_checkpoint_runs_as_its_dequantised_copy(reference_dir, config):
    ref = np.load(FIXTURE / "reference.npz")
    prompt, greedy = ref["input_ids"].tolist(), ref["greedy_ids"].tolist()
    runs = {}
    for model in (FIXTURE, reference_dir):
        with Engine.open(model, EngineConfig(**config)) as eng:
            runs[model] = (eng.logits(prompt), eng.logits(prompt + greedy, steps=True),
                           eng.generate(prompt, max_new_tokens=len(greedy), temperature=0.0, stop_at_eos=False))
    (logits, steps, ids), (ref_logits, ref_steps, ref_ids) = runs[FIXTURE], runs[reference_dir]
    assert close(logits, ref_logits) and close(steps, ref_steps)
    assert ids == ref_ids == greedy
    # and transformers, run on the dequantised float32 weights by tools/fp8_fixture.py
    assert float(np.max(np.abs(logits - ref["logits"]))) < 2e-4
    assert float(np.max(np.abs(steps - ref["full_logits"]))) < 2e-4


@pytest.mark.parametrize("fmt", ["bf16", "q8", "q4"])
def test_fp8_experts_in_the_other_formats_as_the_dequantised_weights_in_them(reference_dir, fmt):
    """bf16, q8 and q4 round the dequantised float32 weights again: the same stored experts as the dequantised
    copy's in that format, so the same logits (split over 2 nodes, in-process: a node's rows start inside a
    48-row block)."""
    prompt = np.load(FIXTURE / "reference.npz")["input_ids"].tolist()
    out = []
    for model in (FIXTURE, reference_dir):
        with Engine.open(model, EngineConfig(numa_split=True, nodes=2, expert_dtype=fmt)) as eng:
            out.append(eng.logits(prompt))
    assert close(out[0], out[1])


# -- errors, named before any worker starts ------------------------------------------------------------


def broken_copy(tmp_path: Path, edit_tensors=None, edit_config=None) -> Path:
    model = tmp_path / "m"
    shutil.copytree(FIXTURE, model)
    ckpt = Checkpoint(FIXTURE)
    tensors = {n: (ckpt.info(n).dtype, np.array(ckpt.files[ckpt.index[n]].raw(n))) for n in sorted(ckpt.index)}
    ckpt.close()
    if edit_tensors:
        edit_tensors(tensors)
        (model / SINGLE_NAME).unlink()
        write_safetensors(model / SINGLE_NAME, tensors)
    if edit_config:
        cfg = json.loads((model / "config.json").read_text())
        edit_config(cfg)
        (model / "config.json").write_text(json.dumps(cfg))
    return model


def refused(model: Path, error=CheckpointError) -> str:
    with pytest.raises(error) as info:
        Engine.open(model, EngineConfig(pool="process", numa_split=True, nodes=2))
    assert not psutil.Process().children(recursive=True)  # no node worker was started
    return str(info.value)


EXPERT = "model.layers.2.mlp.experts.5.down_proj.weight"


def test_an_fp8_tensor_without_its_scales_is_named(tmp_path):
    msg = refused(broken_copy(tmp_path, edit_tensors=lambda t: t.pop(EXPERT + "_scale_inv")))
    assert repr(EXPERT) in msg and "model.safetensors" in msg and repr(EXPERT + "_scale_inv") in msg


def test_scales_of_the_wrong_shape_are_named(tmp_path):
    def edit(t):
        tag, s = t[EXPERT + "_scale_inv"]
        t[EXPERT + "_scale_inv"] = (tag, s[:1])
    msg = refused(broken_copy(tmp_path, edit_tensors=edit))
    assert repr(EXPERT + "_scale_inv") in msg and "model.safetensors" in msg
    assert "F32[1, 2]" in msg and "[2, 2]" in msg and "[48, 40]" in msg and repr(EXPERT) in msg


def test_an_fp8_tensor_that_is_not_a_matrix_is_named(tmp_path):
    def edit(t):
        tag, w = t[EXPERT]
        t[EXPERT] = (tag, w.reshape(1, *w.shape))
    msg = refused(broken_copy(tmp_path, edit_tensors=edit))
    assert repr(EXPERT) in msg and "[1, 64, 64]" in msg and "model.safetensors" in msg


@pytest.mark.parametrize("change, words", [
    ({"fmt": "e5m2"}, "quantization_config.fmt 'e5m2' is not supported; expected 'e4m3'"),
    ({"weight_block_size": [128]}, "weight_block_size [128] is not supported"),
    ({"weight_block_size": [128, 0]}, "weight_block_size [128, 0] is not supported"),
    ({"weight_block_size": None}, "weight_block_size None is not supported"),
    ({"quant_method": "awq"}, "quant_method 'awq' is not supported; expected 'fp8'"),
    ({"activation_scheme": "static"}, "activation_scheme 'static' is not supported"),
])
def test_an_unknown_fp8_fmt_or_block_size_is_named(tmp_path, change, words):
    msg = refused(broken_copy(tmp_path, edit_config=lambda c: c["quantization_config"].update(change)),
                  ModelConfigError)
    assert words in msg and "config.json" in msg
    # the checkpoint itself refuses it too (the architectures whose config parser does not read it)
    with pytest.raises(CheckpointError) as info:
        Checkpoint(tmp_path / "m")
    assert words in str(info.value) and "F8_E4M3" in str(info.value) and "model.safetensors" in str(info.value)


def test_fp8_tensors_without_a_quantization_config_are_named(tmp_path):
    model = broken_copy(tmp_path, edit_config=lambda c: c.pop("quantization_config"))
    msg = refused(model)
    assert "F8_E4M3" in msg and "model.safetensors" in msg and "no fp8 quantization_config" in msg


def test_a_block_size_that_does_not_fit_the_scales_is_named(tmp_path):
    msg = refused(broken_copy(tmp_path, edit_config=lambda c: c["quantization_config"].update(
        weight_block_size=[128, 128])))
    assert "_scale_inv" in msg and "[128, 128]" in msg and "model.safetensors" in msg


def test_the_hub_v3_quantization_config_is_accepted():
    cfg = json.loads((FIXTURE / "config.json").read_text())
    hub = dict(cfg, quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                         "weight_block_size": [128, 128]})
    assert parse_model_config(hub) == parse_model_config({k: v for k, v in cfg.items()
                                                          if k != "quantization_config"})
    assert fp8.block_size(hub["quantization_config"]) == (128, 128)
    assert fp8.block_size({"quant_method": "fp8"}) == (128, 128)  # transformers' default
    assert fp8.block_size(None) is None
