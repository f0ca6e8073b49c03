#!/usr/bin/env python
"""Constrained decoding's cost per token at a real vocabulary, beside the unconstrained sampling step.

    .venv/bin/python tools/grammar_bench.py --vocab VOCAB [--model MODEL_DIR] [--repeat 20] [--json OUT]

VOCAB is a tokenizer.json, or a GGUF file with a tokenizer in its metadata: llama.cpp's
``models/ggml-vocab-qwen2.gguf`` (Qwen2/Qwen3's 151 936 ids; it is in the llama-cpp-python source
distribution that tools/vs_llama.py builds llama.cpp from). Each grammar's text (a JSON document matching a
schema, a tool call) is tokenised, then walked token by token: per token the mask is computed (the
engine's Constraint.allowed(): llguidance's bitmask unpacked to [V] bools, the request's end ids set) and the
token accepted; then again with the mask applied to [V] logits (Constraint.mask); and the library's
bitmask alone. The figure is µs per token (median and mean over the walk, the first token included),
beside the sampler's own choice on [V] logits without a grammar (greedy and temperature 1), and with
``--model`` a decode step of that model (Engine.step of one token, in-process pool). When the xgrammar
package imports (it needs torch), its matcher is timed on the same texts for comparison: the library
choice's measurement.
"""

from __future__ import annotations

from shm import threads_env

threads_env.apply()  # the thread settings strata's commands run with, before NumPy loads

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.text.grammar import GrammarSpec, Grammars  # noqa: E402
from coordinator.model.sampling import Sampler  # noqa: E402
from coordinator.model.sampling_params import SamplingParams  # noqa: E402
from coordinator.model.step import StepBatch

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "email": {"type": "string", "format": "email"},
        "roles": {"type": "array", "items": {"enum": ["admin", "editor", "viewer"]}},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
    },
    "required": ["id", "name", "email", "roles", "address", "active", "score"],
    "additionalProperties": False,
}
DOCUMENT = {"id": 81724, "name": "Ada Lovelace, Countess of Lovelace", "email": "ada.lovelace@example.org",
            "roles": ["admin", "viewer"], "address": {"street": "12 St James's Square", "city": "London",
                                                      "zip": "10001"}, "active": True, "score": 97.25}
TOOL_LARK = ('start: "<tool_call>\\n" call "\\n</tool_call>"\n'
             'call: %json {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": '
             '{"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, '
             '"required": ["city", "unit"], "additionalProperties": false}}, "required": ["name", "arguments"], '
             '"additionalProperties": false}')
TOOL_TEXT = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","unit":"c"}}\n</tool_call>'


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def load_tokenizer(path: Path):
    """A tokenizers.Tokenizer from a tokenizer.json or a GGUF file's metadata."""
    if path.suffix == ".gguf":
        import gguf

        from coordinator.text.gguf_tokenizer import gguf_tokenizer
        from shm.gguf_file import metadata_value

        reader = gguf.GGUFReader(str(path))
        return gguf_tokenizer({k: metadata_value(f) for k, f in reader.fields.items()}, str(path))
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def summary(seconds: list[float]) -> dict:
    us = [s * 1e6 for s in seconds]
    return {"median_us": round(statistics.median(us), 1), "mean_us": round(statistics.fmean(us), 1),
            "tokens": len(us)}


def walk_llguidance(grammars: Grammars, spec: GrammarSpec, ids: list[int], ends: set[int], repeat: int) -> dict:
    """Per token: the mask (Constraint.allowed) and the accept; then the same walk with the mask applied to
    [V] float32 logits (Constraint.mask: what the sampler adds to its choice)."""
    logits = np.random.default_rng(0).standard_normal(grammars.vocab_size).astype(np.float32)
    times, applied, raw = [], [], []
    for _ in range(repeat):
        c = grammars.constraint(spec, ends)
        for t in ids:  # the library alone, as the xgrammar walk: its bitmask filled, the token consumed
            t0 = time.perf_counter()
            c.matcher.unsafe_compute_mask_ptr(c.bitmask.ctypes.data, c.bitmask.nbytes)
            c.matcher.consume_token(t)
            raw.append(time.perf_counter() - t0)
        c = grammars.constraint(spec, ends)
        for t in ids:
            t0 = time.perf_counter()
            allowed = c.allowed()
            c.accept(t)
            times.append(time.perf_counter() - t0)
            assert allowed[t], f"token {t} refused: the text does not match the grammar"
        assert c.matcher.is_accepting()
        c = grammars.constraint(spec, ends)
        for t in ids:
            t0 = time.perf_counter()
            masked = c.mask(logits)
            c.accept(t)
            applied.append(time.perf_counter() - t0)
            assert np.isfinite(masked[t])
    return {"bitmask_and_consume": summary(raw), "mask_and_accept": summary(times),
            "mask_applied_to_logits": summary(applied)}


