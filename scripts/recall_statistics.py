#!/usr/bin/env python
"""Which recall statistic finds a fact among the evicted tokens, and why the server's does not:
an offline analysis on SmolLM2 with the Hugging Face model, one JSON line per trial.

    python scripts/recall_statistics.py --task session --out docs/results/recall_statistics_session.jsonl
    python scripts/recall_statistics.py --task docqa --out docs/results/recall_statistics_docqa.jsonl

`--task session` (the split's 5-turn sessions, 120-token passages, full-cache greedy replies of
at most 16 tokens): the last prompt's scoring window (its last 16 queries before the final
token) attends over the WHOLE conversation, every token visible; the candidates are the tokens a
256-token StreamingLLM view would have evicted (after the 16 sinks, before the last 240 of the
history). Per statistic and pick rule: the fraction of the fact's digits among the `recall`
picked, and the digits' ranks. This is the best case: the server's question sees only the kept
tokens when it scores.

`--task docqa` (the split's 1,000-token documents): the masked reference
(`sgl_vtoken_tools.hf_reference.masked_turn`, exact to the server) evicts the document chunk by
chunk (`--policy`, budget 256, `prefill_chunk` 64, `--window` 32, offload + recall 64); at the last
chunk's cut its window's queries, computed over the kept tokens, score every candidate. Per
statistic: the fraction of the fact's tokens and digits among the 64 picked; also the answer,
and how much of the fact the device row kept.

`--task agent` (the split's agent sessions, `sgl_vtoken_tools.quality.agent_sessions`, replies
greedy with the full cache, at most 64 tokens, the last at most 16; `--cache` keeps the played
conversations for reruns): the whole conversation visible, the candidates every token after the
16 sinks and before the last 32 of the history; per set of queries, the rank (0 = best) of each
of the key's five digits among the candidates under the sum / upper-half sum / max-head sum /
max statistics: the last prompt's scoring window (what the server's recall scores with), the
full-cache reply's tokens before its first digit ("The pass key is"), and the last of them alone
(the query that emits the first digit); and the fraction of the digits among the `--recall`
(default 192) picked by the sum and upper-half sum at (pool, gap) (1, 0), (5, 0), (5, 8).

Statistics: layers (all / upper half / lower half) x aggregation over layers and heads (sum;
max over heads, summed over layers; max over both), each picked with `sgl_vtoken.recall.pick`
at (pool, gap) (1, 0), (5, 0), (5, 8) and, for sessions, (7, 8).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RULES = {"session": ((1, 0), (5, 0), (7, 8), (5, 8)), "docqa": ((1, 0), (5, 0), (5, 8))}


def statistics(per: torch.Tensor) -> dict[str, torch.Tensor]:
    """``[L, H, c]`` attention mass per layer, query head and candidate -> named ``[c]`` scores."""
    n = per.shape[0]
    out = {}
    for name, layers in (
        ("all", slice(0, n)),
        ("upper", slice(n // 2, n)),
        ("lower", slice(0, n // 2)),
    ):
        p = per[layers]
        out[f"{name}/sum"] = p.sum((0, 1))
        out[f"{name}/maxhead"] = p.amax(1).sum(0)
        out[f"{name}/max"] = p.amax((0, 1))
    return out


def coverage(
    scores: dict[str, torch.Tensor],
    cand: torch.Tensor,
    k: int,
    rules,
    targets: dict[str, list[int]],
) -> dict:
    """For each statistic and (pool, gap): the fraction of each target's positions among the `k` picked."""
    from sgl_vtoken.recall import pick

    out = {}
    for name, sc in scores.items():
        for pool, gap in rules:
            kept = set(cand[pick(sc, k, pool, gap)].tolist())
            out[f"{name}/p{pool}g{gap}"] = {
                t: round(sum(p in kept for p in pos) / len(pos), 2) if pos else None
                for t, pos in targets.items()
            }
    return out


def digits(tok, ids, lo: int, hi: int) -> list[int]:
    return [p for p in range(lo, hi) if any(c.isdigit() for c in tok.decode([ids[p]]))]


