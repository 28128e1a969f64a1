#!/usr/bin/env bash
# One device call (issue 20): the H100 table's narrow float16/float32 entries of the two
# norms re-measured (benchmarks/gpu_tables.sh, cuda/pallas/xla, fwd/bwd/step), then a real
# model's training step with the final kernels: Hugging Face's Flax GPT-2 original vs
# jax_ops.optimize (benchmarks/model_step.py; carried wheels in .carry/wheels).
# Usage: bash benchmarks/gpu_issue20_close.sh
set -uo pipefail
t0=$SECONDS
for dt in ${DTYPES:-f32 f16}; do
  OP_TIMEOUT=${OP_TIMEOUT:-110} bash benchmarks/gpu_tables.sh $dt ${OPS:-rms_norm,layer_norm} ${COLS:-32,64,128,256}
done
echo "tables: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
mv "$OUT/env.txt" "$OUT/env_tables.txt"
source benchmarks/gpu_extension.sh > /dev/null  # gpu_tables.sh ran in a child shell: PYTHONPATH, wheels
timeout ${MODEL_TIMEOUT:-240} python3 benchmarks/model_step.py --models gpt2 --modes train --profile-rows 12 \
  --out "$OUT/model_step.json" 2>&1 | grep -v "deprecated\|Warning" | tee "$OUT/model_step.txt"
echo "total: $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
(cd "$OUT" && tar czf sweeps.tgz sweep_* && rm -f sweep_*)
