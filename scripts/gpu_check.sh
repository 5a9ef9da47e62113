#!/usr/bin/env bash
# One prepared GPU run of the sgl-vtoken Triton kernels, on any CUDA machine with torch, triton
# and pytest; SGLang is not needed and the package need not be installed (run it from a copy of
# the repository as it is).
#
#   scripts/gpu_check.sh [OUT_DIR]                   # about 6 minutes on an H200
#   GPU_CHECK_DRY=1 scripts/gpu_check.sh [OUT_DIR]   # CPU: the same steps, tiny shapes, interpreter
#
# Steps, each independent (a failure is logged and the next step runs), within a time budget
# (GPU_CHECK_BUDGET_S, default 400 s; each step gets a bounded share of what is left):
#   1. pytest -m gpu tests/runtime/kernels (compiled)    -> pytest-gpu.log
#   2. `sgl_vtoken_tools kernels`: host cost per call, repacker vs copy bandwidth (256..65536 moves:
#      do_bench, API wall, host and CUDA-graph time), scores vs their K read floor (batch 8/64/256
#      x 2K/4K, with and without LSE)                    -> bench_kernels.jsonl, bench.log
#   3. every other kernel test, compiled on the GPU      -> pytest-compiled.log
#   4. launch-parameter sweeps (repacker, score kernel)  -> bench_kernels.jsonl, bench.log
#   5. `sgl_vtoken_tools graph-scores`: decode scoring captured in a CUDA graph at batch 1/8/64/256
#      (8B shapes, rows of budget 256 + interval 16 + page 16), replays equal to eager and timed
#      against it                                         -> bench_graph_scores.jsonl
#   then summary.txt: device, each step's status and time, the benchmark's tables
# OUT_DIR defaults to $OUT, else build/gpu_check. Exit status: the first failing step's.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${1:-${OUT:-$ROOT/build/gpu_check}}"
PY="${PYTHON:-python}"
DRY="${GPU_CHECK_DRY:-0}"
BUDGET="${GPU_CHECK_BUDGET_S:-400}"
START=$SECONDS
mkdir -p "$OUT_DIR"
cd "$ROOT"
SUMMARY="$OUT_DIR/summary.txt"
: > "$SUMMARY"

if [ "$DRY" = 1 ]; then
    export TRITON_INTERPRET=1
    echo "gpu_check: DRY run on CPU (Triton interpreter, tiny shapes): checks the script, not the GPU" | tee -a "$SUMMARY"
elif ! "$PY" -c "import torch, triton, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: needs torch with a visible CUDA device and triton (GPU_CHECK_DRY=1 for a CPU dry run)" | tee -a "$SUMMARY" >&2
    exit 2
else
    export TRITON_INTERPRET=0
fi

if ! "$PY" -c "import pytest" 2>/dev/null; then
    echo "gpu_check: pytest is missing; trying pip install pytest" >&2
    "$PY" -m pip install -q pytest || echo "gpu_check: no pytest: the test steps will fail" | tee -a "$SUMMARY" >&2
fi

