# logit-distill: `make demo` runs the main job, `make test` the test suite.
# Both create or refresh .venv from pyproject.toml first.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv test demo compile lock bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[pipelines,test]'
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	$(PY) -m pipelines.demo

compile: $(STAMP)
	$(PY) -m pipelines.compile

# containers/requirements-{cpu,cuda,tpu}.lock: the component image's packages per backend, pinned with hashes,
# from containers/image.toml (run on Linux x86_64, CPython 3.11: the image's platform).
lock: $(STAMP)
	$(PY) containers/lock.py

bench: $(STAMP)
	$(PY) -m bench.run

clean:
	rm -rf $(VENV) demo-output bench/out
