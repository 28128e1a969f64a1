#!/bin/bash
# Issue 20, thirty-eighth session, on whichever GPU is lent (stages, a comma list):
# - probe: benchmarks/narrow_fold_probe.cu at one ticket group size (about sqrt(blocks)),
#   49152, 8192 and 1000 rows: its empty and vec variants, not yet run (gpu_issue20_s37.sh);
# - tests: the add+norm tests of the tail widths and many-row shapes on the GPU;
# - tailab: add_rms_norm's backward at one value a lane (257-288 columns), the default
#   (build Q: the tail only where tail_by_device; the tree since: so for bf16 past 280
#   columns only) against JAX_OPS_NORM_BWD_TAIL=2 (the tail on every GPU), bf16 and f16,
#   two passes; add_layer_norm beside it (unchanged);
# - tailcut: the same A/B for add_rms_norm alone at 264-288 columns in steps of 4 (where
#   the tail stops paying off in bf16; f16 measured it faster in tailab), two passes;
# - untable: the dispatch table's entries at columns not a multiple of 8 (the unvectorized
#   kernels, one value a load), bf16, the four ops, cuda / pallas / xla, fwd / bwd / step,
#   merged into this GPU's table (UNTABLE_SPECS: DT:OPS:COLS, space separated);
# - unsweep: auto / cuda / pallas / flax fwd_bwd at such widths (below);
# - item3: add_rms_norm / add_layer_norm fwd_bwd at 264-384 columns, auto / cuda / flax,
#   bf16 and f16 (issue 20 item 3);
# - sw: the four ops' bf16 fwd_bwd sweep at 32-16384 columns (issue 20's H200 run, where
#   an H200 is lent).
# Usage: bash benchmarks/gpu_issue20_s38.sh stages
set -uo pipefail
STAGES=${1:-probe}
probe_t0=$SECONDS
if [[ ",$STAGES," == *",probe,"* ]]; then  # no extension needed
  OUT=${OUT:-/tmp/jax_ops_out}; mkdir -p "$OUT"
  if (cd benchmarks && nvcc -std=c++17 -O3 -gencode arch=compute_90,code=sm_90 -o /tmp/nfp narrow_fold_probe.cu) \
      > "$OUT/probe_build.txt" 2>&1; then
    { nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv
      echo "== 49152 rows, G=0"; timeout 60 /tmp/nfp 49152 0
      echo "== 8192 rows"; timeout 30 /tmp/nfp 8192 0
      echo "== 1000 rows, G=7"; timeout 30 /tmp/nfp 1000 7; } > "$OUT/probe.txt" 2>&1
    cat "$OUT/probe.txt"
  else
    echo "probe: nvcc failed"; tail -20 "$OUT/probe_build.txt"
  fi
  echo "probe: $((SECONDS - probe_t0)) s"
  [[ "$STAGES" == probe ]] && exit 0
fi
source benchmarks/gpu_extension.sh
source benchmarks/gpu_stages.sh
t0=$probe_t0
python3 benchmarks/dram_bandwidth.py | tee -a "$OUT/env.txt"  # tail_by_device's input
starts tests && TEST_TIMEOUT=${TEST_TIMEOUT:-120} norm_tests tests/test_add_norm.py -k "tail or many"
starts tailab && cfg_sweep tailab "default BWD_TAIL=2 default BWD_TAIL=2" "bf16 f16" --rows 49152 \
  --op add_rms_norm,add_layer_norm --mode bwd --cols 264,272,288
starts tailcut && cfg_sweep tailcut "default BWD_TAIL=2 default BWD_TAIL=2" "bf16 f16" --rows 49152 \
  --op add_rms_norm --mode bwd --cols ${TAILCUT_COLS:-264,268,272,276,280,284,288}
if starts untable; then
  OP_TIMEOUT=${OP_TIMEOUT:-130} table_specs "${UNTABLE_SPECS:-bf16:$OPS4:36,100,268,1001,4100}"
fi
# unsweep: auto / cuda / pallas / flax fwd_bwd at such widths, measured (36-4100) and
# between them (52, 500, 2052), LayerNorm and add_rms_norm, UNSWEEP_DT (default bf16; the
# lookup's check).
if starts unsweep; then
  fwd_bwd_sweeps auto,cuda,pallas,flax "layer_norm add_rms_norm" \
    "${UNSWEEP_DT:-bf16}:${UNSWEEP_COLS:-36,52,100,268,500,1001,2052,4100}"
fi
starts item3 && fwd_bwd_sweeps auto,cuda,flax "add_rms_norm add_layer_norm" "bf16:264,288,320,352,384 f16:264,288,320,352,384"
starts sw && fwd_bwd_sweeps auto,cuda,flax "${OPS4//,/ }" bf16:32,64,128,264,320,384,1024,4096,16384
finish_call "log|env|auto_vs_best|probe|tests|tailab|tailcut"
exit 0
