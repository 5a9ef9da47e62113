"""Eviction settings: one frozen dataclass of frozen groups (`config_groups.py`: scoring,
history, prefill, host tier), its fields validated on construction, carried to every process as
JSON. The policy's parameters are validated where a config enters the system, by building the
policy once (:func:`policy_from_config`).

The server builds it from its flags (``--kv-evict POLICY --kv-budget N --kv-sink --kv-window
--kv-evict-interval --kv-reclaim --kv-evict-config JSON``) and hands it to the scheduler processes
through the environment (:data:`ENV_VAR`), so keys follow the flags (a group field by its flat key,
e.g. ``prefill_chunk``) and ``to_dict`` / ``from_dict`` round-trip through JSON exactly.

Row arithmetic the fields describe (one request, row coordinates, `budget` live tokens kept)::

    row before eviction                          row after eviction (budget tokens)
    |sink|.......... evictable ..........|window|   ->   |sink|... kept ...|window|
    0    sink                  len-window     len       0                     budget
    eviction runs when len >= budget + interval and keeps exactly `budget` tokens.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from sgl_vtoken.config_groups import History, HostTier, Prefill, Scoring, check_choice, check_int
from sgl_vtoken.policies import POLICIES, EvictionPolicy, SharingAware, make_policy

__all__ = [
    "DISABLED",
    "ENV_VAR",
    "KEYS",
    "RECLAIM_MODES",
    "TRIGGERS",
    "EvictConfig",
    "History",
    "HostTier",
    "Prefill",
    "Scoring",
    "SettingKey",
    "flag_of",
    "setting_keys",
]

ENV_VAR = "VTOKEN_CONFIG"
DISABLED = "none"
# The attention policies' default `span` (span-aware keeping), chosen on the tuning split's dense
# retrieval tasks (docs/RESULTS.md, "Whole values").
ATTENTION_SPAN = 8
RECLAIM_MODES = ("vtoken", "naive")  # `reclaim`: compact and free, or free fully dead pages only
# `trigger`: evict whenever a row reaches budget + interval, or only when the pool is short
TRIGGERS = ("budget", "pressure")


def _group(cls: type) -> Any:
    return field(default_factory=cls, metadata={"group": cls})


@dataclass(frozen=True)
class EvictConfig:
    """Token eviction and reclamation settings for every request of one server.

    The settings of one concern are a frozen group (:class:`Scoring`, :class:`Prefill`,
    :class:`History`, :class:`HostTier`); flags, ``--kv-evict-config``, per-request `kv_evict` and
    :meth:`to_dict` name each group field by its flat key (field metadata ``"key"``, e.g.
    ``prefill_chunk`` for ``prefill.chunk``). Field metadata also says which flag sets a field
    (``"flag"``; none: a key of ``--kv-evict-config``) and which a request may override
    (``"request"``); :func:`setting_keys` derives every list of keys from them.

    Attributes:
        policy: registry name of the eviction policy, or ``"none"`` (eviction disabled).
        budget: live tokens a request keeps after each eviction (row length cap); required
            unless the policy is ``"none"``. Must be at least ``sink_tokens + window + page_size``.
        sink: attention-sink tokens (positions ``< sink``) that are always kept. At page size
            > 1 it is rounded up to whole pages (:attr:`sink_tokens`): sink pages hold no holes.
        window: the most recent tokens of the row that are always kept.
        interval: hysteresis; evict when the row reaches ``budget + interval`` (1 = every step).
        trigger: ``"budget"``: a row is evicted whenever it reaches ``budget + interval``;
            ``"pressure"``: only when the pool cannot hold what the running rows and the
            waiting requests need, the longest rows down to one level, no further than the
            shortage needs and never below the budget (the floor); with room to spare a row
            keeps every token (`patches/step/pressure.py`).
        reclaim: ``"vtoken"`` (compact survivors, free pages) or ``"naive"`` (same victims; a page
            is freed only when all its tokens are dead).
        page_size: KV pool page size in tokens (SGLang ``--page-size``).
        seed: seed of seeded policies (``random``).
        params: policy hyperparameters (``--kv-evict-config`` JSON), passed to the policy class;
            validated against the policy where a config enters the system
            (:func:`policy_from_config`), not here.
        scoring, history, prefill, host: the groups.
    """

    policy: str = field(default=DISABLED, metadata={"flag": "--kv-evict", "request": True})
    budget: int | None = field(default=None, metadata={"flag": "--kv-budget", "request": True})
    sink: int = field(default=4, metadata={"flag": "--kv-sink", "request": True})
    window: int = field(default=0, metadata={"flag": "--kv-window", "request": True})
    interval: int = field(default=1, metadata={"flag": "--kv-evict-interval", "request": True})
    trigger: str = field(default="budget", metadata={"flag": "--kv-evict-trigger", "request": True})
    reclaim: str = field(default="vtoken", metadata={"flag": "--kv-reclaim"})
    page_size: int = field(default=1, metadata={"flag": "--page-size"})
    seed: int = 0
    params: Mapping[str, Any] = field(default_factory=dict, hash=False, metadata={"params": True})
    scoring: Scoring = _group(Scoring)
    history: History = _group(History)
    prefill: Prefill = _group(Prefill)
    host: HostTier = _group(HostTier)

    def __post_init__(self) -> None:
        names = [DISABLED, *sorted(POLICIES)]
        if self.policy not in names:
            raise ValueError(f"EvictConfig.policy must be one of {names} (got {self.policy!r})")
        check_choice("reclaim", self.reclaim, RECLAIM_MODES)
        check_choice("trigger", self.trigger, TRIGGERS)
        check_int("page_size", self.page_size, 1)
        check_int("sink", self.sink, 0)
        check_int("window", self.window, 0)
        check_int("interval", self.interval, 1)
        check_int("seed", self.seed, 0, 2**32 - 1)
        for f in _GROUP_FIELDS:
            if not isinstance(getattr(self, f.name), f.metadata["group"]):
                raise ValueError(
                    f"EvictConfig.{f.name} must be a {f.metadata['group'].__name__} "
                    f"(got {getattr(self, f.name)!r})"
                )
        if not isinstance(self.params, Mapping):
            raise ValueError(f"EvictConfig.params must be a JSON object (got {self.params!r})")
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))
        if not self.enabled:
            return
        floor = self.sink_tokens + self.window + self.page_size
        if self.budget is None:
            raise ValueError(f"EvictConfig.budget is required when policy={self.policy!r}")
        check_int(
            "budget",
            self.budget,
            floor,  # before any arithmetic on it (prefill, host tier)
            why=f"sink_tokens + window + page_size = {self.sink_tokens} + {self.window} "
            f"+ {self.page_size}",
        )
        if self.prefill.chunk is not None:
            self._check_prefill_chunk(self.prefill.chunk)
        self._check_offload()

    def _check_offload(self) -> None:
        if not self.host.offload:
            return
        if self.page_size > 1 and self.reclaim != "vtoken":
            raise ValueError(
                f"EvictConfig.offload needs reclaim 'vtoken' at page_size {self.page_size} "
                f"(got {self.reclaim!r})"
            )
        recall = self.host.recall
        if self.budget is not None and self.sink_tokens + self.window + recall + 1 > self.budget:
            raise ValueError(
                f"EvictConfig.recall must leave room in the budget: sink_tokens + window + "
                f"recall + 1 = {self.sink_tokens} + {self.window} + {recall} + 1 > "
                f"budget {self.budget}"
            )

    def _check_prefill_chunk(self, c: int) -> None:
        ps = self.page_size
        if c % ps or c <= self.interval:
            raise ValueError(
                f"EvictConfig.prefill_chunk must be a multiple of page_size {ps} and "
                f"> interval {self.interval} (got {c})"
            )
        if self.budget is not None and self.budget % ps:
            raise ValueError(
                f"EvictConfig.budget must be a multiple of page_size {ps} with "
                f"prefill_chunk (got {self.budget}): chunks end at row budget + prefill_chunk, "
                "which must be page-aligned"
            )

    @property
    def prefill_peak(self) -> int | None:
        """Row length at which a prefill is evicted when prompt tokens remain, or None."""
        return None if self.prefill.chunk is None else self.row_budget + self.prefill.chunk

    @property
    def prefill_hold(self) -> int | None:
        """KV tokens a request evicted during prefill holds at most: the prefill peak, plus the
        tokens its last chunk recalls, plus the partly filled page after them; None without
        `prefill_chunk`."""
        peak = self.prefill_peak
        return None if peak is None else peak + self.host.recall + self.page_size

    @property
    def decode_peak(self) -> int:
        """KV tokens an evicting request holds at most while it decodes: the row reaches
        ``budget + interval`` before each eviction, plus the partly filled page of the next."""
        return self.row_budget + self.interval + self.page_size

    @property
    def enabled(self) -> bool:
        return self.policy != DISABLED

    @property
    def row_budget(self) -> int:
        """`budget` of an enabled config, which always has one.

        Raises:
            ValueError: eviction is disabled (no budget).
        """
        if self.budget is None:
            raise ValueError(f"EvictConfig.budget is not set (policy {self.policy!r})")
        return self.budget

    @property
    def span(self) -> int:
        """The span in force (`Scoring.span`): the scoring group's, else the policy's default:
        `ATTENTION_SPAN` for a policy that reads attention, 0 for the others and for none."""
        if self.scoring.span is not None:
            return self.scoring.span
        return ATTENTION_SPAN if self.enabled and "attn" in POLICIES[self.policy].needs else 0

    @property
    def sink_tokens(self) -> int:
        """Sinks rounded up to whole pages: a partially evicted sink page could never be freed."""
        return math.ceil(self.sink / self.page_size) * self.page_size

    @property
    def on_pressure(self) -> bool:
        """Whether decode evicts only under memory pressure (`trigger` "pressure")."""
        return self.enabled and self.trigger == "pressure"

    def should_evict(self, row_len: int) -> bool:
        """True when a row of `row_len` live tokens reached its trigger, ``budget + interval``
        (under `trigger` "pressure" the least a row holds before a shortage may evict it)."""
        return self.enabled and row_len >= self.row_budget + self.interval

    def policy_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``make_policy(self.policy, **kwargs)``."""
        kwargs = {
            "sink": self.sink_tokens,
            "window": self.window,
            "span": self.span,
            **self.params,
        }
        if self.scoring.aggregation is not None:  # None: the policy's own default
            kwargs["aggregation"] = self.scoring.aggregation
        if "seed" in {f.name for f in fields(POLICIES[self.policy])}:
            kwargs.setdefault("seed", self.seed)
        return kwargs

    def history_namespace(self) -> str:
        """Radix-cache namespace of compacted histories: every setting that changes their KV."""
        params = json.dumps(dict(self.params), sort_keys=True)
        sc, host = self.scoring, self.host
        return (
            f"vtoken:{self.policy}:b{self.budget}:s{self.sink_tokens}:w{self.window}"
            f":i{self.interval}:p{self.page_size}:seed{self.seed}:{sc.aggregation}"
            f":o{sc.obs_window}:l{sc.score_layers}:u{self.span}:c{self.prefill.chunk}"
            f":off{int(host.offload)}:r{host.recall}:rr{host.rounds}"
            f"{':tpressure' if self.trigger == 'pressure' else ''}:{params}"
        )

    # --- serialization -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The settings by flat key (today's flag and JSON spellings); `from_dict` inverts it."""
        out = {k.key: k.get(self) for k in KEYS}
        out["params"] = dict(self.params)
        if isinstance(out["score_layers"], tuple):
            out["score_layers"] = list(out["score_layers"])
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EvictConfig:
        """The config of a dict of flat keys (:meth:`to_dict`); a group may also be given whole,
        as its object (``{"host": HostTier(...)}``) or a dict of its own field names."""
        allowed = [k.key for k in KEYS]
        top: dict[str, Any] = {}
        grouped: dict[str, dict[str, Any]] = {f.name: {} for f in _GROUP_FIELDS}
        for name, value in data.items():
            k = _BY_KEY.get(name)
            if k is not None and k.group is not None:
                grouped[k.group][k.name] = value
            elif name in grouped and isinstance(value, Mapping):
                grouped[name].update(value)
            elif name in allowed or name in grouped:
                top[name] = value
            else:
                unknown = sorted(set(data) - set(allowed) - set(grouped))
                raise ValueError(f"EvictConfig has no field(s) {unknown}; allowed: {allowed}")
        for f in _GROUP_FIELDS:
            if grouped[f.name]:
                if f.name in top:
                    raise ValueError(f"EvictConfig.{f.name} is given both whole and by key")
                top[f.name] = f.metadata["group"](**grouped[f.name])
        return cls(**top)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> EvictConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"EvictConfig JSON is malformed: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"EvictConfig JSON must be an object (got {type(data).__name__})")
        return cls.from_dict(data)

    @classmethod
    def from_env(cls, var: str = ENV_VAR) -> EvictConfig:
        """The config exported by the launcher, or the disabled default when `var` is unset."""
        return cls() if (text := os.environ.get(var)) is None else cls.from_json(text)


