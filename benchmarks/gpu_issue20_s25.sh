#!/usr/bin/env bash
# Device calls of the twenty-fifth session (issue 20). Stages:
# - ab: the previous build (.carry/_ffi_old.so.gz) against the carried one: the forward of
#   AB_OPS at AB_COLS in AB_DTYPES (default float16 and bfloat16), then fwd_bwd of
#   AB_FB_OPS in float16 (none if set empty);
# - ab65: old / new twice, LayerNorm and add_layer_norm's forward at 65536 (AB65_ROWS rows);
# - k16392: the block forward at K_COLS under each of K_CFGS, bf16, LayerNorm and RMSNorm;
# - bwd4352: the bulk backward's pair block (knob JAX_OPS_NORM_BWD_BULK_PAIR) at BWD_COLS,
#   then cuda against flax there;
# - sweep: item 1, auto / cuda / flax: bf16 SWEEP_OPS (default LayerNorm and
#   add_layer_norm) at SWEEP_COLS, f16 LayerNorm and RMSNorm at SWEEP_F16_COLS (none if
#   set empty);
# - long: item 1, auto / cuda / pallas / flax, where the H200 table has no entries: f16
#   LONG_F16_OPS at LONG_F16_COLS, bf16 add+norm at LONG_ADD_COLS;
# - step: auto / cuda / flax in the training-step order (and fwd_bwd) for STEP_OPS in
#   STEP_DT at STEP_COLS;
# - abw: the cluster backward, old / new build, bwd and fwd_bwd at ABW_COLS in bf16 and
#   f16, and at 65536 (4096 rows) in bf16;
# - pf: the cluster backward's next rows prefetched to L2 (knob
#   JAX_OPS_NORM_BWD_CLUSTER_PREFETCH off / on; run 8's build only, not kept), bwd and fwd_bwd: bf16 PF_OPS at PF_COLS,
#   f16 RMSNorm / LayerNorm at PF_F16_COLS; pftests: the long-row tests;
# - tests; san: memcheck / synccheck of the four ops at SAN_COLS in float16 and bfloat16,
#   301 rows, racecheck of LayerNorm at RACE_COLS.
# Usage: bash benchmarks/gpu_issue20_s25.sh stages
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-ab}
source benchmarks/gpu_stages.sh
ab_body() {
  echo "== build $1"
  for dt in ${AB_DTYPES:-f16 bf16}; do
    timeout 150 python3 -m jax_ops.bench --repeats 3 --dtype $dt --impl cuda --rows 49152 \
      --op "${AB_OPS:-layer_norm,rms_norm,add_layer_norm,add_rms_norm}" --mode fwd --cols "${AB_COLS:-22528,24576}"
  done
  [ "${AB_FB_OPS-layer_norm,add_layer_norm}" ] && timeout 150 python3 -m jax_ops.bench --repeats 3 --dtype f16 \
    --impl cuda --rows 49152 --op "${AB_FB_OPS-layer_norm,add_layer_norm}" --mode fwd_bwd --cols "${AB_COLS:-22528,24576}"
}
has ab && ab_stage ab ab_body
# The cluster tier's LayerNorm forward at 65536 (AB65_ROWS rows), old / new twice.
ab65_body() {
  echo "== build $1"
  timeout 100 python3 -m jax_ops.bench --repeats 5 --dtype bf16 --impl cuda --rows ${AB65_ROWS:-4096} \
    --op layer_norm,add_layer_norm --mode fwd --cols 65536
}
if has ab65; then ab_stage ab65 ab65_body; ab_stage ab65_again ab65_body; fi
if has sweep; then
  SWEEP_IMPLS=auto,cuda,flax sweep_stage sweep_bf16 --dtype bf16 --rows 49152 \
    --op "${SWEEP_OPS:-layer_norm,add_layer_norm}" --mode fwd,fwd_bwd --cols "${SWEEP_COLS:-4352,16392,22528}"
  [ "${SWEEP_F16_COLS-22528,24576}" ] && SWEEP_IMPLS=auto,cuda,flax sweep_stage sweep_f16 --dtype f16 --rows 49152 \
    --op layer_norm,rms_norm --mode fwd,fwd_bwd --cols "${SWEEP_F16_COLS-22528,24576}"
fi
has k16392 && cfg_sweep k16392 "${K_CFGS:-default FWD_BLOCK_K=4 FWD_BLOCK_K=6}" bf16 --rows 49152 \
  --op layer_norm,rms_norm --mode fwd --cols "${K_COLS:-16384,16392,16640,18440}"
