#!/usr/bin/env bash
# Device calls of the twenty-ninth session (issue 20). Stages:
# - abb: the warp-tier backward's bfloat16 rows as 32-bit words and float16 add+norm's
#   forward in the block tier from 2 KiB rows, the previous build (.carry/_ffi_old.so.gz)
#   against the carried one: bwd of the four ops in bf16 at 128-1024 columns (the warp
#   tier), LayerNorm's in f16 (unchanged code), fwd_bwd of LayerNorm / RMSNorm in bf16,
#   the f16 add+norm forward at 1536 / 2048 and bf16's at 2048 (unchanged);
# - san: memcheck / synccheck of the four ops in bfloat16 and float32 at 301 rows,
#   SAN_COLS (33,257,520,1000: the warp-tier backward), racecheck of LayerNorm at RACE_COLS;
# - tests: the norm tests (test_layer_norm, test_add_norm);
# - tables: this GPU's table entries (cuda / pallas / xla) for each of TABLE_SPECS
#   (DT:OPS:COLS, space separated), merged into jax_ops/tables/<gpu>.json;
# - item1: auto / cuda / flax, fwd_bwd / step of the four ops in bf16 at 128-1024, fwd /
#   fwd_bwd of f16 add+norm at 1536 / 2048;
# - addw: float16 add+norm's h = x + residual as f16x2 adds (the sums two a register):
#   its forward at 1024-2048 columns in the block tier from 2 KiB rows (default) against
#   the warp tier to 4 KiB (knob JAX_OPS_NORM_FWD_ADD_REGS_MAX_BYTES=4096), at 256 / 512 /
#   4096, then the add+norm tests.
# Usage: bash benchmarks/gpu_issue20_s29.sh stages
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-tests}
source benchmarks/gpu_stages.sh
abb_body() {
  echo "== build $1"
  timeout 100 python3 -m jax_ops.bench --repeats 3 --dtype bf16 --impl cuda --rows 49152 \
    --op layer_norm,rms_norm,add_layer_norm,add_rms_norm --mode bwd --cols ${ABB_COLS:-128,256,512,768,1024}
  timeout 40 python3 -m jax_ops.bench --repeats 3 --dtype f16 --impl cuda --rows 49152 \
    --op layer_norm --mode bwd --cols 512,1024
  timeout 50 python3 -m jax_ops.bench --repeats 3 --dtype bf16 --impl cuda --rows 49152 \
    --op layer_norm,rms_norm --mode fwd_bwd --cols 256,1024
  timeout 50 python3 -m jax_ops.bench --repeats 3 --dtype f16 --impl cuda --rows 49152 \
    --op add_layer_norm,add_rms_norm --mode fwd --cols 1536,2048
  timeout 40 python3 -m jax_ops.bench --repeats 3 --dtype bf16 --impl cuda --rows 49152 \
    --op add_layer_norm,add_rms_norm --mode fwd --cols 2048
}
has abb && ab_stage abb abb_body
has san && DTYPES=float32,bfloat16 SAN_OPS=ln,rms,add_ln,add_rms RACE_OPS=ln norm_sanitize 301 \
  "${SAN_COLS:-33,257,520,1000}" "${RACE_COLS:-1000}"
has tests && norm_tests
TABLE_SPECS=${TABLE_SPECS:-"bf16:layer_norm,rms_norm,add_layer_norm,add_rms_norm:32,64,128,256,512,768,1024 f16:add_layer_norm,add_rms_norm:1024,1536,2048,4096"}
has tables && table_specs "$TABLE_SPECS"
has item1 && SWEEP_TIMEOUT=250 sweep_stage sweep_item1_bf16 --dtype bf16 --rows 49152 \
  --op layer_norm,rms_norm,add_layer_norm,add_rms_norm --mode fwd_bwd,step --cols 128,256,512,1024
has item1 && SWEEP_TIMEOUT=100 sweep_stage sweep_item1_f16 --dtype f16 --rows 49152 \
  --op add_layer_norm,add_rms_norm --mode fwd,fwd_bwd --cols 1536,2048
if has addw; then
  cfg_sweep addw "default FWD_ADD_REGS_MAX_BYTES=4096" "f16" --rows 49152 \
    --op add_layer_norm,add_rms_norm --mode fwd --cols 1024,1536,2048
  timeout 60 python3 -m jax_ops.bench --repeats 3 --dtype f16 --impl cuda --rows 49152 \
    --op add_layer_norm,add_rms_norm --mode fwd,fwd_bwd --cols 256,512,4096 > "$OUT/addw_more.txt" 2>&1
  grep -E "^[a-z_]+ (fwd|fwd_bwd) " "$OUT/addw_more.txt" | tee -a "$LOG"; stage_done addw_more
  TEST_TIMEOUT=${TEST_TIMEOUT:-150} norm_tests tests/test_add_norm.py
fi
finish_call "log|env|tests|abb|addw|addw_more|tables_[a-z0-9]+_[0-9]+|env_tables|sanitize"
