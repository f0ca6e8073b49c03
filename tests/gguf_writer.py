"""Writing GGUF files in tests: a make-model checkpoint as llama.cpp's converter lays it out (gguf's own writer)."""

from __future__ import annotations

import json

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from shm.checkpoint import Checkpoint
from shm.gguf_blocks import random_blocks
from coordinator.model.arch.gguf import GLOBAL_TENSORS, LAYER_TENSORS
from coordinator.model.arch.mixtral import GGUF_TENSORS as MIXTRAL_TENSORS

HF_TO_GGUF = {**{hf: g for g, hf in GLOBAL_TENSORS.items()}, **{hf: g for g, hf in LAYER_TENSORS.items()}}
MIXTRAL_TO_GGUF = {**{hf: g for g, hf in GLOBAL_TENSORS.items()}, **{hf: g for g, hf in MIXTRAL_TENSORS.items()}}


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


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


def blocks_of(t: np.ndarray, qtype: Q, seed: int) -> np.ndarray:
    """``t`` quantised to ``qtype`` by gguf.quants, or, for a type it cannot write (the K types), valid random
    blocks of the right size (small weights: the file is for speed and agreement between paths, not text)."""
    try:
        return gguf.quants.quantize(t, qtype)
    except NotImplementedError:
        values, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        shape = (*t.shape[:-1], t.shape[-1] // values * nbytes)
        return random_blocks(qtype, shape, np.random.default_rng(seed), scale=1e-4)


def write_gguf(ckpt_dir, path, arch: str = "qwen3moe", drop: int = 0, experts: Q = Q.Q8_0,
               down: Q | dict[int, Q] | None = None, tokenizer=None, pre: str = "qwen2",
               split_max_tensors: int = 0, dense: Q | None = None) -> None:
    """The checkpoint as llama.cpp's converter writes it: stacked experts (``experts``, ``down`` for
    ffn_down_exps when given: one type, or per layer as llama.cpp's Q4_K_M mixes Q4_K and Q6_K), everything
    else F32; ``tokenizer`` (a `tokenizers` Tokenizer) in the metadata; ``split_max_tensors``: a split set,
    path's stem + -0000k-of-0000N.gguf (gguf-split's naming); ``dense``: the 2-D dense matrices (attention,
    embedding, lm_head, shared experts) in this type, as llama.cpp's quantised files have them."""
    cfg = json.loads((ckpt_dir / "config.json").read_text())
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    mixtral = cfg["model_type"] == "mixtral"  # written as llama.cpp writes Mixtral: arch "llama", q and k permuted
    names = MIXTRAL_TO_GGUF if mixtral else HF_TO_GGUF
    ck = Checkpoint(ckpt_dir)
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    if tokenizer is not None:
        add_tokenizer(w, tokenizer, pre)
    keys = [(w.add_block_count, "num_hidden_layers"), (w.add_context_length, "max_position_embeddings"),
            (w.add_embedding_length, "hidden_size"), (w.add_feed_forward_length, "intermediate_size"),
            (w.add_head_count, "num_attention_heads"), (w.add_head_count_kv, "num_key_value_heads"),
            (w.add_key_length, "head_dim"), (w.add_value_length, "head_dim"),
            (w.add_layer_norm_rms_eps, "rms_norm_eps"), (w.add_rope_freq_base, "rope_theta"),
            (w.add_expert_used_count, "num_experts_per_tok"), (w.add_vocab_size, "vocab_size")]
    if mixtral:
        keys.append((w.add_expert_count, "num_local_experts"))
    else:
        keys += [(w.add_expert_count, "num_experts"), (w.add_expert_feed_forward_length, "moe_intermediate_size")]
        w.add_expert_weights_norm(bool(cfg.get("norm_topk_prob", False)))
    if "shared_expert_intermediate_size" in cfg:
        keys.append((w.add_expert_shared_feed_forward_length, "shared_expert_intermediate_size"))
    for add, key in keys:
        add(cfg[key])
    E = cfg["num_local_experts" if mixtral else "num_experts"]
    moe, projs = ("block_sparse_moe", ("w1", "w3", "w2")) if mixtral else ("mlp", ("gate_proj", "up_proj", "down_proj"))
    for i in range(cfg["num_hidden_layers"]):
        for proj, hf_proj in zip(projs, ("gate_proj", "up_proj", "down_proj")):
            stacked = np.stack([ck.float32(f"model.layers.{i}.{moe}.experts.{e}.{proj}.weight") for e in range(E)])
            name = f"blk.{i}.{names[f'{moe}.experts.{hf_proj}']}"
            qtype = experts
            if hf_proj == "down_proj" and down is not None:
                qtype = down.get(i, experts) if isinstance(down, dict) else down
            if qtype == Q.F32:
                w.add_tensor(name, stacked)
                continue
            w.add_tensor(name, blocks_of(stacked, qtype, i), raw_dtype=qtype)
    for name in ck.names():
        if ".experts." in name:
            continue
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers."):].split(".", 1)
            gname = f"blk.{i}.{names[rest]}"
        else:
            gname = names[name]
        t = ck.float32(name)
        if mixtral and gname.endswith((".attn_q.weight", ".attn_k.weight")):
            t = permute(t, cfg["num_attention_heads" if gname.endswith("q.weight") else "num_key_value_heads"])
        if dense is not None and t.ndim == 2 and ".gate.weight" not in name:  # the router stays F32, as llama.cpp's
            w.add_tensor(gname, blocks_of(np.ascontiguousarray(t), dense, len(gname)), raw_dtype=dense)
        else:
            w.add_tensor(gname, np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ck.close()
    if drop:
        data = path.read_bytes()
        path.write_bytes(data[:-drop])
