"""GGUF files of DeepSeek-V2/V3 (llama.cpp's ``deepseek2``) and GLM-4.5 (``glm4moe``), as llama.cpp's own
converter writes them (tests/fixtures/gguf/, made by tools/gguf_mla_fixtures.py from the safetensors fixtures
in tests/fixtures/hf/): the engine on the file gives the logits of the engine on the checkpoint it came from,
in process and split over two node workers, and the same greedy tokens. The converter splits kv_b_proj into
attn_k_b (transposed) and attn_v_b; the loader puts it back together. The metadata it cannot use is named
with the file and the key before any worker starts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from coordinator.config import EngineConfig
from coordinator.engine import Engine
from coordinator.model.step import StepBatch
from shm.checkpoint_writer import save_checkpoint
from coordinator.model.arch import gguf_config
from coordinator.model.arch.deepseek_v3 import KvB
from coordinator.model.source import open_gguf
from shm.gguf_file import GgufError

ROOT = Path(__file__).parent / "fixtures"
PROMPT = [3, 17, 42, 5, 99, 7, 200, 64]
NAMES = ["deepseek_v3_basic", "deepseek_v2_lite", "glm4_moe_basic"]
ARCH = {"deepseek_v3_basic": "deepseek_v3", "deepseek_v2_lite": "deepseek_v2", "glm4_moe_basic": "glm4_moe"}


def logits(eng: Engine, ids) -> np.ndarray:
    return eng.step(StepBatch.of(np.asarray(ids, np.int64), eng.decoder.new_cache(), every_row=True)).logits[0]


def rewrite(src: Path, dst: Path, *, drop_keys=(), set_keys: dict | None = None, drop_tensors=(),
            tensors: dict | None = None) -> Path:
    """A copy of a GGUF file with metadata keys dropped or set ({key: (value, GGUFValueType)}), tensors
    dropped, or replaced/added ({name: float32 array, numpy order})."""
    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    w = gguf.GGUFWriter(dst, arch)
    set_keys = dict(set_keys or {})
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF.") or field.name in drop_keys:
            continue
        if field.name in set_keys:
            value, vtype = set_keys.pop(field.name)
            w.add_key_value(field.name, value, vtype)
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for key, (value, vtype) in set_keys.items():
        w.add_key_value(key, value, vtype)
    tensors = dict(tensors or {})
    for t in reader.tensors:
        if t.name in drop_tensors:
            continue
        if t.name in tensors:
            w.add_tensor(t.name, np.ascontiguousarray(tensors.pop(t.name), np.float32))
        else:
            w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    for name, data in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(data, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("name", NAMES)
def test_the_converters_file_is_the_checkpoint(name):
    """Every tensor the engine reads from the file equals the checkpoint's (kv_b_proj too, put back together
    from attn_k_b and attn_v_b), and the metadata parses to the checkpoint's configuration."""
    from coordinator.model.model_config import load_model_config, parse_model_config
    from shm.checkpoint import Checkpoint

    ck = open_gguf(ROOT / "gguf" / f"{name}.gguf")
    hf = Checkpoint(ROOT / "hf" / name)
    if name.startswith("deepseek"):
        assert any(isinstance(src, KvB) for src in ck.index.values())  # the converter split kv_b_proj
        assert not any(n.endswith("attn_kv_b.weight") for n in ck.file.tensors)
    assert set(ck.names()) == {n for n in hf.names() if ".experts." not in n} | {
        f"model.layers.{i}.mlp.experts.{p}" for i in (1, 2) for p in ("gate_proj", "up_proj", "down_proj")}
    for n in ck.names():
        if n.endswith((".experts.gate_proj", ".experts.up_proj", ".experts.down_proj")):
            base, proj = n.rsplit(".", 1)
            want = np.stack([hf.float32(f"{base}.{e}.{proj}.weight") for e in range(8)])
        else:
            want = hf.float32(n)
        assert np.array_equal(ck.float32(n), want), n
    got = parse_model_config(gguf_config(ck.file))
    want = load_model_config(ROOT / "hf" / name)
    assert got.arch == ARCH[name]
    diff = {k: (getattr(got, k), getattr(want, k)) for k in got.__dataclass_fields__
            if getattr(got, k) != getattr(want, k)}
    assert diff == {}


