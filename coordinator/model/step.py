"""One forward pass's input and output (StepBatch, StepOutput), and how an eager pass meets the caches (EagerStep).

The decoder's one forward, ``Decoder.forward(batch, step)``, writes the network once. What differs between an
eager pass and a GPU's graph-ready one is not the network but where its inputs come from, where the keys and
values go, how the MoE layer reaches the pool and when the caches advance: that is the ``step`` object. EagerStep
(here) does each as it is called; coordinator/gpu/graph_steps.py's StreamedStep extends it with the forms a
CUDA graph can replay (fixed places, tables on the device), and its runner wraps the unchanged forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from . import ops
from .ops import MlaRows


@dataclass(frozen=True, eq=False)
class StepBatch:
    """The sequences of one forward pass and what it asks of each."""

    seqs: list  # each (its next token ids [T_s] int64, its KVCache)
    all_rows: frozenset[int] = frozenset()  # the sequences whose every row's logits are asked for, else the last's
    hidden: bool = False  # each sequence's rows after the final norm asked for (the MTP layer's input)
    hidden_rows: frozenset[int] = frozenset()  # the sequences whose every hidden row is asked for, else the last's

    @classmethod
    def of(cls, ids: np.ndarray, cache, every_row: bool = False) -> "StepBatch":
        """One sequence: its last row's logits, or with ``every_row`` every row's."""
        return cls([(ids, cache)], all_rows=frozenset({0}) if every_row else frozenset())

    @cached_property
    def lengths(self) -> list[int]:
        return [len(ids) for ids, _ in self.seqs]

    @cached_property
    def bounds(self) -> np.ndarray:
        """[B + 1] the sequences' row ranges in the batch."""
        return np.cumsum([0] + self.lengths)

    @cached_property
    def rows(self) -> int:
        """Every sequence's rows: asked at every layer."""
        return int(self.bounds[-1])

    @cached_property
    def ids(self) -> np.ndarray:
        """[N] every row's token id, in order."""
        return np.concatenate([ids for ids, _ in self.seqs])

    @cached_property
    def positions(self) -> list[np.ndarray]:
        """Each sequence's rows' positions in its cache [T_s]."""
        return [np.arange(c.length, c.length + n) for (_, c), n in zip(self.seqs, self.lengths)]

    @cached_property
    def wanted(self) -> list[int]:
        """The rows of each sequence lm_head takes: every one for those in all_rows, else the last."""
        return [n if k in self.all_rows else 1 for k, n in enumerate(self.lengths)]

    @property
    def last_rows_only(self) -> bool:
        """Whether only each sequence's last row is wanted after the last layer's attention (last logits, last
        hidden row), and some sequence has more rows than that: the last layer then carries on with those rows
        alone (llama.cpp's graphs take ``inp_out_ids``' rows in the last layer the same way)."""
        return not self.all_rows and not self.hidden_rows and len(self.seqs) < self.rows

    def key(self) -> tuple:
        """What decides every launch a step queues and every address in them (with the attention's forms): two
        steps of one key replay one CUDA graph."""
        return tuple(self.lengths), self.all_rows, self.hidden, self.hidden_rows


@dataclass
class StepOutput:
    logits: list  # each sequence's logits on the host, [R_s, V]: its wanted rows
    hidden: list | None = None  # where asked: each sequence's hidden rows [R_s, H] where the network runs
    extra: dict = field(default_factory=dict)


