#!/usr/bin/env bash
# Which backward tier hangs: each shape alone, bulk on and off, 40 s each.
set -uo pipefail
source benchmarks/gpu_extension.sh > /dev/null
for shape in "600 4096" "600 8192" "600 16384" "3 16384" "600 32768"; do
  for st in 3 0; do
    out=$(JAX_OPS_NORM_BWD_BULK_STAGES=$st timeout 40 python3 benchmarks/bulk_probe.py $shape 2>&1); rc=$?
    echo "== $shape stages $st rc $rc: $(echo "$out" | tail -1)"
  done
done
