"""Aggregate replayed requests: per-configuration summaries, concurrency under a pool, tables, plots.

Concurrency model: a pool of `pool_pages` pages; the shared prefix pages are held once by the
tree; requests are admitted first-come first-served while their reservation (their peak private
pages under the mode, what budget-aware admission reserves) fits; every step each running
request advances by one step (a prefill chunk or a decoded token); agent turns become ready
when the previous turn of their session finishes. Mean concurrency = request-steps / makespan.
"""

from __future__ import annotations

import heapq
from collections import defaultdict

from sgl_vtoken_tools.bench.plots import pyplot, save

MODE_NAMES = {
    "noevict": "No-Evict",
    "naive": "Naive-Evict",
    "vtoken": "vToken",
    "lazy": "vToken-lazy",
}


def simulate_concurrency(rows: list[dict], pool_pages: int) -> dict:
    """Admission simulation for one (workload, policy, ratio, page size, mode) group of requests."""
    rows = sorted(rows, key=lambda r: r["rid"])
    shared = max((r["shared_pages"] for r in rows), default=0)
    free = pool_pages - shared
    fits = [r for r in rows if r["peak_pages"] <= free]
    by_session = defaultdict(list)
    for r in fits:
        by_session[r["session"]].append(r)
    ready = [s[0] for s in by_session.values()]  # first turn of every session
    nxt = {id(a): b for s in by_session.values() for a, b in zip(s, s[1:])}
    ready.sort(key=lambda r: r["rid"])
    running: list[tuple[int, int, dict]] = []  # (finish time, rid, row)
    t = max_conc = 0
    busy = 0
    while ready or running:
        while ready and ready[0]["peak_pages"] <= free:
            r = ready.pop(0)
            free -= r["peak_pages"]
            heapq.heappush(running, (t + r["steps"], r["rid"], r))
            busy += r["steps"]
        max_conc = max(max_conc, len(running))
        t, _, done = heapq.heappop(running)
        free += done["peak_pages"]
        follow = nxt.get(id(done))
        if follow is not None:
            ready.append(follow)
            ready.sort(key=lambda r: r["rid"])
    return dict(
        max_concurrency=max_conc,
        mean_concurrency=busy / t if t else 0.0,
        makespan=t,
        rejected=len(rows) - len(fits),
    )


