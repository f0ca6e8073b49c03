#!/usr/bin/env bash
# Create .venv if absent, install the project with its test extra, run pytest.
#   ./tools/test.sh           every test: CI, and before a commit
#   ./tools/test.sh --quick   the quick tier, every test not marked slow (tests/conftest.py says which are):
#                             each module's logic in-process, for the edit-test loop
# Other arguments go to pytest (e.g. ./tools/test.sh --quick -k split -x).
set -euo pipefail
. "$(dirname "$0")/_venv.sh" test
cd "$ROOT"
args=()
for a in "$@"; do
  if [ "$a" = --quick ]; then args+=(-m "not slow"); else args+=("$a"); fi
done
exec python -m pytest ${args[@]+"${args[@]}"}
