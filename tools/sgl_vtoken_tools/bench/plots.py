"""Figures (matplotlib, PNG). `pyplot()` and `save(fig, path, dpi)` serve every command's plots;
`plot` draws the agent benchmark's: bars at the median over repeats with min-max error bars;
running requests over time and TTFT per turn for every repeat."""

from __future__ import annotations

from pathlib import Path

from sgl_vtoken_tools.bench.cells import MODE_NAMES, MODES, figure_spread, groups, sla_spread

COLORS = {"none": "#7f7f7f", "naive": "#d62728", "vtoken": "#1f77b4"}


def pyplot():
    """matplotlib's pyplot, drawing off screen (Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path, dpi: int, **layout) -> None:
    """Lay `fig` out (``tight_layout(**layout)``), write it to `path` (its folder made) and close it."""
    fig.tight_layout(**layout)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def plot(settings: dict, cells, img_dir: Path) -> list[str]:
    """Writes bench_*.png into `img_dir`; returns their file names."""
    plt = pyplot()

    img_dir = Path(img_dir)
    img_dir.mkdir(parents=True, exist_ok=True)
    gs = groups(cells)
    names = [f"{policy} b{budget} ps{page}" for page, policy, budget, _ in gs]
    out = []

    def bars(ax, title, ylabel, spread_of, modes=MODES):
        w = 0.8 / len(modes)
        for j, m in enumerate(modes):
            sps = [spread_of(by_mode[m]) if m in by_mode else None for *_, by_mode in gs]
            xs = [i + (j - (len(modes) - 1) / 2) * w for i in range(len(gs))]
            mid = [sp["median"] if sp else 0 for sp in sps]
            err = [
                [sp["median"] - sp["min"] if sp else 0 for sp in sps],
                [sp["max"] - sp["median"] if sp else 0 for sp in sps],
            ]
            ax.bar(xs, mid, w, yerr=err, capsize=2, label=MODE_NAMES[m], color=COLORS[m])
            for x, sp in zip(xs, sps):
                if sp is not None:
                    ax.annotate(
                        f"{sp['median']:.3g}", (x, sp["max"]), ha="center", va="bottom", fontsize=7
                    )
        ax.set_xticks(range(len(gs)), names, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)

    def done(fig, fname, title=None):
        if title:
            fig.suptitle(title, fontsize=10)
        save(fig, img_dir / fname, 110)
        out.append(fname)

    figure = lambda key: lambda c: figure_spread(c, key)  # noqa: E731
    n = max(len(c.repeats) for c in cells)
    sub = f"median and min-max of {n} repeats"
    width = 2.0 + 2.4 * len(gs)
    fig, axes = plt.subplots(1, 2, figsize=(2 * width, 3.6))
    bars(
        axes[0],
        "Retained pages per request (plugin gauge)",
        "pages",
        figure("retained_pages_per_req"),
        modes=("naive", "vtoken"),
    )
    bars(
        axes[1],
        "KV pages in use per running request (pool)",
        "pages",
        figure("kv_pages_per_running_req"),
    )
    done(fig, "bench_retained_pages.png", f"Burst runs: {sub}")

    fig, axes = plt.subplots(1, 2, figsize=(2 * width, 3.6))
    bars(
        axes[0],
        f"Peak running requests (pool {settings['pool']} tokens)",
        "requests",
        figure("peak_running"),
    )
    bars(axes[1], "Mean running requests", "requests", figure("mean_running"))
    done(fig, "bench_concurrency.png", f"Burst runs: {sub}")

    if settings["quick"]:
        fig, ax = plt.subplots(figsize=(width, 3.6))
        bars(
            ax,
            "Output tokens/s (burst run; quick run: no rate ladder)",
            "tokens/s",
            figure("out_tok_s"),
        )
    else:
        factors = settings["sla_factors"]
        fig, axes = plt.subplots(1, len(factors) + 1, figsize=((len(factors) + 1) * width, 3.6))
        for ax, f in zip(axes, factors):
            bars(
                ax,
                f"Max session rate with p95 TTFT <= {f:g} x unloaded (0: < {min(settings['rates']):g})",
                "sessions/s",
                lambda c, f=f: sla_spread(c, f),
            )
            ax.set_ylim(0, 1.15 * max(settings["rates"]))
        bars(
            axes[-1],
            "Output tokens per scheduler CPU second (burst run)",
            "tokens / CPU s",
            figure("out_tok_per_cpu_s"),
        )
    done(fig, "bench_sla_throughput.png", sub)

    fig, axes = plt.subplots(1, len(gs), figsize=(1 + 3.6 * len(gs), 3.4), squeeze=False)
    for ax, (page, policy, budget, by_mode) in zip(axes[0], gs):
        for m in (m for m in MODES if m in by_mode):
            for r, run in enumerate(by_mode[m].runs_named("burst")):
                pts = [
                    (x["t"], x["running"]) for x in run["samples"] if x.get("running") is not None
                ]
                if pts:
                    ax.step(
                        [p[0] for p in pts],
                        [p[1] for p in pts],
                        where="post",
                        color=COLORS[m],
                        alpha=0.8,
                        linewidth=1,
                        label=MODE_NAMES[m] if r == 0 else None,
                    )
        ax.set_title(f"{policy} b{budget} ps{page}", fontsize=9)
        ax.set_xlabel("seconds since the burst")
        ax.set_ylabel("running requests")
        ax.legend(fontsize=7)
    done(
        fig,
        "bench_running.png",
        f"Running requests over time (burst runs, every repeat; pool {settings['pool']} tokens)",
    )

    fig, axes = plt.subplots(1, len(gs), figsize=(1 + 3.6 * len(gs), 3.4), squeeze=False)
    for ax, (page, policy, budget, by_mode) in zip(axes[0], gs):
        for m in (m for m in MODES if m in by_mode):
            for r, run in enumerate(by_mode[m].runs_named("burst")):
                turns = run["turns"]
                ax.plot(
                    [t["turn"] for t in turns],
                    [t["ttft_ms"]["p50"] for t in turns],
                    marker="o",
                    markersize=3,
                    color=COLORS[m],
                    alpha=0.8,
                    label=MODE_NAMES[m] if r == 0 else None,
                )
        ax.set_title(f"{policy} b{budget} ps{page}", fontsize=9)
        ax.set_xlabel("turn")
        ax.set_ylabel("TTFT p50 (ms)")
        ax.set_xticks(range(1, settings["turns"] + 1))
        ax.legend(fontsize=7)
    done(fig, "bench_ttft_per_turn.png", "TTFT per turn (burst runs, one line per repeat)")
    return out
