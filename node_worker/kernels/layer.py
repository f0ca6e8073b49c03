"""A node's whole MoE layer in one compiled call: group, cut into tasks, compute, weigh and sum.

The routed pairs (token, expert, weight) [P] are sorted by (expert, token);
each expert the node holds rows of becomes a group, a task (rows.py computes
every group's contribution in parallel); then the contributions are weighed
and added into y, each token's row by a thread (weigh_and_sum), its
contributions in group order (experts ascending), so y is the same bits
whatever the thread count or timing. Nothing here touches a Python object: the
per-layer tables are arrays.

    ks      KernelSet       the formats whose loops are compiled in (kernel_set.py): every format of the tables
    offsets [E, 3] int64    byte offsets of expert e's gate, up and down matrices in the store (E: the model's
                            routed experts)
    shapes  [E, 8] int64    expert e's matrices (rows.py's SHAPE columns): the node's rows R (0: it holds none); gate's and up's format (FORMAT_IDS) and bytes of a stored row; down's
                            format, the weights in a stored row of its [H, R] (R in whole blocks), that row's bytes

Returns the expert bytes the layer read, or a negative code when the routing is not valid (nothing is
computed then): the one place the routing is checked, for both pools (ROUTING_ERRORS names each code).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .common import JIT
from .rows import DOWN_BYTES, GATE_BYTES, ROWS, UP_BYTES, layer_rows


SUM_PAIRS = 64  # pairs from which weigh_and_sum takes the tokens' rows in parallel (fewer: decode's, serially)
BAD_TOKEN, BAD_EXPERT, BAD_WEIGHT = -1, -2, -3  # layer_moe's answers to routing that is not valid
ROUTING_ERRORS = {BAD_TOKEN: "token index out of range [0, {rows})", BAD_EXPERT: "expert id out of range [0, {experts})",
                  BAD_WEIGHT: "routing weights must be finite"}


@njit(inline="always", **JIT)
def token_row(y, contrib, sorted_weights, by_token, first, hidden, t) -> None:
    """y[t] = the sum of w · token t's contributions, its pairs by_token[first[t]:first[t + 1]] in pair order."""
    y[t, :] = 0
    for k in range(first[t], first[t + 1]):
        p = by_token[k]
        w = sorted_weights[p]
        for i in range(hidden):
            y[t, i] += w * contrib[p * hidden + i]


@njit(parallel=True, **JIT)
def token_rows_parallel(y, contrib, sorted_weights, by_token, first, hidden) -> None:
    for t in prange(y.shape[0]):
        token_row(y, contrib, sorted_weights, by_token, first, hidden, t)


@njit(**JIT)
def weigh_and_sum(y, contrib, sorted_tokens, sorted_weights, hidden):
    """y [T, H] = for each token, the sum of w · its pairs' contributions in pair order (group order): pair p's
    contribution is contrib[p H:(p + 1) H], its token sorted_tokens[p], its weight sorted_weights[p] (the
    pairs of the layer's groups, one after another). From SUM_PAIRS pairs on a token's row by a thread: a
    prefill's serial loop over the pairs would keep the other threads waiting; decode's eight pairs stay
    serial (a parallel loop's start costs more than their sum)."""
    T = y.shape[0]
    P = sorted_tokens.size
    first = np.zeros(T + 1, np.int64)  # token t's pairs: by_token[first[t]:first[t + 1]]
    for p in range(P):
        first[sorted_tokens[p] + 1] += 1
    for t in range(T):
        first[t + 1] += first[t]
    by_token = np.empty(P, np.int64)  # [P] the pairs by token, in pair order within one (a counting placement)
    filled = first[:T].copy()
    for p in range(P):
        by_token[filled[sorted_tokens[p]]] = p
        filled[sorted_tokens[p]] += 1
    if P >= SUM_PAIRS:
        token_rows_parallel(y, contrib, sorted_weights, by_token, first, hidden)
    else:
        for t in range(T):
            token_row(y, contrib, sorted_weights, by_token, first, hidden, t)


@njit(**JIT)
def layer_moe(ks, data, hidden, x, tokens, experts, weights, offsets, shapes, y) -> int:
    E = shapes.shape[0]  # the model's routed experts (rows of the node's table, 0 rows where it holds none)
    P = experts.size
    T = x.shape[0]
    weight_bits = weights.view(np.uint32)  # finiteness read from the exponent bits: fastmath assumes no NaN/inf
    for p in range(P):
        if tokens[p] < 0 or tokens[p] >= T:
            return BAD_TOKEN
        if experts[p] < 0 or experts[p] >= E:
            return BAD_EXPERT
        if weight_bits[p] & 0x7F800000 == 0x7F800000:
            return BAD_WEIGHT
    order = np.argsort(experts * T + tokens, kind="mergesort")  # [P] by expert, then token
    # groups: the runs of one expert in that order, kept where the node holds rows of the expert
    group_expert = np.empty(P, np.int64)
    tok_start = np.empty(P, np.int64)  # group g's pairs: sorted_tokens[tok_start[g]:tok_stop[g]]
    tok_stop = np.empty(P, np.int64)
    sorted_tokens = np.empty(P, np.int64)
    sorted_weights = np.empty(P, np.float32)
    G = n_pairs = 0
    p = 0
    while p < P:
        e = experts[order[p]]
        held = e < E and shapes[e, ROWS] > 0
        tok_start[G] = n_pairs
        while p < P and experts[order[p]] == e:
            if held:
                sorted_tokens[n_pairs] = tokens[order[p]]
                sorted_weights[n_pairs] = weights[order[p]]
                n_pairs += 1
            p += 1
        if held:
            group_expert[G] = e
            tok_stop[G] = n_pairs
            G += 1
    group_offsets = np.empty((G, 3), np.int64)
    group_shapes = np.empty((G, shapes.shape[1]), np.int64)
    contrib_start = np.empty(G, np.int64)
    total = 0
    nbytes = 0
    for g in range(G):
        e = group_expert[g]
        group_offsets[g] = offsets[e]
        group_shapes[g] = shapes[e]
        nbytes += shapes[e, ROWS] * (shapes[e, GATE_BYTES] + shapes[e, UP_BYTES]) + hidden * shapes[e, DOWN_BYTES]
        contrib_start[g] = total
        total += (tok_stop[g] - tok_start[g]) * hidden
    contrib = np.empty(total, np.float32)
    layer_rows(ks, data, hidden, x, sorted_tokens, tok_start[:G], tok_stop[:G], group_offsets, group_shapes, contrib,
               contrib_start)
    weigh_and_sum(y, contrib, sorted_tokens[:n_pairs], sorted_weights[:n_pairs], hidden)  # in group order
    return nbytes


def sample_args(ks) -> tuple:
    """layer_moe's arguments for one f32 row of 32 through one expert (down [32, 1]), of the types a node's
    requests pass: what warm_up compiles with (and answer.py's warm-up)."""
    hidden = 32
    return (ks, np.zeros(3 * 4 * hidden, np.uint8), hidden, np.zeros((1, hidden), np.float32), np.zeros(1, np.int64),
            np.zeros(1, np.int64), np.ones(1, np.float32), np.array([[0, 4 * hidden, 8 * hidden]], np.int64),
            np.array([[1, 0, 4 * hidden, 0, 4 * hidden, 0, 1, 4]], np.int64), np.zeros((1, hidden), np.float32))


def warm_up(ks) -> None:
    """Compile (or load from the disk cache) the layer kernel of the kernel set ``ks`` before the first request."""
    layer_moe(*sample_args(ks))
