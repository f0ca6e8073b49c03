"""Qwen3-Next's Gated DeltaNet layer on the host (NumPy), and the per-sequence state it keeps.

A layer projects x into q, k, v (through a short causal depthwise conv and SiLU), an output gate z, beta =
sigmoid(b) and a decay g = -exp(A_log) * softplus(a + dt_bias) per value head. With q and k L2-normalised
(q also scaled by dk^-1/2) each head keeps a state S [dk, dv] and, token by token,

    S = exp(g) S;   S = S + k (beta (v - Sᵀk))ᵀ;   o = Sᵀ q

then o goes through an RMSNorm gated by silu(z) and the output projection (transformers'
Qwen3NextGatedDeltaNet). Decode takes that recurrence one token at a time; a prompt takes its chunked form
(transformers' torch_chunk_gated_delta_rule, 64 tokens a chunk): a few matrix products per chunk and a scan over
chunks, not a Python loop over tokens.

A sequence's state (LinearState) is the conv's last K - 1 inputs and S per head; it lives in the sequence's
KVCache beside the keys and values, which rewinds it with them (KVCache.truncate).

On a GPU the layer between its projections is one kernel (coordinator/gpu/linear_attention.py).
"""

from __future__ import annotations

import numpy as np

from . import ops
from .model_config import LinearAttnConfig
from .weights import LinearAttnWeights

CHUNK = 64  # tokens per chunk of the chunked form, transformers' chunk_size
RECURRENT_BELOW = 16  # steps of fewer tokens (decode, drafts being verified) take the token-by-token form
REWINDABLE = 64  # a step of at most this many tokens can be rewound (a decode step and its drafts: at most 17)


def causal_conv(conv_state: np.ndarray, x: np.ndarray, taps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """silu of the causal depthwise conv of x [T, C] after the K - 1 earlier inputs in conv_state [K-1, C], taps
    [C, K]; returns (y [T, C], the new conv state [K-1, C])."""
    K, T = taps.shape[1], x.shape[0]
    full = np.concatenate([conv_state, x])  # [K-1+T, C]
    y = full[:T] * taps[:, 0]
    for j in range(1, K):  # tap j reads the input K-1-j tokens back
        y += full[j:j + T] * taps[:, j]
    return ops.silu(y), full[T:]


def l2norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """x [..., d] / sqrt(sum(x²) + eps), as the FLA kernels (and transformers) normalise q and k."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(eps))


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + exp(x)), linear above 20 as torch's softplus."""
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20)))).astype(np.float32)


def delta_rule_recurrent(q, k, v, g, beta, state):
    """The gated delta rule a token at a time. q, k [T, Hv, dk] (normalised, q scaled); v [T, Hv, dv]; g, beta
    [T, Hv]; state [Hv, dk, dv]. Returns (o [T, Hv, dv], the state after the last token)."""
    out = np.empty_like(v)  # [T, Hv, dv]
    for t in range(q.shape[0]):
        state = state * np.exp(g[t])[:, None, None]
        kv_mem = (k[t][:, None, :] @ state)[:, 0]  # [Hv, dv]: Sᵀk
        delta = (v[t] - kv_mem) * beta[t][:, None]  # [Hv, dv]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = (q[t][:, None, :] @ state)[:, 0]
    return out, state


def delta_rule_chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The gated delta rule in chunks (the WY/UT form): within a chunk a unit lower-triangular solve and a few
    products, across chunks a scan of the state. Arguments and result as delta_rule_recurrent's."""
    T, H, dv = q.shape[0], q.shape[1], v.shape[-1]
    pad = (-T) % chunk  # padded tokens have k = v = beta = g = 0: they read nothing and write nothing
    n = (T + pad) // chunk

    def chunks(x):  # [T, H, ...] -> [H, n, chunk, ...]
        x = np.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return np.ascontiguousarray(np.moveaxis(x, 0, 1).reshape(H, n, chunk, *x.shape[2:]))

    q, k, v, g, beta = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]  # [H, n, c, dk], [H, n, c, dv]
    cum = np.cumsum(g, axis=-1)  # [H, n, c] log of the decay from the chunk's start to each token
    lower = np.tril(np.ones((chunk, chunk), bool))  # [c, c] token i sees token j <= i
    diff = cum[..., :, None] - cum[..., None, :]  # [H, n, c, c]
    decay = np.where(lower, np.exp(np.where(lower, diff, 0)), 0).astype(np.float32)  # exp only where j <= i
    system = (k_beta @ np.swapaxes(k, -1, -2)) * decay  # [H, n, c, c]: strictly below the diagonal is used
    intra = (q @ np.swapaxes(k, -1, -2)) * decay  # [H, n, c, c] within-chunk attention, diagonal included
    # forward substitution of (I + strictly_lower(system)) X = [v_beta | k_beta exp(cum)], a row at a time
    x = np.concatenate([v_beta, k_beta * np.exp(cum)[..., None]], axis=-1)  # [H, n, c, dv + dk]
    for i in range(1, chunk):
        x[..., i, :] -= (system[..., i:i + 1, :i] @ x[..., :i, :])[..., 0, :]
    new_values, k_cumdecay = x[..., :dv], x[..., dv:]  # [H, n, c, dv], [H, n, c, dk]
    q_decayed = q * np.exp(cum)[..., None]  # reads the state as of the chunk's start
    k_decayed = k * np.exp(cum[..., -1:] - cum)[..., None]  # writes decayed to the chunk's end
    chunk_decay = np.exp(cum[..., -1])  # [H, n]
    out = np.empty((H, n, chunk, dv), np.float32)
    for c in range(n):
        v_new = new_values[:, c] - k_cumdecay[:, c] @ state  # [H, chunk, dv]
        out[:, c] = q_decayed[:, c] @ state + intra[:, c] @ v_new
        state = state * chunk_decay[:, c, None, None] + np.swapaxes(k_decayed[:, c], -1, -2) @ v_new
    out = np.moveaxis(out.reshape(H, n * chunk, dv), 0, 1)[:T]  # [T, H, dv]
    return np.ascontiguousarray(out), state


