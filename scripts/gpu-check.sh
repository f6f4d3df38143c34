#!/usr/bin/env bash
# gpu-check.sh: on a machine with an NVIDIA GPU, run kiln's GPU tests and benchmarks and print a
# short table. Run it from (or point KILN_BIN_DIR at) a folder holding the built binaries
# (kiln, kiln_cuda_tests, kiln_cuda_bench).
#
#   gpu-check.sh                      everything available
#   gpu-check.sh --tests              GPU tests only (kiln_cuda_tests)
#   gpu-check.sh --ops-bench          kernel micro-benchmarks (kiln_cuda_bench; KILN_OPS_SECTIONS
#                                     picks sections: launch decode decode-shapes decode-ops prefill attention)
#   gpu-check.sh --model-bench DIR    `kiln bench --device cuda` on checkpoint DIR (repeatable)
#   gpu-check.sh --synth-bench SHAPE  `kiln synth --shape SHAPE` (bf16, into $KILN_SYNTH_DIR, default
#                                     /tmp/kiln-synth; SHAPE:N keeps N layers), then benches it
#   gpu-check.sh --gtest-filter PAT   passes a filter to the GPU tests
# KILN_BENCH_FLAGS adds flags to every `kiln bench` (e.g. "--batch 1,8 --decode-context 512").
# Logs go to $KILN_LOG_DIR (default ./gpu-check-logs).
set -uo pipefail

bin_dir=${KILN_BIN_DIR:-$(cd "$(dirname "$0")" && pwd)}
log_dir=${KILN_LOG_DIR:-./gpu-check-logs}
mkdir -p "$log_dir"

run_tests=0 run_ops=0 filter="*" models=() synths=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tests) run_tests=1 ;;
    --ops-bench) run_ops=1 ;;
    --model-bench) shift; models+=("$1") ;;
    --synth-bench) shift; synths+=("$1") ;;
    --gtest-filter) shift; filter=$1 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "gpu-check.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
if [ $run_tests = 0 ] && [ $run_ops = 0 ] && [ ${#models[@]} = 0 ] && [ ${#synths[@]} = 0 ]; then run_tests=1 run_ops=1; fi

summary=()
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader \
  | tee "$log_dir/device.txt" || echo "nvidia-smi unavailable"

if [ $run_tests = 1 ]; then
  "$bin_dir/kiln_cuda_tests" --gtest_brief=1 --gtest_filter="$filter" 2>&1 | tee "$log_dir/tests.log"
  rc=${PIPESTATUS[0]}
  passed=$(grep -o '\[  PASSED  \] [0-9]*' "$log_dir/tests.log" | grep -o '[0-9]*$' || true)
  failed=$(grep -c '^\[  FAILED  \] [A-Za-z]' "$log_dir/tests.log" || true)
  skipped=$(grep -o '\[  SKIPPED \] [0-9]*' "$log_dir/tests.log" | grep -o '[0-9]*$' || true)
  summary+=("gpu tests: passed ${passed:-0}, failed ${failed:-0}, skipped ${skipped:-0} (exit $rc)")
  [ "$rc" = 0 ] || status=1
fi

if [ $run_ops = 1 ]; then
  # shellcheck disable=SC2086  # the sections are separate words
  "$bin_dir/kiln_cuda_bench" ${KILN_OPS_SECTIONS:-} 2>&1 | tee "$log_dir/ops-bench.log"
  rc=${PIPESTATUS[0]}
  summary+=("ops bench: exit $rc (table in $log_dir/ops-bench.log)")
  [ "$rc" = 0 ] || status=1
fi

bench_model() {  # bench_model DIR: `kiln bench --device cuda` on DIR, logged as bench-NAME.log
  local name rc
  name=$(basename "$1")
  # shellcheck disable=SC2086  # extra bench flags are separate words
  "$bin_dir/kiln" bench --model "$1" --device cuda ${KILN_BENCH_FLAGS:-} 2>&1 | tee "$log_dir/bench-$name.log"
  rc=${PIPESTATUS[0]}
  summary+=("model bench $name: exit $rc")
  benched+=("$name")
  [ "$rc" = 0 ] || status=1
}

benched=()
for model in "${models[@]}"; do bench_model "$model"; done

# One synthetic checkpoint at a time (written, benched, removed): the full-size shapes together
# would not fit on the GPU machine's disk.
for synth in "${synths[@]}"; do
  shape=${synth%%:*}
  layers=()
  [ "$shape" != "$synth" ] && layers=(--layers "${synth#*:}")
  out="${KILN_SYNTH_DIR:-/tmp/kiln-synth}/${synth/:/-}"
  rm -rf "$out"
  if "$bin_dir/kiln" synth --shape "$shape" "${layers[@]}" --out "$out" > "$log_dir/synth-${synth/:/-}.log" 2>&1; then
    bench_model "$out"
  else
    summary+=("synth $synth: failed (see $log_dir/synth-${synth/:/-}.log)")
    status=1
  fi
  rm -rf "$out"
done

echo
echo "=== gpu-check summary ==="
printf '%s\n' "${summary[@]}"
for name in "${benched[@]}"; do grep -E '^(model|prefill|decode)' "$log_dir/bench-$name.log"; done
[ $run_ops = 1 ] && grep -E '^(device-to-device|per-op|decode|prefill)' "$log_dir/ops-bench.log"
exit $status
