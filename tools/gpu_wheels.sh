#!/usr/bin/env bash
# Fetch, where pip reaches PyPI, the wheels a GPU machine without network needs beside its own image
# (this workplace's CUDA image has CuPy, NumPy, numba, pytest, psutil, safetensors, tokenizers, jinja2
# and aiohttp, but not these; gguf is pure Python, the other three are built per Python version).
# They land in .whl/ (git-ignored); carry that folder and ./tools/gpu_check.sh installs them.
#   ./tools/gpu_wheels.sh [python version, default 3.12]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VERSION="${1:-3.12}"
DEST="${STRATA_WHEELS:-$ROOT/.whl}"
mkdir -p "$DEST"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
for pkg in "pyzmq>=25" "posix-ipc>=1.1" "setproctitle>=1.3" "gguf>=0.17"; do
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$VERSION" --implementation cp "${platforms[@]}" -d "$DEST" "$pkg"
done
ls -1 "$DEST"
