"""Turn by turn, where an agent run's conversations kept the key: for each session, which of the
replies fed back into its history state the key, whether its answer is a copy of the reply just
before the question, and the first turn at which its replies part from another cell's.

    sessions(lines, fed=None, reference=None)   one record per (cell, repeat, session)
    cells(records)                              one summary per cell (all repeats together)

`lines` are a `scripts/bench_agent.py` run's JSON lines (request lines with their `reply`,
answer lines with the key as `expected`). `fed`: ``(session, turn) -> reply`` fed back instead
of the server's own (`agent_chat.load_replies`; the run's ``--replies``), so the history's reply
is the fed one. `reference`: another cell's replies the same way, for `first_difference`.
"""

from __future__ import annotations

import re
from collections import defaultdict


def _states(text: str, key: str) -> bool:
    return re.search(rf"(?<!\d){re.escape(key)}(?!\d)", text or "") is not None


def sessions(
    lines: list[dict],
    fed: dict[tuple[str, int], str] | None = None,
    reference: dict[tuple[str, int], str] | None = None,
) -> list[dict]:
    """Per (cell, repeat, session): ``key_turns``, the turns before the last whose reply in the
    history states the whole key; ``hit``; ``copy``, right with the key in the reply just
    before the question; ``first_difference``, the first turn whose own reply differs from
    `reference`'s (None: none differs, or no reference)."""
    replies: dict[tuple, dict[int, str]] = defaultdict(dict)
    for r in lines:
        if r.get("kind") == "request" and "reply" in r:
            replies[(r["cell"], r["repeat"], r["conversation"])][r["turn"]] = r["reply"]
    out = []
    for a in (r for r in lines if r.get("kind") == "answer"):
        sid, key = a["conversation"], a["expected"]
        own = replies[(a["cell"], a["repeat"], sid)]
        last = max(own, default=0)
        said = {t: (fed or {}).get((sid, t), own[t]) for t in own if t < last}
        differ = [t for t in sorted(own) if reference and reference.get((sid, t)) != own[t]]
        out.append(
            {
                "kind": "session",
                "cell": a["cell"],
                "repeat": a["repeat"],
                "conversation": sid,
                "fact_turn": a.get("fact_turn"),
                "turns": last,
                "key_turns": [t for t in sorted(said) if _states(said[t], key)],
                "hit": a["hit"],
                "copy": a["hit"] and _states(said.get(last - 1, ""), key),
                "first_difference": differ[0] if differ else None,
            }
        )
    return out


def cells(records: list[dict]) -> list[dict]:
    """Per cell: sessions played (over repeats), hits, hits that copy the reply before the
    question, and sessions whose every reply before the question states the key."""
    out = []
    for c in dict.fromkeys(r["cell"] for r in records):
        rs = [r for r in records if r["cell"] == c]
        out.append(
            {
                "kind": "cell",
                "cell": c,
                "sessions": len(rs),
                "hits": sum(r["hit"] for r in rs),
                "hits_copying_the_reply_before": sum(r["copy"] for r in rs),
                "key_in_every_reply": sum(len(r["key_turns"]) == r["turns"] - 1 for r in rs),
            }
        )
    return out