@dataclass(frozen=True)
class SettingKey:
    """One user-facing setting: its flat `key`, the `group` field holding it (None: a field of
    EvictConfig itself), its field `name` there, and that field's metadata."""

    key: str
    group: str | None
    name: str
    metadata: Mapping[str, Any]

    def get(self, cfg: EvictConfig) -> Any:
        return getattr(cfg if self.group is None else getattr(cfg, self.group), self.name)

    @property
    def flag(self) -> str:
        """The flag that sets it (error messages name the flag)."""
        return self.metadata.get("flag", "--kv-evict-config")


_GROUP_FIELDS = tuple(f for f in fields(EvictConfig) if "group" in f.metadata)
KEYS: tuple[SettingKey, ...] = tuple(
    SettingKey(f.name, None, f.name, f.metadata)
    for f in fields(EvictConfig)
    if "group" not in f.metadata
) + tuple(
    SettingKey(g.metadata["key"], f.name, g.name, g.metadata)
    for f in _GROUP_FIELDS
    for g in fields(f.metadata["group"])
)
_BY_KEY = {k.key: k for k in KEYS}


def setting_keys(**where: Any) -> tuple[str, ...]:
    """Flat keys whose field metadata has every ``name=value`` of `where` (``request=True``:
    what a request may override); ``json=True``: the server settings that ``--kv-evict-config``
    carries besides policy parameters."""

    def match(k: SettingKey) -> bool:
        meta = {
            **k.metadata,
            "json": k.flag == "--kv-evict-config" and not k.metadata.get("params"),
        }
        return all(meta.get(n, False) == v for n, v in where.items())

    return tuple(k.key for k in KEYS if match(k))


def flag_of(key: str) -> str:
    """The flag that sets the setting of flat `key` (``--kv-evict`` for an unknown key)."""
    k = _BY_KEY.get(key)
    return k.flag if k is not None else "--kv-evict"


@functools.lru_cache(maxsize=64)
def policy_from_config(cfg: EvictConfig) -> EvictionPolicy:
    """The configured policy, wrapped in :class:`SharingAware` (mode "never": the server never
    lets a policy choose a tree-owned token; "consensus" is a library mode).

    Policies hold no per-request state, so equal settings share one object: the eviction step
    scores the rows that share a policy together (`sgl_vtoken.step`).

    This is where a config's policy parameters are validated (the server's flags, a request's
    `kv_evict`): ValueError naming ``EvictConfig.params`` when they do not fit the policy."""
    if not cfg.enabled:
        raise ValueError("EvictConfig.policy is 'none': eviction is disabled")
    try:
        policy = make_policy(cfg.policy, **cfg.policy_kwargs())
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"EvictConfig.params {dict(cfg.params)} do not fit policy {cfg.policy!r}: {exc}"
        ) from None
    return SharingAware(policy, mode="never")
