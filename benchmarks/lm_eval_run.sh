#!/usr/bin/env bash
# lm-evaluation-harness as a real client of `pagellm serve` (the bundled SmolLM2-135M-Instruct):
# a loglikelihood task and a generate_until task defined in benchmarks/lm_eval_tasks/ from a
# local JSON file (nothing from a hub). Needs `pip install 'lm-eval[api]' torch==2.13.0`.
#
#   bash benchmarks/lm_eval_run.sh [results dir]   (default benchmarks/results/lm-eval-<date>)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$PWD/.venv/bin/python}  # not resolved: the venv is in the link
PORT=${PORT:-8123}
OUT=$(realpath -m "${1:-benchmarks/results/lm-eval-$(date +%F)}")
WORK=$(mktemp -d)
trap 'kill $SERVER 2>/dev/null || true; rm -rf "$WORK"' EXIT

"$PY" -m pagellm serve --port "$PORT" --kv-cache-memory 256M > "$WORK/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done
curl -sf "http://127.0.0.1:$PORT/health" > /dev/null || { cat "$WORK/server.log"; exit 1; }

# lm-eval counts the context's tokens itself: give it the model's own tokenizer, read out of the GGUF.
"$PY" - "$WORK/tokenizer" <<'PY'
import os, sys
from transformers import AutoTokenizer
from pagellm.loader.bundled import default_model_path
path = default_model_path()
AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path)).save_pretrained(sys.argv[1])
PY

cd benchmarks/lm_eval_tasks  # the tasks' data_files are relative to here
"$PY" -m lm_eval --model local-completions \
    --model_args "model=SmolLM2-135M-Instruct,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer=$WORK/tokenizer,tokenized_requests=True,num_concurrent=4,max_retries=1" \
    --tasks pagellm_capitals_mc,pagellm_capitals_gen --include_path . --output_path "$OUT" --log_samples
