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

`--task agent` (the split's agent sessions played greedily with the full cache; `--cache` keeps
them for reruns): for the last prompt's scoring window (what the server's recall scores with)
and the query that writes the reply's first digit, the ranks of the key's digits and the
fraction of them among the `--recall` (192) picked, by the all-layer and upper-half sums; once
with every token visible (candidates: all but the 16 sinks and the last 32), once with the last
message seeing only the sinks and the last `--recent` history tokens (the key evicted).

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
RULES = {
    "session": ((1, 0), (5, 0), (7, 8), (5, 8)),
    "docqa": ((1, 0), (5, 0), (5, 8)),
    "agent": ((1, 0), (5, 0), (5, 8)),
}


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
        return _greedy(model, ids, n, eos, keep_eos=True)

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


STATS = ("all/sum", "upper/sum")


def _greedy(model, ids: list[int], n: int, eos: int, keep_eos: bool = False) -> list[int]:
    """At most `n` greedy tokens after `ids`; stops at `eos` (kept with `keep_eos`)."""
    out: list[int] = []
    with torch.no_grad():
        o = model(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            nxt = int(o.logits[0, -1].argmax())
            if nxt != eos or keep_eos:
                out.append(nxt)
            if nxt == eos:
                break
            o = model(torch.tensor([[nxt]]), past_key_values=o.past_key_values, use_cache=True)
    return out


def _ranks(scores: dict[str, torch.Tensor], at: list[int]) -> dict[str, list[int]]:
    """Per named ``[c]`` score, the ranks (0 = best) of candidate indices `at`."""
    out = {}
    for name, sc in scores.items():
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
                    reply = tok.decode(_greedy(model, ids_of(msgs), 64, eos))
                    msgs.append({"role": "assistant", "content": reply})
            ids = ids_of(msgs)
            hist, reply = len(ids_of(msgs[:-1], False)), _greedy(model, ids, 16, eos)
            convs[s.id] = {"ids": ids, "hist": hist, "reply": reply}
            if cache:
                cache.write_text(json.dumps(convs))
        ids, hist, reply = (convs[s.id][k] for k in ("ids", "hist", "reply"))
        text = [tok.decode([i]).strip() for i in ids]
        key = next(p for p in range(len(ids)) if "".join(text[p : p + 5]) == s.answer)
        first = next(
            (j for j, i in enumerate(reply) if any(c.isdigit() for c in tok.decode([i]))), 0
        )
        seq, n, digits_at = ids + reply[:first], len(ids), list(range(key, key + 5))
        line = {"trial": s.id, "fact_turn": s.meta["fact_turn"], "prompt_tokens": n}
        line.update(key=[key, key + 5], full_cache_reply=tok.decode(reply))
        # Full: every token visible, the candidates all but the sinks and the last 32. Row: the
        # last message and the reply's prefix see the sinks and the last `--recent` tokens of
        # the history (the key evicted), as the server's view would; the rest are candidates.
        want = list(range(n - w - 1, len(seq)))  # the window, the last prompt token, the prefix
        for view, recent, masked in (("", 32, False), ("row_", args.recent, True)):
            cand, per = _candidate_mass(model, seq, hist, recent, masked, want)
            line[f"{view}candidates"] = len(cand)
            queries = {"window": per[:, :w]}
            if first:  # the reply names a number: the query that writes its first digit
                queries["first_digit_query"] = per[:, -1:]
            for name, mass in queries.items():
                stats = statistics(mass.sum(1))
                stats = {k: stats[k] for k in STATS}
                picked = coverage(stats, cand, args.recall or 192, RULES["agent"], {"d": digits_at})
                line[view + name] = {
                    "ranks": _ranks(stats, [p - 16 for p in digits_at]),
                    "picked": {k: v["d"] for k, v in picked.items()},
                }
        yield line


def _candidate_mass(model, seq, hist, recent, masked, want) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidates ``[16, hist - recent)`` ``[c]`` and ``[L, len(want), H, c]``: each wanted
    query's softmax mass on them, in one distribution with the keys it sees (all earlier ones, or
    with `masked` the sinks, the last `recent` of the history and the message so far; for
    positions < hist every earlier one). Queries post-RoPE, taken at each layer's input."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from sgl_vtoken.recall import window_probs
    from sgl_vtoken_tools.hf_reference import _mask

    row = list(range(16)) + list(range(hist - recent, hist))
    sees = [list(range(i + 1)) for i in range(len(seq))]
    if masked:
        sees[hist:] = [row + list(range(hist, i + 1)) for i in range(hist, len(seq))]
    qs = {}

    def grab(mod, args, kwargs):
        h, (cos, sin) = kwargs["hidden_states"], kwargs["position_embeddings"]
        q = mod.q_proj(h).view(*h.shape[:-1], -1, mod.head_dim).transpose(1, 2)
        qs[mod.layer_idx] = apply_rotary_pos_emb(q, q, cos, sin)[0][0][:, want].transpose(0, 1)

    att = [layer.self_attn for layer in model.model.layers]
    hooks = [a.register_forward_pre_hook(grab, with_kwargs=True) for a in att]
    try:
        with torch.no_grad():
            res = model(torch.tensor([seq]), attention_mask=_mask(sees, len(seq)), use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    # Each query sees the keys outside the candidates up to itself (a prefix of them in position
    # order, masked or not) and every candidate: one `window_probs` per layer.
    cand = torch.arange(16, hist - recent)
    other = torch.tensor([k for k in range(len(seq)) if not 16 <= k < hist - recent])
    lengths = torch.tensor([int((other <= p).sum()) for p in want])
    per = []
    for layer, q in sorted(qs.items()):
        keys = res.past_key_values.layers[layer].keys[0].transpose(0, 1)  # [n, hkv, d]
        scale = model.model.layers[layer].self_attn.scaling
        p = window_probs(q, keys[torch.cat([other, cand])], lengths, scale, open_tail=len(cand))
        per.append(p[:, :, len(other) :])
    return cand, torch.stack(per)


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
    p.add_argument("--recent", type=int, default=240, help="agent: history tokens the row keeps")
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
