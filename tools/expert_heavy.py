#!/usr/bin/env python
"""The expert-heavy GGUF files of issue 63, made with llama.cpp's own tools: Qwen3-MoE geometry (hidden 2048,
32 query heads, 4 KV heads, 64 experts x 768, top-8) with a small vocabulary, so a decode step reads its experts
and attention rather than a 151,936-row lm_head.

    .venv/bin/python tools/expert_heavy.py --llama-cpp LLAMA_CPP_TREE --hf-python PYTHON [--out DIR]
        [--layers 4] [--vocab 320] [--types Q4_K_M Q8_0 IQ4_XS]

Writes DIR/hf (``strata make-model --preset qwen3-30b-a3b`` in BF16 with the given layers, experts and
vocabulary), DIR/q3moe-bf16.gguf (llama.cpp's convert_hf_to_gguf.py --outtype bf16, run by PYTHON, which has
torch and transformers) and DIR/q3moe.TYPE.gguf (build/bin/llama-quantize). Two changes let llama.cpp load a
byte-level vocabulary: the tokenizer gets one merge ("Ġ Ġ"; llama.cpp refuses a BPE vocabulary without merges)
and the converter is told the pre-tokenizer is GPT-2's (it knows a tokenizer by the hash of its output on a test
text, and this one's is new to it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# runs convert_hf_to_gguf.py (argv[1]) with the pre-tokenizer named GPT-2's, its other arguments passed on
CONVERT = ("import sys, runpy; sys.argv = sys.argv[1:]; sys.path[:0] = [sys.argv[0].rsplit('/', 1)[0]]; "
           "import conversion.base as b; b.TextModel.get_vocab_base_pre = lambda self, tok: 'gpt-2'; "
           "runpy.run_path(sys.argv[0], run_name='__main__')")


def one_merge(tokenizer_json: Path) -> None:
    """Add the merge "Ġ Ġ" (two spaces) and its token after the vocabulary's last id, in place."""
    t = json.loads(tokenizer_json.read_text())
    vocab = t["model"]["vocab"]
    if "ĠĠ" not in vocab:
        vocab["ĠĠ"] = max(max(vocab.values()), max(a["id"] for a in t["added_tokens"])) + 1
        t["model"]["merges"] = ["Ġ Ġ"]
        tokenizer_json.write_text(json.dumps(t, ensure_ascii=False))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", required=True, help="a llama.cpp tree built with cmake (build/bin/llama-quantize)")
    ap.add_argument("--hf-python", required=True, help="a Python with torch and transformers, for the converter")
    ap.add_argument("--out", default="/tmp/q3m")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=320)
    ap.add_argument("--types", nargs="+", default=["Q4_K_M", "Q8_0", "IQ4_XS"])
    args = ap.parse_args()
    from coordinator.cli.make_model import make_model

    out, llama = Path(args.out), Path(args.llama_cpp)
    out.mkdir(parents=True, exist_ok=True)
    hf = out / "hf"
    if not (hf / "model.safetensors").exists():
        make_model(str(hf), preset="qwen3-30b-a3b", num_layers=args.layers, num_experts=args.experts,
                   vocab_size=args.vocab, dtype="BF16", seed=1)
    one_merge(hf / "tokenizer.json")
    bf16 = out / "q3moe-bf16.gguf"
    subprocess.run([args.hf_python, "-c", CONVERT, str(llama / "convert_hf_to_gguf.py"), str(hf), "--outtype", "bf16",
                    "--outfile", str(bf16)], check=True, env={**os.environ, "PYTHONPATH": str(llama / "gguf-py")})
    for t in args.types:
        subprocess.run([str(llama / "build/bin/llama-quantize"), str(bf16), str(out / f"q3moe.{t}.gguf"), t, "2"],
                       check=True, capture_output=True)
        print(out / f"q3moe.{t}.gguf")
    return 0


if __name__ == "__main__":
    sys.exit(main())
