#!/usr/bin/env bash
# Device calls of the twenty-fourth session (issue 20). Stages: fwdk (the block forward's
# packs a thread, knob JAX_OPS_NORM_FWD_BLOCK_K, at FWDK_COLS in float16 and bfloat16);
# abwide2 (the bulk backward's one-pack block two an SM, bwd and fwd_bwd at WIDE2_COLS;
# run 1's build had knob JAX_OPS_NORM_BWD_BULK_WIDE2: 0 off, 1 plain norms, 2 every op;
# main has JAX_OPS_NORM_BWD_BULK_PAIR, 0 = off); tests; san (memcheck / synccheck of the
# four ops at SAN_COLS, 301 rows, racecheck at RACE_COLS); sweep / sweepf16 (item 1:
# auto / cuda / pallas / flax in bf16 at SWEEP_COLS, auto / cuda / flax in f16 at
# SWEEP_F16_COLS); workspace.
# Usage: bash benchmarks/gpu_issue20_s24.sh stages
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-fwdk}
source benchmarks/gpu_stages.sh
if has fwdk; then
  KNOB_DTYPE=f16 knob_sweep fwdk_f16 JAX_OPS_NORM_FWD_BLOCK_K "${FWDK_VALUES:-0 4 5}" --rows 49152 \
    --op "${FWDK_OPS:-layer_norm,rms_norm,add_layer_norm,add_rms_norm}" --mode fwd \
    --cols "${FWDK_COLS:-16392,18432,20480,22528,24576}"
  KNOB_DTYPE=bf16 knob_sweep fwdk_bf16 JAX_OPS_NORM_FWD_BLOCK_K "${FWDK_VALUES_BF16:-0 5}" --rows 49152 \
    --op layer_norm,rms_norm --mode fwd --cols "${FWDK_COLS:-16392,18432,20480,22528,24576}"
fi
if has abwide2; then
  knob_sweep abwide2 ${WIDE2_KNOB:-JAX_OPS_NORM_BWD_BULK_PAIR} "${WIDE2_VALUES:-0 1 0 1}" --rows 49152 \
    --op layer_norm,rms_norm,add_layer_norm,add_rms_norm --mode "${WIDE2_MODES:-bwd,fwd_bwd}" \
    --cols "${WIDE2_COLS:-4104,4352,4608}"
fi
has tests && norm_tests
if has san; then
  SAN_OPS=ln,rms,add_ln,add_rms RACE_OPS=ln,add_ln norm_sanitize 301 "${SAN_COLS:-4104,4352,4608,16392,18440}" \
    "${RACE_COLS:-4352}"
fi
if has sweep; then
  SWEEP_IMPLS=${SWEEP_IMPLS:-auto,cuda,pallas,flax} sweep_stage sweep_bf16 --dtype bf16 --rows 49152 \
    --op "${SWEEP_OPS:-layer_norm,rms_norm,add_layer_norm,add_rms_norm}" --mode "${SWEEP_MODES:-fwd,fwd_bwd}" \
    --cols "${SWEEP_COLS:-4352,4608,20480}"
fi
if has sweepf16; then
  SWEEP_IMPLS=${SWEEP_IMPLS:-auto,cuda,flax} sweep_stage sweep_f16 --dtype f16 --rows 49152 \
    --op "${SWEEP_F16_OPS:-layer_norm,rms_norm}" --mode "${SWEEP_MODES:-fwd,fwd_bwd}" \
    --cols "${SWEEP_F16_COLS:-4352,18432,20480}"
fi
has workspace && workspace_stage workspace
finish_call "log|env|fwdk_f16|fwdk_bf16|abwide2|sanitize|tests|workspace"
