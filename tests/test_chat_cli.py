"""``strata chat``: a scripted conversation through a pipe, against the engine's own greedy continuations."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from coordinator import Engine, EngineConfig
from coordinator.cli.chat import fit_history
from coordinator.cli.main import main
from coordinator.cli.make_model import make_model
from coordinator.config import ENV_VARS
from coordinator.errors import StrataError
from coordinator.text.chat_template import load_chat_template
from leftovers import segments_left, segments_now

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("dev_shm_alone")]  # `strata chat` processes

REPO = Path(__file__).resolve().parents[1]
N = 12
SYSTEM = "Be brief."
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPEED = re.compile(r"^\[prompt: (\d+) tok, [\d.]+ tok/s \| decode: \d+ tok, [\d.-]+ tok/s \| first token: \d+ ms\]$")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    model = make_model(tmp_path_factory.mktemp("chat") / "m", seed=0)
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    return model


def expected_answer(engine: Engine, template, messages: list[dict]) -> tuple[list[int], str]:
    """(prompt ids, answer text): greedy, cut where chat stops (the model's eos or the template's <|im_end|>)."""
    ids = engine.encode(template.render(messages, add_generation_prompt=True))
    stops = set(engine.model_config.eos_token_ids) | {engine.codec.tokenizer.token_to_id(template.eos_token)}
    out = engine.generate(ids, N, stop_at_eos=False)
    cut = next((i for i, t in enumerate(out) if t in stops), len(out))
    return ids, engine.decode(out[:cut])


def test_chat_streams_the_greedy_answers_and_reset_forgets(chat_model):
    env = {k: v for k, v in os.environ.items() if k not in {var for var, _ in ENV_VARS.values()}}
    before = segments_now()
    proc = subprocess.Popen([sys.executable, "-m", "coordinator", "chat", "-m", str(chat_model), "-n", str(N),
                             "--system", SYSTEM], cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate("hello\n/reset\nagain\n/exit\n", timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 0, err

    template = load_chat_template(chat_model)  # the reference: rendered, encoded and generated here
    system = {"role": "system", "content": SYSTEM}
    with Engine.open(chat_model, EngineConfig(pool="inproc")) as engine:
        ids1, first = expected_answer(engine, template, [system, {"role": "user", "content": "hello"}])
        ids2, second = expected_answer(engine, template, [system, {"role": "user", "content": "again"}])
        _, remembered = expected_answer(engine, template, [system, {"role": "user", "content": "hello"},
                                                           {"role": "assistant", "content": first},
                                                           {"role": "user", "content": "again"}])
    assert first and second and remembered != second  # the test tells a reset from a remembered exchange
    assert out == f"{first}\n{second}\n"  # streamed, no prompt marker on a pipe
    speed = [SPEED.match(line) for line in err.splitlines() if line.startswith("[prompt:")]
    assert all(speed) and [int(m[1]) for m in speed] == [len(ids1), len(ids2)], err  # one line per answer
    assert "[history cleared]" in err

    workers = [p for p in psutil.process_iter(["cmdline"])
               if f"--parent-pid {proc.pid}" in " ".join(p.info["cmdline"] or [])]
    assert not workers, "node workers left running"

    assert not segments_left(before, {proc.pid}), "segments left in /dev/shm"


def test_a_model_without_a_template_is_refused_before_loading(tiny_model, capsys):
    model = tiny_model()
    (model / "tokenizer_config.json").unlink()  # make-model's ChatML template
    assert main(["chat", "-m", str(model), "--pool", "inproc"]) == 2
    err = capsys.readouterr().err
    assert "has no chat template" in err and "pool " not in err  # refused before the engine loaded


def test_fit_history_drops_the_oldest_exchanges_and_keeps_the_system_message():
    def render(history):  # 10 tokens a message
        return [0] * (10 * len(history))

    system = {"role": "system", "content": "s"}
    turns = [{"role": r, "content": str(i)} for i in range(3) for r in ("user", "assistant")]
    history = [system, *turns, {"role": "user", "content": "now"}]
    ids, dropped, max_new = fit_history(history, render, limit=60, max_new_tokens=20)
    assert (len(ids), dropped, max_new) == (40, 2, 20)
    assert history == [system, *turns[4:], {"role": "user", "content": "now"}]
    ids, dropped, max_new = fit_history(history, render, limit=25, max_new_tokens=20)  # only the last one left
    assert (history, dropped, max_new) == ([system, {"role": "user", "content": "now"}], 1, 5)
    with pytest.raises(StrataError, match="prompt of 10 tokens; the context holds 10"):
        fit_history([{"role": "user", "content": "too long"}], render, 10, 5)


def test_help_lists_the_commands_and_an_unknown_command_is_not_sent(chat_model):
    """/help lists the commands; /nonsense is refused with a pointer to /help and nothing is generated for it;
    "//x" sends "/x" as text."""
    env = {k: v for k, v in os.environ.items() if k not in {var for var, _ in ENV_VARS.values()}}
    proc = subprocess.run([sys.executable, "-m", "coordinator", "chat", "-m", str(chat_model), "-n", "3", "--pool",
                           "inproc"], cwd=REPO, env=env, input="/help\n/nonsense\n//x\n", capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert all(name in proc.stderr for name in ("/help", "/reset", "/exit"))
    assert "unknown command /nonsense (not sent); /help lists the commands" in proc.stderr
    assert len([line for line in proc.stderr.splitlines() if line.startswith("[prompt:")]) == 1  # "//x" alone


def test_the_readmes_chat_example_runs_on_the_demo_model(tmp_path):
    """The README's chat example, on a model `strata make-model` wrote (its ChatML template): answers a line."""
    readme = (REPO / "README.md").read_text()
    example = next(line.strip() for line in readme.splitlines() if line.strip().startswith("strata chat -m /tmp/tiny"))
    model = tmp_path / "tiny"
    make_model(model, seed=0)
    argv = shlex.split(example.split("#")[0])[1:]
    argv = [str(model) if a == "/tmp/tiny" else a for a in argv]
    env = {k: v for k, v in os.environ.items() if k not in {var for var, _ in ENV_VARS.values()}}
    proc = subprocess.run([sys.executable, "-m", "coordinator", *argv, "-n", "4"], cwd=REPO, env=env,
                          input="hello\n", capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and "[prompt:" in proc.stderr, proc.stderr
