"""The packages' shape, read from their source: imports run one way with no circle, no module imports another's
underscore names, and STRATA_ variables are read in coordinator/config.py alone."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("coordinator", "node_worker", "shm")
LAYER = {"coordinator": 0, "node_worker": 1, "shm": 2}  # a package imports only those after it


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, list[str], int]]:
    """(the module imported, the names taken from it, line) for every import in the module, lazy ones too."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - (node.level - 1)] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((sub if sub in known else target, [alias.name], node.lineno))
        elif isinstance(node, ast.Import):
            found.extend((alias.name, [], node.lineno) for alias in node.names)
    return found


def test_no_module_imports_another_modules_underscore_names():
    known = modules()
    hits = [f"{path.relative_to(REPO)}:{line} takes {n} from {target}"
            for name, path in known.items() for target, names, line in imports(name, path, known)
            for n in names if n.startswith("_") and not n.startswith("__") and target != name]
    assert hits == []


def test_imports_run_one_way_and_make_no_circle():
    known = modules()
    graph = {name: {t for t, _, _ in imports(name, path, known) if t in known and t != name}
             for name, path in known.items()}
    upward = [f"{a} imports {b}" for a, targets in graph.items() for b in targets
              if LAYER[b.split(".")[0]] < LAYER[a.split(".")[0]]]
    assert upward == []
    # a circle: a strongly connected group of modules (Tarjan), a package's __init__ counted as a module
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    assert circles == []


def reads_environment(node: ast.AST) -> ast.AST | None:
    """The key expression of os.environ[...], os.environ.get(...), os.getenv(...) or ``... in os.environ``."""
    def is_environ(n):
        return isinstance(n, ast.Attribute) and n.attr == "environ"

    if isinstance(node, ast.Subscript) and is_environ(node.value):
        return node.slice
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
        if (node.func.attr in {"get", "pop", "setdefault"} and is_environ(node.func.value)) or node.func.attr == "getenv":
            return node.args[0]
    if isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
        return node.left
    return None


def test_strata_variables_are_read_in_the_config_module_alone():
    known = modules()
    hits = []
    for name, path in known.items():
        if name == "coordinator.config":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            key = reads_environment(node)
            if key is None:
                continue
            text = ast.unparse(key)
            if "STRATA_" in text or text.endswith("_VAR"):
                hits.append(f"{path.relative_to(REPO)}:{node.lineno} reads {text}")
    assert hits == []
