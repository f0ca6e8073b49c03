"""Speculative decoding's pure parts: where drafts come from, how many to try, and which of them stand.

A running sequence may feed the model its last token and k drafted tokens in one step (k + 1 rows instead
of one: the dense weights, the attention and every trip to the expert pool paid once for them all). Row j's
logits are the model's distribution after the sequence and drafts 1..j; ``Sampler.verify`` chooses each
position's token in order from them, taking the draft where the rule allows: the greedy token at
temperature 0 (so the output is the tokens plain decoding makes), and at temperature > 0 the draft with the
model's probability of it, else a token drawn from the model's distribution without the draft (the
standard rule for a draft proposed with certainty: the output distribution is the model's). The step ends
at the first position whose token is not the draft; the KV cache drops what was cached after it.

    NgramIndex                     per sequence, prompt lookup (vLLM's ngram, llama.cpp's lookup decoding): the
                                   tokens that followed the latest earlier occurrence of its last n tokens
    DraftLength                    per sequence: how many drafts to try, the count with the most tokens a
                                   second from its recent acceptance at each position and StepCosts' ratio;
                                   drafts that never pay turn it off for exponentially longer spells
    StepCosts                      per engine: a draft's cost over a plain step's, measured as steps run
    DraftHistory                   per engine and draft source: where its finished sequences left their
                                   acceptance and pause, where a new sequence starts
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MODES = ("off", "ngram", "mtp", "auto")  # auto: the model's MTP layer where it has one, else prompt lookup
DEFAULT_DRAFT_MAX = 4  # drafts tried per step at most (--draft-max)
NGRAM_MAX, NGRAM_MIN = 4, 2  # the longest and shortest suffix looked up: long matches first, none shorter than 2
NGRAM_WINDOW = 8192  # tokens looked back through: a prompt's n-grams indexed at its first lookup at most
FEW_ENDS = 16  # NgramIndex puts fewer new ends than this in one by one, more zipped together
OFF_AFTER_MISSES = 2  # steps in a row with no draft accepted before drafting pauses
MAX_PAUSE = 64  # steps a pause lasts at most (each one after another miss twice as long, from 1)


class NgramIndex:
    """Prompt lookup over one sequence's ids as they grow (vLLM's ngram, llama.cpp's lookup decoding, whose
    n-gram maps this follows): the tokens that followed the latest earlier occurrence of the sequence's last n
    tokens, n from max_n down to min_n (the first n that matches), the occurrence inside the last ``window`` ids.
    For each n a map from an n-gram to where its latest occurrence with a follower ends, brought up to date with
    the ids added since the last lookup: a lookup costs a few dictionary probes, not a search of the window."""

    def __init__(self, max_n: int = NGRAM_MAX, min_n: int = NGRAM_MIN, window: int = NGRAM_WINDOW):
        self.max_n, self.min_n, self.window = max_n, min_n, window
        self.ends: dict[int, dict[tuple, int]] = {n: {} for n in range(max_n, min_n - 1, -1)}  # longest first
        self.indexed = 0  # the n-grams ending before this position are in ``ends``

    def draft(self, ids: np.ndarray, k: int) -> list[int]:
        """ids [L] (the prompt and the tokens so far: the ids of an earlier call and more) -> up to k tokens."""
        L = ids.size
        if k <= 0 or L < self.min_n + 1:
            return []
        lo = max(0, L - self.window)  # an occurrence starts here or later
        self._index(ids, max(self.indexed, lo), L - 2)  # an occurrence ends before the last id: it has a follower
        tail = tuple(ids[max(0, L - self.max_n):].tolist())
        for n, ends in self.ends.items():
            if n > L - 1:
                continue
            end = ends.get(tail[len(tail) - n:])
            if end is not None and end - n + 1 >= lo:
                return ids[end + 1:end + 1 + k].tolist()
        return []

    def _index(self, ids: np.ndarray, first: int, last: int) -> None:
        """The n-grams ending at first..last into the maps (a later end replaces an earlier one)."""
        if first > last:
            return
        base = max(0, first - self.max_n + 1)
        seg = ids[base:last + 1].tolist()
        if last - first < FEW_ENDS:  # a decode step's one or few new ends: each n-gram put in directly
            for end in range(first, last + 1):
                for n, ends in self.ends.items():
                    if end >= n - 1:
                        ends[tuple(seg[end - n + 1 - base:end + 1 - base])] = end
            self.indexed = last + 1
            return
        for n, ends in self.ends.items():  # a prompt's many: each n's n-grams zipped from n shifted lists
            lo = max(first, n - 1)  # the first end with n ids before it
            if lo > last:
                continue
            grams = zip(*(seg[lo - n + 1 - base + j:last - n + 2 - base + j] for j in range(n)))
            ends.update(zip(grams, range(lo, last + 1)))
        self.indexed = last + 1


def expected_tokens(acceptance: list[float], k: int) -> float:
    """Tokens a step gives on average with k drafts: 1 + sum over j <= k of the chance drafts 1..j all stand, from
    each position's conditional acceptance (acceptance[j - 1]: draft j stands when drafts 1..j - 1 did)."""
    total, chance = 1.0, 1.0
    for a in acceptance[:k]:
        chance *= a
        total += chance
    return total


