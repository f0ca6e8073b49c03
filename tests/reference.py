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


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


class MtpReference:
    """DeepSeek-V3's multi-token-prediction module (the paper's section 2.2; GLM-4.5's nextn layer is the same
    module around GLM's decoder layer), float64, one token at a time: row i joins the main model's hidden state
    h_i (after its final norm) with the embedding of token t_(i+1), h'_i = M [RMSNorm(Emb(t_(i+1))) ;
    RMSNorm(h_i)] (the embedding's norm first, as vLLM's deepseek_mtp.py concatenates them), runs one decoder
    layer over the rows 0..i (causal attention, RoPE at position i), then shared_head's norm and head: the
    logits of t_(i+2). Architectures: DeepseekV3ForCausalLM (MLA, the grouped sigmoid router) and
    Glm4MoeForCausalLM (GQA with partial rotary, q/k/v biases, the same router)."""

    def __init__(self, model_dir: Path):
        self.cfg = c = json.loads((Path(model_dir) / "config.json").read_text())
        self.t = load_tensors(model_dir)
        self.arch = c["architectures"][0]
        self.L = c["num_hidden_layers"]
        self.p = f"model.layers.{self.L}"
        self.H, self.nh, self.eps = c["hidden_size"], c["num_attention_heads"], c["rms_norm_eps"]
        rp = c.get("rope_parameters") or {}
        self.theta = rp.get("rope_theta", c.get("rope_theta", 10000.0))

    def logits(self, hidden: np.ndarray, next_ids: list[int], start: int = 0) -> np.ndarray:
        """hidden [T, H] (the main model's rows 0..T-1), next_ids [T] (t_1..t_T) -> logits [T, V] of t_2..t_(T+1);
        ``start``: the text position of row 0 (RoPE's), the rows before it not attended to."""
        t, p, eps = self.t, self.p, self.eps
        embed = t.get(f"{p}.embed_tokens.weight", t["model.embed_tokens.weight"])
        head = t.get(f"{p}.shared_head.head.weight", t.get("lm_head.weight", t["model.embed_tokens.weight"]))
        xs = [t[f"{p}.eh_proj.weight"] @ np.concatenate([rmsnorm(embed[tok], t[f"{p}.enorm.weight"], eps),
                                                          rmsnorm(h.astype(np.float64), t[f"{p}.hnorm.weight"], eps)])
              for h, tok in zip(hidden, next_ids)]
        normed = [rmsnorm(x, t[f"{p}.input_layernorm.weight"], eps) for x in xs]
        attend = self.mla if self.arch == "DeepseekV3ForCausalLM" else self.gqa
        out = []
        for x, a in zip(xs, attend(normed, start)):
            h = x + a
            h = h + self.moe(rmsnorm(h, t[f"{p}.post_attention_layernorm.weight"], eps))
            out.append(head @ rmsnorm(h, t[f"{p}.shared_head.norm.weight"], eps))
        return np.stack(out)

    def moe(self, x):
        """The grouped sigmoid router (noaux_tc), its experts and the shared experts."""
        c, t, m = self.cfg, self.t, f"{self.p}.mlp"
        E, k, G = c["n_routed_experts"], c["num_experts_per_tok"], c.get("n_group", 1)
        scores = sigmoid(t[f"{m}.gate.weight"] @ x)
        choice = scores + t[f"{m}.gate.e_score_correction_bias"]
        size = E // G
        group_scores = [sum(sorted(choice[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(G)]
        groups = sorted(range(G), key=lambda g: -group_scores[g])[:c.get("topk_group", 1)]
        chosen = sorted([e for e in range(E) if e // size in groups], key=lambda e: -choice[e])[:k]
        w = np.array([scores[e] for e in chosen])
        if c.get("norm_topk_prob", True):
            w = w / (w.sum() + 1e-20)
        w = w * c.get("routed_scaling_factor", 1.0)
        out = sum(we * swiglu(x, *(t[f"{m}.experts.{e}.{n}_proj.weight"] for n in ("gate", "up", "down")))
                  for e, we in zip(chosen, w))
        s = f"{m}.shared_experts"
        return out + swiglu(x, t[f"{s}.gate_proj.weight"], t[f"{s}.up_proj.weight"], t[f"{s}.down_proj.weight"])

    def _rotate(self, vec, pos, interleaved):
        """RoPE on vec [d] at text position pos: pairs (2i, 2i + 1) when interleaved (DeepSeek's rope_interleave),
        else (i, i + d/2)."""
        d = vec.shape[0]
        out = np.empty_like(vec)
        for i in range(d // 2):
            angle = pos / self.theta ** (2 * i / d)
            c, s = math.cos(angle), math.sin(angle)
            lo, hi = (2 * i, 2 * i + 1) if interleaved else (i, i + d // 2)
            out[lo] = vec[lo] * c - vec[hi] * s
            out[hi] = vec[hi] * c + vec[lo] * s
        return out

    def mla(self, xs, start: int = 0):
        """DeepseekV3Attention over the rows xs (causal) at text positions start.., no YaRN."""
        c, t, a = self.cfg, self.t, f"{self.p}.self_attn"
        nh, dn, dr, dv, r = self.nh, c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
        inter = c.get("rope_interleave", True)
        qs, ks, vs = [], [], []
        for pos, x in enumerate(xs, start):
            if c.get("q_lora_rank"):
                q = t[f"{a}.q_b_proj.weight"] @ rmsnorm(t[f"{a}.q_a_proj.weight"] @ x,
                                                         t[f"{a}.q_a_layernorm.weight"], self.eps)
            else:
                q = t[f"{a}.q_proj.weight"] @ x
            q = q.reshape(nh, dn + dr)
            ckv = t[f"{a}.kv_a_proj_with_mqa.weight"] @ x
            kv = (t[f"{a}.kv_b_proj.weight"] @ rmsnorm(ckv[:r], t[f"{a}.kv_a_layernorm.weight"], self.eps)).reshape(
                nh, dn + dv)
            k_rope = self._rotate(ckv[r:], pos, inter)
            qs.append([np.concatenate([qh[:dn], self._rotate(qh[dn:], pos, inter)]) for qh in q])
            ks.append([np.concatenate([kv[h, :dn], k_rope]) for h in range(nh)])
            vs.append([kv[h, dn:] for h in range(nh)])
        return self._attend(qs, ks, vs, (dn + dr) ** -0.5, t[f"{a}.o_proj.weight"])

    def gqa(self, xs, start: int = 0):
        """Glm4MoeAttention over the rows xs (causal) at text positions start..: q/k/v biases, optional per-head
        q/k norm, partial rotary."""
        c, t, a = self.cfg, self.t, f"{self.p}.self_attn"
        nkv, hd = c["num_key_value_heads"], c.get("head_dim") or self.H // self.nh
        rp = c.get("rope_parameters") or {}
        rot = int(hd * rp.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.5)))
        qs, ks, vs = [], [], []
        for pos, x in enumerate(xs, start):
            q, k, v = ((t[f"{a}.{n}_proj.weight"] @ x + t.get(f"{a}.{n}_proj.bias", 0.0)) for n in "qkv")
            q, k, v = q.reshape(self.nh, hd), k.reshape(nkv, hd), v.reshape(nkv, hd)
            if f"{a}.q_norm.weight" in t:
                q = np.stack([rmsnorm(h, t[f"{a}.q_norm.weight"], self.eps) for h in q])
                k = np.stack([rmsnorm(h, t[f"{a}.k_norm.weight"], self.eps) for h in k])
            part = lambda h: np.concatenate([self._rotate(h[:rot], pos, False), h[rot:]])  # noqa: E731
            g = self.nh // nkv
            qs.append([part(h) for h in q])
            ks.append([part(k[h // g]) for h in range(self.nh)])
            vs.append([v[h // g] for h in range(self.nh)])
        return self._attend(qs, ks, vs, hd ** -0.5, t[f"{a}.o_proj.weight"])

    def _attend(self, qs, ks, vs, scale, o):
        out = []
        for pos in range(len(qs)):
            heads = []
            for h in range(self.nh):
                scores = np.array([qs[pos][h] @ ks[j][h] * scale for j in range(pos + 1)])
                w = np.exp(scores - scores.max())
                w /= w.sum()
                heads.append(sum(w[j] * vs[j][h] for j in range(pos + 1)))
            out.append(o @ np.concatenate(heads))
        return out


class Qwen3NextMtpReference(MtpReference):
    """Qwen3-Next's multi-token-prediction layer (Qwen3NextMultiTokenPredictor as vLLM runs a checkpoint's mtp.*
    tensors; transformers' Qwen3NextForCausalLM leaves them out), float64, one token at a time: row i joins a hidden
    state h_i with the embedding of token t_(i+1), x_i = fc [pre_fc_norm_embedding(Emb(t_(i+1))) ;
    pre_fc_norm_hidden(h_i)], runs one full-attention decoder layer (mtp.layers.0: gated attention with q/k norms and
    partial rotary, the softmax top-k router, the sigmoid-gated shared expert) over the rows 0..i, then mtp.norm and
    the model's lm_head: the logits of t_(i+2). Every RMSNorm here is zero-centred: it multiplies by 1 + weight."""

    def __init__(self, model_dir: Path):
        super().__init__(model_dir)
        self.p = "mtp.layers.0"

    def norm(self, x, name):
        return rmsnorm(x, 1.0 + self.t[name], self.eps)

    def logits(self, hidden: np.ndarray, next_ids: list[int]) -> np.ndarray:
        """hidden [T, H] (the rows the layer is given), next_ids [T] (t_1..t_T) -> logits [T, V] of t_2..t_(T+1)."""
        t, p = self.t, self.p
        xs = [t["mtp.fc.weight"] @ np.concatenate([self.norm(t["model.embed_tokens.weight"][tok],
                                                             "mtp.pre_fc_norm_embedding.weight"),
                                                   self.norm(h.astype(np.float64), "mtp.pre_fc_norm_hidden.weight")])
              for h, tok in zip(hidden, next_ids)]
        attended = self.gated_attention([self.norm(x, f"{p}.input_layernorm.weight") for x in xs])
        out = []
        for x, a in zip(xs, attended):
            h = x + a
            h = h + self.moe(self.norm(h, f"{p}.post_attention_layernorm.weight"))
            out.append(t["lm_head.weight"] @ self.norm(h, "mtp.norm.weight"))
        return np.stack(out)

    def moe(self, x):
        """Softmax over every expert, the top k (renormalised with norm_topk_prob), and the shared expert times
        sigmoid(shared_expert_gate . x)."""
        c, t, m = self.cfg, self.t, f"{self.p}.mlp"
        logits = t[f"{m}.gate.weight"] @ x
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        chosen = sorted(range(c["num_experts"]), key=lambda e: -probs[e])[:c["num_experts_per_tok"]]
        w = np.array([probs[e] for e in chosen])
        if c.get("norm_topk_prob", True):
            w = w / w.sum()
        out = sum(we * swiglu(x, *(t[f"{m}.experts.{e}.{n}_proj.weight"] for n in ("gate", "up", "down")))
                  for e, we in zip(chosen, w))
        s = f"{m}.shared_expert"
        shared = swiglu(x, t[f"{s}.gate_proj.weight"], t[f"{s}.up_proj.weight"], t[f"{s}.down_proj.weight"])
        return out + sigmoid(float(t[f"{m}.shared_expert_gate.weight"][0] @ x)) * shared

    def gated_attention(self, xs):
        """Qwen3NextAttention over the rows xs (causal): q_proj gives per head hd query rows then hd gate rows, q
        and k normed per head, the first partial_rotary_factor of each head rotated, the heads' output times
        sigmoid(gate) before o_proj."""
        c, t, a = self.cfg, self.t, f"{self.p}.self_attn"
        nkv, hd = c["num_key_value_heads"], c["head_dim"]
        rp = c.get("rope_parameters") or {}
        rot = int(hd * rp.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25)))
        qs, ks, vs, gates = [], [], [], []
        for pos, x in enumerate(xs):
            qg = (t[f"{a}.q_proj.weight"] @ x).reshape(self.nh, 2, hd)
            k, v = (t[f"{a}.k_proj.weight"] @ x).reshape(nkv, hd), (t[f"{a}.v_proj.weight"] @ x).reshape(nkv, hd)
            q = [self.norm(h, f"{a}.q_norm.weight") for h in qg[:, 0]]
            k = [self.norm(h, f"{a}.k_norm.weight") for h in k]
            part = lambda h: np.concatenate([self._rotate(h[:rot], pos, False), h[rot:]])  # noqa: E731
            g = self.nh // nkv
            qs.append([part(h) for h in q])
            ks.append([part(k[h // g]) for h in range(self.nh)])
            vs.append([v[h // g] for h in range(self.nh)])
            gates.append(sigmoid(qg[:, 1].reshape(-1)))
        eye = np.eye(self.nh * hd)
        heads = self._attend(qs, ks, vs, hd ** -0.5, eye)  # the heads' outputs concatenated, before o_proj
        return [t[f"{a}.o_proj.weight"] @ (h * gate) for h, gate in zip(heads, gates)]
