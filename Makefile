# Two commands for a newcomer: `make demo` and `make test`. Both set up .venv first (idempotent).
PY := .venv/bin/python

.PHONY: setup demo test test-fast adapters bench clean

# Creates or checks .venv; installs nothing when it is up to date.
setup:
	@bash scripts/setup_env.sh

demo: setup
	$(PY) -m eval.demo

# Two pytest-xdist workers, each with half the CPUs (tests/conftest.py): a module runs on one worker whole.
test: setup
	$(PY) -m pytest -q -ra -n 2

# Unit and integration tests only (no server start).
test-fast: setup
	$(PY) -m pytest -q -ra -n 2 -m "not e2e"

# Retrain the bundled adapters (minutes on 2 cores); the results are committed in assets/adapters/ and
# assets/moe_adapters/ (the MoE model's expert adapters).
adapters: setup
	$(PY) tools/train_adapters.py
	$(PY) tools/train_expert_adapters.py

clean:
	rm -rf .venv .pytest_cache .hypothesis
