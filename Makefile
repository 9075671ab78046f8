# The two commands of the README: `make run` (the main job) and `make test` (the test suite).
# Both create/refresh .venv first (scripts/setup.sh; fast when nothing changed).
PY := .venv/bin/python

.PHONY: setup run test test-offline bench

setup:
	@./scripts/setup.sh

run: setup
	$(PY) -m opencoti demo

# the offline, live and browser tests in one pytest-xdist run on every core (at most 4 workers: each
# live worker holds the bundled model), a test file at a time (module-scoped servers and engines are
# made once), except the files whose tests are independent, which go test by test to whichever worker
# is free (tests/conftest.py sets the unit of --dist loadscope): one run rather than offline, then live
# (two workers, a file at a time), so that no core idles at the end of a phase or while a live test
# waits on a server's start; then the cluster tests alone (they check where the router places
# requests by its requests in flight, which another test file on the same cores disturbs);
# set-up installs the cluster extra, and OPENCOTI_REQUIRE_CLUSTER=1 makes a missing extra an error,
# not a skip; all of them always run, after the linter (ruff check, under a second) and the type checker
# (mypy on the modules pyproject.toml lists; about 25 s without its cache)
test:
	@./scripts/setup.sh --test
	@rc=0; \
	$(PY) -m ruff check . || rc=1; \
	$(PY) -m mypy || rc=1; \
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist loadscope --durations=30 tests/offline tests/live tests/browser \
		|| rc=1; \
	OPENCOTI_REQUIRE_CLUSTER=1 $(PY) -m pytest -q --durations=10 tests/cluster || rc=1; \
	exit $$rc

test-offline: setup
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(PY) -m pytest -q -n auto --maxprocesses 4 tests/offline

bench: setup
	$(PY) -m opencoti bench
