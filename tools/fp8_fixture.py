#!/usr/bin/env python
"""Build the FP8 DeepSeek-V3 test fixture from tests/fixtures/hf/deepseek_v3_basic, as DeepSeek ships V3/R1.

Run with a Python that has torch (with torch.float8_e4m3fn) + transformers + safetensors; NOT needed by the
engine or its tests:

    /tmp/hfenv/bin/python tools/fp8_fixture.py            # writes tests/fixtures/hf/deepseek_v3_fp8

Every 2-D linear weight (attention projections, dense, shared and routed expert MLPs) is quantised as
DeepSeek's own weight_quant does it, per block of the weight_block_size [br, bc] (ragged last blocks where the
size is not a multiple): scale = amax(|w|) / 448, code = float8_e4m3fn(w / scale), stored as F8_E4M3 with the
scale in ``<name>_scale_inv`` (float32 [ceil(rows/br), ceil(cols/bc)]). What DeepSeek's checkpoints keep
unquantised stays as it was (BF16 here): embeddings, lm_head, every norm, the router's gate and its
correction bias. config.json gains DeepSeek's quantization_config.

Blocks are [48, 40] rather than [128, 128]: the same rule, but on the fixture's 24..128-wide matrices it makes
several blocks per matrix, ragged last blocks in both axes, non-square blocks (a transposed scale grid would
be caught) and node slices (32 rows of 64) that start inside a block.

Beside the checkpoint, fp8_reference.npz holds torch's side, for the tests to compare against:

    e4m3fn      float32 [256]   torch's float8_e4m3fn -> float32 of every byte
    names       str [N]         the quantised tensors
    sha256      str [N]         sha256 of each one's dequantised float32 bytes (codes.float() * scale, torch)
    block       int64 [2]

and reference.npz the transformers outputs (as tools/hf_reference.py writes them) of the model with the
dequantised float32 weights.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "tests" / "fixtures" / "hf" / "deepseek_v3_basic"
OUT = ROOT / "tests" / "fixtures" / "hf" / "deepseek_v3_fp8"
BLOCK = (48, 40)
NEW_TOKENS = 8
KEPT = ("embed_tokens", "lm_head", "norm", "mlp.gate.")  # not quantised in DeepSeek's checkpoints


def quantised(name: str, t: torch.Tensor) -> bool:
    return t.ndim == 2 and name.endswith(".weight") and not any(k in name for k in KEPT)


def quantise(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float8 codes, float32 scale_inv, float32 dequantised) of a float32 matrix."""
    rows, cols = w.shape
    br, bc = block
    nr, nc = -(-rows // br), -(-cols // bc)
    padded = torch.zeros(nr * br, nc * bc, dtype=torch.float32)
    padded[:rows, :cols] = w
    amax = padded.reshape(nr, br, nc, bc).abs().amax(dim=(1, 3))  # [nr, nc]
    scale = (amax / 448.0).clamp(min=1e-12).to(torch.float32)
    full = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:rows, :cols]
    codes = (w / full).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return codes, scale, codes.to(torch.float32) * full


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.manual_seed(0)
    tensors = load_file(str(SOURCE / "model.safetensors"))
    stored, dequantised, names, digests = {}, {}, [], []
    for name in sorted(tensors):
        t = tensors[name]
        if quantised(name, t):
            codes, scale, deq = quantise(t.to(torch.float32), BLOCK)
            stored[name], stored[name + "_scale_inv"] = codes, scale
            dequantised[name] = deq
            names.append(name)
            digests.append(hashlib.sha256(deq.contiguous().numpy().tobytes()).hexdigest())
        else:
            stored[name] = t
            dequantised[name] = t.to(torch.float32)
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    cfg = json.loads((SOURCE / "config.json").read_text())
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": list(BLOCK)}
    (args.out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    shutil.copy(SOURCE / "generation_config.json", args.out / "generation_config.json")
    save_file(stored, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32).numpy()
    np.savez(args.out / "fp8_reference.npz", e4m3fn=table, names=np.array(names), sha256=np.array(digests),
             block=np.array(BLOCK, np.int64))

    # transformers on the dequantised weights (float32), reloaded as tools/hf_reference.py reloads its cases
    with tempfile.TemporaryDirectory() as tmp:
        ref_cfg = {k: v for k, v in cfg.items() if k != "quantization_config"}
        (Path(tmp) / "config.json").write_text(json.dumps(ref_cfg))
        save_file({k: v.contiguous() for k, v in dequantised.items()}, str(Path(tmp) / "model.safetensors"),
                  metadata={"format": "pt"})
        model, info = AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="eager", dtype=torch.float32,
                                                           output_loading_info=True)
    assert not any(info.values()), info
    model = model.eval()
    prompt = np.load(SOURCE / "reference.npz")["input_ids"].tolist()
    ids = torch.tensor([prompt], dtype=torch.long)
    with torch.no_grad():
        logits = model(ids).logits[0].float().numpy()
        gen = model.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=0, eos_token_id=None,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True, use_cache=True)
        new = gen.sequences[0, len(prompt):]
        greedy_logits = torch.stack([lg[0] for lg in gen.logits]).float().numpy()
        full = model(gen.sequences).logits[0].float().numpy()
    assert np.array_equal(full[len(prompt) - 1:-1].argmax(-1), new.numpy())
    np.savez(args.out / "reference.npz", input_ids=np.array(prompt, np.int64), logits=logits,
             greedy_ids=new.numpy().astype(np.int64), greedy_logits=greedy_logits, full_logits=full)
    size = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"{args.out}: {len(names)} FP8 matrices in blocks {list(BLOCK)}, {size} bytes; greedy {new.tolist()}")


if __name__ == "__main__":
    main()