def session_lines(args, tok, model):
    from sgl_vtoken_tools.quality.splits import session_trials
    from sgl_vtoken_tools.quality.tasks import next_turn_ids

    eos = tok.convert_tokens_to_ids("<|im_end|>")

    def greedy(ids, n=16):
        out, nxt = [], None
        with torch.no_grad():
            o = model(torch.tensor([ids]), use_cache=True)
            for _ in range(n):
                nxt = int(o.logits[0, -1].argmax())
                out.append(nxt)
                if nxt == eos:
                    break
                o = model(torch.tensor([[nxt]]), past_key_values=o.past_key_values, use_cache=True)
        return out

    trials = session_trials(
        tok, args.split, args.trials, turns=5, passage_tokens=120, seed=0, wheel_dir=args.wheel_dir
    )
    for t in trials:
        prompt, reply = list(t.prompt), []
        for m in t.messages:
            reply = greedy(prompt)
            prompt += reply + next_turn_ids(tok, m, reply)
        hist = len(prompt) - len(next_turn_ids(tok, t.messages[-1], reply))
        text = [tok.decode([i]).strip() for i in prompt]
        fact = next(
            (
                list(range(s, s + len(t.answer)))
                for s in range(len(prompt))  # one token a digit
                if "".join(text[s : s + len(t.answer)]) == t.answer
            ),
            None,
        )
        if fact is None:
            raise SystemExit(
                f"{t.id}: the fact's digits {t.answer} are not one token each in the prompt"
            )
        with torch.no_grad():
            att = model(torch.tensor([prompt]), output_attentions=True).attentions
        end = len(prompt) - 1
        cand = torch.arange(16, hist - 240)
        per = torch.stack([a[0, :, end - 16 : end, :].sum(1)[:, cand] for a in att])  # [L, H, c]
        in_window = not (16 <= fact[0] and fact[-1] < hist - 240)
        line = {
            "trial": t.id,
            "fact_turn": t.meta["fact_turn"],
            "fact": fact,
            "candidates": len(cand),
            "fact_in_recent_window": in_window,
        }
        if not in_window:
            line.update(
                coverage(
                    statistics(per), cand, args.recall or 128, RULES["session"], {"digits": fact}
                )
            )
        yield line


def docqa_lines(args, tok, model):
    import sgl_vtoken_tools.hf_reference as ref
    from sgl_vtoken.config import EvictConfig
    from sgl_vtoken.recall import window_probs
    from sgl_vtoken_tools.quality.splits import docqa_trials
    from sgl_vtoken_tools.quality.tasks import first_number
    from sgl_vtoken_tools.runtime_choice import RUNTIME_RECALL, runtime_policy

    cfg = EvictConfig.from_dict(
        {
            "policy": args.policy,
            "budget": 256,
            "sink": 16,
            "window": args.window,
            "interval": 16,
            "prefill_chunk": 64,
            "offload": True,
            "host_tokens": 1 << 20,
            "recall": args.recall or 64,
        }
    )
    seen: dict = {}
    original = ref._recall

    def recording(res, queries, candidates, row, window, cfg, k, rule):
        lengths = torch.tensor([row.index(t) + 1 for t in window])
        per = []
        for layer, (q, scale) in enumerate(queries):
            keys = res.past_key_values.layers[layer].keys[0]
            rk, ck = keys[:, row].transpose(0, 1), keys[:, candidates].transpose(0, 1)
            p = window_probs(
                q[0][:, window].transpose(0, 1),
                torch.cat([rk, ck]),
                lengths,
                scale,
                open_tail=ck.shape[0],
            )
            per.append(p[:, :, rk.shape[0] :].sum(0))
        seen.update(per=torch.stack(per), cand=torch.tensor(candidates))
        return original(res, queries, candidates, row, window, cfg, k, rule)

    for t in docqa_trials(tok, args.split, [1000], 0, args.wheel_dir):
        seen.clear()
        ref._recall = (
            recording  # the reference's own pick still decides; this only records the scores
        )
        try:
            out, row, _ = ref.masked_turn(
                model,
                list(t.prompt),
                12,
                cfg,
                rid=t.id,
                policy=runtime_policy,
                recall=RUNTIME_RECALL,
            )
        finally:
            ref._recall = original
        answer = tok.decode(out, skip_special_tokens=True)
        lo, hi = t.span
        line = {
            "trial": t.id,
            "hit": first_number(answer) == t.answer,
            "answer": answer[:60],
            "fact_kept_on_device": round(sum(p in row for p in range(lo, hi)) / (hi - lo), 2),
        }
        if seen:
            targets = {"fact": list(range(lo, hi)), "digits": digits(tok, t.prompt, lo, hi)}
            line["candidates"] = int(seen["cand"].numel())
            line.update(
                coverage(
                    statistics(seen["per"]), seen["cand"], cfg.host.recall, RULES["docqa"], targets
                )
            )
        yield line


