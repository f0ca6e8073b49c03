"""How the coordinator's modules depend on each other, read from their source (every import, those inside
functions included): the model below the engine, the generation loop between them, serving and the command line
above it, serving through the engine's public surface. (Between the packages, circles and underscore names:
test_code_shape.py.)"""

from __future__ import annotations

import ast

import pytest
from source_imports import imports, project_modules

MODULES = project_modules()


def project_deps(name: str) -> set[str]:
    """The project modules ``name`` imports (a name taken from a package counts as its module where it is one)."""
    deps = {i.target(MODULES) for i in imports(MODULES[name])}
    return {d for d in deps if d in MODULES and d != name}


GRAPH = {name: project_deps(name) for name in MODULES}


def under(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_commands_share_their_flags_through_a_module_of_their_own():
    """chat and the other commands take the shared flags from cli/flags.py: chat does not reach back into main,
    which registers it."""
    assert {"coordinator.cli.chat", "coordinator.cli.flags"} <= GRAPH["coordinator.cli.main"]
    assert "coordinator.cli.flags" in GRAPH["coordinator.cli.chat"]
    assert "coordinator.cli.main" not in GRAPH["coordinator.cli.chat"]


@pytest.mark.parametrize("lower, upper", [
    ("coordinator.model", ("coordinator.engine", "coordinator.scheduler", "coordinator.request",
                           "coordinator.serving", "coordinator.cli")),
    ("coordinator.engine", ("coordinator.serving", "coordinator.cli")),
    ("coordinator.scheduler", ("coordinator.engine", "coordinator.serving", "coordinator.cli")),
    ("coordinator.request", ("coordinator.engine", "coordinator.scheduler", "coordinator.serving",
                             "coordinator.cli")),
    ("coordinator.serving", ("coordinator.cli",)),
])
def test_imports_run_one_way(lower, upper):
    upward = sorted((name, dep) for name in MODULES if under(name, lower) for dep in GRAPH[name]
                    if under(dep, *upper))
    assert not upward


GPU_LIBRARIES = ("cupy", "cupyx", "cupy_backends")


@pytest.mark.parametrize("room, barred", [
    ("coordinator.model", ("coordinator.gpu", "coordinator.host", *GPU_LIBRARIES)),
    ("coordinator.host", ("coordinator.gpu", *GPU_LIBRARIES)),
    ("coordinator.gpu", ("coordinator.host",)),
])
def test_the_network_knows_no_backend_and_the_backends_not_each_other(room, barred):
    """model/ holds the network against the backend protocol (model/backend.py) and imports no backend and no GPU
    library; host/ and gpu/ import model/, never each other (every import, those inside functions included)."""
    reaching = sorted((name, i.target(MODULES)) for name in MODULES if under(name, room)
                      for i in imports(MODULES[name]) if under(i.target(MODULES), *barred))
    assert not reaching


def test_text_stands_on_its_own():
    """The tokenizers, chat templates and grammars (coordinator/text/) import no other coordinator package but
    errors.py: the model, the server and the command line use them, not the other way round."""
    reaching = sorted((name, i.target(MODULES)) for name in MODULES if under(name, "coordinator.text")
                      for i in imports(MODULES[name]) if under(i.target(MODULES), "coordinator")
                      and not under(i.target(MODULES), "coordinator.text", "coordinator.errors"))
    assert not reaching


def test_one_package_knows_cuda():
    """Every module that imports CuPy, or launches anything through it, is in coordinator/gpu/ (tests and tools
    aside)."""
    outside = sorted(name for name in MODULES if not under(name, "coordinator.gpu")
                     for i in imports(MODULES[name]) if under(i.module, *GPU_LIBRARIES))
    assert outside == []


def test_serving_uses_the_engines_public_surface_only():
    """The server and the scheduler reach the model and the pool through Engine's methods (step, new_cache,
    check_ids, stats, health, maintain, set_wait_hook), not its decoder or pool."""
    files = [MODULES["coordinator.scheduler"], *(p for n, p in MODULES.items() if under(n, "coordinator.serving"))]
    reaching = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("decoder", "pool") and \
                    ast.unparse(node.value).split(".")[-1] in ("engine", "eng"):
                reaching.append((path.name, node.lineno, ast.unparse(node)))
    assert not reaching, reaching