def best_length(acceptance: list[float], ratio: float, draft_max: int) -> int:
    """The draft count k in [0, draft_max] with the most tokens a second: expected_tokens(k) / (1 + ratio k),
    where ratio is one draft's cost (making it and its verify row) over a plain step's (StepCosts.ratio). The
    smaller k wins a tie, so drafts that gain nothing are not made. expected_tokens(k) is summed as k grows."""
    best, best_rate = 0, 1.0
    total, chance = 1.0, 1.0
    for k, a in enumerate(acceptance[:draft_max], start=1):
        chance *= a
        total += chance
        rate = total / (1.0 + ratio * k)
        if rate > best_rate * (1.0 + 1e-9):
            best, best_rate = k, rate
    return best


@dataclass
class StepCosts:
    """What a decode step costs, measured as the schedulers run it (one per engine, Engine.step_costs, all
    sequences): a draft's cost over a plain step's (``ratio``), which decides how many drafts pay (best_length).

    The forward pass: seconds = fixed + per_row · rows. The slope is fitted over pairs of consecutive decode
    steps whose row counts differ (least squares of Δseconds on Δrows, each pair weighted DECAY**age), so the
    machine's drift from one stretch of steps to the next does not enter it, and it is kept while the rows do
    not change (the prior's share of the step until a pair is seen); the fixed part is what the recent steps
    cost beyond it. Steps with prompt chunks are left out. Making drafts: the seconds a step spent on them over
    the drafts made (an MTP pass's share; prompt lookup's search)."""

    DECAY = 0.95  # a step's weight per step after it: the averages follow about the last 20 steps
    PRIOR_RATIO = 0.25  # a draft's cost over a plain step's before anything is measured

    fixed: float = 0.0  # seconds a forward pass costs whatever its rows (0: not measured yet)
    per_row: float = 0.0  # seconds a row adds
    per_draft: float = 0.0  # seconds making one draft costs
    _means: list = field(default_factory=lambda: [0.0, 0.0, 0.0])  # weighted: 1, rows, seconds
    _pairs: list = field(default_factory=lambda: [0.0, 0.0])  # weighted over step pairs: Δrows², Δrows · Δseconds
    _last: tuple | None = None  # the previous decode step's (rows, seconds)
    _draft_sums: list = field(default_factory=lambda: [0.0, 0.0])  # weighted: drafts made, seconds

    def forward(self, rows: int, seconds: float) -> None:
        """A decode step's forward pass over ``rows`` rows took ``seconds``."""
        d = self.DECAY
        if self._last is not None and rows != self._last[0]:
            dr, dt = rows - self._last[0], seconds - self._last[1]
            self._pairs = [self._pairs[0] * d + dr * dr, self._pairs[1] * d + dr * dt]
        self._last = (rows, seconds)
        w, x, y = (v * d for v in self._means)
        self._means = [w + 1, x + rows, y + seconds]
        mean_x, mean_y = self._means[1] / self._means[0], self._means[2] / self._means[0]
        if self._pairs[0]:
            self.per_row = max(0.0, self._pairs[1] / self._pairs[0])
        else:  # no two row counts seen yet: the prior's share of the step
            self.per_row = mean_y / mean_x * self.PRIOR_RATIO / (1 + self.PRIOR_RATIO)
        self.fixed = max(0.0, mean_y - self.per_row * mean_x)

    def drafts(self, made: int, seconds: float) -> None:
        """Making ``made`` drafts took ``seconds``."""
        n, t = (v * self.DECAY for v in self._draft_sums)
        self._draft_sums = [n + made, t + seconds]
        self.per_draft = self._draft_sums[1] / self._draft_sums[0] if self._draft_sums[0] else 0.0

    def ratio(self, sequences: int) -> float:
        """One draft's cost (its making and its verify row) over one of ``sequences`` sequences' plain step (its
        share of the fixed cost and its row); PRIOR_RATIO before a step was measured."""
        plain = self.fixed / max(1, sequences) + self.per_row
        if plain <= 0:
            return self.PRIOR_RATIO
        return (self.per_row + self.per_draft) / plain


