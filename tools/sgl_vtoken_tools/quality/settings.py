"""What one quality cell runs: a policy with its options at one budget, or the full cache.

A setting is written ``[label=]policy[:key=value,...]`` on the command line, e.g.
``streamingllm``, ``h2o:window=32``, ``tova:obs_window=64,aggregation=max``,
``h2o+=h2o:window=32,pool=5,score_layers=15-29``. Keys are :class:`EvictConfig` fields
(``window``, ``aggregation``, ``obs_window``, ``score_layers``: a JSON list or a range ``a-b``)
or policy parameters (``seed``, ``history``, ``threshold``, ``pool``, ``checkpoint``, ...).
Sinks, interval and page size are the sweep's (:class:`Sweep`), identical for every cell.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from sgl_vtoken.config import EvictConfig, setting_keys

FULL = "full"
SERVER_KEYS = ("policy", "budget", "sink", "window")  # what a request's kv_evict may override


@dataclass(frozen=True)
class Sweep:
    """Settings shared by every cell: sinks, interval and page size as the server's flags."""

    sink: int = 16
    interval: int = 16
    page_size: int = 1

    def __post_init__(self) -> None:
        sink_pages = -(-self.sink // self.page_size)  # sinks round up to whole pages
        EvictConfig(
            policy="streamingllm",
            budget=(sink_pages + 1) * self.page_size,
            sink=self.sink,
            interval=self.interval,
            page_size=self.page_size,
        )  # validates, naming the field


@dataclass(frozen=True)
class Setting:
    """One policy with its options (``policy="none"``: the full cache, no eviction)."""

    policy: str
    options: tuple[tuple[str, Any], ...] = ()
    label: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        from sgl_vtoken.policies import POLICIES

        if self.policy != "none" and self.policy not in POLICIES:
            raise ValueError(
                f"--settings: unknown policy {self.policy!r}; choose from {sorted(POLICIES)}"
            )

    @classmethod
    def parse(cls, spec: str) -> Setting:
        """``[label=]policy[:key=value,...]``; values are JSON where they parse as JSON, else
        strings; ``score_layers=a-b`` is the range a..b inclusive."""
        label = ""
        head = spec.split(":", 1)[0]
        if "=" in head:
            label, _, spec = spec.partition("=")
        policy, _, rest = spec.partition(":")
        opts = []
        for item in filter(None, _split(rest)):
            key, eq, value = item.partition("=")
            if not eq or not key:
                raise ValueError(f"setting {spec!r}: expected key=value, got {item!r}")
            try:
                v = json.loads(value)
            except json.JSONDecodeError:
                v = value
            if key == "score_layers" and isinstance(v, str) and re.fullmatch(r"\d+-\d+", v):
                lo, hi = map(int, v.split("-"))
                v = list(range(lo, hi + 1))
            opts.append((key, tuple(v) if isinstance(v, list) else v))
        return cls(policy, tuple(opts), label=label)

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        if self.policy == "none":
            return FULL
        tail = ",".join(f"{k}={_short(v)}" for k, v in self.options)
        return f"{self.policy}:{tail}" if tail else self.policy

    def config(self, sweep: Sweep, budget: int | None) -> EvictConfig:
        """The :class:`EvictConfig` of this setting at `budget` (ValueError naming the setting)."""
        if self.policy == "none":
            return EvictConfig(page_size=sweep.page_size)
        known = set(setting_keys()) - {"params"}  # any other option is a policy parameter
        top = {k: v for k, v in self.options if k in known}
        params = {k: v for k, v in self.options if k not in top}
        try:
            cfg = EvictConfig.from_dict(
                dict(
                    policy=self.policy,
                    budget=budget,
                    sink=sweep.sink,
                    interval=sweep.interval,
                    page_size=sweep.page_size,
                    params=params,
                    **top,
                )
            )
            from sgl_vtoken.config import policy_from_config

            policy_from_config(cfg)  # the policy's parameters
            return cfg
        except (TypeError, ValueError) as e:
            raise ValueError(f"setting {self.name!r} at budget {budget}: {e}") from None

    def kv_evict(self, cfg: EvictConfig) -> dict:
        """The per-request ``kv_evict`` object for `cfg` (policy, budget, sinks, window); the
        other options must be the server's (:meth:`server_options`)."""
        if not cfg.enabled:
            return {"policy": "none"}
        return {k: getattr(cfg, k) for k in SERVER_KEYS}

    def server_options(self) -> dict:
        """Options a request cannot carry (server-wide ``--kv-evict-config`` ones)."""
        return {k: v for k, v in self.options if k not in SERVER_KEYS}


def _split(text: str) -> list[str]:
    """Split on commas outside brackets: ``a=1,b=[1,2]`` -> ``["a=1", "b=[1,2]"]``."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "[{"
        depth -= ch in "]}"
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return out + [cur]


def _short(v) -> str:
    if (
        isinstance(v, tuple)
        and len(v) > 2
        and all(isinstance(x, int) for x in v)
        and list(v) == list(range(v[0], v[-1] + 1))
    ):
        return f"{v[0]}-{v[-1]}"  # score_layers written as the range it was given as
    s = (
        v
        if isinstance(v, str)
        else json.dumps(list(v) if isinstance(v, tuple) else v, separators=(",", ":"))
    )
    return s if len(s) <= 24 else "…" + s[-20:]
