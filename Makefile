# The two commands of the README: `make run` (the main job) and `make test` (the test suite).
# Both create/refresh .venv first (scripts/setup.sh; fast when nothing changed).
PY := .venv/bin/python

.PHONY: setup run test test-offline bench

setup:
	@./scripts/setup.sh

run: setup
	$(PY) -m opencoti demo

test:
	@./scripts/setup.sh --test
	$(PY) -m pytest -q

test-offline: setup
	$(PY) -m pytest -q tests/offline

bench: setup
	$(PY) -m opencoti bench all
