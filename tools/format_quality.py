#!/usr/bin/env python
"""Quality of each expert format against f32 storage of the same checkpoint, in-process.

    .venv/bin/python tools/format_quality.py --model DIR [--formats bf16,q8,q4] [--positions 256] [--json out]

Runs one prompt of ``--positions`` tokens through the model with the experts
stored as f32 and as each format, and reports per format: the max relative
logits error (max |Δ| over max |f32 logits|), the mean KL divergence of the
next-token distribution KL(f32 || format) and the top-1 agreement over every
position.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator import Engine, EngineConfig  # noqa: E402
from coordinator.quality import compare_logits  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--formats", default="bf16,q8,q4")
    ap.add_argument("--positions", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    logits = {}
    for fmt in ["f32"] + [f for f in args.formats.split(",") if f]:
        with Engine.open(args.model, EngineConfig(pool="inproc", expert_dtype=fmt)) as eng:
            rng = np.random.default_rng(args.seed)
            prompt = rng.integers(0, min(eng.model_config.vocab_size, 256), args.positions).tolist()
            logits[fmt] = eng.logits(prompt)
    report = {fmt: compare_logits(logits["f32"], z) for fmt, z in logits.items() if fmt != "f32"}
    print("| format | max rel logits error | mean KL | top-1 agreement |\n|---|---|---|---|")
    for fmt, r in report.items():
        print(f"| {fmt} | {r['max_rel_logits_error']:.2e} | {r['mean_kl']:.2e} | {r['top1_agreement']:.1%} |")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
