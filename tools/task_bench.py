#!/usr/bin/env python
"""NodeWorker task-granularity and threading alternatives, side by side in one run.

    .venv/bin/python tools/task_bench.py [--hidden 2048] [--inter 768] [--experts 32] [--top-k 8] [--tokens 1]

Each configuration runs in its own process (BLAS thread count is fixed at
import) over the same random experts, interleaved over rounds; it prints the
median time per MoE layer call and the effective weight bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
import numpy as np
from node_worker.worker import NodeWorker
from shm.expert_source import ExpertSlice
from shm.expert_store import HeapExpertStore
a = json.loads(sys.argv[1])
rng = np.random.default_rng(0)
H, I, E = a["hidden"], a["inter"], a["experts"]
slices = {(0, e): ExpertSlice(*(rng.standard_normal((I, H), dtype=np.float32) * 0.02 for _ in range(3)))
          for e in range(E)}
w = NodeWorker(0, HeapExpertStore(0, slices), H, threads=a["threads"], cpus=sorted(__import__("os").sched_getaffinity(0)),
               task_rows=a["task_rows"])
T, k = a["tokens"], a["top_k"]
times = []
for i in range(a["calls"] + 3):
    x = rng.standard_normal((T, H), dtype=np.float32)
    experts = np.concatenate([rng.choice(E, k, replace=False) for _ in range(T)])
    tokens = np.repeat(np.arange(T), k)
    weights = rng.random(T * k).astype(np.float32)
    t0 = time.perf_counter()
    w.compute(0, x, tokens, experts, weights)
    if i >= 3:
        times.append(time.perf_counter() - t0)
touched = len({int(e) for e in experts}) * 3 * I * H * 4
print(json.dumps({"median_s": float(np.median(times)), "bytes_per_call_last": touched}))
w.close()
"""

CONFIGS = {
    "per-expert, 1 thread, BLAS 1": dict(threads=1, task_rows=1 << 30, blas=1),
    "per-expert, 1 thread, BLAS 2": dict(threads=1, task_rows=1 << 30, blas=2),
    "per-expert, 2 threads, BLAS 1": dict(threads=2, task_rows=1 << 30, blas=1),
    "rows 256, 2 threads, BLAS 1": dict(threads=2, task_rows=256, blas=1),
    "rows 64, 2 threads, BLAS 1": dict(threads=2, task_rows=64, blas=1),
    "Mixtral-size rows 1024, 2 threads": dict(threads=2, task_rows=1024, blas=1),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    results = {name: [] for name in CONFIGS}
    for _ in range(args.rounds):
        for name, c in CONFIGS.items():
            child = dict(hidden=args.hidden, inter=args.inter, experts=args.experts, top_k=args.top_k,
                         tokens=args.tokens, calls=args.calls, threads=c["threads"], task_rows=c["task_rows"])
            env = dict(os.environ, OPENBLAS_NUM_THREADS=str(c["blas"]), OMP_NUM_THREADS=str(c["blas"]),
                       MKL_NUM_THREADS=str(c["blas"]))
            out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(child)], env=env, check=True,
                                 capture_output=True, text=True).stdout
            results[name].append(json.loads(out))
    per_call = args.tokens * args.top_k * 3 * args.inter * args.hidden * 4  # upper bound: distinct experts
    print(f"H={args.hidden} I={args.inter} E={args.experts} top-{args.top_k} T={args.tokens}, "
          f"{args.rounds} rounds x {args.calls} calls")
    print("| configuration | ms per layer call (median of rounds) | GB/s of expert weights |")
    print("|---|---|---|")
    for name, rs in results.items():
        med = statistics.median(r["median_s"] for r in rs)
        touched = min(per_call, args.experts * 3 * args.inter * args.hidden * 4)
        print(f"| {name} | {med * 1e3:.2f} | {touched / med / 1e9:.1f} |")


if __name__ == "__main__":
    main()
