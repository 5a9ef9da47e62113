"""Reading NVIDIA kvpress runs (`python -m sgl_vtoken_tools kvpress` lines) beside ours: the docqa table,
the StreamingLLM agreement, and the choice of each press's options on a tuning run.

`python -m sgl_vtoken_tools kvpress --report/--choose` call these in the main environment; the presses
themselves run in kvpress's own (docs/benchmarks.md, "kvpress side by side").
"""

from __future__ import annotations

import json
import sys


def choose(records: list[dict]) -> list[dict]:
    """Per press (the name before ``:``) and mode: the spec with the most hits over every budget
    and trial of a tuning run; a tie goes to the spec run first (list the library's defaults
    first). One ``choice`` line each, with every candidate's hits."""
    hits: dict[tuple[str, str], dict[str, list[int]]] = {}
    for r in records:
        if r.get("kind") == "press":
            cell = hits.setdefault((r["press"].partition(":")[0], r["mode"]), {})
            cell.setdefault(r["press"], []).append(int(r["hit"]))
    out = []
    for (name, mode), specs in hits.items():
        best = max(specs, key=lambda s: sum(specs[s]))  # first of the best: dicts keep order
        out.append(
            {
                "kind": "choice",
                "press": name,
                "mode": mode,
                "spec": best,
                "hits": sum(specs[best]),
                "trials": len(specs[best]),
                "candidates": {s: sum(h) for s, h in specs.items()},
            }
        )
    return out


def agreement(
    ours: list[dict],
    presses: list[dict],
    setting: str = "streamingllm",
    press: str = "streamingllm",
    mode: str = "aware",
) -> list[dict]:
    """Per budget: trials whose greedy answer ids (both end with ``<|im_end|>`` when the reply
    closes) are equal in our `setting` and kvpress's `press` in `mode`, and the trials that differ."""
    mine = {
        (r["trial"], r["budget"]): r["output_ids"]
        for r in ours
        if r.get("kind") == "trial" and r.get("setting") == setting
    }
    out = []
    for b in sorted({r["budget"] for r in presses if r.get("kind") == "press"}):
        theirs = {
            r["trial"]: r["output_ids"]
            for r in presses
            if r.get("kind") == "press"
            and r["press"] == press
            and r["mode"] == mode
            and r["budget"] == b
        }
        both = [t for t in theirs if (t, b) in mine]
        differ = [t for t in both if mine[(t, b)] != theirs[t]]
        out.append(
            {
                "kind": "agreement",
                "setting": setting,
                "press": press,
                "mode": mode,
                "budget": b,
                "equal": len(both) - len(differ),
                "trials": len(both),
                "differ": differ,
            }
        )
    return out


def table(ours: list[dict], presses: list[dict]) -> str:
    """Markdown: docqa hits / trials per budget, our settings (full cache first) then every
    kvpress press and mode, from the trial and press records alone."""
    rows: dict[str, dict] = {}
    for r in ours:
        if r.get("kind") == "trial" and r.get("task") == "docqa":
            rows.setdefault(f"ours `{r['setting']}`", {}).setdefault(r["budget"], []).append(
                r["hit"]
            )
    for r in presses:
        if r.get("kind") == "press":
            rows.setdefault(f"kvpress `{r['press']}` ({r['mode']})", {}).setdefault(
                r["budget"], []
            ).append(r["hit"])
    budgets = sorted({b for cells in rows.values() for b in cells if b is not None})
    full = next((cells[None] for cells in rows.values() if None in cells), None)
    lines = [
        f"full cache: {sum(full)}/{len(full)}\n" if full else "",
        "| setting | " + " | ".join(f"budget {b}" for b in budgets) + " |",
        "|---|" + "---:|" * len(budgets),
    ]
    for name, cells in rows.items():
        if None in cells:
            continue
        lines.append(
            f"| {name} | "
            + " | ".join(f"{sum(cells[b])}/{len(cells[b])}" if b in cells else "-" for b in budgets)
            + " |"
        )
    return "\n".join(line for line in lines if line) + "\n"


def tuned_table(splits: dict[str, list[dict]], choices: list[dict]) -> str:
    """Markdown: docqa hits / trials per split and budget, each press and mode at its defaults
    and (where the tuning run chose other options: `choose`'s lines) tuned. A trial run twice
    (a split's files overlap) counts once; two runs that disagree raise ValueError."""
    chosen = {(c["press"], c["mode"]): c["spec"] for c in choices}
    seen: dict[tuple, bool] = {}
    order: dict[tuple[str, str], None] = {}
    for split, records in splits.items():
        for r in records:
            if r.get("kind") == "press":
                key = (split, r["press"], r["mode"], r["budget"], r["trial"])
                if seen.setdefault(key, r["hit"]) != r["hit"]:
                    raise ValueError(f"{key}: two runs of one trial disagree")
                order.setdefault((r["press"].partition(":")[0], r["mode"]), None)
    hits: dict[tuple, list] = {}
    for (split, spec, mode, budget, _), hit in seen.items():
        hits.setdefault((split, spec, mode, budget), []).append(hit)
    budgets = sorted({key[3] for key in hits})
    cols = [(split, b) for split in splits for b in budgets]
    lines = [
        "| press (mode) | options | " + " | ".join(f"{s} {b}" for s, b in cols) + " |",
        "|---|---|" + "---:|" * len(cols),
    ]
    for name, mode in order:
        spec = chosen.get((name, mode), name)
        tuned = (name, mode) in chosen
        rows = [("defaults" + (" (chosen)" if tuned and spec == name else ""), name)]
        if spec != name:
            rows.append((f"tuned: `{spec.partition(':')[2]}`", spec))
        for label, s in rows:
            cells = [hits.get((split, s, mode, b)) for split, b in cols]
            lines.append(
                f"| `{name}` ({mode}) | {label} | "
                + " | ".join(f"{sum(c)}/{len(c)}" if c else "-" for c in cells)
                + " |"
            )
    return "\n".join(lines) + "\n"


def report(args) -> int:
    if args.tuned_table:
        splits = {}
        for arg in args.tuned_table:
            name, _, paths = arg.partition("=")
            splits[name] = [json.loads(x) for path in paths.split(",") for x in open(path)]
        choices = [json.loads(x) for path in args.choices or [] for x in open(path)]
        md = tuned_table(splits, [c for c in choices if c.get("kind") == "choice"])
        print(md)
        if args.markdown:
            open(args.markdown, "w").write(md)
        return 0
    presses = [json.loads(line) for path in args.report for line in open(path)]
    ours = [json.loads(line) for line in open(args.ours)] if args.ours else []
    md = table(ours, presses)
    if ours:
        agree = agreement(ours, presses)
        md += (
            "\nStreamingLLM (aware) vs ours `streamingllm`, equal greedy answers: "
            + ", ".join(f"budget {a['budget']} {a['equal']}/{a['trials']}" for a in agree)
            + "\n"
        )
        for a in agree:
            print(json.dumps(a), file=sys.stderr)
    print(md)
    if args.markdown:
        open(args.markdown, "w").write(md)
    return 0
