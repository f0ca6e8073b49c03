"""tools/gpu_check.sh runs only where a GPU is lent, so what it names is checked here: its Python parts import
names the project has, and the modules, scripts and test files it runs exist (a module moved in the tree fails
this, not a GPU session's first minutes)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re

from source_imports import REPO

SCRIPT = (REPO / "tools" / "gpu_check.sh").read_text()
PROJECT = ("coordinator", "node_worker", "shm")


def heredocs() -> list[str]:
    return re.findall(r"<<'PY'\n(.*?)\nPY\n", SCRIPT, flags=re.S)


def test_its_python_imports_names_the_project_has():
    docs = heredocs()
    assert len(docs) >= 2
    named = []
    for doc in docs:
        for node in ast.walk(ast.parse(doc)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PROJECT:
                named += [(node.module, alias.name) for alias in node.names]
            elif isinstance(node, ast.Import):
                named += [(alias.name, None) for alias in node.names if alias.name.split(".")[0] in PROJECT]
    assert named  # the probe's import at least
    for module, name in named:
        mod = importlib.import_module(module)
        assert name is None or hasattr(mod, name), f"{module} has no {name}"


def test_the_modules_scripts_and_tests_it_runs_exist():
    modules = re.findall(r"-m (coordinator[\w.]*)", SCRIPT)
    files = set(re.findall(r"\b((?:tools|tests)/[\w/]+\.py)\b", SCRIPT))
    assert modules and files
    for module in modules:
        assert importlib.util.find_spec(module) is not None, module
    assert sorted(f for f in files if not (REPO / f).exists()) == []
