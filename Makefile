# The two commands a newcomer needs: `make serve` and `make test`.
# Both create .venv and install the project on first use (torch==2.13.0: the CPU build).
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.servewell-installed
# Every runtime, the built-in models, the fleet planner (`servewell plan`), and what the tests, benchmarks,
# `make lint` and the docs site use.
EXTRAS ?= all,plan,test,bench,dev,docs
# Machines of this kind keep the CPU build of torch in /opt/wheels; elsewhere pip's index serves it.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)

.PHONY: install serve test test-deps lint fuzz bench chaos clean replicas docs

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(FIND_LINKS) -e '.[$(EXTRAS)]'
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/servewell serve --host 127.0.0.1 --port 8000 --log-format console

# Programs some tests run (promtool, prometheus, ...): installed where possible, else named.
test-deps:
	scripts/install-test-deps.sh

# Two processes share the test files (a file's tests stay together, with its module's servers):
# a serial run left half of 2 cores idle (tests wait on servers, clients and timeouts). Tests
# marked `serial` run alone afterwards. tests/ holds the fleet planner's suite too (tests/plan, its slow fits
# included), which `pytest tests/unit` leaves out.
TEST_PROCESSES ?= 2
test: install test-deps
	$(VENV)/bin/pytest -q -n $(TEST_PROCESSES) --dist loadfile -m "not serial" --durations=25
	$(VENV)/bin/pytest -q -m serial --durations=10

# The documentation site with live reload (mkdocs.yml; the reference pages are generated from the code at
# each build). `make test` builds it with --strict (tests/integration/test_docs_site.py). Port 8001 is
# servewell's gRPC default: DOCS_ADDR=127.0.0.1:8002 beside a running server.
DOCS_ADDR ?= 127.0.0.1:8001
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --dev-addr $(DOCS_ADDR)

# ruff (lint rules in pyproject.toml) and mypy (strict on the serving path).
lint: install
	$(VENV)/bin/ruff check src tests bench deploy
	$(VENV)/bin/mypy

# The fuzzing tests of `make test` with many more examples (hypothesis properties of the codecs and
# image decoding, schemathesis against /openapi.json); estimated at half an hour on 2 cores.
fuzz: install
	SERVEWELL_FUZZ=long $(VENV)/bin/pytest -q -p no:cacheprovider tests/unit/api/test_tensor_codec_properties.py \
		tests/unit/test_imaging_properties.py tests/e2e/test_openapi_fuzz.py

bench: install
	$(PY) -m bench.run

# Faults under load (worker kill/stop, hanging load, raising model, memory pressure and limit,
# overload, OTLP outage, SIGTERM, soak): a table and bench/results/chaos.json, about 6 minutes.
# The issue's 10-minute soak: make chaos SOAK_S=600.
SOAK_S ?= 60
chaos: install test-deps
	$(PY) -m bench.chaos --soak-s $(SOAK_S)

# N replicas of `make serve`'s server behind HAProxy on 127.0.0.1:$(PORT) (replicas on the next N ports), in
# the foreground until Ctrl-C; deploy/local/replicas.py status|restart|down from another terminal.
# State (pids, haproxy.cfg, logs) goes to $(STATE_DIR), .replicas/ by default (git-ignored).
N ?= 3
PORT ?= 8000
STATE_DIR ?= .replicas
replicas: install
	$(PY) deploy/local/replicas.py up -n $(N) --port $(PORT) --state-dir $(STATE_DIR) --servewell $(VENV)/bin/servewell \
		-- --log-format console

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build/site
