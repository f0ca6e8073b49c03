"""OpenAI's request and response documents, to and from the ZeroMQ API's (api.py).

Pure functions, free of sockets: http.py serves them, tests drive them alone.

A request becomes one ZeroMQ ``generate`` document per prompt and choice (a completions ``prompt`` may
be a list of prompts; ``n`` choices each); its fields keep OpenAI's names and ranges in every error
(``param`` names the field at fault). ``echo`` (completions) puts the prompt before the text and, with
``logprobs``, the prompt tokens' log-probabilities before the completion's (the engine's
``prompt_logprobs``); ``max_tokens`` 0 with ``echo`` returns the prompt alone, as evaluation harnesses
ask. ``response_format`` ``json_object`` and ``json_schema`` become the ZeroMQ API's ``grammar``
(constrained decoding: the text always parses, and matches the schema). Fields this engine cannot honour
with a non-default value (``best_of`` > 1, ``suffix``, non-text message parts) are refused with a 400
rather than ignored; fields it has no use for (``metadata``, ``store``...) are ignored, as OpenAI's own
server does.

Defaults follow OpenAI: ``temperature`` 1, ``top_p`` 1, ``max_tokens`` 16 for
completions and, for chat, whatever the context has left (within the server's
``--max-new-tokens-limit``). ``top_k``, ``min_p`` and ``repetition_penalty``
and ``stop_token_ids`` are the extensions vLLM and llama-server take (``top_k``
-1 or 0: off).

Finish reasons: the engine's ``eos`` and ``stop`` are OpenAI's ``stop``; its
``length`` and ``deadline`` are ``length``.
"""

from __future__ import annotations

from dataclasses import dataclass

import json
import math
import time
import uuid

from .api import (MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, ApiError, lone_surrogate, read_float, read_int,
                  read_logit_bias)

# the ZeroMQ API's error codes -> HTTP status (busy: the queue is full; shutdown: the server is stopping)
STATUS_OF_CODE = {"bad_request": 400, "too_long": 400, "not_found": 404, "busy": 429, "shutdown": 503,
                  "unavailable": 503, "engine": 500, "grammar": 500, "internal": 500}
RETRY_AFTER_S = {"busy": 1.0, "unavailable": 1.0}  # codes worth retrying: the least Retry-After, seconds
TYPE_OF_STATUS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                  405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
                  429: "rate_limit_error", 500: "server_error", 503: "server_error"}
FINISH_REASON = {"eos": "stop", "stop": "stop", "length": "length", "deadline": "length", "cancelled": "stop"}
MAX_TOP_LOGPROBS = 20
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
ROLES = ("system", "developer", "user", "assistant", "tool")


