"""Compiled host versions of ops.py's per-row reductions, for a CPU (NumPy) device side.

At decode a row is one token: rms_norm's NumPy form is five calls of about 10 µs
each for a few hundred multiplies, and the routers' a softmax, a stable argsort
and a gather, so the calls cost more than the arithmetic. Here each is one compiled loop over the rows;
the results equal ops.py's to float32 rounding (tests/test_ops.py), ties in
the top-k going to the lower expert id as there. The routers' loop (top_k) is the device
router's twin, bit for bit (coordinator/gpu/router.py).

    rms_norm(x [N, D], weight [D], eps, out [N, D])          float32, C-contiguous
    add_rms_norm(h, delta [N, D], weight, eps, total, out)   total = h + delta, out its rms_norm: one call
    norm_rope(x [T, heads, hd], weight [hd], eps, cos, sin, out)  each head rms-normed, then rope: one call
    top_k(logits [T, E], bias [E] | NO_BIAS, k, n_group, topk_group, softmax, normalize, scaling,
          ids [T, k], weights [T, k])                        every router: softmax top-k, grouped
    rope(x [T, heads, hd], cos [T, d], sin [T, d], out)       d <= hd; the rest copied
    linear_rows(x [T, K], wt [K, N], out [T, N])             x · wt, each (row, column) summed over k in order
    linear_rows_parallel(the same)                           the rows over the threads
    gqa_attention(q [T, nh, hd], k, v [S, nkv, hd], mask [T, S], scale, out [T, nh*hd])
    gqa_attention_parallel(the same)                         the (token, KV head) pairs over the threads
    attention_block(...)                                     a decode token's attention half, its matrices'
                                                             one-row loops among these (host/blocks.py)
    moe_block(...)                                           its MoE half on an in-process node: the node's
                                                             layer kernel, the add and the next norm (blocks.py)

At decode gqa_attention's NumPy form is several calls (a broadcast batched matmul, a masked
softmax, another matmul, transposes); here the heads that share a KV
head read each key and value row once, one loop for all of them, and the
softmax's e^x is silu.exp (float32 operations LLVM vectorises; libm's expf is a
call per value).

A sum is never taken in a loop that also stores (the softmax's total is added
up after e^x is written): LLVM vectorises such a loop behind a run-time check
that the stored and the loaded arrays do not overlap, with the scalar loop as
the fallback, and the two add in different orders, so the function loaded from
numba's disk cache could give other last bits than the same function compiled
in the process. A loop that only adds has no such check (tests/test_ops.py
runs on a warm cache to check it).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from node_worker.kernels import dense
from node_worker.kernels.common import JIT
from node_worker.kernels.layer import layer_moe, sample_args
from node_worker.kernels.silu import exp
from shm.jit import CACHED


def rows(*arrays) -> bool:
    """NumPy float32 C-contiguous arrays: the compiled loops take them."""
    for a in arrays:  # a loop, not all() over a generator: a decode step asks this some hundred times
        if type(a) is not np.ndarray or a.dtype != np.float32 or not a.flags.c_contiguous:
            return False
    return True


# The norms' and RoPE's row loops take no fastmath: LLVM keeps every operation as written (the sum's order, no
# multiply fused into an add), so a row's bits are the same wherever the loop is compiled, called alone or inside
# the attention block (attention_block), whose nested calls LLVM inlines and, under fastmath, may vectorise
# another way. Called, not inlined at numba's level: inlined they would take their caller's fastmath.
EXACT = CACHED
LANES = 8  # partial sums of a sum in a fixed order (_rms_row's, _dot_columns', _softmax_seen's total)


@njit(**EXACT)
def _rms_row(x, weight, eps, out) -> None:
    """out [D] = x [D] / sqrt(mean(x^2) + eps) * weight: the squares summed in float64 over LANES partial sums in
    a fixed order, then the scaling."""
    D = x.shape[0]
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
    d = 0
    while d + LANES <= D:
        s0 += np.float64(x[d]) * x[d]
        s1 += np.float64(x[d + 1]) * x[d + 1]
        s2 += np.float64(x[d + 2]) * x[d + 2]
        s3 += np.float64(x[d + 3]) * x[d + 3]
        s4 += np.float64(x[d + 4]) * x[d + 4]
        s5 += np.float64(x[d + 5]) * x[d + 5]
        s6 += np.float64(x[d + 6]) * x[d + 6]
        s7 += np.float64(x[d + 7]) * x[d + 7]
        d += LANES
    s = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
    while d < D:
        s += np.float64(x[d]) * x[d]
        d += 1
    r = np.float32(np.sqrt(np.float32(s / D) + eps))
    for d in range(D):
        out[d] = (x[d] / r) * weight[d]


@njit(**JIT)
def rms_norm(x, weight, eps, out) -> None:
    for n in range(x.shape[0]):
        _rms_row(x[n], weight, eps, out[n])


@njit(**JIT)
def add_rms_norm(h, delta, weight, eps, total, out) -> None:
    """total = h + delta, out = rms_norm(total): one call where a decode step made two (the add's ufunc and the
    loop), each a few microseconds of dispatch on caches the layer's weights have just streamed through."""
    N, D = h.shape
    for n in range(N):
        for d in range(D):
            total[n, d] = h[n, d] + delta[n, d]
        _rms_row(total[n], weight, eps, out[n])


