#!/usr/bin/env bash
# Two scripts/gpu_check.sh jobs at once on a 2-GPU machine (nvidia-h200-x2), one per GPU, to spend
# less device time per measurement. LANE0 and LANE1 hold each job's settings as shell assignments
# (see gpu_check.sh), e.g.
#   LANE0='SHAPES="qwen3-0.6b phi3-mini"' LANE1='TESTS=0 KERNELS=0 SHAPES="qwen3-30b-a3b"' \
#     bash scripts/gpu_two_lanes.sh
# Each lane installs into its own site directory and writes $OUT/lane0 or $OUT/lane1; everything is
# packed into $OUT/lanes.tgz (the device tool returns at most 8 files) beside the two logs' tails.
# The lanes share the host CPU: a host-bound benchmark may read a few percent lower than alone.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/lanes}
mkdir -p "$OUT"
pids=()
for lane in 0 1; do
  settings_var="LANE$lane"
  settings=${!settings_var:-}
  (
    [ -n "$settings" ] && eval "export $settings"
    export CUDA_VISIBLE_DEVICES=$lane SITE=/tmp/pagoda-site-$lane OUT="$OUT/lane$lane"
    bash scripts/gpu_check.sh
  ) >"$OUT/lane$lane.txt" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
for lane in 0 1; do
  settings_var="LANE$lane"
  echo "=================== lane $lane: ${!settings_var:-}"
  tail -40 "$OUT/lane$lane.txt"
done
(cd "$OUT" && tar czf lanes.tgz lane0 lane1 lane0.txt lane1.txt)
