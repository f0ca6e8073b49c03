#!/usr/bin/env bash
# Start the coordinator (`strata generate ...` or `strata serve ...`) placed for a
# multi-socket machine, and print the placement chosen.
#
#   tools/launch.sh generate --model DIR --prompt "Hello" --numa-split
#
# The coordinator's memory is preferred on the GPU's node (from
# /sys/bus/pci/devices/*/numa_node) when numactl is installed and the machine has
# more than one node. Its CPUs are left unbound, so it still sees every node.
# strata itself starts one node worker per node, each under
# `numactl --cpunodebind=N --membind=N` on real nodes (CPU affinity on virtual
# ones), so this script is a convenience, not a second code path.
set -euo pipefail
usage() {  # the comment block above, without its first line and the comment marks
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  echo "The arguments are strata's: tools/launch.sh generate --help, tools/launch.sh serve --help."
}
case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  "") usage >&2; exit 2 ;;
esac
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
STRATA="${STRATA:-$ROOT/.venv/bin/strata}"
[ -x "$STRATA" ] || STRATA="$(command -v strata)"

gpu_node=""
for dev in /sys/bus/pci/devices/*; do
  [ -r "$dev/class" ] || continue
  case "$(cat "$dev/class")" in
    0x0300*|0x0302*)  # display / 3D controller
      n="$(cat "$dev/numa_node" 2>/dev/null || echo -1)"
      if [ "$n" -ge 0 ] 2>/dev/null; then gpu_node="$n"; gpu_dev="$(basename "$dev")"; break; fi ;;
  esac
done
nodes=$(ls -d /sys/devices/system/node/node[0-9]* 2>/dev/null | wc -l)

prefix=()
if [ -n "$gpu_node" ] && [ "$nodes" -gt 1 ] && command -v numactl >/dev/null; then
  prefix=(numactl "--preferred=$gpu_node")
  echo "launch: coordinator memory preferred on node $gpu_node (GPU $gpu_dev)" >&2
elif [ -n "$gpu_node" ]; then
  echo "launch: GPU $gpu_dev on node $gpu_node; coordinator not bound (numactl missing or one node)" >&2
else
  echo "launch: no GPU with a known NUMA node; coordinator not bound" >&2
fi
if command -v numactl >/dev/null; then
  echo "launch: real nodes' workers run under numactl --cpunodebind=N --membind=N" >&2
else
  echo "launch: numactl not installed; workers are pinned by CPU affinity (memory by first touch)" >&2
fi
echo "launch: machine has $nodes NUMA node(s):" >&2
"$STRATA" topo >&2
exec "${prefix[@]}" "$STRATA" "$@"
