#!/usr/bin/env python
r"""Train a tiny Qwen3-MoE on local text, so the formats' quality can be measured on a model that predicts.

A random-weight model's next-token distributions are nearly flat: any perturbation flips its top-1 token,
so a format's top-1 agreement on it says nothing. This trains a small ``Qwen3MoeForCausalLM`` (the
architecture the engine runs) with transformers and torch on one CPU thread, on the Python standard
library's sources (English docstrings and comments, and code), with the byte-level tokenizer of the
project's random models (``strata make-model``: one token per byte, then <|endoftext|>, <|im_start|>,
<|im_end|>), and saves it as a Hugging Face checkpoint the engine loads. Neither torch nor transformers is
a dependency of the project: run it with a separate environment that has both, e.g.

    /tmp/hfenv/bin/python tools/train_tiny_moe.py train --out /tmp/trained-moe

(seed 0, 800 steps of 4 x 512 bytes, about 18 minutes on one thread with torch 2.13 CPU and transformers
5.25: train loss 1.41, held-out loss 1.56 nats/byte). It writes OUT/config.json, generation_config.json,
model.safetensors (float32), tokenizer.json (made by the project's own ``byte_level_tokenizer``, through
its venv's Python), heldout.txt (whole source files never trained on)
and reference.npz (transformers' float32 logits and greedy continuation of heldout.txt's first 256 bytes:
input_ids, logits, greedy_ids). Then

    /tmp/hfenv/bin/python tools/train_tiny_moe.py gguf --model /tmp/trained-moe \
        --llama-cpp /tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp

converts it with llama.cpp's convert_hf_to_gguf.py to OUT/f32.gguf and quantises that with llama-quantize
to OUT/q8_0.gguf, q4_k_m.gguf and iq4_xs.gguf. llama.cpp's converter recognises a BPE tokenizer's
pre-tokenizer by the hash of a test string's ids and refuses one it does not know; this tokenizer has no
merges, so every pre-tokenizer gives the same ids (one a byte), and the converter is told "gpt-2".

    /tmp/hfenv/bin/python tools/train_tiny_moe.py train-mtp --out /tmp/trained-mtp

trains a tiny DeepSeek-V3 (hidden 128, 8 MoE layers of 8 experts, top-2, one shared expert, MLA) together with
its multi-token-prediction layer (the DeepSeek-V3 paper's objective: the next byte's loss plus 0.5 x the MTP
layer's loss on the byte after next), and saves it as the Hub's DeepSeek-V3 checkpoints hold the layer
(model.layers.8.*, num_nextn_predict_layers 1) with reference.npz (torch's float32 logits of the model and of
the MTP layer over the training data's first 64 bytes): the model for MTP drafts' speed
(docs/benchmarks.md). With ``--chain-weight W`` the objective adds W x the MTP layer's loss on the byte two after
next when the layer is fed its own output, as the engine chains a second draft (``chained_loss``): a model
whose chained drafts are trained as well as its first.

The geometry: hidden 256, 4 layers, 16 experts of intermediate 256 (a GGUF K type's super-block is 256
weights along a row, and ffn_down's rows run along the intermediate axis: with 128, llama-quantize would
store the down experts as Q5_0/Q8_0 instead of Q4_K/Q6_K), top-4 with norm_topk_prob, 4 heads / 2 KV heads
of 64, no shared expert. The sequences are 512 bytes so that every position a 512-position quality
measurement reads has been trained on (RoPE does not extrapolate past the trained length).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SPECIALS_SOURCE = "from coordinator.cli.make_model import SPECIAL_TOKENS, EOS_ID"
EOS_ID = 256  # <|endoftext|> (coordinator/cli/make_model.py), checked against the project's at run time


def stdlib_files(root: Path) -> list[Path]:
    """The standard library's own .py files, sorted: no tests, no installed packages."""
    skip = {"test", "tests", "site-packages", "dist-packages", "idle_test", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts) and p.is_file())


def write_tokenizer(out: Path, project_python: Path) -> None:
    """tokenizer.json exactly as ``strata make-model`` writes it, by the project's code in its own venv."""
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); {SPECIALS_SOURCE}; "
            "from coordinator.text.tokenizer import byte_level_tokenizer; "
            f"assert EOS_ID == {EOS_ID}, EOS_ID; "
            f"byte_level_tokenizer(SPECIAL_TOKENS).save({str(out / 'tokenizer.json')!r})")
    subprocess.run([str(project_python), "-c", code], check=True, cwd=REPO)