def walk_xgrammar(tok, vocab: int, schema: str, ids: list[int], repeat: int) -> dict | None:
    """xgrammar's matcher on the same walk of a JSON schema's text (fill_next_token_bitmask + accept_token), or
    None without the package."""
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    encoded = [tok.id_to_token(i) or "" for i in range(vocab)]
    info = xgr.TokenizerInfo(encoded, vocab_type=xgr.VocabType.BYTE_LEVEL, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))  # as llguidance
    compile_s = time.perf_counter() - t0
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    times = []
    for _ in range(repeat):
        m = xgr.GrammarMatcher(compiled)
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bitmask)
            ok = m.accept_token(t)
            times.append(time.perf_counter() - t0)
            assert ok, f"xgrammar refused token {t}"
    return {**summary(times), "compile_s": round(compile_s, 3)}


def sampler_us(vocab: int, temperature: float, repeat: int) -> dict:
    """Sampler.choose on random [V] logits without a grammar: the engine's own sampling step."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(vocab).astype(np.float32)
    times = []
    for i in range(repeat * 20):
        s = Sampler(SamplingParams(temperature=temperature, seed=i))
        t0 = time.perf_counter()
        s.choose(logits)
        times.append(time.perf_counter() - t0)
    return summary(times)


def model_step_us(model: str, repeat: int) -> dict:
    from coordinator.config import EngineConfig
    from coordinator.engine import Engine

    with Engine.open(model, EngineConfig(pool="inproc")) as eng:
        cache = eng.new_cache()
        eng.step(StepBatch([(np.array([1, 2, 3], np.int64), cache)])).logits
        times = []
        for i in range(repeat):
            t0 = time.perf_counter()
            eng.step(StepBatch([(np.array([4 + i], np.int64), cache)])).logits
            times.append(time.perf_counter() - t0)
        return {**summary(times), "model": model}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", required=True, type=Path, help="tokenizer.json, or a GGUF file with a tokenizer")
    ap.add_argument("--model", help="a model folder or GGUF file: its decode step is timed beside")
    ap.add_argument("--repeat", type=int, default=20, help="walks of each text")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    args = ap.parse_args()
    tok = load_tokenizer(args.vocab)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    t0 = time.perf_counter()
    grammars = Grammars(tok.to_str(), vocab)
    grammars.tokenizer()
    tables_s = time.perf_counter() - t0
    ends = {vocab - 1}
    cases = {
        "json_schema": (GrammarSpec.json_schema(SCHEMA), json.dumps(DOCUMENT, separators=(",", ":")),
                        json.dumps(SCHEMA)),
        "json_object": (GrammarSpec("json_object"), json.dumps(DOCUMENT, separators=(",", ":")), None),
        "tool_call_lark": (GrammarSpec("lark", TOOL_LARK), TOOL_TEXT, None),
    }
    out = {"cpu": cpu_name(), "vocab": vocab, "vocab_file": args.vocab.name, "llguidance_tables_s": round(tables_s, 2),
           "grammars": {}}
    for name, (spec, text, xgr_source) in cases.items():
        ids = tok.encode(text, add_special_tokens=False).ids
        t0 = time.perf_counter()
        grammars.compile(spec)
        row = {"compile_s": round(time.perf_counter() - t0, 4),
               "llguidance": walk_llguidance(grammars, spec, ids, ends, args.repeat)}
        if xgr_source is not None:
            row["xgrammar"] = walk_xgrammar(tok, vocab, xgr_source, ids, args.repeat)
        out["grammars"][name] = row
    out["sampler_without_grammar"] = {"greedy": sampler_us(vocab, 0.0, args.repeat),
                                      "temperature_1": sampler_us(vocab, 1.0, args.repeat)}
    if args.model:
        out["decode_step"] = model_step_us(args.model, args.repeat)
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
