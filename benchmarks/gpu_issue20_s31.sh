#!/usr/bin/env bash
# Device calls of the thirty-first session (issue 20). Stages:
# - thirds_bwd: the warp-tier backward with rows of 33-48 / 65-96 16-byte packs at three
#   packs a lane (16 / 32 lanes, no idle slot; JAX_OPS_NORM_BWD_REGS_THIRDS=1, 2: two rows
#   a group at 16 lanes) against the power-of-two shapes (=0), bwd of the four ops in bf16
#   at 320 / 384 / 640 / 768 columns, the default and the off run twice;
# - thirds_fwd: the same for the forward (JAX_OPS_NORM_FWD_REGS_THIRDS; 65-96 / 129-192 /
#   257-384 packs at 3 / 6 / 12 a lane), fwd of the four ops at 384 / 768 / 1536 / 3072;
# - thirds_fb: fwd_bwd with both on / both off, LayerNorm / RMSNorm in bf16 and f16;
# - san: memcheck / synccheck of the four ops in bf16 and f16 at 301 rows x 264 / 384 /
#   520 / 768 / 2056 / 3072 columns (the new shapes, ragged and whole), racecheck
#   LayerNorm at 384;
# - fwdpf2 (build C): the warp-tier forward at two packs a lane (257-512 columns) as a
#   persistent grid that loads each warp's next tile ahead (JAX_OPS_NORM_FWD_REGS_PREFETCH2:
#   1 LayerNorm, 2 LayerNorm and RMSNorm, 0 off), fwd of LayerNorm / RMSNorm in bf16 at
#   264-512 columns twice, f16 and fwd_bwd once; memcheck / synccheck of both norms with it
#   (knob 2) at 301 rows x 264 / 384 / 400 / 512 in bf16 and f16;
# - fwdrows2 (build D): the warp-tier forward at two packs a lane, two rows a tile, their
#   statistics interleaved (JAX_OPS_NORM_FWD_VPT2_ROWS=2; 1: one row) for the plain norms,
#   fwd in bf16 at 264-512 twice, f16 LayerNorm and fwd_bwd once; memcheck of both norms at
#   301 rows x 264 / 384 / 400 / 512 in bf16 and f16;
# - tests: the norm tests;
# - tables: this GPU's table entries for each of TABLE_SPECS (DT:OPS:COLS);
# - item2: auto / cuda / flax, bf16 four ops, fwd and fwd_bwd at ITEM2_COLS;
# - bounds: each cuda kernel of a bf16 training step next to a copy of its own bytes
#   (benchmarks/norm_bounds.py kernels), the four ops at BOUND_COLS: what a three-kernel
#   step can reach on this GPU.
# Usage: bash benchmarks/gpu_issue20_s31.sh stages
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-tests}
source benchmarks/gpu_stages.sh
has thirds_bwd && cfg_sweep thirds_bwd "default BWD_REGS_THIRDS=0 BWD_REGS_THIRDS=2 default BWD_REGS_THIRDS=0" bf16 \
  --rows 49152 --op $OPS4 --mode bwd --cols 320,384,640,768
has thirds_fwd && cfg_sweep thirds_fwd "default FWD_REGS_THIRDS=0 default FWD_REGS_THIRDS=0" bf16 \
  --rows 49152 --op $OPS4 --mode fwd --cols 384,768,1536,3072
has thirds_fb && cfg_sweep thirds_fb "default FWD_REGS_THIRDS=0,BWD_REGS_THIRDS=0" "bf16 f16" \
  --rows 49152 --op layer_norm,rms_norm --mode fwd_bwd --cols 384,768,1536,3072
if has fwdpf2; then
  cfg_sweep fwdpf2 "default FWD_REGS_PREFETCH2=0 FWD_REGS_PREFETCH2=2 default FWD_REGS_PREFETCH2=0" bf16 \
    --rows 49152 --op layer_norm,rms_norm --mode fwd --cols 264,320,384,448,512
  cfg_sweep fwdpf2_f16 "default FWD_REGS_PREFETCH2=0" f16 --rows 49152 --op layer_norm --mode fwd --cols 320,384,512
  cfg_sweep fwdpf2_fwd_bwd "default FWD_REGS_PREFETCH2=0" "bf16 f16" --rows 49152 --op layer_norm --mode fwd_bwd \
    --cols 384,512
  JAX_OPS_NORM_FWD_REGS_PREFETCH2=2 SAN_NAME=sanitize_fwdpf2 DTYPES=bfloat16,float16 SAN_OPS=ln,rms \
    norm_sanitize 301 264,384,400,512 ""
fi
if has fwdrows2; then
  cfg_sweep fwdrows2 "default FWD_VPT2_ROWS=1 default FWD_VPT2_ROWS=1" bf16 \
    --rows 49152 --op layer_norm,rms_norm --mode fwd --cols 264,320,384,448,512
  cfg_sweep fwdrows2_f16 "default FWD_VPT2_ROWS=1" f16 --rows 49152 --op layer_norm,rms_norm --mode fwd --cols 320,384,512
  cfg_sweep fwdrows2_fwd_bwd "default FWD_VPT2_ROWS=1" bf16 --rows 49152 --op layer_norm,rms_norm --mode fwd_bwd \
    --cols 384,512
  { for dt in bfloat16 float16; do
      DTYPES=$dt ROWS=301 OPS=ln,rms timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 \
        python3 benchmarks/sanitize_norm.py 264,384,400,512 2>&1; echo "memcheck $dt rc $?"
    done; } > "$OUT/sanitize_rows2.txt"
  grep -E "rc [0-9]|ERROR SUMMARY|worst" "$OUT/sanitize_rows2.txt" | tee -a "$LOG"
  stage_done sanitize_rows2
fi
if has san; then
  SAN_NAME=sanitize DTYPES=bfloat16,float16 SAN_OPS=ln,rms,add_ln,add_rms RACE_OPS=ln \
    norm_sanitize 301 264,384,520,768,2056,3072 384
fi
has tests && norm_tests
has tables && table_specs "${TABLE_SPECS:?}"
has item2 && SWEEP_TIMEOUT=300 sweep_stage sweep_item2_bf16 --dtype bf16 --rows 49152 \
  --op $OPS4 --mode fwd,fwd_bwd --cols ${ITEM2_COLS:-384,768,1536,3072}
has bounds && bounds_stage ${BOUND_COLS:-128,256,384,512,768}
finish_call "log|env|tests|bounds|fwdpf2|fwdpf2_f16|fwdpf2_fwd_bwd|sanitize_fwdpf2|fwdrows2|fwdrows2_f16|fwdrows2_fwd_bwd|sanitize_rows2|thirds_bwd|thirds_fwd|thirds_fb|sanitize|tables_[a-z0-9]+_[0-9]+|env_tables"
