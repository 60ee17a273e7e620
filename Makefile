# The two commands a newcomer needs: `make serve` and `make test`.
# Both create .venv and install the project on first use (torch==2.13.0: the CPU build).
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.servewell-installed
# Machines of this kind keep the CPU build of torch in /opt/wheels; elsewhere pip's index serves it.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)

.PHONY: install serve test fuzz bench clean

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

# The fuzzing tests of `make test` with many more examples (hypothesis properties of the codecs and
# image decoding, schemathesis against /openapi.json); estimated at half an hour on 2 cores.
fuzz: install
	SERVEWELL_FUZZ=long $(VENV)/bin/pytest -q -p no:cacheprovider tests/unit/api/test_tensor_codec_properties.py \
		tests/unit/test_imaging_properties.py tests/e2e/test_openapi_fuzz.py

bench: install
	$(PY) -m bench.run

clean:
	rm -rf $(VENV) .pytest_cache
