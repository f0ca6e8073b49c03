"""coordinator/model/arch/: a file a model family. The families are found, not listed; nothing outside the package
compares a model's architecture with a family's name; and a family added as one file (here a copy of the package
with one new file) is parsed, written by make-model and generated from."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from source_imports import REPO, project_modules

from coordinator.model.arch import BY_CLASS, BY_GGUF, FAMILIES, PRESETS, SHARED
from coordinator.model.arch.base import Family


def test_every_file_of_the_package_is_a_family_found():
    files = sorted(p.stem for p in (REPO / "coordinator" / "model" / "arch").glob("*.py")
                   if p.stem not in ("__init__", *SHARED))
    modules = sorted({type(f).__module__.rsplit(".", 1)[1] for f in FAMILIES.values()})
    assert files == modules and len(FAMILIES) >= 7
    assert all(isinstance(f, Family) and BY_CLASS[f.hf_class] is f for f in FAMILIES.values())
    assert all(PRESETS[name][0] is f for f in FAMILIES.values() for name in f.presets)
    assert set(BY_GGUF) == {"qwen3moe", "qwen2moe", "llama", "deepseek2", "glm4moe", "qwen3next"}
    assert all(BY_GGUF[f.gguf_arch] is f for f in FAMILIES.values() if f.gguf_arch)


def names_compared_with_an_arch(path) -> list[str]:
    """Comparisons of something's ``.arch`` (or a name ``arch``) with a string: a family's rule kept outside its
    file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            arch = any((isinstance(s, ast.Attribute) and s.attr == "arch") or
                       (isinstance(s, ast.Name) and s.id == "arch") for s in sides)
            text = any(isinstance(s, ast.Constant) and isinstance(s.value, str) or
                       isinstance(s, (ast.Tuple, ast.List)) and any(isinstance(e, ast.Constant) for e in s.elts)
                       for s in sides)
            if arch and text:
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_family_rule_lives_outside_its_file():
    outside = [hit for name, path in project_modules().items()
               if name.startswith("coordinator.") and not name.startswith("coordinator.model.arch")
               for hit in names_compared_with_an_arch(path)]
    assert outside == []


TOY = '''
"""A toy family: Qwen3-MoE's network under names of its own."""
from .qwen3_moe import Qwen3Moe


class ToyMoe(Qwen3Moe):
    name = "toy_moe"
    hf_class = "ToyMoeForCausalLM"
    moe_block = "toy_block"
    presets = {}
    gguf_arch = ""  # no GGUF files: Qwen3-MoE's are read as Qwen3-MoE's


FAMILY = ToyMoe()
'''


@pytest.mark.slow
def test_a_family_added_as_one_file_is_made_opened_and_run(tmp_path):
    """The package copied with one new file, toy_moe.py (Qwen3-MoE under another class name and MoE block name):
    make-model writes it (its block's tensor names), Engine.open parses and loads it, and generate runs; nothing
    else changed."""
    root = tmp_path / "tree"
    shutil.copytree(REPO / "coordinator", root / "coordinator", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "coordinator" / "model" / "arch" / "toy_moe.py").write_text(TOY)
    script = textwrap.dedent(f"""
        import json, sys
        import coordinator
        assert coordinator.__file__.startswith({str(root)!r}), coordinator.__file__
        from coordinator import Engine, EngineConfig
        from coordinator.cli.make_model import make_model
        from shm.checkpoint import Checkpoint
        out = make_model({str(tmp_path / 'm')!r}, arch="toy_moe", seed=1)
        assert json.loads((out / "config.json").read_text())["architectures"] == ["ToyMoeForCausalLM"]
        assert "model.layers.0.toy_block.experts.0.gate_proj.weight" in Checkpoint(out)
        with Engine.open(out, EngineConfig(pool="inproc", device="cpu")) as eng:
            assert eng.model_config.arch == "toy_moe"
            print(len(eng.generate([1, 2, 3], max_new_tokens=4, stop_at_eos=False)))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(REPO)])}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "4"
