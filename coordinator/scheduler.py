"""The generation loop: continuous batching of generate requests over one Engine, free of sockets.

Each ``step`` admits queued requests (up to ``max_active`` prefilling and
decoding sequences together) and runs ONE forward pass holding the next prompt
chunks of the prefilling sequences, in admission order and at most
``prefill_chunk`` prompt tokens in all (a sequence may get a partial chunk and
go on in later steps), plus one decode token for every running sequence (the
token sampled for it in the previous step). Then it samples one token for every
running sequence and for each whose prompt finished in this pass, emits their
events, and drops the finished ones. A long prompt is therefore prefilled across
several steps while the running sequences keep getting a token every step, the
expert pool sees one batch per layer, and a new request joins at the next step.
The server drives it (serving/server.py), Engine.generate drives one request
through it (``generate``), tests drive it in-process. It uses the engine's
public surface alone: new_cache, step, check_ids, encode, decode, codec,
model_config and config, and for MTP drafts has_mtp, new_mtp_cache and mtp_step.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .errors import ConfigValueError, StepInterrupted
from .text.grammar import Constraint, GrammarError
from .model.kv_cache import KVCache
from .latency import new_histograms
from .model.sampling import Sampler, top_logprobs
from .model.step import StepBatch, StepOutput
from .text.tokenizer import StreamDecoder
from .speculative import DraftHistory, DraftLength, NgramIndex, StepCosts
from .request import DEFAULT_MAX_ACTIVE, DEFAULT_MAX_QUEUED, ApiError, GenerateRequest, Limits

log = logging.getLogger(__name__)

Emit = Callable[[bytes, dict], None]  # (client, event)


@dataclass
class Sequence:
    client: bytes
    req: GenerateRequest
    prompt_ids: list[int]
    sampler: Sampler
    cache: KVCache
    stream: StreamDecoder | None
    out_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] | None = None  # one entry per out_id when the request asked for logprobs
    prompt_logprobs: list[dict] | None = None  # one entry per prompt id (the first's logprob None) when asked
    sent: int = 0  # out_ids already carried by token events
    text: str = ""  # completion text so far (stop strings cut it)
    emitted: int = 0  # characters of ``text`` already streamed
    logits: np.ndarray | None = None  # [V] for the next token
    prefilled: int = 0  # prompt tokens already in ``cache`` (chunked prefill)
    deadline: float | None = None  # monotonic time at which it ends with finish_reason "deadline"
    started: float = field(default_factory=time.monotonic)  # when the scheduler took it
    arrived: float = 0.0  # monotonic: when the request arrived (its latencies count from here)
    last_token_at: float | None = None  # monotonic: when its last token was chosen
    drafts: DraftLength | None = None  # speculative decoding: how many drafts it tries next (None: off)
    history: np.ndarray | None = None  # [len(prompt) + max_new_tokens] its ids so far, where drafts are looked up
    lookup: NgramIndex | None = None  # prompt lookup's n-grams of ``history`` (speculative ngram)
    mtp_cache: KVCache | None = None  # MTP drafts: the MTP layer's cache, one position per (hidden, next token) fed
    mtp_hidden: list = field(default_factory=list)  # MTP drafts: hidden rows of the positions not yet fed, in order


MTP_CATCH_UP = 16  # rows of a pause the MTP layer is fed before a draft at most; a longer pause restarts its cache


def split_rows(pieces: list, n: int) -> tuple[list, list]:
    """Row blocks [n_i, H] in order -> (blocks of their first n rows, blocks of the rest), views of the blocks."""
    first, rest = [], []
    for piece in pieces:
        k = min(n, piece.shape[0])
        first += [piece[:k]] if k else []
        rest += [piece[k:]] if k < piece.shape[0] else []
        n -= k
    return first, rest


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters could still be the start of a stop string."""
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                hold = max(hold, n)
                break
    return hold


