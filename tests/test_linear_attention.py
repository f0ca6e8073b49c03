"""Qwen3-Next's Gated DeltaNet (coordinator/model/linear_attention.py) against a float64 reference written here from
transformers' torch_recurrent_gated_delta_rule and causal_conv1d_update: the recurrent (decode) and chunked (prefill)
forms, a prompt cut into pieces as the scheduler's chunked prefill cuts it, and a state rewound to inside its last
step (speculative decoding's rejected drafts) equal to the state that never took those tokens."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.model import linear_attention as la
from coordinator.model.kv_cache import CacheLayout, KVCache
from coordinator.model.model_config import LinearAttnConfig
from coordinator.model.weights import LinearAttnWeights

LC = LinearAttnConfig(key_heads=2, value_heads=4, key_head_dim=16, value_head_dim=8, conv_kernel=4)
H = 32


def weights(seed: int = 0) -> LinearAttnWeights:
    rng = np.random.default_rng(seed)
    C, Hv, dv = LC.conv_dim, LC.value_heads, LC.value_head_dim

    def f(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    return LinearAttnWeights(qkv=f(C, H, scale=H ** -0.5), z=f(Hv * dv, H, scale=H ** -0.5),
                             ba=f(2 * Hv, H, scale=H ** -0.5),
                             conv=f(C, LC.conv_kernel, scale=0.5), a_neg=-np.exp(f(Hv)), dt_bias=f(Hv),
                             norm=1 + f(dv, scale=0.1), out=f(H, Hv * dv, scale=(Hv * dv) ** -0.5))


def reference(w: LinearAttnWeights, mixed, b, a, conv_state, state):
    """float64: the conv with its state, q/k L2-normalised, then the delta rule a token at a time."""
    mixed, b, a = (np.asarray(x, np.float64) for x in (mixed, b, a))
    Hk, Hv, dk, dv, K = LC.key_heads, LC.value_heads, LC.key_head_dim, LC.value_head_dim, LC.conv_kernel
    taps = w.conv.astype(np.float64)
    full = np.concatenate([conv_state.astype(np.float64), mixed])
    T = mixed.shape[0]
    y = np.stack([sum(full[t + j] * taps[:, j] for j in range(K)) for t in range(T)])
    y = y / (1 + np.exp(-y))
    q, k = y[:, :Hk * dk].reshape(T, Hk, dk), y[:, Hk * dk:2 * Hk * dk].reshape(T, Hk, dk)
    v = y[:, 2 * Hk * dk:].reshape(T, Hv, dv)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(dk)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    q, k = np.repeat(q, Hv // Hk, 1), np.repeat(k, Hv // Hk, 1)
    beta = 1 / (1 + np.exp(-b))
    g = w.a_neg.astype(np.float64) * np.log1p(np.exp(a + w.dt_bias))
    S = state.astype(np.float64).copy()
    out = np.zeros((T, Hv, dv))
    for t in range(T):
        for h in range(Hv):
            S[h] *= np.exp(g[t, h])
            delta = (v[t, h] - S[h].T @ k[t, h]) * beta[t, h]
            S[h] += np.outer(k[t, h], delta)
            out[t, h] = S[h].T @ q[t, h]
    return out, full[T:], S


def inputs(T: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((T, LC.conv_dim)).astype(np.float32),
            rng.standard_normal((T, LC.value_heads)).astype(np.float32),
            rng.standard_normal((T, LC.value_heads)).astype(np.float32))


def start_state(seed: int = 2):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((LC.conv_kernel - 1, LC.conv_dim)).astype(np.float32),
            (0.3 * rng.standard_normal((LC.value_heads, LC.key_head_dim, LC.value_head_dim))).astype(np.float32))


def rel(x, ref) -> float:
    return float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize("T", [1, 5, 64, 150])
def test_advance_matches_the_float64_recurrence(T):
    """From a non-zero state: T < 16 takes the recurrent form, T >= 16 the chunked one (150: two whole chunks and a
    padded third); output, conv state and recurrent state within float32 rounding of float64."""
    w, (mixed, b, a), (conv, state) = weights(), inputs(T), start_state()
    out, conv1, state1 = la.advance(w, LC, conv, state, mixed, b, a)
    ref_out, ref_conv, ref_state = reference(w, mixed, b, a, conv, state)
    assert rel(out, ref_out) < 2e-5
    assert np.array_equal(conv1, ref_conv.astype(np.float32))
    assert rel(state1, ref_state) < 2e-5


def test_chunked_and_recurrent_forms_agree_and_pieces_continue():
    """A 150-token prompt at once (chunked) equals the recurrent form token by token, and equals the prompt cut into
    pieces of 48, 70 and 32 (a chunked prefill continuing from the state each piece left)."""
    w, (mixed, b, a), (conv, state) = weights(), inputs(150), start_state()
    y, c = la.causal_conv(conv, mixed, w.conv)
    whole, _, s_whole = la.advance(w, LC, conv, state, mixed, b, a)
    Hk, dk = LC.key_heads, LC.key_head_dim
    q = la.l2norm(y[:, :Hk * dk].reshape(150, Hk, dk)) * np.float32(dk ** -0.5)
    k = la.l2norm(y[:, Hk * dk:2 * Hk * dk].reshape(150, Hk, dk))
    q, k = np.repeat(q, 2, 1), np.repeat(k, 2, 1)
    v = y[:, 2 * Hk * dk:].reshape(150, LC.value_heads, LC.value_head_dim)
    g = w.a_neg * la.softplus(a + w.dt_bias)
    rec, s_rec = la.delta_rule_recurrent(q, k, v, g, 1 / (1 + np.exp(-b)), state)
    assert rel(whole, rec) < 2e-5 and rel(s_whole, s_rec) < 2e-5
    parts, cs, ss = [], conv, state
    for lo, hi in ((0, 48), (48, 118), (118, 150)):
        o, cs, ss = la.advance(w, LC, cs, ss, mixed[lo:hi], b[lo:hi], a[lo:hi])
        parts.append(o)
    assert rel(np.concatenate(parts), whole) < 2e-5 and rel(ss, s_whole) < 2e-5


def test_a_rewound_state_is_the_state_that_never_took_the_rejected_tokens():
    """A cache whose last step took 6 tokens, truncated to keep 2 of them, holds bit for bit the state of a cache
    that took those 2; a truncation before the last step is refused, and one to the cache's length changes nothing."""
    w, (mixed, b, a) = weights(), inputs(40)
    cache, other = (KVCache(CacheLayout(2, 1, 4, attention_layers=(1,))) for _ in range(2))
    for c in (cache, other):
        c.states[0] = la.LinearState(LC)
        c.states[0].step(0, w, LC, mixed[:30], b[:30], a[:30])
        c.advance(30)
    cache.states[0].step(30, w, LC, mixed[30:36], b[30:36], a[30:36])
    cache.advance(6)
    other.states[0].step(30, w, LC, mixed[30:32], b[30:32], a[30:32])
    other.advance(2)
    cache.truncate(32)
    assert np.array_equal(cache.states[0].recurrent, other.states[0].recurrent)
    assert np.array_equal(cache.states[0].conv, other.states[0].conv)
    assert not np.array_equal(cache.states[0].recurrent, la.advance(w, LC, cache.states[0].conv,
                                                                    cache.states[0].recurrent, mixed[32:33],
                                                                    b[32:33], a[32:33])[2])
    kept = cache.states[0].recurrent
    cache.truncate(32)
    assert cache.states[0].recurrent is kept
    with pytest.raises(ValueError, match="last step"):
        cache.truncate(29)


