"""Quantised GGUF files as users have them: llama.cpp's converter, then ``llama-quantize`` to Q8_0, Q4_K_M and IQ4_XS
(tests/fixtures/gguf/<case>-<type>.gguf, made by tools/gguf_quant_fixtures.py from random-weight transformers models
of every supported architecture whose matrices' rows are whole super-blocks, so no type falls back but for
DeepSeek's attn_k_b, whose rows of 128 llama-quantize stores as Q5_0 or IQ4_NL).

Each file's .npz holds transformers' float32 logits on the file's dequantised weights and llama.cpp's own
log-probabilities on the same tokens (llama-perplexity --kl-divergence-base). The engine opens the files unmodified
(llama-quantize writes the shared expert's [1, H] gate as [H]), keeps every dense matrix in the file's blocks, Gated
DeltaNet's projections among them, stays within 1.2x of llama.cpp's own error from the reference, picks the
reference's token wherever its margin is clear, and split over two (virtual) nodes gives in-process's bits."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from coordinator.config import EngineConfig
from coordinator.engine import Engine
from coordinator.host.packed import PackedMatrix, dense_matrices
from shm.formats import traits

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from gguf_quant_fixtures import log_probs, worst  # noqa: E402  (the report's figure: tools/gguf_quant_fixtures.py)

FIXTURES = Path(__file__).parent / "fixtures" / "gguf"
CASES = ("qwen3_next_quant", "qwen2_moe_quant", "qwen3_moe_quant", "mixtral_quant", "glm4_moe_quant", "deepseek_v3_quant")
FILES = [f"{case}-{qtype}" for case in CASES for qtype in ("Q8_0", "Q4_K_M", "IQ4_XS")]
SHARED_GATE = ("qwen3_next_quant", "qwen2_moe_quant")  # the architectures with a shared expert's gate


@pytest.fixture(scope="module", params=FILES)
def run(request):
    """(file stem, the .npz, in-process logits, the in-process engine's dense matrices and format summary, and the
    logits split over two virtual nodes by the in-process pool and by two node workers) of one file."""
    path = FIXTURES / f"{request.param}.gguf"
    ref = np.load(FIXTURES / f"{request.param}.npz")
    tokens = ref["tokens"].tolist()
    with Engine.open(path, EngineConfig(pool="inproc")) as eng:
        logits = eng.logits(tokens)
        matrices = [(name, getattr(obj, name)) for obj, name in dense_matrices(eng.decoder.w)
                    if getattr(obj, name) is not None]
        dense_format = eng.dense_format
    split = {}
    for pool in ("inproc", "process"):  # the same plan: each node's rows of every expert, in process or in a worker
        with Engine.open(path, EngineConfig(pool=pool, numa_split=True, nodes=2)) as eng:
            assert len(eng.cpu.plan.node_ids) == 2
            split[pool] = eng.logits(tokens)
    return request.param, ref, logits, matrices, dense_format, split


def test_the_shared_expert_gate_is_one_dimensional_in_the_file():
    """What the engine has to open: llama-quantize writes ffn_gate_inp_shexp as [H] (the converter's is [1, H]),
    in every quantised file of both architectures that have one."""
    for stem in (f for f in FILES if f.startswith(SHARED_GATE)):
        shapes = {t.name: [int(n) for n in t.shape] for t in gguf.GGUFReader(FIXTURES / f"{stem}.gguf").tensors}
        gates = [shape for name, shape in shapes.items() if name.endswith("ffn_gate_inp_shexp.weight")]
        assert gates and all(len(shape) == 1 for shape in gates), stem


def test_within_llama_cpps_own_error_of_the_reference(run):
    """The |log-prob difference| from transformers on the dequantised weights, over the positions llama.cpp scored:
    its median at most 1.2x llama.cpp's own median on the same positions, and at most one position beyond 1.2x
    llama.cpp's largest. A random model's router is near a tie here and there (DeepSeek's group limit, a top-k
    boundary), so the int8 activations that llama.cpp rounds too may take another expert at one position: that
    position's error is the model's sensitivity, and which side of the tie each takes is chance."""
    stem, ref, logits, *_ = run
    first, T = int(ref["first"]), ref["tokens"].size
    want = log_probs(ref["reference"][first:T - 1])
    ours, theirs = worst(log_probs(logits[first:T - 1]), want), worst(ref["llama"], want)
    assert np.median(ours) <= 1.2 * np.median(theirs), (stem, np.median(ours), np.median(theirs))
    assert (ours > 1.2 * theirs.max()).sum() <= 1, (stem, ours.round(3).tolist(), theirs.max())


def test_the_references_token_wherever_its_margin_is_clear(run):
    """At every position whose reference margin (best less second log-prob) exceeds twice llama.cpp's own error
    there (either entry may move by that much), the engine's best token is the reference's; the one position a
    router's near-tie may take elsewhere (test_within_llama_cpps_own_error_of_the_reference) aside."""
    stem, ref, logits, *_ = run
    first, T = int(ref["first"]), ref["tokens"].size
    want = log_probs(ref["reference"][first:T - 1])
    theirs = worst(ref["llama"], want)
    flipped = worst(log_probs(logits[first:T - 1]), want) > 1.2 * theirs.max()
    top2 = np.sort(want, -1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0] > 2 * theirs) & ~flipped
    assert clear.sum() >= want.shape[0] // 4, stem  # enough positions are clear for the check to test something
    assert np.array_equal(logits[first:T - 1].argmax(-1)[clear], want.argmax(-1)[clear]), stem


