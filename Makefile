# One target per chore. `make run` and `make test` work on a fresh machine: they create .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
# `make run` installs the runtime alone (.[local]: the service, the trainers, a redis-server for the Tinker
# API); `make test` and `make lint` add the dev tools (.[dev]) on top
RUN_STAMP := $(VENV)/.installed-run
STAMP := $(VENV)/.installed
# tinker-cookbook, pinned: tests/tinker/test_cookbook.py runs its loops against the Tinker API; installed
# without its dependencies (the dev extra lists those it imports; pyproject.toml says why)
TINKER_COOKBOOK := tinker-cookbook==0.6.1

.PHONY: setup run test lint format docs bench bench-gpu clean

$(RUN_STAMP): pyproject.toml
	@echo "installing the runtime into $(VENV) (torch's CPU wheel, transformers, the service): a few minutes the first time"
	python3 -m venv $(VENV)
	# torch first and pinned: on a CPU machine this takes the local CPU wheel instead of GBs of CUDA packages
	$(PY) -m pip install --progress-bar on torch==2.13.0
	$(PY) -m pip install --progress-bar on -e ".[local]"
	touch $(RUN_STAMP)

$(STAMP): $(RUN_STAMP)
	@echo "installing the dev tools (tests, lint, benchmarks) into $(VENV)"
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps $(TINKER_COOKBOOK)
	touch $(STAMP)

setup: $(STAMP)

run: $(RUN_STAMP)
	$(VENV)/bin/tunehouse up $(ARGS)

# the suite in parallel processes (pytest-xdist; tests/conftest.py gives each its own database, Redis
# databases and blob folder); a test file stays in one process, so its module fixtures start once. Three on
# two cores: the tests wait on servers and subprocesses a quarter of the time (9.6 min against ~10.5 at two)
TEST_WORKERS ?= 3
# (the slowest tests are listed at the end, so that one that grew slow is seen when it lands)
test: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=25 $(ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy service worker tunehouse trainers
	# the import layers of trainers/, the arrows between packages and no cycles ([tool.importlinter])
	$(VENV)/bin/lint-imports

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

docs: setup
	$(PY) -m trainers.method_docs

# mutation check, one module at a time (slow; not in .ci/run): make mutants MODULES="trainers/methods/grpo.py"
mutants: setup
	$(PY) -m tests.mutants $(MODULES)

# trainers vs TRL (bench/trainers_vs_trl.py; TRAINER_BENCH="--quick" for a few minutes on 2 cores,
# TRAINER_BENCH="--skip" to leave it out), then the pytest benchmarks in bench/
TRAINER_BENCH ?=
bench: setup
	$(if $(findstring --skip,$(TRAINER_BENCH)),,$(PY) -m bench.trainers_vs_trl $(TRAINER_BENCH))
	$(PY) -m pytest bench -m slow -p no:cacheprovider $(ARGS)

# the GPU suite, ours against TRL at 0.5B-8B shapes on one GPU (bench/gpu_suite.py, docs/gpu-bench.md):
# ARGS="--smoke" runs it on a CPU with tiny shapes; GPU_PY=python3 uses a machine's own Python (and torch)
# instead of the venv, as on the device machine, where nothing can be installed
bench-gpu: $(if $(GPU_PY),,setup)
	$(or $(GPU_PY),$(PY)) -m bench.gpu_suite $(ARGS)

clean:
	rm -rf $(VENV) .tunehouse .mypy_cache .ruff_cache .pytest_cache .import_linter_cache .grimp_cache