class Scheduler:
    def __init__(self, engine, emit: Emit, max_active: int = DEFAULT_MAX_ACTIVE, max_queued: int = DEFAULT_MAX_QUEUED,
                 limits: Limits = Limits(), prefill_chunk: int | None = None, speculative: str | None = None,
                 draft_max: int | None = None):
        """``speculative`` and ``draft_max`` (coordinator/speculative.py): the engine's config's when None."""
        self.engine = engine
        self.speculative = engine.config.speculative if speculative is None else speculative
        self.draft_max = engine.config.draft_max if draft_max is None else draft_max
        if self.speculative == "mtp" and not engine.has_mtp:
            raise ConfigValueError("speculative mtp needs the model's multi-token-prediction layer, and this model "
                                   "has none loaded: use ngram or auto")
        if self.speculative == "auto":  # the model's MTP layer where it has one, else prompt lookup
            self.speculative = "mtp" if engine.has_mtp else "ngram"
        self.costs: StepCosts = engine.step_costs  # what a draft costs beside a plain step, kept by the engine
        # where the engine's last sequence with these drafts left off, where a new one starts (kept by the engine)
        self.history: DraftHistory = engine.draft_history.setdefault(self.speculative, DraftHistory())
        self.limits = limits
        self.emit = emit
        self.max_active = max_active
        self.max_queued = max_queued
        self.queue: deque[Sequence] = deque()
        self.prefill_chunk = engine.config.prefill_chunk if prefill_chunk is None else prefill_chunk
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1, got {self.prefill_chunk}")
        self.prefilling: list[Sequence] = []  # admitted, prompt not yet wholly in the cache (admission order)
        self.active: list[Sequence] = []  # running: prompt cached, out_ids[-1] sampled but not yet in the cache
        self.stats = {"requests": 0, "completed": 0, "cancelled": 0, "errors": 0, "tokens": 0, "steps": 0,
                      "prefill_tokens": 0, "busy_rejections": 0, "started": time.time(), "step_s": 0.0,
                      "drafted_tokens": 0, "accepted_drafts": 0}
        self.latency = new_histograms()  # coordinator/latency.py: queue, first token, inter-token, end to end

    # -- admission -----------------------------------------------------------
    def add(self, client: bytes, req: GenerateRequest, ids: list[int] | None = None,
            arrived: float | None = None) -> Sequence:
        """Queue a request; ``ids`` are its text prompt's tokens when already tokenised (the server does that
        off its loop), ``arrived`` the monotonic time its deadline counts from (default: now). Returns its
        sequence, whose ``out_ids`` grow as it is stepped."""
        if any(s.req.id == req.id and s.client == client for s in self.all()):
            raise ApiError("bad_request", f"request id {req.id!r} is already in flight", req.id)
        if len(self.queue) >= self.max_queued:
            self.stats["busy_rejections"] += 1
            raise ApiError("busy", f"the queue is full ({self.max_queued} requests waiting); retry later", req.id)
        eng = self.engine
        if req.prompt is not None:
            if ids is None:
                try:
                    ids = eng.encode(req.prompt)
                except Exception as exc:  # tokenizers raises plain Exceptions; a bad prompt is the request's fault
                    raise ApiError("bad_request", f"the prompt cannot be tokenised: {exc}", req.id) from None
            if not ids:
                raise ApiError("bad_request", "the prompt encodes to no tokens", req.id)
            if len(ids) > self.limits.max_prompt_tokens:
                raise ApiError("too_long", f"the prompt is {len(ids)} tokens; the limit is "
                                           f"{self.limits.max_prompt_tokens}", req.id)
        else:
            ids = list(req.prompt_ids)
        vocab = eng.model_config.vocab_size
        if any(t >= vocab for t, _ in req.logit_bias):
            raise ApiError("bad_request", f"'logit_bias' names a token id outside the vocabulary [0, {vocab})", req.id)
        try:
            eng.check_ids(ids, req.max_new_tokens)
            sampler = Sampler(req.sampling(), prompt_ids=ids, constraint=self._constraint(req))
        except ValueError as exc:
            code = "too_long" if "exceed" in str(exc) else "bad_request"
            raise ApiError(code, str(exc), req.id) from None
        stream = StreamDecoder(eng.codec, req.skip_special_tokens) if eng.codec is not None else None
        arrived = time.monotonic() if arrived is None else arrived
        deadline = None if req.deadline_s is None else arrived + req.deadline_s
        drafts, history = None, None
        if self.speculative != "off":
            drafts = self.history.start(self.draft_max)
            history = np.empty(len(ids) + req.max_new_tokens, np.int64)
            history[:len(ids)] = ids
        seq = Sequence(client, req, list(ids), sampler, eng.new_cache(), stream, deadline=deadline,
                       drafts=drafts, history=history, lookup=NgramIndex() if self.speculative == "ngram" else None,
                       mtp_cache=eng.new_mtp_cache() if self.speculative == "mtp" else None,
                       logprobs=None if req.logprobs is None else [],
                       prompt_logprobs=None if req.prompt_logprobs is None else [
                           {"id": ids[0], "token": self._token_text(ids[0]), "logprob": None, "top": []}],
                       arrived=arrived)
        self.queue.append(seq)
        self.stats["requests"] += 1
        return seq

    def _constraint(self, req: GenerateRequest) -> Constraint | None:
        """The request's grammar state (None without one); ApiError when it cannot be compiled."""
        if req.grammar is None:
            return None
        grammars = self.engine.grammars
        if grammars is None:
            raise ApiError("bad_request", "constrained decoding ('grammar') needs the model's tokenizer", req.id)
        ends = set(req.stop_token_ids)
        if not req.ignore_eos:
            ends |= set(self.engine.model_config.eos_token_ids)
        try:
            return grammars.constraint(req.grammar, ends)
        except GrammarError as exc:
            raise ApiError("bad_request", str(exc), req.id) from None

    def expire(self, now: float) -> int:
        """End the sequences whose deadline has passed (finish_reason "deadline"); how many."""
        late = [s for s in self.all() if s.deadline is not None and now >= s.deadline]
        for s in late:
            if s.stream is not None:
                s.text += s.stream.flush()
            self._finish(s, "deadline")
        return len(late)

    def all(self) -> list[Sequence]:
        return list(self.queue) + self.prefilling + self.active

    def cancel(self, client: bytes, rid: str) -> bool:
        for s in self.all():
            if s.client == client and s.req.id == rid:
                self._finish(s, "cancelled")
                self.stats["cancelled"] += 1
                return True
        return False

    def drop_client(self, client: bytes) -> int:
        """Forget a client that went away; its sequences are freed now."""
        gone = [s for s in self.all() if s.client == client]
        for s in gone:
            self._remove(s)
        return len(gone)

    def fail_all(self, code: str, message: str) -> None:
        for s in self.all():
            self.emit(s.client, {"type": "error", "id": s.req.id, "code": code, "message": message})
            self._remove(s)

    # -- stepping ------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return bool(self.queue or self.prefilling or self.active)

    def step(self) -> None:
        """Admit, run one forward pass (prompt chunks + one decode token per running sequence), sample and emit."""
        t0 = time.perf_counter()
        self._admit()
        chunks = self._chunks()
        decoding = list(self.active)
        drafted = self._drafts_timed(decoding)
        try:
            if not chunks and not decoding:
                return
            out = self._forward(chunks, decoding, drafted)
            self._take(chunks, decoding, drafted, out)
        except StepInterrupted:  # the server is shutting down: it fails every sequence next, nothing to emit here
            raise
        except Exception as exc:  # the engine failed this step: every admitted sequence ends with the cause
            self._fail_all(exc)
            raise
        finally:
            self.stats["steps"] += 1
            self.stats["step_s"] += time.perf_counter() - t0

    def _admit(self) -> None:
        """Queued requests into prefilling, up to max_active sequences in all."""
        while self.queue and len(self.prefilling) + len(self.active) < self.max_active:
            s = self.queue.popleft()
            self.latency["queue"].observe(time.monotonic() - s.arrived)
            self.prefilling.append(s)

    def _chunks(self) -> list[tuple[Sequence, int]]:
        """(prefilling sequence, prompt tokens it gets this step), within the step's prefill_chunk tokens."""
        chunks, budget = [], self.prefill_chunk
        for s in self.prefilling:
            if budget <= 0:
                break
            n = min(budget, len(s.prompt_ids) - s.prefilled)
            chunks.append((s, n))
            budget -= n
        return chunks

    def _drafts_timed(self, decoding: list[Sequence]) -> list[list[int]]:
        """Each running sequence's drafts ([]: none this step), their cost counted."""
        t = time.perf_counter()
        drafted = self._drafts(decoding)
        made = sum(len(d) for d in drafted)
        if made:
            self.costs.drafts(made, time.perf_counter() - t)
        return drafted

    def _forward(self, chunks, decoding: list[Sequence], drafted: list[list[int]]) -> StepOutput:
        """The step's one forward: the prompt chunks, then each running sequence's last token and its drafts.
        Every row's logits where a chunk scores its prompt or a row verifies a draft; with MTP drafts, the rows
        the MTP layer takes (a chunk's every row)."""
        batch = [(np.asarray(s.prompt_ids[s.prefilled:s.prefilled + n], np.int64), s.cache) for s, n in chunks]
        batch += [(np.array([s.out_ids[-1], *d], np.int64), s.cache) for s, d in zip(decoding, drafted)]
        scored = frozenset(k for k, (s, _) in enumerate(chunks) if s.prompt_logprobs is not None)
        scored |= {len(chunks) + j for j, d in enumerate(drafted) if d}  # a drafted row's logits verify it
        mtp = self.speculative == "mtp"
        t = time.perf_counter()
        out = self.engine.step(StepBatch(batch, all_rows=scored, hidden=mtp,
                                         hidden_rows=frozenset(range(len(chunks))) if mtp else frozenset()))
        if not chunks and self.speculative != "off":  # a decode step's cost by its rows (prompt rows differ)
            self.costs.forward(sum(len(ids) for ids, _ in batch), time.perf_counter() - t)
        return out

    def _take(self, chunks, decoding: list[Sequence], drafted: list[list[int]], out: StepOutput) -> None:
        """The forward's logits to their sequences: a chunk's prompt advanced (scored, and done when whole: it
        samples its first token now), a running sequence's token sampled or its drafts verified."""
        outs, hidden, mtp = out.logits, out.hidden, self.speculative == "mtp"
        if mtp:  # a prompt chunk's rows and an undrafted decode row wait for the MTP layer; a verify's, below
            for s, h in zip([s for s, _ in chunks] + decoding, hidden):
                s.mtp_hidden.append(h)
        done = []
        for (s, n), logits in zip(chunks, outs):
            if s.prompt_logprobs is not None:
                self._score_prompt(s, n, logits)
            s.prefilled += n
            self.stats["prefill_tokens"] += n
            if s.prefilled == len(s.prompt_ids):
                s.logits = logits[-1]
                done.append(s)
        if mtp:
            self._mtp_feed([s for s, _ in chunks])
        rows = {}  # a drafted sequence -> (its drafts, their k + 1 rows of logits, their hidden rows or None)
        for j, (s, d, logits) in enumerate(zip(decoding, drafted, outs[len(chunks):])):
            s.logits = logits[-1]
            if d:
                rows[id(s)] = (d, logits, hidden[len(chunks) + j] if mtp else None)
                if mtp:
                    s.mtp_hidden.pop()  # _verify keeps the rows that stand
        for s in done:  # the prompt is cached: it samples its first token now and decodes from the next step
            self.prefilling.remove(s)
        self.active.extend(done)
        for s in list(self.active):
            try:
                if id(s) in rows:
                    self._verify(s, *rows[id(s)])
                else:
                    self._advance(s, s.logits)
            except GrammarError as exc:  # this sequence's grammar failed: it ends, the others go on
                self.stats["errors"] += 1
                self.emit(s.client, {"type": "error", "id": s.req.id, "code": "grammar", "message": str(exc)})
                self._remove(s)

    def _fail_all(self, exc: Exception) -> None:
        """The engine failed the step: every admitted sequence ends once with the cause (unavailable, with when to
        retry, where a node worker is down: pool/supervisor.py)."""
        log.exception("engine step failed")
        self.stats["errors"] += 1
        failed = {id(s): s for s in self.prefilling + self.active}  # each sequence once
        retry = getattr(exc, "retry_after_s", None)
        for s in failed.values():
            event = {"type": "error", "id": s.req.id, "code": "engine" if retry is None else "unavailable",
                     "message": f"{type(exc).__name__}: {exc}"}
            if retry is not None:
                event["retry_after_s"] = retry
            self.emit(s.client, event)
        self.prefilling = []
        self.active = []

    def _drafts(self, seqs: list[Sequence]) -> list[list[int]]:
        """Each running sequence's drafts this step: prompt lookup's, or the MTP layer's for all at once."""
        ratio = self.costs.ratio(len(seqs))
        ks = [self._draft_length(s, ratio) for s in seqs]
        if self.speculative == "mtp":
            return self._mtp_drafts(seqs, ks)
        return [s.lookup.draft(s.history[:len(s.prompt_ids) + len(s.out_ids)], k) if k > 0 else []
                for s, k in zip(seqs, ks)]

    def _draft_length(self, s: Sequence, ratio: float) -> int:
        """How many tokens s drafts this step at a draft's cost ``ratio`` (none when speculation is off or paused
        for it), at most as many as its remaining tokens allow."""
        if s.drafts is None:
            return 0
        return max(0, min(s.drafts.next(ratio), s.req.max_new_tokens - len(s.out_ids) - 1))

    def _mtp_drafts(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """MTP drafts, the MTP layer's greedy tokens: a drafting sequence's first pass feeds it every position not
        yet fed (hidden state h_i with token t_(i+1), the last one's token the one just chosen) and its last row
        gives draft 1; draft j + 1 comes from feeding draft j with the row's own output in place of the model's
        hidden state, as vLLM and llama.cpp chain it. Those chained positions are dropped at the verify. Rows
        that waited longer than a prompt chunk (steps without drafts) are fed first in chunk-long passes; after a
        pause of more than MTP_CATCH_UP steps the MTP cache restarts that many positions back (_mtp_restart)."""
        drafts: list[list[int]] = [[] for _ in seqs]
        drafting = [s for s, k in zip(seqs, ks) if k > 0]
        if not drafting:  # all paused: nothing to feed or draft this step
            return drafts
        for s in drafting:
            self._mtp_restart(s)
        self._mtp_feed(drafting, lambda s: s.cache.length - self.prefill_chunk)
        batch, live = [], []  # one MTP pass: (hidden rows, their next tokens, cache) per sequence in ``live``
        for j, (s, k) in enumerate(zip(seqs, ks)):
            if k <= 0:
                continue
            fed, cached = s.mtp_cache.position, s.cache.length  # positions fed / cached by the model
            batch.append((s.mtp_hidden, s.history[fed + 1:cached + 1].copy(), s.mtp_cache))
            s.mtp_hidden = []
            live.append(j)
        while live:
            logits_rows, hidden_rows = self.engine.mtp_step(batch)
            nxt = []
            for j, logits, h in zip(live, logits_rows, hidden_rows):
                drafts[j].append(int(np.argmax(logits[-1])))
                if len(drafts[j]) < ks[j]:
                    nxt.append((j, h))
            live = [j for j, _ in nxt]
            batch = [([h], np.array(drafts[j][-1:], np.int64), seqs[j].mtp_cache) for j, h in nxt]
        return drafts

    @staticmethod
    def _mtp_restart(s: Sequence) -> None:
        """After a pause of more than MTP_CATCH_UP steps, s's MTP cache goes on from MTP_CATCH_UP positions back
        instead of being fed every position it skipped: an off-switched sequence's probe costs a few rows, not a
        one-layer pass over the whole pause (its drafts attend to the positions since the restart; they are
        verified as any others)."""
        waiting = s.cache.length - s.mtp_cache.position  # the rows in s.mtp_hidden
        if waiting > MTP_CATCH_UP:
            s.mtp_hidden = split_rows(s.mtp_hidden, waiting - MTP_CATCH_UP)[1]
            s.mtp_cache.restart(s.cache.length - MTP_CATCH_UP)

    def _mtp_feed(self, seqs: list[Sequence], upto: Callable[[Sequence], int] | None = None) -> None:
        """Feed the MTP layer the sequences' waiting positions up to ``upto(s)`` (by default the prefilling ones'
        positions whose next token is a prompt token: the last prompt row waits for the token chosen), in passes
        of at most a prompt chunk's rows each, all sequences together."""
        upto = upto or (lambda s: min(s.prefilled, len(s.prompt_ids) - 1))
        while True:
            batch = []
            for s in seqs:
                fed = s.mtp_cache.position
                end = min(upto(s), fed + self.prefill_chunk)
                if end <= fed:
                    continue
                rows, s.mtp_hidden = split_rows(s.mtp_hidden, end - fed)  # the first end - fed rows waiting
                batch.append((rows, s.history[fed + 1:end + 1].copy(), s.mtp_cache))
            if not batch:
                return
            self.engine.mtp_step(batch)

    def _verify(self, s: Sequence, drafts: list[int], rows: np.ndarray, hidden=None) -> None:
        """Choose s's tokens from its k + 1 rows (row j: after drafts 1..j) in order, taking each draft the rule
        allows, up to the first that it does not; the cache keeps what stands, and with MTP drafts (``hidden``:
        the k + 1 rows' hidden states) the MTP cache its positions before the drafts and the rows that stand
        wait for the MTP layer."""
        cached = s.cache.length - len(drafts)  # after the last token chosen, whose row is rows[0]
        took = 0
        for j, logits in enumerate(rows):
            draft = drafts[j] if j < len(drafts) else None
            if not self._advance(s, logits, draft) or s.out_ids[-1] != draft:
                break
            took += 1
        s.drafts.update(len(drafts), took)
        self.stats["drafted_tokens"] += len(drafts)
        self.stats["accepted_drafts"] += took
        s.cache.truncate(cached + took)
        if hidden is not None:
            s.mtp_cache.truncate(cached - 1 - s.mtp_cache.start)  # the chained drafts' go; the model's rows come next
            s.mtp_hidden = [hidden[:took + 1]]

    def _advance(self, s: Sequence, logits: np.ndarray, draft: int | None = None) -> bool:
        """Choose one token for s from ``logits`` (taking ``draft`` where the rule allows) and emit; False when s
        is finished."""
        token, logits = s.sampler.choose(logits, draft)
        s.out_ids.append(token)
        if s.history is not None:
            s.history[len(s.prompt_ids) + len(s.out_ids) - 1] = token
        now = time.monotonic()
        if s.last_token_at is None:
            self.latency["first_token"].observe(now - s.arrived)
        else:
            self.latency["inter_token"].observe(now - s.last_token_at)
        s.last_token_at = now
        if s.logprobs is not None:
            s.logprobs.append(self._logprobs_entry(logits, token, s.req.logprobs))
        self.stats["tokens"] += 1
        eos = ((token in self.engine.model_config.eos_token_ids and not s.req.ignore_eos)
               or token in s.req.stop_token_ids)
        if s.stream is not None and not eos:
            s.text += s.stream.push(token)
        reason = None
        for stop in s.req.stop:
            cut = s.text.find(stop)
            if cut >= 0:
                s.text, reason = s.text[:cut], "stop"
        if reason is None and eos:
            reason = "eos"
        if reason is None and len(s.out_ids) >= s.req.max_new_tokens:
            if s.stream is not None:
                s.text += s.stream.flush()
            reason = "length"
        if s.req.stream:
            upto = len(s.text) if reason else len(s.text) - held_back(s.text, s.req.stop)
            if upto > s.emitted:
                ev = {"type": "token", "id": s.req.id, "text": s.text[s.emitted:upto], "ids": s.out_ids[s.sent:]}
                if s.logprobs is not None:
                    ev["logprobs"] = s.logprobs[s.sent:]
                if s.prompt_logprobs is not None and s.sent == 0:  # the prompt is scored by now: a stream's echo
                    ev["prompt_logprobs"] = s.prompt_logprobs
                self.emit(s.client, ev)
                s.emitted, s.sent = upto, len(s.out_ids)
        if reason:
            self._finish(s, reason)
            self.stats["completed"] += 1
            return False
        return True

    def _finish(self, s: Sequence, reason: str) -> None:
        self.latency["end_to_end"].observe(time.monotonic() - s.arrived)
        log.info("request %s: %d prompt + %d new tokens in %.2f s, %s", s.req.id, len(s.prompt_ids), len(s.out_ids),
                 time.monotonic() - s.started, reason)
        ev = {"type": "final", "id": s.req.id, "finish_reason": reason, "text": s.text, "ids": s.out_ids}
        if s.logprobs is not None:
            ev["logprobs"] = s.logprobs
        if s.prompt_logprobs is not None:
            ev["prompt_logprobs"] = s.prompt_logprobs
        ev["usage"] = {"prompt_tokens": len(s.prompt_ids), "completion_tokens": len(s.out_ids)}
        self.emit(s.client, ev)
        self._remove(s)

    def _score_prompt(self, s: Sequence, n: int, logits: np.ndarray) -> None:
        """The entries of the prompt tokens a chunk's rows predict: row j (prompt position prefilled + j) gives
        the next prompt token's log-probability, raw (no penalty or bias), with the request's alternatives."""
        for j in range(n):
            nxt = s.prefilled + j + 1
            if nxt < len(s.prompt_ids):
                s.prompt_logprobs.append(self._logprobs_entry(logits[j], s.prompt_ids[nxt], s.req.prompt_logprobs))

    def _token_text(self, token: int) -> str:
        return self.engine.decode([token]) if self.engine.codec is not None else ""

    def _logprobs_entry(self, logits: np.ndarray, token: int, n: int) -> dict:
        """The logprobs entry of a chosen token: its log-probability under ``logits`` (after the penalties, before
        temperature and the filters) and the n most likely ids."""
        chosen, top = top_logprobs(logits, token, n)
        return {"id": token, "token": self._token_text(token), "logprob": chosen,
                "top": [{"id": i, "token": self._token_text(i), "logprob": lp} for i, lp in top]}

    def _remove(self, s: Sequence) -> None:
        if s.drafts is not None:
            self.history.keep(s.drafts)
        if s in self.active:
            self.active.remove(s)
        elif s in self.prefilling:
            self.prefilling.remove(s)
        elif s in self.queue:
            self.queue.remove(s)


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    ids: list[int]  # generated ids, the one that ended it (an eos or stop token id, a stop string's end) included
    finish_reason: str  # "length" | "eos" | "stop"
    prefill_s: float
    decode_s: float
    timings: dict = field(default_factory=dict)
    text: str | None = None  # the completion, cut before a stop string; None for a model without a tokenizer


ONE = b"generate"  # the client of a request driven by ``generate``


def generate(engine, req: GenerateRequest, on_token: Callable[[int], None] | None = None,
             on_text: Callable[[str], None] | None = None, speculative: str | None = None) -> GenerationResult:
    """One request driven to its end by a Scheduler of its own: the serving loop's admission, steps, sampling
    and stopping, with the prompt prefilled in one pass. ``on_token`` sees each id as it is chosen,
    ``on_text`` each piece of text as the stream lets it out (text that may begin a stop string held back;
    ``req.stream`` on). An exception from either ends the request, its sequence freed, and goes on to the
    caller; a request the scheduler refuses is a ConfigValueError. ``speculative``: the engine's config's when
    None; the timings count the drafts tried and taken."""
    final: dict = {}

    def emit(_client: bytes, event: dict) -> None:
        if event["type"] == "token" and on_text is not None:
            on_text(event["text"])
        elif event["type"] == "final":
            final.update(event)

    ids = list(req.prompt_ids) if req.prompt_ids is not None else engine.encode(req.prompt)
    sched = Scheduler(engine, emit, max_active=1, max_queued=1, prefill_chunk=max(len(ids), 1),
                      speculative=speculative)
    try:
        seq = sched.add(ONE, req, ids)
    except ApiError as exc:
        raise ConfigValueError(exc.message) from None
    seen = 0
    t0 = time.perf_counter()
    t1 = None  # the prompt is prefilled and the first token chosen in the first step
    try:
        while sched.busy:
            sched.step()
            t1 = t1 or time.perf_counter()
            for token in seq.out_ids[seen:]:
                if on_token is not None:
                    on_token(token)
            seen = len(seq.out_ids)
    finally:
        sched.drop_client(ONE)
    t2 = time.perf_counter()
    t1 = t1 or t2
    decode_steps = max(len(seq.out_ids) - 1, 0)
    timings = {
        "prefill_tokens": len(ids), "prefill_s": t1 - t0,
        "prefill_tokens_per_s": len(ids) / (t1 - t0) if t1 > t0 else None,
        "decode_tokens": decode_steps, "decode_s": t2 - t1,
        "decode_tokens_per_s": decode_steps / (t2 - t1) if decode_steps and t2 > t1 else None,
        "time_to_first_token_s": t1 - t0,
        "steps": sched.stats["steps"], "drafted_tokens": sched.stats["drafted_tokens"],
        "accepted_drafts": sched.stats["accepted_drafts"],
    }
    return GenerationResult(ids, list(seq.out_ids), final.get("finish_reason", "length"), t1 - t0, t2 - t1,
                            timings, final.get("text") if engine.codec is not None else None)
