"""A generate request: what it asks, the limits on it, and the error that refuses one.

The Scheduler's input (coordinator/scheduler.py), whichever front end made it: the JSON APIs
(serving/api.py decodes their documents into one) or Engine.generate. Each setting has its default here
and nowhere else: the sampling fields take SamplingParams', and every command and API that generates takes
DEFAULT_MAX_NEW_TOKENS.
"""

from __future__ import annotations

from dataclasses import dataclass

from .text.grammar import GrammarSpec
from .model.sampling_params import SamplingParams

DEFAULT_MAX_NEW_TOKENS = 256  # the most new tokens a request makes when it does not say
DEFAULT_MAX_NEW_TOKENS_LIMIT = 4096  # the most max_new_tokens a served request may ask for
DEFAULT_MAX_PROMPT_TOKENS = 32768  # the longest prompt a server accepts, in tokens
DEFAULT_MAX_PROMPT_CHARS = 1 << 20  # the longest text prompt a server accepts, in characters
DEFAULT_MAX_ACTIVE = 8  # requests a server decodes together (the Scheduler's max_active)
DEFAULT_MAX_QUEUED = 32  # requests a server keeps waiting before it answers 'busy'


class ApiError(ValueError):
    """A request refused; ``code`` names why ("bad_request", "busy", "too_long", ...) and goes into the
    error event of the API that carried it."""

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
    """One request's prompt (text or token ids), sampling and stopping; serving/api.py documents the fields."""

    id: str
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = SamplingParams.temperature
    top_p: float = SamplingParams.top_p
    top_k: int = SamplingParams.top_k
    seed: int | None = SamplingParams.seed
    stop: tuple[str, ...] = ()
    stream: bool = True
    deadline_s: float | None = None
    min_p: float = SamplingParams.min_p
    presence_penalty: float = SamplingParams.presence_penalty
    frequency_penalty: float = SamplingParams.frequency_penalty
    repetition_penalty: float = SamplingParams.repetition_penalty
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the prompt's tokens' log-probabilities, with this many alternatives each
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # go on past the model's end-of-sequence ids (Engine.generate's stop_at_eos=False)
    logit_bias: tuple[tuple[int, float], ...] = SamplingParams.logit_bias
    grammar: GrammarSpec | None = None  # every token chosen keeps the text inside it (model/grammar.py)
    skip_special_tokens: bool = True  # False: the text keeps special tokens (a tool-call format's markers)

    def sampling(self) -> SamplingParams:
        """The sampler's parameters; ConfigValueError names one out of range."""
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.seed, min_p=self.min_p,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias)
