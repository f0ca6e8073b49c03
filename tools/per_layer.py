#!/usr/bin/env python3
"""A decode step's fixed cost a layer: the tiny preset decoded at two layer counts, in-process.

(step at the larger count - step at the smaller) / the layers between them: the per-layer overhead of issue 63,
the cost a layer adds before any weight worth the name is read. Each round times both models (the median step of
``--tokens`` greedy tokens after a ``--prompt-tokens`` prompt); the figure is the medians' difference.

    tools/per_layer.py [--layers 2 16] [--rounds 5] [--dir /tmp/per_layer]
    PYTHONPATH=OTHER_TREE tools/per_layer.py ...     the same on another checkout (a before/after pair)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np


def step_us(engine, prompt: list[int], tokens: int) -> float:
    """The mean decode step (us) of ``tokens`` greedy tokens after ``prompt``."""
    marks: list[int] = []
    engine.generate_full(prompt, max_new_tokens=tokens + 1, stop_at_eos=False,
                         on_token=lambda _t: marks.append(time.perf_counter_ns()))
    return (marks[-1] - marks[0]) / tokens / 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, nargs=2, default=(2, 16), help="the two layer counts")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--dir", type=Path, default=Path("/tmp/per_layer"), help="where the tiny models are made")
    args = p.parse_args(argv)

    from coordinator.cli.make_model import make_model
    from coordinator.config import EngineConfig
    from coordinator.engine import Engine

    engines = {}
    for n in args.layers:
        path = args.dir / f"tiny{n}"
        if not (path / "config.json").exists():
            make_model(path, "tiny", num_layers=n)
        engines[n] = Engine.open(path, EngineConfig(device="cpu", pool="inproc"))
    prompt = list(np.random.default_rng(0).integers(0, 256, args.prompt_tokens))
    try:
        for e in engines.values():
            e.generate(prompt, max_new_tokens=8, stop_at_eos=False)  # warm
        steps: dict[int, list[float]] = {n: [] for n in engines}
        for _ in range(args.rounds):
            for n, e in engines.items():
                steps[n].append(step_us(e, prompt, args.tokens))
    finally:
        for e in engines.values():
            e.close()
    lo, hi = args.layers
    med = {n: float(np.median(v)) for n, v in steps.items()}
    tree = os.environ.get("PYTHONPATH") or str(Path(__file__).resolve().parents[1])
    for n, v in steps.items():
        print(f"{n} layers: decode step {med[n]:,.0f} us (rounds {', '.join(f'{x:,.0f}' for x in v)})")
    print(f"{tree}: per-layer cost {(med[hi] - med[lo]) / (hi - lo):.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
