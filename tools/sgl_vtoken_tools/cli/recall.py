"""Multi-turn recall through the host tier, on a live server: full cache vs plain eviction vs
eviction with offload + recall, same conversations, same request ids, one server.

Each trial states a 4-digit pass key in turn 1, gives `--fillers` essay passages to summarise,
then asks for the key (`sgl_vtoken_tools.quality.tasks.recall_trials`); every turn is the previous
prompt + reply + the next message, so the server continues from its stored compacted history.
Score: the answer's first number is the key. Besides the hits, each record carries the device KV
the request kept (`live_tokens`), the host tier's figures (offloaded, recalled, recall time, host
bytes) per turn. One JSON line per (setting, trial), then one summary line per setting.

    python -m sgl_vtoken_tools recall --trials 20 --recall 128,192 --out docs/results/recall_host_tier_gap8.jsonl
    python -m sgl_vtoken_tools recall --render docs/results/recall_host_tier_gap8.jsonl --plot docs/img/recall_host_tier.png
    python -m sgl_vtoken_tools recall --first 20 --trials 10 --recall 128,192 --out more.jsonl   # trials 20-29
    python -m sgl_vtoken_tools recall --split heldout --recall-defaults --out heldout.jsonl     # see below

`--split tuning|heldout|final` plays the split's sessions instead (`sgl_vtoken_tools.quality.splits`:
a 5-digit fact stated once, in turn 1 or inside a later passage at the split's depths, in the
split's phrasings; `--fillers + 2` turns). `--recall-defaults` leaves `recall_rounds` to the
server's default (the script's own default is the same, 4; earlier runs used one round). The
recall rule's pooling and gap are fixed (`sgl_vtoken.recall.POOL`, `GAP`: 5 and 8); runs before
they were (`--recall-pool`, `--recall-gap`, until 17e02d6) also used 7 and 8, or 1 and 0.

Trial i is the same conversation whatever `--trials` and `--first` are, so runs over disjoint
ranges add up; `--render` prints one summary line per setting over all the files' trials.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from sgl_vtoken_tools.bench.jsonl import RunLog
from sgl_vtoken_tools.bench.plots import pyplot, save
from sgl_vtoken_tools.bench.probe import flush_cache, vtoken_state
from sgl_vtoken_tools.cli import common
from sgl_vtoken_tools.cli.common import REPO
from sgl_vtoken_tools.launcher import ServerProcess, cpu_server_args, evict_args
from sgl_vtoken_tools.quality.server_check import Client, _strip
from sgl_vtoken_tools.quality.splits import SPLITS, session_trials
from sgl_vtoken_tools.quality.tasks import next_turn_ids, recall_trials, trial_record


def settings(
    policies: list[str], budget: int, recalls: list[int], window: int
) -> list[tuple[str, dict]]:
    out = [("full", {"policy": "none"})]
    for p in policies:
        kv = {"policy": p, "budget": budget, "window": window if p != "streamingllm" else 0}
        out.append((f"{p} b{budget}", kv))
        out += [
            (f"{p} b{budget} + recall {r}", {**kv, "offload": True, "recall": r}) for r in recalls
        ]
    return out


def run_trial(client: Client, tok, trial, label: str, kv: dict, max_new: int, eos: int) -> dict:
    """One conversation on an empty cache: no setting reuses another's KV (the full cache's
    turns would otherwise serve an evicting conversation's identical prompts hole-free)."""
    flush_cache(client.base_url)
    prompt, replies, turns, t0 = list(trial.prompt), [], [], time.monotonic()
    for turn in range(len(trial.messages) + 1):
        if turn:
            prompt += replies[-1] + next_turn_ids(tok, trial.messages[turn - 1], replies[-1])
        out = client.generate(prompt, f"{trial.id}-{label}-{turn}", max_new, kv, stop=eos)
        replies.append(list(out["output_ids"]))
        report = (out["meta_info"].get("kv_evict") or [{}])[0]
        turns.append(
            {
                k: report[k]
                for k in (
                    "live_tokens",
                    "history_tokens",
                    "offloaded_tokens",
                    "recall_candidates",
                    "recalled_tokens",
                    "recomputed_tokens",
                    "recall_ms",
                    "host_bytes",
                    "recalled_positions",
                )
                if k in report
            }
        )
    answer = tok.decode(_strip(replies[-1], eos), skip_special_tokens=True)
    return trial_record(label, trial, answer, turns, t0, prompt_tokens=len(prompt))


