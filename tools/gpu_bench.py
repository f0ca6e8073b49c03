"""The GPU side measured on a GPU: speed, agreement with the CPU path, and memory by category, as JSON.

    python tools/gpu_bench.py --out DIR [--work /tmp/strata-gpu-bench] [--tokens 32] [--prompt-tokens 128]

For each model: the deep preset (48 layers, BF16), a 4-layer Qwen3-30B-A3B-geometry BF16 checkpoint and
its Q4_K_M GGUF (experts Q4_K with Q6_K down where llama.cpp's use_more_bits puts it, dense Q4_K and
output Q6_K: valid random blocks, tests/gguf_writer.py): decode and prefill tokens/s with the GPU device
side (best of --rounds), the logits of 64 positions against the CPU path (the largest error relative to
the CPU logits' largest magnitude, and the share of positions with the same top token), the GPU memory by
category (coordinator/gpu/vram.py, as uploaded), how many hot experts fit in 8 GB in each format, and the
process pool's decode with eager steps, graph-ready steps queued launch by launch and graph-ready steps replayed
as CUDA graphs (docs/gpu.md): tokens/s, ms a step, the pool's wait a step and the host's time a layer.
Writes DIR/gpu_bench.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tools")]

from coordinator import Engine, EngineConfig  # noqa: E402
from coordinator.cli.make_model import make_model  # noqa: E402
from coordinator.gpu import vram  # noqa: E402
from coordinator.model.step import StepBatch
from shm.threads_env import apply  # noqa: E402

POSITIONS = 64
GB = 1e9


# --tiny: the same three kinds of model at a geometry the CPU stand-in runs (tests/test_device_decoder.py)
TINY = dict(preset="tiny", hidden_size=256, moe_intermediate_size=256, dense_intermediate_size=256, head_dim=32,
            num_heads=8)  # rows of o_proj: 256, whole Q4_K blocks


def models(work: Path, tiny: bool = False) -> dict[str, Path]:
    """name -> model path, made once under ``work``."""
    from gguf import GGMLQuantizationType as Q

    from gguf_writer import write_gguf
    from vram_figures import use_more_bits

    out = {}
    deep = work / "deep-bf16"
    if not (deep / "config.json").exists():
        make_model(deep, **(dict(TINY, num_layers=6) if tiny else dict(preset="deep")), dtype="BF16")
    out["deep (BF16)"] = deep
    qwen = work / "qwen3-30b-a3b-4l-bf16"
    if not (qwen / "config.json").exists():
        make_model(qwen, **(TINY if tiny else dict(preset="qwen3-30b-a3b")), num_layers=4, dtype="BF16")
    out["qwen3-30b-a3b 4 layers (BF16)"] = qwen
    gguf_path = work / "qwen3-30b-a3b-4l-q4_k_m.gguf"
    if not gguf_path.exists():
        down = {i: Q.Q6_K for i in range(4) if use_more_bits(i, 4)}
        write_gguf(qwen, gguf_path, experts=Q.Q4_K, down=down, dense=Q.Q4_K)
    out["qwen3-30b-a3b 4 layers (Q4_K_M)"] = gguf_path
    return out


def speed(eng: Engine, prompt: list[int], tokens: int, rounds: int) -> tuple[float, float]:
    """(decode tokens/s, prefill tokens/s): the best of ``rounds``."""
    decode, prefill = 0.0, 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        eng.step(StepBatch.of(np.asarray(prompt), eng.new_cache())).logits[0]
        prefill = max(prefill, len(prompt) / (time.perf_counter() - t0))
        cache = eng.new_cache()
        eng.step(StepBatch.of(np.asarray(prompt[:8]), cache)).logits[0]
        t0 = time.perf_counter()
        for i in range(tokens):
            eng.step(StepBatch.of(np.asarray([prompt[i % len(prompt)]]), cache)).logits[0]
        decode = max(decode, tokens / (time.perf_counter() - t0))
    return decode, prefill


def agreement(gpu: np.ndarray, cpu: np.ndarray) -> dict:
    return {"max_rel_error": float(np.abs(gpu - cpu).max() / np.abs(cpu).max()),
            "top1_agreement": float(np.mean(gpu.argmax(-1) == cpu.argmax(-1))), "positions": int(cpu.shape[0])}


def experts_in(cfg, budget: float) -> dict[str, int]:
    """Hot experts of this geometry that fit in ``budget`` GB, in each format."""
    triples = {"f32": ("f32",) * 3, "bf16": ("bf16",) * 3, "q8": ("q8",) * 3, "q4": ("q4",) * 3}
    if cfg.hidden_size % 256 == 0 and cfg.moe_intermediate_size % 256 == 0:
        triples["q4k/q4k/q6k (Q4_K_M)"] = ("q4k", "q4k", "q6k")
    return {name: vram.fit_experts(int(budget * GB), vram.expert_bytes(cfg, t)) for name, t in triples.items()}


def eager_and_graph(path: Path, prompt: list[int], args) -> dict:
    """The process pool (single node) with eager decode steps, graph-ready steps queued launch by launch, and
    graph-ready steps replayed as captured CUDA graphs, one engine each: decode tokens/s, ms a step, the pool's
    wait and (graph-ready) the host's time a layer until the step is queued or its graph launched."""
    out = {}
    for name, graph, capture in (("eager", False, False), ("queued", True, False), ("graph", True, True)):
        with Engine.open(path, EngineConfig(device="cuda", pool="process", graph=graph,
                                            graph_capture=capture)) as eng:
            eng.logits(prompt[:16])
            dec = eng.decoder
            wait0 = dec.stats.pool_wait_ns
            g0 = (eng.graph.host_ns, eng.graph.steps, eng.graph.replays) if graph else None
            decode, _ = speed(eng, prompt, args.tokens, args.rounds)
            steps = args.tokens * args.rounds + 2 * args.rounds  # decode steps and the prompts' rows of 8
            row = {"decode_tokens_per_s": decode, "ms_a_step": 1e3 / decode,
                   "pool_wait_ms_a_step": (dec.stats.pool_wait_ns - wait0) / 1e6 / steps}
            if graph:
                layers = eng.model_config.num_layers
                n = eng.graph.steps - g0[1]
                row["host_us_a_layer"] = (eng.graph.host_ns - g0[0]) / 1e3 / max(n, 1) / layers
                row["graph_steps"] = n
                row["replayed_steps"] = eng.graph.replays - g0[2]
            out[name] = row
    return out


