"""Constrained decoding: every chosen token keeps the text inside a grammar (a JSON schema, Lark, a regex).

The grammar engine is llguidance (Microsoft's, the one vLLM and llama.cpp use): it computes, per step, the
set of tokens whose bytes can continue the text so far (its cost per token: docs/benchmarks.md,
``tools/grammar_bench.py``). This module adapts it to the engine:

    GrammarSpec        what a request asks: kind + source text (frozen, hashable: the compile cache's key)
    Grammars           one per engine: the vocabulary as llguidance sees it (built once, off the serving
                       loop) and a cache of checked grammars
    Constraint         one per sequence: ``mask(logits)`` -> logits with -inf outside the grammar,
                       ``accept(token)`` advances it

The end of a sequence is the engine's business, not the grammar's: the request's end ids (the model's eos
ids and its stop_token_ids) are allowed exactly when the grammar accepts the text so far (and are the only
tokens allowed once it can take no more), and an end id is never fed to the grammar.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..errors import StrataError

KINDS = ("json_schema", "json_object", "lark", "regex")
MAX_CACHED = 64  # compiled grammars kept (n choices of one request share one; so do repeated schemas)
# Compact JSON: no whitespace between tokens; free whitespace lets a weak model pad forever within the limit.
JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(StrataError):
    """A grammar that cannot be compiled, or a sequence whose grammar reached an error; the message says why."""


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # one of KINDS
    source: str = ""  # json_schema: the schema as JSON text; lark: the grammar; regex: the pattern; json_object: ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise GrammarError(f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}")

    @classmethod
    def json_schema(cls, schema: dict | bool) -> "GrammarSpec":
        return cls("json_schema", json.dumps(schema, separators=(",", ":")))  # key order kept: it is the output's

    def llguidance(self) -> str:
        """The llguidance grammar document of this spec."""
        import llguidance

        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        return llguidance.LLMatcher.grammar_from_lark(self.source)


class Grammars:
    """The tokenizer's vocabulary for llguidance and the grammars compiled against it; thread-safe (the server
    compiles off its loop)."""

    def __init__(self, tokenizer_json: str, vocab_size: int):
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size  # the logits' length (the tokenizer's, or more when the model pads it)
        self._ll_tokenizer = None
        self._cache: OrderedDict[GrammarSpec, str] = OrderedDict()
        self._lock = threading.Lock()

    def tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance

                self._ll_tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size)
            return self._ll_tokenizer

    def compile(self, spec: GrammarSpec) -> str:
        """The checked llguidance grammar of ``spec``; GrammarError naming what is wrong with it."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        import llguidance

        try:
            grammar = spec.llguidance()
        except (ValueError, TypeError, RuntimeError) as exc:
            raise GrammarError(f"the {spec.kind} grammar cannot be compiled: {exc}") from None
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer())
        if failed:
            raise GrammarError(f"the {spec.kind} grammar cannot be compiled: {'; '.join(messages)}")
        with self._lock:
            self._cache[spec] = grammar
            while len(self._cache) > MAX_CACHED:
                self._cache.popitem(last=False)
        return grammar

    def constraint(self, spec: GrammarSpec, end_ids) -> "Constraint":
        """A new sequence's constraint; ``end_ids`` are the ids that end it (allowed when the grammar accepts)."""
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer(), self.compile(spec))
        if matcher.is_error():
            raise GrammarError(f"the {spec.kind} grammar cannot start: {matcher.get_error()}")
        return Constraint(matcher, self.vocab_size, end_ids)


class Constraint:
    """One sequence's grammar state: the tokens it allows next, advanced by each token chosen."""

    def __init__(self, matcher, vocab_size: int, end_ids):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.end_ids = np.array(sorted({int(t) for t in end_ids if 0 <= int(t) < vocab_size}), np.int64)
        self.bitmask = np.zeros((vocab_size + 31) // 32, np.int32)  # llguidance's mask: bit t of word t // 32

    def allowed(self) -> np.ndarray:
        """bool [V]: the tokens that may come next."""
        self.matcher.unsafe_compute_mask_ptr(self.bitmask.ctypes.data, self.bitmask.nbytes)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar reached an error: {self.matcher.get_error()}")
        ok = np.unpackbits(self.bitmask.view(np.uint8), bitorder="little")[:self.vocab_size].view(bool)
        ok[self.end_ids] = self.matcher.is_accepting()  # the grammar's own eos bit is not the request's ends
        if not ok.any():
            raise GrammarError("the grammar allows no token here")
        return ok

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """logits [V] -> a new array, -inf where the grammar forbids the token (a copy and a masked store: the
        cheapest of NumPy's ways at 152 k tokens, tools/grammar_bench.py)."""
        out = logits.copy()
        out[~self.allowed()] = -np.inf
        return out

    def accept(self, token: int) -> None:
        """Advance past a chosen token (an end id ends the sequence and is not the grammar's)."""
        if token in self.end_ids:
            return
        if not self.matcher.consume_token(int(token)):
            raise GrammarError(f"token {token} does not continue the grammar: {self.matcher.get_error()}")