def test_a_prompts_step_keeps_no_inputs_and_is_not_rewound_inside():
    """A step longer than REWINDABLE tokens (a prompt's) keeps no copy of its inputs: truncating to its end is a
    no-op and inside it is refused, while a short step after it rewinds to its start exactly."""
    w, (mixed, b, a) = weights(), inputs(la.REWINDABLE + 10)
    n = la.REWINDABLE + 5
    state = la.LinearState(LC)
    state.step(0, w, LC, mixed[:n], b[:n], a[:n])
    kept = state.recurrent
    state.rewind(n)
    assert state.recurrent is kept
    with pytest.raises(ValueError, match="last step"):
        state.rewind(n - 1)
    state.step(n, w, LC, mixed[n:n + 3], b[n:n + 3], a[n:n + 3])
    state.rewind(n)
    assert state.recurrent is kept


def test_state_layers_hold_no_keys_and_count_their_state():
    """A Gated DeltaNet layer has no key/value rows in the cache: bytes per token count the attention layers only,
    and the state's bytes are the conv's K-1 inputs and the recurrent state."""
    cache = KVCache(CacheLayout(4, 2, 16, attention_layers=(3,)))
    assert cache.bytes_per_token == 2 * 2 * 16 * 4
    cache.states[0] = la.LinearState(LC)
    assert cache.state_bytes == LC.state_floats * 4

