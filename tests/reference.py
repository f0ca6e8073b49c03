"""An independent float64 reference of the three decoders, from their published definitions.

Written for the tests only and on purpose naive: it reads tensors with the
`safetensors` package (not the engine's reader), reads config.json itself, and
loops over tokens, heads and experts the way the Hugging Face modelling code
defines them (Qwen3MoeForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM).
It shares no code with the engine.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file


def load_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update({k: v.astype(np.float64) for k, v in load_file(str(path)).items()})
    return tensors


def rmsnorm(x, w, eps):
    return w * (x / math.sqrt(float(np.mean(x * x)) + eps))


def silu(x):
    return x / (1.0 + np.exp(-x))


def swiglu(x, gate, up, down):
    return down @ (silu(gate @ x) * (up @ x))


def rope(vec, pos, theta, factor=1.0):
    """Rotate one head vector [d] (rotate_half convention: pairs (i, i + d/2))."""
    d = vec.shape[0]
    out = np.empty_like(vec)
    for i in range(d // 2):
        angle = (pos / factor) / theta ** (2 * i / d)
        c, s = math.cos(angle), math.sin(angle)
        a, b = vec[i], vec[i + d // 2]
        out[i] = a * c - b * s
        out[i + d // 2] = b * c + a * s
    return out


class Reference:
    def __init__(self, model_dir: Path):
        self.cfg = json.loads((Path(model_dir) / "config.json").read_text())
        self.t = load_tensors(model_dir)
        c = self.cfg
        self.arch = c["architectures"][0]
        self.H = c["hidden_size"]
        self.nh = c["num_attention_heads"]
        self.nkv = c.get("num_key_value_heads", self.nh)
        self.hd = c.get("head_dim") or self.H // self.nh
        self.eps = c["rms_norm_eps"]
        rp = c.get("rope_parameters") or {}
        self.theta = rp.get("rope_theta", c.get("rope_theta"))
        scaling = rp or c.get("rope_scaling") or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        self.factor = scaling["factor"] if kind == "linear" else 1.0
        self.L = c["num_hidden_layers"]

    def is_sparse(self, i):
        c = self.cfg
        if self.arch == "MixtralForCausalLM":
            return True
        return i not in (c.get("mlp_only_layers") or []) and (i + 1) % c.get("decoder_sparse_step", 1) == 0

    def moe(self, i, x):
        c, t = self.cfg, self.t
        if self.arch == "MixtralForCausalLM":
            p, E, names, norm = f"model.layers.{i}.block_sparse_moe", c["num_local_experts"], ("w1", "w3", "w2"), True
        else:
            p, E, names = f"model.layers.{i}.mlp", c["num_experts"], ("gate_proj", "up_proj", "down_proj")
            norm = c.get("norm_topk_prob", False)
        logits = t[f"{p}.gate.weight"] @ x
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        k = c["num_experts_per_tok"]
        top = sorted(range(E), key=lambda e: -probs[e])[:k]
        w = np.array([probs[e] for e in top])
        if norm:
            w = w / w.sum()
        out = np.zeros(self.H)
        for e, we in zip(top, w):
            g, u, d = (t[f"{p}.experts.{e}.{n}.weight"] for n in names)
            out += we * swiglu(x, g, u, d)
        if f"{p}.shared_expert.gate_proj.weight" in t:
            s = f"{p}.shared_expert"
            shared = swiglu(x, t[f"{s}.gate_proj.weight"], t[f"{s}.up_proj.weight"], t[f"{s}.down_proj.weight"])
            gate = 1.0 / (1.0 + math.exp(-float((t[f"{p}.shared_expert_gate.weight"] @ x)[0])))
            out += gate * shared
        return out

    def forward(self, ids: list[int]) -> np.ndarray:
        """logits [T, V] for the token ids, float64."""
        t = self.t
        hs = [t["model.embed_tokens.weight"][tok].copy() for tok in ids]
        T, g = len(ids), self.nh // self.nkv
        for i in range(self.L):
            p = f"model.layers.{i}"
            a = f"{p}.self_attn"
            qs, ks, vs = [], [], []
            for pos, h in enumerate(hs):
                x = rmsnorm(h, t[f"{p}.input_layernorm.weight"], self.eps)
                q, k, v = (t[f"{a}.{n}_proj.weight"] @ x for n in "qkv")
                for n, arr in (("q", q), ("k", k), ("v", v)):
                    if f"{a}.{n}_proj.bias" in t:
                        arr += t[f"{a}.{n}_proj.bias"]
                q, k, v = q.reshape(self.nh, self.hd), k.reshape(self.nkv, self.hd), v.reshape(self.nkv, self.hd)
                if f"{a}.q_norm.weight" in t:
                    q = np.stack([rmsnorm(qh, t[f"{a}.q_norm.weight"], self.eps) for qh in q])
                    k = np.stack([rmsnorm(kh, t[f"{a}.k_norm.weight"], self.eps) for kh in k])
                qs.append(np.stack([rope(qh, pos, self.theta, self.factor) for qh in q]))
                ks.append(np.stack([rope(kh, pos, self.theta, self.factor) for kh in k]))
                vs.append(v)
            new = []
            for pos in range(T):
                heads = []
                for head in range(self.nh):
                    kvh = head // g
                    scores = np.array([qs[pos][head] @ ks[j][kvh] / math.sqrt(self.hd) for j in range(pos + 1)])
                    w = np.exp(scores - scores.max())
                    w /= w.sum()
                    heads.append(sum(w[j] * vs[j][kvh] for j in range(pos + 1)))
                h = hs[pos] + t[f"{a}.o_proj.weight"] @ np.concatenate(heads)
                x = rmsnorm(h, t[f"{p}.post_attention_layernorm.weight"], self.eps)
                if self.is_sparse(i):
                    h = h + self.moe(i, x)
                else:
                    m = f"{p}.mlp"
                    h = h + swiglu(x, t[f"{m}.gate_proj.weight"], t[f"{m}.up_proj.weight"], t[f"{m}.down_proj.weight"])
                new.append(h)
            hs = new
        head = t.get("lm_head.weight", t["model.embed_tokens.weight"])
        return np.stack([head @ rmsnorm(h, t["model.norm.weight"], self.eps) for h in hs])
