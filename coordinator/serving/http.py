"""``strata serve --http HOST:PORT``: the OpenAI HTTP API on top of the ZeroMQ one.

aiohttp serves on a thread of its own with its own event loop; it talks to the
Server (server.py) through one DEALER socket on an inproc endpoint of the
Server's ROUTER, exactly as a ZeroMQ client would: each HTTP request becomes
one ``generate`` document, its events come back by id. Continuous batching
stays the scheduler's. A client that goes away mid-request (aiohttp cancels its
handler) has its sequence cancelled. Chat prompts are rendered with the model's
chat template and tokenised here, off the server's loop.

Routes: GET /v1/models (and /v1/models/{id}), POST /v1/completions, POST /v1/chat/completions (SSE
when ``stream``), POST /tokenize and /detokenize (vLLM's), GET /health, GET /metrics (Prometheus text).
``--api-key`` (or STRATA_API_KEY) guards /v1/* and the tokenizer routes with a Bearer token. Every error is an OpenAI
error document with its status (openai_api.py). Bodies are capped at
MAX_REQUEST_BYTES (413); a connection that does not finish its request head
within ``header_timeout_s`` is closed, a body not sent within
``body_timeout_s`` gets a 408.

Why aiohttp: one well-kept package that is both the server and (for tests and
the benchmark) the client, with streaming responses and per-connection
timeouts, and no ASGI server to add beside it.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass

import zmq
import zmq.asyncio
from aiohttp import web, web_protocol, web_server

from .api import (BRIDGE_FRAME_BYTES, BRIDGE_ID, DEFAULT_HTTP_BODY_TIMEOUT_S, DEFAULT_HTTP_HEADER_TIMEOUT_S,
                  MAX_REQUEST_BYTES, encode_event)
from .. import latency
from ..text.chat_template import ChatTemplateError, turn_end_id
from .openai_api import (COMPLETION_MAX_TOKENS, FINISH_REASON, OpenAIError, chat_logprobs, chat_messages, chat_tools,
                         check_model, check_unicode, choices, chunk, completion_logprobs, completion_prompts,
                         completion_response, echo, echoed, error_body, from_engine_error, generate_fields,
                         models_list, new_id, parallel_tool_calls, stream_flags, template_kwargs, tool_call_doc,
                         tool_choice, usage_chunk, StreamId)
from .tool_calls import CallDelta, leaves_thinking, tool_format

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamAsk:
    """How one request's events are streamed: as chat or completion chunks, with a usage chunk at the end
    (``include_usage``) and log-probabilities (``want_logprobs``); with ``echo_of``, each choice's prompt (and
    its log-probabilities) first, its text alone after (``prompt_only``); with ``tools`` (format, tools), each
    choice's text parsed into content and tool calls as it comes."""

    chat: bool
    include_usage: bool
    want_logprobs: bool
    echo_of: list[str] | None = None
    prompt_only: bool = False
    tools: tuple | None = None

TOKENIZER_ROUTES = ("/tokenize", "/detokenize")  # vLLM's: text or messages <-> token ids, under the API key too
SHUTDOWN_GRACE_S = 5.0  # in-flight handlers get this long to send their last event on stop
START_TIMEOUT_S = 30.0


