#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: install what is missing (the project with its
# test and gpu extras) and run the GPU suite. One command:  ./tools/gpu_check.sh
set -euo pipefail
. "$(dirname "$0")/_venv.sh" test
cd "$ROOT"
if ! python -c "import cupy" 2>/dev/null; then
  pkg="${STRATA_CUPY_PACKAGE:-}"
  if [ -z "$pkg" ]; then
    cuda_major=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: \([0-9]*\).*/\1/p' | head -1)
    case "${cuda_major:-12}" in 11) pkg=cupy-cuda11x ;; 12) pkg=cupy-cuda12x ;; *) pkg=cupy-cuda13x ;; esac
  fi
  echo "installing $pkg" >&2
  python -m pip install -q "$pkg"
fi
nvidia-smi -L || true
python - <<'PY'
from coordinator.backend import probe_cuda
ok, why = probe_cuda()
print("cuda usable:", ok, why)
PY
exec python -m pytest -m gpu -v tests/test_gpu.py "$@"
