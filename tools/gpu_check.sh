#!/usr/bin/env bash
# On a machine with an NVIDIA GPU, everything the GPU side must show, as one script, JSON under $OUT
# (default /tmp/strata-gpu-out), within about 8 minutes on an H100 (each stage has its own time limit):
#   ./tools/gpu_check.sh                  all the stages below, then $OUT/summary.json
#   ./tools/gpu_check.sh --tests [args]   the GPU tests alone (pytest -m gpu, with pytest's arguments)
# stages (each writes $OUT/<stage>.json or .xml and its log; summary.json has every exit status):
#   capture_probe   tools/capture_probe.py: the stand-in's capture rules against this CuPy, a captured copy,
#                   kernel and host function replayed (10 s)
#   warmup          the CPU kernels the process pools run, compiled as a first run compiles them
#   tests           the GPU tests (tests/test_gpu.py and the kernel tests, -m gpu), junit XML
#   step_memory     tools/gpu_step_memory.py: the step buffer after 1-, 4- and 8-row steps, 4 and 8 layers
#   racecheck, initcheck   compute-sanitizer over the device kernel tests, where the tool exists
#   gpu_bench       tools/gpu_bench.py on the deep preset: replayed steps, host microseconds a layer, the pool's wait
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
from coordinator.gpu.probe import probe_cuda

ok, why = probe_cuda()
print("cuda usable:", ok, why)
if ok:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(0)
    print("device 0:", props["name"].decode(), "CUDA runtime", cupy.cuda.runtime.runtimeGetVersion())
PY
KERNEL_TESTS=(tests/test_device_kernels.py tests/test_format_kernels.py tests/test_device_router.py)
if [ "${1:-}" = "--tests" ]; then
  shift
  exec "$PY" -m pytest -p no:cacheprovider -m gpu -v tests/test_gpu.py "${KERNEL_TESTS[@]}" "$@"
fi
OUT="${OUT:-/tmp/strata-gpu-out}"
mkdir -p "$OUT"
declare -A STATUS
ORDER=()
stage() {  # stage NAME SECONDS COMMAND...: its output into $OUT/NAME.log, its exit status into the summary
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  echo "== $name (at most ${limit}s)" >&2
  set +e
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  STATUS[$name]="$? $((SECONDS - start))"
  ORDER+=("$name")
  set -e
  tail -5 "$OUT/$name.log" >&2
}
stage capture_probe 45 "$PY" tools/capture_probe.py --out "$OUT/capture_probe.json"
# the CPU kernels the process pools need, compiled once as a first run compiles them (seconds when cached)
stage warmup 180 "$PY" -m coordinator.warmup host doorbells stream experts/f32
stage tests 160 "$PY" -m pytest -p no:cacheprovider -m gpu -q tests/test_gpu.py "${KERNEL_TESTS[@]}" \
  --junitxml "$OUT/tests.xml"
stage step_memory 60 "$PY" tools/gpu_step_memory.py --out "$OUT/step_memory.json"
if command -v compute-sanitizer >/dev/null; then
  for tool in racecheck initcheck; do
    stage "$tool" 50 compute-sanitizer --tool "$tool" --error-exitcode 1 --target-processes all \
      "$PY" -m pytest -p no:cacheprovider -m gpu -q -x tests/test_device_kernels.py
  done
else
  echo "compute-sanitizer not found: racecheck and initcheck skipped" >&2
fi
stage gpu_bench 120 "$PY" tools/gpu_bench.py --out "$OUT" --only deep --rounds 1 --tokens 16 --prompt-tokens 64
"$PY" - "$OUT" "$(for k in "${ORDER[@]}"; do echo "$k ${STATUS[$k]}"; done)" <<'PY'
import json
import sys
from pathlib import Path

out, lines = Path(sys.argv[1]), [line.split() for line in sys.argv[2].splitlines() if line.strip()]
stages = {name: {"exit": int(code), "seconds": int(secs)} for name, code, secs in lines}
summary = {"stages": stages, "ok": all(s["exit"] == 0 for s in stages.values())}
for name in ("capture_probe", "step_memory"):
    path = out / f"{name}.json"
    if path.exists():
        summary[name] = json.loads(path.read_text())
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps({k: v for k, v in summary.items() if k == "stages" or k == "ok"}, indent=1))
sys.exit(0 if summary["ok"] else 1)
PY
