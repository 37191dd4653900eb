#!/usr/bin/env bash
# Serving benchmarks recorded in BENCHMARKS.md, all driven by `tokenmill bench` against a real
# `tokenmill serve` on 127.0.0.1. Results (JSON) go to $OUT (default results/), plots to docs/.
#
#   bash benchmarks/serving_benchmarks.sh [sweeps|prefix|all]
#
# Each part starts its own server(s) and stops them; nothing else should run on the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}
PORT=${PORT:-8123}
TM=.venv/bin/tokenmill
URL=http://127.0.0.1:$PORT
mkdir -p "$OUT" docs

start_server() {  # extra serve flags...
  $TM serve --port "$PORT" --kv-cache-memory 2 --max-num-seqs 64 --disable-log-requests "$@" \
    >"$OUT/server.log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 120); do
    curl -sf "$URL/health" >/dev/null && return 0
    sleep 1
  done
  echo "server did not start"; cat "$OUT/server.log"; exit 1
}

stop_server() {
  kill -INT "$SERVER_PID"; wait "$SERVER_PID" || true
}

bench() {  # subcommand, result name, flags...
  local sub=$1 name=$2; shift 2
  $TM bench "$sub" --base-url "$URL" --server-pid "$SERVER_PID" --result-file "$OUT/$name.json" \
    --disable-tqdm "$@"
}

sweeps() {
  start_server
  bench sweep sweep_random --dataset random --random-input-len 256 --random-output-len 64 --ignore-eos \
    --num-prompts 32 --concurrencies 1,2,4,8,16,32,64 --slo ttft=2s,tpot=200ms --plot-dir "$OUT/sweep_random"
  bench sweep sweep_shared_prefix --dataset shared-prefix --num-prefixes 4 --prefix-len 512 \
    --random-input-len 64 --random-output-len 64 --ignore-eos --num-prompts 32 \
    --concurrencies 1,2,4,8,16,32,64 --slo ttft=2s,tpot=200ms --plot-dir "$OUT/sweep_shared_prefix"
  stop_server
}

prefix() {
  for mode in on off; do
    if [ "$mode" = on ]; then start_server; else start_server --no-enable-prefix-caching; fi
    bench serve "prefix_${mode}_shared" --dataset shared-prefix --num-prefixes 8 --prefix-len 1500 \
      --random-input-len 48 --random-output-len 32 --ignore-eos --num-prompts 64 --max-concurrency 8 \
      --num-warmups 0
    bench serve "prefix_${mode}_multiturn" --endpoint /v1/chat/completions --dataset multi-turn \
      --num-turns 5 --random-input-len 64 --random-output-len 48 --ignore-eos --num-prompts 8 \
      --max-concurrency 4 --num-warmups 0
    bench serve "prefix_${mode}_random" --dataset random --random-input-len 256 --random-output-len 64 \
      --ignore-eos --num-prompts 64 --max-concurrency 16
    stop_server
  done
}

case "${1:-all}" in
  sweeps) sweeps ;;
  prefix) prefix ;;
  all) sweeps; prefix ;;
esac
