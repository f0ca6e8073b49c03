"""Continuous batching of generate requests over one Engine, free of sockets.

Each ``step`` admits queued requests (their prompts prefilled together), samples
one token for every active sequence, emits its events, and runs one decode pass
for all sequences still going, so the expert pool sees one batch per layer and a
new request joins at the next step. The server drives it; tests drive it
in-process.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .api import ApiError, GenerateRequest, Limits
from .kv_cache import KVCache
from .sampling import Sampler, SamplingParams
from .tokenizer import StreamDecoder

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
    text: str = ""  # completion text so far (stop strings cut it)
    emitted: int = 0  # characters of ``text`` already streamed
    logits: np.ndarray | None = None  # [V] for the next token


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
    def __init__(self, engine, emit: Emit, max_active: int = 8, max_queued: int = 32, limits: Limits = Limits()):
        self.engine = engine
        self.limits = limits
        self.emit = emit
        self.max_active = max_active
        self.max_queued = max_queued
        self.queue: deque[Sequence] = deque()
        self.active: list[Sequence] = []
        self.stats = {"requests": 0, "completed": 0, "cancelled": 0, "errors": 0, "tokens": 0, "steps": 0,
                      "busy_rejections": 0, "started": time.time(), "step_s": 0.0}

    # -- admission -----------------------------------------------------------
    def add(self, client: bytes, req: GenerateRequest) -> None:
        if any(s.req.id == req.id and s.client == client for s in self.all()):
            raise ApiError("bad_request", f"request id {req.id!r} is already in flight", req.id)
        if len(self.queue) >= self.max_queued:
            self.stats["busy_rejections"] += 1
            raise ApiError("busy", f"the queue is full ({self.max_queued} requests waiting); retry later", req.id)
        eng = self.engine
        if req.prompt is not None:
            ids = eng.encode(req.prompt)
            if not ids:
                raise ApiError("bad_request", "the prompt encodes to no tokens", req.id)
            if len(ids) > self.limits.max_prompt_tokens:
                raise ApiError("too_long", f"the prompt is {len(ids)} tokens; the limit is "
                                           f"{self.limits.max_prompt_tokens}", req.id)
        else:
            ids = list(req.prompt_ids)
        try:
            eng._check_ids(ids, req.max_new_tokens)
            sampler = Sampler(SamplingParams(req.temperature, req.top_k, req.top_p, req.seed))
        except ValueError as exc:
            code = "too_long" if "exceed" in str(exc) else "bad_request"
            raise ApiError(code, str(exc), req.id) from None
        stream = StreamDecoder(eng.codec) if eng.codec is not None else None
        self.queue.append(Sequence(client, req, ids, sampler, eng.decoder.new_cache(), stream))
        self.stats["requests"] += 1

    def all(self) -> list[Sequence]:
        return list(self.queue) + self.active

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
        return bool(self.queue or self.active)

    def step(self) -> None:
        t0 = time.perf_counter()
        admitted = []
        while self.queue and len(self.active) + len(admitted) < self.max_active:
            admitted.append(self.queue.popleft())
        try:
            if admitted:
                outs = self.engine.decoder.forward_batch(
                    [(np.asarray(s.prompt_ids, np.int64), s.cache) for s in admitted])
                for s, logits in zip(admitted, outs):
                    s.logits = logits[-1]
                self.active.extend(admitted)
            going = [s for s in self.active if self._advance(s)]
            if going:
                outs = self.engine.decoder.forward_batch(
                    [(np.array([s.out_ids[-1]], np.int64), s.cache) for s in going])
                for s, logits in zip(going, outs):
                    s.logits = logits[-1]
        except Exception as exc:  # the engine failed this step: every sequence in it ends with the cause
            log.exception("engine step failed")
            self.stats["errors"] += 1
            failed = {id(s): s for s in admitted + self.active}  # each sequence once
            for s in failed.values():
                self.emit(s.client, {"type": "error", "id": s.req.id, "code": "engine",
                                     "message": f"{type(exc).__name__}: {exc}"})
            self.active = []
            raise
        finally:
            self.stats["steps"] += 1
            self.stats["step_s"] += time.perf_counter() - t0

    def _advance(self, s: Sequence) -> bool:
        """Sample one token for s and emit; False when s is finished."""
        token = s.sampler(s.logits)
        s.out_ids.append(token)
        self.stats["tokens"] += 1
        eos = token in self.engine.model_config.eos_token_ids
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
                self.emit(s.client, {"type": "token", "id": s.req.id, "text": s.text[s.emitted:upto], "ids": [token]})
                s.emitted = upto
        if reason:
            self._finish(s, reason)
            self.stats["completed"] += 1
            return False
        return True

    def _finish(self, s: Sequence, reason: str) -> None:
        self.emit(s.client, {
            "type": "final", "id": s.req.id, "finish_reason": reason, "text": s.text, "ids": s.out_ids,
            "usage": {"prompt_tokens": len(s.prompt_ids), "completion_tokens": len(s.out_ids)},
        })
        self._remove(s)

    def _remove(self, s: Sequence) -> None:
        if s in self.active:
            self.active.remove(s)
        elif s in self.queue:
            self.queue.remove(s)