@dataclass
class DraftLength:
    """How many drafts one sequence tries next (``next``), from what was accepted (``update``): each position's
    conditional acceptance is followed (an average over about the last 1 / RECENT steps that reached it; a step
    that does not reach it pulls it back towards PRIOR, so that a position given up after a few misses is tried
    again), and the count with the most tokens a second at the step's cost ratio is tried (best_length). When none pays,
    or OFF_AFTER_MISSES steps in a row took no draft, drafting pauses for 1, 2, 4, ... MAX_PAUSE steps, then
    one draft probes (a miss after a pause pauses again), so a sequence whose drafts never stand costs about
    one draft row every MAX_PAUSE steps."""

    RECENT = 0.2  # the weight of a step's outcome in a position's acceptance
    PRIOR = 0.75  # a position's acceptance before one of its drafts was tried
    DRIFT = 0.05  # a step's pull of an untried position's acceptance back to PRIOR, so that it is tried again

    draft_max: int
    k: int = field(init=False)  # the count tried last
    acceptance: list = field(init=False)  # [draft_max] position j + 1's chance to stand when j stood
    misses: int = 0  # steps in a row with drafts tried and none accepted
    pause: int = 0  # steps left without drafting
    pause_len: int = 1  # the next pause's length
    probe: bool = False  # the step after a pause tries one draft whatever the estimates say
    drafted: int = 0  # totals, for the acceptance figures
    accepted: int = 0
    steps: int = 0  # steps that tried drafts

    def __post_init__(self):
        self.k = self.draft_max
        self.acceptance = [self.PRIOR] * max(0, self.draft_max)

    def next(self, ratio: float = StepCosts.PRIOR_RATIO) -> int:
        """Drafts to try this step at a draft's cost ``ratio`` (StepCosts.ratio)."""
        if self.draft_max <= 0:
            return 0
        if self.pause > 0:
            self.pause -= 1
            self.probe = self.pause == 0
            return 0
        if self.probe:
            self.probe = False
            self.k = 1
            return 1
        self.k = best_length(self.acceptance, ratio, self.draft_max)
        if self.k == 0:  # no count pays now: pause, then probe, each pause twice as long while none pays
            self._pause()
        else:
            self.pause_len = 1
        return self.k

    def update(self, tried: int, took: int) -> None:
        if tried <= 0:
            return
        self.drafted += tried
        self.accepted += took
        self.steps += 1
        reached = min(took + 1, tried)
        for j in range(reached):  # the positions reached: the first took stood, the next did not
            self.acceptance[j] += self.RECENT * (float(j < took) - self.acceptance[j])
        for j in range(reached, len(self.acceptance)):  # the others drift back: a few misses do not end them for good
            self.acceptance[j] += self.DRIFT * (self.PRIOR - self.acceptance[j])
        if took:
            self.misses = 0
            return
        self.misses += 1
        if self.misses >= OFF_AFTER_MISSES:  # the probe after a pause pauses again at once if it misses too
            self._pause()
            self.misses = OFF_AFTER_MISSES - 1

    def _pause(self) -> None:
        self.pause, self.pause_len = self.pause_len, min(2 * self.pause_len, MAX_PAUSE)


@dataclass
class DraftHistory:
    """Per engine and draft source (Engine.draft_history): the acceptance its last finished sequence that tried
    drafts ended with, and its pause length where none of them stood, where a new sequence starts instead of
    PRIOR: on a model whose drafts never stand a new request pauses at once, as long as the last one paused,
    instead of paying the probes of pauses 1, 2, 4, ... again; on one whose drafts stand it drafts from its first
    step as before."""

    acceptance: list | None = None  # [draft_max] as DraftLength.acceptance; None: nothing finished yet
    pause_len: int = 1

    def start(self, draft_max: int) -> DraftLength:
        """A new sequence's DraftLength, from what the last one learnt."""
        d = DraftLength(draft_max)
        if self.acceptance is not None:
            n = min(len(self.acceptance), len(d.acceptance))
            d.acceptance[:n] = self.acceptance[:n]
            d.pause_len = self.pause_len
        return d

    def keep(self, d: DraftLength) -> None:
        """A sequence ended: a new one starts from its acceptance, and from its pause length where none of its
        drafts stood (one whose drafts stood at times starts its pauses from 1 again, so a bad spell at the end of
        one request does not keep the next from drafting); one that tried no draft learnt nothing."""
        if d.steps:
            self.acceptance, self.pause_len = list(d.acceptance), d.pause_len if d.accepted == 0 else 1
