"""Mutation check: change one policy detail of the runtime at a time and see which tests fail.

The policy oracles (`tests/runtime/oracles/`) restate every policy from its paper and share no code with
`sgl_vtoken/`; a detail that drifts in the runtime must make them disagree. Each mutation below
replaces one exact string (found exactly once) in one runtime file, runs `--tests` against the
mutated tree, and puts the file back (also on Ctrl-C or an error). One JSON line per mutation:
whether a test failed ("caught") and which.

    python -m sgl_vtoken_tools mutation-check --out docs/results/mutation_check.jsonl
    python -m sgl_vtoken_tools mutation-check --only window-off-by-one --tests tests/runtime/oracles

Run it on a clean tree: it edits files of the working tree in place, one at a time.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from sgl_vtoken_tools.cli import common
from sgl_vtoken_tools.cli.common import REPO

# name: (file, exact text, replacement, what the change means)
MUTATIONS = {
    "window-off-by-one": (
        "sgl_vtoken/selection.py",
        "(j >= (lengths - window)[:, None])",
        "(j > (lengths - window)[:, None])",
        "the recent window keeps one token fewer",
    ),
    "sinks-off-by-one": (
        "sgl_vtoken/selection.py",
        "(positions < sink[:, None])",
        "(positions <= sink[:, None])",
        "one sink more",
    ),
    "pool-neighbour-offset": (
        "sgl_vtoken/policies/base.py",
        "x, kernel, stride=1, padding=kernel // 2, count_include_pad=False\n    )[0, 0]",
        "x, kernel, stride=1, padding=kernel // 2, count_include_pad=False\n    )[0, 0].roll(1)",
        "the pooled score reads the window one token to the left",
    ),
    "h2o-aggregation-sum": (
        "sgl_vtoken/policies/h2o.py",
        'aggregation: str = "max"',
        'aggregation: str = "sum"',
        "H2O's default aggregation over layers and heads: sum instead of max",
    ),
    "h2o-mean-not-sum": (
        "sgl_vtoken/stats.py",
        "acc + probs.sum(dim=0).to(acc.dtype)",
        "acc + probs.mean(dim=0).to(acc.dtype)",
        "H2O accumulates the mean attention of each block of queries, not the sum",
    ),
    "tova-first-query": (
        "sgl_vtoken/stats.py",
        "self.state = probs[-1].to(self.dtype)",
        "self.state = probs[0].to(self.dtype)",
        "TOVA scores by the first query of a block, not the last",
    ),
    "scissorhands-threshold": (
        "sgl_vtoken/stats.py",
        "limit = threshold / lengths.clamp(min=1).to(probs.dtype)",
        "limit = threshold / (lengths.clamp(min=1) + 1).to(probs.dtype)",
        "Scissorhands' low-importance bar divides by one key more",
    ),
    "scissorhands-history": (
        "sgl_vtoken/stats.py",
        "take = min(q, history)",
        "take = min(q, history - 1)",
        "Scissorhands counts one query fewer",
    ),
    "knorm-sign": (
        "sgl_vtoken/policies/knorm.py",
        'aggregate(-view.require("keys").float().norm(dim=-1), self.aggregation)',
        'aggregate(view.require("keys").float().norm(dim=-1), self.aggregation)',
        "key-norm keeps the largest keys instead of the smallest",
    ),
    "random-seed-ignored": (
        "sgl_vtoken/policies/random_policy.py",
        "return hash_u01(view.positions, self.seed, view.rid, view.step)",
        "return hash_u01(view.positions, 0, view.rid, view.step)",
        "the random policy ignores its seed",
    ),
    "units-letters-only": (
        "sgl_vtoken/units.py",
        "return ch.isalnum()",
        "return ch.isalpha()",
        "span-aware keeping no longer joins digits into one unit",
    ),
    "recall-unpooled": (
        "sgl_vtoken/recall.py",
        "order = ranking(smooth(scores.double().cpu(), pool))",
        "order = ranking(scores.double().cpu())",
        "recall ranks candidates without pooling their scores",
    ),
}
DEFAULT_TESTS = ["tests/runtime/oracles", "tests/runtime/lib/policies"]


def mutate(path: Path, old: str, new: str) -> str:
    """Replace the one occurrence of `old` in `path`; returns the original text."""
    text = path.read_text()
    count = text.count(old)
    if count != 1:
        raise SystemExit(
            f"{path}: the mutation's text occurs {count} times (must be once): {old!r}"
        )
    path.write_text(text.replace(old, new))
    return text


def run_tests(tests: list[str], timeout: int) -> tuple[int, list[str], float]:
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", *tests],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    failed = re.findall(r"^FAILED (\S+)", proc.stdout, flags=re.M)
    return proc.returncode, failed, time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__, __name__)
    p.add_argument("--only", nargs="+", choices=list(MUTATIONS), help="these mutations only")
    p.add_argument("--tests", nargs="+", default=DEFAULT_TESTS, help="pytest paths to run")
    p.add_argument("--timeout", type=int, default=1200, help="seconds per test run")
    p.add_argument("--out", help="JSON lines file (default: stdout)")
    args = p.parse_args(argv)
    out = open(args.out, "w") if args.out else sys.stdout
    rc, failed, seconds = run_tests(args.tests, args.timeout)
    base = {"kind": "baseline", "tests": args.tests, "passed": rc == 0, "failed": failed}
    out.write(json.dumps({**base, "seconds": round(seconds, 1)}) + "\n")
    out.flush()
    if rc != 0:
        raise SystemExit(f"the tests fail before any mutation: {failed or rc}")
    for name in args.only or list(MUTATIONS):
        file, old, new, meaning = MUTATIONS[name]
        path = REPO / file
        original = mutate(path, old, new)
        try:
            rc, failed, seconds = run_tests(args.tests, args.timeout)
        finally:
            path.write_text(original)
        line = {
            "kind": "mutation",
            "mutation": name,
            "file": file,
            "change": meaning,
            "caught": rc != 0,
            "failed": failed,
            "seconds": round(seconds, 1),
        }
        out.write(json.dumps(line) + "\n")
        out.flush()
        print(
            f"{name:>24}: {'caught by ' + ', '.join(failed) if rc else 'NOT caught'}",
            file=sys.stderr,
        )
    return 0
