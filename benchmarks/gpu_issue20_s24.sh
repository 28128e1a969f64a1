#!/usr/bin/env bash
# Device calls of the twenty-fourth session (issue 20). Stages: fwdk (the block forward's
# packs a thread, knob JAX_OPS_NORM_FWD_BLOCK_K, at FWDK_COLS in float16 and bfloat16);
# abwide2 (the bulk backward's one-pack block two an SM, bwd and fwd_bwd at WIDE2_COLS;
# run 1's build had knob JAX_OPS_NORM_BWD_BULK_WIDE2: 0 off, 1 plain norms, 2 every op;
# main has JAX_OPS_NORM_BWD_BULK_PAIR, 0 = off); tests; san (memcheck / synccheck of the
# four ops at SAN_COLS, 301 rows, racecheck at RACE_COLS); sweep / sweepf16 (item 1:
# auto / cuda / pallas / flax in bf16 at SWEEP_COLS, auto / cuda / flax in f16 at
# SWEEP_F16_COLS); workspace; cs16 (the cluster backward's size up to 16, knobs
# JAX_OPS_NORM_BWD_CLUSTER_SMEM_{CS,MAX_CS,MIN_BYTES}, at CS16_SHAPES rows:cols; run 4's
# build); fwdwide (the forward at FWDWIDE_COLS under each of FWDWIDE_CFGS; run 5's build
# had knob JAX_OPS_NORM_FWD_BLOCK_REGS_MAX_VEC); table (the dispatch table's TABLE_DT entries of
# TABLE_OPS at TABLE_COLS re-measured on this GPU, then auto / cuda / flax at TABLE_SWEEP_COLS).
# Usage: bash benchmarks/gpu_issue20_s24.sh stages
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-fwdk}
source benchmarks/gpu_stages.sh
if has fwdk; then
  KNOB_DTYPE=f16 knob_sweep fwdk_f16 JAX_OPS_NORM_FWD_BLOCK_K "${FWDK_VALUES:-0 4 5}" --rows 49152 \
    --op "${FWDK_OPS:-layer_norm,rms_norm,add_layer_norm,add_rms_norm}" --mode fwd \
    --cols "${FWDK_COLS:-16392,18432,20480,22528,24576}"
  KNOB_DTYPE=bf16 knob_sweep fwdk_bf16 JAX_OPS_NORM_FWD_BLOCK_K "${FWDK_VALUES_BF16:-0 5}" --rows 49152 \
    --op layer_norm,rms_norm --mode fwd --cols "${FWDK_COLS:-16392,18432,20480,22528,24576}"
fi
if has abwide2; then
  knob_sweep abwide2 ${WIDE2_KNOB:-JAX_OPS_NORM_BWD_BULK_PAIR} "${WIDE2_VALUES:-0 1 0 1}" --rows 49152 \
    --op layer_norm,rms_norm,add_layer_norm,add_rms_norm --mode "${WIDE2_MODES:-bwd,fwd_bwd}" \
    --cols "${WIDE2_COLS:-4104,4352,4608}"
fi
if has cs16; then  # the 65536-column backward in clusters of up to 16 blocks (non-portable)
  for cfg in ${CS16_CFGS:-default CS=16 CS=16,MIN_BYTES=120000 CS=12 CS=10 MAX_CS=16 default}; do
    knob_envs JAX_OPS_NORM_BWD_CLUSTER_SMEM_ "$cfg"
    echo "== $cfg"
    env "${envs[@]}" python3 -c "
from jax_ops import _extension as e
for op in ('layer_norm', 'rms_norm'):
    for rows, cols in ((4096, 65536), (8192, 32768), (16384, 16384)):
        print(op, rows, cols, 'partial rows', e.norm_bwd_partial_rows('bfloat16', 'float32', rows, cols,
              rms=op == 'rms_norm', add=False, dscale=True, dbias=op != 'rms_norm'))"
    for rows_cols in ${CS16_SHAPES:-4096:65536}; do
      env "${envs[@]}" timeout 120 python3 -m jax_ops.bench --repeats 3 --dtype bf16 --impl cuda \
        --rows ${rows_cols%:*} --cols ${rows_cols#*:} --op layer_norm,rms_norm --mode bwd,fwd_bwd
    done
  done > "$OUT/cs16.txt" 2>&1
  grep -E "^== |partial rows|^[a-z_]+ (fwd|bwd|fwd_bwd) " "$OUT/cs16.txt" | tee -a "$LOG"
  stage_done cs16
fi
has fwdwide && cfg_sweep fwdwide "${FWDWIDE_CFGS:-default FWD_BLOCK_K=8 FWD_BLOCK_K=4 FWD_BLOCK_REGS_MAX_VEC=2048 \
  FWD_BLOCK_REGS_MAX_VEC=2048,FWD_CLUSTER_MIN_BYTES=32768 default}" "f16 bf16" --rows 49152 \
  --op layer_norm,rms_norm --mode fwd --cols "${FWDWIDE_COLS:-22528,24576}"
if has table; then  # TABLE_DT entries of TABLE_OPS at TABLE_COLS, into TABLE (default: this GPU's file)
  TABLE=${TABLE:-jax_ops/tables/$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 |
    tr 'A-Z' 'a-z' | sed 's/[^a-z0-9]\+/_/g; s/_$//').json} TABLE_MODES=${TABLE_MODES:-fwd,bwd,step,fwd_res} \
    table_stage ${TABLE_DT:-bf16} "${TABLE_OPS:-rms_norm}" "${TABLE_COLS:-4352,16384,20480,24576,32768}"
  SWEEP_IMPLS=auto,cuda,flax sweep_stage sweep_table --dtype ${TABLE_DT:-bf16} --rows 49152 --op "${TABLE_OPS:-rms_norm}" \
    --mode fwd,fwd_bwd --cols "${TABLE_SWEEP_COLS:-4352,4608,20480,24576}"
fi
has tests && norm_tests
if has san; then
  SAN_OPS=ln,rms,add_ln,add_rms RACE_OPS=ln,add_ln norm_sanitize 301 "${SAN_COLS:-4104,4352,4608,16392,18440}" \
    "${RACE_COLS:-4352}"
fi
if has sweep; then
  SWEEP_IMPLS=${SWEEP_IMPLS:-auto,cuda,pallas,flax} sweep_stage sweep_bf16 --dtype bf16 --rows 49152 \
    --op "${SWEEP_OPS:-layer_norm,rms_norm,add_layer_norm,add_rms_norm}" --mode "${SWEEP_MODES:-fwd,fwd_bwd}" \
    --cols "${SWEEP_COLS:-4352,4608,20480}"
fi
if has sweepf16; then
  SWEEP_IMPLS=${SWEEP_IMPLS:-auto,cuda,flax} sweep_stage sweep_f16 --dtype f16 --rows 49152 \
    --op "${SWEEP_F16_OPS:-layer_norm,rms_norm}" --mode "${SWEEP_MODES:-fwd,fwd_bwd}" \
    --cols "${SWEEP_F16_COLS:-4352,18432,20480}"
fi
has workspace && workspace_stage workspace
finish_call "log|env|fwdk_f16|fwdk_bf16|abwide2|sanitize|tests|workspace"
