#!/usr/bin/env python
"""Interim pool benchmark (until `strata bench`, issue 6): decode tokens/s of the
in-process pool, the non-split process pool and the split process pool, measured
interleaved in one run, plus the empty round-trip floor of the process pools.

    .venv/bin/python tools/pool_bench.py [--model DIR] [--tokens 32] [--rounds 3] [--nodes 2]

Without --model it builds a model with larger experts in a temporary folder.
"""

from __future__ import annotations

from shm import threads_env

threads_env.apply()  # the thread settings strata's commands run with, before NumPy loads

import argparse
import statistics
import tempfile

from coordinator import Engine, EngineConfig
from coordinator.cli.make_model import make_model

MODES = {
    "inproc-split": dict(pool="inproc", numa_split=True),
    "process-single": dict(pool="process"),
    "process-split": dict(pool="process", numa_split=True),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--threads-compare", action="store_true",
                    help="instead: the non-split worker with 1 thread vs 2 pinned threads (BLAS held to 1)")
    args = ap.parse_args()
    if args.threads_compare:
        MODES.clear()
        MODES.update({"inproc-split": dict(pool="inproc", numa_split=True),
                      "process-single-1t": dict(pool="process", worker_threads=1),
                      "process-single-2t": dict(pool="process", worker_threads=2)})
    tmp = None
    model = args.model
    if model is None:
        tmp = tempfile.TemporaryDirectory()
        model = make_model(tmp.name, seed=0, hidden_size=512, moe_intermediate_size=512, num_experts=16, top_k=4,
                           num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64)
    engines = {}
    for name, opts in MODES.items():
        nodes = args.nodes if opts.get("numa_split") else None
        engines[name] = Engine.open(model, EngineConfig(nodes=nodes, **opts))
    prompt = list(range(40, 56))
    results = {name: [] for name in engines}
    try:
        for eng in engines.values():  # warm-up
            eng.generate(prompt, max_new_tokens=4, stop_at_eos=False)
        for _ in range(args.rounds):  # A B C A B C ...
            for name, eng in engines.items():
                r = eng.generate_full(prompt, max_new_tokens=args.tokens, stop_at_eos=False)
                results[name].append(r.timings["decode_tokens_per_s"])
        floors = {}
        for name, eng in engines.items():
            if hasattr(eng.pool, "ping"):
                pings = [eng.pool.ping() for _ in range(200)]
                floors[name] = statistics.median(pings) * 1e6
        base = statistics.median(results["inproc-split"])
        print(f"| mode | decode tok/s (median, min-max of {args.rounds}) | vs inproc | empty round trip us |")
        print("|---|---|---|---|")
        for name, vals in results.items():
            med = statistics.median(vals)
            floor = f"{floors[name]:.0f}" if name in floors else "-"
            print(f"| {name} | {med:.1f} ({min(vals):.1f}-{max(vals):.1f}) | {med / base:.2f} | {floor} |")
        for name, eng in engines.items():
            print(f"{name}: {eng.pool_description()}")
    finally:
        for eng in engines.values():
            eng.close()
        if tmp:
            tmp.cleanup()


if __name__ == "__main__":
    main()
