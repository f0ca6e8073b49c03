#!/usr/bin/env python
"""One host kind's table for docs/benchmarks.md, from what the benchmarks print and write.

    .venv/bin/python tools/vs_llama.py --model FILE.gguf --llama-bench BIN --rounds 5 | tee q4km.txt
    .venv/bin/strata bench -m DIR --modes inproc,single,split --json bench.json
    .venv/bin/python tools/bench_table.py --host avx2 --vs-llama q4km.txt q8.txt [--bench bench.json]
        [--about "AMD EPYC (Zen 3), 2 vCPUs, AVX2"] [--write [docs/benchmarks.md]]

Inputs, any number of each:

    --vs-llama   the printed output of tools/vs_llama.py (it writes no JSON): its "round N: ..." lines and
                 its summary line "llama.cpp on FILE, strata on MODEL FLAGS, T threads, ppP / tgN, ...".
                 One row per strata checkout in it: tok/s medians of the rounds, and the ratio to llama.cpp
                 in the same round, median (range).
    --bench      a report of ``strata bench --json``: one row per mode (mode@format with --formats):
                 decode and prefill tok/s, median (range), the ratio to the first format, the MoE layer's
                 wall time at decode and the pool's read rate against the STREAM figure.

The block printed (and, with --write, put between the markers ``<!-- table:HOST begin -->`` and
``<!-- table:HOST end -->`` of docs/benchmarks.md, nothing else of the file touched) holds the host, the
commands that made the figures (rebuilt from the inputs: the flags each records) and the tables. A file
without the markers is refused: add them where the table belongs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "benchmarks.md"
ROUND = re.compile(r"^round (\d+): (.*)$")
SIDE = re.compile(r"^(.*) decode ([-+0-9.eE]+|nan) prefill ([-+0-9.eE]+|nan)$")
SUMMARY = re.compile(r"^llama\.cpp on (?P<model>.*?), strata on (?P<strata>.*?), (?P<threads>\d+) threads, "
                     r"pp(?P<prompt>\d+) / tg(?P<tokens>\d+), tok/s \(the median of (?P<reps>\d+) repetitions\)")
LLAMA = "llama.cpp"


class InputError(ValueError):
    """An input is not what the benchmark it names writes; the message says which file and why."""


@dataclass
class VsLlama:
    """One run of tools/vs_llama.py, as it printed it."""

    path: str
    model: str  # llama.cpp's GGUF file
    strata_model: str  # what strata bench opened (the same file unless --strata-model)
    extra: list[str]  # the flags after --
    threads: int
    prompt_tokens: int
    tokens: int
    reps: int
    rounds: list[dict[str, dict[str, float]]] = field(default_factory=list)  # name -> {"decode", "prefill"}

    @property
    def checkouts(self) -> list[str]:
        return [n for n in self.rounds[0] if n != LLAMA]

    def command(self) -> str:
        cmd = ["tools/vs_llama.py", "--model", self.model, "--llama-bench", "LLAMA_BENCH", "--rounds",
               str(len(self.rounds))]
        if self.reps != 1:
            cmd += ["--reps", str(self.reps)]
        cmd += ["--threads", str(self.threads), "--prompt-tokens", str(self.prompt_tokens), "--tokens",
                str(self.tokens)]
        if self.strata_model != self.model:
            cmd += ["--strata-model", self.strata_model]
        if len(self.checkouts) > 1 or self.checkouts[0] != str(REPO):
            for c in self.checkouts:
                cmd += ["--checkout", c]
        if self.extra:
            cmd += ["--", *self.extra]
        return shlex.join(cmd)


def parse_vs_llama(text: str, path: str = "<text>") -> VsLlama:
    """tools/vs_llama.py's printed output -> its rounds and settings."""
    rounds: list[dict[str, dict[str, float]]] = []
    summary = None
    for line in text.splitlines():
        line = line.strip()
        m = ROUND.match(line)
        if m:
            sides = {}
            for part in m.group(2).split("; "):
                s = SIDE.match(part)
                if not s:
                    raise InputError(f"{path}: round {m.group(1)}: cannot read {part!r}")
                sides[s.group(1)] = {"decode": float(s.group(2)), "prefill": float(s.group(3))}
            if LLAMA not in sides or len(sides) < 2:
                raise InputError(f"{path}: round {m.group(1)} has no llama.cpp figure and strata figure")
            rounds.append(sides)
        elif summary is None:
            summary = SUMMARY.match(line)
    if not rounds:
        raise InputError(f"{path}: no 'round N: ...' line: not the output of tools/vs_llama.py")
    if summary is None:
        raise InputError(f"{path}: no 'llama.cpp on FILE, strata on ...' line (the run did not finish?)")
    names = set(rounds[0])
    if any(set(r) != names for r in rounds):
        raise InputError(f"{path}: the rounds do not name the same checkouts")
    strata, _, flags = summary.group("strata").partition(" ")
    return VsLlama(path, summary.group("model"), strata, shlex.split(flags), int(summary.group("threads")),
                   int(summary.group("prompt")), int(summary.group("tokens")), int(summary.group("reps")), rounds)


