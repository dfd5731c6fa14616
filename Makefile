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

# The Slurm tests mostly wait on the test bed's managed jobs: they run side by side with the rest, in one
# lane, and the preempted training (minutes of waiting while SkyPilot recovers it) in a lane of its own,
# with the other preemption tests after it (step cluster, eviction, caption job). More Slurm lanes
# starve the 2-core machine: the bed's job controllers and the rest slow down.
SLOW_SLURM := tests/slurm/test_preemption_on_slurm.py tests/slurm/test_step_cluster_on_slurm.py tests/slurm/test_eviction_on_slurm.py \
              tests/slurm/test_caption_preemption_on_slurm.py
# Each lane has a bound (a test has its own: pytest-timeout in pyproject.toml), so a lane that hangs is cut off
# and its log printed, and `make test` fails saying so.
BED_LANE_TIMEOUT_S ?= 2700
test: $(STAMP)
	@timeout -k 30 $(BED_LANE_TIMEOUT_S) $(VENV)/bin/python -m pytest -q -p no:cacheprovider --durations=0 tests/slurm \
	  $(addprefix --ignore=,$(SLOW_SLURM)) > .pytest-slurm.log 2>&1 & slurm=$$!; \
	timeout -k 30 $(BED_LANE_TIMEOUT_S) $(VENV)/bin/python -m pytest -q -p no:cacheprovider --durations=0 $(SLOW_SLURM) \
	  > .pytest-slurm-slow.log 2>&1 & slow=$$!; \
	$(VENV)/bin/python -m pytest -q --durations=10 --ignore=tests/slurm; rest=$$?; \
	wait $$slurm; slurm_rc=$$?; wait $$slow; slow_rc=$$?; \
	echo "== tests/slurm (ran side by side)"; cat .pytest-slurm.log .pytest-slurm-slow.log; \
	for rc in $$slurm_rc $$slow_rc; do [ $$rc -lt 124 ] || echo "== a Slurm lane was cut off after $(BED_LANE_TIMEOUT_S) s (exit $$rc)"; done; \
	exit $$(( rest != 0 || slurm_rc != 0 || slow_rc != 0 ))

lint: $(STAMP)
	$(VENV)/bin/ruff check gpudoor_pipelines workloads tests benchmarks
