#!/bin/bash
# Issue 20, thirty-ninth session, on whichever GPU is lent (stages, a comma list):
# - tests: the norm tests of rows of whole 8-byte words (half-word packs), the tail widths
#   and the cuda matrix, on the GPU;
# - untable: the dispatch table's entries (cuda / pallas / xla, fwd / bwd / step) at
#   UNTABLE_SPECS ("DT:OPS:COLS ...", default: bf16's half-word widths the table holds),
#   merged into this GPU's table;
# - sanitize: memcheck / synccheck (LayerNorm, add_rms_norm; f32 and bf16) at widths of
#   half-word packs and beside them, racecheck (LayerNorm) at two of them;
# - sync: synccheck alone at the sanitize stage's widths;
# - unsweep: auto / cuda / pallas / flax fwd_bwd, LayerNorm and add_rms_norm, at
#   UNSWEEP_SPECS ("DT:COLS ...");
# - sw: the four norms' bf16 fwd_bwd sweep at 32-16384 columns (for an H200).
# Usage: bash benchmarks/gpu_issue20_s39.sh stages, or "h200:STAGES|STAGES": the first
# where the GPU is an H200, else the second.
set -uo pipefail
STAGES=${1:-tests}
source benchmarks/gpu_extension.sh
source benchmarks/gpu_stages.sh
python3 benchmarks/dram_bandwidth.py | tee -a "$OUT/env.txt"  # tail_by_device's input
HALF_K="half_words or tail_widths or (matches_reference and cuda)"
SAN_COLS=4,34,36,100,1002,1004,4100,8194  # half-word widths (8k + 4 / 4k + 2) and beside them
starts tests && TEST_TIMEOUT=${TEST_TIMEOUT:-150} norm_tests tests/test_layer_norm.py tests/test_add_norm.py -k "$HALF_K"
if starts untable; then
  OP_TIMEOUT=${OP_TIMEOUT:-130} table_specs "${UNTABLE_SPECS:-bf16:$OPS4:36,68,100,268,4100}"
fi
if starts sanitize; then
  DTYPES=float32,bfloat16 SAN_OPS=ln,add_rms RACE_OPS=ln norm_sanitize 17 $SAN_COLS 36,4100
fi
# sync: synccheck alone at the sanitize stage's widths (its start crashes at times, rc 139).
if starts sync; then
  SAN_NAME=sync SAN_TOOLS=synccheck DTYPES=float32,bfloat16 SAN_OPS=ln,add_rms norm_sanitize 17 $SAN_COLS ""
fi
# UNSWEEP_SPECS: "DT:COLS ..." (default bf16 at its measured widths and between them).
if starts unsweep; then
  fwd_bwd_sweeps auto,cuda,pallas,flax "layer_norm add_rms_norm" "${UNSWEEP_SPECS:-bf16:36,52,100,268,500,1004,2052,4100}"
fi
# sw: the four norms' bf16 fwd_bwd sweep, auto / cuda / flax (issue 20's H200 run).
starts sw && fwd_bwd_sweeps auto,cuda,flax "${OPS4//,/ }" bf16:32,64,128,264,320,384,1024,4096,16384
finish_call "log|env|auto_vs_best|tests|sanitize|sync"
exit 0
