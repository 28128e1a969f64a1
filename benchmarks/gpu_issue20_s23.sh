#!/usr/bin/env bash
# Device calls of the twenty-third session (issue 20): the 16-bit cluster backward's
# cluster size (knob JAX_OPS_NORM_BWD_CLUSTER_SMEM_CS: 0 = the most resident clusters of
# 2-8 blocks, -1 = the power of two before it, 2-8 forced). Stages: abcs (the backward
# under each of CS_VALUES at CS_COLS, 49152 rows); abcsstep (fwd_bwd, the rule against
# the power of two, the four ops at STEP_COLS); tests; sandef (memcheck / synccheck of
# the four ops at SAN_COLS, 301 rows; racecheck at RACE_COLS); table (TABLE_OPS' bf16
# entries at TABLE_COLS); sweepmid (item 1: auto / cuda / pallas / flax at
# SWEEP_MID_COLS); workspace.
# Usage: bash benchmarks/gpu_issue20_s23.sh stages
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-abcs}
source benchmarks/gpu_stages.sh
if has abcs; then
  KNOB_TIMEOUT=${KNOB_TIMEOUT:-150} knob_sweep abcs JAX_OPS_NORM_BWD_CLUSTER_SMEM_CS "${CS_VALUES:--1 0 3 5 6 8 -1 0}" \
    --rows 49152 --op "${CS_OPS:-layer_norm,rms_norm,add_layer_norm}" --mode bwd \
    --cols "${CS_COLS:-9216,12288,16384,20480,24576}"
fi
if has abcsstep; then
  KNOB_TIMEOUT=${KNOB_TIMEOUT:-150} knob_sweep abcsstep JAX_OPS_NORM_BWD_CLUSTER_SMEM_CS "${STEP_VALUES:--1 0 -1 0}" \
    --rows 49152 --op layer_norm,rms_norm,add_layer_norm,add_rms_norm --mode fwd_bwd \
    --cols "${STEP_COLS:-9216,12288,16384,20480,24576,32768}"
fi
has tests && norm_tests
if has sandef; then
  SAN_OPS=ln,rms,add_ln,add_rms RACE_OPS=ln,add_ln norm_sanitize 301 \
    "${SAN_COLS:-9216,12288,16384,20480,24576,32768}" "${RACE_COLS:-12288,20480}"
fi
has table && TABLE_MODES=${TABLE_MODES:-fwd,bwd,step,fwd_res} table_stage bf16 \
  "${TABLE_OPS:-layer_norm,rms_norm,add_layer_norm,add_rms_norm}" "${TABLE_COLS:-12288,20480,24576}"
if has sweepmid; then
  SWEEP_IMPLS=${SWEEP_IMPLS:-auto,cuda,pallas,flax} SWEEP_TIMEOUT=${SWEEP_TIMEOUT:-300} sweep_stage sweep_mid_bf16 \
    --dtype bf16 --rows 49152 --op "${SWEEP_MID_OPS:-layer_norm,rms_norm,add_layer_norm,add_rms_norm}" \
    --mode "${SWEEP_MODES:-fwd,fwd_bwd}" --cols "${SWEEP_MID_COLS:-12288,20480,24576}"
fi
has workspace && workspace_stage workspace
finish_call "log|env|abcs|abcsstep|sanitize|tests|workspace"
