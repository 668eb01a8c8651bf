# Two commands do all set-up on a fresh machine:
#   make up    — embedded Redis, the gateway on 127.0.0.1:8000 and a worker per built-in model
#   make test  — ruff, mypy and pytest against a real redis-server
# Both create or reuse the virtualenv at .venv and install what is missing.

PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
# torch is named in the same pip command as everything that depends on it, so pip
# takes the CPU build given here instead of resolving a multi-GB CUDA build.
TORCH ?= torch==2.13.0
# setuptools prints a note on every editable install of a flat layout of several packages
# like ours (BuildBackendWarning "Editable installation."); the install hides that one note.
EDITABLE := PYTHONWARNINGS="ignore:Editable installation"

.PHONY: up test lint typecheck pytest keda-crd bench clean

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(EDITABLE) $(VENV)/bin/python -m pip install -q "$(TORCH)" -e ".[serve,dev]"
	rm -f $(VENV)/.installed-* && touch $@

up: $(STAMP)
	HF_HUB_OFFLINE=$${HF_HUB_OFFLINE:-1} $(VENV)/bin/conveyor up $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# KEDA's CRD schema for tests/deploy/kedacrd.py, from the npm registry (pinned by its lock
# file). Without npm the KEDA schema test skips, saying so; .ci/run installs npm, so CI runs it.
KEDA_CRD := tests/deploy/keda
$(KEDA_CRD)/node_modules/.installed: $(KEDA_CRD)/package.json $(KEDA_CRD)/package-lock.json
	npm ci --prefix $(KEDA_CRD) --no-audit --no-fund --loglevel=error
	touch $@

keda-crd:
	@if command -v npm >/dev/null 2>&1; then $(MAKE) -s --no-print-directory $(KEDA_CRD)/node_modules/.installed; \
	else echo "npm not found: KEDA's CRD schema test will be skipped (apt-get install nodejs npm)"; fi

pytest: $(STAMP) keda-crd
	HF_HUB_OFFLINE=1 $(VENV)/bin/python -m pytest $(PYTEST_ARGS)

test: lint typecheck pytest

bench: $(STAMP)
	$(EDITABLE) $(VENV)/bin/python -m pip install -q "$(TORCH)" -e ".[serve,dev,bench]"
	HF_HUB_OFFLINE=1 $(VENV)/bin/python -m bench $(ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache $(KEDA_CRD)/node_modules
