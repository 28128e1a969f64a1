# Sourced by the device-call scripts after gpu_extension.sh, with STAGES set (a comma
# list): `has STAGE`, the log, the clock, and the stages several scripts share.
LOG="$OUT/log.txt"
t0=$SECONDS
has() { [[ ",$STAGES," == *",$1,"* ]]; }
# "NAME: seconds since the start", to the log.
stage_done() { echo "$1: $((SECONDS - t0)) s" | tee -a "$LOG"; }
# The LayerNorm/RMSNorm and add+norm test files, 8 workers.
norm_tests() {
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_layer_norm.py \
    tests/test_add_norm.py > "$OUT/tests.txt" 2>&1
  tail -2 "$OUT/tests.txt" | tee -a "$LOG"
  stage_done tests
}
# One cuda benchmark (dtype KNOB_DTYPE, default bf16) per value of a knob, to
# $OUT/NAME.txt and the log: knob_sweep NAME KNOB "VALUES" BENCH-ARGS...
knob_sweep() {
  local name=$1 knob=$2 values=$3 v
  shift 3
  for v in $values; do
    echo "== $knob=$v"
    env "$knob=$v" timeout 80 python3 -m jax_ops.bench --repeats 3 --dtype ${KNOB_DTYPE:-bf16} --impl cuda "$@"
  done > "$OUT/$name.txt" 2>&1
  grep -E "^== |^[a-z_]+ (fwd|bwd|fwd_bwd|step) " "$OUT/$name.txt" | tee -a "$LOG"
  stage_done "$name"
}
# The workspace of a lone op's jitted vjp against flax (benchmarks/norm_workspace.py), to
# $OUT/NAME.txt (default workspace) and the log.
workspace_stage() {
  local name=${1:-workspace}
  timeout 150 python3 benchmarks/norm_workspace.py --json "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
  grep -v Warning "$OUT/$name.txt" | tee -a "$LOG"
  stage_done "$name"
}
# Runs the function named BODY once with the previous build (.carry/_ffi_old.so.gz) in
# place and once with the carried one, the build's name ("old", "new") as its argument,
# the output to $OUT/NAME.txt; the carried build is left in place: ab_builds NAME BODY
ab_builds() {
  local name=$1 body=$2 so build
  so=$(ls jax_ops/_ffi*.so); cp "$so" /tmp/ffi_new.so
  for build in old new; do
    if [ $build = old ]; then gunzip -c .carry/_ffi_old.so.gz > "$so"; else cp /tmp/ffi_new.so "$so"; fi
    $body $build
  done > "$OUT/$name.txt" 2>&1
  cp /tmp/ffi_new.so "$so"
}
# ab_builds into $OUT/NAME.txt, its timing lines to the log: ab_stage NAME BODY
ab_stage() {
  [ -f .carry/_ffi_old.so.gz ] || return 0
  ab_builds "$1" "$2"
  grep -E "^== |^[a-z_]+ (fwd|bwd|step|fwd_bwd) " "$OUT/$1.txt" | tee -a "$LOG"
  stage_done "$1"
}
# The benchmark CLI's sweep (auto / cuda / flax unless SWEEP_IMPLS) to $OUT/NAME.{txt,json}, its timing
# lines to the log: sweep_stage NAME BENCH-ARGS...
sweep_stage() {
  local name=$1
  shift
  timeout ${SWEEP_TIMEOUT:-300} python3 -m jax_ops.bench --repeats 3 --impl ${SWEEP_IMPLS:-auto,cuda,flax} "$@" \
    --json "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
  grep -E "^[a-z_]+ (fwd|bwd|fwd_bwd|step) [a-z0-9]+ rows" "$OUT/$name.txt" | tee -a "$LOG"
  stage_done "$name"
}