class EagerStep:
    """A forward pass run as its ops are called: the rows' embedding and RoPE uploaded, each sequence's keys and
    values appended to its cache and attended there, the MoE layer's CPU pairs posted to the pool from Python, the
    logits downloaded, the caches advanced at the end."""

    def __init__(self, decoder, batch: StepBatch):
        self.decoder, self.batch, self.b = decoder, batch, decoder.backend
        self.masks: dict = {}  # (sequence, window) -> [T_s, S_s] on the network's side: uploaded once, not a layer

    def inputs(self):
        """(h [N, H], (cos, sin) [N, d]): the rows' embeddings and every row's RoPE tables."""
        d = self.decoder
        return self.b.xp.asarray(d.w.embed[self.batch.ids]), d.rope_tables(np.concatenate(self.batch.positions))

    def last_rows(self):
        """Each sequence's last row [B], an index where the network runs."""
        return self.b.xp.asarray(self.batch.bounds[1:] - 1)

    def wanted_rows(self, a):
        """The rows lm_head takes of a [N, H] (StepBatch.wanted), in order."""
        b, wanted = self.batch, self.batch.wanted
        return self.b.xp.concatenate([a[hi - n:hi] for hi, n in zip(b.bounds[1:], wanted)])

    def logits(self, a):
        """lm_head's logits [R, V] of the rows a [R, H], on the host: the pass's synchronisation."""
        return self.b.to_host(a @ self.decoder.w.lm_head.T)

    def finish(self) -> None:
        """The caches take the pass's rows."""
        for (_, cache), n in zip(self.batch.seqs, self.batch.lengths):
            cache.advance(n)

    def moe(self, i: int, lw, x, routed=None):
        return self.decoder.moe(i, lw, x, routed)

    def mask(self, s: int, keys: int, window: int | None):
        """Sequence s's attention mask [T_s, keys], made once a pass for each window."""
        if (s, window) not in self.masks:
            self.masks[(s, window)] = self.b.xp.asarray(
                ops.attention_mask(self.batch.positions[s], np.arange(keys), window))
        return self.masks[(s, window)]

    def attend(self, i: int, q, k, v, window: int | None, rows=None):
        """Layer i's attention [N or B, nh*hd] of the queries q [N or B, nh, hd] (B with ``rows``: each sequence's
        last row's) over its cache once every row's k, v [N, nkv, hd] (normed and roped) are appended to it."""
        b = self.batch
        parts = []  # each sequence's [T_s, nh*hd]
        for s, (_, cache) in enumerate(b.seqs):
            r = slice(b.bounds[s], b.bounds[s + 1])
            keys, values = cache.extend(i, k[r], v[r])  # [S, nkv, hd]
            mask = self.mask(s, keys.shape[0], window)  # [T_s, S]
            if rows is not None:  # sequence s's last query alone: row s of q
                r, mask = slice(s, s + 1), mask[-1:]
            parts.append(self.b.gqa_attention(q[r], keys, values, mask))
        return parts[0] if len(parts) == 1 else self.b.xp.concatenate(parts)

    def attention_block(self, i: int, block, h, a, rope):
        """Layer i's attention half in the backend's one call (Backend.attention_block) where this pass is one
        sequence's one token and its cache keeps float32: (h + attention, its post-attention norm [1, H], the
        router's (ids, weights) or None), the key and value cached; else None (the separate calls)."""
        if self.batch.rows != 1:
            return None
        cache = self.batch.seqs[0][1]
        if cache.bf16:
            return None
        keys, values = cache.open_row(i)  # [S, nkv, hd], the token's slot last
        return block(h, a, keys, values, rope[0], rope[1])

    def attend_mla(self, i: int, lw, mla: MlaRows, rope, rows=None):
        """Layer i's multi-head latent attention [N or B, nh*dv] of the queries once every row's latent and rope key
        are appended to the cache."""
        b, d = self.batch, self.decoder
        q_nope, q_rope = mla.q_nope, mla.q_rope
        out = self.b.xp.empty((q_nope.shape[0], d.cfg.num_heads * d.cfg.mla.v_head_dim), np.float32)
        for s, (_, cache) in enumerate(b.seqs):
            r = slice(b.bounds[s], b.bounds[s + 1])
            cos, sin = rope[0][r], rope[1][r]
            lat, kr = cache.extend(i, mla.latent[r], mla.k_rope[r])  # [S, c], [S, dr]
            mask = self.mask(s, lat.shape[0], None)  # [T_s, S]
            if rows is not None:  # sequence s's last query alone: row s of q
                r, cos, sin, mask = slice(s, s + 1), cos[-1:], sin[-1:], mask[-1:]
            out[r] = d.mla_core(lw, MlaRows(q_nope[r], d.mla_rotate(q_rope[r], cos, sin), lat, kr), mask)
        return out
