# Two entry points for a fresh machine: `make demo` (the main job) and `make test` (the suite).
# Both create .venv and install everything on first use.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.megascope-installed
TESTSTAMP := $(VENV)/.megascope-test-extras

.PHONY: setup demo test test-fast bench clean

$(STAMP): pyproject.toml scripts/install-torch.sh
	$(PYTHON) -m venv $(VENV)
	scripts/install-torch.sh $(PY)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

# the suite also traces a Hugging Face Trainer job (the optional `attach` extra) and writes TensorBoard logs
# (`tensorboard`); the demo needs none of it
$(TESTSTAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[test,attach,tensorboard]'
	touch $@

setup: $(STAMP)

demo: setup
	$(VENV)/bin/megascope demo

test: $(TESTSTAMP)
	$(VENV)/bin/ruff check .
	MYPY=$(VENV)/bin/mypy scripts/typecheck.sh
	$(PY) -m pytest -q

# the same checks without the tests marked `slow` (multi-process and end-to-end jobs): the quick loop
test-fast: $(TESTSTAMP)
	$(VENV)/bin/ruff check .
	MYPY=$(VENV)/bin/mypy scripts/typecheck.sh
	$(PY) -m pytest -q -m "not slow"

# five of the benchmarks (trainer, analyzer accuracy and scale); the others are run one by one, each
# with the command its table in docs/measurements.md names
bench: setup
	$(PY) benchmarks/tracer_overhead.py
	$(PY) benchmarks/ddp_compare.py
	$(PY) benchmarks/pipeline_bubble.py
	$(PY) benchmarks/analyzer_accuracy.py
	$(PY) benchmarks/analyzer_scale.py

clean:
	rm -rf $(VENV) runs build *.egg-info
