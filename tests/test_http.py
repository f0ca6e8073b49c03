"""The OpenAI HTTP API (``strata serve --http``), driven by the real ``openai`` client and by raw HTTP.

One shared server (inproc pool, an API key, a chat template in the model folder) serves most tests; the
references are computed by an in-process Engine on the same model.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np
import openai
import pytest

from coordinator.cli.make_model import make_model
from coordinator.config import EngineConfig
from coordinator.engine import Engine
from coordinator.text.chat_template import ChatTemplate, turn_end_id
from coordinator.serving.http import prometheus
from coordinator.serving.openai_api import OpenAIError, from_engine_error, generate_fields
from served import REPO, server_env, start_server, stop_server, wait_for

pytestmark = pytest.mark.slow  # `strata serve` processes over HTTP

KEY = "test-key-123"
TEMPLATE = ("{% for m in messages %}{% if m.role == 'system' %}[S]{{ m.content }}\n{% else %}<|{{ m.role }}|>"
            "{{ m.content }}\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
HEADER_TIMEOUT_S = 1.0


CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """The tiny model with TEMPLATE, whose eos_token is a token the greedy answer to CHAT makes a few tokens
    in (so the template's end of turn ends that answer where the model's own eos would not)."""
    model = make_model(tmp_path_factory.mktemp("http") / "chatm", seed=0)
    with Engine.open(model, EngineConfig(pool="inproc")) as eng:
        answer = eng.generate(eng.encode(ChatTemplate(TEMPLATE).render(CHAT)), 12, temperature=0.0)
        cut = next(i for i in range(2, len(answer)) if answer[i] not in answer[:i])
        turn_end = eng.codec.tokenizer.id_to_token(answer[cut])
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": turn_end}))
    return model


@pytest.fixture(scope="module")
def engine(chat_model):
    eng = Engine.open(chat_model, EngineConfig(pool="inproc"))
    yield eng
    eng.close()


PAGE = "http://page.example:3000"  # the one origin --cors lets in


@pytest.fixture(scope="module")
def http(chat_model, tmp_path_factory):
    s = start_server(chat_model, tmp_path_factory.mktemp("http-logs"), "--http", "127.0.0.1:0", "--api-key", KEY,
                     "--http-header-timeout", str(HEADER_TIMEOUT_S), "--cors", PAGE)
    assert s.http_url and s.http_url.startswith("http://127.0.0.1:"), s.http_url
    yield s
    assert stop_server(s) == 0, s.stderr()


@pytest.fixture(scope="module")
def client(http):
    return openai.OpenAI(base_url=http.http_url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def greedy_text(engine, ids: list[int], n: int) -> tuple[str, list[int]]:
    out = engine.generate(ids, n, temperature=0.0, stop_at_eos=True)
    return engine.decode(out), out


def chat_ids(engine, messages: list[dict]) -> list[int]:
    return engine.encode(engine.chat_template.render(messages, add_generation_prompt=True))


def raw(http, method: str, path: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, dict]:
    """One HTTP request with urllib: (status, parsed JSON body)."""
    req = urllib.request.Request(http.http_url + path, data=body, method=method,
                                 headers={"Authorization": f"Bearer {KEY}", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metric(http, name: str) -> float:
    with urllib.request.urlopen(http.http_url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


# -- the OpenAI client ---------------------------------------------------------------------------------------


def test_models_and_the_api_key(http, client):
    assert [m.id for m in client.models.list()] == ["chatm"]
    assert client.models.retrieve("chatm").id == "chatm"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    bad = openai.OpenAI(base_url=http.http_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    status, doc = raw(http, "GET", "/v1/models", headers={"Authorization": ""})
    assert status == 401 and doc["error"]["code"] == "invalid_api_key"
    status, _ = raw(http, "GET", "/health", headers={"Authorization": ""})  # /health needs no key
    assert status == 200


def test_completion_equals_the_engine(client, engine):
    r = client.completions.create(model="chatm", prompt="Hello", max_tokens=7, temperature=0)
    want, ids = greedy_text(engine, engine.encode("Hello"), 7)
    assert r.choices[0].text == want
    assert r.usage.prompt_tokens == len(engine.encode("Hello")) and r.usage.completion_tokens == len(ids)
    assert r.choices[0].finish_reason == "length"
    by_ids = client.completions.create(model="chatm", prompt=engine.encode("Hello"), max_tokens=7, temperature=0)
    assert by_ids.choices[0].text == want


def test_chat_streamed_and_not(client, engine):
    turn_end = turn_end_id(engine.chat_template, engine.codec)
    ids = engine.generate(chat_ids(engine, CHAT), 12, temperature=0.0)
    assert turn_end in ids  # the fixture chose it so
    want = engine.decode(ids[:ids.index(turn_end)])
    r = client.chat.completions.create(model="chatm", messages=CHAT, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "stop"  # at the template's end of turn, which the model's config lacks
    assert r.usage.completion_tokens == ids.index(turn_end) + 1
    assert r.usage.prompt_tokens == len(chat_ids(engine, CHAT))
    chunks = list(client.chat.completions.create(model="chatm", messages=CHAT, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == r.usage.total_tokens


def test_stop_token_ids(client, engine):
    ids = engine.generate(engine.encode("Hello"), 8, temperature=0.0)
    cut = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])
    r = client.completions.create(model="chatm", prompt="Hello", max_tokens=8, temperature=0,
                                  extra_body={"stop_token_ids": [ids[cut]]})
    assert r.choices[0].text == engine.decode(ids[:cut]) and r.choices[0].finish_reason == "stop"


def test_two_concurrent_streams_with_different_sampling(client, engine):
    prompt = "Once upon a time"
    params = [dict(temperature=0), dict(temperature=1.3, top_p=0.9, seed=7, extra_body={"top_k": 20, "min_p": 0.01})]
    texts: list[str | BaseException | None] = [None, None]
    started = threading.Barrier(2, timeout=60)

    def run(i: int) -> None:
        try:
            stream = client.completions.create(model="chatm", prompt=prompt, max_tokens=24, stream=True,
                                               **params[i])
            pieces = []
            for n, c in enumerate(stream):
                pieces.append(c.choices[0].text)
                if n == 0:
                    started.wait()  # both streams are open at once
            texts[i] = "".join(pieces)
        except BaseException as exc:  # noqa: BLE001 - checked below, in the test's thread
            started.abort()
            texts[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert texts[0] == greedy_text(engine, engine.encode(prompt), 24)[0]
    alone = client.completions.create(model="chatm", prompt=prompt, max_tokens=24, **params[1]).choices[0].text
    assert texts[1] == alone  # the seed decides, whatever ran beside it
    assert texts[1] != texts[0]


def test_stop_strings(client, engine):
    want, _ = greedy_text(engine, engine.encode("Hello"), 12)
    stop = want[3:5]
    assert stop and want.find(stop) >= 0
    for stream in (False, True):
        r = client.completions.create(model="chatm", prompt="Hello", max_tokens=12, temperature=0, stop=[stop],
                                      stream=stream)
        chunks = list(r) if stream else [r]
        text = "".join(c.choices[0].text for c in chunks)
        assert text == want[:want.find(stop)]
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs(client, engine):
    messages = [{"role": "user", "content": "abc"}]
    r = client.chat.completions.create(model="chatm", messages=messages, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens >= 1
    for entry in content:
        assert len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True) and entry.logprob == pytest.approx(tops[0])  # greedy: the best
        assert entry.logprob <= 0
    c = client.completions.create(model="chatm", prompt="abc", max_tokens=4, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(t) <= 2 and max(t.values()) == pytest.approx(v) for t, v in zip(lp.top_logprobs,
                                                                                    lp.token_logprobs))


def test_a_client_that_disconnects_mid_stream_is_cancelled(http, client, engine):
    before = metric(http, "strata_requests_cancelled_total")
    stream = client.completions.create(model="chatm", prompt="Hello", max_tokens=4000, temperature=0, stream=True)
    for n, _ in enumerate(stream):
        if n == 2:
            break
    stream.close()
    wait_for(lambda: metric(http, "strata_requests_cancelled_total") > before, "the sequence cancelled")
    assert metric(http, "strata_active_sequences") == 0
    r = client.completions.create(model="chatm", prompt="Hello", max_tokens=5, temperature=0)
    assert r.choices[0].text == greedy_text(engine, engine.encode("Hello"), 5)[0]


# -- hostile HTTP ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (json.dumps({"prompt": "x", "temperature": "hot"}).encode(), 400, "temperature"),
    (json.dumps({"prompt": "x", "max_tokens": -3}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": 12}).encode(), 400, "prompt"),
    (json.dumps({"prompt": "x", "n": 17}).encode(), 400, "n"),
    (json.dumps({"prompt": "x", "stop_token_ids": ["a"]}).encode(), 400, "stop_token_ids"),
    (json.dumps({"prompt": "x", "model": "gpt-4"}).encode(), 404, "model"),
    (json.dumps({"prompt": "x", "pad": "a" * (10 << 20)}).encode(), 413, None),
])
def test_bad_requests_get_their_status(http, body, status, param):
    got, doc = raw(http, "POST", "/v1/completions", body, {"Content-Type": "application/json"})
    assert got == status, doc
    assert set(doc["error"]) == {"message", "type", "param", "code"} and doc["error"]["message"]
    assert doc["error"]["param"] == param


@pytest.mark.parametrize("prompt", ["\U0001F600" * 400000, "\u4e2d" * 700000, "a" * ((4 << 20) - 100)],
                         ids=["emoji", "cjk", "ascii"])
def test_a_body_under_the_limit_is_answered_whatever_its_internal_frame(http, engine, prompt):
    """A body within the 4 MiB limit is answered, to its own client, even where the frontend's frame to the
    server comes out larger (non-ASCII text escaped as \\uXXXX; the frame's own fields), while a health
    request in flight at the same moment gets its own answer. The prompt is longer than the server takes: its
    refusal (400, too_long) is the answer."""
    import concurrent.futures

    body = json.dumps({"prompt": prompt, "max_tokens": 1}, ensure_ascii=False).encode()
    assert len(body) <= 4 << 20
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        big = pool.submit(raw, http, "POST", "/v1/completions", body, {"Content-Type": "application/json"})
        health = [pool.submit(raw, http, "GET", "/health") for _ in range(3)]
        status, doc = big.result(timeout=120)
        assert all(h.result(timeout=60)[0] == 200 for h in health)
    assert status == 400 and doc["error"]["code"] == "too_long", doc


def test_a_chat_too_long_by_its_bytes_is_refused_before_tokenising(http):
    """A chat whose text alone needs more tokens than a prompt may have is refused by its byte count (the
    message says so: the refusal after tokenising counts tokens), its messages never rendered or tokenised."""
    text = "ab cd " * 690000  # 4.14 MB
    body = json.dumps({"model": "chatm", "messages": [{"role": "user", "content": text[: (4 << 20) - 200]}]})
    status, doc = raw(http, "POST", "/v1/chat/completions", body.encode(), {"Content-Type": "application/json"})
    assert status == 400 and doc["error"]["code"] == "context_length_exceeded", doc
    assert "at least" in doc["error"]["message"] and doc["error"]["param"] == "messages"


@pytest.mark.parametrize("where", ["content", "tool", "template_kwargs"])
def test_a_lone_surrogate_in_a_chat_is_a_400_naming_it(http, where):
    lone = "ab\ud800cd"
    body = {"model": "chatm", "messages": [{"role": "user", "content": lone if where == "content" else "hi"}]}
    if where == "tool":
        body["tools"] = [{"type": "function", "function": {"name": "f", "description": lone}}]
    if where == "template_kwargs":
        body["chat_template_kwargs"] = {"note": lone}
    status, doc = raw(http, "POST", "/v1/chat/completions", json.dumps(body).encode(),
                      {"Content-Type": "application/json"})
    assert status == 400 and "lone UTF-16 surrogate" in doc["error"]["message"], doc
    assert doc["error"]["param"] == {"content": "messages", "tool": "tools"}.get(where, "chat_template_kwargs")


def _exchange(http, data: bytes, half_close: bool = False) -> bytes:
    """Raw bytes to the HTTP port, everything it answers until it closes."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(http.http_url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        chunks = []
        while True:
            chunk = sock.recv(1 << 16)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


def _status_and_json(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    assert b"application/json" in head.lower(), head
    return status, json.loads(body.split(b"\r\n\r\n")[0] if body.startswith(b"{") else body)


def test_a_client_that_half_closes_gets_its_answer(http):
    body = json.dumps({"model": "chatm", "prompt": "abc", "max_tokens": 2, "temperature": 0}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    resets = http.stderr().count("ConnectionResetError")  # the dropped streams' of the tests before
    status, doc = _status_and_json(_exchange(http, request, half_close=True))
    assert status == 200 and doc["choices"][0]["text"] is not None
    assert http.stderr().count("ConnectionResetError") == resets


@pytest.mark.parametrize("head", [
    "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",  # both: request smuggling's shape
    "X-Long: " + "a" * 9000 + "\r\n",  # a header over aiohttp's 8190 bytes
    "".join(f"X-{i}: {i}\r\n" for i in range(10000)),  # too many headers
], ids=["length-and-chunked", "long-header", "many-headers"])
def test_malformed_http_gets_the_json_error_shape(http, head):
    request = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{head}\r\nhello".encode()
    status, doc = _status_and_json(_exchange(http, request))
    assert status == 400 and set(doc["error"]) == {"message", "type", "param", "code"}, doc


def test_after_a_413_the_rest_of_the_body_is_not_a_request(http):
    """A body over the limit is answered 413 and the connection ends: its remaining bytes are never parsed as
    the next request (which would log aiohttp's BadHttpMethod)."""
    body = b"GET /v1/models HTTP/1.1\r\n\r\n" * ((5 << 20) // 28)
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    try:
        answer = _exchange(http, request)
    except (ConnectionResetError, BrokenPipeError):  # the server closed while the body was still being sent
        answer = b""
    if answer:
        assert _status_and_json(answer)[0] == 413 and answer.count(b"HTTP/1.1 ") == 1
    assert "BadHttpMethod" not in http.stderr()


def test_405_names_the_allowed_methods(http):
    answer = _exchange(http, b"GET /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                             + f"Authorization: Bearer {KEY}\r\n\r\n".encode())
    status, _ = _status_and_json(answer)
    assert status == 405 and b"\r\nAllow: POST" in answer


@pytest.mark.parametrize("field, value", [("logit_bias", "x"), ("logit_bias", {"a": 1}), ("logit_bias", {"5": 101}),
                                          ("tool_choice", 5),
                                          ("tool_choice", "required"), ("user", 5), ("functions", []),
                                          ("ignore_eos", "yes"), ("ignore_eos", True), ("min_tokens", -1),
                                          ("min_tokens", 3), ("stop", ["a"] * 9)])
def test_fields_it_does_not_act_on_are_refused_not_ignored(http, field, value):
    body = json.dumps({"prompt": "x", "max_tokens": 1, field: value}).encode()
    status, doc = raw(http, "POST", "/v1/completions", body, {"Content-Type": "application/json"})
    assert status == 400 and doc["error"]["param"] == field, doc
    ok = json.dumps({"prompt": "x", "max_tokens": 1, "user": "u", "tool_choice": "auto", "logit_bias": {},
                     "ignore_eos": False, "min_tokens": 0, "stop": ["a"] * 8}).encode()
    assert raw(http, "POST", "/v1/completions", ok, {"Content-Type": "application/json"})[0] == 200


def test_echo_scores_the_prompt_as_the_engine_does(client, engine):
    """echo with logprobs (how lm-evaluation-harness's local-completions computes log-likelihoods): a list of
    prompts (text and token ids), max_tokens 0 and 1; each prompt token's log-probability equals the
    log-softmax of the engine's own logits within 1e-5, the first one's is null, the text is the prompt (and
    the completion after it)."""
    prompts = ["The quick brown fox", engine.encode("jumps over the lazy dog")]
    r = client.completions.create(model="chatm", prompt=prompts, max_tokens=0, echo=True, logprobs=1,
                                  temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    for prompt, choice in zip(prompts, r.choices):
        ids = engine.encode(prompt) if isinstance(prompt, str) else prompt
        text = prompt if isinstance(prompt, str) else engine.decode(prompt)
        assert choice.text == text
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == text and lp.token_logprobs[0] is None
        logits = engine.logits(ids).astype(np.float64)
        want = logits - logits.max(-1, keepdims=True)
        want -= np.log(np.exp(want).sum(-1, keepdims=True))
        got = np.array(lp.token_logprobs[1:])
        np.testing.assert_allclose(got, want[np.arange(len(ids) - 1), ids[1:]], atol=1e-5, rtol=0)
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(ids))]
    one = client.completions.create(model="chatm", prompt=prompts[0], max_tokens=2, echo=True, logprobs=0,
                                    temperature=0)
    plain = client.completions.create(model="chatm", prompt=prompts[0], max_tokens=2, temperature=0)
    assert one.choices[0].text == prompts[0] + plain.choices[0].text
    assert len(one.choices[0].logprobs.tokens) == len(engine.encode(prompts[0])) + 2
    singles = [client.completions.create(model="chatm", prompt=p, max_tokens=3, temperature=0).choices[0].text
               for p in prompts]
    both = client.completions.create(model="chatm", prompt=prompts, max_tokens=3, temperature=0)
    assert [c.text for c in both.choices] == singles


def test_echo_streamed_equals_echo_whole(client):
    """stream with echo: each choice's first chunk is its prompt with the prompt's log-probabilities, then its
    tokens; put together, the same text and log-probabilities as the one-document answer. max_tokens 0: the
    prompt alone, finish_reason length."""
    prompts = ["The quick brown fox", "Hello"]
    for max_tokens in (0, 3):
        kw = dict(model="chatm", prompt=prompts, max_tokens=max_tokens, echo=True, logprobs=2, temperature=0)
        whole = client.completions.create(**kw)
        texts, lps, finish = ["", ""], [[], []], [None, None]
        for c in client.completions.create(stream=True, **kw):
            for ch in c.choices:
                texts[ch.index] += ch.text
                if ch.logprobs is not None:
                    lps[ch.index] += ch.logprobs.token_logprobs
                finish[ch.index] = ch.finish_reason or finish[ch.index]
        for i, choice in enumerate(whole.choices):
            assert texts[i] == choice.text and texts[i].startswith(prompts[i])
            assert lps[i][0] is None is choice.logprobs.token_logprobs[0]  # batched apart: float32 rounding differs
            np.testing.assert_allclose(lps[i][1:], choice.logprobs.token_logprobs[1:], atol=1e-5, rtol=0)
            assert finish[i] == choice.finish_reason == ("length" if max_tokens == 0 else finish[i])


def test_logit_bias_steers_greedy_decoding(client, engine):
    """+100 on one id makes greedy decoding choose it at every step; -100 on the unbiased greedy first token
    makes it choose another; an id outside the vocabulary is a 400."""
    kw = dict(model="chatm", prompt="Hello", max_tokens=3, temperature=0)
    plain = client.completions.create(**kw).choices[0].text
    forced = engine.encode("z")[0]
    assert client.completions.create(logit_bias={str(forced): 100}, **kw).choices[0].text == "zzz"
    first = engine.encode(plain)[0]
    other = client.completions.create(logit_bias={str(first): -100}, **kw).choices[0].text
    assert engine.encode(other)[0] != first
    with pytest.raises(openai.BadRequestError):
        client.completions.create(logit_bias={str(engine.model_config.vocab_size): 5}, **kw)


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


def test_response_format_json_schema_and_json_object(client):
    """Structured output through the openai client: every choice's content parses and matches the schema,
    streamed and not; json_object is any object; a schema that does not compile is a 400."""
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(model="chatm", messages=CHAT, response_format=fmt, temperature=1.0, seed=1,
                                       n=4, max_tokens=100)
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    stream = client.chat.completions.create(model="chatm", messages=CHAT, response_format=fmt, temperature=1.0,
                                            seed=7, max_tokens=100, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), PERSON)
    r = client.completions.create(model="chatm", prompt="Hello", max_tokens=100, temperature=1.0, seed=3,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].finish_reason != "stop" or isinstance(json.loads(r.choices[0].text), dict)
    assert r.choices[0].text.startswith("{")
    with pytest.raises(openai.BadRequestError, match="cannot be compiled"):
        client.chat.completions.create(model="chatm", messages=CHAT, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="chatm", messages=CHAT, max_tokens=5,
                                       response_format={"type": "yaml"})


def test_n_choices_are_the_requests_with_seeds_seed_plus_i(client):
    """n choices, streamed or not, are each what one request with seed, seed + 1, ... makes; usage counts the
    prompt once and every choice's tokens."""
    kw = dict(model="chatm", prompt="Once upon", max_tokens=6, temperature=1.0)
    singles = [client.completions.create(seed=7 + i, **kw) for i in range(3)]
    r = client.completions.create(n=3, seed=7, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [s.choices[0].text for s in singles]
    assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    texts = ["", "", ""]
    for part in client.completions.create(n=3, seed=7, stream=True, stream_options={"include_usage": True}, **kw):
        for c in part.choices:
            texts[c.index] += c.text
        if part.usage is not None:
            assert part.usage.completion_tokens == r.usage.completion_tokens
    assert texts == [c.text for c in r.choices]
    chat = client.chat.completions.create(model="chatm", messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=4, temperature=0)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content


def test_tokenize_and_detokenize(http, engine):
    """vLLM's /tokenize (a prompt, or messages rendered as the chat routes render them) and /detokenize, under
    the API key."""
    status, doc = raw(http, "POST", "/tokenize", json.dumps({"prompt": "Hello there"}).encode())
    assert status == 200 and doc["tokens"] == engine.encode("Hello there") and doc["count"] == len(doc["tokens"])
    assert doc["max_model_len"] == engine.max_seq_len
    messages = [{"role": "user", "content": "hi"}]
    status, doc = raw(http, "POST", "/tokenize", json.dumps({"messages": messages}).encode())
    assert status == 200 and doc["tokens"] == chat_ids(engine, messages)
    status, doc = raw(http, "POST", "/detokenize", json.dumps({"tokens": engine.encode("Hello there")}).encode())
    assert status == 200 and doc["prompt"] == "Hello there"
    assert raw(http, "POST", "/detokenize", json.dumps({"tokens": [-1]}).encode())[0] == 400
    req = urllib.request.Request(http.http_url + "/tokenize", data=b'{"prompt": "x"}', method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 401


def test_retry_after_on_busy_and_unavailable():
    """429 and 503 from the engine carry Retry-After: at least a second, or the refused restart's wait."""
    from coordinator.serving.openai_api import from_engine_error

    busy = from_engine_error({"type": "error", "code": "busy", "message": "full"})
    assert busy.status == 429 and busy.headers() == {"Retry-After": "1"}
    down = from_engine_error({"type": "error", "code": "unavailable", "message": "down", "retry_after_s": 11.2})
    assert down.status == 503 and down.headers() == {"Retry-After": "12"}
    assert from_engine_error({"type": "error", "code": "engine", "message": "x"}).headers() == {}


def test_unknown_route_chat_without_n1_and_the_server_keeps_serving(http, client, engine):
    assert raw(http, "GET", "/v1/nothing")[0] == 404
    assert raw(http, "GET", "/v1/completions")[0] == 405
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="chatm", messages=[{"role": "user", "content": "x"}], n=17)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="chatm", messages=[{"role": "wizard", "content": "x"}])
    r = client.completions.create(model="chatm", prompt="abc", max_tokens=3, temperature=0)
    assert r.choices[0].text == greedy_text(engine, engine.encode("abc"), 3)[0]


def test_half_sent_headers_are_dropped_after_the_timeout(http, client):
    host, port = http.http_url[len("http://"):].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        assert s.recv(1024) == b""  # closed by the server (the 30 s socket timeout would raise instead)
    assert client.models.list().data[0].id == "chatm"


def test_metrics_and_health(http, client):
    before = metric(http, "strata_generated_tokens_total")
    client.completions.create(model="chatm", prompt="abc", max_tokens=3, temperature=0)
    assert metric(http, "strata_generated_tokens_total") == before + 3
    status, health = raw(http, "GET", "/health")
    assert status == 200 and health["ok"] is True
    with urllib.request.urlopen(http.http_url + "/metrics", timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    for name in ("strata_requests_total", "strata_generated_tokens_total", "strata_tokens_per_second",
                 "strata_queue_depth", "strata_worker_restarts_total", "strata_hot_expert_hit_rate"):
        assert f"# TYPE {name} " in text and any(line.startswith(name + " ") for line in text.splitlines()), name
    assert 'strata_http_responses_total{route="/v1/completions",status="200"}' in text


def _histogram(text: str, name: str) -> dict[str, float]:
    """A histogram's samples by their last label's value (le) or suffix (_sum, _count)."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "_bucket{"):
            out[line.split('le="')[1].split('"')[0]] = float(line.split()[-1])
        elif line.startswith((name + "_sum{", name + "_count{")):
            assert 'model_name="chatm"' in line
            out[line.split("{")[0][len(name):]] = float(line.split()[-1])
    return out


def test_cors_lets_the_named_origin_in_and_no_other(http):
    """--cors ORIGIN: its preflight is answered (before the key is asked), its answers name it; another
    origin's requests get no CORS header, so a browser keeps its page out."""
    def headers(method: str, path: str, origin: str, extra: dict | None = None, key: bool = True):
        h = {"Origin": origin, **({"Authorization": f"Bearer {KEY}"} if key else {}), **(extra or {})}
        req = urllib.request.Request(http.http_url + path, method=method, headers=h)
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.headers
        except urllib.error.HTTPError as e:
            return e.code, e.headers

    status, h = headers("OPTIONS", "/v1/chat/completions", PAGE, {"Access-Control-Request-Method": "POST",
                                                                   "Access-Control-Request-Headers": "authorization"},
                        key=False)
    assert status == 204 and h["Access-Control-Allow-Origin"] == PAGE and "POST" in h["Access-Control-Allow-Methods"]
    status, h = headers("GET", "/v1/models", PAGE)
    assert status == 200 and h["Access-Control-Allow-Origin"] == PAGE
    status, h = headers("GET", "/v1/models", "http://elsewhere.example")
    assert status == 200 and "Access-Control-Allow-Origin" not in h
    status, h = headers("OPTIONS", "/v1/models", "http://elsewhere.example", {"Access-Control-Request-Method": "GET"},
                        key=False)
    assert status != 204 and "Access-Control-Allow-Origin" not in h


def test_latency_histograms_as_vllm_names_them(http, client):
    """Time to first token, inter-token latency, end to end and queue time: vLLM's names, cumulative buckets,
    one more request counted in each (and its 4 tokens: 3 gaps between them)."""
    def read() -> str:
        with urllib.request.urlopen(http.http_url + "/metrics", timeout=30) as r:
            return r.read().decode()

    names = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
             "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds")
    before = {n: _histogram(read(), n) for n in names}
    client.completions.create(model="chatm", prompt="abc", max_tokens=4, temperature=0, stop=None)
    text = read()
    for n in names:
        h = _histogram(text, n)
        assert f"# TYPE {n} histogram" in text and h["+Inf"] == h["_count"], n
        counts = [v for k, v in h.items() if not k.startswith("_")]
        assert counts == sorted(counts), n  # cumulative
        grew = 3 if n == "vllm:inter_token_latency_seconds" else 1
        assert h["_count"] == before[n].get("_count", 0) + grew and h["_sum"] >= before[n].get("_sum", 0), n


# -- a server of its own: no template, a full queue, then SIGTERM with requests in flight -----------------------


def test_no_template_full_queue_and_sigterm(tmp_path):
    """Chat without a template is a 400; with one sequence active and one queued the next request is a 429;
    SIGTERM ends the running stream with an error event and the queued request with a 503."""
    model = make_model(tmp_path / "plain", seed=1)
    (model / "tokenizer_config.json").unlink()  # make-model's ChatML template
    s = start_server(model, tmp_path, "--http", "127.0.0.1:0", "--max-active", "1", "--max-queued", "1")
    queued: list[BaseException | None] = [None]
    try:
        c = openai.OpenAI(base_url=s.http_url + "/v1", api_key="none", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            c.chat.completions.create(model="plain", messages=[{"role": "user", "content": "x"}])
        stream = iter(c.completions.create(model="plain", prompt="Hello", max_tokens=4000, temperature=0,
                                           stream=True))
        next(stream)  # running

        def wait_in_queue() -> None:
            try:
                c.completions.create(model="plain", prompt="abc", max_tokens=4000)
            except BaseException as exc:  # noqa: BLE001 - checked below
                queued[0] = exc

        waiter = threading.Thread(target=wait_in_queue)
        waiter.start()
        wait_for(lambda: metric(s, "strata_queue_depth") >= 1, "the second request queued")
        with pytest.raises(openai.RateLimitError, match="queue is full"):
            c.completions.create(model="plain", prompt="zz", max_tokens=2)
        s.proc.send_signal(signal.SIGTERM)
        with pytest.raises(openai.APIError, match="shutting down"):
            for _ in stream:
                pass
        waiter.join(60)
        assert isinstance(queued[0], openai.InternalServerError) and queued[0].status_code == 503, queued[0]
    finally:
        code = stop_server(s)
    assert code == 0, s.stderr()


def test_non_loopback_http_is_refused_before_loading(tmp_path):
    missing = tmp_path / "no-such-model"
    out = subprocess.run([sys.executable, "-m", "coordinator", "serve", "--model", str(missing), "--http",
                          "0.0.0.0:0", "--pool", "inproc"], cwd=REPO, env=server_env(), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0 and "--insecure-remote" in out.stderr and "0.0.0.0" in out.stderr, out.stderr
    assert str(missing) not in out.stderr


# -- the translation alone ---------------------------------------------------------------------------------------


def test_fields_keep_openai_names_and_defaults():
    f = generate_fields({}, chat=False, max_new_tokens_limit=100, default_max_tokens=16)
    assert f["temperature"] == 1.0 and f["max_new_tokens"] == 16 and f["logprobs"] is None and f["top_k"] == 0
    f = generate_fields({"max_completion_tokens": 5, "top_k": -1, "stop": "x", "logprobs": True, "top_logprobs": 4},
                        chat=True, max_new_tokens_limit=100, default_max_tokens=None)
    assert (f["max_new_tokens"], f["top_k"], f["stop"], f["logprobs"]) == (5, 0, ["x"], 4)
    for body, param in [({"top_p": 0}, "top_p"), ({"max_tokens": 101}, "max_tokens"), ({"stop": [1]}, "stop"),
                        ({"presence_penalty": 3}, "presence_penalty"), ({"top_logprobs": 2}, "top_logprobs"),
                        ({"echo": True}, "echo"), ({"seed": 1.5}, "seed")]:
        with pytest.raises(OpenAIError) as e:
            generate_fields(body, chat=True, max_new_tokens_limit=100, default_max_tokens=None)
        assert e.value.status == 400 and e.value.param == param, body


def test_engine_error_codes_map_to_http_statuses():
    got = {code: from_engine_error({"type": "error", "code": code, "message": "m"}).status
           for code in ("bad_request", "too_long", "not_found", "busy", "shutdown", "unavailable", "engine", "internal",
                        "new")}
    assert got == {"bad_request": 400, "too_long": 400, "not_found": 404, "busy": 429, "shutdown": 503,
                   "unavailable": 503, "engine": 500, "internal": 500, "new": 500}
    text = prometheus({"requests": 3, "experts": {"hit_rate": None}, "pool": {"nodes": [{"restarts": 2},
                                                                                      {"restarts": 1}]}},
                      Counter({("/v1/models", 200): 4}), 1)
    lines = text.splitlines()
    assert "strata_requests_total 3.0" in lines and "strata_worker_restarts_total 3.0" in lines
    assert "strata_hot_expert_hit_rate NaN" in lines and "strata_http_streams_open 1.0" in lines
    assert 'strata_http_responses_total{route="/v1/models",status="200"} 4' in lines
