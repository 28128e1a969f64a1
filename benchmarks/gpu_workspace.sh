#!/usr/bin/env bash
# One device call (eighth session, issue 20): the workspace with an array per wanted
# parameter gradient: norm tests, a lone op's jitted-vjp temporary memory against flax
# (`norm_workspace.py`), and the one-jit fwd_bwd mode at long rows.
# Usage: bash benchmarks/gpu_workspace.sh [stages] (tests,workspace,fwdbwd)
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-tests,workspace,fwdbwd}
source benchmarks/gpu_stages.sh
has tests && norm_tests
if has workspace; then
  timeout 200 python3 benchmarks/norm_workspace.py --json "$OUT/workspace.json" > "$OUT/workspace.txt" 2>&1
  cat "$OUT/workspace.txt" | grep -v Warning | tee -a "$LOG"
  stage_done workspace
fi
if has fwdbwd; then
  timeout 200 python3 -m jax_ops.bench --repeats 3 --dtype bf16 --impl cuda,auto,flax --op layer_norm,rms_norm \
    --mode fwd_bwd,bwd --cols 1024,8192,16384,32768 --json "$OUT/fwdbwd.json" > "$OUT/fwdbwd.txt" 2>&1
  grep -E "^[a-z_]+ (fwd|bwd|fwd_bwd|step) " "$OUT/fwdbwd.txt" | tee -a "$LOG"
  stage_done fwdbwd
fi