if has bwd4352; then
  knob_sweep bwd4352 JAX_OPS_NORM_BWD_BULK_PAIR "${BWD_VALUES:-0 1}" --rows 49152 \
    --op layer_norm,rms_norm --mode bwd,fwd_bwd --cols "${BWD_COLS:-4096,4352,8192}"
  SWEEP_IMPLS=cuda,flax sweep_stage sweep_bwd4352 --dtype bf16 --rows 49152 --op rms_norm,layer_norm \
    --mode bwd,fwd_bwd --cols "${BWD_COLS:-4096,4352,8192}"
fi
if has long; then  # item 1 where the H200 table has no entries: f16 past 1024 columns, add+norm past 16384
  SWEEP_IMPLS=auto,cuda,pallas,flax sweep_stage sweep_f16_long --dtype f16 --rows 49152 \
    --op "${LONG_F16_OPS:-layer_norm,rms_norm,add_layer_norm,add_rms_norm}" --mode fwd,fwd_bwd \
    --cols "${LONG_F16_COLS:-4096,16384,24576,32768}"
  SWEEP_IMPLS=auto,cuda,pallas,flax sweep_stage sweep_bf16_add_long --dtype bf16 --rows 49152 \
    --op add_layer_norm,add_rms_norm --mode fwd,fwd_bwd --cols "${LONG_ADD_COLS:-24576,32768}"
fi
# The training-step order (an optimization barrier between y and dy) where fwd_bwd lets
# flax fuse across stages: STEP_OPS in STEP_DT at STEP_COLS, auto / cuda / flax.
has step && SWEEP_IMPLS=auto,cuda,flax sweep_stage sweep_step_${STEP_DT:-f16} --dtype ${STEP_DT:-f16} --rows 49152 \
  --op "${STEP_OPS:-rms_norm,layer_norm}" --mode step,fwd_bwd --cols "${STEP_COLS:-16384,32768}"
# The cluster backward, old / new build (run 9: old = run 8's build with its prefetch off):
# bwd and fwd_bwd of LayerNorm / RMSNorm at ABW_COLS (49152 rows) in bf16 and f16, then
# at 65536 (4096 rows) in bf16.
abw_body() {
  echo "== build $1"
  for dt in bf16 f16; do
    JAX_OPS_NORM_BWD_CLUSTER_PREFETCH=0 timeout 150 python3 -m jax_ops.bench --repeats 3 --dtype $dt --impl cuda \
      --rows 49152 --op layer_norm,rms_norm --mode bwd,fwd_bwd --cols "${ABW_COLS:-16384,32768}"
  done
  JAX_OPS_NORM_BWD_CLUSTER_PREFETCH=0 timeout 100 python3 -m jax_ops.bench --repeats 5 --dtype bf16 --impl cuda \
    --rows 4096 --op layer_norm,rms_norm --mode bwd,fwd_bwd --cols 65536
}
has abw && ab_stage abw abw_body
if has pf; then  # the cluster backward's next rows prefetched to L2: knob off / on
  knob_sweep pf_bf16 JAX_OPS_NORM_BWD_CLUSTER_PREFETCH "${PF_VALUES:-0 1}" --rows 49152 \
    --op "${PF_OPS:-layer_norm,rms_norm,add_layer_norm}" --mode bwd,fwd_bwd --cols "${PF_COLS:-16384,32768,65536}"
  KNOB_DTYPE=f16 knob_sweep pf_f16 JAX_OPS_NORM_BWD_CLUSTER_PREFETCH "${PF_VALUES:-0 1}" --rows 49152 \
    --op rms_norm,layer_norm --mode bwd,fwd_bwd --cols "${PF_F16_COLS:-16384,32768}"
fi
if has pftests; then  # the long-row backward's tests
  timeout 200 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_layer_norm.py tests/test_add_norm.py \
    -k "cluster or long or many_rows or 65536 or 16384 or 32768" > "$OUT/pftests.txt" 2>&1
  tail -2 "$OUT/pftests.txt" | tee -a "$LOG"
  stage_done pftests
fi
has tests && norm_tests
has san && DTYPES=float16,bfloat16 SAN_OPS=ln,rms,add_ln,add_rms RACE_OPS=ln norm_sanitize 301 "${SAN_COLS:-16392,22536}" "${RACE_COLS:-16392}"
finish_call "log|env|ab|abw|ab65|ab65_again|k16392|bwd4352|pf_bf16|pf_f16|pftests|sanitize|tests"
