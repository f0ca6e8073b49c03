"""The client API's documents: requests, events, and their typed decoder.

Every message is one ZeroMQ frame holding a UTF-8 JSON object (never pickle).
Requests carry ``"type"`` and, except ``stats`` and ``health``, a client-chosen
``"id"`` (a string of at most 128 characters) that every event about it repeats.

Requests::

    {"type": "generate", "id": "r1", "prompt": "text"  |  "prompt_ids": [1, 2],
     "max_new_tokens": 64, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": null,
     "stop": ["\\n\\n"], "stream": true, "deadline_s": null}
    {"type": "cancel", "id": "r1"}
    {"type": "stats"}            {"type": "health"}

Events::

    {"type": "token", "id": "r1", "text": "piece", "ids": [..]}           (stream=true)
    {"type": "final", "id": "r1", "finish_reason": "length"|"eos"|"stop"|"cancelled"|"deadline",
     "text": "whole completion", "ids": [..], "usage": {"prompt_tokens": n, "completion_tokens": m}}
    {"type": "error", "id": "r1"|null, "code": "bad_request"|"busy"|"too_long"|"engine"|"shutdown"|"internal"|...,
     "message": "what went wrong"}

``deadline_s`` (optional, seconds from arrival) ends a request that is not done
by then with finish_reason "deadline" and the text made so far. Every string
must be valid Unicode (no lone surrogates). A request the server cannot handle
gets an error event; it never ends the server.
    {"type": "stats", ...}        {"type": "health", ...}
"""

from __future__ import annotations

import json
from dataclasses import dataclass

MAX_ID_CHARS = 128
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 256
MAX_DEADLINE_S = 7 * 24 * 3600.0

# Serving defaults, set here and nowhere else: ``strata serve``/``strata client`` flags, Limits, Server,
# Scheduler and Client take their defaults from these names.
DEFAULT_ADDRESS = "tcp://127.0.0.1:5557"  # the server's bind address and the client's
DEFAULT_MAX_ACTIVE = 8  # sequences decoded together
DEFAULT_MAX_QUEUED = 32  # waiting requests before 'busy'
DEFAULT_MAX_NEW_TOKENS_LIMIT = 4096  # the most max_new_tokens a request may ask for
DEFAULT_MAX_PROMPT_TOKENS = 32768  # the longest prompt accepted, in tokens
DEFAULT_MAX_PROMPT_CHARS = 1 << 20  # the longest text prompt accepted, in characters
MAX_REQUEST_BYTES = 4 << 20  # one request frame; the server refuses more (libzmq MAXMSGSIZE)


