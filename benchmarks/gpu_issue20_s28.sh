#!/usr/bin/env bash
# Device calls of the twenty-eighth session (issue 20). Stages:
# - dt: why the cuda LayerNorm forward runs bfloat16 slower than float16 on the H200 at
#   2048-8192 columns: benchmarks/norm_dtype_probe.py (each dtype on its own normal
#   values, on the other's bits, on constants), then ncu of the forward at 4096 in both;
# - abw: the warp-tier forward's rows as 32-bit words (bfloat16), the previous build
#   (.carry/_ffi_old.so.gz) against the carried one: fwd of the four ops at ABW_COLS in
#   bf16 (49152 rows), LayerNorm / add_layer_norm at 2048 / 4096 in f16 (unchanged code),
#   bwd of LayerNorm at 1024 / 2048 in both (does a bf16 gap remain there);
# - tables: the H200 table's entries (cuda / pallas / xla), merged into
#   jax_ops/tables/nvidia_h200.json, for each of TABLE_SPECS (DT:OPS:COLS, space
#   separated; the default: bf16, the four ops at the table's widths), its log to
#   tables_DT_N.txt;
# - item1w: auto / cuda / flax, fwd / fwd_bwd / step, the four ops in bf16 at 2048 /
#   3072 / 4096 (the widths the warp-tier change moved) and 32 / 256;
# - bulk: the backward at 1536-3584 columns (block-regs tier) against the bulk tier there
#   (knob JAX_OPS_NORM_BWD_BULK_MIN_COLS=1032), the four ops in bf16, LayerNorm / RMSNorm
#   in f16, 49152 rows: the H200's LayerNorm backward at 2048 ran at 73 % of its 3X copy;
# - san: memcheck / synccheck of the four ops in bfloat16 and float32 at 301 rows,
#   SAN_COLS (33,257,1032,2056,3000,4096), racecheck of LayerNorm at RACE_COLS (2056);
# - item1b: auto / cuda / flax after the bulk backward took 1025-4095 columns: fwd_bwd /
#   step of the four ops in bf16 at 1536 / 2048 / 3072, LayerNorm / RMSNorm in f16 at
#   2048 / 3072;
# - addf16: float16 add+norm's forward at 1536 / 2048 columns in the warp tier (default)
#   against the block tier (knob JAX_OPS_NORM_FWD_ADD_REGS_MAX_BYTES=2048), bf16 at 2048;
# - ws: item 4 at the widths the bulk backward took (WS_SHAPES), bf16 and f16;
# - tests: the norm tests (test_layer_norm, test_add_norm).
# Usage: bash benchmarks/gpu_issue20_s28.sh stages
set -uo pipefail
source benchmarks/gpu_extension.sh
STAGES=${1:-tests}
source benchmarks/gpu_stages.sh
if has dt; then
  timeout 240 python3 benchmarks/norm_dtype_probe.py > "$OUT/dtype_probe.txt" 2>&1
  grep -E "^cols" "$OUT/dtype_probe.txt" | tee -a "$LOG"; stage_done dtype_probe
  timeout 200 ncu --clock-control none -k regex:"fwd_(block_)?regs_kernel" -c 6 \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum,launch__registers_per_thread,launch__grid_size,launch__block_size,sm__warps_active.avg.pct_of_peak_sustained_active,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum,lts__t_sectors_srcunit_tex_op_read.sum \
    python3 benchmarks/norm_dtype_ncu.py > "$OUT/dtype_ncu.txt" 2>&1
  grep -E "fwd_(block_)?regs|duration|bytes|throughput|inst_executed|registers|grid_size|block_size|warps_active|sectors|done" "$OUT/dtype_ncu.txt" | head -120 | tee -a "$LOG"
  stage_done dtype_ncu
fi
abw_body() {
  echo "== build $1"
  timeout 150 python3 -m jax_ops.bench --repeats 3 --dtype bf16 --impl cuda --rows 49152 \
    --op layer_norm,rms_norm,add_layer_norm,add_rms_norm --mode fwd --cols ${ABW_COLS:-32,64,256,1024,2048,3072,4096}
  timeout 60 python3 -m jax_ops.bench --repeats 3 --dtype f16 --impl cuda --rows 49152 \
    --op layer_norm,add_layer_norm --mode fwd --cols 2048,4096
  for dt in bf16 f16; do
    timeout 60 python3 -m jax_ops.bench --repeats 3 --dtype $dt --impl cuda --rows 49152 \
      --op layer_norm --mode bwd --cols 1024,2048
  done
}
has abw && ab_stage abw abw_body
TABLE_SPECS=${TABLE_SPECS:-"bf16:layer_norm,rms_norm:32,64,128,256,512,768,1024,2048,4096,4352,8192,16384,20480,24576,32768 bf16:add_layer_norm,add_rms_norm:32,64,128,256,512,1024,2048,4096,8192,16384"}
has tables && table_specs "$TABLE_SPECS"
has item1w && SWEEP_TIMEOUT=300 sweep_stage sweep_item1_bf16 --dtype bf16 --rows 49152 \
  --op layer_norm,rms_norm,add_layer_norm,add_rms_norm --mode fwd,fwd_bwd,step --cols 32,256,2048,3072,4096
has bulk && cfg_sweep bulk "default BWD_BULK_MIN_COLS=1032" "bf16" --rows 49152 \
  --op layer_norm,rms_norm,add_layer_norm,add_rms_norm --mode bwd --cols 1536,2048,2560,3072,3584
has bulk && cfg_sweep bulk_f16 "default BWD_BULK_MIN_COLS=1032" "f16" --rows 49152 \
  --op layer_norm,rms_norm --mode bwd --cols 2048,3072
has san && DTYPES=float32,bfloat16 SAN_OPS=ln,rms,add_ln,add_rms RACE_OPS=ln norm_sanitize 301 \
  "${SAN_COLS:-33,257,1032,2056,3000,4096}" "${RACE_COLS:-2056}"
has item1b && SWEEP_TIMEOUT=200 sweep_stage sweep_item1b_bf16 --dtype bf16 --rows 49152 \
  --op layer_norm,rms_norm,add_layer_norm,add_rms_norm --mode fwd_bwd,step --cols 1536,2048,3072
has item1b && SWEEP_TIMEOUT=100 sweep_stage sweep_item1b_f16 --dtype f16 --rows 49152 \
  --op layer_norm,rms_norm --mode fwd_bwd,step --cols 2048,3072
has addf16 && cfg_sweep addf16 "default FWD_ADD_REGS_MAX_BYTES=2048" "f16" --rows 49152 \
  --op add_layer_norm,add_rms_norm --mode fwd --cols 1536,2048
has addf16 && cfg_sweep addbf16 "default FWD_ADD_REGS_MAX_BYTES=2048" "bf16" --rows 49152 \
  --op add_layer_norm,add_rms_norm --mode fwd --cols 2048
if has ws; then
  export WS_SHAPES=${WS_SHAPES:-49152x1536,49152x2048,49152x3072,8192x2048,8192x3072,2048x2048}
  WS_DTYPE=bfloat16 workspace_stage workspace_bf16
  WS_DTYPE=float16 workspace_stage workspace_f16
fi
has tests && norm_tests
finish_call "log|env|tests|dtype_probe|dtype_ncu|abw|tables_[a-z0-9]+_[0-9]+|env_tables|sanitize|bulk|bulk_f16|workspace_bf16|workspace_f16|addf16|addbf16"
