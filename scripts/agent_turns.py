#!/usr/bin/env python
"""Turn by turn, where an agent run's conversations kept the key (`scripts/bench_agent.py`'s
JSON lines): one JSON line per session and one per cell.

    python scripts/agent_turns.py docs/results/agent_tuning_full_replies_smollm2.jsonl
    python scripts/agent_turns.py docs/results/agent_tuning_chat_replies_smollm2.jsonl \\
        --reference docs/results/agent_tuning_full_replies_smollm2.jsonl full
    python scripts/agent_turns.py docs/results/agent_tuning_replayed_smollm2.jsonl \\
        --fed docs/results/agent_tuning_full_replies_smollm2.jsonl full

Per session (`sgl_vtoken_tools/bench/agent_turns.py`): `key_turns`, the turns before the
question whose reply in the history states the whole key; `hit`; `copy`, right with the key in
the reply just before the question (a copy of it answers, no fact from further back is needed);
`first_difference`, the first turn whose reply differs from the `--reference` cell's. Per cell:
hits, hits that copy the reply before, sessions whose every reply states the key. A run made
with `--replies` must be given the same file as `--fed` (its histories hold those replies).
"""

from __future__ import annotations

import argparse
import json
import sys


def _replies(path: str, cell: str) -> dict:
    from sgl_vtoken_tools.bench.agent_chat import load_replies

    with open(path) as f:
        return load_replies([json.loads(line) for line in f], cell)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run", help="a bench_agent.py run's JSON lines")
    p.add_argument("--reference", nargs=2, metavar=("JSONL", "CELL"), help="replies to compare")
    p.add_argument("--fed", nargs=2, metavar=("JSONL", "CELL"), help="the run's --replies")
    args = p.parse_args(argv)
    from sgl_vtoken_tools.bench.agent_turns import cells, sessions

    with open(args.run) as f:
        lines = [json.loads(line) for line in f]
    config = next((r for r in lines if r.get("kind") == "config"), {})
    if config.get("replies") and not args.fed:
        raise SystemExit(
            f"{args.run} was played with --replies {' '.join(config['replies'])}: "
            "give that file and cell as --fed"
        )
    fed = _replies(*args.fed) if args.fed else None
    reference = _replies(*args.reference) if args.reference else None
    recs = sessions(lines, fed, reference)
    for r in recs + cells(recs):
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
