#!/usr/bin/env bash
# One device call (eleventh session, issue 20): the cluster backward's row sums exchanged
# by st.async pushes onto mbarriers (no cluster barrier a row), its next rows copied by
# cp.async. Stages: tests (norm tests at the cluster widths, TEST_K), sanitize
# (memcheck / synccheck at SAN_COLS, racecheck at RACE_COLS), ab (the backward of
# .carry/_ffi_old.so.gz, the previous build, against this one, same run), sweep (step and
# fwd_bwd, auto / cuda / flax at SWEEP_COLS), fulltests, workspace.
# Usage: bash benchmarks/gpu_cluster_exchange.sh [stages]
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-tests,sanitize,ab,sweep}
source benchmarks/gpu_stages.sh
if has tests; then
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_layer_norm.py \
    tests/test_add_norm.py -k "${TEST_K:-16384 or 24577 or 32768 or 65536 or cluster}" > "$OUT/tests.txt" 2>&1
  tail -2 "$OUT/tests.txt" | tee -a "$LOG"
  stage_done tests
fi
has sanitize && norm_sanitize ${SAN_ROWS:-301} ${SAN_COLS:-16384,24577,32768,65536} ${RACE_COLS:-16384}
ab_bwd() {
  for dt in ${AB_DTYPES:-bf16 f16 f32}; do
    cols=${AB_COLS:-16384,32768,65536}; [ $dt = f32 ] && cols=${AB_COLS_F32:-16384,32768}
    echo "== $1 $dt"
    timeout 150 python3 -m jax_ops.bench --repeats 5 --dtype $dt --impl cuda --op ${AB_OPS:-layer_norm,rms_norm,add_layer_norm} \
      --mode bwd --cols $cols
  done
}
has ab && ab_stage ab ab_bwd
has sweep && sweep_stage sweep --dtype ${SWEEP_DTYPE:-bf16} --rows ${SWEEP_ROWS:-49152} \
  --op ${SWEEP_OPS:-layer_norm,rms_norm} --mode ${SWEEP_MODES:-fwd,bwd,step,fwd_bwd} --cols ${SWEEP_COLS:-16384,32768}
has fulltests && norm_tests
has workspace && workspace_stage
# Experiment settings: each word of FLAG_ENVS is an environment assignment (knobs of the
# build carried; JAX_OPS_NORM_BWD_CLUSTER_FLAGS existed only in the experiment builds of
# runs 2-4), the bf16 backward at FLAG_COLS under each; then f32 and 65536 (FLAG_ROWS
# rows) old build against new.
if has flags; then
  for e in ${FLAG_ENVS:-JAX_OPS_NORM_BWD_CLUSTER_FLAGS=0 JAX_OPS_NORM_BWD_CLUSTER_FLAGS=2 JAX_OPS_NORM_BWD_CLUSTER_SMEM=0}; do
    echo "== $e"
    env JAX_OPS_NORM_DEBUG=1 $e timeout 100 python3 -m jax_ops.bench --repeats 3 --dtype bf16 \
      --impl cuda --op ${FLAG_OPS:-layer_norm,rms_norm,add_layer_norm} --mode bwd --cols ${FLAG_COLS:-16384,32768} 2>&1 \
      | grep -E "bwd .*cuda|cluster_smem" | sort -u
  done > "$OUT/flags.txt" 2>&1
  cat "$OUT/flags.txt" | tee -a "$LOG"
  stage_done flags
fi
ab_other() {
  echo "== $1"
  timeout 100 python3 -m jax_ops.bench --repeats 3 --dtype f32 --impl cuda --op layer_norm,rms_norm --mode bwd --cols 16384
  timeout 100 python3 -m jax_ops.bench --repeats 3 --dtype bf16 --rows ${FLAG_ROWS:-8192} --impl cuda --op layer_norm,rms_norm \
    --mode bwd --cols 65536
}
if has abother && [ -f .carry/_ffi_old.so.gz ]; then
  ab_builds abother ab_other
  grep -E "^== |^[a-z_]+ bwd " "$OUT/abother.txt" | tee -a "$LOG"
  stage_done abother
fi
# 65536 columns at WIDE_ROWS rows (49152 rows of 65536 do not fit the benchmark's
# rotated inputs), and add+norm at 16384.
if has sweepwide; then
  timeout 200 python3 -m jax_ops.bench --repeats 3 --dtype bf16 --rows ${WIDE_ROWS:-8192} --impl auto,cuda,flax \
    --op layer_norm,rms_norm --mode fwd,bwd,step,fwd_bwd --cols 65536 --json "$OUT/sweep_wide.json" > "$OUT/sweep_wide.txt" 2>&1
  timeout 200 python3 -m jax_ops.bench --repeats 3 --dtype bf16 --impl auto,cuda,flax \
    --op add_layer_norm,add_rms_norm --mode fwd,bwd,step,fwd_bwd --cols 16384 --json "$OUT/sweep_add.json" > "$OUT/sweep_add.txt" 2>&1
  grep -hE "^[a-z_]+ (fwd|bwd|fwd_bwd|step) " "$OUT/sweep_wide.txt" "$OUT/sweep_add.txt" | tee -a "$LOG"
  stage_done sweepwide
fi
# The forward's cached block tier split over a cluster (rows over 64 KiB), off
# (JAX_OPS_NORM_FWD_CLUSTER_MIN_BYTES=0) against on, at 65536 (WIDE_ROWS rows) and float32
# 32768 / 65536. (Run 10 of results/2026-11-26_H100_clusterexchange measured another
# cluster forward, the register tier split, with knobs of its own build only.)
if has fwdcluster; then
  for e in JAX_OPS_NORM_FWD_CLUSTER_MIN_BYTES=0 JAX_OPS_NORM_FWD_CLUSTER_MIN_BYTES=65537; do
    echo "== $e"
    env $e timeout 100 python3 -m jax_ops.bench --repeats 3 --dtype bf16 --rows ${WIDE_ROWS:-8192} --impl cuda \
      --op layer_norm,rms_norm,add_layer_norm --mode fwd --cols 65536 2>&1 | grep "fwd bf16 rows"
    env $e timeout 100 python3 -m jax_ops.bench --repeats 3 --dtype f32 --rows ${WIDE_ROWS:-8192} --impl cuda \
      --op layer_norm,rms_norm --mode fwd --cols 32768,65536 2>&1 | grep "fwd f32 rows"
  done > "$OUT/fwdcluster.txt" 2>&1
  cat "$OUT/fwdcluster.txt" | tee -a "$LOG"
  stage_done fwdcluster
fi
