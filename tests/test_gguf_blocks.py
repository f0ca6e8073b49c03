"""GGUF rows repacked into the stores' formats dequantise to exactly what gguf.quants reads from the file."""

from __future__ import annotations

import numpy as np
import gguf
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants

from shm import formats, gguf_blocks

from shm.gguf_blocks import random_blocks

from invariance import first_token_alone_and_beside

H = 256


def random_rows(ggml_type: int, rows: int, rng: np.random.Generator, hidden: int = H) -> np.ndarray:
    """Valid random rows of the file: any value bytes, finite float16 scales of either sign."""
    raw = random_blocks(ggml_type, (rows, gguf_blocks.file_row_bytes(ggml_type, hidden)), rng)
    if ggml_type in gguf_blocks.BLOCK_BYTES:
        blocks = raw.reshape(rows, H // 32, gguf_blocks.BLOCK_BYTES[ggml_type])
        scales = (rng.standard_normal((rows, H // 32)) * 1e-2).astype(np.float16)
        blocks[:, :, :2] = scales.view(np.uint8).reshape(rows, H // 32, 2)
    elif ggml_type == gguf_blocks.F32:
        raw = rng.standard_normal((rows, H)).astype(np.float32).view(np.uint8)
    elif ggml_type == gguf_blocks.F16:
        raw = rng.standard_normal((rows, H)).astype(np.float16).view(np.uint8)
    return raw


@pytest.mark.parametrize("ggml_type", sorted(gguf_blocks.LOSSLESS), ids=lambda t: t.name)
def test_repacked_rows_dequantise_bit_exactly_as_gguf_reads_them(ggml_type):
    assert int(ggml_type) == {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 8, "BF16": 30, "Q4_K": 12, "Q5_K": 13,
                              "Q6_K": 14, "IQ4_XS": 23}[Q(ggml_type).name]  # the file's ids
    raw = random_rows(ggml_type, 7, np.random.default_rng(ggml_type))
    name, stored = gguf_blocks.repack(raw, ggml_type, H)
    fmt = formats.get(name)
    assert stored.shape == (7, fmt.row_bytes(H) // np.dtype(fmt.STORED_DTYPE).itemsize)
    want = quants.dequantize(raw, Q(ggml_type)).astype(np.float32)  # [7, H]
    got = formats.decoded(fmt, stored)
    assert got.shape == want.shape == (7, H)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # every bit, the signs of zeros too


def test_types_without_a_lossless_format_and_wrong_row_sizes_are_named():
    with pytest.raises(ValueError, match="IQ4_NL has no lossless store format .*Q8_0"):
        gguf_blocks.repack(np.zeros((1, 144), np.uint8), int(Q.IQ4_NL), H)
    with pytest.raises(ValueError, match="Q6_K rows of 32 values: not a whole number of 256-blocks"):
        gguf_blocks.repack(np.zeros((1, 26), np.uint8), int(Q.Q6_K), 32)
    with pytest.raises(ValueError, match="Q8_0 rows of 256 values take 272 bytes, got 271"):
        gguf_blocks.repack(np.zeros((1, 271), np.uint8), gguf_blocks.Q8_0, H)
    with pytest.raises(ValueError, match="Q4_0 rows of 40 values: not a whole number of 32-blocks"):
        gguf_blocks.repack(np.zeros((1, 20), np.uint8), gguf_blocks.Q4_0, 40)


K_TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS]  # the types in super-blocks of 256


@pytest.mark.parametrize("ggml_type", K_TYPES, ids=lambda t: t.name)
def test_compiled_readers_of_k_blocks_dequantise_bit_exactly(ggml_type):
    """The kernels' own reading of a row (node_worker/kernels: each 32-group of a super-block widened in
    registers) gives gguf.quants' weights bit for bit: no second rounding, no fused multiply-add."""
    from node_worker.kernels import dense
    from node_worker.kernels.kernel_set import KernelSet
    from node_worker.kernels.rows import FORMAT_IDS

    raw = random_rows(ggml_type, 5, np.random.default_rng(int(ggml_type)), hidden=512)
    name, stored = gguf_blocks.repack(raw, ggml_type, 512)
    out = np.empty((5, 512), np.float32)
    dense.decode_rows(KernelSet.of([name], False), FORMAT_IDS[name], np.ascontiguousarray(stored).reshape(-1), 0,
                      stored.shape[1], 0, out)
    want = quants.dequantize(raw, Q(ggml_type)).astype(np.float32)
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("triple", [(t, t, t) for t in K_TYPES] + [(Q.Q4_K, Q.IQ4_XS, Q.Q6_K)],
                         ids=lambda t: "/".join(q.name for q in t))
@pytest.mark.parametrize("tokens_per_expert", [1, 5])  # decode's four rows at a time; prefill's 2 rows x 4 tokens
def test_node_compute_on_k_blocks_equals_float64_on_the_dequantised_weights(triple, tokens_per_expert):
    """An expert kept as the file's K blocks (gate [R, H], up [R, H], down [H, R], R = 512 rows: two
    super-blocks along down's rows), each matrix in its own type as a Q4_K_M file mixes them, computed by the
    node's compiled layer call against float64 on gguf.quants' weights."""
    from node_worker.worker import NodeWorker
    from shm.expert_source import ExpertSlice
    from shm.expert_store import HeapExpertStore

    rng = np.random.default_rng(3)
    R = 512
    raws = [random_rows(triple[0], R, rng), random_rows(triple[1], R, rng), random_rows(triple[2], H, rng, hidden=R)]
    stored = [gguf_blocks.repack(raw, t, raw.shape[1] // gguf.GGML_QUANT_SIZES[t][1] * 256)
              for raw, t in zip(raws, triple)]
    spec = formats.ExpertFormats(tuple(name for name, _ in stored)).spec
    assert spec == ("/".join(name for name, _ in stored) if len(set(triple)) > 1 else stored[0][0])
    expert = ExpertSlice(*(s for _, s in stored), spec)
    worker = NodeWorker(0, HeapExpertStore(0, {(0, 0): expert, (0, 2): expert}, spec), H, threads=2,
                        activations="f32")  # the float-activation path, the reference
    try:
        x = rng.standard_normal((tokens_per_expert + 1, H)).astype(np.float32)
        tokens = np.repeat(np.arange(tokens_per_expert), 2)  # every token to experts 0 and 2
        experts = np.tile([0, 2], tokens_per_expert)
        weights = rng.random(tokens.size).astype(np.float32)
        y = worker.compute(0, x, tokens, experts, weights)
    finally:
        worker.close()
    g, u, d = (quants.dequantize(raw, t).astype(np.float64) for raw, t in zip(raws, triple))
    a, b = x.astype(np.float64) @ g.T, x.astype(np.float64) @ u.T
    per_token = (a / (1 + np.exp(-a)) * b) @ d.T  # [T + 1, H]
    want = np.zeros_like(per_token)
    np.add.at(want, tokens, weights[:, None].astype(np.float64) * per_token[tokens])
    scale = np.abs(want).max()
    assert scale > 0 and not y[tokens_per_expert].any()  # the token routed nowhere gets nothing
    np.testing.assert_allclose(y, want, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("shuffle", [True, False], ids=["byte shuffle", "select tree"])
def test_both_iq4xs_level_lookups_give_the_levels(shuffle):
    """IQ4_XS's 16 levels are looked up by pshufb where the host has SSSE3, else by a tree of selects: the
    kernels compile only the host's choice, so each is compiled here on its own, on every index."""
    from llvmlite import ir
    from numba import njit, types
    from numba.extending import intrinsic

    from node_worker.kernels import iq4xs
    from node_worker.kernels.common import target_features
    from node_worker.kernels.ir import I8, LANES

    if shuffle and "ssse3" not in target_features():
        pytest.skip("no SSSE3 byte shuffle on this host")
    V32 = ir.VectorType(I8, LANES)

    @intrinsic
    def lookup(typingctx, idx, out):
        def codegen(context, builder, sig, args):
            src = context.make_array(sig.args[0])(context, builder, args[0]).data
            dst = context.make_array(sig.args[1])(context, builder, args[1]).data
            got = iq4xs.levels(builder, builder.load(builder.bitcast(src, V32.as_pointer()), align=1), shuffle)
            builder.store(got, builder.bitcast(dst, V32.as_pointer()), align=1)
            return context.get_dummy_value()

        return types.void(idx, out), codegen

    @njit
    def run(idx, out):
        lookup(idx, out)

    idx = np.array(list(range(16)) + list(range(15, -1, -1)), np.int8)  # every index in both halves
    out = np.zeros(32, np.int8)
    run(idx, out)
    assert out.tolist() == [formats.get("iq4xs").KVALUES[i] for i in idx]


@pytest.mark.parametrize("triple", [(t, t, t) for t in K_TYPES] + [(Q.Q4_K, Q.IQ4_XS, Q.Q6_K)],
                         ids=lambda t: "/".join(q.name for q in t))
@pytest.mark.parametrize("activations", ["f32", "q8"])  # the float loops; the super-block integer loop (isuper.py)
def test_a_tokens_partial_output_on_k_blocks_does_not_depend_on_the_tokens_beside_it(triple, activations):
    """Token 0's partial output from an expert in K blocks is the same bits alone (decode's rows) and beside 1
    to 15 other tokens routed to the same experts (the tiles of eight, four, three and two tokens, one left over
    alone, padding) or elsewhere: what a sequence decodes does not depend on the batch it is in (issue 62)."""
    from node_worker.worker import NodeWorker
    from shm.expert_source import ExpertSlice
    from shm.expert_store import HeapExpertStore

    rng = np.random.default_rng(5)
    R = 256
    experts = {}
    for e in range(3):
        raws = [random_rows(triple[0], R, rng), random_rows(triple[1], R, rng), random_rows(triple[2], H, rng,
                                                                                              hidden=R)]
        stored = [gguf_blocks.repack(raw, t, raw.shape[1] // gguf.GGML_QUANT_SIZES[t][1] * 256)
                  for raw, t in zip(raws, triple)]
        spec = formats.ExpertFormats(tuple(name for name, _ in stored)).spec
        experts[(0, e)] = ExpertSlice(*(s for _, s in stored), spec)
    worker = NodeWorker(0, HeapExpertStore(0, experts, spec), H, threads=2, activations=activations)
    alone, beside = first_token_alone_and_beside(worker, H, (2, 3, 4, 5, 6, 8, 9, 13, 16))
    assert np.abs(alone).max() > 0
    assert [T for T, y in beside.items() if not np.array_equal(y, alone)] == []
