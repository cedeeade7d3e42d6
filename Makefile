# The commands the README shows. Each one sets the machine up first (scripts/bootstrap.sh).
VENV ?= .venv
ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup serve test test-fast lint format proto bench-kv

setup:
	bash scripts/bootstrap.sh

serve: setup
	$(VENV)/bin/pdserve serve $(ARGS)

test: setup
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

test-fast: setup
	$(VENV)/bin/python -m pytest -m "not e2e" $(PYTEST_ARGS)

lint:
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format:
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

proto:
	bash scripts/gen_proto.sh

bench-kv: setup
	$(VENV)/bin/python benchmarks/kv_transport.py