class ApiError(ValueError):
    """A request the server refuses; ``code`` goes into the error event."""

    def __init__(self, code: str, message: str, request_id: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


@dataclass(frozen=True)
class Limits:
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS_LIMIT
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS


@dataclass(frozen=True)
class GenerateRequest:
    id: str
    prompt: str | None
    prompt_ids: tuple[int, ...] | None
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    deadline_s: float | None = None


@dataclass(frozen=True)
class CancelRequest:
    id: str


@dataclass(frozen=True)
class StatsRequest:
    pass


@dataclass(frozen=True)
class HealthRequest:
    pass


GENERATE_FIELDS = {"type", "id", "prompt", "prompt_ids", "max_new_tokens", "temperature", "top_p", "top_k", "seed",
                   "stop", "stream", "deadline_s"}


def _int(doc: dict, key: str, default, lo: int, hi: int, rid) -> int:
    v = doc.get(key, default)
    if v is None and default is None:
        return None  # type: ignore[return-value]
    if not isinstance(v, int) or isinstance(v, bool):
        raise ApiError("bad_request", f"'{key}' must be an integer, got {type(v).__name__}", rid)
    if not lo <= v <= hi:
        code = "too_long" if key == "max_new_tokens" and v > hi else "bad_request"
        raise ApiError(code, f"'{key}' must be between {lo} and {hi}, got {v}", rid)
    return v


def _float(doc: dict, key: str, default: float, lo: float, hi: float, rid, lo_open: bool = False) -> float:
    v = doc.get(key, default)
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise ApiError("bad_request", f"'{key}' must be a number, got {type(v).__name__}", rid)
    if not (lo < v if lo_open else lo <= v) or v > hi or v != v:
        raise ApiError("bad_request", f"'{key}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", rid)
    return float(v)


def lone_surrogate(text: str) -> int | None:
    """The index of the first lone surrogate in ``text`` (JSON's "\\ud800" decodes to one), or None."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as exc:
        return exc.start


def _text(value: str, key: str, rid) -> str:
    at = lone_surrogate(value)
    if at is not None:
        raise ApiError("bad_request", f"'{key}' holds a lone UTF-16 surrogate at character {at}: it is not "
                                      "valid Unicode text", rid)
    return value


def _id(doc: dict, required: bool = True) -> str | None:
    rid = doc.get("id")
    if rid is None and not required:
        return None
    if not isinstance(rid, str) or not 0 < len(rid) <= MAX_ID_CHARS:
        raise ApiError("bad_request", f"'id' must be a non-empty string of at most {MAX_ID_CHARS} characters")
    return _text(rid, "id", None)


def decode_request(raw: bytes, limits: Limits):
    """One frame -> a typed request, or ApiError naming the field at fault."""
    try:
        doc = json.loads(raw)
    except RecursionError:
        raise ApiError("bad_request", "request is nested too deeply to be a request") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of too many digits
        raise ApiError("bad_request", f"request is not UTF-8 JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ApiError("bad_request", "request must be a JSON object")
    kind = doc.get("type")
    if kind == "stats":
        return StatsRequest()
    if kind == "health":
        return HealthRequest()
    if kind == "cancel":
        return CancelRequest(_id(doc))
    if kind != "generate":
        shown = repr(kind) if isinstance(kind, str) and len(kind) <= 64 else f"a {type(kind).__name__}"
        rid = doc.get("id")
        raise ApiError("bad_request", f"'type' must be one of generate, cancel, stats, health; got {shown}",
                       rid if isinstance(rid, str) and len(rid) <= MAX_ID_CHARS and lone_surrogate(rid) is None
                       else None)
    rid = _id(doc)
    unknown = sorted(set(doc) - GENERATE_FIELDS)
    if unknown:
        raise ApiError("bad_request", f"unknown field(s): {', '.join(unknown)}", rid)
    prompt, prompt_ids = doc.get("prompt"), doc.get("prompt_ids")
    if (prompt is None) == (prompt_ids is None):
        raise ApiError("bad_request", "give exactly one of 'prompt' (text) and 'prompt_ids' (list of integers)", rid)
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt:
            raise ApiError("bad_request", "'prompt' must be a non-empty string", rid)
        _text(prompt, "prompt", rid)
        if len(prompt) > limits.max_prompt_chars:
            raise ApiError("too_long", f"'prompt' has {len(prompt)} characters; the limit is "
                                       f"{limits.max_prompt_chars}", rid)
    else:
        if not isinstance(prompt_ids, list) or not prompt_ids or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt_ids):
            raise ApiError("bad_request", "'prompt_ids' must be a non-empty list of integers", rid)
        if len(prompt_ids) > limits.max_prompt_tokens:
            raise ApiError("too_long", f"'prompt_ids' has {len(prompt_ids)} tokens; the limit is "
                                       f"{limits.max_prompt_tokens}", rid)
        prompt_ids = tuple(prompt_ids)
    stop = doc.get("stop", [])
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS or not all(
            isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop):
        raise ApiError("bad_request", f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} "
                                      f"non-empty strings of at most {MAX_STOP_CHARS} characters", rid)
    for s in stop:
        _text(s, "stop", rid)
    stream = doc.get("stream", True)
    if not isinstance(stream, bool):
        raise ApiError("bad_request", "'stream' must be true or false", rid)
    return GenerateRequest(
        id=rid, prompt=prompt, prompt_ids=prompt_ids,
        max_new_tokens=_int(doc, "max_new_tokens", 64, 1, limits.max_new_tokens, rid),
        temperature=_float(doc, "temperature", 0.0, 0.0, 100.0, rid),
        top_p=_float(doc, "top_p", 1.0, 0.0, 1.0, rid, lo_open=True),
        top_k=_int(doc, "top_k", 0, 0, 1 << 20, rid),
        seed=_int(doc, "seed", None, 0, 2**63 - 1, rid),
        stop=tuple(stop), stream=stream,
        deadline_s=None if doc.get("deadline_s") is None else _float(doc, "deadline_s", 0.0, 0.0, MAX_DEADLINE_S, rid,
                                                                     lo_open=True),
    )


def encode_event(doc: dict) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def error_event(code: str, message: str, request_id: str | None = None) -> dict:
    return {"type": "error", "id": request_id, "code": code, "message": message}
