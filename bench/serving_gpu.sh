#!/usr/bin/env bash
# The GPU figures of issues 30 and 31 in one run, on a `kiln synth` checkpoint (no model hub on the
# GPU machine): `kiln bench` decode at batch 1, 8 and 64 and prefill 512 (and the same with a
# second binary, e.g. an earlier commit's, for a before/after in one call), the oracle speculative
# bench at k = 4 and 2, then `kiln serve` under load (bench/serve_load.py: 64 and 8 clients, 128
# prompt + 128 generated tokens) and the multi-turn prefix benchmark (2,048-token system prompt,
# 256 more tokens a turn), with the server's prefix-cache and KV-pool metrics.
#
#   bench/serving_gpu.sh BIN_DIR [SHAPE]     (SHAPE: a kiln synth shape, default llama-3.1-8b)
# BIN_DIR holds `kiln` and, optionally, `kiln_before`; KILN_SYNTH_DIR (default /tmp/kiln-serving)
# receives the checkpoint. Run from the repository root (it uses bench/*.py).
set -uo pipefail
bin_dir=$(cd "${1:?usage: bench/serving_gpu.sh BIN_DIR [SHAPE]}" && pwd)
shape=${2:-llama-3.1-8b}
model=${KILN_SYNTH_DIR:-/tmp/kiln-serving}
start=$(date +%s)
elapsed() { echo "[$(( $(date +%s) - start )) s] $*"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

"$bin_dir/kiln" synth --shape "$shape" --out "$model" > /dev/null && python3 bench/synth_tokenizer.py "$model" ||
  { echo "serving_gpu.sh: could not write the $shape checkpoint" >&2; exit 1; }
elapsed "synth $shape"
bench_flags=(--device cuda --batch 1,8,64 --prompt-tokens 512 --decode-tokens 48)
for binary in kiln_before kiln; do
  [ -x "$bin_dir/$binary" ] || continue
  timeout 120 "$bin_dir/$binary" bench --model "$model" "${bench_flags[@]}" 2>&1 | sed "s/^/$binary: /"
  elapsed "bench $binary"
done
for k in 4 2; do
  timeout 90 "$bin_dir/kiln" bench --model "$model" --device cuda --speculative oracle --num-speculative-tokens $k \
    --decode-tokens 96 --batch 1 2>&1 | tail -6
  elapsed "oracle k=$k"
done

port=${KILN_PORT:-18080}
url=http://127.0.0.1:$port
"$bin_dir/kiln" serve --model "$model" --device cuda --port "$port" --max-batch 64 --max-context 8192 \
  --memory-share 0.9 > serve.log 2>&1 &
server=$!
trap 'kill $server 2>/dev/null' EXIT
fetch() { python3 -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen('$url$1').read().decode())"; }
for _ in $(seq 1 180); do fetch /health > /dev/null 2>&1 && break; sleep 1; done
elapsed "serve up"
timeout 200 python3 bench/serve_load.py --url "$url" --concurrency 64,8 --requests 3 --prompt-tokens 128 --max-tokens 128
elapsed "load"
timeout 120 python3 bench/serve_load.py --url "$url" --multi-turn 10 --system-tokens 2048 --turn-tokens 256 --max-tokens 8
elapsed "multi-turn"
fetch /metrics | grep -E "^kiln_(prefix|kv_cache|preempt)"
