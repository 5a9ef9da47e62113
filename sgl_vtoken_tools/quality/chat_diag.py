"""The answer turn of one chat trial (`chats.py`) under the policy + recall, taken apart.

Plays trial `idx` of the tuning split's `group` under `chat_recall`'s third cell (h2o b256 +
recall 192 by default; flags after the two arguments are `chat_recall`'s), prints each turn's
recalled positions and the fact's digits in the row, then the answer's key digits
teacher-forced (the played answer up to its first digit, then the key) under masks that change
one thing each: as played, the full cache on the same tokens, the last turn seeing the whole
history, the prefill's row kept through decode, the view alone, the view plus the fact's digits.
The conversation is kept in ``$CHAT_DIAG_DIR`` (default /tmp) as a pickle, so a second run
only redoes the masks.

    python -m sgl_vtoken_tools.quality.chat_diag first 0 > diag.txt
"""

import json
import os
import pickle
import sys

import torch
from transformers import AutoTokenizer

from sgl_vtoken_tools.hf_reference import _mask, load_model
from sgl_vtoken_tools.quality import chat_recall as cr
from sgl_vtoken_tools.quality.chats import chat_trials


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    group, idx = argv[0], int(argv[1])
    args = cr.build_parser().parse_args(["--split", "tuning", "--group", group] + argv[2:])
    tok = AutoTokenizer.from_pretrained(args.model)
    model = load_model(args.model)
    label, cfg = cr.settings(args)[2]
    t = chat_trials(tok, "tuning", group, idx + 1)[idx]
    pk = os.path.join(os.environ.get("CHAT_DIAG_DIR", "/tmp"), f"chat_diag_{group}{idx}.pkl")
    if os.path.exists(pk):
        rec, keep = pickle.load(open(pk, "rb"))
    else:
        keep = []
        rec = cr.play(model, tok, t, label, cfg, args.max_new, cr._choice(False), keep)
        pickle.dump((rec, keep), open(pk, "wb"))
    print(json.dumps({k: rec[k] for k in ("hit", "answer", "expected")}))
    for tr in rec["turns"]:
        print(
            "turn",
            tr["prompt"],
            tr["reply"],
            "recalled",
            len(tr["recalled"]),
            tr["recalled"][:8],
            "...",
            tr["recalled"][-8:],
            "fact",
            tr["fact"],
            "seen",
            tr["fact_seen"],
        )
    ids, masks, start = keep[0]
    n_prompt = len(ids) - rec["turns"][-1]["reply"]
    key = tok(t.answer, add_special_tokens=False)["input_ids"]
    ans = ids[n_prompt:]
    # teacher-forced: the played answer up to its first digit, then the key's digits
    digits = set(tok.convert_tokens_to_ids(list("0123456789")))
    d = next((i for i, x in enumerate(ans) if x in digits), len(ans))
    seq = ids[:n_prompt] + ans[:d] + key
    q0 = n_prompt + d - 1  # query that writes the first digit
    fact = rec["turns"][-1]["fact"]
    rl = rec["turns"][-1]["recalled"]
    runs, a = [], None
    for p in rl:
        if a is None or p != runs[-1][1] + 1:
            runs.append([p, p])
        else:
            runs[-1][1] = p
    print("recalled runs", [(a, b, repr(tok.decode(ids[a : b + 1]))[:60]) for a, b in runs])
    print("fact missing", [p for p in rec["turns"][-1]["fact"] if p not in set(rl)])
    print("answer prefix", repr(tok.decode(ans[:d])), "fact positions", fact)
    hist = masks[:start]
    played = masks[start:]

    def extend(ms):
        ms = list(ms)
        while start + len(ms) < len(seq):
            ms.append(sorted(set(ms[-1]) | {start + len(ms)}))
        return ms

    recalled = rec["turns"][-1]["recalled"]
    view = [p for p in masks[start] if p < start]
    prow = [p for p in masks[n_prompt - 1] if p < start]
    print("view", len(view), "prefill row (history part)", len(prow), "recalled", len(recalled))
    variants = {
        "played": extend(played[: q0 - start + 1]),
        "full-causal": None,
        "turn sees whole history": [list(range(i + 1)) for i in range(start, len(seq))],
        "no decode eviction (prefill row)": [
            sorted(set(prow) | set(range(start, i + 1))) for i in range(start, len(seq))
        ],
        "view + own turn (no recall)": [
            sorted(set(view) | set(range(start, i + 1))) for i in range(start, len(seq))
        ],
        "view + fact + own turn": [
            sorted(set(view) | set(fact) | set(range(start, i + 1))) for i in range(start, len(seq))
        ],
        "sinks + fact + own turn": [
            sorted(set(range(16)) | set(fact) | set(range(start, i + 1)))
            for i in range(start, len(seq))
        ],
    }
    with torch.no_grad():
        for name, ms in variants.items():
            if ms is None:
                res = model(torch.tensor([seq]), output_attentions=True)
                allm = [list(range(i + 1)) for i in range(len(seq))]
            else:
                allm = hist + ms
                res = model(
                    torch.tensor([seq]),
                    attention_mask=_mask(allm, len(seq)),
                    output_attentions=True,
                )
            lp = torch.log_softmax(res.logits[0].float(), -1)
            probs = [float(lp[q0 + j, key[j]].exp()) for j in range(len(key))]
            top = tok.decode([int(lp[q0].argmax())])
            att = torch.stack([a[0, :, q0] for a in res.attentions])  # [L, H, T]
            fm = float(att[:, :, fact].sum(-1).mean()) if fact else 0.0
            fm_up = float(att[15:, :, fact].sum(-1).mean()) if fact else 0.0
            print(
                f"{name:35s} row {len(allm[q0]):5d} top1 {top!r:6} p(key digits) {[round(p, 3) for p in probs]} fact-attn mean {fm:.3f} upper {fm_up:.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
