"""The README's Python examples run as pasted, on the model its quick start makes (/tmp/tiny here a test's own)
and, for the client, against a running server (its address in place of the default's)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from coordinator.config import ENV_VARS
from coordinator.serving.api import DEFAULT_ADDRESS

REPO = Path(__file__).resolve().parents[1]


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)


def run(code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in {var for var, _ in ENV_VARS.values()}}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_engine_example_runs_as_pasted(tiny_model, tmp_path):
    block = next(b for b in python_blocks() if "Engine.open(" in b)
    model = tiny_model("tiny", seed=0)
    out = run(block.replace('"/tmp/tiny"', repr(str(model))), tmp_path)
    assert out.returncode == 0, out.stderr
    assert re.match(r"\(5, 320\) ", out.stdout), out.stdout  # "Hello": five byte-level tokens, the tiny vocabulary


def test_the_client_example_runs_as_pasted(server, tmp_path):
    block = next(b for b in python_blocks() if "Client(" in b)
    out = run(block.replace(f'"{DEFAULT_ADDRESS}"', repr(server.address)), tmp_path)
    assert out.returncode == 0, out.stderr
    assert re.search(r"(length|stop) \{.*\}\nTrue ", out.stdout), out.stdout
