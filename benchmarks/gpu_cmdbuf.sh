#!/usr/bin/env bash
# One device call (ninth session, issue 20): the group tier's partials merged over 1/2/3
# blocks (speed; the workspace at 3), and item 5, XLA's command buffers (CUDA graphs) in a
# real model's training step: Hugging Face's Flax GPT-2 (benchmarks/model_step.py,
# original and optimize(policy="auto")) with command buffers off, at jax's default
# (XLA's FUSION, CUBLAS, CUBLASLT, CUSTOM_CALL, CUDNN, DYNAMIC_SLICE_FUSION), the default
# without CUSTOM_CALL (our handlers then split the graphs: the effect of declaring them
# compatible), and FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL (the fourth session's setting).
# jax 0.11's XLA forms command buffers from thunks after HLO, so the compiled HLO text
# does not show them; the settings are compared by step time.
# Usage: bash benchmarks/gpu_cmdbuf.sh [stages]
#   (tests,groupmerge,groupws,workspace,off,default,nocustom,custom)
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-groupmerge,groupws,off,default,custom}
source benchmarks/gpu_stages.sh
has tests && norm_tests
has groupmerge && knob_sweep groupmerge JAX_OPS_NORM_BWD_GROUP_MERGE_BLOCKS "1 2 3" \
  --op layer_norm,rms_norm --mode bwd --cols ${MERGE_COLS:-128,768,1024}
has groupws && JAX_OPS_NORM_BWD_GROUP_MERGE_BLOCKS=3 workspace_stage workspace_group3
has workspace && workspace_stage
mkdir -p "$OUT/cmdbuf"
for name in off default nocustom custom; do
  has $name || continue
  case $name in
    off) flags="--xla_gpu_enable_command_buffer=" ;;
    default) flags="" ;;
    nocustom) flags="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUDNN,DYNAMIC_SLICE_FUSION" ;;
    custom) flags="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL" ;;
  esac
  echo "== command buffers $name: XLA_FLAGS='$flags'" | tee -a "$LOG"
  XLA_FLAGS="$flags" timeout 240 python3 benchmarks/model_step.py --models gpt2 --modes train \
    --profile-rows 0 --out "$OUT/cmdbuf/gpt2_$name.json" > "$OUT/cmdbuf/gpt2_$name.txt" 2>&1
  grep -E "ms/step|speedup|Error" "$OUT/cmdbuf/gpt2_$name.txt" | tee -a "$LOG"
  stage_done "$name"
done
tar -C "$OUT" -czf "$OUT/cmdbuf.tgz" cmdbuf && rm -rf "$OUT/cmdbuf"
