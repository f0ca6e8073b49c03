"""Qwen3-Next's Gated DeltaNet layer on the GPU (model/linear_attention.py is the host's and the reference).

The layer between its projections is one launch for every sequence of a step (ops.gated_delta, ``device_layer``):
the conv, the delta rule and the gated norm, a block a (sequence, value head). A sequence's states in every Gated
DeltaNet layer are one DeviceLinearStates in its cache, on the device, double-buffered: a step reads one buffer and
writes the other, so the state before the last step is kept without a copy and a rewind re-runs the kept tokens
from it.
"""

from __future__ import annotations

import numpy as np

from ..model.linear_attention import REWINDABLE
from ..model.model_config import LinearAttnConfig
from ..model.weights import LinearAttnWeights
from ..model.xp import to_host
from . import ops as device_ops
from .format_kernels import address


class DeviceLinearStates:
    """One sequence's Gated DeltaNet states on the device, every such layer's (a slot each): conv [2, slots, K-1, C]
    and recurrent [2, slots, Hv, dk, dv], two buffers. ``cur`` holds the state after the last step; a step reads it
    and writes the other, which becomes ``cur``. For a step of at most REWINDABLE tokens each layer's inputs are kept
    (views of its projections, not copies) so that a rewind inside it can take the step again from the buffer it
    read."""

    def __init__(self, lc: LinearAttnConfig, layers: list[int], xp):
        self.lc, self.xp = lc, xp
        self.slot = {layer: k for k, layer in enumerate(layers)}  # model layer id -> its place in the buffers
        n = len(layers)
        self.conv = xp.zeros((2, n, lc.conv_kernel - 1, lc.conv_dim), np.float32)
        self.recurrent = xp.zeros((2, n, lc.value_heads, lc.key_head_dim, lc.value_head_dim), np.float32)
        self._addresses = [(address(self.conv[b]), address(self.recurrent[b])) for b in (0, 1)]
        self.cur = 0
        self.start = self.end = 0  # cache positions of the last step's first token and the one after its last
        self._last: dict | None = {}  # layer -> (weights, eps, qkv, z, ba rows) of a rewindable step; None: not

    @property
    def nbytes(self) -> int:
        return int(self.conv.nbytes + self.recurrent.nbytes)

    def state(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(conv [K-1, C], recurrent [Hv, dk, dv]) of ``layer`` after the last step, on the host (tests)."""
        k = self.slot[layer]
        return to_host(self.conv[self.cur, k]), to_host(self.recurrent[self.cur, k])

    def begin(self, start: int, tokens: int) -> tuple[int, int, int, int]:
        """A step of ``tokens`` from cache position ``start``: the buffers flip. Returns (conv src, conv dst,
        recurrent src, recurrent dst) addresses for device_ops.gated_delta's tables."""
        (conv_src, rec_src), (conv_dst, rec_dst) = self._addresses[self.cur], self._addresses[1 - self.cur]
        self.cur = 1 - self.cur
        self.start, self.end = start, start + tokens
        self._last = {} if tokens <= REWINDABLE else None
        return conv_src, conv_dst, rec_src, rec_dst

    def keep(self, layer: int, w: LinearAttnWeights, eps: float, qkv, z, ba) -> None:
        """The step's inputs of ``layer`` (this sequence's rows), for a rewind inside the step."""
        if self._last is not None:
            self._last[layer] = (w, eps, qkv, z, ba)

    def rewind(self, length: int) -> None:
        """The state after ``length`` tokens: LinearState.rewind's rule, the step taken again from the buffer it
        read (nothing to take when ``length`` is its start)."""
        if length == self.end:
            return
        if not self.start <= length < self.end or self._last is None:
            raise ValueError(f"a Gated DeltaNet state rewinds only within its last step of at most {REWINDABLE} "
                             f"tokens (here tokens {self.start} to {self.end}), not to {length}")
        last, keep = self._last, length - self.start
        self.cur = 1 - self.cur  # the buffer the step read: the state before it
        self.end, self._last = self.start, {}
        if not keep:
            return
        tables = device_tables(self.xp, [(keep, self.begin(self.start, keep))])
        for layer, (w, eps, qkv, z, ba) in last.items():
            device_ops.gated_delta(qkv[:keep], z[:keep], ba[:keep], w.conv, w.a_neg, w.dt_bias, w.norm, eps, tables,
                                   self.slot[layer], _dims(self.lc))
            self.keep(layer, w, eps, qkv[:keep], z[:keep], ba[:keep])


def _dims(lc: LinearAttnConfig) -> tuple[int, int, int, int, int]:
    return lc.key_heads, lc.value_heads, lc.key_head_dim, lc.value_head_dim, lc.conv_kernel


def device_tables(xp, steps: list) -> tuple:
    """device_ops.gated_delta's tables for a step's sequences, ``steps``: per sequence (its rows, the addresses
    DeviceLinearStates.begin gave), uploaded in one copy: (row_start [B + 1], conv_src, conv_dst, rec_src, rec_dst
    [B]), views of one device int64 array."""
    B = len(steps)
    host = np.empty(1 + 5 * B, np.int64)  # row_start [B + 1] | conv_src | conv_dst | rec_src | rec_dst
    host[0] = 0
    host[1:B + 1] = np.cumsum([rows for rows, _ in steps])
    host[B + 1:].reshape(4, B)[:] = np.array([addresses for _, addresses in steps], np.int64).T
    dev = xp.asarray(host)
    return (dev[:B + 1], *(dev[B + 1 + k * B:B + 1 + (k + 1) * B] for k in range(4)))


def device_layer(w: LinearAttnWeights, lc: LinearAttnConfig, x, layer: int, states: list, tables, bounds,
                 eps: float):
    """``layer`` on the device: x [N, H] (the step's rows, sequence s's at bounds[s]:bounds[s + 1]) -> the gated
    output before out_proj [N, Hv dv]; ``states``: each sequence's DeviceLinearStates, begun for this step (their
    addresses in ``tables``). The whole step's recurrence runs in the kernel, a token at a time: a prompt takes the
    recurrent form too, not the host's chunked one (one launch a layer, no chunk-sized temporaries, and the same
    code for decode, drafts and prefill)."""
    qkv = x @ w.qkv.T  # [N, C]
    z = x @ w.z.T  # [N, Hv*dv]
    ba = x @ w.ba.T  # [N, 2 Hv]
    out = device_ops.gated_delta(qkv, z, ba, w.conv, w.a_neg, w.dt_bias, w.norm, eps, tables, states[0].slot[layer],
                                 _dims(lc))
    for s, st in enumerate(states):
        rows = slice(bounds[s], bounds[s + 1])
        st.keep(layer, w, eps, qkv[rows], z[rows], ba[rows])
    return out
