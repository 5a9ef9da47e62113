"""Cutting texts to exact token counts with a server's own tokenizer (`/v1/tokenize` and
`/v1/detokenize`, which SGLang serves); approximate (one word ~ 1.3 tokens) for servers without
them."""

from __future__ import annotations

import requests


class TokenFitter:
    """`fit` cuts texts to token targets; `exact` says whether the server's tokenizer answered."""

    def __init__(self, base_url: str, model: str, timeout: float = 30.0):
        self.base_url, self.model, self.timeout = base_url, model, timeout
        self.exact = self._probe()

    def _post(self, path: str, payload: dict) -> dict:
        r = requests.post(
            self.base_url + path, json={"model": self.model, **payload}, timeout=self.timeout
        )
        r.raise_for_status()
        return r.json()

    def _probe(self) -> bool:
        try:
            return isinstance(self._post("/v1/tokenize", {"prompt": "probe"}).get("tokens"), list)
        except (requests.RequestException, ValueError):
            return False

    def tokenize(self, text: str) -> list[int]:
        return self._post("/v1/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]

    def fit(self, texts: list[str], targets: list[int], keep: list[str]) -> list[str]:
        """Each text cut to its target token count, never shorter than its prefix `keep[i]`
        (texts must be long enough: about one word per token)."""
        if not self.exact:
            return approx_fit(texts, targets, keep)
        kept = [i for i, k in enumerate(keep) if k]
        toks = self._post(
            "/v1/tokenize", {"prompt": texts + [keep[i] for i in kept], "add_special_tokens": False}
        )["tokens"]
        floors = [0] * len(texts)
        for i, ids in zip(kept, toks[len(texts) :]):
            floors[i] = len(ids)
        cut = [ids[: max(n, floor)] for ids, n, floor in zip(toks, targets, floors)]
        return self._post("/v1/detokenize", {"tokens": cut, "skip_special_tokens": True})["text"]


def approx_fit(texts: list[str], targets: list[int], keep: list[str]) -> list[str]:
    """Word-count cut (one word ~ 1.3 tokens), never shorter than `keep[i]`'s words."""
    return [
        " ".join(t.split(" ")[: max(len(k.split(" ")), round(n / 1.3))])
        for t, n, k in zip(texts, targets, keep)
    ]