def _ratio_cell(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f}x"
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f}x)"


def _label_vs_llama(run: VsLlama, checkout: str) -> str:
    model = os.path.basename(run.model.rstrip("/"))
    strata = os.path.basename(run.strata_model.rstrip("/"))
    flags = f" {' '.join(run.extra)}" if run.extra else ""
    label = f"`{model}` itself{flags}" if run.strata_model == run.model else f"`{strata}`{flags} / `{model}`"
    if len(run.checkouts) > 1:
        label += f" ({os.path.basename(checkout.rstrip('/')) or checkout})"
    return label


def vs_llama_table(runs: list[VsLlama]) -> list[str]:
    lines = ["| ours / llama.cpp's file | rounds | decode tok/s, ours / llama.cpp | decode ratio | "
             "prefill tok/s, ours / llama.cpp | prefill ratio |", "|---|---|---|---|---|---|"]
    for run in runs:
        for c in run.checkouts:
            cells = [_label_vs_llama(run, c), str(len(run.rounds))]
            for k in ("decode", "prefill"):
                ours = [r[c][k] for r in run.rounds]
                theirs = [r[LLAMA][k] for r in run.rounds]
                ratios = [o / t for o, t in zip(ours, theirs) if t > 0]
                cells += [f"{statistics.median(ours):.1f} / {statistics.median(theirs):.1f}", _ratio_cell(ratios)]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def _summary_cell(s: dict | None, digits: int = 1) -> str:
    if not s or s.get("median") is None:
        return "-"
    if s.get("n", 1) > 1 and s.get("min") is not None and s["min"] != s["max"]:
        return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"
    return f"{s['median']:.{digits}f}"


def read_bench(path: str) -> dict:
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: {exc}") from None
    if not isinstance(report, dict) or not isinstance(report.get("modes"), dict) or not report["modes"]:
        raise InputError(f"{path}: no 'modes': not a report of strata bench --json")
    for key in ("model", "tokens", "prompt_tokens", "rounds"):
        if key not in report:
            raise InputError(f"{path}: no {key!r}: not a report of strata bench --json")
    return report


def bench_command(report: dict) -> str:
    modes = list(dict.fromkeys(m.get("mode", label.split("@")[0]) for label, m in report["modes"].items()))
    cmd = ["strata", "bench", "-m", report["model"], "--modes", ",".join(modes)]
    nodes = {len(m.get("nodes", [])) for m in report["modes"].values() if m.get("mode") == "split"}
    if nodes:
        cmd += ["--nodes", str(max(nodes))]
    cmd += ["--tokens", str(report["tokens"]), "--prompt-tokens", str(report["prompt_tokens"]), "--rounds",
            str(report["rounds"])]
    if report.get("formats"):
        cmd += ["--formats", ",".join(report["formats"])]
    if report.get("spin_us"):
        cmd += ["--spin-us", f"{report['spin_us']:g}"]
    for key, value in sorted((report.get("device") or {}).items()):
        if value is not None and key in ("device", "expert_profile", "gpu_experts", "gpu_expert_memory"):
            cmd += ["--" + key.replace("_", "-"), str(value)]
    cmd += ["--json", "bench.json"]
    return shlex.join(cmd)


def bench_table(reports: list[dict]) -> list[str]:
    lines = ["| model | mode | experts / dense | decode tok/s | prefill tok/s | vs first format, decode / prefill "
             "| MoE layer at decode, µs | pool / STREAM GB/s |", "|---|---|---|---|---|---|---|---|"]
    for report in reports:
        model = os.path.basename(str(report["model"]).rstrip("/"))
        for label, m in report["modes"].items():
            vs = m.get("vs_first_format") or {}
            vs_cell = (f"{vs['decode']:.2f}x / {vs['prefill']:.2f}x"
                       if vs.get("decode") is not None and vs.get("prefill") is not None else "-")
            wall = (m.get("moe_layer_decode") or {}).get("wall_us")
            pool, stream = m.get("pool_gb_per_s"), (m.get("membw") or {}).get("gb_per_s")
            bw = f"{pool:.1f} / {stream:.1f}" if pool is not None and stream is not None else "-"
            formats = f"{m.get('expert_format', '?')} / {m.get('dense_format', '?')}"
            lines.append(f"| `{model}` | {label} | {formats} | {_summary_cell(m.get('decode_tokens_per_s'))} | "
                         f"{_summary_cell(m.get('prefill_tokens_per_s'))} | {vs_cell} | {_summary_cell(wall, 0)} | "
                         f"{bw} |")
    return lines


