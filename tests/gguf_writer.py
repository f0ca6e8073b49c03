"""Writing GGUF files in tests: a make-model checkpoint as llama.cpp's converter lays it out (gguf's own writer)."""

from __future__ import annotations

import json

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from shm.checkpoint import Checkpoint
from shm.gguf_file import GLOBAL_TENSORS, LAYER_TENSORS

HF_TO_GGUF = {**{hf: g for g, hf in GLOBAL_TENSORS.items()}, **{hf: g for g, hf in LAYER_TENSORS.items()}}


def add_tokenizer(w: gguf.GGUFWriter, tok, pre: str = "qwen2", model: str = "gpt2") -> None:
    """A `tokenizers` byte-level BPE tokenizer as llama.cpp's converter writes it (tokenizer.ggml.*)."""
    vocab = tok.get_vocab(with_added_tokens=True)  # {token: id}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    special = {a.content for a in tok.get_added_tokens_decoder().values() if a.special}
    merges = json.loads(tok.to_str())["model"]["merges"]
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])


def write_gguf(ckpt_dir, path, arch: str = "qwen3moe", drop: int = 0, experts: Q = Q.Q8_0,
               down: Q | None = None, tokenizer=None, pre: str = "qwen2") -> None:
    """The checkpoint as llama.cpp's converter writes it: stacked experts (``experts``, ``down`` for
    ffn_down_exps when given), everything else F32; ``tokenizer`` (a `tokenizers` Tokenizer) in the metadata."""
    cfg = json.loads((ckpt_dir / "config.json").read_text())
    ck = Checkpoint(ckpt_dir)
    w = gguf.GGUFWriter(str(path), arch)
    if tokenizer is not None:
        add_tokenizer(w, tokenizer, pre)
    for add, key in ((w.add_block_count, "num_hidden_layers"), (w.add_context_length, "max_position_embeddings"),
                     (w.add_embedding_length, "hidden_size"), (w.add_feed_forward_length, "intermediate_size"),
                     (w.add_expert_feed_forward_length, "moe_intermediate_size"),
                     (w.add_head_count, "num_attention_heads"), (w.add_head_count_kv, "num_key_value_heads"),
                     (w.add_key_length, "head_dim"), (w.add_value_length, "head_dim"),
                     (w.add_layer_norm_rms_eps, "rms_norm_eps"), (w.add_rope_freq_base, "rope_theta"),
                     (w.add_expert_count, "num_experts"), (w.add_expert_used_count, "num_experts_per_tok"),
                     (w.add_vocab_size, "vocab_size")):
        add(cfg[key])
    w.add_expert_weights_norm(bool(cfg.get("norm_topk_prob", False)))
    E = cfg["num_experts"]
    for i in range(cfg["num_hidden_layers"]):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            stacked = np.stack([ck.float32(f"model.layers.{i}.mlp.experts.{e}.{proj}.weight") for e in range(E)])
            name = f"blk.{i}.{HF_TO_GGUF[f'mlp.experts.{proj}']}"
            qtype = down if proj == "down_proj" and down is not None else experts
            if qtype == Q.F32:
                w.add_tensor(name, stacked)
            else:
                w.add_tensor(name, gguf.quants.quantize(stacked, qtype), raw_dtype=qtype)
    for name in ck.names():
        if ".experts." in name:
            continue
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers."):].split(".", 1)
            gname = f"blk.{i}.{HF_TO_GGUF[rest]}"
        else:
            gname = HF_TO_GGUF[name]
        w.add_tensor(gname, np.ascontiguousarray(ck.float32(name)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ck.close()
    if drop:
        data = path.read_bytes()
        path.write_bytes(data[:-drop])
