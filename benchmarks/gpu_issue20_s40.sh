#!/bin/bash
# Issue 20, fortieth session, on whichever GPU is lent (stages, a comma list):
# - tests: the norm tests of half-word rows, the tail widths and the cuda matrix, on the GPU
#   (the launches' pack now chosen by row_pack);
# - halfab: the half-word packs' warp tiers against the block tiers, cuda fwd / bwd of
#   HALF_OPS (default LayerNorm, add_rms_norm) at float32 HALF_F32 and bf16 HALF_BF16
#   columns (modes HALF_MODES, default fwd,bwd), under each configuration of HALF_CFGS
#   (knobs without JAX_OPS_NORM_);
# - sync: synccheck at s39's half-word widths (its start crashed on fresh machines);
# - untable: the dispatch table's entries at UNTABLE_SPECS ("DT:OPS:COLS ...") under the
#   knobs of TABLE_CFG (a HALF_CFGS entry; default none), merged into this GPU's table;
# - unsweep: auto / cuda / pallas / flax fwd_bwd, LayerNorm and add_rms_norm, at
#   UNSWEEP_SPECS ("DT:COLS ...");
# - sw: the four norms' bf16 fwd_bwd sweep at 32-16384 columns (for an H200).
# Usage: bash benchmarks/gpu_issue20_s40.sh STAGES, or "h200:STAGES|STAGES": the first
# where the GPU is an H200, else the second.
set -uo pipefail
STAGES=${1:-tests}
source benchmarks/gpu_extension.sh
source benchmarks/gpu_stages.sh
python3 benchmarks/dram_bandwidth.py | tee -a "$OUT/env.txt"  # tail_by_device's input
HALF_K="half_words or tail_widths or (matches_reference and cuda)"
SAN_COLS=4,34,36,100,1002,1004,4100,8194
starts tests && TEST_TIMEOUT=${TEST_TIMEOUT:-150} norm_tests tests/test_layer_norm.py tests/test_add_norm.py -k "$HALF_K"
if starts halfab; then
  for op in ${HALF_OPS:-layer_norm add_rms_norm}; do
    cfg_sweep halfab_f32_$op "${HALF_CFGS:-default FWD_HALF_REGS_MAX_BYTES=1024,BWD_HALF_REGS_MAX_COLS=256}" f32 \
      --op $op --mode ${HALF_MODES:-fwd,bwd} --cols ${HALF_F32:-266,514,1002,1502,2002}
    cfg_sweep halfab_bf16_$op "${HALF_CFGS:-default FWD_HALF_REGS_MAX_BYTES=1024,BWD_HALF_REGS_MAX_COLS=256}" bf16 \
      --op $op --mode ${HALF_MODES:-fwd,bwd} --cols ${HALF_BF16:-268,516,1004,2052,3076}
  done
fi
if starts sync; then
  SAN_NAME=sync SAN_TOOLS=synccheck DTYPES=float32,bfloat16 SAN_OPS=ln,add_rms norm_sanitize 17 $SAN_COLS ""
fi
starts sw && fwd_bwd_sweeps auto,cuda,flax "${OPS4//,/ }" bf16:32,64,128,264,320,384,1024,4096,16384
# The untable and unsweep stages run under TABLE_CFG's knobs (exported from here on).
knob_envs JAX_OPS_NORM_ "${TABLE_CFG:-default}"
export "${envs[@]}"
starts untable && OP_TIMEOUT=${OP_TIMEOUT:-130} table_specs "${UNTABLE_SPECS:-f16:$OPS4:36,68,100,268,4100}"
if starts unsweep; then
  fwd_bwd_sweeps auto,cuda,pallas,flax "layer_norm add_rms_norm" "${UNSWEEP_SPECS:-bf16:44,52,1004,2052}"
fi
finish_call "log|env|auto_vs_best|tests|sync"
exit 0
