"""``strata chat``: talk to a model in the terminal, the conversation rendered by the model's chat template.

The engine loads once, in this process. Each line read from stdin (a terminal or a pipe) is a user message; the
history is rendered with add_generation_prompt, tokenised, and the answer streamed as it is generated (through
Engine.generate_full, the serving loop's sampling and stopping), until the model's eos (or the template's
eos_token), a --stop string, --max-new-tokens, or Ctrl-C, which ends that answer only (Ctrl-C or end of input
at the prompt ends the chat). After each answer one line on stderr, as llama.cpp's:

    [prompt: 31 tok, 812.4 tok/s | decode: 63 tok, 41.0 tok/s | first token: 38 ms]

The oldest exchanges are dropped (the system message kept) when the prompt and --max-new-tokens would not fit
the context. Commands (COMMANDS): /help, /reset (forget the conversation), /exit; another word after a "/" is
refused, not sent ("//" sends a line that starts with "/"). At a terminal the line is read with readline: the
line can be edited and earlier lines recalled with the arrow keys.

At a terminal, Ctrl-C during an answer is read as a key (the terminal's signal keys off while the model
writes): the terminal would send SIGINT to the node worker processes too, which stop on it.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import time
from pathlib import Path
from typing import Callable

from ..errors import StrataError
from .flags import add_engine_flags, add_sampling_flags, engine_config, print_config, sampling_options

COMMANDS = {"/help": "list the commands", "/reset": "forget the conversation (the system message stays)",
            "/exit": "leave (so does Ctrl-D, or Ctrl-C at the prompt)"}
CTRL_C = b"\x03"


class _AnswerStopped(Exception):
    """Raised from the token callback to end an answer: Ctrl-C."""


def add_chat_command(sub, common) -> None:
    """The ``chat`` subcommand: generate's engine and sampling flags, plus --system."""
    p = sub.add_parser("chat", help="chat in the terminal through the model's chat template", parents=[common])
    p.add_argument("-m", "--model", required=True, type=Path,
                   help="a checkpoint folder or a GGUF file, with a chat template")
    p.add_argument("--system", default=None, metavar="TEXT", help="a system message first in the conversation")
    add_sampling_flags(p)
    add_engine_flags(p)
    p.set_defaults(func=cmd_chat)


def fit_history(history: list[dict], render: Callable[[list[dict]], list[int]], limit: int,
                max_new_tokens: int) -> tuple[list[int], int, int]:
    """(prompt ids, exchanges dropped, new tokens allowed): the oldest user/assistant exchanges dropped from
    ``history`` (in place; a leading system message kept, the last user message never) until the prompt plus
    ``max_new_tokens`` fits ``limit``; when even the last message alone does not, fewer new tokens. StrataError
    when the prompt alone leaves no room for one."""
    first = 1 if history and history[0].get("role") == "system" else 0
    dropped = 0
    ids = render(history)
    while len(ids) + max_new_tokens > limit and len(history) - first > 1:
        end = first + 1  # the oldest exchange: its user message and everything up to the next user message
        while end < len(history) - 1 and history[end].get("role") != "user":
            end += 1
        del history[first:end]
        dropped += 1
        ids = render(history)
    if len(ids) >= limit:
        raise StrataError(f"the message makes a prompt of {len(ids)} tokens; the context holds {limit}")
    return ids, dropped, min(max_new_tokens, limit - len(ids))


def speed_line(prompt_tokens: int, ttft_s: float, decode_tokens: int, decode_s: float) -> str:
    """llama.cpp's line after an answer."""
    def rate(n: int, s: float) -> str:
        return f"{n / s:.1f}" if n and s > 0 else "-"

    return (f"[prompt: {prompt_tokens} tok, {rate(prompt_tokens, ttft_s)} tok/s | decode: {decode_tokens} tok, "
            f"{rate(decode_tokens, decode_s)} tok/s | first token: {ttft_s * 1000:.0f} ms]")


class _CtrlC:
    """While an answer is generated: Ctrl-C asks it to stop at the next token. SIGINT sets ``requested`` (a
    second one interrupts as usual); at a terminal the key itself is read (``poll``), the terminal's signal keys,
    line mode and echo off meanwhile, so that no SIGINT reaches the node workers in the same process group."""

    def __init__(self, tty: bool):
        self.requested = False
        self.fd = sys.stdin.fileno() if tty else None
        self.saved = None

    def _on_sigint(self, signum, frame):
        if self.requested:  # a second Ctrl-C: interrupted as anywhere else (the command's own handler)
            if callable(self.previous):
                self.previous(signum, frame)
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> "_CtrlC":
        self.previous = signal.signal(signal.SIGINT, self._on_sigint)
        if self.fd is not None:
            import termios

            self.saved = termios.tcgetattr(self.fd)
            quiet = list(self.saved)
            quiet[3] &= ~(termios.ISIG | termios.ICANON | termios.ECHO)
            quiet[6] = list(self.saved[6])
            quiet[6][termios.VMIN], quiet[6][termios.VTIME] = 0, 0
            termios.tcsetattr(self.fd, termios.TCSANOW, quiet)
        return self

    def poll(self) -> bool:
        """Whether Ctrl-C was pressed; keys typed while the model writes are dropped."""
        while self.fd is not None and select.select([self.fd], [], [], 0)[0]:
            data = os.read(self.fd, 64)
            if not data:
                break
            self.requested |= CTRL_C in data
        return self.requested

    def __exit__(self, *exc) -> None:
        if self.saved is not None:
            import termios

            termios.tcsetattr(self.fd, termios.TCSANOW, self.saved)
        signal.signal(signal.SIGINT, self.previous)


