"""A tool's JSON report: written to --out where given, printed, and its exit status (0 when report["ok"])."""

from __future__ import annotations

import json
from pathlib import Path


def emit(report: dict, out: str | None) -> int:
    text = json.dumps(report, indent=1)
    if out:
        Path(out).write_text(text)
    print(text)
    return 0 if report["ok"] else 1
