#!/usr/bin/env bash
# One device call (issue 20): re-measure the dispatch table's entries of some ops for one
# dtype (cuda, pallas, xla; fwd, bwd, step: the training forward is step - bwd), one op at
# a time merged into jax_ops/tables/<gpu>.json (a timeout loses one op, not the run;
# TABLE_MODES replaces the modes fwd,bwd,step; with fwd_res cuda's and pallas' training
# forward is timed alone),
# the table copied to $OUT. Usage: bash benchmarks/gpu_tables.sh f16|f32 [ops] [cols]
set -uo pipefail
source benchmarks/gpu_extension.sh
[ -f .carry/_ffi_new.so.gz ] && gunzip -c .carry/_ffi_new.so.gz > jax_ops/_ffi.cpython-312-x86_64-linux-gnu.so
DT=$1; OPS=${2:-layer_norm,rms_norm}; COLS=${3:-32,256,1024,4096,8192,16384,32768}
TABLE=${TABLE:-jax_ops/tables/nvidia_h100_80gb_hbm3.json}
for op in ${OPS//,/ }; do
  t0=$SECONDS
  timeout ${OP_TIMEOUT:-270} python3 -m jax_ops.bench --repeats 3 --op $op --dtype $DT --impl cuda,pallas,xla \
    --mode ${TABLE_MODES:-fwd,bwd,step} --cols $COLS --table $TABLE --json "$OUT/sweep_${op}_$DT.json" > "$OUT/sweep_${op}_$DT.txt" 2>&1
  echo "$op $DT: rc $? in $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
  grep -E "^[a-z_]+ (fwd|bwd|fwd_bwd|step) " "$OUT/sweep_${op}_$DT.txt"
done
cp $TABLE "$OUT/"
