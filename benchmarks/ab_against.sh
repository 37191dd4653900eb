#!/usr/bin/env bash
# This tree against REV in one session, the two taking turns: single-stream decode (ab_decode.py) and
# serving at 16 concurrent 200-in/128-out (`tokenmill bench serve`), ROUNDS rounds each.
#
#   benchmarks/ab_against.sh REV [ROUNDS]
#
# REV is checked out in a git worktree (its kernels are built from source at its first use if it
# predates the prebuilt ones). Nothing else may run meanwhile. Env: PORT (8471); MODEL, a GGUF file
# (default: the packaged SmolLM2-135M-Instruct Q4_1; e.g. `MODEL=$(../shared/models/fetch.sh qwen2.5-coder-0.5b)`);
# PARTS, what to run (default "decode serve").
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REV=$1 ROUNDS=${2:-2} PORT=${PORT:-8471}
PY="$ROOT/.venv/bin/python"
BASE=$(mktemp -d)/base
git -C "$ROOT" worktree add -q --detach "$BASE" "$REV"
trap 'git -C "$ROOT" worktree remove --force "$BASE"' EXIT
FILE=${MODEL:-$(find "$ROOT/.venv" -name 'SmolLM2-135M-Instruct.Q4_1.gguf' | head -1)}

serve_bench() {  # TREE LABEL
  (cd "$1" && PYTHONPATH="$1" "$PY" -m tokenmill.server.cli serve --port "$PORT" --model "$FILE" --log-interval 0 >/dev/null 2>&1) &
  local pid=$!
  until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do sleep 0.5; done
  "$ROOT/.venv/bin/tokenmill" bench serve --base-url "http://127.0.0.1:$PORT" \
    --tokenizer "$FILE" --dataset random --random-input-len 200 --random-output-len 128 --ignore-eos \
    --temperature 0 --max-concurrency 16 --num-prompts 64 --num-warmups 4 --disable-tqdm \
    --result-file "/tmp/ab-$2.json" >/dev/null
  pkill -TERM -f "tokenmill.server.cli serve --port $PORT" || true
  wait "$pid" || true
  "$PY" -c "import json; s = json.load(open('/tmp/ab-$2.json'))['summary']; \
print('SERVE $2', round(s['output_throughput'], 1), 'out tok/s, TTFT p50', round(s['ttft_ms']['p50']), 'ms')"
}

PARTS=${PARTS:-decode serve}
if [[ $PARTS == *decode* ]]; then
  for r in $(seq "$ROUNDS"); do
    (cd "$BASE" && PYTHONPATH="$BASE" "$PY" "$ROOT/benchmarks/ab_decode.py" "$REV" --model "$FILE")
    (cd "$ROOT" && PYTHONPATH="$ROOT" "$PY" "$ROOT/benchmarks/ab_decode.py" HEAD --model "$FILE")
  done
fi
if [[ $PARTS == *serve* ]]; then
  for r in $(seq "$ROUNDS"); do
    serve_bench "$BASE" "$REV-$r"
    serve_bench "$ROOT" "HEAD-$r"
  done
fi