@njit(**EXACT)
def _rope_row(x, cos, sin, out) -> None:
    """One head [hd] rotated by cos, sin [d] (d <= hd; the rest copied)."""
    hd = x.shape[0]
    d = cos.shape[0]
    half = d // 2
    for j in range(half):
        out[j] = x[j] * cos[j] - x[j + half] * sin[j]
    for j in range(half, d):
        out[j] = x[j] * cos[j] + x[j - half] * sin[j]
    for j in range(d, hd):
        out[j] = x[j]


@njit(**JIT)
def norm_rope(x, weight, eps, cos, sin, out) -> None:
    """Each head of x [T, heads, hd] rms-normed by weight [hd] (qk-norm), then rotated: one call for rms_norm and
    rope's two."""
    T, heads, hd = x.shape
    normed = np.empty(hd, np.float32)
    for t in range(T):
        for h in range(heads):
            _rms_row(x[t, h], weight, eps, normed)
            _rope_row(normed, cos[t], sin[t], out[t, h])


# The router's loop is EXACT too: its float32 operations are coordinator/gpu/router.py's kernel's one for one, and
# so are its results' bits.
NO_BIAS = np.empty(0, np.float32)  # top_k's bias where the router has none


def top_k_fits(E: int, spec) -> bool:
    """Whether top_k takes a router of E experts with the rule ``spec`` (model/ops.RouterSpec): whole groups, and
    k within the kept groups' experts."""
    return E % spec.n_group == 0 and 1 <= spec.topk_group <= spec.n_group and 1 <= spec.k <= spec.topk_group * (
        E // spec.n_group)
# model/ops.py's ROUTER_NORM_EPS, written here: this file's compiled code depends on no file outside the build key
NORM_EPS = np.float32(1e-20)


@njit(inline="always", **EXACT)
def _scores(row, bias, softmax, score, choice) -> None:
    """score [E]: softmax(row) or sigmoid(row); choice [E]: what the choice ranks, row itself (softmax keeps
    its order) or sigmoid + bias."""
    E = row.shape[0]
    if softmax:
        m = row[0]
        for e in range(1, E):
            m = max(m, row[e])
        for e in range(E):
            score[e] = exp(row[e] - m)
            choice[e] = row[e]
        total = np.float32(0.0)
        for e in range(E):  # in expert order, as the device's one thread adds them
            total += score[e]
        for e in range(E):
            score[e] = score[e] / total
    else:
        for e in range(E):
            score[e] = np.float32(1.0) / (np.float32(1.0) + exp(-row[e]))
            choice[e] = score[e] + bias[e] if bias.shape[0] else score[e]


@njit(inline="always", **EXACT)
def _keep_groups(choice, softmax, topk_group, group, kept, left) -> None:
    """left [E]: True on the experts of the topk_group groups of the best scores (ties to the lower group), a
    group scored by its best choice (softmax) or its best two summed; group [G] and kept [G] are scratch."""
    n_group = group.shape[0]
    size = choice.shape[0] // n_group
    for g in range(n_group):
        b1 = b2 = np.float32(-np.inf)
        for e in range(g * size, (g + 1) * size):
            v = choice[e]
            if v > b1:
                b2 = b1
                b1 = v
            elif v > b2:
                b2 = v
        group[g] = b1 if softmax or size < 2 else b1 + b2
    kept[:] = False
    for _ in range(topk_group):
        best = -1
        for g in range(n_group):
            if not kept[g] and (best < 0 or group[g] > group[best]):
                best = g
        kept[best] = True
    for g in range(n_group):
        left[g * size:(g + 1) * size] = kept[g]


@njit(**EXACT)
def top_k(logits, bias, k, n_group, topk_group, softmax, normalize, scaling, ids, weights) -> None:
    """Every router (coordinator/gpu/router.py's docstring): per row the scores, the groups kept where
    topk_group < n_group, the k best choices among their experts (ties to the lower id), their scores divided by
    their sum + 1e-20 (normalize), times scaling. bias: NO_BIAS where there is none."""
    T, E = logits.shape
    score = np.empty(E, np.float32)  # [E] the weights' values
    choice = np.empty(E, np.float32)  # [E] what the choice ranks
    left = np.empty(E, np.bool_)  # [E] True where the expert may still be chosen
    group = np.empty(n_group, np.float32)
    kept = np.empty(n_group, np.bool_)
    for t in range(T):
        _scores(logits[t], bias, softmax, score, choice)
        if topk_group < n_group:
            _keep_groups(choice, softmax, topk_group, group, kept, left)
        else:
            left[:] = True
        total = np.float32(0.0)
        for j in range(k):
            best = -1
            for e in range(E):  # the largest choice left; the lower id on a tie
                if left[e] and (best < 0 or choice[e] > choice[best]):
                    best = e
            left[best] = False
            ids[t, j] = best
            weights[t, j] = score[best]
            total += score[best]
        for j in range(k):
            w = weights[t, j] / (total + NORM_EPS) if normalize else weights[t, j]
            weights[t, j] = w * scaling


ROW_BLOCK = 4  # rows of x a step of _times_columns takes, each row of wt read once for them


@njit(inline="always", **EXACT)
def _times_columns(x, wt, out, t0, t1) -> None:
    """out[t, n] = sum over k of x[t, k] wt[k, n], k in order, for t0 <= t < t1 and every n: each step a row of wt
    scaled and added along n, which LLVM vectorises with no fastmath (no sum is reassociated), so every (t, n) is
    the same operations, hence bits, whatever rows share its block, serial or parallel."""
    K, N = wt.shape
    for t in range(t0, t1):
        for n in range(N):
            out[t, n] = np.float32(0.0)
    for k in range(K):
        for t in range(t0, t1):
            a = x[t, k]
            for n in range(N):
                out[t, n] += a * wt[k, n]


@njit(inline="always", **EXACT)
def _dot_columns(x, wt, out, t) -> None:
    """out[t, n] for a wt of fewer than LANES columns (the shared expert's one-row gate), where the steps along n
    are too short to vectorise: each a dot product over k in LANES partial sums added in a fixed order."""
    K, N = wt.shape
    for n in range(N):
        s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = np.float32(0.0)
        k = 0
        while k + LANES <= K:
            s0 += x[t, k] * wt[k, n]
            s1 += x[t, k + 1] * wt[k + 1, n]
            s2 += x[t, k + 2] * wt[k + 2, n]
            s3 += x[t, k + 3] * wt[k + 3, n]
            s4 += x[t, k + 4] * wt[k + 4, n]
            s5 += x[t, k + 5] * wt[k + 5, n]
            s6 += x[t, k + 6] * wt[k + 6, n]
            s7 += x[t, k + 7] * wt[k + 7, n]
            k += LANES
        total = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
        while k < K:
            total += x[t, k] * wt[k, n]
            k += 1
        out[t, n] = total


@njit(inline="always", **EXACT)
def _linear_block(x, wt, out, b) -> None:
    """Block b of ROW_BLOCK rows of linear_rows: the form chosen by wt's width alone, so a row's bits never depend
    on T."""
    t0 = b * ROW_BLOCK
    t1 = min(t0 + ROW_BLOCK, x.shape[0])
    if wt.shape[1] < LANES:
        for t in range(t0, t1):
            _dot_columns(x, wt, out, t)
    else:
        _times_columns(x, wt, out, t0, t1)


@njit(**EXACT)
def linear_rows(x, wt, out) -> None:
    """out [T, N] = x [T, K] · wt [K, N] (float32; wt the matrix transposed), every (row, column) summed in an
    order fixed by K and N (_linear_block): the same bits for a row of x whatever rows are beside it (BLAS picks
    its kernels and blocking by the row count)."""
    for b in range((x.shape[0] + ROW_BLOCK - 1) // ROW_BLOCK):
        _linear_block(x, wt, out, b)


@njit(parallel=True, **EXACT)
def linear_rows_parallel(x, wt, out) -> None:
    """linear_rows with the blocks of rows over the threads: a prompt's, a batch's."""
    for b in prange((x.shape[0] + ROW_BLOCK - 1) // ROW_BLOCK):
        _linear_block(x, wt, out, b)


@njit(**JIT)
def rope(x, cos, sin, out) -> None:
    T, heads, hd = x.shape
    for t in range(T):
        for h in range(heads):
            _rope_row(x[t, h], cos[t], sin[t], out[t, h])


@njit(inline="always", **JIT)
def _seen(mask, t):
    """[lo, hi): the keys from token t's first seen one to its last (causal and windowed masks: all of them)."""
    S = mask.shape[1]
    lo = 0
    while lo < S and not mask[t, lo]:
        lo += 1
    hi = S
    while hi > lo and not mask[t, hi - 1]:
        hi -= 1
    return lo, hi


@njit(**EXACT)
def _softmax_seen(row, seen, lo, hi) -> None:
    """row[lo:hi] <- the softmax of the seen scores (0 where unseen), in float32 operations as written: no
    fastmath, so its vector and scalar forms give the same bits wherever LLVM splits the loops, and the sum
    takes LANES partial sums in a fixed order whatever the length: a token's weights are the
    same bits alone and in a longer chunk, compiled in the process or loaded from the cache, serial or parallel.
    Called, not inlined: inlined it would take its caller's fastmath."""
    m = row[lo]
    for j in range(lo + 1, hi):
        m = max(m, row[j])
    for j in range(lo, hi):  # silu.exp: float32 operations that LLVM vectorises, where libm's is a call
        row[j] = exp(row[j] - m) if seen[j] else np.float32(0.0)
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = np.float32(0.0)
    j = lo
    while j + LANES <= hi:
        s0 += row[j]
        s1 += row[j + 1]
        s2 += row[j + 2]
        s3 += row[j + 3]
        s4 += row[j + 4]
        s5 += row[j + 5]
        s6 += row[j + 6]
        s7 += row[j + 7]
        j += LANES
    total = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
    while j < hi:
        total += row[j]
        j += 1
    for j in range(lo, hi):
        row[j] /= total


@njit(inline="always", **JIT)
def _kv_group(q, k, v, mask, scale, out, t, kh, scores, acc) -> None:
    """Token t's heads that share KV head kh: scores [g, S] and acc [g, hd] are scratch. Every loop runs over the
    keys token t sees alone (_seen), never over the keys a longer prompt adds past it: LLVM splits a loop into
    vectors and a remainder by its length, so the softmax's sum would otherwise add in another order when the
    same token comes in a longer chunk (issue 62)."""
    g = scores.shape[0]
    hd = acc.shape[1]
    lo, hi = _seen(mask, t)
    for j in range(lo, hi):
        seen = mask[t, j]
        for a in range(g):
            s = np.float32(-np.inf)
            if seen:
                s = np.float32(0.0)
                for d in range(hd):
                    s += q[t, kh * g + a, d] * k[j, kh, d]
                s *= scale
            scores[a, j] = s
    for a in range(g):
        acc[a, :] = 0.0
        if hi > lo:  # else no key seen: nothing to weigh
            _softmax_seen(scores[a], mask[t], lo, hi)
    for j in range(lo, hi):
        if mask[t, j]:  # a masked key's weight is 0: its products are skipped (half of a causal prompt's)
            for a in range(g):
                p = scores[a, j]
                for d in range(hd):
                    acc[a, d] += p * v[j, kh, d]
    for a in range(g):
        for d in range(hd):
            out[t, (kh * g + a) * hd + d] = acc[a, d]


@njit(**JIT)
def gqa_attention(q, k, v, mask, scale, out) -> None:
    T, nh, hd = q.shape
    nkv = k.shape[1]
    scores = np.empty((nh // nkv, k.shape[0]), np.float32)  # [g, S] the group's heads over the keys
    acc = np.empty((nh // nkv, hd), np.float32)
    for t in range(T):
        for kh in range(nkv):
            _kv_group(q, k, v, mask, scale, out, t, kh, scores, acc)


@njit(inline="always", **JIT)
def zigzag(i, T) -> int:
    """The i-th token of the order 0, T - 1, 1, T - 2, ...: prange hands each thread one run of consecutive
    iterations, and a causal prompt's later tokens see more keys; in this order every run holds early and
    late tokens alike."""
    return i // 2 if i % 2 == 0 else T - 1 - i // 2


@njit(parallel=True, **JIT)
def gqa_attention_parallel(q, k, v, mask, scale, out) -> None:
    """gqa_attention with the (token, KV head) pairs shared among the threads (tokens in zigzag order): long
    contexts, and prompts. The zigzag order balances the threads' runs of a causal prompt, and the masked
    keys' zero-weight products are skipped."""
    T, nh, hd = q.shape
    nkv = k.shape[1]
    for i in prange(T * nkv):
        scores = np.empty((nh // nkv, k.shape[0]), np.float32)
        acc = np.empty((nh // nkv, hd), np.float32)
        _kv_group(q, k, v, mask, scale, out, zigzag(i // nkv, T), i % nkv, scores, acc)


@njit(**JIT)
def _norm_rope_or_rope(x, weight, eps, cos, sin, out) -> None:
    """The backend's norm_rope: qk-norm then RoPE, or RoPE alone where the layer has no norm (weight empty)."""
    if weight.shape[0]:
        norm_rope(x, weight, eps, cos, sin, out)
    else:
        rope(x, cos, sin, out)


@njit(**JIT)
def attention_block(kq, kk, kv, ko, qm, km, vm, om, h, a, q_norm, k_norm, eps, cos, sin, keys, values, mask,
                    scale, parallel, post_norm, bufs, h_out, m_out, router) -> None:
    """A decode token's attention half of a layer (coordinator/host/blocks.py): h_out = h + attention(a), m_out its
    post-attention norm, the token's key and value written in the cache's last row (keys, values [S, nkv, hd]),
    and where the layer routes, the router's choice for m_out. kq..ko: the q, k, v and o matrices' one-row loop
    kinds (dense.ONE_ROW_LOOPS, literals), qm..om their arguments; router: (routes, wt [H, E], in parallel, bias,
    k, n_group, topk_group, softmax, normalize, scaling, logits [1, E], ids [1, k], weights [1, k]). The same
    loops the separate calls take, on arrays of the same types: the same bits."""
    q_raw, q_rot, k_raw, k_rot, v_raw, att, o_out = bufs  # [1, nh*hd], [1, nh, hd], [1, nkv*hd], ..., [1, H]
    nh, hd, nkv = q_rot.shape[1], q_rot.shape[2], k_rot.shape[1]
    dense.one_row(kq, qm, a, q_raw)
    dense.one_row(kk, km, a, k_raw)
    dense.one_row(kv, vm, a, v_raw)
    _norm_rope_or_rope(q_raw.reshape((1, nh, hd)), q_norm, eps, cos, sin, q_rot)
    _norm_rope_or_rope(k_raw.reshape((1, nkv, hd)), k_norm, eps, cos, sin, k_rot)
    last = keys.shape[0] - 1
    keys[last] = k_rot[0]
    values[last] = v_raw.reshape((nkv, hd))
    if parallel:
        gqa_attention_parallel(q_rot, keys, values, mask, scale, att)
    else:
        gqa_attention(q_rot, keys, values, mask, scale, att)
    dense.one_row(ko, om, att, o_out)
    add_rms_norm(h, o_out, post_norm, eps, h_out, m_out)
    routes, wt, wide, bias, k, n_group, topk_group, softmax, normalize, scaling, logits, ids, weights = router
    if routes:
        if wide:
            linear_rows_parallel(m_out, wt, logits)
        else:
            linear_rows(m_out, wt, logits)
        top_k(logits, bias, k, n_group, topk_group, softmax, normalize, scaling, ids, weights)


@njit(**JIT)
def moe_block(ks, node, m, tokens, ids, weights, shared, h, norm, eps, y, h_out, a_out, counts) -> int:
    """A decode token's MoE half of a layer on an in-process node that holds every expert (host/blocks.py):
    y = the node's layer kernel (kernels/layer.py: layer_moe) for the router's pairs of the row m [1, H], plus
    ``shared`` where it has a row (the shared experts' output, made apart), h_out = h + y, a_out its rms_norm
    by ``norm`` (the next layer's input norm), and each chosen expert counted in counts [E]. node: layer_moe's
    (data, hidden, offsets, shapes) for the layer; tokens [k]: zeros (the pairs' row); ids, weights [1, k]: the
    router's. Returns layer_moe's answer: the expert bytes read, or its negative code (nothing else done then).
    The same loops as the pool's request and the backend's add_rms_norm, in the same order: the same bits."""
    data, hidden, offsets, shapes = node
    k = ids.shape[1]
    nbytes = layer_moe(ks, data, hidden, m, tokens, ids.reshape(k), weights.reshape(k), offsets, shapes, y)
    if nbytes < 0:
        return nbytes
    if shared.shape[0]:
        for d in range(y.shape[1]):
            y[0, d] = y[0, d] + shared[0, d]
    add_rms_norm(h, y, norm, eps, h_out, a_out)
    for j in range(k):
        counts[ids[0, j]] += 1
    return nbytes


def warm_up_moe_block(ks) -> None:
    """Compile (or load) moe_block for the kernel set ``ks`` on the types a host MoE block passes (the experts
    unit's, coordinator/warmup.py): a next norm writable (a float32 conversion's) and read-only (a file's view)."""
    _, data, hidden, x, tokens, experts, weights, offsets, shapes, y = sample_args(ks)
    row = np.zeros((1, hidden), np.float32)
    norm = np.ones(hidden, np.float32)
    for writable in (True, False):
        norm.flags.writeable = writable
        moe_block(ks, (data, hidden, offsets, shapes), x, tokens, experts.reshape((1, -1)),
                  weights.reshape((1, -1)), np.empty((0, 0), np.float32), row, norm, np.float32(1e-6), y,
                  np.empty_like(row), np.empty_like(row), np.zeros(offsets.shape[0], np.int64))


def warm_up() -> None:
    """Compile (or load from the disk cache) every loop here before the first request, on the types ops.py
    passes. Left to the first use, a prompt long enough for gqa_attention_parallel (PARALLEL_ATTENTION_MACS)
    would load it inside the request and pay for the load in its latency."""
    x = np.ones((2, 8), np.float32)
    weight = np.ones(8, np.float32)
    rms_norm(x, weight, np.float32(1e-6), np.empty_like(x))
    add_rms_norm(x, x, weight, np.float32(1e-6), np.empty_like(x), np.empty_like(x))
    weight.flags.writeable = False  # a checkpoint's norm weights: read-only views of the file, another type
    rms_norm(x, weight, np.float32(1e-6), np.empty_like(x))
    add_rms_norm(x, x, weight, np.float32(1e-6), np.empty_like(x), np.empty_like(x))
    ids, routed = np.empty((2, 2), np.int64), np.empty((2, 2), np.float32)
    bias = np.zeros(8, np.float32)
    for b in (NO_BIAS, bias):
        top_k(x, b, 2, 2, 1, b is NO_BIAS, True, np.float32(1.0), ids, routed)
    bias.flags.writeable = False  # a checkpoint's e_score_correction_bias: a read-only view of the file
    top_k(x, bias, 2, 2, 1, False, True, np.float32(1.0), ids, routed)
    wt = np.ones((8, 2), np.float32)  # [K, N]
    for loop in (linear_rows, linear_rows_parallel):
        loop(x, wt, np.empty((2, 2), np.float32))
    heads = np.ones((2, 2, 8), np.float32)  # [T, heads, hd]
    rope(heads, x, x, np.empty_like(heads))
    for w in (np.ones(8, np.float32), weight):  # a norm's weight writable (a test's) and read-only (a file's)
        norm_rope(heads, w, np.float32(1e-6), x, x, np.empty_like(heads))
    mask = np.ones((2, 2), np.bool_)  # [T, S]
    out = np.empty((2, 16), np.float32)
    for loop in (gqa_attention, gqa_attention_parallel):
        loop(heads, heads[:, :1].copy(), heads[:, :1].copy(), mask, np.float32(0.5), out)
