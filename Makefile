# The two commands of the README: `make run` (the main job) and `make test` (the test suite).
# Both create/refresh .venv first (scripts/setup.sh; fast when nothing changed).
PY := .venv/bin/python

.PHONY: setup run test test-offline bench

setup:
	@./scripts/setup.sh

run: setup
	$(PY) -m opencoti demo

# offline tests on every core (pytest-xdist: small models, mostly Python), then the live, browser and
# cluster tests one at a time (each loads the real model and uses every core); both always run
test:
	@./scripts/setup.sh --test
	@rc=0; \
	$(PY) -m pytest -q -n auto --maxprocesses 4 tests/offline || rc=1; \
	$(PY) -m pytest -q tests/live tests/browser tests/cluster || rc=1; \
	exit $$rc

test-offline: setup
	$(PY) -m pytest -q -n auto --maxprocesses 4 tests/offline

bench: setup
	$(PY) -m opencoti bench all
