#!/usr/bin/env bash
# One device call at the end of a session: the norm tests + memcheck (gpu_step.sh tests),
# a bf16 fwd/bwd/step sweep of the norms merged into the H100 table (copied to $OUT), and
# the real-model steps (GPT-2 train, ResNet-50 train and inference). Usage: bash
# benchmarks/gpu_final.sh (extension: .carry/_ffi.so.gz, see gpu_extension.sh).
bash benchmarks/gpu_step.sh tests 2>&1 | grep -E "passed|failed|memcheck"
source benchmarks/gpu_extension.sh > /dev/null
timeout 150 python3 -m jax_ops.bench --repeats 3 --op layer_norm,rms_norm,add_layer_norm --dtype bf16 --impl cuda,flax --mode fwd,bwd,step --cols 4096,8192,16384,32768 --table jax_ops/tables/nvidia_h100_80gb_hbm3.json --json $OUT/sweep_fwd_two_pass.json > $OUT/sweep_fwd_two_pass.txt 2>&1
cp jax_ops/tables/nvidia_h100_80gb_hbm3.json $OUT/
grep -E "^[a-z_]+ (fwd|step) bf16" $OUT/sweep_fwd_two_pass.txt
bash benchmarks/gpu_models.sh --models gpt2 resnet50 2>&1 | grep -E "ms/step|speedup|models:"
