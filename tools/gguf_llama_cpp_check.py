#!/usr/bin/env python
r"""The engine's log-probabilities on a GGUF file against llama.cpp's own, on the same tokens.

llama.cpp's ``llama-perplexity --kl-divergence-base FILE`` saves, for the second half of each chunk, every
position's log-probabilities over the vocabulary (16 bits each, scaled over the 16 nats below the best:
steps of about 1e-4). This runs it on each file with a float32 KV cache and no flash attention (an f16
cache alone moves this tiny random models' log-probabilities by 1e-3, and flips a near-tied router choice
here and there), then the engine (in process, float32 activations) on the chunks' tokens, and prints the
largest difference over the log-probabilities llama.cpp keeps, and top-1 agreement:

    .venv/bin/python tools/gguf_llama_cpp_check.py --llama-cpp /tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp \
        tests/fixtures/gguf/deepseek_v3_basic.gguf tests/fixtures/gguf/glm4_moe_basic.gguf

On F32 files (tools/gguf_mla_fixtures.py --outtype f32 --out DIR) of deepseek_v3_basic and glm4_moe_basic,
and on the deepseek2 one with yarn_log_multiplier 0.0707 or none: at most 5e-5, top-1 126/126, i.e. the
same numbers to the file's 16 bits. On the committed BF16 files about 5e-2: llama.cpp's CPU rounds the
activations to bfloat16 for BF16 matrices (the engine widens the weights instead).

llama.cpp refuses a byte-level vocabulary without merges (the fixtures' tokenizer has 256 byte tokens and
none), so a copy with one merge that makes no token is what llama.cpp reads; the engine leaves it out. It
also refuses a deepseek2 file without q_lora_rank unless it has 26 or 27 layers (its DeepSeek-V2-Lite
test), so tests/fixtures/gguf/deepseek_v2_lite.gguf cannot be checked here.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def with_a_merge(src: Path, dst: Path) -> Path:
    """A copy of src whose tokenizer.ggml.merges holds one merge ("Ā ā", making no token) when it has none."""
    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, str(reader.fields["general.architecture"].contents()))
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        w.add_key_value(field.name, field.contents(), vtype,
                        sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    if "tokenizer.ggml.merges" not in reader.fields:
        w.add_token_merges(["\u0100 \u0101"])
    for t in reader.tensors:
        w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def read_kld(path: Path):
    """(tokens [chunks, n_ctx], first position kept, log-probs [chunks, n_ctx - 1 - first, vocab])."""
    b = path.read_bytes()
    if b[:8] != b"_logits_":
        raise SystemExit(f"{path}: not a llama-perplexity logits file")
    n_ctx, n_vocab, n_chunk = (int(x) for x in np.frombuffer(b[8:20], np.int32))
    off = 20 + 4 * n_chunk * n_ctx
    tokens = np.frombuffer(b[20:off], np.int32).reshape(n_chunk, n_ctx)
    nv = 2 * ((n_vocab + 1) // 2) + 4
    first = n_ctx // 2
    raw = np.frombuffer(b[off:], np.uint16).reshape(n_chunk, n_ctx - 1 - first, nv)
    head = raw[..., :4].copy().view(np.float32)  # per position: scale, the lowest log-prob kept
    return tokens, first, head[..., 1:2] + head[..., 0:1] * raw[..., 4:4 + n_vocab].astype(np.float64)


def main() -> int:
    from coordinator.config import EngineConfig
    from coordinator.engine import Engine

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="a llama.cpp tree with build/bin")
    ap.add_argument("--text", type=Path, default=REPO / "README.md", help="the text (its first 4000 bytes)")
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--activations", default="f32", choices=["f32", "q8"], help="the engine's (q8: as llama.cpp "
                    "computes a Q8_0 file's matrices)")
    ap.add_argument("files", type=Path, nargs="+")
    args = ap.parse_args()
    worst_all = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "text.txt"
        text.write_bytes(bytes(c for c in args.text.read_bytes()[:4000] if c in (9, 10, 13) or 32 <= c < 127))
        for path in args.files:
            copy = with_a_merge(path, Path(tmp) / path.name)
            kld = Path(tmp) / f"{path.stem}.kld"
            r = subprocess.run([str(args.llama_cpp / "build" / "bin" / "llama-perplexity"), "-m", str(copy), "-f",
                                str(text), "-c", str(args.ctx), "--chunks", str(args.chunks), "-b", str(args.ctx),
                                "-t", "2", "-ctk", "f32", "-ctv", "f32", "-fa", "off", "--kl-divergence-base",
                                str(kld)], capture_output=True, text=True)
            if r.returncode:
                print(f"{path}: llama.cpp refused it:\n" + "\n".join(r.stderr.strip().splitlines()[-3:]))
                continue
            tokens, first, want = read_kld(kld)
            worst, agree, n = 0.0, 0, 0
            with Engine.open(path, EngineConfig(pool="inproc", activations=args.activations)) as eng:
                for c in range(tokens.shape[0]):
                    lg = eng.logits(tokens[c].tolist()).astype(np.float64)[first:tokens.shape[1] - 1]
                    lp = lg - lg.max(1, keepdims=True)
                    lp -= np.log(np.exp(lp).sum(1, keepdims=True))
                    kept = lp > lp.max(1, keepdims=True) - 15.9  # llama.cpp floors the rest
                    worst = max(worst, float(np.abs(lp - want[c])[kept].max()))
                    agree += int((lp.argmax(1) == want[c].argmax(1)).sum())
                    n += lp.shape[0]
            worst_all = max(worst_all, worst)
            print(f"{path}: max |log-prob difference| {worst:.1e} over {n} positions, top-1 {agree}/{n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
