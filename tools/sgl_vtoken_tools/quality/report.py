"""Summaries, markdown tables and the plot of a quality run, from its JSON lines alone.

Every figure is recomputed from the ``trial`` records, so a committed ``.jsonl`` regenerates the
tables (``python -m sgl_vtoken_tools quality --report FILE``). One ``summary`` record per cell:

    passkey   hits / trials (exact match of the pass key), needle_kept (mean fraction of the
              needle's tokens the first eviction kept)
    recall    hits / trials (the fact asked at the last turn)
    docqa     hits / trials of the split's document questions (splits.py)
    session   hits / trials of the split's conversations (the fact asked at the last turn)
    kv        hits / trials of the split's dense key-value lists (a whole 7-digit value);
              kv_prefix: the fraction answered with a strict prefix of the value (retrieval.py)
    needle    hits / trials of one 7-digit value in a repeated filler; needle_prefix likewise
    ppl       exp(sum nll / sum tokens) of the teacher-forced held-out continuations
    top1      fraction of those positions whose prediction equals the full cache's
    greedy    mean fraction of greedy continuation tokens equal to the full cache's
"""

from __future__ import annotations

import math
from collections import defaultdict

from sgl_vtoken_tools.bench.plots import pyplot, save
from sgl_vtoken_tools.quality.settings import FULL

METRICS = {  # name: (title, higher is better)
    "passkey": ("passkey retrieval, exact match", True),
    "needle_kept": ("passkey: fraction of the needle's tokens the first eviction keeps", True),
    "recall": ("multi-turn recall, exact match", True),
    "docqa": ("document question (split tasks), exact match", True),
    "session": ("conversation recall (split tasks), exact match", True),
    "kv": ("dense key-value retrieval (split tasks), whole value", True),
    "kv_prefix": ("dense key-value retrieval: answers a strict prefix of the value", False),
    "needle": ("one value in a repeated filler (split tasks), whole value", True),
    "needle_prefix": ("one value in a filler: answers a strict prefix of the value", False),
    "ppl": ("perplexity, held-out essays", False),
    "top1": ("top-1 agreement with the full cache", True),
    "greedy": ("greedy agreement with the full cache", True),
}
HIT_TASKS = ("passkey", "recall", "docqa", "session", "kv", "needle")  # scored by exact match
PREFIX_TASKS = ("kv", "needle")  # also count answers that are a strict prefix of the value


def summarize(records: list[dict]) -> list[dict]:
    """One ``summary`` record per (setting, budget), full cache first, in first-seen order."""
    cells: dict[tuple, dict] = {}
    for r in records:
        if r.get("kind") != "trial":
            continue
        key = (r["setting"], r["budget"])
        c = cells.setdefault(key, {"policy": r["policy"], "acc": defaultdict(list)})
        acc = c["acc"]
        task = r["task"]
        if task in HIT_TASKS:
            acc[task].append(bool(r["hit"]))
            if task == "passkey" and r.get("needle_kept") is not None:
                acc["needle_kept"].append(r["needle_kept"])
            if task in PREFIX_TASKS:
                acc[f"{task}_prefix"].append(r.get("outcome") == "prefix")
        elif task == "lm":
            acc["nll"].append(r["nll"])
            acc["tokens"].append(r["tokens"])
            acc["top1"].append(r["top1"])
            acc["greedy"].append(r["greedy_agree"])
        acc["seconds"].append(r.get("seconds", 0.0))
    out = []
    for (setting, budget), c in cells.items():
        a = c["acc"]
        row = {"kind": "summary", "setting": setting, "policy": c["policy"], "budget": budget}
        for task in HIT_TASKS:
            if a[task]:
                row[task] = round(sum(a[task]) / len(a[task]), 4)
                row[f"{task}_hits"], row[f"{task}_trials"] = sum(a[task]), len(a[task])
        for task in PREFIX_TASKS:
            if a[f"{task}_prefix"]:
                row[f"{task}_prefix"] = round(sum(a[f"{task}_prefix"]) / len(a[task]), 4)
        if a["needle_kept"]:
            row["needle_kept"] = round(sum(a["needle_kept"]) / len(a["needle_kept"]), 4)
        if a["tokens"]:
            tokens = sum(a["tokens"])
            row["ppl"] = round(math.exp(sum(a["nll"]) / tokens), 3)
            row["top1"] = round(sum(a["top1"]) / tokens, 4)
            row["greedy"] = round(sum(a["greedy"]) / len(a["greedy"]), 4)
            row["lm_tokens"] = tokens
        row["seconds"] = round(sum(a["seconds"]), 1)
        out.append(row)
    out.sort(key=lambda r: (r["setting"] != FULL,))
    return out