# sgl_vtoken.kernels lives in kernels/ and is mapped into the package at install time. Without an
# install, assemble the package from symlinks in a scratch directory (no SGLang import happens),
# and put tools/ (sgl_vtoken_tools, whose commands run the benchmarks) on the path beside it. The
# commands run as `python -P -m sgl_vtoken_tools`: -P keeps the working directory, the repository
# root, off sys.path, so its sgl_vtoken/ (without kernels/) does not hide the assembled package.
PYTEST_CWD="$ROOT"
if ! "$PY" -c "import sgl_vtoken.kernels" 2>/dev/null; then
    SHIM="$(mktemp -d)"
    trap 'rm -rf "$SHIM"' EXIT
    mkdir -p "$SHIM/sgl_vtoken"
    for f in "$ROOT"/sgl_vtoken/*; do ln -s "$f" "$SHIM/sgl_vtoken/"; done
    [ -e "$SHIM/sgl_vtoken/__init__.py" ] || : > "$SHIM/sgl_vtoken/__init__.py"
    ln -s "$ROOT/kernels" "$SHIM/sgl_vtoken/kernels"
    ln -s "$ROOT/patches" "$SHIM/sgl_vtoken/patches"  # patches/attention.py imports SGLang lazily
    export PYTHONPATH="$SHIM:$ROOT/tools${PYTHONPATH:+:$PYTHONPATH}"
    PYTEST_CWD="$SHIM"  # `python -m pytest` puts the cwd first: keep the repo's sgl_vtoken/ off it
    (cd "$SHIM" && "$PY" -c "import sgl_vtoken.kernels") || { echo "gpu_check: cannot import sgl_vtoken.kernels" | tee -a "$SUMMARY" >&2; exit 2; }
fi

"$PY" - <<'EOF' 2>&1 | tee -a "$SUMMARY"
import os, platform, torch, triton
if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    p = torch.cuda.get_device_properties(0)
    dev = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs"
else:
    dev = "cpu"
print(f"device: {dev}; python {platform.python_version()}, torch {torch.__version__}, triton {triton.__version__}")
EOF

status=0
left() { echo $((BUDGET - (SECONDS - START))); }
step() {  # step NAME LOG MAX_S CMD...: run with a time limit (SIGINT first: pytest still reports)
    local name="$1" log="$2" cap="$3"; shift 3
    local limit; limit=$(left); [ "$limit" -gt "$cap" ] && limit=$cap
    if [ "$limit" -lt 20 ]; then
        echo "$name: skipped, time budget spent" | tee -a "$SUMMARY"; return
    fi
    local t0=$SECONDS
    if command -v timeout > /dev/null; then
        timeout -s INT -k 15 "$limit" "$@" > "$log" 2>&1
    else  # no coreutils timeout: run unbounded rather than not at all
        "$@" > "$log" 2>&1
    fi
    local rc=$?
    local note=""; [ "$rc" -eq 124 ] || [ "$rc" -eq 130 ] && note=" (stopped at its ${limit} s limit)"
    echo "$name: rc=$rc, $((SECONDS - t0)) s$note; $(grep -E '(passed|failed|error|skipped|no tests ran)' "$log" | tail -1)" | tee -a "$SUMMARY"
    if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
}

run_pytest() { (cd "$PYTEST_CWD" && "$PY" -m pytest --rootdir "$ROOT" -c "$ROOT/pyproject.toml" -q -rfE -p no:cacheprovider "$@"); }
export -f run_pytest
export PYTEST_CWD PY ROOT
K="$ROOT/tests/runtime/kernels"
# new code first: the score kernel and the buffer-set cache, then the rest
ORDER=("$K/test_attn_scores.py" "$K/test_buffer_set.py" "$K/test_repack.py" "$K/test_repack_rope.py" "$K/test_page_indices.py" "$K/test_attention_registration.py")

step "1 pytest -m gpu (compiled)" "$OUT_DIR/pytest-gpu.log" 150 bash -c 'run_pytest "$@"' _ -m gpu "${ORDER[@]}"

rm -f "$OUT_DIR/bench_kernels.jsonl"
bench() {  # bench NAME CAP ARGS...: the benchmark, stopping new measurements 30 s before its limit
    local name="$1" cap="$2"; shift 2
    local limit; limit=$(left); [ "$limit" -gt "$cap" ] && limit=$cap
    local extra=(); [ "$DRY" = 1 ] && extra=(--cpu-smoke)
    step "$name" "$OUT_DIR/bench.log" "$cap" "$PY" -P -m sgl_vtoken_tools kernels --out "$OUT_DIR/bench_kernels.jsonl" \
        --deadline-s $((limit - 30)) ${extra[@]+"${extra[@]}"} "$@"
}
bench "2 bench_kernels (default launches)" 150

if [ "$DRY" = 1 ]; then  # the interpreter runs the whole suite in minutes: a quick subset
    step "3 pytest kernels (interpreted subset)" "$OUT_DIR/pytest-compiled.log" 200 \
        bash -c 'run_pytest "$@"' _ -m "not gpu" -k "default_launch or tiles_and_splits or validated_once" "${ORDER[@]}"
else  # leaves about 70 s for the sweeps
    step "3 pytest kernels (compiled, not gpu-marked)" "$OUT_DIR/pytest-compiled.log" $(( $(left) - 70 )) \
        bash -c 'run_pytest "$@"' _ -m "not gpu" "${ORDER[@]}"
fi
mv "$OUT_DIR/bench.log" "$OUT_DIR/bench.log.1" 2>/dev/null
bench "4 bench_kernels --sweep-only" 90 --sweep-only --parts scores,repack
cat "$OUT_DIR/bench.log.1" "$OUT_DIR/bench.log" > "$OUT_DIR/bench.log.all" 2>/dev/null
mv "$OUT_DIR/bench.log.all" "$OUT_DIR/bench.log"; rm -f "$OUT_DIR/bench.log.1"

if [ "$DRY" = 1 ]; then
    GRAPH_ARGS=(--device cpu)
else
    GRAPH_ARGS=()
fi
rm -f "$OUT_DIR/bench_graph_scores.jsonl"
step "5 bench_graph_scores" "$OUT_DIR/bench_graph_scores.log" 60 "$PY" -P -m sgl_vtoken_tools graph-scores \
    --out "$OUT_DIR/bench_graph_scores.jsonl" ${GRAPH_ARGS[@]+"${GRAPH_ARGS[@]}"}
[ -s "$OUT_DIR/bench_graph_scores.jsonl" ] && cat "$OUT_DIR/bench_graph_scores.jsonl" >> "$SUMMARY"

if [ -s "$OUT_DIR/bench_kernels.jsonl" ]; then
    "$PY" -P -m sgl_vtoken_tools kernels --summarize "$OUT_DIR/bench_kernels.jsonl" 2>&1 | tee -a "$SUMMARY"
fi
echo "gpu_check: done in $((SECONDS - START)) s, status $status; files: $(cd "$OUT_DIR" && ls | tr '\n' ' ')" | tee -a "$SUMMARY"
exit $status
