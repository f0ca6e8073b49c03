# Sourced by tools/*.sh: make .venv (if absent) and install the project into it (editable: once, and again
# only when pyproject.toml changes; a stamp in .venv records what was installed).
# Usage: . tools/_venv.sh [extra]   e.g. ". tools/_venv.sh test"
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
if [ ! -x "$ROOT/.venv/bin/python" ]; then
  echo "creating $ROOT/.venv" >&2
  "$PY" -m venv "$ROOT/.venv"
  "$ROOT/.venv/bin/python" -m pip install -q --upgrade pip
fi
SPEC="$ROOT"
if [ -n "${1:-}" ]; then SPEC="$ROOT[$1]"; fi
STAMP="$ROOT/.venv/.strata-installed${1:+-$1}"
WANT="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$WANT" ]; then
  "$ROOT/.venv/bin/python" -m pip install -q --disable-pip-version-check -e "$SPEC"
  echo "$WANT" > "$STAMP"
fi
export PATH="$ROOT/.venv/bin:$PATH"
