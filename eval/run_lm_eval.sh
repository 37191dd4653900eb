#!/usr/bin/env bash
# lm-eval, unchanged, against `tokenmill serve` and against its own `hf` backend on the same float32
# weights, then item-by-item comparison (eval/compare_lm_eval.py). Not part of `make test`: it installs
# lm-eval into its own environment and takes a few minutes. Usage (from the repository root):
#
#     make lm-eval                      # or: bash eval/run_lm_eval.sh [MODEL] [OUT_DIR]
#
# MODEL: a tokenmill alias or a .gguf path (default: the default model); OUT_DIR: default results/lm-eval.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
LMEVAL_VENV=${LMEVAL_VENV:-$ROOT/.lmeval-venv}
MODEL=${1:-}
OUT=$(realpath -m "${2:-$ROOT/results/lm-eval}")
PORT=${PORT:-18765}
NAME=lm-eval-model
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1

if [ ! -x "$LMEVAL_VENV/bin/lm_eval" ]; then
  echo "installing lm-eval into $LMEVAL_VENV"
  python3 -m venv "$LMEVAL_VENV"
  "$LMEVAL_VENV/bin/pip" install -q torch==2.13.0 "lm_eval[hf,api]==0.4.13" gguf sentencepiece
fi

mkdir -p "$OUT"
rm -rf "$OUT/hf" "$OUT/tokenmill"
echo "writing the model as an HF float32 checkpoint: $OUT/model"
"$PY" "$ROOT/eval/gguf_to_hf.py" $MODEL "$OUT/model" >/dev/null

"$PY" -m tokenmill.server.cli serve --model "$OUT/model" --served-model-name "$NAME" --dtype float32 \
  --host 127.0.0.1 --port "$PORT" --log-interval 0 >"$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 300); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 $SERVER 2>/dev/null || { cat "$OUT/server.log"; exit 1; }
  sleep 1
done

cd "$ROOT/eval/tasks"  # the task YAMLs name their JSONL files relative to this directory
run() { "$LMEVAL_VENV/bin/lm_eval" --include_path . --log_samples "$@"; }
API="num_concurrent=1,max_retries=1"
run --model hf --model_args "pretrained=$OUT/model,dtype=float32" --device cpu --batch_size 4 \
  --tasks tokenmill_mc --output_path "$OUT/hf"
run --model local-completions --tasks tokenmill_mc --output_path "$OUT/tokenmill" --model_args \
  "model=$NAME,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer_backend=huggingface,tokenizer=$OUT/model,$API"
run --model hf --model_args "pretrained=$OUT/model,dtype=float32" --device cpu --batch_size 1 \
  --apply_chat_template --tasks tokenmill_gen --output_path "$OUT/hf"
run --model local-chat-completions --apply_chat_template --tasks tokenmill_gen --output_path "$OUT/tokenmill" \
  --model_args "model=$NAME,base_url=http://127.0.0.1:$PORT/v1/chat/completions,$API"

"$PY" "$ROOT/eval/compare_lm_eval.py" "$OUT/hf" "$OUT/tokenmill" --tolerance 1e-3 | tee "$OUT/comparison.txt"
