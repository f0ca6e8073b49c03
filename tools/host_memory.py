#!/usr/bin/env python
"""The host memory a model's geometry takes on a machine without a GPU, by category, from its config alone, for
llama.cpp's IQ4_XS file of it (no weights read, nothing allocated):

    python tools/host_memory.py [--preset qwen3-next] [--ctx 262144] [--check FILE.gguf] [--json]

    experts     the routed experts in /dev/shm, each matrix in its file's blocks (the node workers' segments)
    dense       the coordinator's: every dense matrix in its file's blocks (packed.pack_dense), the router, norms,
                biases and the shared expert's one-row gate float32, the embedding float32 (its rows are looked up)
    kv cache    one sequence's keys and values at --ctx tokens over the attention layers, float32 (context.py)
    states      one sequence's Gated DeltaNet states (float32, any length)
    segment     a process pool's data-path segment (context.py's segment_layout; 0 in process)

The file's tensor types follow llama-quantize's rule for IQ4_XS without an importance matrix
(llama_tensor_get_type_impl): IQ4_XS, with Q6_K for output.weight, Q5_K for the attn_v-like tensors (attn_v and the
Gated DeltaNet's attn_qkv) when the model has 4 or more query heads a KV head, and Q5_K for every ffn_down (the
experts' and the shared expert's) in the first n_layer/8 layers; norms, routers (ffn_gate_inp), conv taps and 1-D
tensors stay F32. ``--check FILE`` compares that rule with a file llama-quantize wrote for the same architecture
(its own geometry), tensor by tensor.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.cli.make_model import PRESET_ARCH, PRESETS, hf_config  # noqa: E402
from coordinator.context import context_needs  # noqa: E402
from coordinator.gpu import vram  # noqa: E402
from coordinator.model.model_config import ModelConfig, parse_model_config  # noqa: E402
from shm.formats import traits  # noqa: E402

GB = 1e9
BYTES = {"F32": 4.0, **{t: traits.BY_NAME[f].bytes_per_weight for t, f in traits.EXACT.items() if t != "F16"}}


def iq4_xs_type(gguf_name: str, cfg: ModelConfig) -> str:
    """The type llama-quantize gives a 2-D or 3-D tensor ``gguf_name`` in an IQ4_XS file (see the module's rule)."""
    if gguf_name == "output.weight":
        return "Q6_K"
    if "_norm" in gguf_name or "ffn_gate_inp" in gguf_name or "ssm_conv1d" in gguf_name:
        return "F32"
    if gguf_name.endswith(("attn_v.weight", "attn_qkv.weight")) and cfg.num_heads // cfg.num_kv_heads >= 4:
        return "Q5_K"
    layer = re.match(r"blk\.(\d+)\.", gguf_name)
    if "ffn_down" in gguf_name and layer and int(layer[1]) < cfg.num_layers // 8:
        return "Q5_K"
    return "IQ4_XS"


# the Hugging Face names of vram.dense_tensors -> the GGUF names the converter gives them (one name may become two)
GGUF_NAMES = [
    (r"model\.layers\.(\d+)\.self_attn\.(q|k|v)_proj\.weight", r"blk.\1.attn_\2.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", r"blk.\1.attn_output.weight"),
    (r"model\.layers\.(\d+)\.linear_attn\.out_proj\.weight", r"blk.\1.ssm_out.weight"),
    (r"model\.layers\.(\d+)\.linear_attn\.in_proj_ba\.weight", r"blk.\1.ssm_ba.weight"),
    (r"model\.layers\.(\d+)\.mlp\.shared_expert\.(gate|up|down)_proj\.weight", r"blk.\1.ffn_\2_shexp.weight"),
    (r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", r"blk.\1.ffn_\2.weight"),
    (r"lm_head\.weight", "output.weight"),
]


def dense_matrices(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """(GGUF name, rows, row length) of every dense matrix the coordinator packs; Qwen3-Next's in_proj_qkvz is the
    file's attn_qkv and attn_gate."""
    out = []
    for t in vram.dense_tensors(cfg):
        if not t.matrix:
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.linear_attn\.in_proj_qkvz\.weight", t.name)
        if m is not None:
            lc = cfg.linear
            out += [(f"blk.{m[1]}.attn_qkv.weight", lc.conv_dim, t.shape[1]),
                    (f"blk.{m[1]}.attn_gate.weight", lc.value_heads * lc.value_head_dim, t.shape[1])]
            continue
        for pattern, repl in GGUF_NAMES:
            if re.fullmatch(pattern, t.name):
                out.append((re.sub(pattern, repl, t.name), t.shape[0], t.shape[1]))
                break
        else:
            raise SystemExit(f"{t.name}: no GGUF name known for it")
    return out


def plan(cfg: ModelConfig, ctx: int, nodes: int = 1) -> dict:
    """The module's categories in bytes, and the dense matrices' and experts' counts by type."""
    H, V, inter = cfg.hidden_size, cfg.vocab_size, cfg.moe_intermediate_size
    types: dict[str, int] = {}
    dense = 0.0
    for name, rows, row in dense_matrices(cfg):
        qtype = iq4_xs_type(name, cfg)
        types[qtype] = types.get(qtype, 0) + 1
        dense += rows * row * BYTES[qtype]
    vectors = sum(4 * math.prod(t.shape) for t in vram.dense_tensors(cfg) if not t.matrix)
    embedding = 4 * V * H
    experts, expert_types = 0.0, {}
    for layer in cfg.moe_layers:
        for part, rows, row in (("gate", inter, H), ("up", inter, H), ("down", H, inter)):
            qtype = iq4_xs_type(f"blk.{layer}.ffn_{part}_exps.weight", cfg)
            expert_types[qtype] = expert_types.get(qtype, 0) + cfg.num_experts
            experts += cfg.num_experts * rows * row * BYTES[qtype]
    needs = context_needs(cfg, ctx, nodes, process_pool=True)
    return {"experts": experts, "dense": dense + vectors + embedding, "dense_matrices": dense,
            "dense_vectors": vectors, "embedding": embedding, "kv": needs.kv_cache, "states": needs.state,
            "segment": needs.pool_segment, "dense_types": types, "expert_types": expert_types, "tokens": ctx}


def check(path: Path) -> int:
    """The rule's type against the file's for every tensor; prints the differences, returns their count."""
    from coordinator.model.arch import gguf_config
    from coordinator.model.source import open_gguf

    ck = open_gguf(path)
    try:
        cfg = parse_model_config(gguf_config(ck.file))
        tensors = {name: t.tensor_type.name for name, (_, t) in ck.file.tensors.items()}
    finally:
        ck.close()
    wrong = 0
    for name, qtype in sorted(tensors.items()):
        if len([int(n) for n in ck.file.shape(name) if n > 1]) < 2:
            continue  # 1-D tensors are never quantised
        want = iq4_xs_type(name, cfg)
        if want != qtype:
            wrong += 1
            print(f"{path.name}: {name} is {qtype}, the rule says {want}")
    print(f"{path.name}: {len(tensors)} tensors, {wrong} whose type the rule does not give")
    return wrong


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3-next", choices=list(PRESETS))
    ap.add_argument("--ctx", type=int, default=None, help="tokens of context (default: the model's longest)")
    ap.add_argument("--nodes", type=int, default=2, help="node workers sharing the pool segment")
    ap.add_argument("--check", type=Path, help="an IQ4_XS file llama-quantize wrote: its types against the rule")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.check is not None and check(args.check):
        return 1
    cfg = parse_model_config(hf_config(PRESET_ARCH.get(args.preset, "qwen3_moe"), PRESETS[args.preset]()))
    p = plan(cfg, args.ctx or cfg.max_position_embeddings, args.nodes)
    if args.json:
        print(json.dumps(p, indent=2))
        return 0
    total = p["experts"] + p["dense"] + p["kv"] + p["states"] + p["segment"]
    print(f"{args.preset} at IQ4_XS, {p['tokens']:,} tokens of context, no GPU ({args.nodes} node workers):")
    print("| category | GB | what |\n|---|---|---|")
    print(f"| experts (/dev/shm) | {p['experts'] / GB:.2f} | {cfg.num_experts} x {len(cfg.moe_layers)} layers: "
          f"{', '.join(f'{n} {t}' for t, n in p['expert_types'].items())} matrices |")
    print(f"| dense (coordinator) | {p['dense'] / GB:.2f} | matrices {p['dense_matrices'] / GB:.2f} "
          f"({', '.join(f'{n} {t}' for t, n in p['dense_types'].items())}), embedding float32 "
          f"{p['embedding'] / GB:.2f}, vectors and routers float32 {p['dense_vectors'] / GB:.3f} |")
    print(f"| KV cache | {p['kv'] / GB:.2f} | {cfg.kv_bytes_per_token:,} bytes a token, float32, "
          f"{len(cfg.attention_layers)} attention layers |")
    print(f"| Gated DeltaNet states | {p['states'] / GB:.3f} | one sequence, {sum(cfg.linear_layers) if cfg.linear else 0}"
          " layers |")
    print(f"| pool segment (/dev/shm) | {p['segment'] / GB:.3f} | one step's rows |")
    print(f"| total | {total / GB:.2f} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
