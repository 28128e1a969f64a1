#!/usr/bin/env bash
# Device calls of the twenty-sixth session (issue 20). Stages:
# - tests: the norm tests (test_layer_norm, test_add_norm);
# - ws: item 4, the temporary memory of a lone op's jitted vjp against flax
#   (benchmarks/norm_workspace.py) in bf16 and f16;
# - fold: the 16-bit cluster backward's partial rows folded (knob
#   JAX_OPS_NORM_BWD_CLUSTER_FOLD off / on), bwd and fwd_bwd of LayerNorm / RMSNorm /
#   add_layer_norm at 65536 (FOLD65_ROWS rows, default 4096 and 512; knob values
#   FOLD65_VALUES) and 16384 / 32768 (FOLD_ROWS rows, none if set empty); fold49k:
#   LayerNorm / RMSNorm at 16384 / 32768, 49152 rows, in FOLD_DTYPES (default bf16),
#   modes FOLD49K_MODES (bwd,fwd_bwd), knob values FOLD49K_VALUES (0 1);
# - abw: the cluster backward, previous build (.carry/_ffi_old.so.gz) against the carried
#   one, the fold off: bwd and fwd_bwd of LayerNorm / RMSNorm at 16384 / 32768 (49152
#   rows) in bf16 and f16, and at 65536 (4096 rows) in bf16;
# - san: memcheck / synccheck of the four ops at SAN_COLS in float16 and bfloat16, 301
#   rows, racecheck of LayerNorm at RACE_COLS; sanfold: memcheck / synccheck of bf16
#   LayerNorm / add_layer_norm at 1921 x 65536 (folded).
# Usage: bash benchmarks/gpu_issue20_s26.sh stages
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-tests}
source benchmarks/gpu_stages.sh
has tests && norm_tests
if has ws; then
  WS_DTYPE=bfloat16 workspace_stage workspace_bf16
  WS_DTYPE=float16 workspace_stage workspace_f16
fi
if has fold; then
  for r in ${FOLD65_ROWS:-4096 512}; do
    knob_sweep fold65_$r JAX_OPS_NORM_BWD_CLUSTER_FOLD "${FOLD65_VALUES:-0 1 0 1}" --rows $r \
      --op layer_norm,rms_norm,add_layer_norm --mode bwd,fwd_bwd --cols 65536
  done
  [ "${FOLD_ROWS-2048}" ] && knob_sweep fold16 JAX_OPS_NORM_BWD_CLUSTER_FOLD "0 1" --rows "${FOLD_ROWS-2048}" \
    --op layer_norm,rms_norm,add_layer_norm --mode bwd,fwd_bwd --cols 16384,32768
fi
if has fold49k; then  # LayerNorm / RMSNorm at 16384 / 32768, 49152 rows, fold off / on
  for dt in ${FOLD_DTYPES:-bf16}; do
    KNOB_DTYPE=$dt KNOB_TIMEOUT=150 knob_sweep fold49k_$dt JAX_OPS_NORM_BWD_CLUSTER_FOLD "${FOLD49K_VALUES:-0 1}" \
      --rows 49152 --op layer_norm,rms_norm --mode ${FOLD49K_MODES:-bwd,fwd_bwd} --cols 16384,32768
  done
fi
abw_body() {  # the kernel without the fold (knob 0) against the previous build
  echo "== build $1"
  for dt in bf16 f16; do
    JAX_OPS_NORM_BWD_CLUSTER_FOLD=0 timeout 150 python3 -m jax_ops.bench --repeats 3 --dtype $dt --impl cuda \
      --rows 49152 --op layer_norm,rms_norm --mode bwd,fwd_bwd --cols 16384,32768
  done
  JAX_OPS_NORM_BWD_CLUSTER_FOLD=0 timeout 100 python3 -m jax_ops.bench --repeats 5 --dtype bf16 --impl cuda \
    --rows 4096 --op layer_norm,rms_norm --mode bwd,fwd_bwd --cols 65536
}
has abw && ab_stage abw abw_body
has san && DTYPES=float16,bfloat16 SAN_OPS=ln,rms,add_ln,add_rms RACE_OPS=ln norm_sanitize 301 "${SAN_COLS:-16384,65536}" "${RACE_COLS:-65536}"
# the fold (rows >= 128 a cluster): memcheck and synccheck, bf16 LayerNorm / add_layer_norm
has sanfold && SAN_NAME=sanitize_fold DTYPES=bfloat16 SAN_OPS=ln,add_ln norm_sanitize 1921 65536 ""
finish_call "log|env|tests|workspace_bf16|fold65_4096|fold16|fold49k_bf16|fold49k_f16|abw|sanitize_fold"
