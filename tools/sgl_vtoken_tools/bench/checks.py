"""What makes Naive-Evict vs vToken a comparison of reclamation alone, checked on the runs
themselves: the same request ids (so the same seeded victims), identical outputs request by
request, equal evicted-token counts run by run, and whether both cached the same prompt tokens;
and whether each mode returned the same outputs in every repeat."""

from __future__ import annotations

from sgl_vtoken_tools.bench.cells import Cell, groups


def _requests(cell: Cell) -> dict:
    """(repeat, run, session, turn) -> request record, over every run of every repeat."""
    out = {}
    for r, rep in enumerate(cell.repeats):
        for name, run in rep.items():
            for q in run["requests"]:
                out[(r, name, q["session"], q["turn"])] = q
    return out


def _runs(cell: Cell) -> dict:
    return {
        (r, name): run["summary"] for r, rep in enumerate(cell.repeats) for name, run in rep.items()
    }


def compare_cells(a: Cell, b: Cell) -> dict:
    """Request-by-request and run-by-run comparison of two cells that played the same workload.

    Pairs are formed within the runs both cells have (a ladder may stop earlier on one side:
    `one_sided_runs` counts those runs, which are not compared). Returns `requests` (pairs where
    both succeeded), `identical` (equal output hashes), `same_rids` (pairs sent with the same
    request id), `unpaired` (a request of a shared run that failed or is missing on one side),
    `first_difference` (the earliest differing pair: repeat, run, session, turn, rid; None when
    all are identical), `runs` (runs on both sides), `evicted_equal` (shared runs whose
    evicted-token deltas agree), `cached` (cached prompt tokens of each side over the shared runs).
    """
    ra, rb = _runs(a), _runs(b)
    both = sorted(set(ra) & set(rb))
    shared = set(both)
    qa, qb = _requests(a), _requests(b)
    pairs, unpaired = [], 0
    for k in sorted(set(qa) | set(qb), key=lambda k: (k[0], k[1], k[3], k[2])):
        if (k[0], k[1]) not in shared:
            continue
        x, y = qa.get(k), qb.get(k)
        if x is None or y is None or x["error"] is not None or y["error"] is not None:
            unpaired += 1
        else:
            pairs.append((k, x, y))
    differ = [(k, x) for k, x, y in pairs if x.get("output_hash") != y.get("output_hash")]
    first = None
    if differ:
        (r, name, session, turn), x = differ[0]
        first = {"repeat": r, "run": name, "session": session, "turn": turn, "rid": x.get("rid")}

    def evicted(s):
        return ((s.get("vtoken") or {}).get("delta") or {}).get("evicted_tokens")

    return {
        "requests": len(pairs),
        "identical": len(pairs) - len(differ),
        "same_rids": sum(
            x.get("rid") is not None and x.get("rid") == y.get("rid") for _, x, y in pairs
        ),
        "unpaired": unpaired,
        "first_difference": first,
        "runs": len(both),
        "one_sided_runs": len(set(ra) ^ set(rb)),
        "evicted_equal": sum(
            evicted(ra[k]) is not None and evicted(ra[k]) == evicted(rb[k]) for k in both
        ),
        "cached": [sum(rs[k]["cached_tokens"] or 0 for k in both) for rs in (ra, rb)],
    }


def repeat_consistency(cell: Cell) -> list[int]:
    """[same, compared]: requests (run, session, turn) that succeeded in at least two repeats, and
    how many of them returned the same output in every repeat (greedy decoding is deterministic,
    so a difference means timing changed what a request attended to)."""
    outs: dict[tuple, set] = {}
    count: dict[tuple, int] = {}
    for (_r, name, session, turn), q in _requests(cell).items():
        if q["error"] is None:
            outs.setdefault((name, session, turn), set()).add(q.get("output_hash"))
            count[(name, session, turn)] = count.get((name, session, turn), 0) + 1
    keys = [k for k, n in count.items() if n >= 2]
    return [sum(len(outs[k]) == 1 for k in keys), len(keys)]


def fair(check: dict) -> bool:
    """Every request paired, sent with the same id and answered identically; every run evicted
    the same number of tokens on both sides."""
    return (
        check["unpaired"] == 0
        and check["requests"] > 0
        and check["identical"] == check["requests"]
        and check["same_rids"] == check["requests"]
        and check["evicted_equal"] == check["runs"]
    )


def fairness_checks(cells: list[Cell]) -> list[dict]:
    """`compare_cells(Naive-Evict, vToken)` for every policy, budget and page size that has both."""
    out = []
    for page, policy, budget, by_mode in groups(cells):
        if "naive" in by_mode and "vtoken" in by_mode:
            out.append(
                {
                    "kind": "check",
                    "page": page,
                    "policy": policy,
                    "budget": budget,
                    **compare_cells(by_mode["naive"], by_mode["vtoken"]),
                    "repeat_consistency": {m: repeat_consistency(c) for m, c in by_mode.items()},
                }
            )
    return out
