#!/bin/bash
# Issue 20, thirty-seventh session, on whichever GPU is lent (stages, a comma list):
# - probe: benchmarks/narrow_fold_probe.cu, what folding the narrow backward's column
#   sums into it saves (a mock LayerNorm step at 32-128 columns as CUDA graphs: the sums
#   kernel, the same with PDL, the sums kernel with 16-byte loads, an empty third kernel,
#   a two-level ticket with a memset or forward-zeroed counters, its tickets alone, the
#   partial rows alone, none); ticket groups of about sqrt(blocks), 16 and 64 blocks
#   (PROBE_GROUPS), 49152 rows; 8192 and 1000 rows too;
# - tailab: add+norm's tail kernels by device, the default against JAX_OPS_NORM_FWD_TAIL=0,
#   BWD_TAIL=0 (on an H200 the default takes them), bf16, two passes;
# - sumsab: the column sums kernel with 16-byte loads (JAX_OPS_NORM_SUMS_VEC: 0 off, 1 or 2
#   the fewest float4s a block) against the scalar one, bf16 bwd, LayerNorm and
#   add_rms_norm at 32-352 columns, two passes. The knob exists only in an extension built
#   with benchmarks/results/2026-12-07_H100_s37/run6/sums_vec.patch applied (measured no faster, not
#   kept);
# - sw: the four ops' bf16 fwd_bwd sweep at 32-16384 columns, auto / cuda / flax, on
#   whichever GPU is lent (meant for issue 20's H200 run of the norm sweep; run 1 got an H100).
# Usage: bash benchmarks/gpu_issue20_s37.sh stages
set -uo pipefail
STAGES=${1:-probe}
probe_t0=$SECONDS  # the call's clock (gpu_stages.sh's t0) starts here, before the probe
if [[ ",$STAGES," == *",probe,"* ]]; then  # no extension needed
  OUT=${OUT:-/tmp/jax_ops_out}; mkdir -p "$OUT"
  if (cd benchmarks && nvcc -std=c++17 -O3 -gencode arch=compute_90,code=sm_90 -o /tmp/nfp narrow_fold_probe.cu) \
      > "$OUT/probe_build.txt" 2>&1; then
    { nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv
      for g in ${PROBE_GROUPS:-0 16 64}; do echo "== G=$g"; /tmp/nfp 49152 $g; done
      echo "== 8192 rows"; /tmp/nfp 8192 0
      echo "== 1000 rows, G=7"; /tmp/nfp 1000 7; } > "$OUT/probe.txt" 2>&1
    cat "$OUT/probe.txt"
  else
    echo "probe: nvcc failed"; tail -20 "$OUT/probe_build.txt"; exit 1
  fi
  [[ "$STAGES" == probe ]] && exit 0
fi
source benchmarks/gpu_extension.sh
source benchmarks/gpu_stages.sh
t0=$probe_t0
python3 benchmarks/dram_bandwidth.py | tee -a "$OUT/env.txt"  # tail_by_device's input
ADD_TAIL_COLS=264,288,296,320,336,352
starts tailab && cfg_sweep tailab "default FWD_TAIL=0,BWD_TAIL=0 default FWD_TAIL=0,BWD_TAIL=0" bf16 --rows 49152 \
  --op add_layer_norm,add_rms_norm --mode fwd,bwd --cols $ADD_TAIL_COLS
starts sumsab && KNOB_TIMEOUT=60 knob_sweep sumsab JAX_OPS_NORM_SUMS_VEC "0 1 2 0 1 2" --rows 49152 \
  --op layer_norm,add_rms_norm --mode bwd --cols 32,64,128,288,320,352
if starts sw; then
  SWEEP_OPS="${OPS4//,/ }" SWEEP_MODES=fwd_bwd SWEEP_COLS=32,64,128,264,320,384,1024,4096,16384 SWEEP_65536=0 \
    sweep_dtype bf16
fi
finish_call "log|env|auto_vs_best|probe|tailab|sumsab"
exit 0
