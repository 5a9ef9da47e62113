"""Cross-check the fast reference against a running sgl-vtoken server, token for token.

The same trials run through ``/generate`` with ``input_ids``, the reference's request id and a
per-request ``custom_params.kv_evict`` object, greedy (the server's settings for everything a
request cannot carry: sinks, interval, page size, ``--kv-evict-config``). Multi-turn trials send
each turn as the previous turn's prompt + reply + the next message, so the server continues
from the compacted history it stored (page size 1). One ``server`` record per (task, trial, cell)
with ``equal``, and the first differing output index when not; a mismatch is a bug.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import requests

from sgl_vtoken_tools.quality.runner import Cell
from sgl_vtoken_tools.quality.tasks import Trial, next_turn_ids


class Client:
    def __init__(self, base_url: str, timeout: float = 900.0) -> None:
        self.base_url, self.timeout = base_url.rstrip("/"), timeout

    def generate(
        self,
        ids: list[int],
        rid: str,
        max_new_tokens: int,
        kv_evict: dict | None,
        stop: int | None = None,
    ) -> dict:
        """Greedy `/generate`; `kv_evict` None: the server's own flags (no ``custom_params``)."""
        params: dict = {"temperature": 0.0, "max_new_tokens": max_new_tokens}
        if kv_evict is not None:
            params["custom_params"] = {"kv_evict": kv_evict}
        if stop is None:
            params["ignore_eos"] = True
        else:
            params["stop_token_ids"] = [stop]
        r = requests.post(
            self.base_url + "/generate",
            json={"rid": rid, "input_ids": list(ids), "sampling_params": params},
            timeout=self.timeout,
        )
        if r.status_code != 200:
            raise RuntimeError(f"/generate -> HTTP {r.status_code}: {r.text[:500]}")
        return r.json()


def _strip(ids: list[int], eos: int) -> list[int]:
    """Output ids without a final stop token (servers differ on whether they report it)."""
    return list(ids[:-1]) if ids and ids[-1] == eos else list(ids)


def _diff(a: list[int], b: list[int]) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class ServerCheck:
    """Replays reference trials on a server; `reference[(task, trial, setting, budget)]` is the
    reference's ``trial`` record (with ``output_ids`` / ``turn_ids`` / ``greedy_ids``)."""

    def __init__(
        self,
        client: Client,
        tokenizer,
        reference: dict,
        emit: Callable[[dict], None],
        progress: Callable[[int], None] = lambda n: None,
    ) -> None:
        self.client, self.tok, self.ref, self.emit, self.progress = (
            client,
            tokenizer,
            reference,
            emit,
            progress,
        )
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def _record(
        self, task: str, t: Trial, cell: Cell, ref: list[int], got: list[int], t0: float, meta: dict
    ) -> None:
        ref, got = _strip(ref, self.eos), _strip(got, self.eos)
        self.emit(
            {
                "kind": "server",
                "task": task,
                **cell.key,
                "trial": t.id,
                "equal": ref == got,
                "first_diff": _diff(ref, got),
                "tokens": len(ref),
                **meta,
                "server_text": self.tok.decode(
                    [x for x in got if x >= 0], skip_special_tokens=True
                )[-200:],
                "seconds": round(time.monotonic() - t0, 3),
            }
        )
        self.progress(1)

    def passkey(self, trials: list[Trial], cells: list[Cell], max_new_tokens: int) -> None:
        for t in trials:
            for cell in cells:
                t0 = time.monotonic()
                ref = self.ref[(t.task, t.id, cell.setting.name, cell.budget)]
                out = self.client.generate(
                    t.prompt,
                    cell.rid(t.id),
                    max_new_tokens,
                    cell.setting.kv_evict(cell.cfg),
                    stop=self.eos,
                )
                self._record(
                    t.task,
                    t,
                    cell,
                    ref["output_ids"],
                    out["output_ids"],
                    t0,
                    {"meta": out["meta_info"].get("kv_evict")},
                )

    def recall(self, trials: list[Trial], cells: list[Cell], max_new_tokens: int) -> None:
        for t in trials:
            for cell in cells:
                t0 = time.monotonic()
                ref = self.ref[(t.task, t.id, cell.setting.name, cell.budget)]
                prompt, got, hist = list(t.prompt), [], []
                for turn in range(len(t.messages) + 1):
                    if turn:
                        prompt += got[-1] + next_turn_ids(self.tok, t.messages[turn - 1], got[-1])
                    out = self.client.generate(
                        prompt,
                        cell.rid(t.id, turn),
                        max_new_tokens,
                        cell.setting.kv_evict(cell.cfg),
                        stop=self.eos,
                    )
                    got.append(list(out["output_ids"]))
                    kv = (out["meta_info"].get("kv_evict") or [{}])[0]
                    hist.append(kv.get("history_tokens", 0))

                def flat(turns):
                    return [x for ids in turns for x in _strip(ids, self.eos) + [-1]]

                self._record(
                    t.task, t, cell, flat(ref["turn_ids"]), flat(got), t0, {"history_tokens": hist}
                )

    def lm(self, trials: list[Trial], cells: list[Cell], greedy_tokens: int) -> None:
        for t in trials:
            for cell in cells:
                t0 = time.monotonic()
                ref = self.ref[("lm", t.id, cell.setting.name, cell.budget)]
                out = self.client.generate(
                    t.prompt, cell.rid(t.id, 1), greedy_tokens, cell.setting.kv_evict(cell.cfg)
                )
                self._record("lm", t, cell, ref["greedy_ids"], out["output_ids"], t0, {})
