# Two commands on a fresh machine with Python 3.11 and pip: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sgl-vtoken-installed

.PHONY: install demo test bench clean

install: $(STAMP)

# sglang==0.5.23 brings torch, triton and flashinfer (a few GB, a few minutes on first install).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[test]'
	touch $@

demo: $(STAMP)
	$(PY) scripts/demo.py

test: $(STAMP)
	$(PY) -m pytest

# No-Evict vs Naive-Evict vs vToken on the agent benchmark (CPU, tiny model): rewrites the bench
# section of docs/RESULTS.md and docs/img/bench_*.png (about 5 to 15 minutes on two cores).
bench: $(STAMP)
	$(PY) scripts/bench_matrix.py

clean:
	rm -rf $(VENV) .cache .pytest_cache .hypothesis
