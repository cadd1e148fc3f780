#!/usr/bin/env bash
# The prepared GPU check, 3-5 minutes on one H200 (docs/gpu.md). From the repository root:
#
#   PAGELLM_COMMIT=<git hash> bash benchmarks/gpu_check.sh [gpu_check.py options]
#
# Runs pagellm from the working tree (PYTHONPATH=.), downloads nothing, and installs only the
# wheels carried in .whl/ (see benchmarks/gpu_check.py's docstring: gguf). Writes
# benchmarks/results/gpu_check-<date>-<machine>.json, and copies it and the log to $OUT when
# the device tool set one (that is how they come back).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/pagellm-site \
        .whl/*.whl && export PYTHONPATH=/tmp/pagellm-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>/dev/null || true
log=$(mktemp)
timeout 470 "$PY" benchmarks/gpu_check.py "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
if [ -n "${OUT:-}" ]; then
    newest=$(ls -t benchmarks/results/gpu_check-*.json 2>/dev/null | head -1)
    [ -n "$newest" ] && cp "$newest" "$OUT"/
    cp "$log" "$OUT"/gpu_check.log
fi
exit "$rc"
