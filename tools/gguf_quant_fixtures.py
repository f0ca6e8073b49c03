#!/usr/bin/env python
r"""Quantised GGUF fixtures made as users' files are made, with the references their tests hold the engine to.

For each case (a random-weight transformers model from tools/hf_reference.py whose matrices' rows are whole
256-weight super-blocks: qwen3_next_quant, qwen2_moe_quant), this runs llama.cpp's convert_hf_to_gguf.py (F32), then
``llama-quantize`` to each type (Q8_0, Q4_K_M, IQ4_XS), the way every published quantised file is made, and writes
tests/fixtures/gguf/<case>-<type>.gguf beside <case>-<type>.npz:

    tokens           int32   [T]          the text's first T tokens, as llama.cpp tokenised them
    first            int32   []           the first position scored (llama-perplexity scores the second half)
    reference        float32 [T, V]       transformers' logits (float32) on the file's dequantised weights
    llama            float32 [P, V]       llama.cpp's log-probabilities at positions first .. T-2 (its CPU backend,
                                          a float32 KV cache, no flash attention), as llama-perplexity
                                          --kl-divergence-base saves them: steps of about 2.4e-4 nats, and those
                                          more than 16 nats below the best floored

so a test measures llama.cpp's own error against the same reference the engine is measured against, on the same
positions. The dequantised weights are the file's tensors read back into the model's own names and layouts (the
inverse of the converter's changes: Qwen3-Next's attn_qkv and attn_gate interleaved again per key head into
in_proj_qkvz, log(-ssm_a), the norms less 1); the converter's F32 file read back that way is checked to give the
checkpoint's weights before anything is quantised. Run with the project's venv, a llama.cpp tree built with cmake
(build/bin/llama-quantize and llama-perplexity) and a Python with torch and transformers:

    .venv/bin/python tools/gguf_quant_fixtures.py --llama-cpp /tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp \
        --hf-python /tmp/hfenv/bin/python [--cases qwen3_next_quant qwen2_moe_quant] [--types Q8_0 Q4_K_M IQ4_XS]

It prints, per file, llama.cpp's largest |log-prob difference| from the reference over the entries within 16 nats of
the best, and the tensor types the file holds. ``--report`` reads the files already written and prints a table of
llama.cpp's and the engine's (in process, its default activations) differences, the median and the largest over the
positions, and the dense matrices' formats (docs/benchmarks.md, "Quantised files against llama.cpp"):

    .venv/bin/python tools/gguf_quant_fixtures.py --report [--out tests/fixtures/gguf]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

CASES = ("qwen3_next_quant", "qwen2_moe_quant", "qwen3_moe_quant", "mixtral_quant", "glm4_moe_quant",
         "deepseek_v3_quant")
MIXTRAL_EXPERTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # Mixtral's per-expert names
TYPES = ("Q8_0", "Q4_K_M", "IQ4_XS")
CTX = 64  # tokens llama-perplexity scores in one chunk (positions CTX/2 .. CTX-2)
FLOOR = 15.9  # nats below the best that llama-perplexity's saved log-probabilities keep

# run by --hf-python: transformers' float32 logits of a checkpoint folder on tokens, saved as npz
REFERENCE = """
import os, sys
os.environ.setdefault("USE_HUB_KERNELS", "NO")
import numpy as np, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32, attn_implementation="eager").eval()
tokens = np.load(sys.argv[2])
with torch.no_grad():
    logits = model(torch.tensor(tokens[None].astype(np.int64))).logits[0].float().numpy()
