#!/usr/bin/env bash
# One call on the GPU machine: environment, extension check (build there if the carried
# one does not load), tests, sanitizers, benchmarks. Logs go to $OUT/logs, packed into
# $OUT/session.tgz at the end (the device tool returns at most 8 files).
# Usage: bash benchmarks/gpu_session.sh [steps...]; steps below.
set -uo pipefail
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/jax_ops_out}; L=$OUT/logs; mkdir -p "$L"
steps=${*:-env check tests bench-ln bench-rms sanitize}
# .carry/COMMIT: the source commit this run tests (the extension may be from an older
# commit with the same C++/CUDA sources: .carry/BUILD_COMMIT)
commit=$(cat .carry/COMMIT 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)
export JAX_OPS_COMMIT=$commit  # recorded by the benchmark's JSON
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
slug=$(echo "$gpu" | tr 'A-Z' 'a-z' | sed -E 's/[^a-z0-9]+/_/g; s/^_|_$//g')
table=jax_ops/tables/$slug.json

{ date -u +%FT%TZ; echo "commit $commit"; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv; } | tee "$L/env.txt"
[ -f .carry/_ffi.so ] && cp .carry/_ffi.so jax_ops/_ffi.cpython-312-x86_64-linux-gnu.so
if ! python3 -c "import jax_ops, sys; sys.exit(0 if jax_ops.with_cuda() else 1)"; then
  echo "carried extension unusable: building here"
  cmake -S . -B build/gpu -G Ninja -DPython_EXECUTABLE="$(command -v python3)" -DJAX_OPS_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 >/dev/null &&
    cmake --build build/gpu -j 16 | tail -3 && cp build/gpu/_ffi*.so jax_ops/
fi
python3 -c "import jax, jax_ops; print('jax', jax.__version__, jax.devices(), 'with_cuda', jax_ops.with_cuda())" | tee -a "$L/env.txt"

