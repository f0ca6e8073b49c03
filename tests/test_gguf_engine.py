"""The engine on a GGUF file (issue 15): the file's expert blocks kept as they are, computed on exactly their
dequantised weights, in process and split over two virtual nodes; the choices it cannot make, named.

The reference is a safetensors checkpoint written from the same file's dequantised tensors (gguf.quants), run
with f32 experts: the GGUF engine must agree with it to float rounding, while the store holds the file's
blocks (checked byte for byte against the file, not against a quantisation of ours).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from coordinator.cli.make_model import make_model
from coordinator.config import EngineConfig
from coordinator.engine import Engine
from coordinator.errors import ConfigValueError
from coordinator.model.step import StepBatch
from shm import formats
from shm.checkpoint_writer import save_checkpoint
from shm.expert_store import HeapExpertStore
from shm.gguf_blocks import repack
from coordinator.model.arch import gguf_config
from coordinator.model.source import open_gguf
from shm.gguf_checkpoint import gguf_path
from shm.gguf_file import GgufError
from shm.plan import NodeShare, make_plan

from gguf_writer import write_gguf

PROMPT = [3, 17, 42, 5, 99, 7]


def dequantised_checkpoint(gguf_file, config_src, out):
    """A safetensors folder holding the GGUF's tensors dequantised, experts one by one as transformers names them."""
    ck = open_gguf(gguf_file)
    mixtral = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"} if ck.file.arch == "llama" else None
    tensors = {}
    for name in ck.names():
        w = ck.float32(name)
        if name.endswith((".experts.gate_proj", ".experts.up_proj", ".experts.down_proj")):
            base, proj = name.rsplit(".", 1)
            for e in range(w.shape[0]):
                tensors[f"{base}.{e}.{mixtral[proj] if mixtral else proj}.weight"] = w[e]
        else:
            tensors[name] = w
    save_checkpoint(out, tensors, "F32")
    for extra in ("config.json", "generation_config.json", "tokenizer.json"):
        shutil.copy(config_src / extra, out / extra)
    return out


# name -> (experts' type, ffn_down_exps' types by layer, the store formats auto chooses, model geometry)
FILES = {
    "Q8_0": (Q.Q8_0, {}, "q8", dict(hidden_size=64, moe_intermediate_size=96)),  # 3 blocks of 32: 2 nodes
    "Q4_0": (Q.Q4_0, {}, "q4", dict(hidden_size=64, moe_intermediate_size=96)),
    # as llama.cpp's Q4_K_M mixes them (Q6_K down in some layers; Q5_K as Q5_K_M has it): K blocks of 256
    "Q4_K_M": (Q.Q4_K, {0: Q.Q6_K, 2: Q.Q5_K}, "q4k/q4k/q6k;1=q4k;2=q4k/q4k/q5k",
               dict(hidden_size=256, moe_intermediate_size=768, num_layers=3)),  # 1.5 blocks a node: turns
}


@pytest.fixture(scope="module", params=list(FILES))
def files(request, tmp_path_factory):
    qtype, down, _, geometry = FILES[request.param]
    root = tmp_path_factory.mktemp(f"gguf-{request.param}")
    ckpt = make_model(root / "m", seed=7, **geometry)
    path = root / "dir" / "m.gguf"
    path.parent.mkdir()
    write_gguf(ckpt, path, experts=qtype, down=down)
    shutil.copy(ckpt / "tokenizer.json", path.parent / "tokenizer.json")
    return request.param, path, dequantised_checkpoint(path, ckpt, root / "deq")


def logits(eng: Engine, ids) -> np.ndarray:
    return eng.step(StepBatch.of(np.asarray(ids, np.int64), eng.decoder.new_cache(), every_row=True)).logits[0]


