# The two commands a newcomer needs: `make serve` and `make test`.
# Both create .venv and install the project on first use (torch==2.13.0: the CPU build).
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.servewell-installed
# Machines of this kind keep the CPU build of torch in /opt/wheels; elsewhere pip's index serves it.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)

.PHONY: install serve test bench clean replicas

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(FIND_LINKS) -e '.[test,bench]'
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/servewell serve --host 127.0.0.1 --port 8000 --log-format console

test: install
	$(VENV)/bin/pytest -q

bench: install
	$(PY) -m bench.run

# N replicas of `make serve`'s server behind HAProxy on 127.0.0.1:$(PORT) (replicas on the next N ports), in
# the foreground until Ctrl-C; deploy/local/replicas.py status|restart|down from another terminal.
N ?= 3
PORT ?= 8000
replicas: install
	$(PY) deploy/local/replicas.py up -n $(N) --port $(PORT) --servewell $(VENV)/bin/servewell -- --log-format console

clean:
	rm -rf $(VENV) .pytest_cache
