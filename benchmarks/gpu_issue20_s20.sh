#!/usr/bin/env bash
# Device calls of the twentieth session (issue 20): bigger blocks in the narrow backward
# (knob JAX_OPS_NORM_BWD_REGS_BLOCK_THREADS: 128 or 320 threads, five or two partial
# rows an SM; run 2's build also had 640, one, since removed as slower),
# 16-byte shared-memory accesses in the long-row cluster backward (knob
# JAX_OPS_NORM_BWD_CLUSTER_SMEM_VEC), and how many clusters of each size the GPU keeps
# resident. Stages:
# occupancy (.carry/cluster_occupancy, built from benchmarks/cluster_occupancy.cu: resident
# clusters of 1-16 blocks and the SMs they land on); abnarrow (cuda bwd / fwd_bwd of the
# four ops at NARROW_COLS, 49152 rows, bf16, under each BLOCK_THREADS value, the list
# reversed and repeated); ablong (the same for LONG_OPS at LONG_COLS, 4096 rows, under each
# VEC value); workspace (benchmarks/norm_workspace.py under each WS_THREADS block size);
# tests; sanitize (memcheck /
# synccheck at SAN_COLS, racecheck at RACE_COLS, SAN_ROWS rows, the four ops); sanlong
# (memcheck / synccheck at LONG_SAN_COLS, racecheck at 65536, 301 rows, LayerNorm /
# RMSNorm / add_layer_norm);
# sweepnarrow / sweeplong (item 1: auto / cuda / flax, fwd / bwd / fwd_bwd).
# Usage: bash benchmarks/gpu_issue20_s20.sh stages
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-occupancy}
source benchmarks/gpu_stages.sh
if has occupancy; then
  timeout 60 .carry/cluster_occupancy > "$OUT/occupancy.txt" 2>&1
  grep -v "SMs by" "$OUT/occupancy.txt" | grep -v "^  " | tee -a "$LOG"
  stage_done occupancy
fi
NARROW_COLS=${NARROW_COLS:-32,64,128}
if has abnarrow; then
  KNOB_TIMEOUT=150 knob_sweep abnarrow JAX_OPS_NORM_BWD_REGS_BLOCK_THREADS "${BLOCK_THREADS_VALUES:-128 320 320 128}" \
    --rows 49152 --op layer_norm,rms_norm,add_layer_norm,add_rms_norm --mode bwd,fwd_bwd --cols "$NARROW_COLS"
fi
if has ablong; then
  KNOB_TIMEOUT=150 knob_sweep ablong JAX_OPS_NORM_BWD_CLUSTER_SMEM_VEC "${VEC_VALUES:-1 0 0 1}" \
    --rows 4096 --op ${LONG_OPS:-layer_norm,rms_norm,add_layer_norm} --mode bwd,fwd_bwd --cols "${LONG_COLS:-16384,32768,65536}"
fi
if has workspace; then  # under each narrow block size
  for v in ${WS_THREADS:-128 320}; do JAX_OPS_NORM_BWD_REGS_BLOCK_THREADS=$v workspace_stage workspace_$v; done
fi
has tests && norm_tests
has sanitize && SAN_OPS=ln,rms,add_ln,add_rms norm_sanitize "${SAN_ROWS:-2001}" "${SAN_COLS:-3,31,33,64,127,128}" \
  "${RACE_COLS:-32,64,128}"
if has sanlong; then  # the cluster backward: memcheck and synccheck, then racecheck at 65536 (all three
  # columns under racecheck took over 200 s: run 4), 301 rows
  { for tool in memcheck synccheck; do
      ROWS=301 OPS=ln,rms,add_ln timeout 200 compute-sanitizer --tool $tool --error-exitcode 9 \
        python3 benchmarks/sanitize_norm.py "${LONG_SAN_COLS:-16384,40000,65536}" 2>&1; echo "$tool rc $?"
    done
    for ops in ln,rms add_ln; do
      ROWS=301 OPS=$ops timeout 250 compute-sanitizer --tool racecheck --error-exitcode 9 \
        python3 benchmarks/sanitize_norm.py 65536 2>&1; echo "racecheck $ops rc $?"
    done; } > "$OUT/sanlong.txt"
  grep -E "rc [0-9]|ERROR SUMMARY|MISMATCH|worst" "$OUT/sanlong.txt" | tee -a "$LOG"
  stage_done sanlong
fi
if has sweepnarrow; then
  SWEEP_TIMEOUT=240 sweep_stage sweep_narrow_bf16 --dtype bf16 --rows 49152 \
    --op layer_norm,rms_norm,add_layer_norm,add_rms_norm --mode fwd,bwd,fwd_bwd --cols "$NARROW_COLS"
fi
if has sweeplong; then
  SWEEP_TIMEOUT=200 sweep_stage sweep_long_bf16 --dtype bf16 --rows 4096 --op ${LONG_OPS:-layer_norm,rms_norm} \
    --mode fwd,bwd,fwd_bwd --cols 65536
fi
finish_call "log|env|occupancy|abnarrow|ablong|workspace_128|workspace_320|tests|sanitize|sanlong"
