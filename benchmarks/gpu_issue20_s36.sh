#!/usr/bin/env bash
# Device calls of the thirty-sixth session (issue 20), on the H100. Stages:
# - tailab: add+norm's tail kernels by device (tail_by_device: on the H100 the forward
#   tail off, add_layer_norm's backward tail only at one value a lane) against
#   JAX_OPS_NORM_FWD_TAIL=2,BWD_TAIL=2 (the tails as on a fast-DRAM GPU), bf16, two passes;
# - narrow: the two-kernel bound at 32-128 columns (norm_bounds.py narrow);
# - sw3: item 3 at the tail widths, add+norm bf16 and f16 fwd_bwd, auto / cuda / flax;
# - tests: the norm tests (the tail kernels' large-offset cases first run on a GPU);
# - san: memcheck / synccheck of the four ops, bf16 / f16, 301 rows x SAN_COLS;
# - gpt2: Hugging Face's Flax GPT-2 training step, original and optimize(), with jax's
#   default command buffers (item 5; transformers 4.57 from .carry/wheels);
# - swbwd: item 1's float16 / float32 bwd alone, and 64 columns, the four ops.
# Usage: bash benchmarks/gpu_issue20_s36.sh stages
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-tests}
source benchmarks/gpu_stages.sh
python3 benchmarks/dram_bandwidth.py | tee -a "$OUT/env.txt"  # tail_by_device's input
ADD_TAIL_COLS=264,288,296,320,336,352
starts tailab && cfg_sweep tailab "default FWD_TAIL=2,BWD_TAIL=2 default FWD_TAIL=2,BWD_TAIL=2" bf16 --rows 49152 \
  --op add_layer_norm,add_rms_norm --mode fwd,bwd --cols $ADD_TAIL_COLS
if starts narrow; then
  timeout ${BOUND_TIMEOUT:-200} python3 benchmarks/norm_bounds.py narrow $OPS4 32,64,128 > "$OUT/narrow.txt" 2>&1
  grep -E "^[a-z_]+ [0-9]+ \|" "$OUT/narrow.txt" | tee -a "$LOG"
  stage_done narrow
fi
if starts sw3; then
  for dt in bf16 f16; do
    SWEEP_OPS="add_layer_norm add_rms_norm" SWEEP_MODES=fwd_bwd SWEEP_COLS=$ADD_TAIL_COLS,384 SWEEP_65536=0 \
      sweep_dtype $dt
  done
fi
starts tests && norm_tests
if starts san; then
  # Its first start often crashes (rc 139); a throwaway start first.
  timeout 60 compute-sanitizer --tool memcheck python3 -c "print('sanitizer warm')" > /dev/null 2>&1
  DTYPES=bfloat16,float16 SAN_OPS=ln,rms,add_ln,add_rms norm_sanitize 301 ${SAN_COLS:-33,264,328,384,1000} ""
fi
if starts gpt2; then
  XLA_FLAGS="" timeout ${MODEL_TIMEOUT:-200} python3 benchmarks/model_step.py --models gpt2 --modes train \
    --profile-rows 0 --out "$OUT/gpt2.json" > "$OUT/gpt2.txt" 2>&1
  grep -E "ms/step|speedup|Error" "$OUT/gpt2.txt" | tee -a "$LOG"
  stage_done gpt2
fi
if starts swbwd; then
  for dt in f16 f32; do
    SWEEP_OPS="${OPS4//,/ }" SWEEP_MODES=bwd SWEEP_COLS=32,64,128,264,320,384,1024,4096,16384 SWEEP_65536=0 \
      sweep_dtype $dt
  done
  SWEEP_OPS="${OPS4//,/ }" SWEEP_COLS=64 SWEEP_65536=0 sweep_dtype bf16
fi
finish_call "log|env|auto_vs_best|tests|sanitize|gpt2|tailab|narrow"
exit 0