def train(args: argparse.Namespace) -> int:
    import numpy as np
    import torch
    from tokenizers import Tokenizer
    from transformers import GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    write_tokenizer(out, args.project_python)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    probe = "def f(x):\n    return x  # ünïcode ✓\n"
    assert tok.encode(probe, add_special_tokens=False).ids == list(probe.encode()), "not one token a byte"

    # data: whole files, every held_every-th (by sorted path) held out; tokens are the bytes, files joined by eos
    files = stdlib_files(args.data)
    held = [p for i, p in enumerate(files) if i % args.held_every == args.held_every // 2]
    held_set = set(held)
    trained = [p for p in files if p not in held_set]

    def stream(paths: list[Path]) -> np.ndarray:
        parts = []
        for p in paths:
            parts.append(np.frombuffer(p.read_bytes(), np.uint8).astype(np.int64))
            parts.append(np.array([EOS_ID], np.int64))
        return np.concatenate(parts)

    train_ids, held_ids = stream(trained), stream(held)
    heldout_text = "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in held)
    (out / "heldout.txt").write_text(heldout_text, encoding="utf-8")
    print(f"data: {len(trained)} files, {train_ids.size / 1e6:.2f} MB trained on; {len(held)} files, "
          f"{held_ids.size / 1e6:.2f} MB held out ({out / 'heldout.txt'}); vocab {vocab}", flush=True)

    cfg = Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads, num_experts=args.experts,
        num_experts_per_tok=args.top_k, moe_intermediate_size=args.intermediate, intermediate_size=2 * args.hidden,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=1024,
        tie_word_embeddings=False, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        router_aux_loss_coef=args.aux_coef, output_router_logits=False, bos_token_id=None, eos_token_id=EOS_ID,
        pad_token_id=None, use_cache=True, attention_dropout=0.0)
    model = Qwen3MoeForCausalLM(cfg).float()
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters", flush=True)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:  # linear warmup, then cosine down to a tenth
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    T = args.seq_len

    def batch(ids: np.ndarray, starts: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.stack([ids[s:s + T] for s in starts]))

    eval_starts = np.linspace(0, held_ids.size - T - 1, args.eval_seqs).astype(np.int64)
    train_eval_starts = np.random.default_rng(args.seed + 1).integers(0, train_ids.size - T, args.eval_seqs)

    @torch.no_grad()
    def mean_loss(ids: np.ndarray, starts: np.ndarray) -> float:
        model.eval()
        losses = [model(input_ids=(x := batch(ids, starts[i:i + 8])), labels=x).loss.item() * x.shape[0]
                  for i in range(0, starts.size, 8)]
        model.train()
        return sum(losses) / starts.size

    model.train()
    t0 = time.time()
    window: list[float] = []
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        x = batch(train_ids, rng.integers(0, train_ids.size - T, args.batch))
        res = model(input_ids=x, labels=x, output_router_logits=True)  # loss includes aux_coef * balance loss
        res.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        window.append(res.loss.item() - args.aux_coef * res.aux_loss.item())
        if (step + 1) % args.log_every == 0 or step == 0:
            el = time.time() - t0
            print(f"step {step + 1:5d}  lr {lr_at(step):.2e}  loss {np.mean(window):.4f} nats/byte  "
                  f"balance {res.aux_loss.item():.3f}  {(step + 1) * args.batch * T / el:.0f} tok/s  {el:.0f} s",
                  flush=True)
            window = []
        if (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            print(f"  held-out loss {mean_loss(held_ids, eval_starts):.4f}", flush=True)

    final_train, final_held = mean_loss(train_ids, train_eval_starts), mean_loss(held_ids, eval_starts)
    print(f"final: train loss {final_train:.4f}, held-out loss {final_held:.4f} nats/byte "
          f"(uniform: {math.log(vocab):.4f}) over {args.eval_seqs} x {T} bytes; {time.time() - t0:.0f} s", flush=True)

    model.eval()
    model.generation_config = GenerationConfig(eos_token_id=[EOS_ID], do_sample=False)
    model.save_pretrained(out, safe_serialization=True)

    # the reference for the engine's check: heldout.txt's first 256 bytes through transformers, in float32
    reloaded = Qwen3MoeForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    prompt = torch.tensor([tok.encode(heldout_text, add_special_tokens=False).ids[:256]])
    with torch.no_grad():
        logits = reloaded(input_ids=prompt).logits[0].numpy()
        gen = reloaded.generate(prompt, max_new_tokens=200, do_sample=False)[0, prompt.shape[1]:].numpy()
    np.savez(out / "reference.npz", input_ids=prompt[0].numpy(), logits=logits, greedy_ids=gen)
    (out / "training.json").write_text(json.dumps({
        "seed": args.seed, "steps": args.steps, "batch": args.batch, "seq_len": T, "lr": args.lr,
        "train_files": len(trained), "heldout_files": len(held), "train_loss": final_train,
        "heldout_loss": final_held, "torch": torch.__version__, "seconds": time.time() - t0}, indent=2))
    print("prompt:", repr(tok.decode(prompt[0].tolist())[-120:]))
    print("greedy:", repr(tok.decode(gen.tolist())))
    print(f"saved {out}: " + ", ".join(sorted(p.name for p in out.iterdir())))
    return 0


def train_mtp(args: argparse.Namespace) -> int:
    """A tiny DeepSeek-V3 with its multi-token-prediction layer, trained together on the same bytes: loss = the
    model's next-byte loss + mtp_weight x the MTP layer's loss on the byte after next (the DeepSeek-V3 paper's
    objective, k = 1). The MTP layer is DeepSeek-V3's module: eh_proj([enorm(Emb(t_(i+1))); hnorm(h_i)]) with
    h_i the model's last hidden state after its final norm (the rows vLLM and SGLang hand DeepSeek-V3's MTP layer,
    as the engine does), a DeepSeek-V3 decoder layer (a one-layer
    DeepseekV3Model fed inputs_embeds, whose final norm is shared_head.norm) and the model's lm_head. Saved as
    the Hub's checkpoints hold it: model.layers.L.* with L = num_hidden_layers, num_nextn_predict_layers 1."""
    import numpy as np
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, DeepseekV3Model

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out, args.project_python)
    vocab = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    files = stdlib_files(args.data)
    trained = [p for i, p in enumerate(files) if i % args.held_every != args.held_every // 2]
    ids = np.concatenate([x for p in trained for x in (np.frombuffer(p.read_bytes(), np.uint8).astype(np.int64),
                                                         np.array([EOS_ID], np.int64))])
    kw = dict(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
              moe_intermediate_size=args.intermediate, num_attention_heads=args.heads, num_key_value_heads=args.heads,
              n_routed_experts=args.experts, num_experts_per_tok=args.top_k, n_shared_experts=1, n_group=1,
              topk_group=1, first_k_dense_replace=0, routed_scaling_factor=1.0, norm_topk_prob=True,
              q_lora_rank=None, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
              max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None,
              eos_token_id=EOS_ID, pad_token_id=None, attention_dropout=0.0)
    cfg = DeepseekV3Config(num_hidden_layers=args.layers, num_nextn_predict_layers=1, **kw)
    model = DeepseekV3ForCausalLM(cfg).float()
    core = DeepseekV3Model(DeepseekV3Config(num_hidden_layers=1, **kw)).float()  # the MTP layer + its norm
    H = args.hidden
    enorm, hnorm = torch.nn.RMSNorm(H, eps=1e-6), torch.nn.RMSNorm(H, eps=1e-6)
    eh_proj = torch.nn.Linear(2 * H, H, bias=False)
    mtp_parts = torch.nn.ModuleDict(dict(core=core, enorm=enorm, hnorm=hnorm, eh_proj=eh_proj))
    captured = {}
    model.model.norm.register_forward_hook(lambda _m, _inp, out: captured.__setitem__("h", out))
    core.norm.register_forward_hook(lambda _m, inp, _out: captured.__setitem__("o", inp[0]))  # before the head's norm
    params = [p for p in list(model.parameters()) + list(mtp_parts.parameters()) if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    T = args.seq_len
    ce = torch.nn.functional.cross_entropy
    t0 = time.time()
    for step in range(args.steps):
        frac = step / max(1, args.steps - 1)
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        x = torch.from_numpy(np.stack([ids[s:s + T] for s in rng.integers(0, ids.size - T, args.batch)]))
        logits = model(input_ids=x).logits  # [B, T, V]
        main_loss = ce(logits[:, :-1].reshape(-1, vocab), x[:, 1:].reshape(-1))
        h = captured["h"][:, :-1]  # [B, T-1, H] h_0..h_(T-2), after the final norm
        e = model.model.embed_tokens(x[:, 1:])  # t_1..t_(T-1)
        joined = eh_proj(torch.cat([enorm(e), hnorm(h)], dim=-1))
        mtp_logits = model.lm_head(core(inputs_embeds=joined).last_hidden_state)  # predicts t_2..t_T
        mtp_loss = ce(mtp_logits[:, :-1].reshape(-1, vocab), x[:, 2:].reshape(-1))
        loss = main_loss + args.mtp_weight * mtp_loss
        if args.chain_weight:
            chain_loss = chained_loss(core, model, eh_proj, enorm, hnorm, joined, captured["o"], x, vocab)
            loss = loss + args.chain_weight * chain_loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % args.log_every == 0 or step == 0:
            chained = f"  chained {chain_loss.item():.4f}" if args.chain_weight else ""
            print(f"step {step + 1:5d}  loss {main_loss.item():.4f}  mtp loss {mtp_loss.item():.4f}{chained} nats/byte  "
                  f"{time.time() - t0:.0f} s", flush=True)
    L = args.layers
    tensors = {n: t.detach().contiguous() for n, t in model.state_dict().items()}
    for n, t in core.state_dict().items():
        if n.startswith("layers.0."):
            tensors[f"model.layers.{L}.{n[len('layers.0.'):]}"] = t.detach().contiguous()
    tensors[f"model.layers.{L}.shared_head.norm.weight"] = core.norm.weight.detach().contiguous()
    tensors[f"model.layers.{L}.enorm.weight"] = enorm.weight.detach().contiguous()
    tensors[f"model.layers.{L}.hnorm.weight"] = hnorm.weight.detach().contiguous()
    tensors[f"model.layers.{L}.eh_proj.weight"] = eh_proj.weight.detach().contiguous()
    for i in range(L + 1):  # the router's correction bias, zeros, where the state dict leaves the buffer out
        tensors.setdefault(f"model.layers.{i}.mlp.gate.e_score_correction_bias", torch.zeros(args.experts))
    save_file(tensors, str(out / "model.safetensors"))
    with torch.no_grad():  # the reference for the engine's check: the model's and the MTP layer's float32 logits
        x = torch.from_numpy(ids[:args.reference_tokens][None])
        logits = model(input_ids=x).logits[0]
        joined = eh_proj(torch.cat([enorm(model.model.embed_tokens(x[:, 1:])), hnorm(captured["h"][:, :-1])], -1))
        mtp_logits = model.lm_head(core(inputs_embeds=joined).last_hidden_state)[0]
    np.savez(out / "reference.npz", input_ids=x[0].numpy(), logits=logits.numpy(), mtp_logits=mtp_logits.numpy())
    doc = cfg.to_dict()
    doc["architectures"] = ["DeepseekV3ForCausalLM"]
    (out / "config.json").write_text(json.dumps(doc, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS_ID], "do_sample": False}))
    print(f"saved {out} after {time.time() - t0:.0f} s: main loss {main_loss.item():.4f}, mtp loss "
          f"{mtp_loss.item():.4f}", flush=True)
    return 0