def advance(w: LinearAttnWeights, lc: LinearAttnConfig, conv_state: np.ndarray, state: np.ndarray,
            mixed: np.ndarray, b: np.ndarray, a: np.ndarray, chunked: bool = True):
    """One sequence's T new tokens through the conv and the delta rule: mixed [T, C] (q, k, v before the conv),
    b, a [T, Hv]; returns (o [T, Hv, dv], new conv state [K-1, C], new state [Hv, dk, dv]). ``chunked``: a step of
    RECURRENT_BELOW tokens or more may take the chunked form (else a token at a time, whose bits do not depend
    on how a prompt is cut into steps)."""
    T, Hk, Hv, dk, dv = mixed.shape[0], lc.key_heads, lc.value_heads, lc.key_head_dim, lc.value_head_dim
    y, conv_state = causal_conv(conv_state, mixed, w.conv)  # [T, C]
    q = l2norm(y[:, :Hk * dk].reshape(T, Hk, dk)) * np.float32(dk ** -0.5)
    k = l2norm(y[:, Hk * dk:2 * Hk * dk].reshape(T, Hk, dk))
    v = y[:, 2 * Hk * dk:].reshape(T, Hv, dv)
    if Hv != Hk:  # each key head serves Hv / Hk consecutive value heads
        q, k = np.repeat(q, Hv // Hk, axis=1), np.repeat(k, Hv // Hk, axis=1)
    beta = ops.sigmoid(b)  # [T, Hv]
    g = w.a_neg * softplus(a + w.dt_bias)  # [T, Hv] log of the decay, <= 0
    rule = delta_rule_chunked if chunked and T >= RECURRENT_BELOW else delta_rule_recurrent
    out, state = rule(q, k, v, g, beta, state)
    return out, conv_state, state


class LinearState:
    """One sequence's state in one Gated DeltaNet layer, and what rewinding its last step needs: the state before
    that step (the arrays themselves: each step makes new ones) and, for a step of at most REWINDABLE tokens (a
    decode step with its drafts), a copy of its inputs. A longer step (a prompt's) keeps no inputs, so a prefill
    does not hold its whole projection per layer."""

    def __init__(self, lc: LinearAttnConfig, chunked: bool = True):
        self.chunked = chunked  # long steps may take the chunked form (advance)
        self.conv = np.zeros((lc.conv_kernel - 1, lc.conv_dim), np.float32)  # [K-1, C]
        self.recurrent = np.zeros((lc.value_heads, lc.key_head_dim, lc.value_head_dim), np.float32)
        self.start = self.end = 0  # cache positions of the last step's first token and the one after its last
        self._last = None  # (weights, config, conv before, recurrent before, mixed, b, a) of a rewindable step

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes

    def step(self, start: int, w: LinearAttnWeights, lc: LinearAttnConfig, mixed, b, a) -> np.ndarray:
        """Tokens start .. start + T - 1 (mixed [T, C], b, a [T, Hv]) through the layer; returns o [T, Hv, dv]."""
        T = mixed.shape[0]
        self.start, self.end = start, start + T
        self._last = (w, lc, self.conv, self.recurrent, mixed.copy(), b.copy(), a.copy()) if T <= REWINDABLE \
            else None
        out, self.conv, self.recurrent = advance(w, lc, self.conv, self.recurrent, mixed, b, a, self.chunked)
        return out

    def rewind(self, length: int) -> None:
        """The state after ``length`` tokens: recomputed from the last step's start when ``length`` falls inside
        it (rejected drafts); a position before the last step, or inside a prompt's step, cannot be restored."""
        if length == self.end:
            return
        if not self.start <= length < self.end or self._last is None:
            raise ValueError(f"a Gated DeltaNet state rewinds only within its last step of at most {REWINDABLE} "
                             f"tokens (here tokens {self.start} to {self.end}), not to {length}")
        w, lc, conv, recurrent, mixed, b, a = self._last
        keep = length - self.start
        self.conv, self.recurrent = conv, recurrent
        self.step(self.start, w, lc, mixed[:keep], b[:keep], a[:keep])


def layer(w: LinearAttnWeights, lc: LinearAttnConfig, x: np.ndarray, parts: list, eps: float) -> np.ndarray:
    """A Gated DeltaNet layer's output [N, H] for x [N, H]; ``parts``: per sequence (its rows, a slice of x; its
    LinearState; the cache position of its first row)."""
    if type(x) is not np.ndarray:
        raise TypeError("linear_attention.layer is the host's form: device arrays take device_layer")
    N, Hv, dv = x.shape[0], lc.value_heads, lc.value_head_dim
    mixed = x @ w.qkv.T  # [N, C]
    ba = x @ w.ba.T  # [N, 2 Hv]
    core = np.empty((N, Hv, dv), np.float32)
    for rows, state, start in parts:
        core[rows] = state.step(start, w, lc, mixed[rows], ba[rows, :Hv], ba[rows, Hv:])
    z = (x @ w.z.T).reshape(N, Hv, dv)
    gated = ops.rms_norm(core, w.norm, eps) * ops.silu(z)  # [N, Hv, dv]: norm per head, then the gate
    return gated.reshape(N, Hv * dv) @ w.out.T
