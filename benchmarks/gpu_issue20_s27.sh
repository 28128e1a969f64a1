#!/usr/bin/env bash
# Device calls of the twenty-seventh session (issue 20). Stages:
# - tests: the norm tests (test_layer_norm, test_add_norm);
# - ws: item 4, the temporary memory of a lone op's jitted vjp against flax
#   (benchmarks/norm_workspace.py) in bf16 and f16 (RMSNorm's group tier now holds more
#   blocks an SM, so more partial rows);
# - abr: the 16-bit cluster backward with the norm kind at compile time, the previous
#   build (.carry/_ffi_old.so.gz) against the carried one: bwd of LayerNorm / RMSNorm at
#   16384 / 32768 (49152 rows) in bf16 and f16 and at 65536 (4096 rows) in bf16;
# - abn: the norm kind at compile time in every tier, the previous build against the
#   carried one: bf16 bwd of LayerNorm / RMSNorm / add_rms_norm at ABN_BWD_COLS, fwd of
#   LayerNorm / RMSNorm at ABN_FWD_COLS (49152 rows);
# - abl: 16-bit xhat as one FMA in the block-row and cluster backward, the previous build
#   against the carried one: bwd of LayerNorm / RMSNorm at 4096 / 8192 / 16384 / 32768
#   (49152 rows) in bf16 and f16, add_layer_norm at 8192 / 16384 in bf16, LayerNorm at
#   65536 (4096 rows);
# - san: memcheck / synccheck of LayerNorm / RMSNorm / add_rms_norm in float32 and
#   bfloat16 at 301 rows, SAN_COLS (33,1000,4104,8192,16384), racecheck of LayerNorm /
#   RMSNorm at RACE_COLS (1000,16384);
# - item1: auto / cuda / flax, fwd_bwd and step, LayerNorm / RMSNorm in f16 at 16384 /
#   32768 (49152 rows), where RMSNorm's fwd_bwd missed 0.98 of flax on the H200;
#   item1r: auto / cuda / flax, fwd / fwd_bwd / step, RMSNorm / add_rms_norm in bf16 at
#   1024 / 4096 / 8192 / 16384 (49152 rows), where cuda got faster.
# Usage: bash benchmarks/gpu_issue20_s27.sh stages
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-tests}
source benchmarks/gpu_stages.sh
abr_body() {
  echo "== build $1"
  for dt in bf16 f16; do
    timeout 100 python3 -m jax_ops.bench --repeats 3 --dtype $dt --impl cuda \
      --rows 49152 --op layer_norm,rms_norm --mode bwd --cols 16384,32768
  done
  timeout 60 python3 -m jax_ops.bench --repeats 5 --dtype bf16 --impl cuda \
    --rows 4096 --op layer_norm,rms_norm --mode bwd --cols 65536
}
has abr && ab_stage abr abr_body
abn_body() {
  echo "== build $1"
  timeout 150 python3 -m jax_ops.bench --repeats 3 --dtype bf16 --impl cuda --rows 49152 \
    --op layer_norm,rms_norm,add_rms_norm --mode bwd --cols ${ABN_BWD_COLS:-32,128,512,1024,4096,8192}
  timeout 100 python3 -m jax_ops.bench --repeats 3 --dtype bf16 --impl cuda --rows 49152 \
    --op layer_norm,rms_norm --mode fwd --cols ${ABN_FWD_COLS:-64,256,1024,4096,16384}
}
has abn && ab_stage abn abn_body
abl_body() {
  echo "== build $1"
  for dt in bf16 f16; do
    timeout 100 python3 -m jax_ops.bench --repeats 3 --dtype $dt --impl cuda --rows 49152 \
      --op layer_norm,rms_norm --mode bwd --cols 4096,8192,16384,32768
  done
  timeout 60 python3 -m jax_ops.bench --repeats 3 --dtype bf16 --impl cuda --rows 49152 \
    --op add_layer_norm --mode bwd --cols 8192,16384
  timeout 60 python3 -m jax_ops.bench --repeats 5 --dtype bf16 --impl cuda --rows 4096 \
    --op layer_norm --mode bwd --cols 65536
}
has abl && ab_stage abl abl_body
has san && DTYPES=float32,bfloat16 SAN_OPS=ln,rms,add_rms RACE_OPS=ln,rms norm_sanitize 301 \
  "${SAN_COLS:-33,1000,4104,8192,16384}" "${RACE_COLS:-1000,16384}"
has item1 && SWEEP_TIMEOUT=200 sweep_stage sweep_item1_f16 --dtype f16 --rows 49152 --op rms_norm,layer_norm \
  --mode fwd_bwd,step --cols 16384,32768
has item1r && SWEEP_TIMEOUT=240 sweep_stage sweep_item1_rms_bf16 --dtype bf16 --rows 49152 \
  --op rms_norm,add_rms_norm --mode fwd,fwd_bwd,step --cols 1024,4096,8192,16384
has tests && norm_tests
if has ws; then
  WS_DTYPE=bfloat16 workspace_stage workspace_bf16
  WS_DTYPE=float16 workspace_stage workspace_f16
fi
finish_call "log|env|tests|abr|abn|abl|sanitize|workspace_bf16"
