#!/bin/bash
# Issue 20, forty-second session, on whichever GPU is lent (stages, a comma list):
# - tests: the norm tests of shifted rows (16-bit rows of the backward's block tier that
#   are not whole 16-byte words: the bulk kernel on the flat buffer's words), half-word
#   rows, tail widths, the cuda matrix and the many-rows cases, on the GPU; then the
#   half-word block tests with the shifted kernel off (the pre-Hopper path);
# - san: memcheck at SAN_COLS (and racecheck at RACE_COLS) of the shifted kernel, 801 rows
#   (an odd count: the buffers end mid-word);
# - shiftab: cuda bwd of SHIFT_OPS at bf16 SHIFT_COLS, the shifted kernel on and off
#   (16-byte widths beside them as the reference);
# - untable: the dispatch table's entries at UNTABLE_SPECS ("DT:OPS:COLS ...") merged into
#   this GPU's table; unsweep: auto / cuda / pallas / flax fwd_bwd at UNSWEEP_SPECS.
# Usage: bash benchmarks/gpu_issue20_s42.sh STAGES, or "h200:STAGES|STAGES".
set -uo pipefail
STAGES=${1:-tests}
source benchmarks/gpu_extension.sh
source benchmarks/gpu_stages.sh
python3 benchmarks/dram_bandwidth.py | tee -a "$OUT/env.txt"  # tail_by_device's input
SHIFT_K="unaligned_rows or half_words or tail_widths or (matches_reference and cuda) or (many_rows and (2052 or 3076 or 6148))"
if starts tests; then
  TEST_TIMEOUT=${TEST_TIMEOUT:-150} norm_tests tests/test_layer_norm.py tests/test_add_norm.py -k "$SHIFT_K"
  JAX_OPS_NORM_BWD_SHIFT=0 TESTS_NAME=tests_noshift TEST_TIMEOUT=90 norm_tests tests/test_layer_norm.py \
    tests/test_add_norm.py -k "half_words or unaligned_rows"
fi
if starts san; then
  SAN_NAME=san_shift SAN_TOOLS=memcheck DTYPES=bfloat16,float16 SAN_OPS=ln,add_rms RACE_OPS=ln \
    norm_sanitize 801 "${SAN_COLS:-1025,1030,2052,4100,4611,6150,8188}" "${RACE_COLS-2051}"
fi
if starts shiftab; then
  for op in ${SHIFT_OPS:-layer_norm add_rms_norm}; do
    cfg_sweep shiftab_$op "default BWD_SHIFT=0" bf16 --op $op --mode bwd \
      --cols ${SHIFT_COLS:-1025,2048,2052,3075,4096,4100,6144,6148,8187}
  done
fi
starts untable && OP_TIMEOUT=${OP_TIMEOUT:-130} table_specs "${UNTABLE_SPECS:-bf16:$OPS4:2052,4100}"
if starts unsweep; then
  fwd_bwd_sweeps auto,cuda,pallas,flax "layer_norm add_rms_norm" "${UNSWEEP_SPECS:-bf16:2052,3076,4100}"
fi
finish_call "log|env|auto_vs_best|tests|tests_noshift|san_shift"
exit 0
