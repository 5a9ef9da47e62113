"""Chat conversations (`chats.py`) replayed through the masked Hugging Face reference.

Each setting plays the whole conversation on its own: every reply is greedy under that setting
(ending at ``<|im_end|>`` or at `max_new` tokens) and is fed into the next turn as a chat client
feeds it, the next turn continuing from the view the previous one stored
(`hf_reference.masked_turn` with its history). One JSON line per (setting, trial): the hit, the
answer, and per turn the prompt and reply lengths, the positions recalled, and how many of the
fact's tokens each answer token's query could see (``fact_seen``: min and max over the reply).

    python -m sgl_vtoken_tools.quality.chat_recall --split tuning --group first --trials 10 \\
        --out docs/results/chat_recall_tuning_first.jsonl
"""

from __future__ import annotations

import argparse
import time

from sgl_vtoken.config import EvictConfig, HostTier
from sgl_vtoken_tools.cli.common import numbers
from sgl_vtoken_tools.quality.chats import GROUPS, chat_trials
from sgl_vtoken_tools.quality.splits import SPLITS
from sgl_vtoken_tools.quality.tasks import Trial, next_turn_ids, trial_record


def settings(args) -> list[tuple[str, EvictConfig]]:
    """The cells: the full cache, the policy alone, the policy with offload + each recall."""
    base = dict(
        policy=args.policy,
        budget=args.budget,
        sink=args.sink,
        window=args.window,
        interval=args.interval,
    )
    out = [("full", EvictConfig(policy="none"))]
    out.append((f"{args.policy} b{args.budget}", EvictConfig(**base)))
    for r in args.recall:
        host = HostTier(
            offload=True,
            tokens=1 << 20,
            recall=r,
            rounds=args.recall_rounds,
        )
        out.append((f"{args.policy} b{args.budget} + recall {r}", EvictConfig(**base, host=host)))
    return out


def fact_positions(tok, trial: Trial, prompt: list[int], turn: int) -> list[int]:
    """Logical positions of the fact's digits (every occurrence of the key) once turn `turn`'s
    prompt holds them: the key's token ids matched in `prompt`."""
    key = tok(trial.answer, add_special_tokens=False)["input_ids"]
    n = len(key)
    return [
        p for i in range(len(prompt) - n + 1) if prompt[i : i + n] == key for p in range(i, i + n)
    ]


def play(
    model, tok, trial: Trial, label: str, cfg: EvictConfig, max_new: int, choice, keep=None
) -> dict:
    """One conversation under `cfg` (`choice`: the reference's ``policy=``/``recall=``);
    `keep`, when given, is a list that receives the last turn's ``(ids, masks, start)``."""
    from sgl_vtoken_tools.hf_reference import masked_turn

    eos = tok.convert_tokens_to_ids("<|im_end|>")
    prompt, history, turns, t0, out = list(trial.prompt), None, [], time.monotonic(), []
    for turn in range(len(trial.messages) + 1):
        if turn:
            prompt = prompt + out + next_turn_ids(tok, trial.messages[turn - 1], out)
        view = set() if history is None else set(history[1])
        start = 0 if history is None else len(history[0])
        out, _, history = masked_turn(
            model,
            prompt,
            max_new,
            cfg,
            f"{trial.id}-{label}-{turn}",
            history=history,
            stop=eos,
            **choice,
        )
        masks = history[0]
        first = masks[len(prompt) - 1] if len(masks) >= len(prompt) else []
        recalled = sorted(p for p in first if p < start and p not in view)
        fact = fact_positions(tok, trial, prompt, turn)
        seen = [sum(1 for p in fact if p in set(m)) for m in masks[len(prompt) - 1 :]]
        turns.append(
            {
                "prompt": len(prompt),
                "reply": len(out),
                "recalled": recalled,
                "fact": fact,
                "fact_seen": [min(seen), max(seen)] if seen else None,
                "row_first": len(first),
            }
        )
    if keep is not None:
        keep.append((prompt + out, history[0], start))
    answer = tok.decode([t for t in out if t != eos], skip_special_tokens=True)
    return trial_record(label, trial, answer, turns, t0)


def add_chat_args(ap: argparse.ArgumentParser) -> None:
    """The flags of the conversations and the settings, shared with `chat_server`."""
    ap.add_argument("--model", default=".cache/smollm2")
    ap.add_argument("--split", choices=SPLITS, required=True)
    ap.add_argument("--trials", type=int, default=10, help="conversations per group")
    ap.add_argument("--first", type=int, default=0, help="index of the first trial")
    numbers(ap, seed=0, passage_tokens=150)
    ap.add_argument("--max-new", type=int, default=48, help="reply cap (tokens)")
    ap.add_argument("--policy", default="h2o")
    numbers(ap, budget=256, sink=16, window=32, interval=16)
    ap.add_argument("--recall", type=lambda s: [int(x) for x in s.split(",")], default=[192])
    ap.add_argument("--cells", default=None, help="comma-separated cell indices to run")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--group", choices=GROUPS, required=True)
    add_chat_args(ap)
    numbers(ap, recall_rounds=4)
    ap.add_argument(
        "--oracles", action="store_true", help="tests/runtime/oracles' rule (else runtime)"
    )
    ap.add_argument(
        "--rule-before",
        action="store_true",
        help="the runtime's rule as it was: each round's gap walk sees only its own picks",
    )
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=None)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    import torch
    from transformers import AutoTokenizer

    from sgl_vtoken_tools.hf_reference import load_model
    from sgl_vtoken_tools.quality.cli import json_lines

    if args.threads:
        torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = load_model(args.model)
    cells = settings(args)
    if args.cells:
        cells = [cells[int(i)] for i in args.cells.split(",")]
    choice = _choice(args.oracles)
    if args.rule_before:
        choice["recall"] = _RoundsApart(choice["recall"])
    trials = chat_trials(
        tok, args.split, args.group, args.first + args.trials, args.passage_tokens, args.seed
    )[args.first :]
    with json_lines(args.out) as emit:
        emit({"kind": "config", **vars(args)})
        for trial in trials:
            for label, cfg in cells:
                rule = " (rule before)" if args.rule_before and cfg.host.recall else ""
                emit(play(model, tok, trial, label + rule, cfg, args.max_new, choice))


class _RoundsApart:
    """A recall rule whose rounds do not see each other's tokens (the rule before the gap walk
    took the earlier rounds' tokens as neighbours)."""

    def __init__(self, rule) -> None:
        self.rule = rule
        self.split, self.rounds, self.quota = rule.split, rule.rounds, rule.quota

    def choose(self, cfg, layers, lengths, k, positions=(), recalled=()) -> list[int]:
        return self.rule.choose(cfg, layers, lengths, k)


def _choice(oracles: bool) -> dict:
    if oracles:
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests" / "runtime"))
        from oracles import ORACLE_RECALL, oracle_policy  # type: ignore[import-not-found]

        return {"policy": oracle_policy, "recall": ORACLE_RECALL}
    from sgl_vtoken_tools.runtime_choice import RUNTIME_RECALL, runtime_policy

    return {"policy": runtime_policy, "recall": RUNTIME_RECALL}


if __name__ == "__main__":
    main()
