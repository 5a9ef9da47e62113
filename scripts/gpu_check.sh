#!/usr/bin/env bash
# One-command GPU check of the sgl-vtoken Triton kernels, on any CUDA machine with torch + triton
# (+ pytest); SGLang is not needed and the package need not be installed.
#
#   scripts/gpu_check.sh [OUT_DIR]          # gpu-marked kernel tests, then the benchmark
#   GPU_CHECK_FULL=1 scripts/gpu_check.sh   # also every other kernel test, compiled on the GPU
#   GPU_CHECK_SWEEP=1 scripts/gpu_check.sh  # also sweep the repacker's launch parameters
#
# Writes OUT_DIR/pytest-gpu.log, OUT_DIR/bench_kernels.jsonl and OUT_DIR/summary.txt
# (OUT_DIR defaults to $OUT, else build/gpu_check). Exit status: first failing step.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${1:-${OUT:-$ROOT/build/gpu_check}}"
PY="${PYTHON:-python}"
mkdir -p "$OUT_DIR"
cd "$ROOT"

if ! "$PY" -c "import torch, triton, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: needs torch with a visible CUDA device and triton" >&2
    exit 2
fi
if ! "$PY" -c "import pytest" 2>/dev/null; then
    echo "gpu_check: pytest is missing; trying pip install pytest" >&2
    "$PY" -m pip install -q pytest || { echo "gpu_check: install pytest first" >&2; exit 2; }
fi

# sgl_vtoken.kernels lives in kernels/ and is mapped into the package at install time. Without an
# install, assemble the package from symlinks in a scratch directory (no SGLang import happens).
PYTEST_CWD="$ROOT"
if ! "$PY" -c "import sgl_vtoken.kernels" 2>/dev/null; then
    SHIM="$(mktemp -d)"
    trap 'rm -rf "$SHIM"' EXIT
    mkdir -p "$SHIM/sgl_vtoken"
    for f in "$ROOT"/sgl_vtoken/*; do ln -s "$f" "$SHIM/sgl_vtoken/"; done
    [ -e "$SHIM/sgl_vtoken/__init__.py" ] || : > "$SHIM/sgl_vtoken/__init__.py"
    ln -s "$ROOT/kernels" "$SHIM/sgl_vtoken/kernels"
    ln -s "$ROOT/patches" "$SHIM/sgl_vtoken/patches"  # patches/attention.py imports SGLang lazily
    export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
    PYTEST_CWD="$SHIM"  # `python -m pytest` puts the cwd first: keep the repo's sgl_vtoken/ off it
    (cd "$SHIM" && "$PY" -c "import sgl_vtoken.kernels") || { echo "gpu_check: cannot import sgl_vtoken.kernels" >&2; exit 2; }
fi

export TRITON_INTERPRET=0 VTOKEN_TEST_GPU=1
"$PY" - <<'EOF' | tee "$OUT_DIR/summary.txt"
import torch, triton
p = torch.cuda.get_device_properties(0)
print(f"device: {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs; "
      f"torch {torch.__version__}, triton {triton.__version__}")
EOF

status=0
step() {  # step NAME LOG CMD...: run with output to the console and LOG; keep the first failure
    local name="$1" log="$2"; shift 2
    local t0=$SECONDS
    "$@" 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]}
    echo "$name: rc=$rc, $((SECONDS - t0)) s" | tee -a "$OUT_DIR/summary.txt"
    if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
}

run_pytest() { (cd "$PYTEST_CWD" && "$PY" -m pytest --rootdir "$ROOT" -c "$ROOT/pyproject.toml" -q -p no:cacheprovider "$@"); }
step "pytest -m gpu tests/kernels" "$OUT_DIR/pytest-gpu.log" run_pytest -m gpu "$ROOT/tests/kernels"
if [ "${GPU_CHECK_FULL:-0}" = 1 ]; then
    step "pytest tests/kernels (compiled, all)" "$OUT_DIR/pytest-full.log" run_pytest -m "not gpu" "$ROOT/tests/kernels"
fi
rm -f "$OUT_DIR/bench_kernels.jsonl"
bench_args=(--out "$OUT_DIR/bench_kernels.jsonl")
[ "${GPU_CHECK_SWEEP:-0}" = 1 ] && bench_args+=(--sweep)
step "bench_kernels" "$OUT_DIR/bench.log" "$PY" scripts/bench_kernels.py "${bench_args[@]}"

"$PY" - "$OUT_DIR/bench_kernels.jsonl" <<'EOF' | tee -a "$OUT_DIR/summary.txt"
import json, sys
try:
    rows = [json.loads(line) for line in open(sys.argv[1])]
except FileNotFoundError:
    sys.exit(0)
print("repack_kv (triton) vs device-to-device copy:")
for r in rows:
    if r["kernel"] == "repack_kv" and r["impl"] == "triton":
        print(f"  {r['pattern']:<10} {r['tokens']:>6} tokens  bm={r['block_moves']} nw={r['num_warps']} cb={r['col_block']}  "
              f"{r['gbps']:7.0f} GB/s = {100 * r['frac_of_copy']:5.1f}% of copy ({r['copy_gbps']:.0f} GB/s), "
              f"{r['us_per_1k_tokens']:7.1f} us/1k tokens (floor {r['floor_us_per_1k_tokens']:.1f})")
EOF
exit $status