def summarize(rows: list[dict], pool_tokens: int, bytes_per_token: int) -> list[dict]:
    """One summary per (workload, policy, ratio, page size, mode)."""
    groups = defaultdict(list)
    for r in rows:
        groups[(r["workload"], r["policy"], r["ratio"], r["page_size"], r["mode"])].append(r)
    out = []
    for (wl, pol, ratio, ps, mode), rs in sorted(groups.items()):
        n = len(rs)
        total = sum(r["total_len"] for r in rs)
        live = sum(r["live_tokens"] for r in rs)
        moved = sum(r["tokens_moved"] for r in rs)
        out.append(
            dict(
                workload=wl,
                policy=pol,
                ratio=ratio,
                page_size=ps,
                mode=mode,
                requests=n,
                evicted_frac=round(1 - live / total, 4),
                retained_pages=sum(r["retained_pages"] for r in rs) / n,
                ideal_pages=sum(r["ideal_pages"] for r in rs) / n,
                peak_pages=sum(r["peak_pages"] for r in rs) / n,
                pages_freed=sum(r["pages_freed"] for r in rs) / n,
                tokens_moved=moved / n,
                bytes_moved=moved * bytes_per_token / n,
                pool_pages=pool_tokens // ps,
                **simulate_concurrency(rs, pool_tokens // ps),
            )
        )
    return out


def _index(summary):
    return {(s["workload"], s["policy"], s["ratio"], s["page_size"], s["mode"]): s for s in summary}


def _fewer(na: dict | None, vt: dict | None) -> float | None:
    """Percent fewer retained pages per request under vToken (`vt`) than under Naive-Evict
    (`na`); None without both, or with none retained under Naive-Evict."""
    if not (na and vt and na["retained_pages"]):
        return None
    return 100 * (1 - vt["retained_pages"] / na["retained_pages"])


def headline(summary: list[dict], page_size: int = 16) -> str:
    """One sentence with the ranges the tables hold (computed, never typed in)."""
    idx = _index(summary)
    red, gain, contiguous = [], [], []
    for (wl, pol, ratio, ps, mode), vt in idx.items():
        na = idx.get((wl, pol, ratio, ps, "naive"))
        r = _fewer(na, vt)
        if mode != "vtoken" or ps != page_size or r is None:
            continue
        (contiguous if pol == "streamingllm" else red).append(r)
        if pol != "streamingllm" and na["mean_concurrency"]:
            gain.append(vt["mean_concurrency"] / na["mean_concurrency"])
    if not red:
        return f"Page size {page_size}: no scattered-victim policy in this run."
    text = (
        f"**Headline (page size {page_size}, every workload and ratio):** vToken retains "
        f"{min(red):.1f}% to {max(red):.1f}% fewer pages per request than Naive-Evict with the "
        f"scattered-victim policies, and admits {min(gain):.2f}x to {max(gain):.2f}x as many "
        "concurrent requests under the same pool (paper: -27.2% to -72.3%, up to 2x)."
    )
    if contiguous:
        text += (
            f" StreamingLLM evicts a contiguous range, so Naive-Evict already frees whole "
            f"pages: {min(contiguous):.1f}% to {max(contiguous):.1f}%."
        )
    return text


def markdown_tables(summary: list[dict], page_size: int = 16) -> str:
    """The headline table (one page size, every policy and ratio) and a page-size table."""
    idx, lines = _index(summary), [headline(summary, page_size), ""]
    workloads = sorted({s["workload"] for s in summary})
    policies = sorted({s["policy"] for s in summary})
    ratios = sorted({s["ratio"] for s in summary})
    sizes = sorted({s["page_size"] for s in summary})
    for wl in workloads:
        some = next(s for s in summary if s["workload"] == wl and s["page_size"] == page_size)
        lines += [
            f"**{wl}** ({some['requests']} requests), page size {page_size}, pool "
            f"{some['pool_pages']} pages. Pages are private pages per request at the end "
            "of the request (mean); concurrency is the mean number of running requests.",
            "",
            "| policy | ratio | evicted | No-Evict | Naive-Evict | vToken (ideal) | vToken vs Naive "
            "| vToken-lazy | moved tok/req (vToken / lazy) | concurrency Naive -> vToken | gain |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for pol in policies:
            for ratio in ratios:
                g = {m: idx.get((wl, pol, ratio, page_size, m)) for m in MODE_NAMES}
                if not all(g.values()):
                    continue
                ne, na, vt, lz = g["noevict"], g["naive"], g["vtoken"], g["lazy"]
                fewer = _fewer(na, vt) or 0.0
                gain = (
                    vt["mean_concurrency"] / na["mean_concurrency"]
                    if na["mean_concurrency"]
                    else 0.0
                )
                lines.append(
                    f"| {pol} | {ratio:.1f} | {vt['evicted_frac']:.2f} | {ne['retained_pages']:.1f} "
                    f"| {na['retained_pages']:.1f} | {vt['retained_pages']:.1f} ({vt['ideal_pages']:.1f}) "
                    f"| {-fewer + 0.0:+.1f}% | {lz['retained_pages']:.1f} "
                    f"| {vt['tokens_moved']:.0f} / {lz['tokens_moved']:.0f} "
                    f"| {na['mean_concurrency']:.2f} -> {vt['mean_concurrency']:.2f} | {gain:.2f}x |"
                )
        lines.append("")
    lines += [
        "Retained pages per request, vToken vs Naive-Evict, by page size (ratio "
        f"{0.5 if 0.5 in ratios else ratios[0]:.1f}):",
        "",
        "| workload | policy | " + " | ".join(f"ps {p}" for p in sizes) + " |",
        "|---|---|" + "---|" * len(sizes),
    ]
    ratio = 0.5 if 0.5 in ratios else ratios[0]
    for wl in workloads:
        for pol in policies:
            cells = []
            for ps in sizes:
                fewer = _fewer(
                    idx.get((wl, pol, ratio, ps, "naive")), idx.get((wl, pol, ratio, ps, "vtoken"))
                )
                cells.append("-" if fewer is None else f"{-fewer + 0.0:+.1f}%")
            lines.append(f"| {wl} | {pol} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(summary: list[dict], img_dir: str, page_size: int = 16) -> list[str]:
    """PNG plots (matplotlib, Agg): retained-page reduction and concurrency per policy."""
    import os

    plt = pyplot()

    os.makedirs(img_dir, exist_ok=True)
    idx = _index(summary)
    workloads = sorted({s["workload"] for s in summary})
    policies = sorted({s["policy"] for s in summary})
    ratios = sorted({s["ratio"] for s in summary})
    sizes = sorted({s["page_size"] for s in summary})
    paths = []

    def bars(ax, series, labels, title, ylabel):
        width = 0.8 / len(series)
        for i, (name, values) in enumerate(series.items()):
            ax.bar([x + i * width for x in range(len(labels))], values, width, label=name)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))], labels, rotation=20)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=len(series))

    def red(wl, pol, ratio, ps):
        return (
            _fewer(idx.get((wl, pol, ratio, ps, "naive")), idx.get((wl, pol, ratio, ps, "vtoken")))
            or 0
        )

    figs = [
        (
            "sim_retained_reduction.png",
            f"retained pages vs Naive-Evict (%), page size {page_size}",
            lambda wl: {f"ratio {r}": [red(wl, p, r, page_size) for p in policies] for r in ratios},
        ),
        (
            "sim_page_size.png",
            "retained pages vs Naive-Evict (%), ratio 0.5",
            lambda wl: {f"ps {ps}": [red(wl, p, 0.5, ps) for p in policies] for ps in sizes},
        ),
        (
            "sim_concurrency.png",
            f"mean concurrency, ratio 0.5, page size {page_size}",
            lambda wl: {
                MODE_NAMES[m]: [
                    idx[(wl, p, 0.5, page_size, m)]["mean_concurrency"] for p in policies
                ]
                for m in MODE_NAMES
            },
        ),
    ]
    for name, title, series in figs:
        if "0.5" in title and 0.5 not in ratios:
            continue
        fig, axes = plt.subplots(
            1, len(workloads), figsize=(6 * len(workloads), 4.2), squeeze=False
        )
        for ax, wl in zip(axes[0], workloads):
            bars(ax, series(wl), policies, f"{wl}: {title}", "")
        path = os.path.join(img_dir, name)
        save(fig, path, 110)
        paths.append(path)
    return paths
