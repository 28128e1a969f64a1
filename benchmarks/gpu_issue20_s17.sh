#!/usr/bin/env bash
# Device calls of the seventeenth session (issue 20). Stages: gridsums (the group-tier
# backward that sums its own dscale/dbias partials after a grid-wide barrier, a
# cooperative launch, instead of a second kernel; knob JAX_OPS_NORM_BWD_GRID_SUMS 0 / 1 /
# 0 / 1, cuda, bwd and fwd_bwd at GS_COLS, bf16 for the four ops, float32 for the two
# norms) and cmdbuf (below) need branch exp/bwd-grid-sums' build and files; dhab
# (add+norm's backward with dh prefetched to L2, against the previous build,
# .carry/_ffi_old.so.gz); dhahead (at one pack a lane, dh loaded with the row or
# prefetched: knob JAX_OPS_NORM_BWD_ADD_DH_AHEAD 1 / 0 / 1 / 0, bwd and fwd_bwd at
# 32-256, bf16; float32 bwd) needs the build of run 3, the knob is not on main; addflax
# (add+norm fwd_bwd, auto / cuda / flax, 5 repeats); narrow
# (LayerNorm / RMSNorm fwd_bwd at 32-256 bf16 columns, auto / cuda / flax, 7 repeats);
# tests; sanitize (memcheck / synccheck / racecheck at narrow widths, every op);
# cmdbuf (benchmarks/grid_sums_cmdbuf.py: gradients bitwise equal with command buffers
# off, at jax's default and in forced graphs; within 1e-5 of the knob off's, whose
# second kernel adds in another order); workspace.
# Usage: bash benchmarks/gpu_issue20_s17.sh stages
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-gridsums,narrow}
source benchmarks/gpu_stages.sh
GS_COLS=${GS_COLS:-32,64,128,256,512}
export KNOB_TIMEOUT=${KNOB_TIMEOUT:-150}
if has gridsums; then
  knob_sweep gridsums_norms JAX_OPS_NORM_BWD_GRID_SUMS "0 1 0 1" --rows 49152 --op layer_norm,rms_norm \
    --mode bwd,fwd_bwd --cols "$GS_COLS"
  knob_sweep gridsums_add JAX_OPS_NORM_BWD_GRID_SUMS "0 1" --rows 49152 --op add_layer_norm,add_rms_norm \
    --mode bwd,fwd_bwd --cols "$GS_COLS"
  KNOB_DTYPE=f32 knob_sweep gridsums_f32 JAX_OPS_NORM_BWD_GRID_SUMS "0 1" --rows 49152 \
    --op layer_norm,rms_norm --mode fwd_bwd --cols 32,128,256
fi
# add+norm's backward with dh prefetched to L2 after the row's loads (group and block
# tiers; the bulk tier a row ahead), against the previous build (.carry/_ffi_old.so.gz),
# twice; LayerNorm's backward (unchanged kernels) as the control.
dh_ab_body() {
  echo "== build=$1"
  timeout 150 python3 -m jax_ops.bench --repeats 3 --dtype bf16 --rows 49152 --impl cuda \
    --op add_layer_norm,add_rms_norm --mode bwd --cols ${DH_COLS:-128,512,768,1024,2048}
  timeout 120 python3 -m jax_ops.bench --repeats 3 --dtype ${DH_F32_DTYPE:-f32} --rows 49152 --impl cuda \
    --op add_layer_norm,add_rms_norm --mode bwd --cols ${DH_F32_COLS:-256,1024,2048}
  timeout 100 python3 -m jax_ops.bench --repeats 3 --dtype bf16 --rows 49152 --impl cuda --op layer_norm \
    --mode bwd --cols 1024,2048
}
if has dhab; then
  ab_stage dhab1 dh_ab_body
  ab_stage dhab2 dh_ab_body
  python3 benchmarks/knob_summary.py "$OUT/dhab1.txt" "$OUT/dhab2.txt" | tee -a "$LOG"
