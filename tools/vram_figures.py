"""The device memory a model's geometry needs, by category, from its config alone (no weights read):
coordinator/gpu/vram.py's plan for a BF16 checkpoint and for llama.cpp's Q4_K_M file of it.

    python tools/vram_figures.py [--presets qwen3-30b-a3b,deepseek-v3,glm-4.5-air] [--kv-tokens 4096]
                                 [--expert-memory-gb 8] [--json]
    python tools/vram_figures.py --steps 1,8,64 --presets qwen3-30b-a3b:40960,deepseek-v3:163840

--steps: a graph-ready decode step's device memory for those row counts over the preset's context (after the
colon; default --kv-tokens): vram.step_bytes (the step arena planned by lifetimes: one layer's transients at a
time, GQA's attention split over the keys, MLA's kv_b dequantised compact) beside what the bump arena and the
one-pass GQA attention, the context-long MLA splits and the float32 kv_b of every layer before them took (every
layer's allocations kept to the end of the step, the scores as long as the context).

A Q4_K_M file's tensor types follow llama-quantize's rule (llama_tensor_get_type): Q4_K, with Q6_K for
output.weight and for attn_v and ffn_down in the layers use_more_bits picks; norms, biases and the router
(ffn_gate_inp) F32. The hot-expert column is how many whole experts fit in --expert-memory-gb.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.cli.make_model import PRESET_ARCH, PRESETS, hf_config  # noqa: E402
from coordinator.gpu import vram  # noqa: E402
from coordinator.gpu.storage import matrix_format  # noqa: E402
from coordinator.gpu import ops as device_ops  # noqa: E402
from coordinator.model.model_config import ModelConfig, parse_model_config  # noqa: E402

GB = 1e9


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers that keep more bits in its _M mixes."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


# a K type on rows that are not whole super-blocks of 256: llama-quantize's fallback
FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}


def q4_k_m_type(name: str, cfg: ModelConfig, row: int) -> str:
    """The GGUF type llama-quantize gives the Hugging Face tensor ``name`` (rows of ``row`` weights) in a
    Q4_K_M file."""
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    i = int(layer.group(1)) if layer else 0
    more = name == "lm_head.weight" or (name.endswith((".v_proj.weight", "down_proj.weight"))
                                         and use_more_bits(i, cfg.num_layers))
    qtype = "Q6_K" if more else "Q4_K"
    return qtype if row % 256 == 0 else FALLBACK[qtype]


def model_config(preset: str) -> ModelConfig:
    return parse_model_config(hf_config(PRESET_ARCH.get(preset, "qwen3_moe"), PRESETS[preset]()))


def figures(preset: str, kv_tokens: int, expert_memory: float) -> list[dict]:
    cfg = model_config(preset)
    rows = []
    rows_of = {t.name: t.shape[-1] for t in vram.dense_tensors(cfg)}
    for m, k in (("gate", cfg.hidden_size), ("up", cfg.hidden_size), ("down", cfg.moe_intermediate_size)):
        rows_of[f"model.layers.{cfg.moe_layers[0]}.mlp.experts.0.{m}_proj.weight"] = k
    for source, dtype_of in (("BF16", lambda name: "BF16"),
                             ("Q4_K_M", lambda name: q4_k_m_type(name, cfg, rows_of[name]))):
        experts = tuple(matrix_format(dtype_of(f"model.layers.{cfg.moe_layers[0]}.mlp.experts.0.{m}_proj.weight"),
                                      "auto", k) for m, k in (("gate", cfg.hidden_size), ("up", cfg.hidden_size),
                                                              ("down", cfg.moe_intermediate_size)))
        plan = vram.plan(cfg, dtype_of, "auto", "bf16", kv_tokens, 512, experts)
        rows.append({"model": preset, "source": source, **plan.as_dict(),
                     "experts_in_budget": vram.fit_experts(int(expert_memory * GB), plan.expert_bytes),
                     "expert_formats": "/".join(experts)})
    return rows


def table(rows: list[dict], expert_memory: float) -> str:
    out = ["| model | source | dense (formats) | one expert | experts in "
           f"{expert_memory:g} GB | kv cache | scratch |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['source']} | {r['dense'] / GB:.2f} GB ({r['dense_formats']}) | "
                   f"{r['expert_bytes'] / 1e6:.2f} MB ({r['expert_formats']}) | {r['experts_in_budget']} | "
                   f"{r['kv_cache'] / GB:.2f} GB ({r['kv_tokens']} tokens) | {r['scratch'] / GB:.2f} GB |")
    return "\n".join(out)


def bump_step_bytes(cfg: ModelConfig, rows: int, context: int) -> int:
    """What the bump arena took for a step before the lifetimes were planned: nothing freed, so every layer's
    attention (GQA's one-pass kernel with its context-long scores in place of the split-K partials) and MLP at
    once, plus lm_head's logits (vram.step_terms' parts)."""
    t = vram.step_terms(cfg, rows, context)
    attention = t["attention"]
    if cfg.mla is None:
        attention += rows * cfg.num_heads * context - t["attention_scratch"]
    else:  # MLA's splits then grew with the context: a chunk at most its shared-memory tile of keys
        m, nh = cfg.mla, cfg.num_heads
        c, dr = m.kv_lora_rank, m.qk_rope_head_dim
        cap = max(1, min(device_ops.MLA_CHUNK_MAX, device_ops.SHARED_FLOATS // device_ops.MLA_ROWS
                         - max(c + dr, device_ops.THREADS)))
        then = max(-(-context // cap), device_ops.mla_max_splits(nh, context, c, dr))
        attention += rows * nh * (then - device_ops.mla_max_splits(nh, context, c, dr)) * (c + 2)
        attention += nh * (m.qk_nope_head_dim + m.v_head_dim) * c - rows * nh * c  # kv_b dequantised, no out_lat
    return 4 * (cfg.num_layers * (t["kept"] + attention + max(t["moe"], t["dense"])) + t["logits"])


def step_table(specs: list[str], rows_list: list[int], default_context: int) -> str:
    out = ["| model | context | rows | bump arena (before) | planned arena (after) |", "|---|---|---|---|---|"]
    for spec in specs:
        preset, _, context = spec.partition(":")
        cfg, context = model_config(preset), int(context or default_context)
        for rows in rows_list:
            out.append(f"| {preset} | {context} | {rows} | {bump_step_bytes(cfg, rows, context) / GB:.2f} GB | "
                       f"{vram.step_bytes(cfg, rows, context) / GB:.3f} GB |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="qwen3-30b-a3b,deepseek-v3,glm-4.5-air")
    ap.add_argument("--kv-tokens", type=int, default=4096)
    ap.add_argument("--expert-memory-gb", type=float, default=8.0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--steps", help="row counts: the decode steps' memory table instead")
    args = ap.parse_args(argv)
    if args.steps:
        print(step_table(args.presets.split(","), [int(r) for r in args.steps.split(",")], args.kv_tokens))
        return 0
    rows = [r for p in args.presets.split(",") for r in figures(p, args.kv_tokens, args.expert_memory_gb)]
    print(json.dumps(rows, indent=1) if args.json else table(rows, args.expert_memory_gb))
    return 0


if __name__ == "__main__":
    sys.exit(main())