def test_every_dense_matrix_keeps_the_files_blocks(run):
    """No dense matrix of the file is float32: attention's (q and its gate regrouped from one tensor, Mixtral's
    permuted q and k), the Gated DeltaNet's qkv, z, ba and out, MLA's, the dense and shared MLPs', the lm_head: each
    is packed in the format that holds its tensor's type, and the bench's summary counts them all. The one
    exception is MLA's kv_b, which the file holds as attn_k_b (transposed) and attn_v_b: float32 rows, and counted
    so."""
    stem, _, _, matrices, dense_format, _ = run
    unpacked = [name for name, m in matrices if not isinstance(m, PackedMatrix) or m.fmt.NAME == "f32"]
    assert matrices and unpacked == (["kv_b"] * unpacked.count("kv_b") if stem.startswith("deepseek") else []), stem
    counts = {fmt: int(n) for n, fmt in (p.split() for p in dense_format.split(", "))}
    assert counts.get("f32", 0) == len(unpacked) and sum(counts.values()) == len({id(m) for _, m in matrices})
    if stem.startswith("qwen3_next"):
        assert {"qkv", "z", "ba", "out", "q_gate"} <= {name for name, _ in matrices}


@pytest.mark.parametrize("stem", FILES)
def test_the_packed_rows_are_the_files(stem):
    """A matrix keeps the file's bytes, not a second rounding, also where the loader regrouped its rows (Qwen3-Next's
    q and gate from attn_q, ssm_ba's b and a rows): decoded, every packed matrix is exactly the float32 weights the
    loader read, and its format is the one that holds its tensor's type."""
    from coordinator.model.model_config import parse_model_config
    from coordinator.host.packed import Packing, pack_dense
    from coordinator.model.weights import load_weights
    from coordinator.model.arch import gguf_config
    from coordinator.model.source import open_gguf

    ck = open_gguf(FIXTURES / f"{stem}.gguf")
    try:
        weights = load_weights(parse_model_config(gguf_config(ck.file)), ck)
        read = [(obj, name, getattr(obj, name), weights.sources.get(getattr(obj, name)))
                for obj, name in dense_matrices(weights) if getattr(obj, name) is not None]
        assert any(source.rows is not None for *_, source in read) == stem.startswith("qwen3_next")
        pack_dense(weights, None, Packing(int_act=True, invariant=False), ck)  # kv_b left float32
        for obj, name, w, source in read:
            packed = getattr(obj, name)
            if name == "kv_b" and not isinstance(packed, PackedMatrix):
                continue  # put back together from two tensors, one transposed (test_every_dense_matrix_keeps...)
            assert isinstance(packed, PackedMatrix), (stem, name)
            assert packed.fmt.NAME == traits.EXACT[ck.info(source.tensor).dtype], (stem, name)
            assert np.array_equal(packed.decoded(), w), (stem, name)
    finally:
        ck.close()


def test_split_over_two_nodes_gives_in_process_bits(run):
    """Two node workers, each with its rows of every expert in its own segment, give the bits of the in-process
    pool on the same plan; and the split's logits are the unsplit ones' but for the partial sums' order."""
    stem, _, logits, *_, split = run
    assert np.array_equal(split["process"], split["inproc"]), stem
    np.testing.assert_allclose(split["inproc"], logits, atol=0.05 * np.abs(logits).max())
