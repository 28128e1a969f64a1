#!/usr/bin/env bash
# One device call (issue 20): the backward's dscale/dbias partials merged over a cluster
# of blocks (knob JAX_OPS_NORM_BWD_MERGE_BLOCKS; the bulk tier, eighth session, and the
# group tier, ninth): norm tests, compute-sanitizer, speed with 1/2/4/8 blocks merged,
# the workspace against flax. MERGE_COLS / SAN_COLS (environment) pick the widths:
# the bulk tier's by default, e.g. MERGE_COLS=32,128,768,1024 SAN_COLS=33,768,1024 for
# the group tier.
# Usage: bash benchmarks/gpu_merge.sh [stages] (tests,sanitize,ab,workspace)
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-tests,sanitize,ab,workspace}
source benchmarks/gpu_stages.sh
has tests && norm_tests
if has sanitize; then
  { ROWS=600 timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/sanitize_norm.py \
      ${SAN_COLS:-4096,5000,8192} 2>&1; echo "memcheck rc $?"
    ROWS=300 timeout 100 compute-sanitizer --tool synccheck --error-exitcode 9 python3 benchmarks/sanitize_norm.py \
      ${SAN_COLS:-4096,8192} 2>&1; echo "synccheck rc $?"
    ROWS=300 timeout 150 compute-sanitizer --tool racecheck --error-exitcode 9 python3 benchmarks/sanitize_norm.py \
      ${SAN_COLS:-4096} 2>&1; echo "racecheck rc $?"; } > "$OUT/sanitize.txt"
  grep -E "rc [0-9]|ERROR SUMMARY|worst" "$OUT/sanitize.txt" | tee -a "$LOG"
  stage_done sanitize
fi
has ab && knob_sweep ab JAX_OPS_NORM_BWD_MERGE_BLOCKS "1 2 4 8" \
  --op layer_norm,rms_norm,add_layer_norm --mode bwd --cols ${MERGE_COLS:-4096,8192}
has workspace && workspace_stage
