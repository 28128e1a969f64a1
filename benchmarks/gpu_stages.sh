# Sourced by the device-call scripts after gpu_extension.sh, with STAGES set (a comma
# list): `has STAGE`, the log, the clock, and the stages several scripts share.
LOG="$OUT/log.txt"
t0=$SECONDS
# STAGES "h200:A|B": the stages A where the GPU is an H200, else B.
if [[ "${STAGES:-}" == h200:* ]]; then
  STAGES=${STAGES#h200:}
  if [[ $(nvidia-smi --query-gpu=name --format=csv,noheader) == *H200* ]]; then STAGES=${STAGES%%|*}; else STAGES=${STAGES#*|}; fi
fi
has() { [[ ",$STAGES," == *",$1,"* ]]; }
# The four norm ops, and the 16-bit tail kernels' widths (1 / 2 / 4 values a lane).
OPS4=layer_norm,rms_norm,add_layer_norm,add_rms_norm
TAIL_COLS=264,288,296,320,336,384
# has STAGE, and less than SKIP_AFTER s (default 400) of the call are gone. It only keeps
# a stage from starting late; set SKIP_AFTER so that the stages' own timeouts end inside
# the 600 s limit, or packing the results is lost.
starts() {
  has $1 || return 1
  [ $((SECONDS - t0)) -lt ${SKIP_AFTER:-400} ] && return 0
  echo "skipped $1: time" | tee -a "$LOG"; return 1
}
# "NAME: seconds since the start", to the log.
stage_done() { echo "$1: $((SECONDS - t0)) s" | tee -a "$LOG"; }
# The LayerNorm/RMSNorm and add+norm test files (or the pytest ARGS given), 8 workers, to
# $OUT/NAME.txt (TESTS_NAME, default tests): norm_tests [ARGS...]
norm_tests() {
  local files=("$@") name=${TESTS_NAME:-tests}
  [ ${#files[@]} -gt 0 ] || files=(tests/test_layer_norm.py tests/test_add_norm.py)
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -n 8 -p no:cacheprovider "${files[@]}" > "$OUT/$name.txt" 2>&1
  tail -2 "$OUT/$name.txt" | tee -a "$LOG"
  stage_done $name
}
# compute-sanitizer over benchmarks/sanitize_norm.py (ROWS rows; ops SAN_OPS, else OPS,
# else ln,rms): memcheck and synccheck (SAN_TOOLS) at COLS, racecheck (ops RACE_OPS, else the same)
# at RACE_COLS (none if empty; timeouts SAN_TIMEOUT, default 150 s a tool, and RACE_TIMEOUT,
# default 200), to $OUT/NAME.txt (SAN_NAME, default sanitize) and the
# log: norm_sanitize ROWS COLS RACE_COLS
norm_sanitize() {
  local rows=$1 cols=$2 race=$3 ops=${SAN_OPS:-${OPS:-ln,rms}} name=${SAN_NAME:-sanitize} tool
  { for tool in ${SAN_TOOLS:-memcheck synccheck}; do
      ROWS=$rows OPS=$ops timeout ${SAN_TIMEOUT:-150} compute-sanitizer --tool $tool --error-exitcode 9 \
        python3 benchmarks/sanitize_norm.py $cols 2>&1; echo "$tool rc $?"
    done
    if [ "$race" ]; then
      ROWS=$rows OPS=${RACE_OPS:-$ops} timeout ${RACE_TIMEOUT:-200} compute-sanitizer --tool racecheck --error-exitcode 9 \
        python3 benchmarks/sanitize_norm.py $race 2>&1; echo "racecheck rc $?"
    fi; } > "$OUT/$name.txt"
  grep -E "rc [0-9]|ERROR SUMMARY|MISMATCH|worst" "$OUT/$name.txt" | tee -a "$LOG"
  stage_done "$name"
}
# One cuda benchmark (dtype KNOB_DTYPE, default bf16; KNOB_TIMEOUT s, default 80) per value of a knob, to
# $OUT/NAME.txt and the log: knob_sweep NAME KNOB "VALUES" BENCH-ARGS...
knob_sweep() {
  local name=$1 knob=$2 values=$3 v
  shift 3
  for v in $values; do
    echo "== $knob=$v"
    env "$knob=$v" timeout ${KNOB_TIMEOUT:-80} python3 -m jax_ops.bench --repeats 3 --dtype ${KNOB_DTYPE:-bf16} --impl cuda "$@"
  done > "$OUT/$name.txt" 2>&1
  grep -E "^== |^[a-z_]+ (fwd|bwd|fwd_bwd|step) " "$OUT/$name.txt" | tee -a "$LOG"
  stage_done "$name"
}
# The workspace of a lone op's jitted vjp against flax (benchmarks/norm_workspace.py), to
# $OUT/NAME.txt (default workspace) and the log; dtype WS_DTYPE (default bfloat16).
workspace_stage() {
  local name=${1:-workspace}
  timeout 150 python3 benchmarks/norm_workspace.py --dtype ${WS_DTYPE:-bfloat16} --json "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
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
# The item-1 sweep of one dtype, one op a benchmark process (a timeout loses one op, not
# the stage): SWEEP_OPS (space separated, default LayerNorm and RMSNorm), modes
# SWEEP_MODES, SWEEP_COLS at 49152 rows, then 65536 columns at 8192 rows where SWEEP_65536
# is 1 (the default). Each op starts only before STOP_AFTER s of the call and gets at most
# what is left of CALL_SECONDS (so that packing the results fits): sweep_dtype DT
sweep_dtype() {
  local dt=$1 op left
  for op in ${SWEEP_OPS:-layer_norm rms_norm}; do
    if [ $((SECONDS - t0)) -gt ${STOP_AFTER:-450} ]; then echo "skipped sweep $op $dt: time" | tee -a "$LOG"; continue; fi
    left=$((${CALL_SECONDS:-570} - (SECONDS - t0)))
    SWEEP_TIMEOUT=$((left < 240 ? left : 240)) sweep_stage sweep_${op}_$dt --dtype $dt --rows 49152 --op $op \
      --mode ${SWEEP_MODES:-fwd,bwd,fwd_bwd} --cols ${SWEEP_COLS:-32,64,128,256,512,1024,2048,4096,8192,16384,32768}
    left=$((${CALL_SECONDS:-570} - (SECONDS - t0)))
    [ "${SWEEP_65536:-1}" = 1 ] && [ $left -gt 20 ] && SWEEP_TIMEOUT=$((left < 120 ? left : 120)) \
      sweep_stage sweep_${op}_${dt}_65536 --dtype $dt --rows 8192 --op $op --mode ${SWEEP_MODES:-fwd,bwd,fwd_bwd} --cols 65536
  done
}
# sweep_dtype's fwd_bwd sweeps, no 65536 columns, implementations IMPLS, ops OPS (space
# separated), for each "DT:COLS" of SPECS (space separated): fwd_bwd_sweeps IMPLS OPS SPECS
fwd_bwd_sweeps() {
  local spec
  for spec in $3; do
    SWEEP_IMPLS=$1 SWEEP_OPS="$2" SWEEP_MODES=fwd_bwd SWEEP_COLS=${spec#*:} SWEEP_65536=0 sweep_dtype ${spec%%:*}
  done
}
# Each cuda kernel of a bf16 training step of the four ops next to a copy of its own bytes
# (benchmarks/norm_bounds.py kernels: the most a three-kernel step can reach) at COLS, to
# $OUT/bounds.txt and the log: bounds_stage COLS
bounds_stage() {
  timeout ${BOUND_TIMEOUT:-300} python3 benchmarks/norm_bounds.py kernels $OPS4 $1 > "$OUT/bounds.txt" 2>&1
  grep -E "^[a-z_]+ [0-9]+ \|" "$OUT/bounds.txt" | tee -a "$LOG"
  stage_done bounds
}
# The auto / best summary of the sweep JSONs in $OUT (benchmarks/auto_vs_best.py), then,
# as at most 8 files come back, everything but the named .txt files ("log|env|...") and
# the table JSON in one archive, extra.tgz: finish_call NAMES
finish_call() {
  if compgen -G "$OUT/sweep_*.json" > /dev/null; then
    python3 benchmarks/auto_vs_best.py "$OUT"/sweep_*.json > "$OUT/auto_vs_best.txt" 2>&1
    grep -E "MISS|lowest|fastest|point\(s\)" "$OUT/auto_vs_best.txt" | tee -a "$LOG"
  fi
  (cd "$OUT" && ls | grep -v -E "^($1)\.txt\$|^nvidia_.*\.json\$" > /tmp/pack.lst
   [ -s /tmp/pack.lst ] && tar czf extra.tgz -T /tmp/pack.lst && xargs rm -f < /tmp/pack.lst; ls)
}
# The dispatch table's DT entries of OPS at COLS re-measured (gpu_tables.sh: cuda / pallas
# / xla, fwd / bwd / step, an op a process within OP_TIMEOUT s, default 240), merged into
# this tree's H100 table so that later stages use them, the table copied to $OUT. The
# per-op JSONs become table_sweep_OP_DT.json: not auto sweeps for finish_call's summary,
# nor overwritten by a sweep stage's of the same op and dtype: table_stage DT OPS COLS
table_stage() {
  local op
  cp "$OUT/env.txt" "$OUT/env_main.txt"
  OP_TIMEOUT=${OP_TIMEOUT:-240} bash benchmarks/gpu_tables.sh "$1" "$2" "$3" > "$OUT/tables.txt" 2>&1
  mv "$OUT/env.txt" "$OUT/env_tables.txt"; mv "$OUT/env_main.txt" "$OUT/env.txt"
  grep -E "rc [0-9]+ in" "$OUT/env_tables.txt" | tee -a "$LOG"
  for op in ${2//,/ }; do
    [ -f "$OUT/sweep_${op}_$1.json" ] && mv "$OUT/sweep_${op}_$1.json" "$OUT/table_sweep_${op}_$1.json"
  done
  stage_done "tables_$1"
}
# table_stage for each DT:OPS:COLS of SPECS (space separated) into this GPU's table
# (jax_ops/tables/<name, lower case, spaces as _>.json, e.g. nvidia_h200.json), each one's
# log to $OUT/tables_DT_N.txt: table_specs "SPECS"
table_specs() {
  local n=0 spec dt ops cols table
  table=jax_ops/tables/$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z ' 'a-z_').json
  for spec in $1; do
    IFS=: read -r dt ops cols <<< "$spec"
    n=$((n + 1))
    TABLE=$table table_stage $dt $ops $cols
    mv "$OUT/tables.txt" "$OUT/tables_${dt}_$n.txt"
  done
}
# envs=(...): the environment assignments of a configuration CFG (a comma list of
# name=value, each name without PREFIX; "default" for none): knob_envs PREFIX CFG
knob_envs() {
  local kv
  envs=(X=0)
  [ "$2" = default ] || for kv in ${2//,/ }; do envs+=("$1$kv"); done
}
# One cuda benchmark a configuration (a comma list of knob=value, each knob name without
# its JAX_OPS_NORM_ prefix; "default" for none) and dtype, to $OUT/NAME.txt and the log:
# cfg_sweep NAME "CFGS" "DTYPES" BENCH-ARGS...
cfg_sweep() {
  local name=$1 cfgs=$2 dtypes=$3 cfg dt
  shift 3
  for cfg in $cfgs; do
    knob_envs JAX_OPS_NORM_ "$cfg"
    echo "== $cfg"
    for dt in $dtypes; do
      env "${envs[@]}" timeout 120 python3 -m jax_ops.bench --repeats 3 --dtype $dt --impl cuda "$@"
    done
  done > "$OUT/$name.txt" 2>&1
  grep -E "^== |^[a-z_]+ (fwd|bwd|fwd_bwd) " "$OUT/$name.txt" | tee -a "$LOG"
  stage_done "$name"
}
# ncu's metrics M (a comma list, set by the caller) of one launch of the kernels matching
# KERNEL-REGEX after SKIP others, in python3 SCRIPT ARGS (env as set by the caller); the
# metric lines to stdout: ncu_case NAME KERNEL-REGEX SKIP SCRIPT ARGS...
ncu_case() {
  echo "#### $1"
  timeout 120 ncu --kernel-name regex:$2 --launch-skip $3 --launch-count 1 --metrics $M python3 "${@:4}" 2>&1 |
    grep -E "inst_exec|registers|warps_active|duration|dram__|issue_active|stalled|grid_size|l1tex|lts__|ERR|rror"
}