class Bridge:
    """The HTTP side's one DEALER to the Server's ROUTER: documents out, events routed back by request id."""

    def __init__(self, ctx: zmq.Context, endpoint: str):
        self.sock = zmq.asyncio.Context.shadow(ctx.underlying).socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, BRIDGE_ID)  # the server holds its frames to BRIDGE_FRAME_BYTES
        self.sock.connect(endpoint)
        self.open: dict[str, asyncio.Queue] = {}
        self.calls: dict[str, deque[asyncio.Future]] = {"stats": deque(), "health": deque()}
        self.ids = itertools.count(1)
        self.reader: asyncio.Task | None = None

    def start(self) -> None:
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        while True:
            ev = json.loads(await self.sock.recv())
            kind, rid = ev.get("type"), ev.get("id")
            if kind in self.calls and self.calls[kind]:
                self.calls[kind].popleft().set_result(ev)
            elif rid in self.open:
                self.open[rid].put_nowait(ev)
            elif kind == "error" and rid is None and any(self.calls.values()):
                next(q for q in self.calls.values() if q).popleft().set_result(ev)
            # else: an event of a request already given up (cancelled): nothing waits for it

    def send(self, doc: dict) -> None:
        self.sock.send(encode_event(doc), zmq.NOBLOCK)  # inproc, never full in practice; Again is an error

    def begin(self, doc: dict) -> asyncio.Queue:
        """Send a generate document; its events come back on the queue. A document over the server's limit for
        this socket is refused here, to its own client (the server's refusal would carry no id to route by)."""
        rid = f"http-{next(self.ids)}"
        doc["id"] = rid
        frame = encode_event(doc)
        if len(frame) > BRIDGE_FRAME_BYTES:
            raise OpenAIError(413, f"the request is {len(frame)} bytes once tokenised; the server takes at most "
                                   f"{BRIDGE_FRAME_BYTES}")
        queue = self.open[rid] = asyncio.Queue()
        self.sock.send(frame, zmq.NOBLOCK)
        return queue

    def end(self, rid: str, cancel: bool) -> None:
        self.open.pop(rid, None)
        if cancel:
            try:
                self.send({"type": "cancel", "id": rid})
            except zmq.ZMQError:
                pass

    async def call(self, kind: str) -> dict:
        fut = asyncio.get_running_loop().create_future()
        self.calls[kind].append(fut)
        self.send({"type": kind})
        ev = await fut
        if ev["type"] == "error":
            raise from_engine_error(ev)
        return ev

    async def close(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
            try:
                await self.reader
            except (asyncio.CancelledError, Exception):
                pass
        self.sock.close(0)


class _Connection(web_protocol.RequestHandler):
    """aiohttp's connection, with two answers changed: a client that half-closes (its whole request sent, then
    its sending side shut) still reads its answer, and a request aiohttp's parser refuses (a Content-Length and
    Transfer-Encoding conflict, a header too long, too many headers) gets OpenAI's JSON error shape."""

    def eof_received(self) -> bool:
        self.close()  # no more requests on it: answer the one sent, then close
        return True  # the socket stays open for writing (asyncio closes it on a false return)

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status == 500:  # a defect: aiohttp logs it and answers as it does
            return super().handle_error(request, status, exc, message)
        log.debug("HTTP request refused by the parser (%s): %s", status, message or exc)
        resp = _json(status, error_body(status, f"malformed HTTP request: {message or exc or status}"))
        resp.force_close()
        return resp


class _Server(web_server.Server):
    def __call__(self) -> web_protocol.RequestHandler:
        return _Connection(self, loop=self._loop, **self._kwargs)


class _Runner(web.AppRunner):
    """aiohttp's runner, its connections _Connection's."""

    async def _make_server(self) -> web_server.Server:
        server = await super()._make_server()
        server.__class__ = _Server  # the same object, its connections made by _Server.__call__
        return server


def _json(status: int, doc: dict) -> web.Response:
    return web.Response(status=status, text=json.dumps(doc), content_type="application/json")


def sse(doc: dict | str) -> bytes:
    return f"data: {doc if isinstance(doc, str) else json.dumps(doc, separators=(',', ':'))}\n\n".encode()


class HttpFrontend:
    def __init__(self, server, host: str, port: int, model_name: str, api_key: str | None = None,
                 header_timeout_s: float = DEFAULT_HTTP_HEADER_TIMEOUT_S,
                 body_timeout_s: float = DEFAULT_HTTP_BODY_TIMEOUT_S, cors: tuple[str, ...] = ()):
        self.server = server
        self.cors = cors  # origins whose pages may call the API (--cors; "*": any); none: no CORS headers
        self.engine = server.engine
        self.host, self.port = host, port
        self.model_name = model_name
        self.api_key = api_key
        self.header_timeout_s, self.body_timeout_s = header_timeout_s, body_timeout_s
        self.endpoint = server.bind_inproc()
        self.template = self.engine.chat_template
        self.turn_end = turn_end_id(self.template, self.engine.codec) if self.template is not None else None
        self.tool_format = tool_format(self.template.source) if self.template is not None else None
        codec = self.engine.codec  # llguidance matches an added token only as a token: the grammars name them
        self.added_tokens = frozenset(t.content for t in codec.tokenizer.get_added_tokens_decoder().values()) \
            if codec is not None else frozenset()
        self.created = int(time.time())
        self.counts: Counter = Counter()  # (route, status) -> responses
        self.streams = 0  # open SSE responses
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._failed: BaseException | None = None

    # -- life ----------------------------------------------------------------
    def start(self) -> None:
        """Bind and serve on the frontend's thread; raises here what made the bind fail."""
        self.thread = threading.Thread(target=self._thread, name="strata-http", daemon=True)
        self.thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            raise RuntimeError(f"the HTTP server did not start within {START_TIMEOUT_S:.0f}s")
        if self._failed is not None:
            raise self._failed

    def _thread(self) -> None:
        self.loop = loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._start())
        except BaseException as exc:  # noqa: BLE001 - handed to start() in the main thread
            self._failed = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        loop.run_forever()
        loop.run_until_complete(self._stop())
        loop.close()

    async def _start(self) -> None:
        self.bridge = Bridge(self.server.ctx, self.endpoint)
        self.bridge.start()
        app = web.Application(client_max_size=MAX_REQUEST_BYTES, middlewares=[self._cors, self._errors, self._auth])
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model}", self._model)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self.runner = _Runner(app, handler_cancellation=True, keepalive_timeout=self.header_timeout_s,
                              shutdown_timeout=SHUTDOWN_GRACE_S, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # the port bound, when 0 was asked

    async def _stop(self) -> None:
        await self.runner.cleanup()  # waits up to SHUTDOWN_GRACE_S for in-flight handlers
        await self.bridge.close()

    def stop(self) -> None:
        """After the Server's loop ended (its in-flight requests got their shutdown errors): let the handlers
        send those, then close the listener and the bridge."""
        if self.loop is None or self.thread is None or not self.thread.is_alive():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(SHUTDOWN_GRACE_S + 5)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    # -- middleware ------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler):
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "other"
        try:
            response = await handler(request)
        except OpenAIError as exc:
            response = _json(exc.status, exc.body())
            response.headers.update(exc.headers())
        except web.HTTPException as exc:  # aiohttp's own: 404 route, 405 method, 413 body
            message = {404: f"no route {request.method} {request.path}", 413: f"the request body is over "
                       f"{MAX_REQUEST_BYTES} bytes"}.get(exc.status, exc.reason)
            response = _json(exc.status, error_body(exc.status, message))
            if exc.status == 405:  # the methods the route takes, as HTTP asks of a 405
                response.headers["Allow"] = ", ".join(sorted(getattr(exc, "allowed_methods", ())))
            if exc.status == 413:  # the rest of the body is not read: the connection ends with this answer
                response.force_close()
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as exc:  # a defect of ours: this request's 500, never the server's end
            log.exception("HTTP %s %s failed", request.method, request.path)
            response = _json(500, error_body(500, f"the server could not handle this request: "
                                                  f"{type(exc).__name__}: {exc}"))
        self.counts[(route, response.status)] += 1
        return response

    @web.middleware
    async def _cors(self, request: web.Request, handler):
        """--cors: a preflight (OPTIONS with Access-Control-Request-Method) from an allowed origin is answered
        here, before the key is asked; every answer to an allowed origin says so. Other origins get no CORS
        header, so browsers keep their pages out."""
        origin = request.headers.get("Origin")
        allowed = origin is not None and ("*" in self.cors or origin in self.cors)
        if allowed and request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            response = web.Response(status=204, headers={
                "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers",
                                                                    "Authorization, Content-Type"),
                "Access-Control-Max-Age": "600"})
        else:
            response = await handler(request)
        if allowed:
            response.headers["Access-Control-Allow-Origin"] = "*" if "*" in self.cors else origin
            response.headers["Vary"] = "Origin"
        return response

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self.api_key and (request.path.startswith("/v1/") or request.path in TOKENIZER_ROUTES):
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                raise OpenAIError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                                  code="invalid_api_key")
        return await handler(request)

    # -- routes ----------------------------------------------------------------
    async def _body(self, request: web.Request) -> dict:
        try:
            raw = await asyncio.wait_for(request.read(), self.body_timeout_s)
        except asyncio.TimeoutError:
            raise OpenAIError(408, f"the request body did not arrive within {self.body_timeout_s:.0f}s") from None
        try:
            body = json.loads(raw)
        except RecursionError:
            raise OpenAIError(400, "the request body is nested too deeply") from None
        except ValueError as exc:
            raise OpenAIError(400, f"the request body is not UTF-8 JSON: {exc}") from None
        if not isinstance(body, dict):
            raise OpenAIError(400, "the request body must be a JSON object")
        check_model(body, self.model_name)
        return body

    async def _models(self, _request: web.Request) -> web.Response:
        return _json(200, models_list(self.model_name, self.created))

    async def _model(self, request: web.Request) -> web.Response:
        check_model({"model": request.match_info["model"]}, self.model_name)
        return _json(200, models_list(self.model_name, self.created)["data"][0])

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        doc = {"type": "generate", **generate_fields(body, chat=False, max_new_tokens_limit=self._limit(),
                                                     default_max_tokens=min(COMPLETION_MAX_TOKENS, self._limit()))}
        prompts = completion_prompts(body)
        prompt_only = doc["max_new_tokens"] == 0  # echo's prompt alone: one token made and left out
        if prompt_only:
            doc["max_new_tokens"] = 1
        docs = [dict(doc, **{"prompt_ids" if isinstance(p, list) else "prompt": p}) for p in prompts]
        texts = None
        if echo(body):
            texts = [p if isinstance(p, str) else self.engine.decode(p) if self.engine.codec is not None else ""
                     for p in prompts]
        return await self._run(request, body, docs, chat=False, echo_texts=texts, prompt_only=prompt_only)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        if self.template is None:
            why = self.engine.chat_template_error
            raise OpenAIError(400, f"the model's chat template cannot be used ({why}); use /v1/completions" if why
                              else f"the model '{self.model_name}' has no chat template; use /v1/completions",
                              code="no_chat_template")
        if self.engine.codec is None:
            raise OpenAIError(400, "the model has no tokenizer; use /v1/completions with token ids")
        messages, tools, extra = chat_messages(body, self._arguments_as_text()), chat_tools(body), template_kwargs(body)
        fields = generate_fields(body, chat=True, max_new_tokens_limit=self._limit(), default_max_tokens=None)
        self._check_size(messages)  # before the template and the tokenizer see them
        prompt, ids = await asyncio.get_running_loop().run_in_executor(None, self._render, messages, tools, extra)
        room = self.engine.max_seq_len - len(ids)
        if room < 1:
            raise OpenAIError(400, f"the messages are {len(ids)} tokens; the context holds "
                                   f"{self.engine.max_seq_len}", param="messages", code="context_length_exceeded")
        if fields["max_new_tokens"] is None:
            fields["max_new_tokens"] = min(room, self._limit())
        if self.turn_end is not None and self.turn_end not in fields["stop_token_ids"]:
            fields["stop_token_ids"].append(self.turn_end)  # the assistant's turn ends there (ChatML's <|im_end|>)
        fmt = self._tool_fields(body, tools, fields, prompt)
        doc = {"type": "generate", "prompt_ids": ids, **fields}
        return await self._run(request, body, [doc], chat=True, tools=None if fmt is None else (fmt, tools))

    def _arguments_as_text(self) -> bool:
        return self.tool_format is not None and self.tool_format.arguments_as_text

    def _tool_fields(self, body: dict, tools: list | None, fields: dict, prompt: str):
        """The template's tool-call format when the reply is to be parsed for calls (None: plain content), the
        generate fields set for it: special tokens kept in the text (some formats' markers are), and for
        ``tool_choice`` "required" or a named function the format's grammar, so the model writes only calls
        (after a thought where the ``prompt`` leaves the model to think)."""
        choice = tool_choice(body)
        if choice not in ("none", "auto") and not tools:
            raise OpenAIError(400, "'tool_choice' other than \"none\" or \"auto\" needs 'tools'", param="tool_choice")
        if not tools or choice == "none":
            return None
        fmt = self.tool_format
        if fmt is None:
            if choice == "auto":
                return None  # the tools are in the prompt; the reply is content as the template's model writes it
            raise OpenAIError(400, "the model's chat template writes tool calls in no format this server parses, so "
                                   f"'tool_choice' {json.dumps(choice)} cannot be enforced", param="tool_choice")
        fields["skip_special_tokens"] = False
        if choice != "auto":
            if fields["grammar"] is not None:
                raise OpenAIError(400, "'response_format' and a forced 'tool_choice' cannot both hold",
                                  param="response_format")
            try:
                grammar = fmt.grammar(tools, choice, special=self.added_tokens,
                                      think=leaves_thinking(self.template.source, prompt),
                                      parallel=parallel_tool_calls(body))
                fields["grammar"] = {"type": "lark", "grammar": grammar}
            except ValueError as exc:
                raise OpenAIError(400, str(exc), param="tool_choice") from None
        return fmt

    def _check_size(self, messages: list[dict]) -> None:
        """Refuse messages whose text alone needs more tokens than a prompt may have: no token of the tokenizer
        is longer than max_token_bytes, so n bytes are at least n / max_token_bytes tokens (as the server
        refuses a long completion prompt, before tokenising it)."""
        longest = self.server.max_token_bytes
        if not longest:
            return
        nbytes = sum(len(m["content"].encode("utf-8")) for m in messages if isinstance(m.get("content"), str))
        least = -(-nbytes // longest)
        limit = min(self.server.limits.max_prompt_tokens, self.engine.max_seq_len)
        if least > limit:
            raise OpenAIError(400, f"the messages' text is {nbytes} bytes, so at least {least} tokens (no token is "
                                   f"longer than {longest} bytes); the limit is {limit} tokens", param="messages",
                              code="context_length_exceeded")

    async def _tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: {"prompt": text} (add_special_tokens ignored: the tokenizer adds none) or
        {"messages": [...]} rendered as a chat -> {"tokens", "count", "max_model_len"}."""
        body = await self._body(request)
        if self.engine.codec is None:
            raise OpenAIError(400, "the model has no tokenizer")
        loop = asyncio.get_running_loop()
        if "messages" in body:
            if self.template is None:
                raise OpenAIError(400, "the model has no usable chat template", param="messages")
            messages, tools, extra = chat_messages(body, self._arguments_as_text()), chat_tools(body), \
                template_kwargs(body)
            self._check_size(messages)
            _, ids = await loop.run_in_executor(None, self._render, messages, tools, extra)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise OpenAIError(400, "'prompt' must be a string (or give 'messages')", param="prompt")
            check_unicode(prompt, "prompt")
            self._check_size([{"content": prompt}])
            ids = await loop.run_in_executor(None, self.engine.encode, prompt)
        return _json(200, {"tokens": ids, "count": len(ids), "max_model_len": self.engine.max_seq_len})

    async def _detokenize(self, request: web.Request) -> web.Response:
        """vLLM's /detokenize: {"tokens": [ids]} -> {"prompt": text}."""
        body = await self._body(request)
        ids = body.get("tokens")
        vocab = self.engine.model_config.vocab_size
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                for t in ids):
            raise OpenAIError(400, f"'tokens' must be a list of token ids in [0, {vocab})", param="tokens")
        if self.engine.codec is None:
            raise OpenAIError(400, "the model has no tokenizer")
        text = await asyncio.get_running_loop().run_in_executor(None, self.engine.decode, ids)
        return _json(200, {"prompt": text})

    def _render(self, messages: list[dict], tools, extra: dict) -> tuple[str, list[int]]:
        """The chat's prompt text and its ids."""
        try:
            text = self.template.render(messages, add_generation_prompt=True, tools=tools, **extra)
        except ChatTemplateError as exc:
            raise OpenAIError(400, f"the chat template refused these messages: {exc}", param="messages") from None
        return text, self.engine.encode(text)

    def _limit(self) -> int:
        return self.server.limits.max_new_tokens

    async def _run(self, request: web.Request, body: dict, docs: list[dict], chat: bool,
                   echo_texts: list[str] | None = None, prompt_only: bool = False,
                   tools: tuple | None = None) -> web.StreamResponse:
        """Send a generate document per prompt and choice (``n``; seeds seed, seed + 1, ... when one is given)
        and answer with their events: one JSON document (choice i * n + j: prompt i's choice j; with
        ``echo_texts``, each prompt before its text), or SSE chunks of every choice as they come."""
        stream, include_usage = stream_flags(body)
        want_logprobs = docs[0]["logprobs"] is not None
        n = choices(body)
        queues, done = [], False
        try:
            for doc in docs:
                for i in range(n):
                    one = dict(doc, stream=stream, seed=None if doc["seed"] is None else doc["seed"] + i)
                    queues.append((self.bridge.begin(one), one["id"]))
            if not stream:
                finals = []
                for queue, _ in queues:
                    ev = await queue.get()
                    if ev["type"] == "error":
                        raise from_engine_error(ev)
                    finals.append(ev)
                done = True
                if echo_texts is not None:
                    finals = [echoed(f, echo_texts[k // n], prompt_only) for k, f in enumerate(finals)]
                return _json(200, completion_response(new_id(chat), self.model_name, finals, chat, want_logprobs,
                                                      tools))
            echo_of = None if echo_texts is None else [echo_texts[k // n] for k in range(len(queues))]
            ask = StreamAsk(chat, include_usage, want_logprobs, echo_of, prompt_only, tools)
            response, done = await self._stream(request, [q for q, _ in queues], ask)
            return response
        finally:
            for _, rid in queues:
                self.bridge.end(rid, cancel=not done)

    async def _stream(self, request: web.Request, queues: list[asyncio.Queue],
                      ask: StreamAsk) -> tuple[web.StreamResponse, bool]:
        """The choices' events as SSE chunks, each tagged with its choice's index, in the order they come (ask:
        StreamAsk's table)."""
        merged: asyncio.Queue = asyncio.Queue()

        async def forward(index: int, queue: asyncio.Queue) -> None:
            while True:
                ev = await queue.get()
                merged.put_nowait((index, ev))
                if ev["type"] != "token":
                    return

        tasks = [asyncio.get_running_loop().create_task(forward(i, q)) for i, q in enumerate(queues)]
        try:
            return await self._write_stream(request, merged, len(queues), ask)
        finally:
            for t in tasks:
                t.cancel()

    async def _write_stream(self, request: web.Request, merged: asyncio.Queue, n: int,
                            ask: StreamAsk) -> tuple[web.StreamResponse, bool]:
        chat, want_logprobs, echo_of, prompt_only, tools = (ask.chat, ask.want_logprobs, ask.echo_of,
                                                            ask.prompt_only, ask.tools)
        index, first = await merged.get()
        if first["type"] == "error":  # refused before any token: a plain HTTP error, not a stream
            raise from_engine_error(first)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        self.streams += 1
        head, offsets, finals = StreamId(new_id(chat), self.model_name, int(time.time()), chat), [0] * n, {}
        try:
            if chat:
                for i in range(n):
                    await response.write(sse(chunk(head, "", role=True, index=i)))
            ev = first
            echoed_choices: set[int] = set()
            streamers = [tools[0].streamer(tools[1]) for _ in range(n)] if tools is not None else None
            called = [False] * n  # whether choice i made a tool call (its finish_reason is then tool_calls)

            async def deltas(i: int, out: list, lp: dict | None) -> None:
                """A choice's parsed pieces as chunks: content, or one whole tool call each; the token's
                logprobs ride on the first (an empty content chunk carries them when nothing else goes)."""
                for d in out:
                    if isinstance(d, CallDelta):
                        called[i] = True
                        piece = chunk(head, None, logprobs=lp, index=i,
                                      tool_calls=[tool_call_doc(d.call, d.index)])
                    else:
                        piece = chunk(head, d.text, logprobs=lp, index=i)
                    await response.write(sse(piece))
                    lp = None
                if lp is not None:
                    await response.write(sse(chunk(head, "", logprobs=lp, index=i)))

            while True:
                if echo_of is not None and index not in echoed_choices and ev["type"] in ("token", "final"):
                    echoed_choices.add(index)  # the prompt first, with its log-probabilities (the first event's)
                    entries = ev.get("prompt_logprobs") or []
                    lp = completion_logprobs(entries) if want_logprobs else None
                    offsets[index] = len(echo_of[index])
                    await response.write(sse(chunk(head, echo_of[index], logprobs=lp, index=index)))
                if prompt_only and ev["type"] == "token":
                    pass  # the one token made for an echo of max_tokens 0 is not the answer's
                elif ev["type"] == "token":
                    entries = ev.get("logprobs") or []
                    lp = None
                    if want_logprobs:
                        lp = chat_logprobs(entries) if chat else completion_logprobs(entries, offsets[index])
                    offsets[index] += len(ev["text"])
                    if streamers is not None:
                        await deltas(index, streamers[index].push(ev["text"]), lp)
                    else:
                        await response.write(sse(chunk(head, ev["text"], logprobs=lp, index=index)))
                elif ev["type"] == "final":
                    if prompt_only:
                        ev = dict(ev, finish_reason="length", usage=dict(ev["usage"], completion_tokens=0))
                    finish = FINISH_REASON.get(ev["finish_reason"], "stop")
                    if streamers is not None:
                        await deltas(index, streamers[index].finish(), None)
                        finish = "tool_calls" if called[index] and finish == "stop" else finish
                    await response.write(sse(chunk(head, None if chat else "", finish=finish, index=index)))
                    finals[index] = ev
                    if len(finals) == n:
                        if ask.include_usage:
                            await response.write(sse(usage_chunk(head, [finals[i] for i in range(n)])))
                        break
                else:  # an error after the stream began (engine failure, shutdown): an error event ends it
                    await response.write(sse(from_engine_error(ev).body()))
                    break
                index, ev = await merged.get()
            await response.write(sse("[DONE]"))
            await response.write_eof()
            return response, len(finals) == n
        finally:
            self.streams -= 1

    async def _health(self, _request: web.Request) -> web.Response:
        health = await self.bridge.call("health")
        return _json(200 if health.get("ok") else 503, health)

    async def _metrics(self, _request: web.Request) -> web.Response:
        stats = await self.bridge.call("stats")
        return web.Response(text=prometheus(stats, self.counts, self.streams, self.model_name),
                            content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})


def prometheus(stats: dict, http_counts: Counter, streams: int, model: str = "") -> str:
    """The server's stats, its latency histograms (labelled with ``model``, vLLM's names) and the HTTP counts
    in Prometheus' text format (version 0.0.4)."""
    nodes = stats.get("pool", {}).get("nodes", [])
    hit = (stats.get("experts") or {}).get("hit_rate")
    rows = [  # (name, type, help, value)
        ("strata_requests_total", "counter", "generate requests accepted", stats.get("requests", 0)),
        ("strata_requests_completed_total", "counter", "requests that finished", stats.get("completed", 0)),
        ("strata_requests_cancelled_total", "counter", "requests cancelled", stats.get("cancelled", 0)),
        ("strata_busy_rejections_total", "counter", "requests refused: queue full", stats.get("busy_rejections", 0)),
        ("strata_generated_tokens_total", "counter", "tokens generated", stats.get("tokens", 0)),
        ("strata_prompt_tokens_total", "counter", "prompt tokens prefilled", stats.get("prefill_tokens", 0)),
        ("strata_tokens_per_second", "gauge", "tokens generated per second of engine steps",
         stats.get("tokens_per_s") or 0.0),
        ("strata_queue_depth", "gauge", "requests waiting for a slot", stats.get("queued", 0)),
        ("strata_active_sequences", "gauge", "sequences prefilling or decoding", stats.get("active", 0)),
        ("strata_worker_restarts_total", "counter", "node worker restarts", sum(n.get("restarts", 0) for n in nodes)),
        ("strata_hot_expert_hit_rate", "gauge", "share of routed expert pairs served by the device side",
         hit if hit is not None else float("nan")),
        ("strata_http_streams_open", "gauge", "server-sent event responses in progress", streams),
        ("strata_spec_draft_tokens_total", "counter", "speculative decoding: tokens drafted",
         stats.get("drafted_tokens", 0)),
        ("strata_spec_accepted_tokens_total", "counter", "speculative decoding: drafted tokens that stood",
         stats.get("accepted_drafts", 0)),
    ]
    lines = []
    for name, kind, text, value in rows:
        value = float(value)
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {'NaN' if value != value else value}"]
    lines += ["# HELP strata_http_responses_total HTTP responses by route and status",
              "# TYPE strata_http_responses_total counter"]
    for (route, status), n in sorted(http_counts.items()):
        lines.append(f'strata_http_responses_total{{route="{route}",status="{status}"}} {n}')
    lines += latency.prometheus_lines(stats.get("latency") or {}, model)
    return "\n".join(lines) + "\n"
