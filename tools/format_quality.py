#!/usr/bin/env python
"""Quality of each expert format against f32 storage of the same checkpoint, in-process.

    .venv/bin/python tools/format_quality.py --model DIR [--formats bf16,q8,q4] [--positions 256] [--json out]
        [--text FILE] [--activations q8,f32] [--decode] [--dense-dtype auto] [--reference PATH]

Runs one prompt of ``--positions`` tokens through the model with the experts
stored as f32 and as each format, and reports per format: the max relative
logits error (max |Δ| over max |f32 logits|), the mean KL divergence of the
next-token distribution KL(f32 || format) and the top-1 agreement over every
position.

The prompt is random token ids (below 256, ``--seed``) unless ``--text`` names a
file: then it is that file's first ``--positions`` tokens, by the model's
tokenizer. A random-weight model's distributions are nearly flat, so its top-1
agreement says little; measure a trained one on real text
(tools/train_tiny_moe.py makes one, with held-out text).

The reference is the f32 computation: ``--reference`` (default: ``--model``)
with f32 experts and f32 dense matrices. A GGUF file is measured as it is with
``--formats auto`` (its own blocks; ``--dense-dtype auto`` keeps its quantised
dense matrices too) against the f32 GGUF of the same checkpoint as
``--reference``. ``--activations`` takes one or more of q8, f32 (EngineConfig's
``activations``: quantised weights times int8 activations, or widened to float);
one row per format and setting. The prompt is one prefill forward, unless
``--decode``: one decode step a token, the path generation takes (the int8
activations apply to decode for every quantised format, to prefill only for the
K types and IQ4_XS).
"""

from __future__ import annotations

from shm import threads_env

threads_env.apply()  # the thread settings strata's commands run with, before NumPy loads

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator import Engine, EngineConfig  # noqa: E402
from coordinator.quality import compare_logits  # noqa: E402


def prompt_ids(eng: Engine, args: argparse.Namespace) -> list[int]:
    if args.text is None:
        rng = np.random.default_rng(args.seed)
        return rng.integers(0, min(eng.model_config.vocab_size, 256), args.positions).tolist()
    ids = eng.encode(args.text.read_text(encoding="utf-8"))[:args.positions]
    if len(ids) < args.positions:
        raise SystemExit(f"{args.text} is only {len(ids)} tokens; --positions is {args.positions}")
    return ids


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--formats", default="bf16,q8,q4", help="expert formats, comma-separated (auto: the file's)")
    ap.add_argument("--positions", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text", type=Path, help="prompt: this file's first --positions tokens instead of random ids")
    ap.add_argument("--activations", default=EngineConfig.activations, help="q8, f32 or both, comma-separated")
    ap.add_argument("--decode", action="store_true", help="one decode step a token instead of one prefill forward")
    ap.add_argument("--dense-dtype", default=EngineConfig.dense_dtype, help="the measured runs' dense_dtype")
    ap.add_argument("--reference", type=Path, help="the model whose f32 computation is the reference "
                                                     "(default --model; for a GGUF file, its f32 GGUF)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    reference = args.reference or args.model
    with Engine.open(reference, EngineConfig(pool="inproc", expert_dtype="f32", dense_dtype="f32",
                                             activations="f32")) as eng:
        prompt = prompt_ids(eng, args)
        ref = eng.logits(prompt, steps=args.decode)
    report = []
    acts = [a for a in args.activations.split(",") if a]
    for fmt in [f for f in args.formats.split(",") if f]:
        for act in acts:
            cfg = EngineConfig(pool="inproc", expert_dtype=fmt, dense_dtype=args.dense_dtype, activations=act)
            with Engine.open(args.model, cfg) as eng:
                if args.text is not None and prompt_ids(eng, args) != prompt:
                    raise SystemExit(f"{args.model} and {reference} tokenise {args.text} differently")
                report.append({"format": fmt, "activations": act, "dense_dtype": args.dense_dtype,
                               "path": "decode" if args.decode else "prefill",
                               **compare_logits(ref, eng.logits(prompt, steps=args.decode))})
    src = f"{args.text}'s first {args.positions} tokens" if args.text else f"{args.positions} random ids"
    print(f"{args.model} against {reference} (f32 experts, f32 dense); prompt: {src}; "
          f"{'one decode step a token' if args.decode else 'one prefill forward'}; dense_dtype {args.dense_dtype}\n")
    print("| format | activations | max rel logits error | mean KL | top-1 agreement | positions |\n"
          "|---|---|---|---|---|---|")
    for r in report:
        print(f"| {r['format']} | {r['activations']} | {r['max_rel_logits_error']:.2e} | {r['mean_kl']:.2e} | "
              f"{r['top1_agreement']:.1%} | {r['positions']} |")
    if args.json:  # keyed by format (format@activations when several), as before
        prompt_src = str(args.text) if args.text else f"random ids, seed {args.seed}"
        args.json.write_text(json.dumps({r["format"] if len(acts) == 1 else f"{r['format']}@{r['activations']}":
                                         {**r, "model": str(args.model), "reference": str(reference),
                                          "prompt": prompt_src} for r in report}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
