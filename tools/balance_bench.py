#!/usr/bin/env python
"""Two nodes' decode compute on experts whose rows split unevenly in 256-row K blocks, plan turns off and on.

    .venv/bin/python tools/balance_bench.py [--inter 768] [--hidden 2048] [--experts 64] [--layers 400]

768 rows are three Q4_K blocks: without turns one node holds two of them for every expert. Each node runs on one
thread in this process, one after the other, top-8 random experts a layer; prints each node's total compute
and the slowest over the mean (1.33 expected without turns, 1.00 with them).
"""

from __future__ import annotations

from shm import threads_env

threads_env.apply()  # the thread settings strata's commands run with, before NumPy loads

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node_worker.worker import NodeWorker  # noqa: E402
from shm import gguf_blocks  # noqa: E402
from shm.expert_source import ExpertSlice  # noqa: E402
from shm.expert_store import HeapExpertStore  # noqa: E402
from shm.plan import NodeShare, make_plan  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--layers", type=int, default=400)
    args = ap.parse_args()
    I, H, E = args.inter, args.hidden, args.experts
    rng = np.random.default_rng(0)
    q4k = gguf_blocks.ggml_type("Q4_K")
    per = gguf_blocks.file_row_bytes(q4k, 256)  # bytes of one 256-weight block

    def rows(count: int, width: int) -> np.ndarray:
        return gguf_blocks.random_blocks(q4k, (count, gguf_blocks.file_row_bytes(q4k, width)), rng)

    gate, up, down = rows(I, H), rows(I, H), rows(H, I)  # one expert's file rows, shared by all (timing only)

    def sliced(a: int, b: int) -> ExpertSlice:
        return ExpertSlice(gguf_blocks.repack(gate[a:b], q4k, H)[1], gguf_blocks.repack(up[a:b], q4k, H)[1],
                           gguf_blocks.repack(down[:, a // 256 * per: b // 256 * per], q4k, b - a)[1], "q4k")

    x = rng.standard_normal((1, H)).astype(np.float32)
    for turns in (False, True):
        plan = make_plan([NodeShare(0, 1), NodeShare(1, 1)], [I], 256)
        if not turns:
            plan = dataclasses.replace(plan, turns={})
        workers = []
        for node in (0, 1):
            held = {(0, e): sliced(s.start, s.stop) for e in range(E) if (s := plan.slice_of(I, node, e))}
            workers.append(NodeWorker(node, HeapExpertStore(node, held, "q4k"), H, threads=1))
        total = [0.0, 0.0]
        for _ in range(args.layers):
            experts = rng.choice(E, 8, replace=False)
            for k, w in enumerate(workers):
                t0 = time.perf_counter()
                w.compute(0, x, np.zeros(8, np.int64), experts, np.ones(8, np.float32))
                total[k] += time.perf_counter() - t0
        for w in workers:
            w.close()
        print(f"turns {'on ' if turns else 'off'}: node 0 {total[0]:.3f} s, node 1 {total[1]:.3f} s, "
              f"slowest / mean {max(total) / (sum(total) / 2):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
