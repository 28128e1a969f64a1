#!/usr/bin/env bash
# Device calls of the sixteenth session (issue 20). Stages: tablesf32 (the H100 table's
# float32 entries of TABLE_OPS, default the two norms, at TABLE_COLS, default 512 / 2048,
# merged in place); f32picks (float32 LayerNorm / RMSNorm at 512 / 2048 columns, where
# the lookup's dtype-width rule and interpolation moved picks: every implementation and
# flax, fwd / fwd_bwd, 49152 rows); sweepaddrms (add_rms_norm bf16, auto / cuda / flax,
# 32-32768 and 65536); narrow (LayerNorm / RMSNorm fwd_bwd at 32-256 bf16 columns, 7
# repeats); l2bound (LayerNorm's 65536-column forward: the parameters' cost, ncu's DRAM /
# L2 throughput); tests; gpt2 (Hugging Face's Flax GPT-2 training step, original vs
# jax_ops.optimize). Then the auto / best summary of every sweep JSON. (The session's
# first runs also had stages rows2 and sliceab, for knobs of branch exp/ln-fwd-two-rows:
# that branch's copy of this script.)
# Usage: bash benchmarks/gpu_issue20_s16.sh stages
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-tablesf32,f32picks}
source benchmarks/gpu_stages.sh
has tablesf32 && table_stage f32 ${TABLE_OPS:-layer_norm,rms_norm} ${TABLE_COLS:-512,2048}
if has f32picks; then
  SWEEP_IMPLS=auto,cuda,pallas,xla,flax SWEEP_TIMEOUT=200 sweep_stage sweep_f32picks --dtype f32 --rows 49152 \
    --op layer_norm,rms_norm --mode ${PICK_MODES:-fwd,fwd_bwd} --cols ${PICK_COLS:-512,2048}
fi
if has sweepaddrms; then
  SWEEP_TIMEOUT=240 sweep_stage sweep_add_rms_norm_bf16 --dtype bf16 --rows 49152 --op add_rms_norm \
    --mode fwd,bwd,fwd_bwd --cols ${SWEEP_COLS:-32,64,128,256,512,1024,2048,4096,8192,16384,32768}
  SWEEP_TIMEOUT=120 sweep_stage sweep_add_rms_norm_bf16_65536 --dtype bf16 --rows 8192 --op add_rms_norm \
    --mode fwd,bwd,fwd_bwd --cols 65536
fi
if has narrow; then  # the narrow step, more repeats (the target: >= 0.85 of its 5X bound)
  timeout 120 python3 -m jax_ops.bench --repeats 7 --dtype bf16 --rows 49152 --impl auto,cuda,flax \
    --op layer_norm,rms_norm --mode fwd_bwd --cols 32,64,128,256 > "$OUT/narrow.txt" 2>&1
  grep -E "^[a-z_]+ (fwd|bwd|fwd_bwd|step) [a-z0-9]+ rows" "$OUT/narrow.txt" | tee -a "$LOG"
  stage_done narrow
fi
# Where LayerNorm's 65536-column forward loses to RMSNorm's: the cuda forward with float32,
# bfloat16 and no scale / bias (norm_params_probe.py, 8192 rows), and ncu's DRAM and L2
# throughput of the cluster forward (fwd_block_kernel) for each (2048 rows).
if has l2bound; then
  ROWS=8192 COLS=${PROBE_COLS:-65536} timeout 120 python3 benchmarks/norm_params_probe.py > "$OUT/params.txt" 2>&1
  grep -E "^cols" "$OUT/params.txt" | tee -a "$LOG"
  ROWS=2048 timeout 200 ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
    --kernel-name regex:fwd_block_kernel python3 benchmarks/norm_fwd_ncu.py ${PROBE_COLS:-65536} > "$OUT/ncu.txt" 2>&1
  echo "ncu rc $?" | tee -a "$LOG"
  grep -E "fwd_block_kernel|cols |Duration|L2 Hit Rate|Mem Busy|Max Bandwidth|L2 Cache Throughput|DRAM Throughput|Memory Throughput|Achieved Occupancy" \
    "$OUT/ncu.txt" | sed -E 's/ +/ /g' | cut -c1-150 | tee -a "$LOG"
  stage_done l2bound
fi
has tests && norm_tests
if has gpt2; then
  timeout ${MODEL_TIMEOUT:-240} python3 benchmarks/model_step.py --models gpt2 --modes train --profile-rows 12 \
    --out "$OUT/model_step.json" 2>&1 | grep -v "deprecated\|Warning" > "$OUT/model_step.txt"
  grep -E "gpt2|step|MiB" "$OUT/model_step.txt" | tail -12 | tee -a "$LOG"
  stage_done gpt2
fi
finish_call "log|env|auto_vs_best|tests|model_step"
exit 0
