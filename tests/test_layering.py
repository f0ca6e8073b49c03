"""How the coordinator's modules depend on each other, read from their source (every import, those inside
functions included): the model below the engine, the generation loop between them, serving and the command line
above it, serving through the engine's public surface. (Between the packages, circles and underscore names:
test_code_shape.py.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("coordinator", "node_worker", "shm")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for package in PACKAGES for p in (REPO / package).rglob("*.py")}


def imports(name: str) -> list[tuple[str, list[str]]]:
    """(module, names taken from it) for every import statement of module ``name``, relative ones resolved."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            source = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
            out.append((source, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
    return out


def project_deps(name: str) -> set[str]:
    """The project modules ``name`` imports (a name taken from a package counts as its module where it is one)."""
    deps = set()
    for source, names in imports(name):
        for taken in names or [None]:
            full = f"{source}.{taken}" if taken else source
            deps.add(full if full in MODULES else source)
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
