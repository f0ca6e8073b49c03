"""Speculative decoding's pure parts: where drafts come from, how many to try, and which of them stand.

A running sequence may feed the model its last token and k drafted tokens in one step (k + 1 rows instead
of one: the dense weights, the attention and every trip to the expert pool paid once for them all). Row j's
logits are the model's distribution after the sequence and drafts 1..j; ``Sampler.verify`` chooses each
position's token in order from them, taking the draft where the rule allows: the greedy token at
temperature 0 (so the output is the tokens plain decoding makes), and at temperature > 0 the draft with the
model's probability of it, else a token drawn from the model's distribution without the draft (the
standard rule for a draft proposed with certainty: the output distribution is the model's). The step ends
at the first position whose token is not the draft; the KV cache drops what was cached after it.

    ngram_draft(ids, k)            prompt lookup (vLLM's ngram, llama.cpp's lookup decoding): the tokens that
                                   followed the latest earlier occurrence of the sequence's last n tokens
    DraftLength                    per sequence: how many drafts to try, from its recent acceptance; drafts
                                   that are never accepted turn it off for exponentially longer spells
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MODES = ("off", "ngram", "mtp", "auto")  # auto: the model's MTP layer where it has one, else prompt lookup
DEFAULT_DRAFT_MAX = 4  # drafts tried per step at most (--draft-max)
NGRAM_MAX, NGRAM_MIN = 4, 2  # the longest and shortest suffix looked up: long matches first, none shorter than 2
NGRAM_WINDOW = 8192  # tokens looked back through: the search costs this many comparisons a step at most
OFF_AFTER_MISSES = 2  # steps in a row with no draft accepted before drafting pauses
MAX_PAUSE = 64  # steps a pause lasts at most (each one after another miss twice as long, from 1)


def ngram_draft(ids: np.ndarray, k: int, max_n: int = NGRAM_MAX, min_n: int = NGRAM_MIN,
                window: int = NGRAM_WINDOW) -> list[int]:
    """ids [L] (the prompt and the tokens so far) -> up to k tokens that followed the latest earlier place where
    the last n tokens occurred (n from max_n down to min_n, the first n that matches); [] when none does."""
    L = ids.size
    if k <= 0 or L < min_n + 1:
        return []
    lo = max(0, L - window)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = ids[L - n:]
        hay = ids[lo:L - 1]  # a match must end before the last token, so it has a follower
        if hay.size < n:
            continue
        starts = np.flatnonzero(hay[: hay.size - n + 1] == suffix[0])  # candidates by the first token
        for j in range(1, n):
            if starts.size == 0:
                break
            starts = starts[hay[starts + j] == suffix[j]]
        if starts.size:
            at = lo + int(starts[-1]) + n  # the token after the latest match
            return ids[at:at + k].tolist()
    return []


@dataclass
class DraftLength:
    """How many drafts one sequence tries next (``next``), adapted from what was accepted (``update``): one more
    after a step that took every draft, halved after one that took none; OFF_AFTER_MISSES such steps in a row
    pause drafting for 1, 2, 4, ... MAX_PAUSE steps (a miss after a pause pauses again), so a sequence whose
    drafts never stand costs about one draft row every MAX_PAUSE steps."""

    draft_max: int
    k: int = field(init=False)
    misses: int = 0  # steps in a row with drafts tried and none accepted
    pause: int = 0  # steps left without drafting
    pause_len: int = 1  # the next pause's length
    drafted: int = 0  # totals, for the acceptance figures
    accepted: int = 0
    steps: int = 0  # steps that tried drafts

    def __post_init__(self):
        self.k = self.draft_max

    def next(self) -> int:
        if self.draft_max <= 0:
            return 0
        if self.pause > 0:
            self.pause -= 1
            return 0
        return self.k

    def update(self, tried: int, took: int) -> None:
        if tried <= 0:
            return
        self.drafted += tried
        self.accepted += took
        self.steps += 1
        if took == tried:
            self.k = min(self.k + 1, self.draft_max)
        elif took == 0:
            self.k = max(1, self.k // 2)
        if took:
            self.misses, self.pause_len = 0, 1
            return
        self.misses += 1
        if self.misses >= OFF_AFTER_MISSES:  # the probe after a pause pauses again at once if it misses too
            self.pause, self.pause_len = self.pause_len, min(2 * self.pause_len, MAX_PAUSE)
            self.misses = OFF_AFTER_MISSES - 1
