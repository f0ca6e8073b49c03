#!/usr/bin/env bash
# Create .venv if absent, install the project with its test extra, run pytest.
#   ./tools/test.sh           every test: CI, and before a commit
#   ./tools/test.sh --quick   the quick tier, every test not marked slow (tests/conftest.py says which are):
#                             each module's logic in-process, for the edit-test loop
# Two pytest workers (pytest-xdist) share the tests a file at a time (a module's fixtures are set up once); -n N
# among the arguments sets another count (-n 0: none). Other arguments go to pytest
# (e.g. ./tools/test.sh --quick -k split -x).
set -euo pipefail
. "$(dirname "$0")/_venv.sh" test
cd "$ROOT"
args=()
workers=(-n 2 --dist loadfile)
for a in "$@"; do
  case "$a" in
    --quick) args+=(-m "not slow") ;;
    -n|-n*|--numprocesses|--numprocesses=*) workers=(); args+=("$a") ;;
    *) args+=("$a") ;;
  esac
done
exec python -m pytest ${workers[@]+"${workers[@]}"} ${args[@]+"${args[@]}"}
