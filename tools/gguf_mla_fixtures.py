#!/usr/bin/env python
r"""GGUF fixtures of the DeepSeek, GLM-4.5 and Qwen3-Next architectures, written by llama.cpp's own converter.

tests/fixtures/gguf/{deepseek_v3_basic,deepseek_v2_lite,glm4_moe_basic}.gguf are llama.cpp's
convert_hf_to_gguf.py run on the safetensors fixtures of the same names (tests/fixtures/hf/, made by
tools/hf_reference.py), so the tests read exactly what users' files hold: arch ``deepseek2`` (kv_b_proj
split into attn_k_b, transposed, and attn_v_b; the MLA head sizes as key_length_mla/value_length_mla;
the correction bias as exp_probs_b; YaRN's mscale_all_dim as yarn_log_multiplier x 0.1) and ``glm4moe``
(post_attention_norm, block_count counting the multi-token-prediction layer), and qwen3_next_basic.gguf's
``qwen3next`` (in_proj_qkvz split into attn_qkv and attn_gate, -exp(A_log) as ssm_a, the RMSNorms' weights
plus 1; always F32, as its checkpoint is, and --no-mtp: the fixture has no MTP layer). ``--outtype bf16``: the
checkpoints are bfloat16, so their BF16 matrices and F32 vectors are the same numbers as the safetensors
(lossless) at half an F32 file's size. Run with the project's venv (it writes the tokenizer with the
project's code) and point it at a llama.cpp tree and a Python that has torch and transformers:

    .venv/bin/python tools/gguf_mla_fixtures.py --llama-cpp /tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp \
        --hf-python /tmp/hfenv/bin/python

What is changed in the temporary copy the converter reads, and why:

* tokenizer.json: the fixtures have none; the byte-level tokenizer of 256 byte tokens and no merges
  (coordinator/text/tokenizer.py's byte_level_tokenizer), as the fixtures' vocab_size is 256. The
  converter recognises a BPE pre-tokenizer by a hash and refuses one it does not know; with no merges every
  pre-tokenizer gives the same ids, so it is told "gpt-2" (as tools/train_tiny_moe.py's ``gguf`` does), and
  GLM's vocabulary writer (which looks up GLM's own special tokens, [gMASK] etc.) is replaced by the gpt2 one.
* tokenizer_config.json (Qwen3-Next's alone): every special token null, as transformers 5.25 otherwise adds
  <|endoftext|> as a 257th token to a vocabulary of 256 and the converter refuses it.
* config.json: ``scoring_func`` as the Hub's configs have it ("sigmoid" for DeepSeek-V3, "softmax" for V2):
  transformers 5's config classes leave it out, and without it the converter writes no expert_gating_func,
  which llama.cpp reads as softmax (DeepSeek-V2's) for every deepseek2 file.

With ``--q8`` it also writes OUT/deepseek_v3_basic-q8_0.gguf with llama-quantize (not committed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FIXTURES = {"deepseek_v3_basic": "sigmoid", "deepseek_v2_lite": "softmax", "glm4_moe_basic": None,
            "qwen3_next_basic": None}
OWN_ARGS = {"qwen3_next_basic": ["--no-mtp", "--outtype", "f32"]}  # after --outtype: the converter takes the last
CONVERT = ("import sys; sys.argv = sys.argv[1:]; sys.path[:0] = [sys.argv[0].rsplit('/', 1)[0]]; "
           "import conversion.base as b; b.TextModel.get_vocab_base_pre = lambda self, tok: 'gpt-2'; "
           "b.TextModel._set_vocab_glm = b.TextModel._set_vocab_gpt2; "
           "import runpy; runpy.run_path(sys.argv[0], run_name='__main__')")


def main() -> int:
    from coordinator.text.tokenizer import byte_level_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="a llama.cpp source tree (build/bin for --q8)")
    ap.add_argument("--hf-python", type=Path, required=True, help="a Python with torch and transformers")
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / "gguf")
    ap.add_argument("--cases", nargs="*", default=list(FIXTURES), choices=list(FIXTURES), help="the fixtures to write")
    ap.add_argument("--q8", action="store_true", help="also a Q8_0 file of deepseek_v3_basic (llama-quantize)")
    ap.add_argument("--outtype", default="bf16", choices=["bf16", "f32"],
                    help="the matrices' type (f32: for tools/gguf_llama_cpp_check.py, as llama.cpp computes BF16 "
                         "matrices with bfloat16 activations)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(args.llama_cpp / "gguf-py"))
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.cases:
            scoring = FIXTURES[name]
            src = Path(tmp) / name
            shutil.copytree(REPO / "tests" / "fixtures" / "hf" / name, src)
            byte_level_tokenizer([]).save(str(src / "tokenizer.json"))
            if name in OWN_ARGS:
                (src / "tokenizer_config.json").write_text(json.dumps({
                    "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": None,
                    "unk_token": None, "pad_token": None}))
            if scoring is not None:
                cfg = json.loads((src / "config.json").read_text())
                cfg["scoring_func"] = scoring
                (src / "config.json").write_text(json.dumps(cfg, indent=2))
            dst = args.out / f"{name}.gguf"
            subprocess.run([str(args.hf_python), "-c", CONVERT, str(args.llama_cpp / "convert_hf_to_gguf.py"),
                            str(src), "--outtype", args.outtype, *OWN_ARGS.get(name, []), "--outfile", str(dst)],
                           check=True, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            print(f"{dst}: {dst.stat().st_size} bytes")
    if args.q8:
        dst = args.out / "deepseek_v3_basic-q8_0.gguf"
        r = subprocess.run([str(args.llama_cpp / "build" / "bin" / "llama-quantize"), "--allow-requantize",
                            str(args.out / "deepseek_v3_basic.gguf"), str(dst), "Q8_0"], capture_output=True,
                           text=True)
        print(f"Q8_0: {'ok ' + str(dst) if r.returncode == 0 else 'refused'}\n"
              + "\n".join((r.stdout + r.stderr).strip().splitlines()[-4:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