def summary(label: str, records: list[dict]) -> dict:
    last = [r["turns"][-1] for r in records]
    recall_ms = [t["recall_ms"] for r in records for t in r["turns"] if "recall_ms" in t]
    host = [r["turns"][-1].get("host_bytes") for r in records if "host_bytes" in r["turns"][-1]]
    return {
        "kind": "summary",
        "setting": label,
        "hits": sum(r["hit"] for r in records),
        "trials": len(records),
        "accuracy": round(sum(r["hit"] for r in records) / len(records), 4),
        "max_live_tokens_last_turn": max((t.get("live_tokens") or 0) for t in last),
        "recall_ms_median": round(statistics.median(recall_ms), 2) if recall_ms else None,
        "host_bytes_per_session_median": int(statistics.median(host)) if host else None,
        "mean_prompt_tokens": round(statistics.mean(r["prompt_tokens"] for r in records), 1),
    }


def _budgets(text: str) -> list[int]:
    """``--recall``: comma-separated positive integers."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers, got {text!r}"
        )
    return values


def plot(records: list[dict], path: str) -> None:
    """Two panels from the trial and summary lines: pass-key accuracy per setting (hits/trials),
    and each trial's device KV after its last eviction (the full cache: its whole history)."""
    plt = pyplot()

    summaries = [r for r in records if r["kind"] == "summary"]
    trials = [r for r in records if r["kind"] == "trial"]
    labels = [s["setting"] for s in summaries]
    colors = ["#7f7f7f", "#d62728", "#1f77b4", "#2ca02c", "#9467bd"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    acc = [100 * s["accuracy"] for s in summaries]
    a.bar(range(len(labels)), acc, color=[colors[i % len(colors)] for i in range(len(labels))])
    for i, s in enumerate(summaries):
        a.annotate(f"{s['hits']}/{s['trials']}", (i, acc[i]), ha="center", va="bottom", fontsize=8)
    a.set_xticks(range(len(labels)), labels, fontsize=7, rotation=12)
    a.set_ylim(0, 110)
    a.set_ylabel("pass key found (%)")
    a.set_title("question four turns after the fact", fontsize=9)
    for i, label in enumerate(labels):
        kv = [
            (t["turns"][-1].get("live_tokens") or t["prompt_tokens"])
            for t in trials
            if t["setting"] == label
        ]
        b.scatter([i] * len(kv), kv, color=colors[i % len(colors)], s=14)
    b.set_xticks(range(len(labels)), labels, fontsize=7, rotation=12)
    b.set_ylabel("device KV tokens, last turn")
    b.set_title("KV the request holds (full cache: its history)", fontsize=9)
    save(fig, path, 120)


def build_trials(args, tok, wheel_dir=None) -> list:
    """Trials `--first` .. `--first + --trials` of the recall task, or of `--split`'s sessions."""
    n = args.first + args.trials
    if args.split:
        return session_trials(
            tok,
            args.split,
            n,
            turns=args.fillers + 2,
            passage_tokens=args.filler_tokens,
            seed=args.seed,
            wheel_dir=wheel_dir,
        )[args.first :]
    return recall_trials(
        tok,
        n,
        fillers=args.fillers,
        filler_tokens=args.filler_tokens,
        seed=args.seed,
        wheel_dir=wheel_dir,
    )[args.first :]


def server_config(args) -> dict:
    """The server's --kv-evict-config: a large host tier, the recall rule unless --recall-defaults."""
    config = {"host_tokens": 1 << 20}
    if not args.recall_defaults:
        config.update(recall_rounds=args.recall_rounds)
    if args.score_layers:
        lo, hi = map(int, args.score_layers.split("-"))
        config["score_layers"] = list(range(lo, hi + 1))
    return config


def build_parser() -> argparse.ArgumentParser:
    ap = common.parser(__doc__, __name__)
    ap.add_argument("--model", default=str(REPO / ".cache" / "smollm2"))
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument(
        "--first",
        type=int,
        default=0,
        help="index of the first trial (trials are seeded one by one)",
    )
    ap.add_argument(
        "--fillers", type=int, default=3, help="turns between the fact and the question"
    )
    common.numbers(ap, filler_tokens=120, budget=256)
    ap.add_argument(
        "--recall",
        type=_budgets,
        default=[128],
        help="comma-separated recall budgets, one setting each",
    )
    ap.add_argument(
        "--recall-rounds", type=int, default=4, help="recall_rounds: rounds of recall per turn"
    )
    ap.add_argument(
        "--recall-defaults",
        action="store_true",
        help="send no --recall-rounds: the server's default",
    )
    ap.add_argument(
        "--split", choices=SPLITS, help="play this split's sessions (default: the recall task's)"
    )
    ap.add_argument(
        "--window", type=int, default=32, help="recent window of the non-positional policies"
    )
    ap.add_argument("--policies", default="streamingllm")
    common.numbers(ap, sink=16, interval=16)
    ap.add_argument(
        "--score-layers",
        default=None,
        help="a-b: layers scoring attention and recall (default: the server's, the upper half of the layers)",
    )
    common.numbers(ap, max_new_tokens=16, pool=8192, seed=0)
    ap.add_argument("--out", default=None, help="JSON lines file (default: stdout only)")
    ap.add_argument("--plot", default=None, help="PNG of accuracy and device KV per setting")
    ap.add_argument(
        "--render",
        nargs="+",
        default=None,
        help="JSON lines of earlier runs (e.g. two trial ranges): print one summary line per "
        "setting over all their trials, and plot them with --plot",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.first < 0 or args.trials < 1:
        ap.error(f"--first must be >= 0 and --trials >= 1 (got {args.first} and {args.trials})")
    if args.render:
        records = [r for p in args.render for r in common.read_lines(p) if r["kind"] == "trial"]
        by_setting: dict[str, list[dict]] = {}
        for rec in records:
            if any(r["trial"] == rec["trial"] for r in by_setting.get(rec["setting"], [])):
                ap.error(
                    f"--render: {rec['setting']!r} has {rec['trial']} twice (overlapping trial ranges)"
                )
            by_setting.setdefault(rec["setting"], []).append(rec)
        summaries = [summary(label, recs) for label, recs in by_setting.items()]
        for rec in summaries:
            print(json.dumps(rec))
        if args.plot:
            plot(records + summaries, args.plot)
        return
    from transformers import AutoTokenizer

    from sgl_vtoken_tools.models import ensure_model

    model = args.model
    if model == str(REPO / ".cache" / "smollm2"):
        model = str(ensure_model("smollm2", model))
    tok = AutoTokenizer.from_pretrained(model)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    trials = build_trials(args, tok)
    config = server_config(args)
    flags = cpu_server_args(model, args.pool, 1) + evict_args(
        "streamingllm", args.budget, args.interval, args.sink, config=config
    )
    flags.append("--disable-overlap-schedule")
    cells = settings(args.policies.split(","), args.budget, args.recall, args.window)
    log = RunLog(args.out, echo=True)
    records, emit = log.records, log.emit

    emit(
        {
            "kind": "config",
            **{k: v for k, v in vars(args).items() if k != "out"},
            "server_flags": flags[2:],
        }
    )
    with ServerProcess(flags) as server:
        client = Client(server.base_url)
        by_setting: dict[str, list[dict]] = {}
        for trial in trials:
            for label, kv in cells:
                rec = run_trial(client, tok, trial, label, kv, args.max_new_tokens, eos)
                by_setting.setdefault(label, []).append(rec)
                emit(rec)
        state = vtoken_state(server.base_url, strict=True)
    for label, _ in cells:
        emit(summary(label, by_setting[label]))
    emit(
        {
            "kind": "server",
            **{
                k: state.get(k)
                for k in (
                    "offloaded_tokens",
                    "recalled_tokens",
                    "recalls",
                    "recall_seconds",
                    "host_tokens_held",
                    "host_bytes_held",
                    "peak_host_bytes",
                    "offload_dropped_tokens",
                )
            },
        }
    )
    log.close()
    if args.plot:
        plot(records, args.plot)
