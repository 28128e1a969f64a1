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