np.save(sys.argv[3], logits)
"""


def dequantised_state(gguf: Path, like: Path) -> dict[str, np.ndarray]:
    """The GGUF file's tensors as float32 under the names and in the layouts of the safetensors checkpoint ``like``
    (the file it was converted from): the inverse of the converter's changes."""
    from safetensors.numpy import load_file

    from coordinator.model.weights import per_group_rows
    from coordinator.model.arch import gguf_config
    from coordinator.model.source import open_gguf

    want = load_file(str(like / "model.safetensors"))
    cfg = json.loads((like / "config.json").read_text())
    ck = open_gguf(gguf)
    out: dict[str, np.ndarray] = {}
    try:
        for name, ref in want.items():
            m = re.match(r"^(.*\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+)\.weight$", name)
            linear = re.match(r"^(.*\.linear_attn)\.(\w+)(\.weight)?$", name)
            if m is not None:  # the file stacks each layer's experts
                w = ck.float32(f"{m[1]}.{MIXTRAL_EXPERTS.get(m[3], m[3])}")[int(m[2])]
            elif linear is not None and linear[2] == "in_proj_qkvz":
                Hk, Hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
                dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
                rows = per_group_rows(Hk, [dk, dk, Hv // Hk * dv, Hv // Hk * dv])
                w = np.empty(ref.shape, np.float32)
                w[np.concatenate(rows[:3])] = ck.float32(f"{linear[1]}.in_proj_qkv.weight")
                w[rows[3]] = ck.float32(f"{linear[1]}.in_proj_z.weight")
            elif linear is not None and linear[2] == "A_log":
                w = np.log(-ck.float32(f"{linear[1]}.A_neg"))
            elif name not in ck:  # a multi-token-prediction layer's, which the converter leaves out
                w = ref
            else:
                w = ck.float32(name)
                if cfg.get("model_type") == "qwen3_next" and name.endswith("norm.weight") and \
                        not name.endswith("linear_attn.norm.weight"):
                    w = w - np.float32(1.0)  # the converter stores 1 + weight
            out[name] = np.ascontiguousarray(np.asarray(w, np.float32).reshape(ref.shape))
    finally:
        ck.close()
    return out


def tensor_types(gguf: Path) -> dict[str, int]:
    """How many of the file's tensors hold each ggml type."""
    import gguf as gg

    count: dict[str, int] = {}
    for t in gg.GGUFReader(gguf).tensors:
        count[t.tensor_type.name] = count.get(t.tensor_type.name, 0) + 1
    return count


def log_probs(logits: np.ndarray) -> np.ndarray:
    lp = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    return lp - np.log(np.exp(lp).sum(-1, keepdims=True))


def worst(lp: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Per position, the largest |lp - ref| over the entries within FLOOR nats of ref's best (llama.cpp floors the
    rest): the figure of the report and of tests/test_gguf_quantized.py."""
    kept = ref > ref.max(-1, keepdims=True) - FLOOR
    return np.where(kept, np.abs(lp - ref), 0.0).max(-1)


def report(out: Path, cases, types) -> None:
    """The module's --report table over the files in ``out``."""
    from coordinator.config import EngineConfig
    from coordinator.engine import Engine

    print("| file | llama.cpp median / max | ours median / max | top-1 ours / llama.cpp | dense matrices |")
    print("|---|---|---|---|---|")
    for case in cases:
        for qtype in types:
            stem = f"{case}-{qtype}"
            ref = np.load(out / f"{stem}.npz")
            first, T = int(ref["first"]), ref["tokens"].size
            want = log_probs(ref["reference"][first:T - 1])
            with Engine.open(out / f"{stem}.gguf", EngineConfig(pool="inproc")) as eng:
                got = log_probs(eng.logits(ref["tokens"].tolist())[first:T - 1])
                dense = eng.dense_format
            theirs, ours = worst(ref["llama"], want), worst(got, want)
            top = [int((x.argmax(-1) == want.argmax(-1)).sum()) for x in (got, ref["llama"])]
            print(f"| `{stem}` | {np.median(theirs):.3f} / {theirs.max():.3f} | {np.median(ours):.3f} / "
                  f"{ours.max():.3f} | {top[0]} / {top[1]} of {T - 1 - first} | {dense} |")


def main() -> int:
    from gguf_llama_cpp_check import read_kld, with_a_merge
    from gguf_mla_fixtures import CONVERT, OWN_ARGS
    from safetensors.numpy import load_file, save_file

    from coordinator.text.tokenizer import byte_level_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", type=Path, help="a llama.cpp source tree built with cmake (build/bin)")
    ap.add_argument("--hf-python", type=Path, help="a Python with torch and transformers")
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / "gguf")
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--types", nargs="*", default=list(TYPES))
    ap.add_argument("--text", type=Path, default=REPO / "README.md", help="the text scored (its first 4000 bytes)")
    ap.add_argument("--report", action="store_true", help="only the table of the files already in --out")
    args = ap.parse_args()
    if args.report:
        report(args.out, args.cases, args.types)
        return 0
    if args.llama_cpp is None or args.hf_python is None:
        ap.error("--llama-cpp and --hf-python are needed to write the files")
    bins = args.llama_cpp / "build" / "bin"
    env = dict(os.environ, PYTHONPATH=str(args.llama_cpp / "gguf-py"))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        text = tmp / "text.txt"
        text.write_bytes(bytes(c for c in args.text.read_bytes()[:4000] if c in (9, 10, 13) or 32 <= c < 127))
        for case in args.cases:
            subprocess.run([str(args.hf_python), str(REPO / "tools" / "hf_reference.py"), "--out", str(tmp / "hf"),
                            "--cases", case], check=True, stdout=subprocess.DEVNULL)
            src = tmp / "hf" / case
            byte_level_tokenizer([]).save(str(src / "tokenizer.json"))
            if True:  # as tools/gguf_mla_fixtures.py for Qwen3-Next: transformers adds <|endoftext|> to a vocabulary of 256 otherwise
                (src / "tokenizer_config.json").write_text(json.dumps({
                    "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": None,
                    "unk_token": None, "pad_token": None}))
            if case.startswith("deepseek_v3"):  # as tools/gguf_mla_fixtures.py: the Hub's scoring_func
                cfg = json.loads((src / "config.json").read_text())
                (src / "config.json").write_text(json.dumps(dict(cfg, scoring_func="sigmoid"), indent=2))
            f32 = tmp / f"{case}-F32.gguf"
            subprocess.run([str(args.hf_python), "-c", CONVERT, str(args.llama_cpp / "convert_hf_to_gguf.py"), str(src),
                            *OWN_ARGS.get("qwen3_next_basic" if case.startswith("qwen3_next") else case, []),
                            "--outtype", "f32", "--outfile", str(f32)],
                           check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            original = load_file(str(src / "model.safetensors"))
            back = dequantised_state(f32, src)
            gap = max(float(np.abs(back[n] - original[n]).max()) for n in original)
            print(f"{case}: the F32 file read back differs from the checkpoint by at most {gap:.1e}")
            if gap > 1e-6:
                raise SystemExit(f"{case}: the inverse of the converter's changes is wrong ({gap})")
            for qtype in args.types:
                dst = args.out / f"{case}-{qtype}.gguf"
                r = subprocess.run([str(bins / "llama-quantize"), str(f32), str(dst), qtype], capture_output=True,
                                   text=True)
                if r.returncode:
                    raise SystemExit(f"llama-quantize {qtype} refused {f32}:\n{r.stderr[-2000:]}")
                copy = with_a_merge(dst, tmp / f"llama-{dst.name}")  # llama.cpp refuses a BPE vocabulary without merges
                kld = tmp / f"{dst.stem}.kld"
                r = subprocess.run([str(bins / "llama-perplexity"), "-m", str(copy), "-f", str(text), "-c", str(CTX),
                                    "--chunks", "1", "-b", str(CTX), "-t", "2", "-ctk", "f32", "-ctv", "f32", "-fa",
                                    "off", "--kl-divergence-base", str(kld)], capture_output=True, text=True)
                if r.returncode:
                    raise SystemExit(f"llama-perplexity refused {copy}:\n{r.stderr[-2000:]}")
                tokens, first, llama = read_kld(kld)
                deq = tmp / "deq" / dst.stem
                deq.mkdir(parents=True, exist_ok=True)
                save_file(dequantised_state(dst, src), str(deq / "model.safetensors"))
                (deq / "config.json").write_text((src / "config.json").read_text())
                np.save(tmp / "tokens.npy", tokens[0])
                subprocess.run([str(args.hf_python), "-c", REFERENCE, str(deq), str(tmp / "tokens.npy"),
                                str(tmp / "reference.npy")], check=True, stderr=subprocess.DEVNULL)
                reference = np.load(tmp / "reference.npy").astype(np.float32)
                np.savez_compressed(args.out / f"{dst.stem}.npz", tokens=tokens[0].astype(np.int32),
                                    first=np.int32(first), reference=reference, llama=llama[0].astype(np.float32))
                ref_lp = log_probs(reference[first:tokens.shape[1] - 1])
                print(f"{dst.name}: {dst.stat().st_size} bytes, types {tensor_types(dst)}; llama.cpp's max |log-prob "
                      f"difference| from transformers on the dequantised weights {worst(llama[0], ref_lp).max():.2e} "
                      f"over {ref_lp.shape[0]} positions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