@pytest.mark.parametrize("name", NAMES)
def test_engine_on_the_file_equals_the_engine_on_the_checkpoint(name):
    path = ROOT / "gguf" / f"{name}.gguf"
    cfg = dict(pool="inproc", activations="f32")
    with Engine.open(ROOT / "hf" / name, EngineConfig(**cfg)) as ref:
        want = logits(ref, PROMPT)
        want_steps = ref.logits(PROMPT, steps=True)
        want_ids = ref.generate(PROMPT, max_new_tokens=8, stop_at_eos=False)
    with Engine.open(path, EngineConfig(**cfg)) as eng:
        assert eng.model_config.arch == ARCH[name]
        got = logits(eng, PROMPT)
        # the same float32 numbers (BF16 and F32 in the file, bfloat16 in the checkpoint): the same logits, bit
        # for bit, in prefill and decode steps
        assert np.array_equal(eng.logits(PROMPT, steps=True), want_steps)
        assert eng.generate(PROMPT, max_new_tokens=8, stop_at_eos=False) == want_ids
    assert np.array_equal(got, want)
    split = dict(pool="process", activations="f32", numa_split=True, nodes=2)
    with Engine.open(path, EngineConfig(**split)) as eng:
        assert [n.virtual for n in eng.nodes] == [True, True]
        np.testing.assert_allclose(logits(eng, PROMPT), want, rtol=1e-5, atol=1e-6)
        assert eng.generate(PROMPT, max_new_tokens=8, stop_at_eos=False) == want_ids


@pytest.mark.parametrize("keep_split", [False, True])
def test_an_older_converters_file_kv_b_unsplit(tmp_path, keep_split):
    """Files from converters before the split hold attn_kv_b itself and the MLA head sizes as key_length and
    value_length (no *_mla keys): the same model (and attn_kv_b is read where a file has it beside the split
    pair, as some converters wrote both)."""
    src = ROOT / "gguf" / "deepseek_v3_basic.gguf"
    ck = open_gguf(src)
    kv_b = {f"blk.{i}.attn_kv_b.weight": ck.float32(f"model.layers.{i}.self_attn.kv_b_proj.weight")
            for i in range(3)}
    u32 = gguf.GGUFValueType.UINT32
    old = rewrite(src, tmp_path / "old.gguf", drop_keys=("deepseek2.attention.key_length_mla",
                                                         "deepseek2.attention.value_length_mla"),
                  set_keys={"deepseek2.attention.key_length": (20, u32), "deepseek2.attention.value_length": (20, u32)},
                  drop_tensors=[] if keep_split else [f"blk.{i}.attn_{kv}_b.weight" for i in range(3) for kv in "kv"],
                  tensors=kv_b)
    assert not any(isinstance(src, KvB) for src in open_gguf(old).index.values())
    with Engine.open(src, EngineConfig(pool="inproc", activations="f32")) as new, \
            Engine.open(old, EngineConfig(pool="inproc", activations="f32")) as eng:
        np.testing.assert_array_equal(logits(eng, PROMPT), logits(new, PROMPT))