def _answer(engine, ids: list[int], max_new: int, args, seed, tty: bool) -> tuple[str, str]:
    """Generate and stream one answer, ended by the model's eos, the template's end-of-turn token, a --stop
    string, the token limit or Ctrl-C: (its text, why it ended)."""
    from ..text.chat_template import turn_end_id

    turn_end = turn_end_id(engine.chat_template, engine.codec)
    options = {**sampling_options(args), "seed": seed, "stop_token_ids": () if turn_end is None else (turn_end,)}
    times: list[float] = []
    pieces: list[str] = []
    start = time.perf_counter()

    def on_text(piece: str) -> None:
        pieces.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()

    with _CtrlC(tty) as ctrl_c:
        def on_token(token: int) -> None:
            times.append(time.perf_counter())
            if ctrl_c.poll():
                raise _AnswerStopped("interrupted")

        try:
            result = engine.generate_full(ids, max_new, args.temperature, on_token=on_token, on_text=on_text,
                                          **options)
            reason, answer = result.finish_reason, result.text
        except _AnswerStopped as why:
            reason, answer = str(why), "".join(pieces)
    sys.stdout.write("\n")
    sys.stdout.flush()
    first = times[0] - start if times else time.perf_counter() - start
    decode_s = times[-1] - times[0] if times else 0.0
    print(speed_line(len(ids), first, max(len(times) - 1, 0), decode_s), file=sys.stderr, flush=True)
    if reason == "interrupted":
        print("[answer stopped]", file=sys.stderr, flush=True)
    return answer, reason


def _read_line(tty: bool) -> str | None:
    """The next line of input without its end; None at end of input or Ctrl-C. At a terminal through readline
    (input()): the line editable, earlier lines recalled with the arrow keys."""
    if tty:
        try:
            return input("> ")
        except (EOFError, KeyboardInterrupt):
            sys.stdout.write("\n")
            return None
    try:
        line = sys.stdin.readline()
    except KeyboardInterrupt:
        line = ""
    return line.rstrip("\r\n") if line else None


def command_of(line: str) -> tuple[str, str]:
    """(command, text): a line "/word ..." is the command "/word" (text ''); "//..." is the text "/..."; any
    other line is text to send."""
    stripped = line.strip()
    if stripped.startswith("//"):
        return "", stripped[1:]
    if stripped.startswith("/") and len(stripped) > 1:
        return stripped.split()[0], ""
    return "", line


def help_text() -> str:
    return "\n".join(f"  {name:<7} {what}" for name, what in COMMANDS.items()) + \
        "\n  //text  send a line that starts with /; Ctrl-C stops an answer"


def cmd_chat(args: argparse.Namespace) -> int:
    from ..engine import Engine
    from ..model.source import open_source

    config, sources = engine_config(args)
    if args.print_config:
        print_config(config, sources)
        return 0
    source = open_source(args.model)  # configuration, tokenizer and template: what chat needs is checked first
    if source.codec is None:
        raise StrataError(f"{args.model} has no tokenizer; chat needs one")
    if source.chat_template_error is not None:
        raise StrataError(source.chat_template_error)
    if source.chat_template is None:
        raise StrataError(f"{args.model} has no chat template (chat_template.jinja or tokenizer_config.json's "
                          "chat_template in the folder, tokenizer.chat_template in a GGUF file); use "
                          "`strata generate` for plain text")
    system = [{"role": "system", "content": args.system}] if args.system else []
    tty = sys.stdin.isatty()
    with Engine.open(args.model, config, source, quiet=args.quiet) as engine:
        if not args.quiet:
            print(engine.pool_description(), file=sys.stderr)
        print(f"chat: {', '.join(COMMANDS)}; Ctrl-C stops an answer, Ctrl-D (end of input) leaves", file=sys.stderr,
              flush=True)
        if tty:
            import readline  # noqa: F401  (input() then edits the line and keeps the history)

        def render(history: list[dict]) -> list[int]:
            return engine.encode(engine.chat_template.render(history, add_generation_prompt=True))

        history = list(system)
        answers = 0
        while (line := _read_line(tty)) is not None:
            command, text = command_of(line)
            if command == "/exit":
                break
            if command == "/help":
                print(help_text(), file=sys.stderr, flush=True)
                continue
            if command == "/reset":
                history = list(system)
                print("[history cleared]", file=sys.stderr, flush=True)
                continue
            if command:
                print(f"strata: unknown command {command} (not sent); /help lists the commands", file=sys.stderr,
                      flush=True)
                continue
            if not text.strip():
                continue
            history.append({"role": "user", "content": text})
            try:
                ids, dropped, max_new = fit_history(history, render, engine.max_seq_len, args.max_new_tokens)
            except StrataError as exc:
                history.pop()
                print(f"strata: {exc}; not sent", file=sys.stderr, flush=True)
                continue
            if dropped:
                print(f"[context: dropped the {dropped} oldest exchange{'s' if dropped > 1 else ''} to fit "
                      f"{engine.max_seq_len} tokens]", file=sys.stderr, flush=True)
            if max_new < args.max_new_tokens:
                print(f"[context: at most {max_new} new tokens fit]", file=sys.stderr, flush=True)
            seed = None if args.seed is None else args.seed + answers
            text, _ = _answer(engine, ids, max_new, args, seed, tty)
            history.append({"role": "assistant", "content": text})
            answers += 1
    return 0