bench() {  # bench <name> <ops> <args...>: jax_ops.bench per op, fwd/fwd_bwd/bwd
  local name=$1 ops=$2; shift 2
  for op in ${ops//,/ }; do
    python3 -m jax_ops.bench --op $op --mode fwd,fwd_bwd,bwd --impl cuda,pallas,xla,auto,flax \
      --json "$L/${name}_$op.json" "$@" 2>&1 | tee "$L/${name}_$op.txt" | grep -v "^check\|K=" | tail -60
  done
}
NORMS=layer_norm,rms_norm
SOFTMAX=${SOFTMAX_OPS:-softmax,log_softmax}

for step in $steps; do
  t0=$SECONDS
  case $step in
    tests) python3 -m pytest tests -q -n 4 -p no:cacheprovider 2>&1 | tee "$L/tests.txt" | tail -15 ;;
    # Some test files only: TESTS="tests/test_softmax.py ..."
    tests-some) python3 -m pytest ${TESTS:-tests/test_softmax.py} -q -n 8 -p no:cacheprovider 2>&1 | tee -a "$L/tests_some.txt" | tail -8 ;;
    check) python3 benchmarks/sanitize_norm.py 2>&1 | tail -20 | tee "$L/check.txt"
           IMPL=pallas python3 benchmarks/sanitize_norm.py 2>&1 | tail -20 | tee -a "$L/check.txt" ;;
    # Under the sanitizers XLA's compiles crawl: a few shapes, one per kernel tier.
    sanitize) timeout 200 compute-sanitizer --tool memcheck --print-limit 20 python3 benchmarks/sanitize_norm.py 3,33,1025,5000,40000 2>&1 | tail -8 | tee "$L/memcheck.txt" ;;
    sanitize-pallas) IMPL=pallas timeout 200 compute-sanitizer --tool memcheck --print-limit 20 python3 benchmarks/sanitize_norm.py 3,33,1025,5000,20000 2>&1 | tail -8 | tee "$L/memcheck_pallas.txt" ;;
    racecheck) timeout 150 compute-sanitizer --tool racecheck --print-limit 20 python3 benchmarks/sanitize_norm.py 5000,40000 2>&1 | tail -8 | tee "$L/racecheck.txt" ;;
    backends) python3 benchmarks/pallas_backends.py 2>&1 | tee "$L/pallas_backends.txt" ;;
    # Writes the dispatch table of this GPU (the auto column of this run still uses the old one).
    table) bench table $NORMS --impl cuda,pallas,xla --max-sets 48 --table "$table" --check; cp "$table" "$L/" ;;
    table-softmax) bench table $SOFTMAX --impl cuda,pallas,xla,auto,flax --max-sets 48 --table "$table" --check; cp "$table" "$L/" ;;
    # Measures again: auto now reads the table just written.
    verify) bench verify $NORMS --impl cuda,pallas,xla,auto --max-sets 48 ;;
    verify-softmax) bench verify $SOFTMAX --impl cuda,pallas,xla,auto --max-sets 48 ;;
    # Masked and causal softmax next to the plain one (target: masked <= 1.15x unmasked).
    bench-masked) python3 -m jax_ops.bench --op softmax,softmax_mask,softmax_causal --mode fwd,fwd_bwd --cols ${MASKED_COLS:-128,1024,4096,16384,32768} \
        --impl cuda,pallas,xla --max-sets 48 --json "$L/masked.json" 2>&1 | tee "$L/masked.txt" | grep -v "^check\|K=" | tail -80 ;;
    check-softmax) python3 benchmarks/sanitize_softmax.py 2>&1 | tail -20 | tee "$L/check_softmax.txt"
           IMPL=pallas python3 benchmarks/sanitize_softmax.py 2>&1 | tail -20 | tee -a "$L/check_softmax.txt" ;;
    sanitize-softmax) timeout ${SAN_TIMEOUT:-240} compute-sanitizer --tool memcheck --print-limit 20 python3 benchmarks/sanitize_softmax.py ${SAN_COLS:-3,33,1025,5000,20000,40000} 2>&1 | tail -8 | tee "$L/memcheck_softmax.txt" ;;
    # One tier a step, bf16, plain and bool mask (the whole script outlasts 200 s under racecheck)
    racecheck-softmax-quick) for c in ${RACE_COLS:-5000 40000}; do QUICK=1 timeout ${RACE_TIMEOUT:-150} compute-sanitizer --tool racecheck --print-limit 20 python3 benchmarks/sanitize_softmax.py $c 2>&1 | tail -4 | tee -a "$L/racecheck_softmax.txt"; done ;;
    racecheck-softmax) timeout 200 compute-sanitizer --tool racecheck --print-limit 20 python3 benchmarks/sanitize_softmax.py 5000,40000 2>&1 | tail -8 | tee "$L/racecheck_softmax.txt" ;;
    autotune-quick) python3 benchmarks/autotune_check.py --skip-bench 2>&1 | tee "$L/autotune.txt" | grep -v "^  \|jax_ops.autotune \[" | tail -60 ;;
    autotune) python3 benchmarks/autotune_check.py 2>&1 | tee "$L/autotune.txt" | tail -40 ;;
    bench-ln) python3 -m jax_ops.bench --op layer_norm --mode fwd,fwd_bwd,bwd --check --json "$L/layer_norm.json" 2>&1 | tee "$L/layer_norm.txt" ;;
    bench-rms) python3 -m jax_ops.bench --op rms_norm --mode fwd,fwd_bwd,bwd --check --json "$L/rms_norm.json" 2>&1 | tee "$L/rms_norm.txt" ;;
    # ReLU family and BatchNorm fusions (issue 5)
    check-relu-bn) python3 benchmarks/sanitize_relu_bn.py 2>&1 | tail -20 | tee "$L/check_relu_bn.txt"
           IMPL=pallas python3 benchmarks/sanitize_relu_bn.py 2>&1 | tail -20 | tee -a "$L/check_relu_bn.txt" ;;
    sanitize-relu-bn) timeout 240 compute-sanitizer --tool memcheck --print-limit 20 python3 benchmarks/sanitize_relu_bn.py 1,33,4099,65537 1,33,2048 2>&1 | tail -8 | tee "$L/memcheck_relu_bn.txt" ;;
    racecheck-relu-bn) timeout 200 compute-sanitizer --tool racecheck --print-limit 20 python3 benchmarks/sanitize_relu_bn.py 4099 33,256 2>&1 | tail -8 | tee "$L/racecheck_relu_bn.txt" ;;
    # relu/add_relu at 100-400 MB bf16 tensors; BatchNorm at the issue's ResNet shapes
    bench-relu) python3 -m jax_ops.bench --op relu,add_relu --rows 49152 --cols ${RELU_COLS:-1024,4096} --dtype ${RELU_DTYPE:-bf16} \
        --mode ${RELU_MODES:-fwd,fwd_bwd,bwd} --impl cuda,pallas,xla,auto,jnp --max-sets 48 --check --table "$table" --json "$L/relu${RELU_TAG:-}.json" 2>&1 | tee "$L/relu${RELU_TAG:-}.txt" | grep -v "K=" | tail -60; cp "$table" "$L/" ;;
    bench-bn) for dt in ${BN_DTYPES:-f32 bf16}; do for shape in ${BN_SHAPES:-200704:32 401408:256}; do
        python3 -m jax_ops.bench --op batch_norm_relu,batch_norm_add_relu --rows ${shape%%:*} --cols ${shape##*:} --dtype $dt \
          --mode ${BN_MODES:-fwd,fwd_bwd,bwd} --impl cuda,pallas,xla,auto,flax --max-sets 8 --check --table "$table" --json "$L/bn${BN_TAG:-}_${dt}_${shape%%:*}.json" 2>&1 | tee "$L/bn${BN_TAG:-}_${dt}_${shape%%:*}.txt" | grep -v "K=" | tail -40
        done; done; cp "$table" "$L/" ;;
    memory-relu-bn) python3 benchmarks/memory_relu_bn.py 2>&1 | tee "$L/memory.txt" ;;
    # Flax layers and examples (issue 6): the layer tests on the GPU, then train-step times
    tests-nn) python3 -m pytest tests/test_nn.py tests/test_examples.py -q -n 4 -p no:cacheprovider 2>&1 | tee "$L/tests_nn.txt" | tail -15 ;;
    step-time) python3 benchmarks/step_time.py --out "$L/step_time.json" ${STEP_ARGS:-} 2>&1 | tee "$L/step_time.txt" | tail -40 ;;
    # Issue 7 on several GPUs: batch- and hidden-sharded ops vs one GPU; export on the GPU
    sharding-gpu) python3 benchmarks/sharding_gpu.py --out "$L/sharding.json" 2>&1 | tee "$L/sharding.txt" | tail -20 ;;
    tests-export) python3 -m pytest tests/test_export.py -q -p no:cacheprovider 2>&1 | tee "$L/tests_export.txt" | tail -5 ;;
    # Per-kernel CUPTI times: BREAKDOWN="op:dtype:rows:cols ..." (IMPLS: implementations)
    breakdown) for spec in ${BREAKDOWN:-batch_norm_relu:f32:200704:32}; do IFS=: read -r op dt r c <<< "$spec"
        python3 benchmarks/kernel_breakdown.py $op $dt $r $c ${IMPLS:-cuda pallas xla flax} 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tee -a "$L/breakdown.txt"
        done ;;
    env) ;;
    *) echo "unknown step $step" ;;
  esac
  echo "step $step: $((SECONDS - t0)) s" | tee -a "$L/env.txt"
done
tar czf "$OUT/session.tgz" -C "$OUT" logs && rm -rf "$L"
