#!/usr/bin/env bash
# One device call (issue 20): the narrow forward's rows a lane group (2 for a plain norm,
# 1 for add+norm): the H100 table's 32-128 column entries re-measured with it (bf16 for
# the four norm ops, float16/float32 for LayerNorm/RMSNorm), the norm test files, and
# compute-sanitizer memcheck at narrow widths. Usage: bash benchmarks/gpu_fwd_rows.sh
set -uo pipefail
t0=$SECONDS
for spec in "bf16 layer_norm,rms_norm,add_layer_norm,add_rms_norm" "f16 layer_norm,rms_norm" "f32 layer_norm,rms_norm"; do
  set -- $spec
  OP_TIMEOUT=80 bash benchmarks/gpu_tables.sh $1 $2 ${COLS:-32,64,128} > /dev/null 2>&1
  echo "tables $1: $((SECONDS - t0)) s"
done > "$OUT/log.txt"
grep -h -E "^[a-z_]+ (fwd|bwd|step) " "$OUT"/sweep_*.txt | tee -a "$OUT/log.txt"
(cd "$OUT" && tar czf sweeps.tgz sweep_* && rm -f sweep_*)
source benchmarks/gpu_extension.sh > /dev/null
timeout 150 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_layer_norm.py tests/test_add_norm.py \
  > "$OUT/tests.txt" 2>&1; tail -1 "$OUT/tests.txt" | tee -a "$OUT/log.txt"
OPS=ln,rms,add_ln,add_rms ROWS=5001 timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 \
  python3 benchmarks/sanitize_norm.py 1,8,31,32,33,64,100,128 > "$OUT/memcheck.txt" 2>&1
echo "memcheck rc $?" | tee -a "$OUT/log.txt"; grep -iE "ERROR SUMMARY|mismatch|worst" "$OUT/memcheck.txt" | tail -3 | tee -a "$OUT/log.txt"
echo "total: $((SECONDS - t0)) s" | tee -a "$OUT/log.txt"