def host_about() -> str:
    """This machine in a few words: the CPU's model name and how many CPUs this process may use."""
    name = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {len(os.sched_getaffinity(0))} CPUs"


def block(host: str, runs: list[VsLlama], reports: list[dict], about: str | None = None,
          regenerate: str | None = None) -> str:
    """The text between the markers: host, commands, tables."""
    kernels = sorted({r["kernels"] for r in reports if r.get("kernels")})
    lines = [f"Host: {about or host_about()}" + (f"; {'; '.join(kernels)}" if kernels else "") + ".", ""]
    commands = [run.command() for run in runs] + [bench_command(r) for r in reports]
    lines += ["Made by:", "", "```", *commands]
    if regenerate:
        lines.append(regenerate)
    lines += ["```", ""]
    if runs:
        threads = sorted({r.threads for r in runs})
        shapes = sorted({f"pp{r.prompt_tokens} / tg{r.tokens}" for r in runs})
        lines += [f"Beside llama.cpp's `llama-bench` on the same file, rounds alternating, "
                  f"{', '.join(map(str, threads))} threads, {', '.join(shapes)}: tok/s are the medians of the "
                  "rounds, a ratio is ours over llama.cpp's in the same round, median (range).", "",
                  *vs_llama_table(runs), ""]
    if reports:
        lines += ["`strata bench`, modes side by side in interleaved rounds: tok/s median (range).", "",
                  *bench_table(reports), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def markers(host: str) -> tuple[str, str]:
    return f"<!-- table:{host} begin -->", f"<!-- table:{host} end -->"


def replace_block(doc: str, host: str, text: str, path: str = "docs/benchmarks.md") -> str:
    """``doc`` with what lies between HOST's markers replaced by ``text``; the rest unchanged."""
    begin, end = markers(host)
    i, j = doc.find(begin), doc.find(end)
    if i < 0 or j < 0 or j < i:
        raise InputError(f"{path} has no '{begin}' ... '{end}' pair: add the markers where the {host} table "
                         "belongs")
    if doc.count(begin) > 1 or doc.count(end) > 1:
        raise InputError(f"{path} has the {host} markers more than once")
    return doc[:i + len(begin)] + "\n" + text + doc[j:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", required=True, help="the host kind: the markers' name (avx2, avx512, ...)")
    ap.add_argument("--vs-llama", dest="vs_llama", nargs="+", default=[], metavar="OUT",
                    help="saved output of tools/vs_llama.py")
    ap.add_argument("--bench", nargs="+", default=[], metavar="JSON", help="reports of strata bench --json")
    ap.add_argument("--about", default=None, help="the host in words (default: this machine's CPU and count)")
    ap.add_argument("--write", nargs="?", const=str(DOC), default=None, metavar="DOC",
                    help=f"put the block between the host's markers in DOC (default {DOC.relative_to(REPO)})")
    args = ap.parse_args(argv)
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", args.host):
        ap.error(f"--host {args.host!r}: letters, digits, '.', '_' and '-' only")
    if not args.vs_llama and not args.bench:
        ap.error("give --vs-llama OUT or --bench JSON (or both)")
    try:
        runs = [parse_vs_llama(Path(p).read_text(), p) for p in args.vs_llama]
        reports = [read_bench(p) for p in args.bench]
        regenerate = shlex.join(["tools/bench_table.py", "--host", args.host,
                                 *(["--vs-llama", *args.vs_llama] if args.vs_llama else []),
                                 *(["--bench", *args.bench] if args.bench else []),
                                 *(["--about", args.about] if args.about else []), "--write"])
        text = block(args.host, runs, reports, args.about, regenerate)
        if args.write:
            doc = Path(args.write)
            doc.write_text(replace_block(doc.read_text(), args.host, text, str(doc)))
            print(f"wrote the {args.host} table into {doc}", file=sys.stderr)
        else:
            print(text, end="")
    except (InputError, OSError) as exc:
        print(f"bench_table: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