def test_the_store_holds_the_files_blocks_byte_for_byte(files):
    name, path, _ = files
    ck = open_gguf(path)
    fmt = FILES[name][2]
    cfg = gguf_config(ck.file)
    I, H = cfg["moe_intermediate_size"], cfg["hidden_size"]
    block = formats.ExpertFormats.parse(fmt).down_block
    plan = make_plan([NodeShare(0, 1), NodeShare(1, 2)], [I], max(32, block))  # node 1: twice node 0's rows
    from coordinator.model.model_config import parse_model_config
    from coordinator.model.weights import load_weights
    experts = {k: (refs, I) for k, refs in load_weights(parse_model_config(cfg), ck).experts.items()}
    for node in (0, 1):
        rows = plan.slice_of(I, node)
        store = HeapExpertStore.from_checkpoint(ck, plan, node, experts, fmt)
        try:
            for layer, e in [(0, 0), (1, 3), (2, 5)]:
                got = store.get(layer, e)
                gate_name, down_name = (f"model.layers.{layer}.mlp.experts.{m}" for m in ("gate_proj", "down_proj"))
                gate, down = ck.raw(gate_name)[e], ck.raw(down_name)[e]
                gate_type, down_type = (Q[ck.info(n).dtype] for n in (gate_name, down_name))
                assert got.formats == formats.ExpertFormats.parse(fmt).of(layer)
                assert np.array_equal(got.gate, repack(gate[rows.start:rows.stop], gate_type, H)[1])
                values, per_block = GGML_QUANT_SIZES[down_type]
                cols = slice(rows.start // values * per_block, rows.stop // values * per_block)
                assert np.array_equal(got.down, repack(down[:, cols], down_type, rows.stop - rows.start)[1])
                # and so the weights the kernels compute with are the file's, dequantised by gguf.quants
                want = ck.float32(down_name)[e][:, rows.start:rows.stop]
                assert np.array_equal(formats.decoded(formats.get(got.formats[2]), got.down), want)
        finally:
            store.close()


def test_engine_on_the_file_agrees_with_its_dequantised_weights_single_and_split_bitwise_in_process(files):
    qtype, path, deq = files
    with Engine.open(deq, EngineConfig(pool="inproc", activations="f32", expert_dtype="f32")) as ref:
        want = logits(ref, PROMPT)
        want_ids = ref.generate(PROMPT, max_new_tokens=6, stop_at_eos=False)
    with Engine.open(path, EngineConfig(pool="inproc", activations="f32")) as eng:
        assert eng.expert_format == FILES[qtype][2]  # auto: the file's blocks, kept, each tensor's own type
        inproc = logits(eng, PROMPT)
        assert eng.generate(PROMPT, max_new_tokens=6, stop_at_eos=False) == want_ids
    np.testing.assert_allclose(inproc, want, rtol=1e-4, atol=1e-5)
    with Engine.open(path, EngineConfig(pool="process", activations="f32")) as eng:  # single: one worker process, whole experts
        assert np.array_equal(logits(eng, PROMPT), inproc)
    split = dict(numa_split=True, nodes=2)  # the same plan in process and in two worker processes
    with Engine.open(path, EngineConfig(pool="inproc", activations="f32", **split)) as eng:
        inproc_split = logits(eng, PROMPT)
        # the plan cuts on the down format's block (256 rows for K blocks), and 3 blocks go 1 + 2, then 2 + 1,
        # expert by expert
        assert eng.pool.plan.block == (256 if qtype == "Q4_K_M" else 32)
        assert len(set(eng.pool.plan.turns[eng.model_config.moe_intermediate_size])) == 2
    with Engine.open(path.parent, EngineConfig(pool="process", activations="f32", **split)) as eng:  # the folder names the file
        assert [n.virtual for n in eng.nodes] == [True, True]
        assert np.array_equal(logits(eng, PROMPT), inproc_split)
    np.testing.assert_allclose(inproc_split, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch, gguf_arch", [("mixtral", "llama"), ("qwen2_moe", "qwen2moe")])
def test_mixtral_and_qwen2_moe_files(tmp_path, arch, gguf_arch):
    """Mixtral as llama.cpp writes it (arch llama, q and k rows permuted for ggml's rope), Qwen2-MoE with its
    shared expert: the same logits as the safetensors checkpoint they came from, to the experts' Q8_0 rounding,
    and exactly those of the file's dequantised weights."""
    ckpt = make_model(tmp_path / "m", arch=arch, seed=11, hidden_size=64, moe_intermediate_size=96)
    path = tmp_path / "m.gguf"
    write_gguf(ckpt, path, arch=gguf_arch, experts=Q.Q8_0)
    deq = dequantised_checkpoint(path, ckpt, tmp_path / "deq")
    with Engine.open(path, EngineConfig(pool="inproc", activations="f32")) as eng, \
            Engine.open(deq, EngineConfig(pool="inproc", activations="f32", expert_dtype="f32")) as ref, \
            Engine.open(ckpt, EngineConfig(pool="inproc", activations="f32")) as orig:
        assert eng.model_config.arch == arch
        got = logits(eng, PROMPT)
        np.testing.assert_allclose(got, logits(ref, PROMPT), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got, logits(orig, PROMPT), atol=0.05)  # Q8_0 experts against the originals
        assert eng.generate(PROMPT, max_new_tokens=5, stop_at_eos=False) == \
            ref.generate(PROMPT, max_new_tokens=5, stop_at_eos=False)


def test_block_types_without_an_exact_store_format_ask_for_one(tmp_path):
    ckpt = make_model(tmp_path / "m", seed=8, hidden_size=64, moe_intermediate_size=96)
    path = tmp_path / "q41.gguf"
    write_gguf(ckpt, path, experts=Q.Q4_1)
    with pytest.raises(ConfigValueError, match=r"Q4_1 blocks.*choose --expert-dtype"):
        Engine.open(path, EngineConfig(pool="inproc"))
    with Engine.open(path, EngineConfig(pool="inproc", expert_dtype="bf16")) as eng:  # converted, as asked
        assert eng.expert_format == "bf16" and logits(eng, PROMPT[:2]).shape[0] == 2
    unreadable = tmp_path / "q81.gguf"  # Q8_1 is an intermediate type gguf.quants does not read
    write_gguf(ckpt, unreadable, experts=Q.Q8_1)
    with pytest.raises(GgufError, match=r"q81.gguf: tensor blk.0.ffn_gate_exps.weight has type Q8_1"):
        Engine.open(unreadable, EngineConfig(pool="process", expert_dtype="q8"))  # before any worker starts
    q41_down = tmp_path / "q41-down.gguf"  # a type with no exact format, in one matrix: that matrix named
    write_gguf(ckpt, q41_down, experts=Q.Q8_0, down={1: Q.Q4_1})
    with pytest.raises(ConfigValueError, match=r"layer 1 down \(model.layers.1.mlp.experts.down_proj, Q4_1\): "
                                               r"the experts are Q4_1 blocks.*choose --expert-dtype"):
        Engine.open(q41_down, EngineConfig(pool="inproc"))
    with pytest.raises(ConfigValueError, match=r"layer 0 gate .*expert format q4k holds a GGUF file's Q4_K blocks "
                                               r"as they are; these experts are Q8_0"):
        Engine.open(q41_down, EngineConfig(pool="inproc", expert_dtype="q4k"))


def test_a_split_set_opened_by_its_first_part_is_the_whole_file(tmp_path):
    ckpt = make_model(tmp_path / "m", seed=12, hidden_size=64, moe_intermediate_size=96)
    write_gguf(ckpt, tmp_path / "one.gguf")
    (tmp_path / "parts").mkdir()
    write_gguf(ckpt, tmp_path / "parts" / "m.gguf", split_max_tensors=12)
    parts = sorted(p.name for p in (tmp_path / "parts").iterdir())
    assert len(parts) >= 3 and parts[0].startswith("m-00001-of-")
    with Engine.open(tmp_path / "one.gguf", EngineConfig(pool="inproc")) as one, \
            Engine.open(tmp_path / "parts" / parts[0], EngineConfig(pool="inproc")) as split:
        assert np.array_equal(logits(split, PROMPT), logits(one, PROMPT))
    (tmp_path / "parts" / parts[1]).unlink()
    with pytest.raises(GgufError, match=f"missing {parts[1]}"):
        Engine.open(tmp_path / "parts" / parts[0], EngineConfig(pool="inproc"))


def test_a_model_path_names_one_gguf_file(tmp_path):
    assert gguf_path(tmp_path) is None  # an empty folder: not GGUF (the safetensors reader names what is missing)
    (tmp_path / "a.gguf").write_bytes(b"")
    assert gguf_path(tmp_path) == tmp_path / "a.gguf"
    (tmp_path / "b-00001-of-00002.gguf").write_bytes(b"")
    (tmp_path / "b-00002-of-00002.gguf").write_bytes(b"")
    with pytest.raises(GgufError, match=r"holds 2 GGUF models \(a.gguf, b-00001-of-00002.gguf\)"):
        gguf_path(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({}))
    assert gguf_path(tmp_path) is None  # a Hugging Face folder, whatever else it holds


def test_integer_dots_keep_the_greedy_tokens_and_stay_near_the_float_path(files):
    """The default activations (q8: integer dot products in decode, as llama.cpp computes) against the
    float-activation path on the same file: the same greedy tokens, logits off by the activations' rounding,
    in process and split."""
    qtype, path, _ = files
    with Engine.open(path, EngineConfig(pool="inproc", activations="f32")) as ref:
        want = ref.logits(PROMPT, steps=True)
        want_ids = ref.generate(PROMPT, max_new_tokens=6, stop_at_eos=False)
    with Engine.open(path, EngineConfig(pool="inproc")) as eng:
        assert eng.config.activations == "q8"
        got = eng.logits(PROMPT, steps=True)
        assert eng.generate(PROMPT, max_new_tokens=6, stop_at_eos=False) == want_ids
    with Engine.open(path, EngineConfig(pool="process", numa_split=True, nodes=2)) as eng:
        assert eng.generate(PROMPT, max_new_tokens=6, stop_at_eos=False) == want_ids
    per_position = np.abs(got - want).max(axis=1) / np.abs(want).max()
    # the rounding moves the logits by ~0.5 %; a near tie in a router may pick another expert at one position
    # of this random model (Q8_0's last: 16 %), as it may in llama.cpp, so the median is what is bounded
    assert 1e-6 < np.median(per_position) < 2e-2


@pytest.mark.parametrize("arch, gguf_arch, dense", [("qwen3_moe", "qwen3moe", Q.Q8_0), ("qwen3_moe", "qwen3moe", Q.Q4_0),
                                                    ("mixtral", "llama", Q.Q8_0)])
def test_quantised_dense_matrices_are_read_as_the_file_has_them(tmp_path, arch, gguf_arch, dense):
    """A file whose attention, embedding and lm_head are quantised (the router F32): without a GPU they are
    kept as its blocks (dense_dtype auto), Mixtral's q and k too (their rows gathered back from the converter's
    permutation), and computed with exactly the dequantised weights; f32 asks for float32 copies."""
    from coordinator.host.packed import PackedMatrix

    ckpt = make_model(tmp_path / "m", arch=arch, seed=12, hidden_size=64, moe_intermediate_size=96)
    path = tmp_path / "m.gguf"
    write_gguf(ckpt, path, arch=gguf_arch, experts=Q.Q8_0, dense=dense)
    deq = dequantised_checkpoint(path, ckpt, tmp_path / "deq")
    want_format = {Q.Q8_0: "q8", Q.Q4_0: "q4"}[dense]
    with Engine.open(path, EngineConfig(pool="inproc", device="cpu", activations="f32")) as eng, \
            Engine.open(deq, EngineConfig(pool="inproc", device="cpu", activations="f32")) as ref:
        w = eng.decoder.w
        assert all(isinstance(getattr(layer, m), PackedMatrix) and getattr(layer, m).fmt.NAME == want_format
                   for layer in w.layers for m in "qkvo")
        assert isinstance(w.lm_head, PackedMatrix) and w.lm_head.fmt.NAME == want_format
        assert w.layers[0].router.wt.dtype == np.float32 and ref.decoder.w.layers[0].q.fmt.NAME == "f32"
        got, want = eng.logits(PROMPT, steps=True), ref.logits(PROMPT, steps=True)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        assert eng.generate(PROMPT, max_new_tokens=5, stop_at_eos=False) == \
            ref.generate(PROMPT, max_new_tokens=5, stop_at_eos=False)
    with Engine.open(path, EngineConfig(pool="inproc", device="cpu", dense_dtype="f32")) as eng:
        assert eng.decoder.w.lm_head.fmt.NAME == "f32"  # float32 rows for the batch-invariant loops
    with Engine.open(path, EngineConfig(pool="inproc", device="cpu", dense_dtype="f32", batch_invariant=False)) as eng:
        assert isinstance(eng.decoder.w.lm_head, np.ndarray)
