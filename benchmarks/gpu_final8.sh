#!/usr/bin/env bash
# One device call (eighth session, issue 20): the committed build (bulk backward's
# partials merged over pairs of blocks): norm tests, the workspace against flax, and the
# float16 / float32 dispatch-table entries of the norms re-measured (sweeps bundled in
# sweeps.tgz: a call returns 8 files). Usage: bash benchmarks/gpu_final8.sh [stages]
# (tests,workspace,tables)
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-tests,workspace,tables}
source benchmarks/gpu_stages.sh
has tests && norm_tests
has workspace && workspace_stage
if has tables; then
  for dt in f16 f32; do
    OP_TIMEOUT=90 bash benchmarks/gpu_tables.sh $dt layer_norm,rms_norm ${TABLE_COLS:-32,1024,4096,16384}
  done > "$OUT/tables.txt" 2>&1
  grep -E "rc [0-9]|^[a-z_]+ (fwd|bwd|step) " "$OUT/tables.txt" | tee -a "$LOG"
  (cd "$OUT" && tar czf sweeps.tgz sweep_* tables.txt && rm -f sweep_* tables.txt)
  stage_done tables
fi