def test_q8_0_file_computes_with_its_dequantised_weights(tmp_path):
    """llama-quantize's Q8_0 of the deepseek2 file (its experts and 64-wide matrices Q8_0; the rest, rows not of
    32, fall back): the engine keeps the file's blocks and agrees with a float32 checkpoint of the same
    dequantised weights."""
    path = ROOT / "gguf" / "deepseek_v3_basic-q8_0.gguf"
    ck = open_gguf(path)
    assert ck.info("model.layers.1.mlp.experts.gate_proj").dtype == "Q8_0"
    tensors = {}
    for n in ck.names():
        w = ck.float32(n)
        if n.endswith((".experts.gate_proj", ".experts.up_proj", ".experts.down_proj")):
            base, proj = n.rsplit(".", 1)
            tensors.update({f"{base}.{e}.{proj}.weight": w[e] for e in range(w.shape[0])})
        else:
            tensors[n] = w
    deq = tmp_path / "deq"
    save_checkpoint(deq, tensors, "F32")
    (deq / "config.json").write_text(json.dumps(gguf_config(ck.file)))
    with Engine.open(path, EngineConfig(pool="inproc", activations="f32")) as eng, \
            Engine.open(deq, EngineConfig(pool="inproc", activations="f32", expert_dtype="f32")) as ref:
        assert eng.expert_format == "q8"
        np.testing.assert_allclose(logits(eng, PROMPT), logits(ref, PROMPT), rtol=1e-4, atol=1e-5)
        assert eng.generate(PROMPT, max_new_tokens=6, stop_at_eos=False) == \
            ref.generate(PROMPT, max_new_tokens=6, stop_at_eos=False)


U32, F32 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32


@pytest.mark.parametrize("name, change, match", [
    ("deepseek_v3_basic", dict(drop_keys=("deepseek2.attention.kv_lora_rank",)),
     r"bad.gguf: metadata deepseek2.attention.kv_lora_rank is missing"),
    ("deepseek_v3_basic", dict(drop_keys=("deepseek2.rope.dimension_count",)),
     r"bad.gguf: metadata deepseek2.rope.dimension_count is missing"),
    ("deepseek_v3_basic", dict(set_keys={"deepseek2.expert_gating_func": (3, U32)}),
     r"bad.gguf: metadata deepseek2.expert_gating_func is 3; supported: 1 \(softmax\), 2 \(sigmoid\)"),
    ("deepseek_v3_basic", dict(drop_keys=("deepseek2.expert_gating_func",)),  # llama.cpp: softmax; bias present
     r"bad.gguf: a softmax router .* correction bias"),
    ("deepseek_v3_basic", dict(set_keys={"deepseek2.rope.scaling.type": ("longrope", gguf.GGUFValueType.STRING)}),
     r"bad.gguf: metadata deepseek2.rope.scaling.type 'longrope' is not supported"),
    ("deepseek_v3_basic", dict(set_keys={"deepseek2.attention.temperature_scale": (0.1, F32)}),
     r"bad.gguf: metadata deepseek2.attention.temperature_scale = 0.1: attention temperature"),
    ("deepseek_v3_basic", dict(drop_tensors=("blk.1.attn_v_b.weight",)),
     r"tensor blk.1.attn_k_b.weight without blk.1.attn_v_b.weight"),
    ("glm4_moe_basic", dict(drop_keys=("glm4moe.expert_feed_forward_length",)),
     r"bad.gguf: metadata glm4moe.expert_feed_forward_length is missing"),
    ("glm4_moe_basic", dict(set_keys={"glm4moe.expert_gating_func": (1, U32)}),
     r"bad.gguf: metadata glm4moe.expert_gating_func is not 2 \(sigmoid\)"),
])
def test_metadata_it_cannot_use_is_named_before_any_worker_starts(tmp_path, name, change, match):
    bad = rewrite(ROOT / "gguf" / f"{name}.gguf", tmp_path / "bad.gguf", **change)
    with pytest.raises(GgufError, match=match):
        Engine.open(bad, EngineConfig(pool="process", numa_split=True, nodes=2))


def test_yarn_without_log_multiplier_is_read_as_llama_cpp_does(tmp_path):
    """No yarn_log_multiplier (a config without mscale_all_dim): llama.cpp scales cos and sin by
    mscale(factor) = 1 + 0.1 ln(factor) and the softmax by its square; the configuration says so."""
    from coordinator.model.model_config import parse_model_config

    bad = rewrite(ROOT / "gguf" / "deepseek_v3_basic.gguf", tmp_path / "m.gguf",
                  drop_keys=("deepseek2.rope.scaling.yarn_log_multiplier",))
    cfg = parse_model_config(gguf_config(open_gguf(bad).file))
    m = 1 + 0.1 * np.log(40.0)
    assert cfg.yarn.attention_factor == pytest.approx(m)
    assert cfg.mla.softmax_scale == pytest.approx(20 ** -0.5 * m * m)


