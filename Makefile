# Two commands: `make run` and `make test`. Everything else is optional.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: run test lint fuzz bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	rm -f $(VENV)/.installed-* && touch $@

## Start the gateway on embedded defaults (private Redis, SQLite in ./.qgw).
run: $(STAMP)
	$(BIN)/qgw serve

## Lint, type-check and run the test suite against real servers.
test: $(STAMP) lint
	$(BIN)/pytest -q

## schemathesis against our own OpenAPI document: every route, valid credentials, bounded.
fuzz: $(STAMP)
	$(BIN)/python tests/fuzz_api.py

lint: $(STAMP)
	$(BIN)/ruff check app tests bench
	$(BIN)/mypy

## Benchmarks: bounded, loopback only, ratios against a baseline measured in the same run.
bench: $(STAMP)
	$(BIN)/python bench/submit_dispatch.py
	$(BIN)/python bench/upstream_client.py
	$(BIN)/python bench/ratelimit.py
	$(BIN)/python bench/chaos.py
	$(BIN)/python bench/eta.py
	$(BIN)/python bench/purge.py
	$(BIN)/python bench/outbox_drain.py --outage-s 30

clean:
	rm -rf $(VENV) .qgw .pytest_cache .mypy_cache .ruff_cache