def chained_loss(core, model, eh_proj, enorm, hnorm, joined, o, x, vocab):
    """The MTP layer's loss on the byte two after next when it is fed its own output, as the engine chains a second
    draft (vLLM's and llama.cpp's chaining of a model's one MTP layer): the chained row at position j + 1 joins
    the first pass's output o_j (before the head's norm) with t_(j+2) and predicts t_(j+3), attending to the
    first pass's rows 0..j and itself, as it does in the engine's MTP cache. One pass over both sets of rows
    [first rows 0..T-2 ; chained rows at positions 1..T-2], the mask drawn for that."""
    import torch

    B, n1, _ = joined.shape  # n1 = T - 1 first rows
    n2 = n1 - 1  # chained rows: j = 0..T-3 at positions j + 1
    joined2 = eh_proj(torch.cat([enorm(model.model.embed_tokens(x[:, 2:])), hnorm(o[:, :-1])], dim=-1))
    first_pos, chained_pos = torch.arange(n1), torch.arange(1, n1)
    allowed = torch.zeros(n1 + n2, n1 + n2, dtype=torch.bool)
    allowed[:n1, :n1] = first_pos[:, None] >= first_pos[None, :]  # the first pass: causal
    allowed[n1:, :n1] = chained_pos[:, None] > first_pos[None, :]  # a chained row: the first rows before it
    allowed[n1:, n1:] = torch.eye(n2, dtype=torch.bool)  # ... and itself
    mask = torch.zeros(n1 + n2, n1 + n2).masked_fill(~allowed, torch.finfo(torch.float32).min)
    out = core(inputs_embeds=torch.cat([joined, joined2], dim=1), attention_mask=mask[None, None].expand(B, 1, -1, -1),
               position_ids=torch.cat([first_pos, chained_pos])[None].expand(B, -1)).last_hidden_state
    logits = model.lm_head(out[:, n1:])  # [B, T-2, V]: row j predicts t_(j+3)
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), x[:, 3:].reshape(-1))


