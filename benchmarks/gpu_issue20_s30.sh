#!/usr/bin/env bash
# Device calls of the thirtieth session (issue 20). Stages:
# - pf2 (build U, where the knob was off by default for every op; since build V on for
#   LayerNorm only): the warp-tier backward's next tile loaded ahead at two bfloat16 packs
#   a lane (257-512 columns; JAX_OPS_NORM_BWD_REGS_PREFETCH2=1) against without, twice each
#   in turn: bwd of the four ops at 384 / 512, fwd_bwd at 512;
# - fwdrows: the forward's rows a group below 32 lanes (knob JAX_OPS_NORM_FWD_GROUP_ROWS,
#   chosen on the H100) on this GPU: LayerNorm / RMSNorm bf16 at 32 / 64 / 128;
# - knobs: the warp-tier backward's partial rows on this GPU (both knobs chosen on the
#   H100): pairs of blocks merged from 256 columns (JAX_OPS_NORM_BWD_GROUP_MERGE_MIN_COLS;
#   default 768) or from 4096 (none merged here), 320-thread blocks (BWD_REGS_BLOCK_THREADS),
#   bwd of the four ops in bf16 at 384 / 512 / 768 / 1024;
# - fwdx (build W, whose two knobs build X folds into one): the warp-tier forward at one
#   pack a lane, the tile's rows' statistics as interleaved shuffle chains
#   (JAX_OPS_NORM_FWD_ROWS_JOINT=1) and/or a persistent grid that loads each warp's next
#   tile ahead (JAX_OPS_NORM_FWD_REGS_PREFETCH=1): fwd of the four ops in bf16 at 32-256,
#   LayerNorm / RMSNorm in f16 and f32, fwd_bwd of LayerNorm / RMSNorm;
# - f16pf: float16 LayerNorm's forward with the next tile ahead, its rows as words, against
#   without (JAX_OPS_NORM_FWD_REGS_PREFETCH=0; run 5 on build Y turned it off by that
#   build's own knob, JAX_OPS_NORM_FWD_REGS_PREFETCH_F16=0), twice: fwd at 64 / 128 / 256,
#   fwd_bwd at 128 / 256; then memcheck / synccheck of it at 301 rows x 64 / 72 / 200 / 256;
# - san: memcheck / synccheck of the four ops in bfloat16 with that knob on at 301 rows x
#   264 / 392 / 512 columns, racecheck of LayerNorm at 512; then float16 add+norm (its
#   sums as f16x2) at 33 / 1000 / 2056 / 4104 columns;
# - sanln: memcheck / synccheck of LayerNorm's bf16 forward with its next tile ahead;
# - rnd: the test that h = x + residual rounds like jnp's (the f16x2 sums on a GPU);
# - tests: the norm tests;
# - tables: this GPU's table entries for each of TABLE_SPECS (DT:OPS:COLS);
# - item1: auto / cuda / flax at ITEM1_COLS, bf16 four ops, fwd_bwd and step; LayerNorm's
#   bf16 forward at 32-256.
# Usage: bash benchmarks/gpu_issue20_s30.sh stages
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-tests}
source benchmarks/gpu_stages.sh
if has pf2; then
  cfg_sweep pf2 "default BWD_REGS_PREFETCH2=1 default BWD_REGS_PREFETCH2=1" bf16 --rows 49152 \
    --op $OPS4 --mode bwd --cols 384,512
  cfg_sweep pf2_fwd_bwd "default BWD_REGS_PREFETCH2=1" bf16 --rows 49152 --op $OPS4 --mode fwd_bwd --cols 512
fi
has fwdrows && cfg_sweep fwdrows "default FWD_GROUP_ROWS=1 FWD_GROUP_ROWS=4 default" bf16 --rows 49152 \
  --op layer_norm,rms_norm --mode fwd --cols 32,64,128
has knobs && cfg_sweep knobs "default BWD_GROUP_MERGE_MIN_COLS=256 BWD_GROUP_MERGE_MIN_COLS=4096 \
BWD_REGS_BLOCK_THREADS=320 default" bf16 --rows 49152 --op $OPS4 --mode bwd --cols 384,512,768,1024
if has fwdx; then
  FWDX="default FWD_ROWS_JOINT=1 FWD_REGS_PREFETCH=1 FWD_ROWS_JOINT=1,FWD_REGS_PREFETCH=1 default"
  cfg_sweep fwdx "$FWDX" bf16 --rows 49152 --op $OPS4 --mode fwd --cols 32,64,128,256
  cfg_sweep fwdx_dt "$FWDX" "f16 f32" --rows 49152 --op layer_norm,rms_norm --mode fwd --cols 32,128,256
  cfg_sweep fwdx_fwd_bwd "default FWD_ROWS_JOINT=1 FWD_ROWS_JOINT=1,FWD_REGS_PREFETCH=1" bf16 --rows 49152 \
    --op layer_norm,rms_norm --mode fwd_bwd --cols 64,128,256
fi
if has san; then
  JAX_OPS_NORM_BWD_REGS_PREFETCH2=1 SAN_NAME=sanitize_pf2 DTYPES=bfloat16 SAN_OPS=ln,rms,add_ln,add_rms \
    RACE_OPS=ln norm_sanitize 301 264,392,512 512
  SAN_NAME=sanitize_f16add DTYPES=float16 SAN_OPS=add_ln,add_rms norm_sanitize 301 33,1000,2056,4104 ""
fi
if has f16pf; then
  cfg_sweep f16pf "default FWD_REGS_PREFETCH=0 default FWD_REGS_PREFETCH=0" f16 --rows 49152 \
    --op layer_norm --mode fwd --cols 64,128,256
  cfg_sweep f16pf_fwd_bwd "default FWD_REGS_PREFETCH=0" f16 --rows 49152 --op layer_norm --mode fwd_bwd --cols 128,256
  SAN_NAME=sanitize_ln16 DTYPES=float16 SAN_OPS=ln norm_sanitize 301 64,72,200,256 ""
fi
# sanln: memcheck / synccheck of LayerNorm's bf16 forward with its next tile ahead (the
# default from build X), 301 rows at 64 / 72 / 128 / 200 / 256 columns.
has sanln && SAN_NAME=sanitize_ln DTYPES=bfloat16 SAN_OPS=ln norm_sanitize 301 64,72,128,200,256 ""
has rnd && TEST_TIMEOUT=120 norm_tests tests/test_add_norm.py -k rounds_like
has tests && norm_tests
has tables && table_specs "${TABLE_SPECS:?}"
has item1 && SWEEP_TIMEOUT=250 sweep_stage sweep_item1_bf16 --dtype bf16 --rows 49152 \
  --op $OPS4 --mode fwd_bwd,step --cols ${ITEM1_COLS:-384,512}
has item1 && SWEEP_TIMEOUT=100 sweep_stage sweep_item1_ln_fwd --dtype bf16 --rows 49152 \
  --op layer_norm --mode fwd --cols 32,64,128,256
finish_call "log|env|tests|pf2|pf2_fwd_bwd|fwdrows|knobs|fwdx|fwdx_dt|fwdx_fwd_bwd|tables_[a-z0-9]+_[0-9]+|env_tables|sanitize_pf2|sanitize_ln|sanitize_ln16|f16pf|f16pf_fwd_bwd|sanitize_f16add"