# DeepSeek-V3's tokenizer.json pre_tokenizer as the Hub has it (deepseek-ai/DeepSeek-V3), byte for byte
DEEPSEEK_V3_PRE = r'''{"type": "Sequence", "pretokenizers": [
  {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": false},
  {"type": "Split", "pattern": {"Regex": "[一-龥぀-ゟ゠-ヿ]+"}, "behavior": "Isolated", "invert": false},
  {"type": "Split", "pattern": {"Regex": "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"}, "behavior": "Isolated", "invert": false},
  {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]}'''
TOK_CORPUS = ["The quick brown fox jumps over the lazy dog. It's 2026; isn't it?",
              "Über naïve café: 東京 and 大阪, ひらがな カタカナ 1234567 apples, 89 pears!!\n\n  indented\tline",
              "def main():\n    return x_1 + y_22 == 333  # done (a.b)[c]",
              "We'll see, they'd said; I'M SURE you've LL'd it. $5.99 #tag @you",
              "abc東京def «quoted»word e\u0301te\u0301 x—y ¿qué? foo123bar"] * 20


@pytest.mark.parametrize("pre", ["deepseek-v3", "glm4"])
def test_deepseek_v3_and_glm4_split_rules(tmp_path, pre):
    """tokenizer.ggml.pre "deepseek-v3" (DeepSeek-V3/R1: three splits in turn) and "glm4" (GLM-4.5: Llama 3's,
    merges ignored for a piece that is a token): the ids of the tokenizer the file was written from."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from coordinator.cli.make_model import make_model
    from coordinator.text.gguf_tokenizer import LLAMA3, gguf_tokenizer
    from shm.gguf_file import GgufFile

    from gguf_writer import write_gguf

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE(ignore_merges=pre == "glm4"))
    if pre == "deepseek-v3":
        spec = json.loads(DEEPSEEK_V3_PRE)["pretokenizers"]
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(s["pattern"]["Regex"]), behavior="isolated", invert=False) for s in spec[:3]]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TOK_CORPUS, trainers.BpeTrainer(vocab_size=460, special_tokens=specials,
                                                            show_progress=False,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    ckpt = make_model(tmp_path / "m", seed=9, hidden_size=64, moe_intermediate_size=96, vocab_size=512)
    path = tmp_path / "m.gguf"
    write_gguf(ckpt, path, tokenizer=tok, pre=pre)
    got = gguf_tokenizer(GgufFile(path).metadata)
    merged = 0
    for text in TOK_CORPUS[:5] + ["<|im_start|>user\n東京タワー 12345678 x(y)<|im_end|>", "naïve—\r\n\r\n  x", ""]:
        ids = tok.encode(text).ids
        assert got.encode(text).ids == ids, text
        assert got.decode(ids, skip_special_tokens=False) == text
        merged += sum(i >= 256 + len(specials) for i in ids)
    assert merged > 20


def nextn_layer(hf_dir: Path, seed: int = 5) -> dict[str, np.ndarray]:
    """A whole nextn layer for the 3-layer glm4_moe fixture (layer id 3): layer 2's tensors, each scaled by its
    own random factors, and the MTP module's own (no embedding or head: the model's are shared)."""
    from shm.checkpoint import Checkpoint

    rng = np.random.default_rng(seed)
    hf = Checkpoint(hf_dir)
    t = {n.replace(".layers.2.", ".layers.3."): hf.float32(n) * rng.uniform(0.5, 1.5, hf.float32(n).shape)
         for n in hf.names() if ".layers.2." in n}
    H = t["model.layers.3.input_layernorm.weight"].shape[0]
    t.update({f"model.layers.3.{n}.weight": (1 + 0.1 * rng.standard_normal(H)) for n in ("enorm", "hnorm",
                                                                                           "shared_head.norm")})
    t["model.layers.3.eh_proj.weight"] = rng.standard_normal((H, 2 * H)) / np.sqrt(2 * H)
    return {n: np.ascontiguousarray(a, np.float32) for n, a in t.items()}


def as_gguf_names(layer: dict[str, np.ndarray], E: int) -> dict[str, np.ndarray]:
    """The nextn layer under llama.cpp's names: blk.3.nextn.* for its own, the experts stacked [E, I, H]."""
    from coordinator.model.arch.glm4_moe import FAMILY as GLM
    from coordinator.model.arch.gguf import NEXTN_TENSORS

    names = {hf: g for g, hf in {**GLM.gguf_layer_tensors, **NEXTN_TENSORS}.items()}
    out = {f"blk.3.{names[n[len('model.layers.3.'):]]}": a for n, a in layer.items() if ".experts." not in n}
    for proj in ("gate_proj", "up_proj", "down_proj"):
        out[f"blk.3.{names[f'mlp.experts.{proj}']}"] = np.stack(
            [layer[f"model.layers.3.mlp.experts.{e}.{proj}.weight"] for e in range(E)])
    return out


