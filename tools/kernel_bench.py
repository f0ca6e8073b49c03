#!/usr/bin/env python
"""One node's decode compute per format: NodeWorker.compute of one token routed to 8 experts.

    .venv/bin/python tools/kernel_bench.py [--formats f32,bf16,q8,q4,q4k,q6k,iq4xs] [--hidden 2048] [--inter 768]
                                           [--threads 2] [--experts 8] [--tokens 1]

The same experts every call (Qwen3-30B-A3B's expert geometry by default), so
the figure is the kernel's speed with the weights as warm as the caches keep
them (--experts 48 and more: out of this machine's 105 MB LLC); `strata bench`
gives the speed inside whole decode steps. A GGUF file format (q4k, q5k, q6k,
iq4xs) is filled with valid random blocks of its type.
"""

from __future__ import annotations

from shm import threads_env

threads_env.apply()  # the thread settings strata's commands run with, before NumPy loads

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node_worker.worker import NodeWorker  # noqa: E402
from shm import formats, gguf_blocks  # noqa: E402
from shm.expert_source import ExpertSlice  # noqa: E402
from shm.expert_store import HeapExpertStore  # noqa: E402


def stored_rows(fmt, rows: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, stored row] of random weights in the format: encoded from floats, or a GGUF type's random blocks."""
    if fmt.NAME in formats.FILE_FORMATS:
        qtype = gguf_blocks.ggml_type(fmt.GGML)
        return gguf_blocks.repack(gguf_blocks.random_blocks(qtype, (rows, gguf_blocks.file_row_bytes(qtype, width)),
                                                            rng), qtype, width)[1]
    stored = np.empty((rows, fmt.row_bytes(width) // np.dtype(fmt.STORED_DTYPE).itemsize), fmt.STORED_DTYPE)
    fmt.encode_into(stored, (rng.standard_normal((rows, width)) * 0.02).astype(np.float32))
    return stored


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="f32,bf16,q8,q4,q4k,q6k,iq4xs")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--activations", default="q8,f32", help="a comma-separated list of EngineConfig.activations: "
                    "q8 (integer dot products), bf16 (bf16 rows by bf16 activations), f32")
    ap.add_argument("--tokens", type=int, default=1, help="tokens routed to every expert (1: decode; more: prefill)")
    args = ap.parse_args()
    H, I, E = args.hidden, args.inter, args.experts
    rng = np.random.default_rng(0)
    T = args.tokens
    print(f"{T} token(s) per expert\n| format | activations | ms per layer | Gweights/s | GB/s of stored weights "
          "| GFLOP/s |\n|---|---|---|---|---|---|")
    for name in args.formats.split(","):
        fmt = formats.get(name)
        slices = {}
        for e in range(E):
            mats = [stored_rows(fmt, rows, width, rng) for rows, width in ((I, H), (I, H), (H, I))]  # gate, up, down
            slices[(0, e)] = ExpertSlice(*mats, name)
        store = HeapExpertStore(0, slices, name)
        x = rng.standard_normal((T, H)).astype(np.float32)  # [T, H]
        tokens, experts = np.tile(np.arange(T), E), np.repeat(np.arange(E), T)  # [E*T]: every token to every expert
        weights = np.full(E * T, 1 / E, np.float32)
        for acts in args.activations.split(","):
            worker = NodeWorker(0, store, H, threads=args.threads, activations=acts)
            worker.compute(0, x, tokens, experts, weights)
            t0 = time.perf_counter()
            for _ in range(args.calls):
                worker.compute(0, x, tokens, experts, weights)
            dt = (time.perf_counter() - t0) / args.calls
            n = E * 3 * I * H
            print(f"| {name} | {acts} | {dt * 1e3:.2f} | {n / dt / 1e9:.2f} | "
                  f"{n * fmt.BYTES_PER_WEIGHT / dt / 1e9:.1f} | {2 * n * T / dt / 1e9:.1f} |")
        store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