def measure(name: str, path: Path, args) -> dict:
    rng = np.random.default_rng(0)
    with Engine.open(path, EngineConfig(device="cpu", pool="inproc")) as cpu:
        vocab = cpu.model_config.vocab_size
        ids = rng.integers(300, min(vocab, 5000), POSITIONS).tolist()
        want = cpu.logits(ids)
    with Engine.open(path, EngineConfig(device="cuda", pool="inproc")) as gpu:
        got = gpu.logits(ids)
        prompt = rng.integers(300, min(vocab, 5000), args.prompt_tokens).tolist()
        gpu.logits(prompt[:16])  # the kernels compiled and loaded before the clock starts
        decode, prefill = speed(gpu, prompt, args.tokens, args.rounds)
        memory = gpu.gpu_memory.as_dict()
        cfg = gpu.model_config
    steps = eager_and_graph(path, prompt, args)
    return {"model": name, "path": str(path), "decode_tokens_per_s": decode, "prefill_tokens_per_s": prefill,
            "process_pool_decode": steps,
            "prompt_tokens": args.prompt_tokens, "logits_vs_cpu": agreement(got, want), "gpu_memory": memory,
            "hot_experts_in_8_gb": experts_in(cfg, 8.0)}


def main(argv: list[str] | None = None) -> int:
    apply()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--work", type=Path, default=Path("/tmp/strata-gpu-bench"))
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", default="", help="measure the models whose name contains this")
    ap.add_argument("--tiny", action="store_true", help="tiny geometries (a check of this tool, not a benchmark)")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    import cupy

    card = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    report = {"card": card, "models": []}
    for name, path in models(args.work, args.tiny).items():
        if args.only in name:
            report["models"].append(measure(name, path, args))
            (args.out / "gpu_bench.json").write_text(json.dumps(report, indent=1))  # kept if a later one fails
            r = report["models"][-1]
            m, a = r["gpu_memory"], r["logits_vs_cpu"]
            print(f"{card} | {name} | decode {r['decode_tokens_per_s']:.1f} tok/s | prefill "
                  f"{r['prefill_tokens_per_s']:.1f} tok/s | rel err {a['max_rel_error']:.2e}, top-1 "
                  f"{a['top1_agreement']:.3f} | dense {m['dense'] / GB:.3f} GB ({m['dense_formats']}), kv "
                  f"{m['kv_cache'] / GB:.3f} GB, scratch {m['scratch'] / GB:.3f} GB | 8 GB holds "
                  f"{r['hot_experts_in_8_gb']}", flush=True)
            e, q, g = (r["process_pool_decode"][k] for k in ("eager", "queued", "graph"))
            print(f"{card} | {name} | process pool decode: eager {e['decode_tokens_per_s']:.1f} tok/s "
                  f"({e['pool_wait_ms_a_step']:.2f} ms pool wait a step), graph-ready queued "
                  f"{q['decode_tokens_per_s']:.1f} tok/s (host {q['host_us_a_layer']:.1f} us a layer), captured "
                  f"{g['decode_tokens_per_s']:.1f} tok/s ({g['pool_wait_ms_a_step']:.2f} ms pool wait, host "
                  f"{g['host_us_a_layer']:.1f} us a layer, {g['replayed_steps']} of {g['graph_steps']} replayed)",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
