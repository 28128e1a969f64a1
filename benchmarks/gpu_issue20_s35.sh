#!/usr/bin/env bash
# Device calls of the thirty-fifth session (issue 20): the first H100 since the
# twenty-fourth session, so the kernels of sessions 25-34 measured there. Stages:
# - ws: item 4, the workspace of a lone op's jitted vjp against flax (bf16);
# - swA / swB / swC: items 1-3 in bf16, auto / cuda / flax, fwd / bwd / fwd_bwd at 49152
#   rows: LayerNorm and RMSNorm at LN_COLS (and 65536 at 8192 rows), add_layer_norm /
#   add_rms_norm at ADD_COLS;
# - swf16 / swf32: item 1 in float16 / float32, the four ops, fwd and fwd_bwd at DT_COLS;
# - tailab: the tail kernels (257-384 16-bit columns, rules measured on the H200) against
#   JAX_OPS_NORM_FWD_TAIL=0 / BWD_TAIL=0, four ops, fwd and bwd, bf16;
# - san: memcheck / synccheck of the four ops, bf16 / f16, 301 rows x SAN_COLS;
# - bounds: the kernel-structure bound (bounds_stage) at BOUND_COLS;
# - tests: the norm tests;
# - tables: the H100 table's entries TABLE_SPECS (DT:OPS:COLS ..., see table_specs);
# - gpt2: Hugging Face's Flax GPT-2 training step, original and optimize(), with jax's
#   default command buffers (item 5; transformers 4.57 from .carry/wheels).
# Usage: bash benchmarks/gpu_issue20_s35.sh stages
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-tests}
source benchmarks/gpu_stages.sh
LN_COLS=32,128,256,264,288,320,384,512,768,1024,2048,4096,8192,16384,32768
ADD_COLS=32,128,256,264,288,320,384,512,1024,2048,4096,8192,16384
DT_COLS=32,128,264,320,384,1024,4096,16384
has ws && workspace_stage
has tables && OP_TIMEOUT=${OP_TIMEOUT:-150} table_specs "${TABLE_SPECS:?tables needs TABLE_SPECS}"
has swA && SWEEP_OPS="layer_norm rms_norm" SWEEP_COLS=$LN_COLS sweep_dtype bf16
has swB && SWEEP_OPS=add_layer_norm SWEEP_COLS=$ADD_COLS SWEEP_65536=0 sweep_dtype bf16
has swC && SWEEP_OPS=add_rms_norm SWEEP_COLS=$ADD_COLS SWEEP_65536=0 sweep_dtype bf16
for dt in f16 f32; do
  has sw$dt && SWEEP_OPS="${OPS4//,/ }" SWEEP_MODES=fwd,fwd_bwd SWEEP_COLS=$DT_COLS SWEEP_65536=0 sweep_dtype $dt
done
starts tailab && cfg_sweep tailab "default FWD_TAIL=0,BWD_TAIL=0" bf16 --rows 49152 --op $OPS4 --mode fwd,bwd \
  --cols 264,296,320,352,384
if starts san; then
  # Its first start often crashes (rc 139); in runs 3 and 5 the tools crashed after this too.
  timeout 60 compute-sanitizer --tool memcheck python3 -c "print('sanitizer warm')" > /dev/null 2>&1
  DTYPES=bfloat16,float16 SAN_OPS=ln,rms,add_ln,add_rms norm_sanitize 301 ${SAN_COLS:-33,264,328,384,1000} ""
fi
starts bounds && bounds_stage ${BOUND_COLS:-128,264,288,320,384}
if starts gpt2; then
  XLA_FLAGS="" timeout ${MODEL_TIMEOUT:-200} python3 benchmarks/model_step.py --models gpt2 --modes train \
    --profile-rows 0 --out "$OUT/gpt2.json" > "$OUT/gpt2.txt" 2>&1
  grep -E "ms/step|speedup|Error" "$OUT/gpt2.txt" | tee -a "$LOG"
  stage_done gpt2
fi
starts tests && norm_tests
finish_call "log|env|auto_vs_best|tests|workspace|sanitize|gpt2|tailab|bounds"
exit 0
