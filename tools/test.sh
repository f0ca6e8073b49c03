#!/usr/bin/env bash
# Create .venv if absent, install the project with its test extra, run pytest.
# Extra arguments go to pytest (e.g. ./tools/test.sh -k split -x).
set -euo pipefail
. "$(dirname "$0")/_venv.sh" test
cd "$ROOT"
exec python -m pytest "$@"
