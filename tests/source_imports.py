"""The one reader of the project's imports, from its source (ast, nothing imported): the layering and shape tests
(test_layering, test_code_shape), the kernel build key (test_first_run) and the wheel's dependencies (test_wheel)."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("coordinator", "node_worker", "shm")


def module_name(path: Path) -> str:
    """coordinator/model/ops.py -> coordinator.model.ops; a package's __init__.py is the package."""
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    """Every module of the three packages: dotted name -> file."""
    return {module_name(p): p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))
            if "__pycache__" not in p.parts}


@dataclass(frozen=True)
class Import:
    module: str  # the module the statement names, a relative one resolved
    name: str | None  # the name a from-import takes; None for "import module"
    line: int
    top_level: bool  # in the module's body (run at import), not inside a function or class
    relative: bool

    def target(self, known: dict[str, Path]) -> str:
        """The module this import reaches: the taken name's own module where it is one, else the statement's."""
        if self.name is not None and f"{self.module}.{self.name}" in known:
            return f"{self.module}.{self.name}"
        return self.module


def imports(path: Path) -> list[Import]:
    """Every import statement of a project file, lazy ones inside functions included (``from __future__`` not)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            base = (package.rsplit(".", node.level - 1)[0] if node.level > 1 else package) if node.level else ""
            module = ".".join(p for p in (base, node.module) if p)
            found += [Import(module, a.name, node.lineno, id(node) in top, bool(node.level)) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [Import(a.name, None, node.lineno, id(node) in top, False) for a in node.names]
    return found