class OpenAIError(Exception):
    """A request answered with an OpenAI error document and an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s  # the Retry-After header's seconds (429, 503), None: no header

    def headers(self) -> dict:
        return {} if self.retry_after_s is None else {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": TYPE_OF_STATUS.get(status, "server_error"), "param": param,
                      "code": code}}


def from_engine_error(event: dict) -> OpenAIError:
    """An error event of the ZeroMQ API -> the HTTP error it stands for."""
    code = event.get("code", "internal")
    retry = RETRY_AFTER_S.get(code)
    if retry is not None and isinstance(event.get("retry_after_s"), (int, float)):
        retry = max(retry, float(event["retry_after_s"]))
    return OpenAIError(STATUS_OF_CODE.get(code, 500), event.get("message", "engine error"), code=code,
                       retry_after_s=retry)


def _field(check, body: dict, key: str, default, lo, hi, **kwargs):
    """``body[key]`` checked by api.py's validator (``default`` when absent or null), its ApiError turned into a
    400 naming the OpenAI field."""
    if body.get(key) is None:
        return default
    try:
        return check(body, key, default, lo, hi, None, **kwargs)
    except ApiError as exc:
        raise OpenAIError(400, exc.message, param=key) from None


def check_model(body: dict, served: str) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise OpenAIError(400, "'model' must be a string", param="model")
    if model != served:
        raise OpenAIError(404, f"the model '{model}' does not exist; this server serves '{served}'", param="model",
                          code="model_not_found")


MAX_N = 16  # choices a request may ask for (each one a sequence of its own in the batch)


def choices(body: dict) -> int:
    """``n``: how many choices to make for the prompt, 1..MAX_N."""
    return _field(read_int, body, "n", 1, 1, MAX_N)


def _refuse_unsupported(body: dict) -> None:
    choices(body)
    if body.get("best_of") not in (None, 1):
        raise OpenAIError(400, "'best_of' must be 1", param="best_of")
    if body.get("echo") is not None and not isinstance(body["echo"], bool):
        raise OpenAIError(400, "'echo' must be true or false", param="echo")
    if body.get("suffix") is not None:
        raise OpenAIError(400, "'suffix' is not supported", param="suffix")
    _check_types(body)


def tool_choice(body: dict) -> str | dict:
    """``tool_choice`` checked: "none", "auto", "required" or {"type": "function", "function": {"name": N}};
    absent: "auto" when the request has tools, else "none" (OpenAI's defaults)."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if body.get("tools") else "none"
    if not (choice in ("none", "auto", "required") or (isinstance(choice, dict) and choice.get("type") == "function"
                                                        and isinstance(choice.get("function"), dict)
                                                        and isinstance(choice["function"].get("name"), str))):
        raise OpenAIError(400, "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": "
                               "\"function\", \"function\": {\"name\": ...}}", param="tool_choice")
    return choice


def parallel_tool_calls(body: dict) -> bool:
    """``parallel_tool_calls`` (default true): false holds a forced tool choice to one call."""
    value = body.get("parallel_tool_calls")
    if value is None:
        return True
    if not isinstance(value, bool):
        raise OpenAIError(400, "'parallel_tool_calls' must be true or false", param="parallel_tool_calls")
    return value


def _check_types(body: dict) -> None:
    """The fields this server does not act on, refused when they would change the answer and checked for
    their type when they would not: none is taken silently."""
    tool_choice(body)
    parallel_tool_calls(body)
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise OpenAIError(400, "'user' must be a string", param="user")
    for old in ("functions", "function_call"):
        if body.get(old) is not None:
            raise OpenAIError(400, f"'{old}' is not supported: use 'tools'", param=old)
    if body.get("ignore_eos") is not None:
        if not isinstance(body["ignore_eos"], bool):
            raise OpenAIError(400, "'ignore_eos' must be true or false", param="ignore_eos")
        if body["ignore_eos"]:
            raise OpenAIError(400, "'ignore_eos' is not supported", param="ignore_eos")
    if body.get("min_tokens") is not None:
        v = body["min_tokens"]
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise OpenAIError(400, "'min_tokens' must be an integer >= 0", param="min_tokens")
        if v > 0:
            raise OpenAIError(400, "'min_tokens' other than 0 is not supported", param="min_tokens")


def response_grammar(body: dict) -> dict | None:
    """``response_format`` -> the ZeroMQ API's ``grammar`` (None for text): {"type": "json_object"} is any JSON
    object, {"type": "json_schema", "json_schema": {"name", "schema", "strict"}} one matching the schema
    (strict or not: the grammar always holds it to the schema)."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(
                spec.get("schema", {}), dict) or not isinstance(spec.get("strict", False), (bool, type(None))):
            raise OpenAIError(400, "'response_format.json_schema' must be an object with a 'name' string, a "
                                   "'schema' object and an optional 'strict' boolean", param="response_format")
        return {"type": "json_schema", "schema": spec.get("schema", {"type": "object"})}
    raise OpenAIError(400, "'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                           "{\"type\": \"json_schema\", \"json_schema\": {...}}", param="response_format")


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS or not all(
            isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop):
        raise OpenAIError(400, f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} non-empty strings "
                               f"of at most {MAX_STOP_CHARS} characters", param="stop")  # the ZeroMQ API's words
    return stop


def _stop_token_ids(body: dict) -> list[int]:
    ids = body.get("stop_token_ids")
    if ids is None:
        return []
    if not isinstance(ids, list) or len(ids) > MAX_STOP_TOKEN_IDS or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise OpenAIError(400, f"'stop_token_ids' must be a list of at most {MAX_STOP_TOKEN_IDS} token ids",
                          param="stop_token_ids")
    return ids


def _logit_bias(body: dict) -> dict:
    """``logit_bias`` checked as the ZeroMQ API checks it (api.read_logit_bias), passed on as given."""
    try:
        read_logit_bias(body.get("logit_bias"), None)
    except ApiError as exc:
        raise OpenAIError(400, exc.message, param="logit_bias") from None
    return body.get("logit_bias") or {}


def echo(body: dict) -> bool:
    return bool(body.get("echo"))


MAX_PROMPTS = 256  # prompts one completions request may hold


def _max_tokens(body: dict, default: int | None, limit: int) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        if body.get(key) is not None:
            return _field(read_int, body, key, None, 0 if echo(body) else 1, limit)  # 0: the echoed prompt alone
    return default


def stream_flags(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage)"""
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise OpenAIError(400, "'stream' must be true or false", param="stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise OpenAIError(400, "'stream_options' must be an object like {\"include_usage\": true}",
                          param="stream_options")
    if not stream:
        raise OpenAIError(400, "'stream_options' is only allowed with 'stream': true", param="stream_options")
    return stream, options.get("include_usage", False)


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives to return with each token's logprob; None = no logprobs."""
    if chat:
        wanted = body.get("logprobs", False)
        if wanted is None:
            wanted = False
        if not isinstance(wanted, bool):
            raise OpenAIError(400, "'logprobs' must be true or false", param="logprobs")
        top = _field(read_int, body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
        if top is not None and not wanted:
            raise OpenAIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return (top or 0) if wanted else None
    return _field(read_int, body, "logprobs", None, 0, MAX_TOP_LOGPROBS)


def generate_fields(body: dict, *, chat: bool, max_new_tokens_limit: int, default_max_tokens: int | None) -> dict:
    """The sampling and stopping fields of a ZeroMQ generate document, from an OpenAI request body."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    _refuse_unsupported(body)
    if echo(body) and chat:
        raise OpenAIError(400, "'echo' is for /v1/completions", param="echo")
    if not chat and tool_choice(body) not in ("none", "auto"):
        raise OpenAIError(400, "'tool_choice' is for /v1/chat/completions with 'tools'", param="tool_choice")
    logprobs = _logprobs(body, chat)
    return {
        "max_new_tokens": _max_tokens(body, default_max_tokens, max_new_tokens_limit),
        "temperature": _field(read_float, body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _field(read_float, body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        "top_k": max(_field(read_int, body, "top_k", 0, -1, 1 << 20), 0),
        "min_p": _field(read_float, body, "min_p", 0.0, 0.0, 1.0),
        "presence_penalty": _field(read_float, body, "presence_penalty", 0.0, -2.0, 2.0),
        "frequency_penalty": _field(read_float, body, "frequency_penalty", 0.0, -2.0, 2.0),
        "repetition_penalty": _field(read_float, body, "repetition_penalty", 1.0, 0.0, 10.0, lo_open=True),
        "seed": _field(read_int, body, "seed", None, 0, 2**63 - 1),
        "stop": _stop(body),
        "stop_token_ids": _stop_token_ids(body),
        "logprobs": logprobs,
        "prompt_logprobs": logprobs if echo(body) else None,
        "logit_bias": _logit_bias(body),
        "grammar": response_grammar(body),
    }


def completion_prompts(body: dict) -> list[str | list[int]]:
    """/v1/completions' ``prompt``: a string, a list of token ids, or a list of those (several prompts)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts = prompt
    else:
        prompts = [prompt]
    if len(prompts) > MAX_PROMPTS:
        raise OpenAIError(400, f"'prompt' holds {len(prompts)} prompts; the limit is {MAX_PROMPTS}", param="prompt")
    for p in prompts:
        if not (isinstance(p, str) and p) and not (isinstance(p, list) and p and all(
                isinstance(t, int) and not isinstance(t, bool) for t in p)):
            raise OpenAIError(400, "'prompt' must be a non-empty string, a non-empty list of token ids, or a list "
                                   "of those", param="prompt")
    return prompts


def _text_content(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise OpenAIError(400, f"{where}: only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                                       "supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)
    raise OpenAIError(400, f"{where}: 'content' must be a string or a list of text parts", param="messages")


def check_unicode(value, param: str, where: str | None = None) -> None:
    """Every string in ``value`` (nested lists and objects, keys too) valid Unicode: a lone UTF-16 surrogate
    (JSON's "\\ud800") cannot be tokenised, and is refused naming where it is."""
    if isinstance(value, str):
        at = lone_surrogate(value)
        if at is not None:
            raise OpenAIError(400, f"{where or param} holds a lone UTF-16 surrogate at character {at}: it is not "
                                   "valid Unicode", param=param)
    elif isinstance(value, dict):
        for k, v in value.items():
            check_unicode(k, param, where)
            check_unicode(v, param, f"{where or param}.{k}" if isinstance(k, str) and lone_surrogate(k) is None
                          else where)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_unicode(v, param, f"{where or param}[{i}]")


def _template_tool_calls(calls, where: str, as_text: bool) -> list:
    """An assistant's ``tool_calls`` as its template reads them: each ``function.arguments`` JSON text parsed
    into an object (transformers' and vLLM's convention; GLM's template iterates it), or, ``as_text``, kept
    as JSON text (DeepSeek's templates concatenate it)."""
    if not isinstance(calls, list):
        raise OpenAIError(400, f"{where}: 'tool_calls' must be a list", param="messages")
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise OpenAIError(400, f"{where}.tool_calls[{i}] must be {{\"type\": \"function\", \"function\": "
                                   "{\"name\": ..., \"arguments\": ...}}", param="messages")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise OpenAIError(400, f"{where}.tool_calls[{i}].function.arguments is not JSON",
                                  param="messages") from None
        if as_text:
            arguments = json.dumps(arguments, ensure_ascii=False)
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def chat_messages(body: dict, arguments_as_text: bool = False) -> list[dict]:
    """``messages`` checked, text parts joined into strings; other keys (name, tool_calls, tool_call_id) kept
    for the template, an assistant's tool calls with their arguments as objects (as JSON text with
    ``arguments_as_text``) and a null content as "" (DeepSeek's templates concatenate it)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError(400, "'messages' must be a non-empty list", param="messages")
    check_unicode(messages, "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise OpenAIError(400, f"{where} must be an object with 'role' one of {', '.join(ROLES)}",
                              param="messages")
        m = dict(m)
        if m.get("content") is None:
            if m["role"] != "assistant" or not m.get("tool_calls"):
                raise OpenAIError(400, f"{where} has no 'content'", param="messages")
            m["content"] = ""
        else:
            m["content"] = _text_content(m["content"], where)
        if m.get("tool_calls") is not None:
            m["tool_calls"] = _template_tool_calls(m["tool_calls"], where, arguments_as_text)
        out.append(m)
    return out


def chat_tools(body: dict) -> list | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise OpenAIError(400, "'tools' must be a list of objects", param="tools")
    check_unicode(tools, "tools")
    return tools


def template_kwargs(body: dict) -> dict:
    """``chat_template_kwargs`` (vLLM's extension, e.g. {"enable_thinking": false}) for the template."""
    extra = body.get("chat_template_kwargs")
    if extra is None:
        return {}
    if not isinstance(extra, dict) or any(k in ("messages", "tools", "add_generation_prompt") for k in extra):
        raise OpenAIError(400, "'chat_template_kwargs' must be an object of extra template variables",
                          param="chat_template_kwargs")
    check_unicode(extra, "chat_template_kwargs")
    return extra


# -- responses ---------------------------------------------------------------

def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def usage(finals: list[dict]) -> dict:
    """The prompt's tokens once, the choices' completion tokens summed (OpenAI's count for n > 1)."""
    prompt = finals[0]["usage"]["prompt_tokens"]
    completion = sum(f["usage"]["completion_tokens"] for f in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _lp(value: float) -> float:
    return value if math.isfinite(value) else -9999.0  # JSON has no -inf; OpenAI's clients expect a number


def chat_logprobs(entries: list[dict]) -> dict:
    def one(e: dict) -> dict:
        return {"token": e["token"], "logprob": _lp(e["logprob"]), "bytes": list(e["token"].encode("utf-8"))}

    return {"content": [{**one(e), "top_logprobs": [one(t) for t in e["top"]]} for e in entries]}


def completion_logprobs(entries: list[dict], text_offset: int = 0) -> dict:
    tokens, offsets = [], []
    for e in entries:
        offsets.append(text_offset)
        text_offset += len(e["token"])
        tokens.append(e["token"])
    return {"tokens": tokens,  # an echoed prompt's first token has no log-probability: null, as OpenAI's
            "token_logprobs": [None if e["logprob"] is None else _lp(e["logprob"]) for e in entries],
            "top_logprobs": [None if e["logprob"] is None else {t["token"]: _lp(t["logprob"]) for t in e["top"]}
                             for e in entries],
            "text_offset": offsets}


def echoed(final: dict, prompt_text: str, prompt_only: bool) -> dict:
    """A final event with the prompt before its text and its prompt entries before its logprobs (``echo``);
    ``prompt_only`` (max_tokens 0): the prompt alone."""
    prompt_entries = final.get("prompt_logprobs")
    out = dict(final, text=prompt_text + ("" if prompt_only else final["text"]))
    if prompt_entries is not None:
        out["logprobs"] = prompt_entries + ([] if prompt_only else final.get("logprobs") or [])
    if prompt_only:
        out["finish_reason"] = "length"
        out["usage"] = dict(final["usage"], completion_tokens=0)
    return out


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_doc(call, index: int | None = None) -> dict:
    """A parsed call (tool_calls.ToolCall) as OpenAI's ``tool_calls`` entry (a stream's delta: with ``index``)."""
    doc = {"id": new_call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return doc if index is None else {"index": index, **doc}


def completion_response(rid: str, model: str, finals: list[dict], chat: bool, want_logprobs: bool,
                        tools: tuple | None = None) -> dict:
    """The answer to a request from its choices' final events, in choice order; ``tools`` (the chat template's
    tool_calls.ToolFormat, the request's tools): each text parsed into content and ``tool_calls``."""
    out = []
    for index, final in enumerate(finals):
        entries = final.get("logprobs") or []
        choice = {"index": index, "finish_reason": FINISH_REASON.get(final["finish_reason"], "stop")}
        if chat and tools is not None:
            content, calls = tools[0].parse(final["text"], tools[1])
            choice["message"] = {"role": "assistant", "content": content}
            if calls:
                choice["message"]["tool_calls"] = [tool_call_doc(c) for c in calls]
                if choice["finish_reason"] == "stop":
                    choice["finish_reason"] = "tool_calls"
            choice["logprobs"] = chat_logprobs(entries) if want_logprobs else None
        elif chat:
            choice["message"] = {"role": "assistant", "content": final["text"]}
            choice["logprobs"] = chat_logprobs(entries) if want_logprobs else None
        else:
            choice["text"] = final["text"]
            choice["logprobs"] = completion_logprobs(entries) if want_logprobs else None
        out.append(choice)
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": out, "usage": usage(finals)}


@dataclass(frozen=True)
class StreamId:
    """What every chunk of one streamed response repeats: its id, the model's name, when it began, and whether it
    is a chat completion."""

    rid: str
    model: str
    created: int
    chat: bool


def chunk(head: StreamId, text: str | None, finish: str | None = None, logprobs: dict | None = None,
          role: bool = False, index: int = 0, tool_calls: list | None = None) -> dict:
    """One streamed chunk of choice ``index``: a piece of text (or the role, or tool calls, or the finish
    reason)."""
    chat = head.chat
    choice: dict = {"index": index, "logprobs": logprobs, "finish_reason": finish}
    if chat:
        delta: dict = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    return {"id": head.rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": head.created, "model": head.model, "choices": [choice]}


def usage_chunk(head: StreamId, finals: list[dict]) -> dict:
    return {"id": head.rid, "object": "chat.completion.chunk" if head.chat else "text_completion",
            "created": head.created, "model": head.model, "choices": [], "usage": usage(finals)}


def models_list(model: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "strata"}]}
