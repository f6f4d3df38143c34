#!/usr/bin/env bash
# llama.cpp's numbers on the shapes of issue 27, for docs/perf.md's peer comparison: random-weight
# GGUFs of the Llama-3.1-8B shape quantized to Q4_0, Q4_K_M and Q8_0 and of the Llama-3.2-1B shape
# to Q4_0, each through llama-bench (pp512 and tg128, flash attention, all layers on the GPU,
# 3 repetitions). Prints the tables and appends them to $OUT/llama-peer.md (or ./llama-peer.md).
#
#   bash bench/llama_cpp_peer.sh BIN_DIR GGUF_PY_DIR
#
# BIN_DIR holds llama-bench, llama-quantize and their shared libraries; GGUF_PY_DIR is llama.cpp's
# gguf-py. GGUFs go to $LLAMA_PEER_WORK (default /tmp/llama-peer) and are deleted as soon as they
# are measured: at most the 8B's F16 (16 GB) and one quantized file (8.5 GB for Q8_0) at a time.
# LLAMA_PEER_SHAPES (default "llama-3.1-8b llama-3.2-1b", or "tiny" for a CPU check),
# LLAMA_PEER_TYPES (default: Q4_0 Q4_K_M Q8_0 for the 8B, Q4_0 for the others) and
# LLAMA_PEER_BENCH_ARGS (default "-p 512 -n 128 -fa on -ngl 99 -r 3") change what runs.
set -euo pipefail
if [ $# -ne 2 ]; then
  echo "usage: $0 BIN_DIR GGUF_PY_DIR" >&2
  exit 2
fi
bin=$(cd "$1" && pwd)
gguf_py=$(cd "$2" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
work=${LLAMA_PEER_WORK:-/tmp/llama-peer}
report=${OUT:-.}/llama-peer.md
shapes=${LLAMA_PEER_SHAPES:-llama-3.1-8b llama-3.2-1b}
read -r -a bench_args <<< "${LLAMA_PEER_BENCH_ARGS:--p 512 -n 128 -fa on -ngl 99 -r 3}"
export LD_LIBRARY_PATH="$bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
stamp() { echo "[$(date -u +%T)] $*" >&2; }

mkdir -p "$work"
# Absolute: llama-quantize reads an output name that starts with a digit as the type (stoi).
work=$(cd "$work" && pwd)
df -h "$work" >&2
for shape in $shapes; do
  case "$shape" in
    llama-3.1-8b) types="Q4_0 Q4_K_M Q8_0" ;;
    *) types="Q4_0" ;;
  esac
  types=${LLAMA_PEER_TYPES:-$types}
  f16="$work/$shape-f16.gguf"
  stamp "$shape: writing F16"
  python3 "$here/write_random_gguf.py" --gguf-py "$gguf_py" --shape "$shape" "$f16"
  for type in $types; do
    quantized="$work/$shape-$type.gguf"
    stamp "$shape: quantizing to $type"
    "$bin/llama-quantize" "$f16" "$quantized" "$type" "$(nproc)" > "$work/quantize.log" 2>&1 ||
      { cat "$work/quantize.log" >&2; exit 1; }
    stamp "$shape $type: llama-bench ${bench_args[*]}"
    { echo "### $shape $type (random weights), llama.cpp de3ff81"; echo
      "$bin/llama-bench" -m "$quantized" "${bench_args[@]}" -o md || exit 1; echo; } | tee -a "$report"
    rm -f "$quantized"
  done
  rm -f "$f16"
done
stamp "done"
