#!/usr/bin/env bash
# Runs every libFuzzer target (fuzz/<name>_fuzz.cpp) at once for DURATION_SECONDS or 10 million
# executions each, whichever comes first, and prints one row per target: executions, coverage
# (libFuzzer's cov and ft), corpus size and the crashing inputs it saved. Exits 1 when any target
# crashed, leaked, hung or ran out of memory.
#
# Usage: scripts/fuzz-long.sh DURATION_SECONDS [JOBS [BINARY_DIR [CORPUS_DIR]]]
#   JOBS        fuzzing processes in all (default: the number of cores), shared out between the
#               targets; each target gets at least one
#   BINARY_DIR  the *_fuzz executables (default build-asan); they need nothing else at run time
#   CORPUS_DIR  where each target's corpus grows (CORPUS_DIR/<name>) and its crashing inputs are
#               saved (CORPUS_DIR/crashes/<name>/); kept between runs (default fuzz-long-corpus)
# The seed corpora (fuzz/corpus/<name>) and dictionaries (fuzz/dict) are read from this checkout;
# seeds are copied into CORPUS_DIR, which is the only place anything is written.
set -euo pipefail

if [ $# -lt 1 ] || ! [[ $1 =~ ^[0-9]+$ ]]; then
  sed -n '7,14p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
duration=$1
jobs=${2:-$(nproc)}
binary_dir=$(realpath "${3:-build-asan}")
corpus_dir=$(realpath -m "${4:-fuzz-long-corpus}")
fuzz_dir=$(realpath "$(dirname "$0")/../fuzz")
max_executions=10000000
# An input slower than this, or a process above this memory, is a finding (a hang, an allocation
# bomb), not something to wait for.
input_timeout_s=10
rss_limit_mb=2048

mapfile -t binaries < <(find "$binary_dir" -maxdepth 1 -name '*_fuzz' -type f -perm -u+x | sort)
if ((${#binaries[@]} == 0)); then
  echo "fuzz-long: no *_fuzz executables in $binary_dir (build with -DKILN_FUZZ=ON)" >&2
  exit 2
fi
# FUZZ_EXCLUDE names targets not to run (space-separated), for findings that are known and open.
for excluded in ${FUZZ_EXCLUDE:-}; do
  mapfile -t binaries < <(printf '%s\n' "${binaries[@]}" | grep -v "/${excluded}_fuzz$")
  echo "fuzz-long: not running ${excluded}_fuzz (FUZZ_EXCLUDE)" >&2
done
targets=${#binaries[@]}
mkdir -p "$corpus_dir"

# The dictionary of a target: Jinja tokens for templates, regex and GBNF syntax for grammar texts,
# none for raw HTTP, JSON keys otherwise.
dictionary_of() {
  case $1 in
    jinja) echo "$fuzz_dir/dict/jinja.dict" ;;
    grammar_text) echo "$fuzz_dir/dict/grammar.dict" ;;
    http_request) ;;
    *) echo "$fuzz_dir/dict/json.dict" ;;
  esac
}

# One worker: runs the target until the deadline or its share of executions, starting it again
# after each crash (libFuzzer stops at the first) so one finding does not end the run.
run_worker() {
  local binary=$1 name=$2 worker=$3 quota=$4 deadline=$5
  local corpus=$corpus_dir/$name crashes=$corpus_dir/crashes/$name/ log_dir=$corpus_dir/logs/$name
  local dictionary executed=0 round=0
  dictionary=$(dictionary_of "$name")
  mkdir -p "$crashes" "$log_dir"
  while true; do
    local now remaining_s remaining_runs log
    now=$(date +%s)
    remaining_s=$((deadline - now))
    remaining_runs=$((quota - executed))
    ((remaining_s > 0 && remaining_runs > 0)) || break
    log=$log_dir/worker$worker.$round.log
    "$binary" "$corpus" ${dictionary:+-dict="$dictionary"} -max_total_time="$remaining_s" -runs="$remaining_runs" \
      -timeout="$input_timeout_s" -rss_limit_mb="$rss_limit_mb" -artifact_prefix="$crashes" \
      -print_final_stats=1 -close_fd_mask=1 > "$log" 2>&1 || true
    local ran
    ran=$(grep -ao 'stat::number_of_executed_units: [0-9]*' "$log" | tail -1 | awk '{print $2}')
    [ -n "$ran" ] || ran=$(grep -ao '^#[0-9]*' "$log" | tail -1 | tr -d '#')
    executed=$((executed + ${ran:-0}))
    round=$((round + 1))
    # A run that ended without executing anything (it cannot start) would spin here.
    ((${ran:-0} > 0)) || break
  done
  echo "$executed" > "$log_dir/worker$worker.executed"
}

deadline=$(($(date +%s) + duration))
pids=()
for index in "${!binaries[@]}"; do
  binary=${binaries[$index]}
  name=$(basename "$binary" _fuzz)
  mkdir -p "$corpus_dir/$name"
  [ -d "$fuzz_dir/corpus/$name" ] && cp -n "$fuzz_dir/corpus/$name"/* "$corpus_dir/$name"/ 2>/dev/null || true
  rm -rf "$corpus_dir/logs/$name"
  mkdir -p "$corpus_dir/logs/$name"
  touch "$corpus_dir/logs/$name/started"  # crashing inputs newer than this are this run's
  workers=$((jobs / targets + (index < jobs % targets ? 1 : 0)))
  ((workers > 0)) || workers=1
  for ((worker = 0; worker < workers; ++worker)); do
    run_worker "$binary" "$name" "$worker" $((max_executions / workers)) "$deadline" &
    pids+=($!)
  done
done
wait "${pids[@]}"

status=0
printf '%-20s %12s %8s %8s %8s  %s\n' target executions cov ft corpus crashes
for binary in "${binaries[@]}"; do
  name=$(basename "$binary" _fuzz)
  executions=$(cat "$corpus_dir/logs/$name"/*.executed | awk '{sum += $1} END {print sum + 0}')
  # The largest coverage any worker reached (the workers share one corpus).
  cov=$(grep -aoh 'cov: [0-9]*' "$corpus_dir/logs/$name"/*.log | awk '$2 > m {m = $2} END {print m + 0}')
  ft=$(grep -aoh 'ft: [0-9]*' "$corpus_dir/logs/$name"/*.log | awk '$2 > m {m = $2} END {print m + 0}')
  corpus=$(find "$corpus_dir/$name" -type f | wc -l)
  mapfile -t found < <(find "$corpus_dir/crashes/$name" -type f \
    \( -name 'crash-*' -o -name 'leak-*' -o -name 'timeout-*' -o -name 'oom-*' \) -newer "$corpus_dir/logs/$name/started" | sort)
  printf '%-20s %12s %8s %8s %8s  %s\n' "$name" "$executions" "$cov" "$ft" "$corpus" \
    "$( ((${#found[@]})) && echo "${#found[@]}: ${found[*]}" || echo 0)"
  ((${#found[@]} == 0)) || status=1
done
if ((status)); then
  echo "fuzz-long: crashing inputs saved; the worker logs ($corpus_dir/logs/<target>/) hold the reports" >&2
fi
exit $status