def gguf(args: argparse.Namespace) -> int:
    """llama.cpp's converter (pre-tokenizer named, see the docstring) to f32, then llama-quantize."""
    llama: Path = args.llama_cpp
    f32 = args.model / "f32.gguf"
    code = ("import sys; sys.argv = sys.argv[1:]; sys.path[:0] = [sys.argv[0].rsplit('/', 1)[0]]; "
            "import conversion.base as b; b.TextModel.get_vocab_base_pre = lambda self, tok: 'gpt-2'; "
            "import runpy; runpy.run_path(sys.argv[0], run_name='__main__')")
    env = dict(os.environ, PYTHONPATH=str(llama / "gguf-py"))
    subprocess.run([sys.executable, "-c", code, str(llama / "convert_hf_to_gguf.py"), str(args.model),
                    "--outtype", "f32", "--outfile", str(f32)], check=True, env=env)
    for qtype in [t for t in args.types.split(",") if t]:
        dst = args.model / f"{qtype.lower()}.gguf"
        r = subprocess.run([str(llama / "build" / "bin" / "llama-quantize"), str(f32), str(dst), qtype],
                           capture_output=True, text=True)
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-4:])
        print(f"{qtype}: {'ok ' + str(dst) if r.returncode == 0 else 'refused (rc ' + str(r.returncode) + ')'}\n"
              f"{tail}", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train and save the checkpoint")
    t.add_argument("--out", type=Path, default=Path("/tmp/trained-moe"))
    t.add_argument("--data", type=Path, default=Path(f"/usr/lib/python{sys.version_info[0]}.{sys.version_info[1]}"))
    t.add_argument("--project-python", type=Path, default=REPO / ".venv" / "bin" / "python")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--steps", type=int, default=800)
    t.add_argument("--batch", type=int, default=4)
    t.add_argument("--seq-len", type=int, default=512)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--warmup", type=int, default=50)
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--aux-coef", type=float, default=0.01, help="router load-balancing loss weight")
    t.add_argument("--hidden", type=int, default=256)
    t.add_argument("--layers", type=int, default=4)
    t.add_argument("--heads", type=int, default=4)
    t.add_argument("--kv-heads", type=int, default=2)
    t.add_argument("--experts", type=int, default=16)
    t.add_argument("--top-k", type=int, default=4)
    t.add_argument("--intermediate", type=int, default=256)
    t.add_argument("--held-every", type=int, default=20, help="hold out every Nth source file")
    t.add_argument("--eval-seqs", type=int, default=32)
    t.add_argument("--eval-every", type=int, default=250)
    t.add_argument("--log-every", type=int, default=25)
    t.add_argument("--threads", type=int, default=1)
    m = sub.add_parser("train-mtp", help="train a tiny DeepSeek-V3 with its MTP layer and save the checkpoint")
    m.add_argument("--out", type=Path, default=Path("/tmp/trained-mtp"))
    m.add_argument("--data", type=Path, default=Path(f"/usr/lib/python{sys.version_info[0]}.{sys.version_info[1]}"))
    m.add_argument("--project-python", type=Path, default=REPO / ".venv" / "bin" / "python")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--steps", type=int, default=600)
    m.add_argument("--batch", type=int, default=8)
    m.add_argument("--seq-len", type=int, default=256)
    m.add_argument("--lr", type=float, default=3e-3)
    m.add_argument("--warmup", type=int, default=30)
    m.add_argument("--mtp-weight", type=float, default=0.5, help="the MTP loss's weight beside the model's")
    m.add_argument("--chain-weight", type=float, default=0.0,
                   help="the weight of the MTP layer's loss when fed its own output (a second chained draft's)")
    m.add_argument("--hidden", type=int, default=128)
    m.add_argument("--layers", type=int, default=8)
    m.add_argument("--heads", type=int, default=4)
    m.add_argument("--experts", type=int, default=8)
    m.add_argument("--top-k", type=int, default=2)
    m.add_argument("--intermediate", type=int, default=128)
    m.add_argument("--held-every", type=int, default=20, help="hold out every Nth source file")
    m.add_argument("--log-every", type=int, default=25)
    m.add_argument("--threads", type=int, default=1)
    m.add_argument("--reference-tokens", type=int, default=64, help="bytes of reference.npz's logits")
    g = sub.add_parser("gguf", help="convert a trained checkpoint to GGUF files with llama.cpp")
    g.add_argument("--model", type=Path, default=Path("/tmp/trained-moe"))
    g.add_argument("--llama-cpp", type=Path, required=True, help="a llama.cpp source tree with build/bin")
    g.add_argument("--types", default="Q8_0,Q4_K_M,IQ4_XS")
    args = ap.parse_args()
    return {"train": train, "train-mtp": train_mtp, "gguf": gguf}[args.cmd](args)


if __name__ == "__main__":
    raise SystemExit(main())
