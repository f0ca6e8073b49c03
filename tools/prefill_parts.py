#!/usr/bin/env python
"""Where a prefill's time goes: the MoE layers, the dense matrices, the attention, the rest; in-process pool.

    .venv/bin/python tools/prefill_parts.py -m MODEL [--tokens 64] [--runs 8] [FIELD=VALUE ...]

Opens the engine (EngineConfig(device="cpu", pool="inproc") with the FIELD=VALUE pairs, e.g.
dense_dtype=bf16 expert_dtype=q8), prefills the same random prompt --runs times, each on a fresh KV cache,
and times the calls into the compiled kernels around them: the in-process pool's MoE layers
(node_worker.worker.layer_moe), the dense matrices' many-token tiles and integer loops (dense.matmul_tiles,
matmul_tokens_int), their few-token rows (dense.matmul_rows: the lm_head's one token), and the attention
(ops.gqa_attention). Prints each prefill's wall and, per part, the median over the runs. The timers add a
few microseconds a call.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # as shm/threads_env.py sets it, before NumPy loads

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import node_worker.worker as worker_module  # noqa: E402
from coordinator.config import EngineConfig  # noqa: E402
from coordinator.engine import Engine  # noqa: E402
from coordinator.model import ops  # noqa: E402
from coordinator.model.step import StepBatch
from node_worker.kernels import dense  # noqa: E402

PARTS = {"MoE layers": (worker_module, "layer_moe"), "dense tiles": (dense, "matmul_tiles"),
         "dense integer": (dense, "matmul_tokens_int"), "dense rows": (dense, "matmul_rows"),
         "attention": (ops, "gqa_attention")}


def timed(spent: dict, part: str, module, name: str) -> None:
    """Replace module.name with a wrapper adding its seconds to spent[part]."""
    inner = getattr(module, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[part] += time.perf_counter() - t

    setattr(module, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("fields", nargs="*", help="EngineConfig FIELD=VALUE pairs (strings and integers)")
    args = ap.parse_args()
    fields = {k: (int(v) if v.isdigit() else v) for k, v in (f.split("=", 1) for f in args.fields)}
    spent: dict[str, float] = defaultdict(float)
    for part, (module, name) in PARTS.items():
        timed(spent, part, module, name)
    with Engine.open(args.model, EngineConfig(device="cpu", pool="inproc", **fields)) as eng:
        dec = eng.decoder
        ids = np.random.default_rng(0).integers(0, 256, args.tokens)
        caches = [dec.new_cache() for _ in range(args.runs + 1)]  # made before the timing: their pages too
        dec.forward(StepBatch.of(ids, caches[0])).logits[0]  # warm
        walls, per_run = [], defaultdict(list)
        for cache in caches[1:]:
            spent.clear()
            t = time.perf_counter()
            dec.forward(StepBatch.of(ids, cache)).logits[0]
            walls.append(time.perf_counter() - t)
            for part in PARTS:
                per_run[part].append(spent[part])
            per_run["the rest"].append(walls[-1] - sum(spent.values()))
    print(f"{args.tokens}-token prefill, {args.runs} runs, ms: " + " ".join(f"{1e3 * w:.1f}" for w in walls))
    print("| part | ms, median (min-max) |\n| --- | --- |")
    for part, values in [("whole prefill", walls), *per_run.items()]:
        if max(values) > 0:
            print(f"| {part} | {1e3 * statistics.median(values):.1f} ({1e3 * min(values):.1f}-"
                  f"{1e3 * max(values):.1f}) |")


if __name__ == "__main__":
    main()
