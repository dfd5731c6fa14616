# Two commands on a fresh machine: `make flow` (the whole flow on this laptop) and `make test`.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: flow test dev lint

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -e '.[dev]'
	touch $(STAMP)

flow: $(STAMP)
	$(VENV)/bin/gpudoor flow

dev: $(STAMP)
	DAGSTER_HOME=$${DAGSTER_HOME:-$$HOME/.gpudoor/dagster_home} $(VENV)/bin/gpudoor pools
	DAGSTER_HOME=$${DAGSTER_HOME:-$$HOME/.gpudoor/dagster_home} $(VENV)/bin/dagster dev -h 127.0.0.1 -p 3000

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check gpudoor_pipelines workloads tests benchmarks
