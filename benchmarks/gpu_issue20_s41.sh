#!/bin/bash
# Issue 20, forty-first session, on whichever GPU is lent (stages, a comma list):
# - tests: the norm tests of half-word rows (the tier cuts by value size, the 16-bit block
#   backward at two packs a thread; run 1 the bulk one), the tail widths and the cuda
#   matrix, on the GPU;
# - bulkab: cuda bwd of HALF_OPS at bf16 BULK_COLS under BULK_CFGS (default: the tree's
#   two packs a thread against one; run 1 gave BULK_CFGS="default BWD_BULK_HALF=0
#   BWD_BULK_HALF=0,BWD_HALF_BLOCK_K=2", the bulk backward against the block-regs one);
# - san: memcheck at SAN_HALF_COLS (and racecheck at RACE_COLS) of the 16-bit half packs'
#   block-tier backward (run 1: the bulk one, bulk_half.patch), 801 rows (an odd count:
#   the buffers end mid-word);
# - sync: synccheck at s39's half-word widths;
# - untable: the dispatch table's entries at UNTABLE_SPECS ("DT:OPS:COLS ...") merged into
#   this GPU's table; unsweep: auto / cuda / pallas / flax fwd_bwd at UNSWEEP_SPECS;
# - sw: the four norms' bf16 fwd_bwd sweep at 32-16384 columns (for an H200).
# Usage: bash benchmarks/gpu_issue20_s41.sh STAGES, or "h200:STAGES|STAGES".
set -uo pipefail
STAGES=${1:-tests}
source benchmarks/gpu_extension.sh
source benchmarks/gpu_stages.sh
python3 benchmarks/dram_bandwidth.py | tee -a "$OUT/env.txt"  # tail_by_device's input
HALF_K="half_words or tail_widths or (matches_reference and cuda) or (many_rows and (2052 or 3076 or 6148))"
starts tests && TEST_TIMEOUT=${TEST_TIMEOUT:-150} norm_tests tests/test_layer_norm.py tests/test_add_norm.py -k "$HALF_K"
if starts bulkab; then
  for op in ${HALF_OPS:-layer_norm add_rms_norm}; do
    cfg_sweep bulkab_$op "${BULK_CFGS:-default BWD_HALF_BLOCK_K=1}" bf16 \
      --op $op --mode bwd --cols ${BULK_COLS:-1028,2052,3076,4100,6148}
  done
fi
if starts san; then
  SAN_NAME=san_half SAN_TOOLS=memcheck DTYPES=bfloat16,float16 SAN_OPS=ln,add_rms RACE_OPS=ln \
    norm_sanitize 801 "${SAN_HALF_COLS:-1028,2052,3076,4100,6148}" "${RACE_COLS-2052}"
fi
if starts sync; then
  SAN_NAME=sync SAN_TOOLS=synccheck DTYPES=float32,bfloat16 SAN_OPS=ln,add_rms norm_sanitize 17 4,34,36,100,1002,1004,4100,8194 ""
fi
starts sw && fwd_bwd_sweeps auto,cuda,flax "${OPS4//,/ }" bf16:32,64,128,264,320,384,1024,4096,16384
starts untable && OP_TIMEOUT=${OP_TIMEOUT:-130} table_specs "${UNTABLE_SPECS:-f32:$OPS4:266,1002,2002}"
if starts unsweep; then
  fwd_bwd_sweeps auto,cuda,pallas,flax "layer_norm add_rms_norm" "${UNSWEEP_SPECS:-bf16:2052,4100 f32:1002,2002}"
fi
finish_call "log|env|auto_vs_best|tests|san_half|sync"
exit 0
