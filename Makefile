# Two entry points: `make demo` (the main job) and `make test`. Both build .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench proto clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned to the local CPU wheel: a bare `torch` requirement with no torch
	# installed would download a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvcache bench store

test: $(STAMP)
	$(PY) -m pytest -q -x --durations=15

proto: $(STAMP)
	$(PY) -m proto.generate
	$(PY) -m proto.docs

clean:
	rm -rf $(VENV) *.egg-info
