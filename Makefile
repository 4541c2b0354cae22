# `make test` and `make demo` each do all set-up on a fresh machine: a virtualenv in .venv,
# torch (CPU build pinned; set TORCH_SPEC to change it), the project, then run.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

demo: $(STAMP)
	$(PY) examples/demo.py --out demo_out

clean:
	rm -rf $(VENV) demo_out