def _fmt(row: dict, metric: str) -> str:
    v = row.get(metric)
    if v is None:
        return "-"
    if metric in HIT_TASKS:
        return f"{row[metric + '_hits']}/{row[metric + '_trials']}"
    return f"{v:.2f}" if metric in ("ppl", "needle_kept") else f"{v:.3f}"


def markdown(summaries: list[dict], metrics: tuple[str, ...] = tuple(METRICS)) -> str:
    """One pivot table per metric: settings as rows, budgets as columns, full cache on top."""
    budgets = sorted({s["budget"] for s in summaries if s["budget"] is not None})
    settings = list(dict.fromkeys(s["setting"] for s in summaries if s["setting"] != FULL))
    by = {(s["setting"], s["budget"]): s for s in summaries}
    full = next((s for s in summaries if s["setting"] == FULL), None)
    parts = []
    for m in metrics:
        if not any(m in s for s in summaries):
            continue
        title, higher = METRICS[m]
        head = (
            f"**{title}** ({'higher' if higher else 'lower'} is better; full cache: "
            f"{_fmt(full, m) if full else '-'})\n\n"
        )
        lines = [
            "| setting | " + " | ".join(f"budget {b}" for b in budgets) + " |",
            "|---|" + "---:|" * len(budgets),
        ]
        for name in settings:
            cells = [_fmt(by[(name, b)], m) if (name, b) in by else "-" for b in budgets]
            lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
        parts.append(head + "\n".join(lines))
    return "\n\n".join(parts) + "\n"


def plot(summaries: list[dict], path, title: str = "") -> None:
    """Score vs budget, one line per setting (a colour per policy; its first setting solid, the
    others dashed), one panel per metric, the full cache dashed black; legend below."""
    plt = pyplot()

    metrics = [m for m in METRICS if any(m in s for s in summaries)]
    cols = min(3, len(metrics))
    rows = -(-len(metrics) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.4 * rows + 1.2), squeeze=False)
    full = next((s for s in summaries if s["setting"] == FULL), None)
    settings = list(dict.fromkeys(s["setting"] for s in summaries if s["setting"] != FULL))
    policies = list(dict.fromkeys(s["policy"] for s in summaries if s["setting"] != FULL))
    colour = {p: plt.get_cmap("tab10")(i % 10) for i, p in enumerate(policies)}
    seen: set[str] = set()
    style = {}
    for name in settings:
        pol = next(s["policy"] for s in summaries if s["setting"] == name)
        style[name] = dict(color=colour[pol], linestyle="-" if pol not in seen else "--")
        seen.add(pol)
    budgets = sorted({s["budget"] for s in summaries if s["budget"] is not None})
    for ax, m in zip(axes.flat, metrics):
        for name in settings:
            pts = sorted((s["budget"], s[m]) for s in summaries if s["setting"] == name and m in s)
            if pts:
                ax.plot(*zip(*pts), marker="o", markersize=3, label=name, **style[name])
        if full is not None and m in full:
            ax.axhline(full[m], color="black", linestyle=":", label="full cache")
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_xlabel("KV budget (tokens)")
        ax.set_title(METRICS[m][0], fontsize=9)
        if m == "ppl":
            ax.set_yscale("log")
    for ax in list(axes.flat)[len(metrics) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=7, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    save(fig, path, 90, rect=(0, 0.05 + 0.02 * len(labels) / 3, 1, 1))
