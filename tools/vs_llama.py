#!/usr/bin/env python
"""strata and llama.cpp on the same GGUF file, alternating, round by round: the ratios of decode and prefill.

    .venv/bin/python tools/vs_llama.py --model FILE.gguf --llama-bench PATH/llama-bench [--rounds 3] [--reps 1]
        [--threads 2] [--prompt-tokens 64] [--tokens 32] [--mode inproc|single] [--checkout DIR ...]
        [--strata-model DIR]
        [-- extra strata bench flags]

Each round runs ``llama-bench -m FILE -t T -p P -n N -r R -o json``, then ``strata bench --model FILE --modes
MODE --rounds R --device cpu --quality-positions 0`` from each checkout given (default: this one; give an
older commit's worktree to set two versions side by side), in that order, R = --reps (1 unless given). On a
shared host whose speed swings by 2-3x within minutes only figures taken close together compare: the table
gives each round's ratio, then the median of the rounds. Each side's figure in a round is the median of its R
repetitions (llama-bench's samples_ts, strata bench's rounds), both after a warm-up on the same prompt
(llama-bench's warm-up run; strata bench's on the whole prompt), so a repetition disturbed by another tenant
moves neither much. ``strata bench`` opens its engine (and compiles or loads its kernels) before it times
anything; each run is a process of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def llama_bench(binary: str, model: str, threads: int, prompt: int, tokens: int, reps: int = 1) -> dict[str, float]:
    """{"decode": tok/s, "prefill": tok/s} of llama-bench: the median of its ``reps`` repetitions (samples_ts;
    avg_ts where a build does not list them)."""
    out = subprocess.run([binary, "-m", model, "-t", str(threads), "-p", str(prompt), "-n", str(tokens), "-r",
                          str(reps), "-o", "json"], check=True, capture_output=True, text=True).stdout
    got = {}
    for test in json.loads(out):
        samples = test.get("samples_ts") or [test["avg_ts"]]
        got["prefill" if test["n_prompt"] else "decode"] = float(statistics.median(samples))
    return got


def strata_bench(checkout: Path, model: str, prompt: int, tokens: int, extra: list[str],
                 reps: int = 1, mode: str = "inproc") -> dict[str, float]:
    """{"decode": tok/s, "prefill": tok/s} of ``strata bench`` in ``mode`` (in-process, or the default single
    worker process) from ``checkout``: the medians of its ``reps`` rounds."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "bench.json"
        subprocess.run([sys.executable, "-m", "coordinator", "bench", "--model", model, "--modes", mode,
                        "--rounds", str(reps), "--tokens", str(tokens), "--prompt-tokens", str(prompt), "--device", "cpu",
                        "--quality-positions", "0", "--json", str(report), *extra],
                       cwd=checkout, env={**os.environ, "PYTHONPATH": str(checkout)},  # its code, not the venv's
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        got = json.loads(report.read_text())["modes"][mode]
    return {"decode": got["decode_tokens_per_s"]["median"], "prefill": got["prefill_tokens_per_s"]["median"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a GGUF file")
    ap.add_argument("--llama-bench", required=True, help="llama.cpp's llama-bench binary")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=1, help="repetitions of each side a round (its median counts)")
    ap.add_argument("--strata-model", default=None,
                    help="the model strata bench opens (default: --model): the same model in another form, as "
                         "the safetensors checkpoint a GGUF file was converted from, with --expert-dtype after --")
    ap.add_argument("--mode", default="inproc", choices=("inproc", "single", "split"),
                    help="strata bench's pool mode (default inproc; single: the default path, one worker process)")
    ap.add_argument("--checkout", action="append", type=Path,
                    help="a checkout of strata to run (repeatable; default: this one)")
    ap.add_argument("extra", nargs="*", help="after --: more flags for strata bench")
    args = ap.parse_args()
    checkouts = args.checkout or [REPO]
    names = ["llama.cpp"] + [str(c) for c in checkouts]
    rows: list[dict[str, dict[str, float]]] = []
    for r in range(args.rounds):
        got = {"llama.cpp": llama_bench(args.llama_bench, args.model, args.threads, args.prompt_tokens, args.tokens,
                                        args.reps)}
        for c in checkouts:
            got[str(c)] = strata_bench(c, args.strata_model or args.model, args.prompt_tokens, args.tokens, args.extra,
                                       args.reps, args.mode)
        rows.append(got)
        print(f"round {r + 1}: " + "; ".join(f"{n} decode {g['decode']:.1f} prefill {g['prefill']:.1f}"
                                             for n, g in got.items()), flush=True)
    print(f"\nllama.cpp on {args.model}, strata on {args.strata_model or args.model} "
          f"{' '.join(args.extra + (['--modes', args.mode] if args.mode != 'inproc' else []))}, "
          f"{args.threads} threads, pp{args.prompt_tokens} / tg{args.tokens}, tok/s (the median of {args.reps} "
          f"repetitions) and ratio to llama.cpp in the same round\n")
    print("| round | " + " | ".join(f"{n} decode | {n} prefill" for n in names) + " |")
    print("|---" * (1 + 2 * len(names)) + "|")
    for r, got in enumerate(rows):
        cells = []
        for n in names:
            for k in ("decode", "prefill"):
                v = got[n][k]
                cells.append(f"{v:.1f}" if n == "llama.cpp" else f"{v:.1f} ({v / got['llama.cpp'][k]:.2f}x)")
        print(f"| {r + 1} | " + " | ".join(cells) + " |")
    for n in names[1:]:
        ratios = {k: statistics.median(g[n][k] / g["llama.cpp"][k] for g in rows) for k in ("decode", "prefill")}
        print(f"\n{n}: median ratio decode {ratios['decode']:.2f}x, prefill {ratios['prefill']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
