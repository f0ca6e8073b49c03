"""The packages' shape, read from their source: imports run one way with no circle, no module imports another's
underscore names, and STRATA_ variables are read in coordinator/config.py alone."""

from __future__ import annotations

import ast

from source_imports import REPO, imports, project_modules

LAYER = {"coordinator": 0, "node_worker": 1, "shm": 2}  # a package imports only those after it


def test_no_module_imports_another_modules_underscore_names():
    known = project_modules()
    hits = [f"{path.relative_to(REPO)}:{i.line} takes {i.name} from {i.module}"
            for name, path in known.items() for i in imports(path)
            if i.name and i.name.startswith("_") and not i.name.startswith("__") and i.target(known) != name]
    assert hits == []


def test_imports_run_one_way_and_make_no_circle():
    known = project_modules()
    graph = {name: {t for t in (i.target(known) for i in imports(path)) if t in known and t != name}
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
    known = project_modules()
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


def test_cuda_lives_in_cu_files_not_in_python_strings():
    """The kernels' CUDA C is in coordinator/gpu/kernels/*.cu (NVRTC and the emulator read the same files): no
    string in a project module holds more than 20 lines of CUDA (a __global__ or __device__ function)."""
    long_cuda = []
    for path in project_modules().values():
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)  # prose about the kernels, not their code
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and n.body
                      and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if id(node) not in docstrings and isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    ("__global__" in node.value or "__device__" in node.value) and node.value.count("\n") > 20:
                long_cuda.append(f"{path.relative_to(REPO)}:{node.lineno} ({node.value.count(chr(10))} lines)")
    assert long_cuda == []
    assert {p.name for p in (REPO / "coordinator" / "gpu" / "kernels").glob("*.cu*")} >= {
        "common.cuh", "ops.cu", "formats.cu", "compact.cu", "experts.cu", "router.cu"}
