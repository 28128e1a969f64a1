#!/usr/bin/env bash
# One device call (twelfth and thirteenth sessions, issue 20): the group tier's backward
# at 32-1024 columns (bwd_rows_bulk_kernel, bwd_group_row, the column sums) and the
# cluster forward's parameters.
# Stages: fulltests (the norm test files); quicktests (TEST_K of test_layer_norm.py);
# sanitize (memcheck / synccheck at SAN_COLS, SAN_ROWS rows; racecheck at RACE_COLS; OPS
# as sanitize_norm.py takes it); ab (.carry/_ffi_old.so.gz, the previous build, against
# this one, same run, at AB_COLS, each of AB_MODES: bwd unless named); knobab (this build
# under each KNOB_VALUES of KNOB_NAME, the backward at AB_COLS, each of AB_DTYPES; the
# thirteenth session's runs 2, 6 and 8 wrote one knobab.txt at 5 repeats);
# abknob (the same under each AB_STAGES, with the forward); knobs (stages a block);
# rowsknob (rows a group of the 16-bit register backward: JAX_OPS_NORM_BWD_REGS_ROWS
# existed in run 5's build only); breakdown (per-kernel times at
# BD_COLS); sweep (fwd / bwd / step / fwd_bwd, auto / cuda / flax at SWEEP_COLS); psmem
# (the cluster forward's parameters in shared memory); sweepf32; workspace.
# Usage: bash benchmarks/gpu_narrow_bulk.sh [stages]
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-fulltests,sanitize,ab,sweep}
source benchmarks/gpu_stages.sh
has fulltests && norm_tests
if has quicktests; then
  timeout 200 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_layer_norm.py -k "${TEST_K:-many_rows or -32- or 128 or 1024}" \
    > "$OUT/tests.txt" 2>&1
  tail -2 "$OUT/tests.txt" | tee -a "$LOG"
  stage_done quicktests
fi
has sanitize && norm_sanitize ${SAN_ROWS:-5001} ${SAN_COLS:-8,32,64,128,256,512,1024} ${RACE_COLS:-128,1024}
ab_bwd() {
  local dt mode
  for mode in ${AB_MODES:-bwd}; do
    for dt in ${AB_DTYPES:-bf16 f16 f32}; do
      echo "== $1 $dt $mode"
      timeout 150 python3 -m jax_ops.bench --repeats 5 --dtype $dt --impl cuda --op ${AB_OPS:-layer_norm,rms_norm} \
        --mode $mode --cols ${AB_COLS:-32,64,128,256,512,1024}
    done
  done
}
has ab && ab_stage ab ab_bwd
# This build under each KNOB_VALUES of the knob KNOB_NAME: the backward at AB_COLS of
# AB_OPS, to $OUT/knobab_DTYPE.txt for each of AB_DTYPES.
if has knobab; then
  for dt in ${AB_DTYPES:-bf16 f32}; do
    KNOB_DTYPE=$dt knob_sweep knobab_$dt "$KNOB_NAME" "${KNOB_VALUES:-0 1}" --op ${AB_OPS:-layer_norm,rms_norm} \
      --mode bwd --cols ${AB_COLS:-32,64,128,256,512,1024}
  done
fi
# The old build, then the new one under each JAX_OPS_NORM_BWD_ROWS_BULK_STAGES of
# AB_STAGES: the backward at AB_COLS (AB_DTYPES), the forward at FWD_COLS (bf16).
ab_knob() {
  local s first=1
  for s in ${AB_STAGES:-0 2}; do
    [ $1 = old ] && [ $first = 0 ] && continue
    first=0
    for dt in ${AB_DTYPES:-bf16 f32}; do
      echo "== $1 stages=$s $dt"
      JAX_OPS_NORM_BWD_ROWS_BULK_STAGES=$s timeout 100 python3 -m jax_ops.bench --repeats 5 --dtype $dt --impl cuda \
        --op ${AB_OPS:-layer_norm,rms_norm} --mode bwd --cols ${AB_COLS:-32,64,128,256,512,1024}
    done
    echo "== $1 stages=$s fwd bf16"
    timeout 100 python3 -m jax_ops.bench --repeats 5 --dtype bf16 --impl cuda --op layer_norm,rms_norm --mode fwd \
      --cols ${FWD_COLS:-32,128,256}
  done
}
has abknob && ab_stage abknob ab_knob
if has knobs; then
  knob_sweep stages JAX_OPS_NORM_BWD_ROWS_BULK_STAGES "${KNOB_STAGES:-0 2 3 4}" --op layer_norm,rms_norm --mode bwd \
    --cols ${KNOB_COLS:-32,128,256,512,1024}
fi
if has rowsknob; then
  knob_sweep rowsknob JAX_OPS_NORM_BWD_REGS_ROWS "0 1 2" --op layer_norm,rms_norm --mode bwd --cols ${ROWS_COLS:-32,64,128,256}
fi
if has breakdown; then
  for c in ${BD_COLS:-32 128 256}; do
    MODES=bwd timeout 100 python3 benchmarks/kernel_breakdown.py layer_norm bf16 49152 $c cuda 2>&1 | grep -v Warning
  done > "$OUT/breakdown.txt"
  cat "$OUT/breakdown.txt" | tee -a "$LOG"
  stage_done breakdown
fi
has sweep && sweep_stage sweep --dtype ${SWEEP_DTYPE:-bf16} --rows ${SWEEP_ROWS:-49152} \
  --op ${SWEEP_OPS:-layer_norm,rms_norm} --mode ${SWEEP_MODES:-fwd,bwd,step,fwd_bwd} --cols ${SWEEP_COLS:-32,128,256,512,1024}
# The cluster forward's parameters in shared memory (JAX_OPS_NORM_FWD_CLUSTER_PARAMS_SMEM,
# and packs a thread _PACKS; knobs of run 8's build only, reverted): LayerNorm /
# add_layer_norm forward at 65536 bf16 and 32768 / 65536 float32 columns, 8192 rows,
# under each setting of PSMEM_ENVS.
if has psmem; then
  for e in ${PSMEM_ENVS:-JAX_OPS_NORM_FWD_CLUSTER_PARAMS_SMEM=0 JAX_OPS_NORM_FWD_CLUSTER_PARAMS_SMEM=1}; do
    echo "== $e"
    env $e timeout 100 python3 -m jax_ops.bench --repeats 5 --dtype bf16 --rows 8192 --impl cuda \
      --op layer_norm,add_layer_norm,rms_norm --mode fwd --cols 65536 2>&1
    env $e timeout 100 python3 -m jax_ops.bench --repeats 5 --dtype f32 --rows 8192 --impl cuda \
      --op layer_norm --mode fwd --cols 32768,65536 2>&1
  done > "$OUT/psmem.txt"
  grep -E "^== |^[a-z_]+ fwd " "$OUT/psmem.txt" | tee -a "$LOG"
  stage_done psmem
fi
has sweepf32 && sweep_stage sweep_f32 --dtype f32 --rows 49152 --op layer_norm,rms_norm --mode fwd,bwd,step \
  --cols ${F32_COLS:-32,128,256,1024}
has workspace && workspace_stage
exit 0
