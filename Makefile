# The commands the README shows. Each one sets the machine up first (scripts/bootstrap.sh).
VENV ?= .venv
ARGS ?=
PYTEST_ARGS ?=
FAST_WORKERS ?= 2
# test-fast's pytest-xdist workers: its tiers wait on sockets, timeouts and Ray starts for about
# half their time, so two workers on two cores take ~70 s against ~95 s in one (`make test` stays
# in one process: its servers are shared by the whole session). FAST_WORKERS=0: one process.

.PHONY: setup serve test test-fast lint format proto bench bench-kv sweep

setup:
	bash scripts/bootstrap.sh

serve: setup
	$(VENV)/bin/pdserve serve $(ARGS)

test:
	bash scripts/bootstrap.sh tests
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

test-fast:
	bash scripts/bootstrap.sh tests
	$(VENV)/bin/python -m pytest -m "logic or sockets" -n $(FAST_WORKERS) $(PYTEST_ARGS)

lint:
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format:
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

proto:
	bash scripts/gen_proto.sh

# the comparison in results/bench/README.md: disaggregated 1P1D vs colocated on the same 2 cores,
# interference workload, plus the router's overhead and the KV micro-benchmark (~10 min)
bench: setup
	$(VENV)/bin/pdserve bench compare --workload interference --prompt-len 64 --output-len 128 \
		--long-prompt-len 1536 --long-output-len 16 --long-every-s 10 --arrivals poisson \
		--rate 1 --num-requests 120 --ttft-slo-s 2 --tpot-slo-s 0.1 \
		--out results/bench/interference $(ARGS)

# the rate sweep in results/bench/sweep/README.md: pdserve adaptive, remote and colocated and plain
# vLLM's OpenAI server on the same 2 cores, both mixes, SLO attainment per rate (~45 min)
sweep: setup
	$(VENV)/bin/pdserve bench sweep --systems adaptive remote colocated vllm \
		--rates 1 2 3 4 5 --duration-s 40 --timeout-s 60 --out results/bench/sweep $(ARGS)

bench-kv: setup
	$(VENV)/bin/python benchmarks/kv_transport.py
