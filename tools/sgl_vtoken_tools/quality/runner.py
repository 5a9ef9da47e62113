"""Run the quality tasks for every cell (setting x budget) through the fast masked reference.

Each prompt is prefilled once and shared by every cell (a prefill is full attention whatever
the policy); a cell then decodes from it under its own eviction. One ``trial`` record per
(task, trial, cell), emitted as soon as it is known:

    passkey  (and docqa) hit, answer, output_ids, needle_kept (fraction of the needle's tokens the first
             eviction kept), needle_live (... still live at the end)
    recall   (and session) hit, answer, the replies of every turn, fact_kept (fraction of the fact's tokens
             live when the question is answered)
    lm       nll and tokens of the teacher-forced continuation, top1 (positions where the
             prediction equals the full cache's), greedy_agree / greedy_prefix (free-running
             greedy continuation vs the full cache's)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sgl_vtoken.config import EvictConfig
from sgl_vtoken.units import Words
from sgl_vtoken_tools.quality.fastref import Request, prefill
from sgl_vtoken_tools.quality.retrieval import value_outcome
from sgl_vtoken_tools.quality.settings import Setting, Sweep
from sgl_vtoken_tools.quality.tasks import Trial, exact_number, next_turn_ids


@dataclass(frozen=True)
class Cell:
    setting: Setting
    budget: int | None
    cfg: EvictConfig

    @property
    def key(self) -> dict:
        return {"setting": self.setting.name, "policy": self.setting.policy, "budget": self.budget}

    def rid(self, trial: str, turn: int = 0) -> str:
        """Request id (seeded policies hash it): the same in the reference and the server."""
        return f"{trial}|{self.setting.name}|{self.budget}|{turn}"


def make_cells(settings: list[Setting], budgets: list[int], sweep: Sweep) -> list[Cell]:
    """The full cache first, then every setting at every budget."""
    full = Setting("none")
    cells = [Cell(full, None, full.config(sweep, None))]
    cells += [
        Cell(s, b, s.config(sweep, b)) for s in settings if s.policy != "none" for b in budgets
    ]
    return cells


def _frac(positions: torch.Tensor | None, span: tuple[int, int]) -> float | None:
    lo, hi = span
    if hi <= lo:
        return None
    if positions is None:
        return 1.0
    return round(float(((positions >= lo) & (positions < hi)).sum()) / (hi - lo), 4)


class Runner:
    """Runs tasks for `cells` on `model` (loaded by ``fastref.load_model``), emitting records."""

    def __init__(
        self,
        model,
        tokenizer,
        cells: list[Cell],
        emit: Callable[[dict], None],
        progress: Callable[[int], None] = lambda n: None,
    ) -> None:
        if not cells or cells[0].cfg.enabled:
            raise ValueError(
                "Runner: the first cell must be the full cache (make_cells puts it first)"
            )
        self.model, self.tok, self.cells, self.emit, self.progress = (
            model,
            tokenizer,
            cells,
            emit,
            progress,
        )
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        spans = any(c.cfg.span for c in cells)
        self.words = Words.from_tokenizer(tokenizer) if spans else None
        self.obs = max(c.cfg.scoring.obs_window for c in cells)

    def request(self, cell: Cell, trial: str, turn: int = 0, history=None) -> Request:
        """A fresh request of `cell` (a later `turn` continues `history`, the previous one)."""
        rid = cell.rid(trial, turn)
        if history is None:
            return Request(self.model, cell.cfg, rid, words=self.words)
        return Request(self.model, cell.cfg, rid, history.row, self.words, history.ids)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def passkey(self, trials: list[Trial], max_new_tokens: int = 12) -> None:
        for t in trials:
            prompt = prefill(self.model, list(t.prompt), self.obs)
            for cell in self.cells:
                t0 = time.monotonic()
                req = self.request(cell, t.id)
                req.start(prompt)
                out = req.generate(max_new_tokens, stop=(self.eos,))
                text = self.decode(out)
                self.emit(
                    {
                        "kind": "trial",
                        "task": t.task,
                        **cell.key,
                        "trial": t.id,
                        **t.meta,
                        "hit": exact_number(text, t.answer),
                        "outcome": value_outcome(text, t.answer),
                        "expected": t.answer,
                        "answer": text,
                        "output_ids": out,
                        "needle_kept": _frac(req.first_kept, t.span),
                        "needle_live": _frac(req.row.positions if req.steps else None, t.span),
                        "seconds": round(time.monotonic() - t0, 3),
                    }
                )
                self.progress(1)

    def recall(self, trials: list[Trial], max_new_tokens: int = 40) -> None:
        for t in trials:
            first = prefill(self.model, list(t.prompt), self.obs)
            for cell in self.cells:
                t0 = time.monotonic()
                replies, ids, req = [], [], self.request(cell, t.id, 0)
                req.start(first)
                out = req.generate(max_new_tokens, stop=(self.eos,))
                replies.append(self.decode(out))
                ids.append(out)
                for turn, message in enumerate(t.messages, start=1):
                    new_ids = next_turn_ids(self.tok, message, out)
                    # The server continues from the compacted history (every page size).
                    nxt = self.request(cell, t.id, turn, req)
                    # The reply's last token was never fed (it ended the turn): it opens the prompt.
                    nxt.prompt(out[-1:] + new_ids)
                    req = nxt
                    out = req.generate(max_new_tokens, stop=(self.eos,))
                    replies.append(self.decode(out))
                    ids.append(out)
                self.emit(
                    {
                        "kind": "trial",
                        "task": t.task,
                        **cell.key,
                        "trial": t.id,
                        **t.meta,
                        "hit": exact_number(replies[-1], t.answer),
                        "expected": t.answer,
                        "answer": replies[-1],
                        "replies": replies[:-1],
                        "turn_ids": ids,
                        "fact_kept": _frac(req.row.positions, t.span),
                        "seconds": round(time.monotonic() - t0, 3),
                    }
                )
                self.progress(1)

    def lm(self, trials: list[Trial], greedy_tokens: int = 32) -> None:
        for t in trials:
            prompt = prefill(self.model, list(t.prompt), self.obs)
            cont = list(t.meta["continuation"])
            ref_top1 = ref_greedy = None
            for cell in self.cells:
                t0 = time.monotonic()
                req = self.request(cell, t.id)
                first = req.start(prompt)
                logits = torch.cat([first[None], req.feed(cont[:-1])])  # [T, vocab]
                logp = torch.log_softmax(logits.double(), dim=-1)
                nll = -float(logp[torch.arange(len(cont)), torch.tensor(cont)].sum())
                top1 = logits.argmax(dim=-1)
                gen = self.request(cell, t.id, 1)
                gen.start(prompt)
                greedy = gen.generate(greedy_tokens)
                if ref_top1 is None:  # the first cell is the full cache
                    ref_top1, ref_greedy = top1, greedy
                same = [a == b for a, b in zip(greedy, ref_greedy)]
                self.emit(
                    {
                        "kind": "trial",
                        "task": "lm",
                        **cell.key,
                        "trial": t.id,
                        "offset": t.meta["offset"],
                        "context": len(t.prompt),
                        "tokens": len(cont),
                        "nll": round(nll, 4),
                        "ppl": round(math.exp(nll / len(cont)), 4),
                        "top1": int((top1 == ref_top1).sum()),
                        "greedy_agree": round(sum(same) / len(same), 4),
                        "greedy_prefix": next((i for i, s in enumerate(same) if not s), len(same)),
                        "greedy_ids": greedy,
                        "seconds": round(time.monotonic() - t0, 3),
                    }
                )
                self.progress(1)
