# Two commands: `make run` and `make test`. Everything else is optional.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# Installs come from the lock (requirements/*.txt, hashes checked); `make lock` rewrites it.
LOCKS  := requirements/run.txt requirements/test.txt
HASH   := $(shell cat pyproject.toml clients/python/pyproject.toml $(LOCKS) | cksum | cut -d' ' -f1)
# Two installs: the runtime alone for `make run`, the test tools on top for everything else.
RUNSTAMP := $(VENV)/.run-$(HASH)
STAMP  := $(VENV)/.installed-$(HASH)
SYSDEPS := $(VENV)/.system-deps

.PHONY: run test lint fuzz bench lock clean reference docs

$(RUNSTAMP): pyproject.toml requirements/run.txt
	PYTHON=$(PYTHON) scripts/system-deps run
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --require-hashes -r requirements/run.txt
	$(BIN)/pip install -q --no-deps -e .
	rm -f $(VENV)/.run-* && touch $@

$(STAMP): $(RUNSTAMP) requirements/test.txt clients/python/pyproject.toml
	$(BIN)/pip install -q --require-hashes -r requirements/test.txt
	$(BIN)/pip install -q --no-deps -e clients/python  # the client: its tests and mypy
	rm -f $(VENV)/.installed-* && touch $@

## Rewrite the lock from pyproject.toml after a dependency changed (pins kept where they
## still fit; `make lock UPGRADE=--upgrade` takes the newest of everything). Needs PyPI.
## tests/test_lock.py fails while the lock and pyproject.toml disagree.
LOCK_FLAGS := --quiet --universal --python-version 3.11 --generate-hashes --no-header
lock:
	test -x $(BIN)/pip || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q 'uv>=0.9'
	$(BIN)/uv pip compile $(LOCK_FLAGS) $(UPGRADE) pyproject.toml -o requirements/run.txt
	$(BIN)/uv pip compile $(LOCK_FLAGS) $(UPGRADE) pyproject.toml clients/python/pyproject.toml \
	  --extra test -c requirements/run.txt -o requirements/test.txt

## Start the gateway on embedded defaults (private Redis, SQLite in ./.qgw).
run: $(RUNSTAMP)
	$(BIN)/qgw serve

## Lint, type-check and run the test suite against real servers. The code is compiled to
## bytecode first: the tests start hundreds of `qgw` processes, and where the environment sets
## PYTHONDONTWRITEBYTECODE each would compile what it imports again.
test: $(SYSDEPS) $(STAMP) lint
	$(BIN)/python -m compileall -q app bench tests
	$(BIN)/pytest -q -n 3

## The system packages the tests drive (MariaDB, nginx, Chromium) and lint uses (promtool):
## installed once on Debian as root, named in one line elsewhere (scripts/system-deps).
$(SYSDEPS): scripts/system-deps
	PYTHON=$(PYTHON) scripts/system-deps test
	mkdir -p $(VENV) && touch $@

## schemathesis against our own OpenAPI document: every route, valid credentials, bounded.
fuzz: $(STAMP)
	$(BIN)/python tests/fuzz_api.py

## Lint and type-check; the Dockerfile (hadolint), compose.yaml (the compose spec), the
## Prometheus alert rules and their unit tests (promtool, from scripts/system-deps), the
## Kubernetes manifests (scripts/check-kubernetes: Kubernetes and KEDA schemas, strict), and the
## documentation site: its generated reference current, and `mkdocs build --strict`.
lint: $(STAMP) $(SYSDEPS)
	$(BIN)/ruff check app tests bench clients scripts
	$(BIN)/mypy
	$(BIN)/hadolint Dockerfile
	$(BIN)/check-jsonschema -q --builtin-schema vendor.compose-spec compose.yaml
	promtool check rules deploy/prometheus/alerts.yml
	promtool test rules deploy/prometheus/alerts.test.yml
	$(BIN)/python scripts/check-kubernetes
	$(BIN)/python -m scripts.gen_reference --check
	site=$$(mktemp -d) && NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -q -d "$$site"; \
	  status=$$?; rm -rf "$$site"; exit $$status

## Regenerate docs/reference/ (HTTP API, settings, CLI, metrics) from the code.
reference: $(STAMP)
	$(BIN)/python -m scripts.gen_reference

## The documentation site on http://127.0.0.1:8000, rebuilt as pages change.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

## Benchmarks: bounded, loopback only, ratios against a baseline measured in the same run.
bench: $(STAMP)
	$(BIN)/python bench/peers.py
	$(BIN)/python bench/e2e_cpu.py
	$(BIN)/python bench/submit_dispatch.py
	$(BIN)/python bench/upstream_client.py
	$(BIN)/python bench/ratelimit.py
	$(BIN)/python bench/upstream_limits.py
	$(BIN)/python bench/chaos.py
	$(BIN)/python bench/eta.py
	$(BIN)/python bench/purge.py
	$(BIN)/python bench/outbox_drain.py --outage-s 30
	$(BIN)/python bench/waiters.py
	$(BIN)/python bench/failover.py
	$(BIN)/python bench/cluster.py --tasks 1500

clean:
	rm -rf $(VENV) .qgw .pytest_cache .mypy_cache .ruff_cache
