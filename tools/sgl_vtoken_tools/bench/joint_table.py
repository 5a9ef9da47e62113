"""The joint benchmark's cells from its `summary` lines (`python -m sgl_vtoken_tools joint`):

    spread_lines(summaries)   one `cell` line per cell: each figure's spread over repeats, and
                              the throughput and prompt tokens computed as ratios to stock's of
                              the same repeat
    table(cells)              the markdown table (medians, with min-max when repeats differ)
    plot(cells, path)         accuracy against the throughput ratio, one point per cell

A `cell` line written before a figure existed renders it as "-".
"""

from __future__ import annotations

from sgl_vtoken_tools.bench.plots import pyplot, save
from sgl_vtoken_tools.bench.quantiles import spread
from sgl_vtoken_tools.bench.quantiles import spread_text as _fmt

KEYS = (
    "output_tokens_per_s",
    "prefill_tokens",
    "turns_from_device",
    "turns_from_host",
    "turns_from_prefix",
    "turns_prefilled_again",
    "history_restored_tokens",
    "host_bytes_per_turn",
    "host_histories_stored",
    "host_histories_restored",
    "host_histories_dropped",
    "mean_ttft_ms",
    "accuracy",
    "accuracy_session",
    "accuracy_docqa",
    "agreement",
    "kv_tokens_mean",
    "retractions",
    "peak_running",
    "mean_running",
    "wall_s",
    "failed",
)
# (a summary figure, its ratio to stock's of the same repeat in the cell line)
RATIOS = (("output_tokens_per_s", "throughput_ratio"), ("prefill_tokens", "computed_ratio"))


def spread_lines(summaries: list[dict], keys=KEYS, ratios=RATIOS) -> list[dict]:
    """One `cell` line per cell (in order of first appearance): `keys` spread over repeats, and
    `ratios`: each repeat's figure over stock's of the same repeat (None without stock)."""
    cells = list(dict.fromkeys(s["cell"] for s in summaries))
    stock = {s["repeat"]: s for s in summaries if s["cell"] == "stock"}
    out = []
    for c in cells:
        rows = [s for s in summaries if s["cell"] == c]
        line = {
            "kind": "cell",
            "cell": c,
            "repeats": len(rows),
            **{k: spread([r.get(k) for r in rows]) for k in keys},
        }
        for key, ratio in ratios:
            line[ratio] = spread(
                [
                    r[key] / stock[r["repeat"]][key]
                    for r in rows
                    if stock.get(r["repeat"], {}).get(key) and r.get(key) is not None
                ]
            )
        out.append(line)
    return out


COLUMNS = (
    "cell",
    "output tok/s",
    "x stock",
    "prompt tokens computed",
    "computed x stock",
    "turns from device history",
    "turns from host history",
    "turns from radix prefix",
    "turns prefilled again",
    "host MB / turn",
    "mean TTFT ms",
    "accuracy %",
    "sessions %",
    "docqa %",
    "agree w/ full %",
    "KV tokens / conv.",
    "retractions",
    "peak running",
)


def table(cells: list[dict]) -> str:
    """Markdown: `COLUMNS`, medians over repeats with (min-max); "-" where a cell has no figure
    (turns from a device or host history: no request carried the plugin's report)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|---|" + "---:|" * (len(COLUMNS) - 1)]
    for c in cells:
        row = [
            c["cell"],
            _fmt(c.get("output_tokens_per_s")),
            _fmt(c.get("throughput_ratio"), 2),
            _fmt(c.get("prefill_tokens"), 0),
            _fmt(c.get("computed_ratio"), 2),
            _fmt(c.get("turns_from_device"), 0),
            _fmt(c.get("turns_from_host"), 0),
            _fmt(c.get("turns_from_prefix"), 0),
            _fmt(c.get("turns_prefilled_again"), 0),
            _fmt(c.get("host_bytes_per_turn"), 2, scale=1e-6),
            _fmt(c.get("mean_ttft_ms"), 0),
            _fmt(c.get("accuracy"), pct=True),
            _fmt(c.get("accuracy_session"), pct=True),
            _fmt(c.get("accuracy_docqa"), pct=True),
            _fmt(c.get("agreement"), pct=True),
            _fmt(c.get("kv_tokens_mean"), 0),
            _fmt(c.get("retractions"), 0),
            _fmt(c.get("peak_running"), 0),
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def plot(cells: list[dict], path: str, title: str = "") -> None:
    """Accuracy against throughput ratio to stock, one point per cell (median, min-max bars)."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for i, c in enumerate(cells):
        x, y = c.get("throughput_ratio"), c.get("accuracy")
        if x is None or y is None:
            continue
        ax.errorbar(
            x["median"],
            100 * y["median"],
            xerr=[[x["median"] - x["min"]], [x["max"] - x["median"]]],
            yerr=[[100 * (y["median"] - y["min"])], [100 * (y["max"] - y["median"])]],
            fmt="o",
            capsize=3,
        )
        ax.annotate(
            c["cell"],
            (x["median"], 100 * y["median"]),
            fontsize=7,
            xytext=(4, 4 - 9 * (i % 3)),
            textcoords="offset points",
        )  # staggered: cells at one point stay readable
    ax.axvline(2.0, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("output throughput / stock SGLang (same repeat)")
    ax.set_ylabel("answers right (%)")
    ax.set_title(title or "speed and answers, one run", fontsize=9)
    save(fig, path, 110)
