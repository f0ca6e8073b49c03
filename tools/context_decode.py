#!/usr/bin/env python
"""Decode speed at a long context against a short one, on one engine, the steps interleaved.

    PYTHONPATH=. .venv/bin/python tools/context_decode.py -m MODEL --contexts 64,8192 --steps 32

Opens one engine (a node worker process holding whole experts, as ``strata bench``'s ``single`` mode), prefills one
sequence per context (random token ids, ``--prefill-chunk`` tokens a step, as the server does), then takes
``--steps`` rounds of one decode step for each sequence in turn (A B A B ...), so a shared host's swings fall on
both alike. Prints per context the median decode step (ms) and tokens/s, and each context's speed as a share of the
shortest's; ``--json FILE`` writes them. Also the KV cache's bytes a token and the state's bytes a sequence.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from coordinator.model.step import StepBatch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    from shm import threads_env

    threads_env.apply()
    from coordinator.config import EngineConfig
    from coordinator.engine import Engine

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True, type=Path)
    ap.add_argument("--contexts", default="64,8192", help="comma-separated context lengths (default %(default)s)")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per context (default %(default)s)")
    ap.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens a prefill step (default %(default)s)")
    ap.add_argument("--pool", default="process", choices=["process", "inproc"])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    rng = np.random.default_rng(0)
    with Engine.open(args.model, EngineConfig(pool=args.pool, max_seq_len=max(contexts) + args.steps + 1)) as eng:
        mcfg = eng.model_config
        caches, last = {}, {}
        for c in contexts:
            ids = rng.integers(0, min(mcfg.vocab_size, 256), c)
            cache = eng.new_cache()
            t0 = time.perf_counter()
            for lo in range(0, c, args.prefill_chunk):
                out = eng.step(StepBatch([(ids[lo:lo + args.prefill_chunk], cache)])).logits
            print(f"context {c}: prefilled in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
            caches[c], last[c] = cache, int(np.argmax(out[0][-1]))
        times = {c: [] for c in contexts}
        for _ in range(args.steps):
            for c in contexts:
                t0 = time.perf_counter()
                out = eng.step(StepBatch([(np.array([last[c]], np.int64), caches[c])])).logits
                times[c].append(time.perf_counter() - t0)
                last[c] = int(np.argmax(out[0][-1]))
        report = {"model": str(args.model), "arch": mcfg.arch, "kv_bytes_per_token": mcfg.kv_bytes_per_token,
                  "state_bytes_per_sequence": mcfg.state_bytes_per_sequence, "steps": args.steps,
                  "contexts": {}}
        base = statistics.median(times[contexts[0]])
        for c in contexts:
            med = statistics.median(times[c])
            report["contexts"][c] = {"step_ms_median": med * 1e3, "step_ms_min": min(times[c]) * 1e3,
                                     "step_ms_max": max(times[c]) * 1e3, "tokens_per_s": 1 / med,
                                     "speed_vs_first": base / med}
            print(f"context {c:>7}: decode step median {med * 1e3:.1f} ms (min {min(times[c]) * 1e3:.1f}, max "
                  f"{max(times[c]) * 1e3:.1f}), {1 / med:.2f} tok/s, {base / med:.2f} of context {contexts[0]}'s")
        print(f"KV cache {mcfg.kv_bytes_per_token} bytes a token, state {mcfg.state_bytes_per_sequence} bytes a "
              "sequence")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
