#!/usr/bin/env bash
# Device calls of the thirty-fourth session (issue 20). Stages:
# - add_ab: add+norm's forward at 264-384 16-bit columns through fwd_tail_kernel (the
#   row's last columns spread over the lanes) against JAX_OPS_NORM_FWD_TAIL=0 (two packs
#   a lane, fwd_regs_kernel), bf16 twice and f16, 49152 rows;
# - rows_ab: the tail backward at two rows a warp (JAX_OPS_NORM_BWD_TAIL_ROWS=2) against
#   one, four ops bwd bf16 twice, LayerNorm / RMSNorm f16;
# - tables: the H200 table's float32 LayerNorm / RMSNorm entries at 264-384 (and 512);
# - check: the kept rules' backward against JAX_OPS_NORM_BWD_TAIL=0, LayerNorm, RMSNorm,
#   add_layer_norm, bf16 twice;
# - item1: auto / cuda / flax, four ops, fwd and fwd_bwd at 264-384, ITEM1_DTYPES (f32);
# - san: memcheck / synccheck (racecheck at 264 / 328) of four ops at 301 rows x SAN_COLS;
# - tests: the norm tests;
# - item2: auto / cuda / flax, bf16, four ops, fwd and fwd_bwd at ITEM2_COLS;
# - bound: LayerNorm's two-row tail backward at one value a lane asked to fit five blocks
#   an SM (96 registers), bwd and fwd_bwd at 264 / 272 / 288 and, unchanged, 296 / 320 (to
#   compare with run 2's four blocks: the two builds do not fit one carry), bf16 twice, f16.
# Usage: bash benchmarks/gpu_issue20_s34.sh stages
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-tests}
source benchmarks/gpu_stages.sh
has add_ab && cfg_sweep add_ab "default FWD_TAIL=0 default FWD_TAIL=0" bf16 --rows 49152 \
  --op add_layer_norm,add_rms_norm --mode fwd --cols $TAIL_COLS
has add_ab && cfg_sweep add_ab_f16 "default FWD_TAIL=0" f16 --rows 49152 --op add_layer_norm,add_rms_norm \
  --mode fwd --cols $TAIL_COLS
if has rows_ab; then
  cfg_sweep rows_ab "default BWD_TAIL_ROWS=2 default BWD_TAIL_ROWS=2" bf16 --rows 49152 --op $OPS4 --mode bwd \
    --cols $TAIL_COLS
  cfg_sweep rows_ab_f16 "default BWD_TAIL_ROWS=2" f16 --rows 49152 --op layer_norm,rms_norm --mode bwd --cols $TAIL_COLS
fi
has check && cfg_sweep check "default BWD_TAIL=0 default BWD_TAIL=0" bf16 --rows 49152 \
  --op layer_norm,rms_norm,add_layer_norm --mode bwd --cols 264,296,320,336,384
has tables && OP_TIMEOUT=150 table_specs "f32:layer_norm,rms_norm:264,288,320,384,512"
if has item1; then
  for dt in ${ITEM1_DTYPES:-f32}; do
    sweep_stage sweep_item1_$dt --dtype $dt --rows 49152 --op $OPS4 --mode fwd,fwd_bwd --cols 264,288,320,384
  done
fi
if has san; then
  compute-sanitizer --tool memcheck python3 -c "print('sanitizer warm')" > /dev/null 2>&1  # its first start crashes
  SAN_NAME=sanitize DTYPES=bfloat16,float16 SAN_OPS=ln,rms,add_ln,add_rms norm_sanitize 301 ${SAN_COLS:-264,296,328,384} \
    264,328
fi
has tests && norm_tests
has item2 && SWEEP_TIMEOUT=300 sweep_stage sweep_item2_bf16 --dtype bf16 --rows 49152 \
  --op $OPS4 --mode fwd,fwd_bwd --cols ${ITEM2_COLS:-264,288,320,384}
if has bound; then
  for dt in bf16 bf16 f16; do
    timeout 100 python3 -m jax_ops.bench --repeats 3 --dtype $dt --impl cuda --rows 49152 --op layer_norm \
      --mode bwd,fwd_bwd --cols 264,272,288,296,320
  done > "$OUT/bound.txt" 2>&1
  grep -E "^[a-z_]+ (bwd|fwd_bwd) " "$OUT/bound.txt" | tee -a "$LOG"
  stage_done bound
fi
finish_call "log|env|tests|add_ab|add_ab_f16|rows_ab|rows_ab_f16|sanitize|check|bound"
