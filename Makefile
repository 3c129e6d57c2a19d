# logit-distill: `make demo` runs the main job, `make test` the test suite.
# Both create or refresh .venv from pyproject.toml first: the demo installs only what it needs
# (the package and the pipeline tools), the tests add their extras (the reference models). Every package
# installs at the version of containers/requirements-dev.lock (pip constraints; `make lock` writes it, held to
# the component image's lock), so the tests run what the image ships, and a new release on PyPI changes
# nothing until `make lock`.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_STAMP := $(VENV)/.installed-demo
TEST_STAMP := $(VENV)/.installed-test
CONSTRAINTS := containers/requirements-dev.lock

.PHONY: venv test quick-test demo compile lock bench clean

# pip byte-compiles every file it installs, half of the set-up's time (torch, transformers and
# google-cloud-aiplatform are ~200 MB of Python, most of it never imported here); instead Python compiles a
# module when it is first imported and caches it, so make's commands write bytecode even where the
# environment says not to (PYTHONDONTWRITEBYTECODE).
unexport PYTHONDONTWRITEBYTECODE
PIP_INSTALL := $(PY) -m pip install --quiet --no-compile

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) -c $(CONSTRAINTS) --upgrade pip

$(DEMO_STAMP): pyproject.toml $(CONSTRAINTS) | $(VENV)/bin/python
	$(PIP_INSTALL) -c $(CONSTRAINTS) -e '.[pipelines]'
	touch $(DEMO_STAMP)

$(TEST_STAMP): pyproject.toml $(CONSTRAINTS) | $(VENV)/bin/python
	$(PIP_INSTALL) -c $(CONSTRAINTS) -e '.[pipelines,test]'
	touch $(TEST_STAMP) $(DEMO_STAMP)

venv: $(TEST_STAMP)

# the test files run in parallel, one file per worker at a time (a file's module fixtures are built once),
# in the order tests/conftest.py collects them (the longest files first: xdist would otherwise start the files
# with the most tests first and leave the one-test demo file to the end); TEST_WORKERS=1 runs them one after another
TEST_WORKERS ?= 3
PYTEST_PARALLEL := $(if $(filter 1,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

test: $(TEST_STAMP)
	$(PY) -m pytest -q $(PYTEST_PARALLEL)

# the quick loop: everything but the multi-process, kill and image tests (pytest -m slow)
quick-test: $(TEST_STAMP)
	$(PY) -m pytest -q $(PYTEST_PARALLEL) -m "not slow"

demo: $(DEMO_STAMP)
	$(PY) -m pipelines.demo

compile: $(DEMO_STAMP)
	$(PY) -m pipelines.compile

# containers/requirements-{cpu,cuda,tpu}.lock: the component image's packages per backend, pinned with hashes,
# and containers/requirements-dev.lock, this venv's, from containers/image.toml (run on Linux x86_64,
# CPython 3.11: the image's platform); the next make test reinstalls the venv at the new versions.
lock: $(DEMO_STAMP)
	$(PY) containers/lock.py

bench: $(TEST_STAMP)
	$(PY) -m bench.run

clean:
	rm -rf $(VENV) demo-output bench/out
