#!/usr/bin/env bash
# Device calls of the twenty-second session (issue 20): the block-tier forward's packs a
# thread (4, 5 or 6: fwd_block_packs; knob JAX_OPS_NORM_FWD_BLOCK_K forces 4, 5, 6 or 8,
# 0 = the rule), and the bulk backward's wide block (knob JAX_OPS_NORM_BWD_BULK_WIDE). Stages:
# abk (LayerNorm / RMSNorm forward at K_COLS under each of K_VALUES, 49152 rows);
# abkadd (add_layer_norm / add_rms_norm forward at ADD_COLS); abkauto (the rule against 4
# packs, the four ops at AUTO_COLS); abwide (the wide bulk backward against two packs a
# thread, the four ops at WIDE_COLS); abstages (the bulk backward's
# stages, knob JAX_OPS_NORM_BWD_BULK_STAGES, at STAGE_COLS); sank (memcheck of the four
# ops at SAN_COLS under each K of SAN_K, 0 = the rule, 301 rows); sandef (memcheck /
# synccheck of the defaults at SAN_COLS, racecheck of add+norm at RACE_COLS: sanitize.txt); probe (launch
# errors at PROBE_SHAPES, old and new build); probesweep (the same in a
# benchmark's order of shapes); table (TABLE_OPS' bf16 entries at TABLE_COLS); tests; sweepmid (item 1: auto / cuda /
# pallas / flax at SWEEP_MID_COLS, the four ops, fwd and fwd_bwd); workspace.
# Usage: bash benchmarks/gpu_issue20_s22.sh stages
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-abk}
source benchmarks/gpu_stages.sh
if has abk; then
  KNOB_TIMEOUT=${KNOB_TIMEOUT:-150} knob_sweep abk JAX_OPS_NORM_FWD_BLOCK_K "${K_VALUES:-4 6 5 0 8 4 6}" \
    --rows 49152 --op layer_norm,rms_norm --mode fwd \
    --cols "${K_COLS:-4352,4608,5120,5632,6144,6656,7168,8192,12288,16384,24576}"
fi
if has abkadd; then
  KNOB_TIMEOUT=${KNOB_TIMEOUT:-150} knob_sweep abkadd JAX_OPS_NORM_FWD_BLOCK_K "${ADD_K_VALUES:-4 6 5 0 4 6}" \
    --rows 49152 --op add_layer_norm,add_rms_norm --mode fwd --cols "${ADD_COLS:-4352,4608,6144,8192,12288}"
fi
if has abkauto; then  # the rule (0) against 4 packs where run 1 measured no rule
  KNOB_TIMEOUT=${KNOB_TIMEOUT:-150} knob_sweep abkauto JAX_OPS_NORM_FWD_BLOCK_K "${AUTO_K_VALUES:-0 4 0}" \
    --rows 49152 --op layer_norm,rms_norm,add_layer_norm,add_rms_norm --mode fwd --cols "${AUTO_COLS:-5632,20480,24576}"
fi
if has abwide; then  # the bulk backward's wide block (1) against two packs a thread (0) at 513-1024 packs
  KNOB_TIMEOUT=${KNOB_TIMEOUT:-150} knob_sweep abwide JAX_OPS_NORM_BWD_BULK_WIDE "${WIDE_VALUES:-1 0 1}" \
    --rows 49152 --op layer_norm,rms_norm,add_layer_norm,add_rms_norm --mode bwd --cols "${WIDE_COLS:-4352,5120,6144,8192}"
fi
if has abstages; then  # the bulk backward's stages where one block of K=2 holds an SM (4352-7168)
  KNOB_TIMEOUT=${KNOB_TIMEOUT:-150} knob_sweep abstages JAX_OPS_NORM_BWD_BULK_STAGES "${STAGE_VALUES:-3 6 4 8 3 6}" \
    --rows 49152 --op layer_norm,rms_norm --mode bwd --cols "${STAGE_COLS:-4352,4608,5120,6144,7168,8192}"
fi
if has sank; then
  { for k in ${SAN_K:-0 5 6}; do
      echo "== JAX_OPS_NORM_FWD_BLOCK_K=$k"
      JAX_OPS_NORM_FWD_BLOCK_K=$k ROWS=301 OPS=ln,rms,add_ln,add_rms timeout 200 compute-sanitizer --tool memcheck \
        --error-exitcode 9 python3 benchmarks/sanitize_norm.py "${SAN_COLS:-4104,4352,4616,8192,12288,24576}" 2>&1
      echo "memcheck K=$k rc $?"
    done; } > "$OUT/sank.txt"
  grep -E "^== |rc [0-9]|ERROR SUMMARY|MISMATCH|worst" "$OUT/sank.txt" | tee -a "$LOG"
  stage_done sank
fi
if has sandef; then  # the defaults: memcheck / synccheck of the four ops, racecheck of add+norm's wide backward
  SAN_OPS=ln,rms,add_ln,add_rms RACE_OPS=add_ln,add_rms norm_sanitize 301 \
    "${SAN_COLS:-4104,4352,4616,8192,12288,24576}" "${RACE_COLS:-4352,8184}"
fi
if has probe; then  # launch errors at PROBE_SHAPES: the previous build (.carry/_ffi_old.so.gz) and this one
  probe_body() {
    echo "== build $1"; timeout 120 python3 benchmarks/probe_norm_errors.py "${PROBE_SHAPES:-49152x12288,2048x12288,301x12288}"
    [ "$1" = new ] && CUDA_LAUNCH_BLOCKING=1 timeout 60 python3 benchmarks/probe_norm_errors.py 2048x12288
  }
  ab_builds probe probe_body
  grep -v ": ok$" "$OUT/probe.txt" | grep -v Warning | tee -a "$LOG"
  stage_done probe
fi
if has probesweep; then  # the sweep's order of shapes (run 3 saw cudaErrorInvalidValue at 12288), old and new build
  probesweep_body() {
    echo "== build $1"; timeout 100 python3 -m jax_ops.bench --repeats 3 --impl auto,cuda --dtype bf16 --rows 49152 \
      --op layer_norm,rms_norm,add_rms_norm --mode fwd,fwd_bwd --cols "${PROBE_COLS:-5632,12288}" 2>&1 | grep -E "^== |bf16 rows=|Error"
  }
  ab_builds probesweep probesweep_body
  grep -E "^== |ERROR|Error" "$OUT/probesweep.txt" | tee -a "$LOG"
  stage_done probesweep
fi
has table && TABLE_MODES=${TABLE_MODES:-fwd,bwd,step,fwd_res} table_stage bf16 "${TABLE_OPS:-add_rms_norm}" \
  "${TABLE_COLS:-4352,4608,5632}"
has tests && norm_tests
if has sweepmid; then
  SWEEP_IMPLS=${SWEEP_IMPLS:-auto,cuda,pallas,flax} SWEEP_TIMEOUT=${SWEEP_TIMEOUT:-300} sweep_stage sweep_mid_bf16 \
    --dtype bf16 --rows 49152 --op "${SWEEP_MID_OPS:-layer_norm,rms_norm,add_layer_norm,add_rms_norm}" \
    --mode fwd,fwd_bwd --cols "${SWEEP_MID_COLS:-4352,4608,5632,12288,20480,24576}"
fi
has workspace && workspace_stage workspace
finish_call "log|env|abk|abkadd|abkauto|abwide|abstages|sank|sanitize|probe|probesweep|tests|workspace"
