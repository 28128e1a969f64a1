source benchmarks/gpu_extension.sh > /dev/null; source benchmarks/gpu_stages.sh; STAGES=x
C="--rows 49152 --op layer_norm,rms_norm --mode bwd --cols 4352,4608,5120,6144"
JAX_OPS_NORM_BWD_CLUSTER_MIN_COLS=4096 KNOB_TIMEOUT=60 knob_sweep abcap JAX_OPS_NORM_BWD_CLUSTER_SMEM_MAX_PARTS "0 132 66 0" $C
JAX_OPS_NORM_BWD_CLUSTER_MIN_COLS=4096 JAX_OPS_NORM_BWD_CLUSTER_SMEM_MAX_PARTS=132 KNOB_TIMEOUT=60 knob_sweep abcapcs JAX_OPS_NORM_BWD_CLUSTER_SMEM_CS "3 2" $C
for dt in f16 bf16; do timeout 60 python3 -m jax_ops.bench --repeats 3 --impl cuda --dtype $dt --rows 49152 --op layer_norm,rms_norm --mode fwd,bwd --cols 20480; done > $OUT/f16fwd.txt 2>&1
grep "rows=" $OUT/f16fwd.txt
