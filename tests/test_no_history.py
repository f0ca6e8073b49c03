"""Package comments say what the code does and why, not its history (issue 44).

Every comment and docstring under coordinator/, node_worker/ and shm/ is scanned for a commit hash
or an ISO date; figures that justify a choice belong in docs/benchmarks.md, not in the code.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("coordinator", "node_worker", "shm")

# A word of 7 to 40 lowercase hex digits with at least one digit and one letter a-f: the shape of a
# (short) commit hash.  A hex literal (0x...), a word joined to other letters, digits or a hyphen
# ("znver4-1a2b3c4d", a build's digest) and the digits of a float ("9.99999997e-07") are no hash.
HASH = re.compile(r"(?<![0-9A-Za-z_.-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![0-9A-Za-z_-])")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def _texts(path: Path):
    """(line, text) of each comment and each docstring line in ``path``."""
    source = path.read_text(encoding="utf-8")
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                first = body[0].value.lineno
                for i, line in enumerate(body[0].value.value.splitlines()):
                    yield first + i, line


def _hits(pattern: re.Pattern) -> list[str]:
    hits = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for line, text in _texts(path):
                for m in pattern.finditer(text):
                    hits.append(f"{path.relative_to(ROOT)}:{line}: {m.group(0)!r} in {text.strip()!r}")
    return hits


def test_no_commit_hash_in_comments():
    hits = _hits(HASH)
    assert not hits, "commit hashes in package comments/docstrings:\n" + "\n".join(hits)


def test_no_date_in_comments():
    hits = _hits(DATE)
    assert not hits, "dates in package comments/docstrings:\n" + "\n".join(hits)


def test_patterns():
    """The hash pattern takes hashes and leaves hex literals, words and plain numbers alone."""
    for text in ("commit e2dca4a", "(0a1566e)", "fixed in 3f9c2d1b7e", "e2dca4a."):
        assert HASH.search(text), text
    for text in ("0x7fffffff", "deadbeef", "1234567", "feedface", "a_1b2c3d4e5", "sha256", "dim 4096",
                 "9.99999997e-07", "znver4-1a2b3c4d5e6f7a8b"):
        assert not HASH.search(text), text
    assert DATE.search("on 2026-12-04 we") and not DATE.search("20260-12-04")