def test_the_nextn_layer_of_a_glm_file_is_the_checkpoints(tmp_path):
    """GLM-4.5's files count the multi-token-prediction layer in block_count (nextn_predict_layers) and hold its
    tensors (blk.N.nextn.* and a whole layer's): the engine runs the N layers before as the model and the nextn
    layer as its MTP layer, both giving the checkpoint's logits bit for bit; greedy with MTP drafts is greedy."""
    from safetensors.numpy import save_file

    hf_dir = tmp_path / "hf"
    shutil.copytree(ROOT / "hf" / "glm4_moe_basic", hf_dir)
    layer = nextn_layer(hf_dir)
    save_file(layer, str(hf_dir / "nextn.safetensors"))
    path = rewrite(ROOT / "gguf" / "glm4_moe_basic.gguf", tmp_path / "mtp.gguf", tensors=as_gguf_names(layer, 8))
    ck = open_gguf(path)
    assert gguf_config(ck.file)["num_hidden_layers"] == 3
    assert {n for n in ck.names() if ".layers.3." in n} == {n for n in layer if ".experts." not in n} | {
        f"model.layers.3.mlp.experts.{p}" for p in ("gate_proj", "up_proj", "down_proj")}
    got = {}
    for name, where in (("hf", hf_dir), ("gguf", path)):
        with Engine.open(where, EngineConfig(pool="inproc", activations="f32")) as eng:
            assert eng.has_mtp and eng.model_config.moe_layers == [1, 2, 3]
            out = eng.step(StepBatch([(np.asarray(PROMPT, np.int64), eng.new_cache())], all_rows=frozenset({0}),
                                     hidden=True))
            main, hidden = out.logits[0], out.hidden
            mtp, _ = eng.decoder.forward_mtp([(hidden, np.asarray(PROMPT[1:] + [1], np.int64),
                                               eng.new_mtp_cache())], last_only=False)
            plain = eng.generate(PROMPT, max_new_tokens=12, stop_at_eos=False)
            drafted = eng.generate(PROMPT, max_new_tokens=12, stop_at_eos=False, speculative="mtp")
            got[name] = (main, mtp[0], plain)
            assert drafted == plain
    assert np.array_equal(got["gguf"][0], got["hf"][0])
    assert np.array_equal(got["gguf"][1], got["hf"][1])
    assert got["gguf"][2] == got["hf"][2]
    with Engine.open(ROOT / "gguf" / "glm4_moe_basic.gguf", EngineConfig(pool="inproc", activations="f32")) as eng:
        assert not eng.has_mtp  # the fixture's file counts the layer but holds none of its tensors
        assert np.array_equal(logits(eng, PROMPT), got["hf"][0])