# Two commands on a fresh machine: `make flow` (the whole flow on this laptop) and `make test`.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: flow test dev lint compile

# uv installs the environment (pip takes three times as long on 2 cores). It does not read pip's settings: a
# machine's own wheels (pip's find-links, e.g. a CPU build of torch) are handed to it, and it trusts the
# system's certificates as pip does. It compiles the bytecode once, at install: where PYTHONDONTWRITEBYTECODE
# is set (as on some CI images), every process would otherwise compile SkyPilot and Dagster from source at
# each start (importing SkyPilot's jobs module: 4.4 CPU-s instead of 1.6).
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q 'uv==0.13.9'
	UV_FIND_LINKS="$${UV_FIND_LINKS:-$${PIP_FIND_LINKS:-$$($(VENV)/bin/pip config get global.find-links 2>/dev/null)}}" \
	  UV_SYSTEM_CERTS=1 $(VENV)/bin/uv pip install -q --compile-bytecode --python $(VENV)/bin/python -e '.[dev]'
	touch $(STAMP)

# The project's own modules, compiled as the installed packages are (only what changed since).
compile: $(STAMP)
	$(VENV)/bin/python -m compileall -q -j 0 gpudoor_pipelines workloads tests testbed/lib >/dev/null

flow: compile
	$(VENV)/bin/gpudoor flow

dev: compile
	DAGSTER_HOME=$${DAGSTER_HOME:-$$HOME/.gpudoor/dagster_home} $(VENV)/bin/gpudoor pools
	DAGSTER_HOME=$${DAGSTER_HOME:-$$HOME/.gpudoor/dagster_home} $(VENV)/bin/dagster dev -h 127.0.0.1 -p 3000

# The lanes side by side (the test bed's tests beside the rest), each with a bound; a report at the end
# names every failed test and the file with its log (tests/lanes.py). The bed is brought up when it is
# down, and taken down again afterwards.
test: compile
	$(VENV)/bin/python tests/lanes.py --reports $${GPUDOOR_TEST_REPORTS:-.test-reports}

lint: $(STAMP)
	$(VENV)/bin/ruff check gpudoor_pipelines workloads tests benchmarks testbed
	$(VENV)/bin/ruff format --check gpudoor_pipelines workloads tests benchmarks testbed
	$(VENV)/bin/lint-imports