def _ranks(per: torch.Tensor, at: list[int]) -> dict[str, list[int]]:
    """``[L, H, c]`` mass -> per statistic the ranks (0 = best) of candidate indices `at`."""
    n = per.shape[0]
    stats = {
        "sum": per.sum((0, 1)),
        "upper": per[n // 2 :].sum((0, 1)),
        "maxhead": per.amax(1).sum(0),
        "max": per.amax((0, 1)),
    }
    out = {}
    for name, sc in stats.items():
        rank = torch.empty(sc.numel(), dtype=torch.int64)
        rank[torch.argsort(sc, descending=True)] = torch.arange(sc.numel())
        out[name] = [int(rank[i]) for i in at]
    return out


def agent_lines(args, tok, model):
    from sgl_vtoken_tools.quality.agent_sessions import SYSTEM, AgentSpec, agent_sessions

    eos = tok.convert_tokens_to_ids("<|im_end|>")

    def ids_of(msgs, gen=True):
        text = tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
        return tok(text, add_special_tokens=False).input_ids

    def greedy(ids, n):
        out = []
        with torch.no_grad():
            o = model(torch.tensor([ids]), use_cache=True)
            for _ in range(n):
                nxt = int(o.logits[0, -1].argmax())
                if nxt == eos:
                    break
                out.append(nxt)
                o = model(torch.tensor([[nxt]]), past_key_values=o.past_key_values, use_cache=True)
        return out

    cache = Path(args.cache) if args.cache else None
    convs = json.loads(cache.read_text()) if cache and cache.exists() else {}
    spec = AgentSpec(args.split, args.trials, (8, 10), (200, 600), 0)
    w = 16
    for s in agent_sessions(tok, spec, args.wheel_dir):
        if s.id not in convs:  # the conversation as the full cache plays it
            msgs = [{"role": "system", "content": SYSTEM}]
            for t, (_, text) in enumerate(s.turns, 1):
                msgs.append({"role": "user", "content": text})
                if t < len(s.turns):
                    reply = tok.decode(greedy(ids_of(msgs), 64))
                    msgs.append({"role": "assistant", "content": reply})
            ids = ids_of(msgs)
            convs[s.id] = {
                "ids": ids,
                "hist": len(ids_of(msgs[:-1], False)),
                "reply": greedy(ids, 16),
            }
            if cache:
                cache.write_text(json.dumps(convs))
        ids, hist, reply = (convs[s.id][k] for k in ("ids", "hist", "reply"))
        text = [tok.decode([i]).strip() for i in ids]
        key = next(p for p in range(len(ids)) if "".join(text[p : p + 5]) == s.answer)
        first = next(
            (j for j, i in enumerate(reply) if any(c.isdigit() for c in tok.decode([i]))), 0
        )
        n, cand = len(ids), torch.arange(16, hist - 32)
        with torch.no_grad():  # the last w + 1 prompt tokens and the reply's prefix, attentions out
            o = model(torch.tensor([ids[: n - w - 1]]), use_cache=True)
            att = model(
                torch.tensor([ids[n - w - 1 :] + reply[:first]]),
                past_key_values=o.past_key_values,
                output_attentions=True,
            ).attentions
        per = torch.stack([a[0][:, :, cand] for a in att])  # [L, H, queries, c]
        at, digits_at = [p - 16 for p in range(key, key + 5)], list(range(key, key + 5))
        line = {
            "trial": s.id,
            "fact_turn": s.meta["fact_turn"],
            "prompt_tokens": n,
            "key": [key, key + 5],
            "candidates": len(cand),
            "full_cache_reply": tok.decode(reply),
        }
        queries = {"window": per[:, :, :w].sum(2)}
        if first:  # the reply names a number: the queries before its first digit
            queries.update(answer_prefix=per[:, :, w + 1 :].sum(2), first_digit_query=per[:, :, -1])
        for name, mass in queries.items():
            picked = coverage(
                {k: v for k, v in statistics(mass).items() if k in ("all/sum", "upper/sum")},
                cand,
                args.recall or 192,
                ((1, 0), (5, 0), (5, 8)),
                {"digits": digits_at},
            )
            line[name] = {
                "ranks": _ranks(mass, at),
                "picked": {k: v["digits"] for k, v in picked.items()},
            }
        yield line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--task", choices=("session", "docqa", "agent"), required=True)
    p.add_argument("--model", default=str(REPO / ".cache" / "smollm2"))
    p.add_argument("--split", default="tuning", help="tuning (where rules are chosen) or heldout")
    p.add_argument(
        "--trials", type=int, default=12, help="sessions (docqa: every 1,000-token document)"
    )
    p.add_argument("--policy", default="h2o", help="docqa: the policy evicting during prefill")
    p.add_argument("--window", type=int, default=32, help="docqa: the policy's recent window")
    p.add_argument(
        "--recall",
        type=int,
        default=0,
        help="tokens picked (default 128 sessions, 64 docqa, 192 agent)",
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--wheel-dir", default=str(REPO / ".cache" / "wheels"))
    p.add_argument("--cache", help="agent: JSON file of the played conversations (reused)")
    p.add_argument("--out", help="JSON lines file (default: stdout only)")
    args = p.parse_args(argv)
    if args.trials < 1 or args.recall < 0:
        p.error(f"--trials must be >= 1 and --recall >= 0 (got {args.trials}, {args.recall})")
    from transformers import AutoTokenizer

    from sgl_vtoken_tools.hf_reference import load_model

    torch.set_num_threads(args.threads)
    tok, model = AutoTokenizer.from_pretrained(args.model), load_model(args.model)
    out = open(args.out, "w") if args.out else None
    lines = {"session": session_lines, "docqa": docqa_lines, "agent": agent_lines}[args.task]
    for line in lines(args, tok, model):
        print(json.dumps(line), flush=True)
        if out:
            out.write(json.dumps(line) + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
