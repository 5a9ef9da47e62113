"""Chat conversations (`chats.py`) played against a server, as a chat client plays them.

Each cell plays every conversation turn by turn through ``/generate`` with ``input_ids`` and a
per-request ``custom_params.kv_evict``: turn k's prompt is turn k-1's prompt, its reply (greedy,
up to `max_new` tokens, ending at ``<|im_end|>``) and the next message, so the server continues
from the compacted history it stored. One conversation at a time, so every history survives the
pool (`--pool`). One JSON line per (cell, conversation): the hit, the answer, and per turn the
prompt and reply lengths, the tokens served from the cache, where the history came from and the
tokens recalled and the row's live tokens at the end (``usage.kv_evict``).

    python -m sgl_vtoken_tools.quality.chat_server --split tuning --group first --trials 10 \\
        --out docs/results/chat_server_tuning_first.jsonl

The server (started here unless `--base-url` is given) runs `--kv-evict POLICY --kv-budget B
--kv-sink S --kv-window W --kv-evict-interval I --kv-evict-config SERVER_CONFIG` (default: a
host store); the cells ask per request for the full cache (``{"policy": "none"}``), the policy
alone, and the policy with offload and each `--recall`; the last cell, ``server flags``, sends
no per-request settings (`--cells 3 --server-config '{"host_tokens": 1048576, "offload": true,
"recall": 192}'`: a command's own flags, nothing asked per request).
"""

from __future__ import annotations

import argparse
import json
import shlex
import time

from sgl_vtoken_tools.quality.chat_recall import add_chat_args
from sgl_vtoken_tools.quality.chats import GROUPS, chat_trials
from sgl_vtoken_tools.quality.cli import hits_by
from sgl_vtoken_tools.quality.tasks import Trial, next_turn_ids, trial_record


def cells(args) -> list[tuple[str, dict | None]]:
    """(label, per-request kv_evict): the full cache, the policy alone, the policy + recall,
    then ``server flags`` (no per-request settings: the server's `--kv-evict-config` as given)."""
    base = {"policy": args.policy, "budget": args.budget}
    out: list[tuple[str, dict | None]] = [
        ("full", {"policy": "none"}),
        (f"{args.policy} b{args.budget}", base),
    ]
    out += [
        (f"{args.policy} b{args.budget} + recall {r}", {**base, "offload": True, "recall": r})
        for r in args.recall
    ]
    return out + [("server flags", None)]


def server_flags(args) -> list[str]:
    from sgl_vtoken_tools.launcher import cpu_server_args, evict_args

    evict = evict_args(
        args.policy, args.budget, args.interval, args.sink, args.window, args.server_config
    )
    flags = cpu_server_args(args.model, args.pool, args.page_size) + ["--dtype", "float32"]
    return flags + evict + shlex.split(args.server_args)


def play(client, tok, trial: Trial, label: str, kv_evict: dict | None, max_new: int) -> dict:
    """One conversation under `kv_evict` (None: the server's flags); request ids
    ``{trial}-{label}-t{turn}``."""
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    prompt, out, turns, t0 = list(trial.prompt), [], [], time.monotonic()
    for turn in range(len(trial.messages) + 1):
        if turn:
            prompt = prompt + out + next_turn_ids(tok, trial.messages[turn - 1], out)
        res = client.generate(prompt, f"{trial.id}-{label}-t{turn}", max_new, kv_evict, stop=eos)
        out = list(res["output_ids"])
        meta = res["meta_info"]
        rep = (meta.get("kv_evict") or [{}])[0] or {}
        turns.append(
            {
                "prompt": len(prompt),
                "reply": len(out),
                "cached": meta.get("cached_tokens"),
                "history_source": rep.get("history_source"),
                "history_tokens": rep.get("history_tokens"),
                "recalled": rep.get("recalled_tokens"),
                "live_tokens": rep.get("live_tokens"),
            }
        )
    answer = tok.decode([t for t in out if t != eos], skip_special_tokens=True)
    return trial_record(label, trial, answer, turns, t0, kv_evict=kv_evict)


def summary(records: list[dict]) -> list[dict]:
    """Hits per (setting, group) over the trial records."""
    return hits_by(records, "setting", "group")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--group", choices=GROUPS + ("both",), default="both")
    add_chat_args(ap)
    ap.add_argument("--pool", type=int, default=16384, help="--max-total-tokens of the server")
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument(
        "--server-config",
        default=json.dumps({"host_tokens": 1 << 20}),
        help="the server's --kv-evict-config (JSON); the last cell plays with it alone",
    )
    ap.add_argument("--server-args", default="", help="more flags for the server (shell words)")
    ap.add_argument("--base-url", default=None, help="a running server (its flags must match)")
    ap.add_argument("--out", default=None)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from sgl_vtoken_tools.launcher import ServerProcess
    from sgl_vtoken_tools.quality.cli import server_tokenizer, write_run
    from sgl_vtoken_tools.quality.server_check import Client

    tok = server_tokenizer(args.model)
    chosen = cells(args)
    if args.cells:
        chosen = [chosen[int(i)] for i in args.cells.split(",")]
    groups = GROUPS if args.group == "both" else (args.group,)
    trials = [
        t
        for g in groups
        for t in chat_trials(
            tok, args.split, g, args.first + args.trials, args.passage_tokens, args.seed
        )[args.first :]
    ]
    server = None if args.base_url else ServerProcess(server_flags(args)).start()
    try:
        client = Client(args.base_url or server.base_url)
        played = (
            play(client, tok, trial, label, kv, args.max_new)
            for trial in trials
            for label, kv in chosen
        )
        config = {**vars(args), "server_args": server_flags(args)}
        write_run(args.out, config, played, summary)
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
