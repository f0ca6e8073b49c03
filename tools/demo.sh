#!/usr/bin/env bash
# Create .venv, install, make the tiny demo model (once), and generate text
# with the experts split over 2 NUMA nodes (virtual ones on a machine with fewer).
set -euo pipefail
. "$(dirname "$0")/_venv.sh"
MODEL="${STRATA_DEMO_MODEL:-$ROOT/.cache/strata/tiny-qwen3_moe}"
if [ ! -f "$MODEL/config.json" ]; then
  strata make-model --preset tiny --arch qwen3_moe --seed 0 --out "$MODEL"
fi
echo "model: $MODEL (tiny, random weights: the text is noise)"
# strata prints where the experts run (virtual nodes are labelled) on stderr
strata generate --model "$MODEL" --prompt "${1:-Once upon a time}" --max-new-tokens "${2:-48}" --numa-split --nodes 2
