#!/usr/bin/env bash
# Device calls of the fifteenth session (issue 20): the automatic choice against the best
# of cuda and flax at every width and dtype (item 1), the partials merged over more
# blocks where rows are few (item 4), and the checks of a new build.
# Stages: wsknobs (norm_workspace.py under each WS_ENVS); mergeab (the backward under
# each merge setting: the group tier at 768 / 1024 columns, the bulk tier at 4096 with
# 8192 and 49152 rows); tests (the norm test files); workspace; sanitize (memcheck /
# synccheck / racecheck where partials merge over 4 blocks); sweepDT for DT in bf16, f16,
# f32 (SWEEP_OPS, fwd / bwd / fwd_bwd, auto / cuda / flax, 32-32768 columns at 49152 rows
# and 65536 at 8192), each op its own JSON; sweepadd (add+norm, bf16).
# Usage: bash benchmarks/gpu_issue20_final.sh stages
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-tests,workspace}
source benchmarks/gpu_stages.sh
if has wsknobs; then
  for e in ${WS_ENVS:-JAX_OPS_NORM_BWD_MERGE_BLOCKS=2 JAX_OPS_NORM_BWD_MERGE_BLOCKS=4 JAX_OPS_NORM_BWD_GROUP_MERGE_BLOCKS=4}; do
    echo "== $e"
    env $e timeout 120 python3 benchmarks/norm_workspace.py 2>&1 | grep -v Warning
  done > "$OUT/wsknobs.txt"
  cat "$OUT/wsknobs.txt" | tee -a "$LOG" > /dev/null
  stage_done wsknobs
fi
if has mergeab; then
  for v in ${MERGE_VALUES:-2 4}; do
    echo "== JAX_OPS_NORM_BWD_GROUP_MERGE_BLOCKS=$v"
    for dt in bf16 f32; do
      JAX_OPS_NORM_BWD_GROUP_MERGE_BLOCKS=$v timeout 80 python3 -m jax_ops.bench --repeats 5 --dtype $dt --impl cuda \
        --op layer_norm,rms_norm --mode bwd,step --cols 768,1024
    done
    echo "== JAX_OPS_NORM_BWD_MERGE_BLOCKS=$v"
    for rows in 8192 49152; do
      JAX_OPS_NORM_BWD_MERGE_BLOCKS=$v timeout 80 python3 -m jax_ops.bench --repeats 5 --dtype bf16 --rows $rows \
        --impl cuda --op layer_norm,rms_norm --mode bwd,step --cols 4096
    done
  done > "$OUT/mergeab.txt" 2>&1
  grep -E "^== |^[a-z_]+ (bwd|step) " "$OUT/mergeab.txt" | tee -a "$LOG"
  stage_done mergeab
fi
has tests && norm_tests
has workspace && workspace_stage
has sanitize && SAN_OPS=${SAN_OPS:-ln,rms,add_ln} RACE_OPS=ln norm_sanitize ${SAN_ROWS:-3001} \
  ${SAN_COLS:-768,1000,1024,4096} ${RACE_COLS:-1024,4096}
# The dispatch table's bf16 entries of TABLE_OPS at TABLE_COLS re-measured (table_stage).
has tables && OP_TIMEOUT=${OP_TIMEOUT:-100} table_stage bf16 \
  ${TABLE_OPS:-layer_norm,rms_norm,add_layer_norm,add_rms_norm} ${TABLE_COLS:-256,512}
for dt in bf16 f16 f32; do has sweep$dt && sweep_dtype $dt; done
has sweepadd && SWEEP_OPS="add_layer_norm add_rms_norm" sweep_dtype bf16
finish_call "log|env|auto_vs_best|tests|workspace|sanitize"
exit 0
