# `make test` and `make run` set everything up from nothing: a fresh clone needs no other step.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test run setup clean

setup: $(STAMP)

# torch first, pinned, so pip takes the local CPU wheel instead of several GB of CUDA builds.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

run: $(STAMP)
	@echo "raysample: the batch job (cluster.job) lands with issue 7; until then 'make run' only sets up the environment."
	$(PY) -c "import processors; print('processors', len(processors.__all__), 'names importable')"

clean:
	rm -rf $(VENV) build *.egg-info
