#!/usr/bin/env bash
# On a machine with an NVIDIA GPU, the GPU suite (tests/test_gpu.py, `pytest -m gpu`) in one command:
#   ./tools/gpu_check.sh [pytest arguments]
#   ./tools/gpu_check.sh --bench    then tools/gpu_bench.py (speed, logits against the CPU path, GPU memory by
#                                   category, hot experts in 8 GB: $OUT/gpu_bench.json) and the decode bench
#                                   with the CuPy coordinator on the deep preset (48 layers, /tmp/strata-deep)
# With network: makes .venv, installs the project with its test extra and the CuPy wheel that matches
# the driver's CUDA (or $STRATA_CUPY_PACKAGE).
# Without network (this workplace's GPU machines): runs on the machine's own python3 and its CuPy;
# the few packages its image lacks travel as wheels in .whl/ (./tools/gpu_wheels.sh fetches them
# beforehand where pip works) and are installed from there into a scratch folder.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
WHEELS="${STRATA_WHEELS:-$ROOT/.whl}"
if [ -d "$WHEELS" ]; then
  PY="${PYTHON:-python3}"
  SITE="${TMPDIR:-/tmp}/strata-site"
  echo "installing $(ls "$WHEELS" | wc -l) carried wheels from $WHEELS into $SITE" >&2
  "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$SITE" "$WHEELS"/*.whl
  export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
  . "$ROOT/tools/_venv.sh" test
  PY=python
  if ! command -v nvidia-smi >/dev/null; then
    echo "no NVIDIA driver here (nvidia-smi not found): CuPy is not installed and the GPU tests skip" >&2
  elif ! "$PY" -c "import cupy" 2>/dev/null; then
    pkg="${STRATA_CUPY_PACKAGE:-}"
    if [ -z "$pkg" ]; then
      cuda_major=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: \([0-9]*\).*/\1/p' | head -1)
      case "${cuda_major:-13}" in 11) pkg=cupy-cuda11x ;; 12) pkg=cupy-cuda12x ;; *) pkg=cupy-cuda13x ;; esac
    fi
    echo "installing $pkg" >&2
    "$PY" -m pip install -q "$pkg"
  fi
fi
cd "$ROOT"
nvidia-smi -L || true
"$PY" - <<'PY'
import importlib
import sys

missing = []
for name in ("numpy", "numba", "zmq", "posix_ipc", "psutil", "safetensors", "tokenizers", "setproctitle", "gguf",
             "jinja2", "aiohttp", "pytest", "hypothesis"):
    try:
        mod = importlib.import_module(name)
        print(f"{name} {getattr(mod, '__version__', '?')}")
    except Exception as exc:
        missing.append(f"{name} ({exc})")
if missing:
    sys.exit("missing: " + ", ".join(missing) + ": where pip reaches PyPI, ./tools/gpu_wheels.sh fetches"
             " the wheels into .whl/; carry that folder")
from coordinator.model.backend import probe_cuda

ok, why = probe_cuda()
print("cuda usable:", ok, why)
if ok:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(0)
    print("device 0:", props["name"].decode(), "CUDA runtime", cupy.cuda.runtime.runtimeGetVersion())
PY
if [ "${1:-}" != "--bench" ]; then
  exec "$PY" -m pytest -p no:cacheprovider -m gpu -v tests/test_gpu.py tests/test_device_kernels.py \
    tests/test_format_kernels.py tests/test_device_router.py "$@"
fi
# the CPU kernels the bench's engines need (the deep preset's f32 experts), compiled as a first run compiles them
"$PY" -m coordinator.warmup host doorbells experts/f32
"$PY" tools/gpu_bench.py --out "${OUT:-/tmp/strata-gpu-out}"
DEEP="${TMPDIR:-/tmp}/strata-deep"
[ -f "$DEEP/config.json" ] || "$PY" -m coordinator make-model --preset deep --out "$DEEP" --force
exec "$PY" -m coordinator bench -m "$DEEP" --modes inproc,single,split --device cuda --tokens 32 \
  --prompt-tokens 32 --rounds 2 --quality-positions 0