fi
if has dhahead; then  # at one pack a lane: dh loaded with the row (1) or prefetched to L2 (0)
  knob_sweep dhahead JAX_OPS_NORM_BWD_ADD_DH_AHEAD "1 0 1 0" --rows 49152 --op add_layer_norm,add_rms_norm \
    --mode bwd,fwd_bwd --cols 32,64,128,256
  KNOB_DTYPE=f32 knob_sweep dhahead_f32 JAX_OPS_NORM_BWD_ADD_DH_AHEAD "1 0" --rows 49152 \
    --op add_layer_norm,add_rms_norm --mode bwd --cols 32,128
  python3 benchmarks/knob_summary.py "$OUT/dhahead.txt" "$OUT/dhahead_f32.txt" | tee -a "$LOG"
fi
if has addflax; then  # item 3: add + norm against flax's one-jit add + norm
  timeout 200 python3 -m jax_ops.bench --repeats 5 --dtype bf16 --rows 49152 --impl auto,cuda,flax \
    --op add_layer_norm,add_rms_norm --mode fwd_bwd --cols ${ADD_COLS:-128,512,1024,2048,8192} > "$OUT/addflax.txt" 2>&1
  grep -E "^== |^[a-z_]+ (fwd|bwd|fwd_bwd) [a-z0-9]+ rows" "$OUT/addflax.txt" | tee -a "$LOG"
  stage_done addflax
fi
if has narrow; then  # the narrow step, more repeats (the target: >= 0.85 of its 5X bound)
  timeout 120 python3 -m jax_ops.bench --repeats 7 --dtype bf16 --rows 49152 --impl auto,cuda,flax \
    --op layer_norm,rms_norm --mode fwd_bwd --cols 32,64,128,256 > "$OUT/narrow.txt" 2>&1
  grep -E "^[a-z_]+ (fwd|bwd|fwd_bwd|step) [a-z0-9]+ rows" "$OUT/narrow.txt" | tee -a "$LOG"
  stage_done narrow
fi
has tests && norm_tests
if has sanitize; then
  SAN_OPS=ln,rms,add_ln,add_rms norm_sanitize ${SAN_ROWS:-5001} ${SAN_COLS:-1,3,8,31,32,33,64,127,128,256,512,760} \
    ${RACE_COLS:-33,128,512}
fi
if has cmdbuf; then
  { for setting in off default forced knob0; do
      case $setting in
        off) flags="--xla_gpu_enable_command_buffer=" knob=1 ;;
        default) flags="" knob=1 ;;
        forced) flags="--xla_gpu_graph_min_graph_size=1" knob=1 ;;
        knob0) flags="--xla_gpu_graph_min_graph_size=1" knob=0 ;;
      esac
      echo "== $setting: XLA_FLAGS='$flags' JAX_OPS_NORM_BWD_GRID_SUMS=$knob"
      XLA_FLAGS="$flags" JAX_OPS_NORM_BWD_GRID_SUMS=$knob timeout 120 python3 benchmarks/grid_sums_cmdbuf.py \
        "/tmp/cmdbuf_$setting.npz" 2>&1 | grep -v Warning; echo "rc $?"
    done
    for setting in default forced; do
      python3 benchmarks/grid_sums_cmdbuf.py --compare /tmp/cmdbuf_off.npz "/tmp/cmdbuf_$setting.npz"
    done
    python3 benchmarks/grid_sums_cmdbuf.py --compare /tmp/cmdbuf_off.npz /tmp/cmdbuf_knob0.npz 1e-5; } > "$OUT/cmdbuf.txt" 2>&1
  grep -E "^==|rc |compare|Error" "$OUT/cmdbuf.txt" | tee -a "$LOG"
  stage_done cmdbuf
fi
has workspace && workspace_stage
finish_call "log|env|tests|narrow|gridsums_norms|gridsums_add|gridsums_f32|cmdbuf|dhab1|dhab2|dhahead|dhahead_f32|addflax"
exit 0
