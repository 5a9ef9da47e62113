"""The groups of :class:`sgl_vtoken.config.EvictConfig`: frozen settings of one concern each,
validated in their own ``__post_init__``. A group field's metadata ``"key"`` is its flat
user-facing key (flags, ``--kv-evict-config``, per-request `kv_evict`, ``to_dict``); error
messages name that key (``EvictConfig.<key>``), which the server turns into the flag or the
request field."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sgl_vtoken.policies.base import AGGREGATIONS


def _key(key: str, **meta: Any) -> dict[str, Any]:
    """Field metadata: the flat user-facing key of a group field (flags, JSON, `kv_evict`)."""
    return {"key": key, **meta}


LAYER_RULES = ("upper", "all")


@dataclass(frozen=True)
class Scoring:
    """How statistics become token scores.

    Attributes:
        aggregation: how per-layer, per-head statistics become one score per token: ``"sum"``,
            ``"max"``, or None (the default): the policy's own (``max`` for H2O, ``sum`` for the
            others).
        obs_window: attention policies: prompt queries whose attention seeds the statistics at
            prefill (the last `obs_window`, SnapKV-style).
        score_layers: attention policies: the layers whose attention is scored: ``"upper"`` (the
            default: the upper half of the model's layers, ``num_layers // 2`` and up), ``"all"``
            (or None), or a list of layer ids. A rule is resolved against the served model by
            :meth:`layer_ids`.
        span: span-aware keeping: a word or digit run (`sgl_vtoken.units`) of up to `span`
            tokens is kept or dropped whole, longer ones in pieces of `span`; every policy.
            0: off (each token on its own). None (the default): the policy's own
            (`EvictConfig.span`: 8 for the attention policies, 0 for the others).
    """

    aggregation: str | None = field(default=None, metadata=_key("aggregation"))
    obs_window: int = field(default=16, metadata=_key("obs_window"))
    score_layers: tuple[int, ...] | str | None = field(
        default="upper", metadata=_key("score_layers")
    )
    span: int | None = field(default=None, metadata=_key("span", request=True))

    def __post_init__(self) -> None:
        if self.aggregation is not None:
            check_choice(
                "aggregation", self.aggregation, AGGREGATIONS, "or null (the policy's default)"
            )
        check_int("obs_window", self.obs_window, 1)
        if self.span is not None:
            check_int("span", self.span, 0)
        layers = self.score_layers
        if layers == "all":
            object.__setattr__(self, "score_layers", None)
        elif layers is not None and layers not in LAYER_RULES:
            if (
                not isinstance(layers, (list, tuple))
                or not layers
                or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in layers)
            ):
                raise ValueError(
                    f'EvictConfig.score_layers must be "upper", "all" (or null) or a '
                    f"non-empty list of layer ids >= 0 (got {layers!r})"
                )
            object.__setattr__(self, "score_layers", tuple(sorted(set(layers))))

    def layer_ids(self, num_layers: int) -> tuple[int, ...] | None:
        """The scored layer ids of a model of `num_layers` layers (None: every layer)::

        "upper", 30 layers  ->  (15, 16, ..., 29)      "all" -> None      [2, 5] -> (2, 5)
        """
        layers = self.score_layers
        if layers == "upper":
            return tuple(range(num_layers // 2, num_layers))
        assert not isinstance(layers, str), layers  # construction resolved every other rule
        return layers


@dataclass(frozen=True)
class Prefill:
    """Eviction during prefill.

    Attributes:
        chunk (``prefill_chunk``): evict during prefill (None: the prompt is prefilled whole
            first). The prompt is prefilled in chunks: whenever the row reaches ``budget +
            prefill_chunk`` live tokens and prompt tokens remain, it is evicted down to `budget`
            (attention policies score with that chunk's last `obs_window` queries), so a request
            never holds more than ``budget + prefill_chunk`` tokens of KV. A multiple of
            `page_size`, above `interval`; `budget` must then be a multiple of `page_size` too.
    """

    chunk: int | None = field(default=None, metadata=_key("prefill_chunk"))

    def __post_init__(self) -> None:
        if self.chunk is not None:
            check_int("prefill_chunk", self.chunk, 1)


@dataclass(frozen=True)
class History:
    """Compacted histories across turns.

    Attributes:
        reuse (``reuse_history``): a finished request leaves its compacted history in the radix
            cache, and a next turn that extends it continues from it instead of re-prefilling.
    """

    reuse: bool = field(default=True, metadata=_key("reuse_history"))

    def __post_init__(self) -> None:
        if not isinstance(self.reuse, bool):
            raise ValueError(
                f"EvictConfig.reuse_history must be true or false (got {self.reuse!r})"
            )


@dataclass(frozen=True)
class HostTier:
    """The host tier: evicted K/V kept in host memory, recalled by later turns.

    Attributes:
        offload: evicted tokens' K/V (every layer) go to the host store owned by the request's
            stored history instead of being dropped (docs/design/cache.md, "Host tier and recall").
            Needs `host_tokens`, and reclaim ``"vtoken"`` at page size > 1. With `prefill_chunk`
            the tokens evicted during the prompt's prefill go there too.
        tokens (``host_tokens``): capacity of the server's host store in tokens (0: no host
            store). When full, the stores of the least recently used stored histories are
            released first.
        recall: tokens a new turn may bring back from its history's host store (0: offload
            only). Scored after the new message's prefill by its last `obs_window` queries; the
            recalled tokens are kept for the rest of the turn, within `budget`. With
            `prefill_chunk` the prompt's last chunk scores and recalls, from the history's store
            and from what the prefill itself evicted.
            Candidates are ranked and taken as `sgl_vtoken.recall.pick` does with its `POOL` and
            `GAP`.
        rounds (``recall_rounds``): the turn recalls in this many rounds of ``recall //
            recall_rounds`` tokens (the last takes what is left); after each, the scoring window
            is recomputed with what came back visible and scores the candidates left, so a fact
            whose first token came back brings the rest (1: one round; at most `recall` rounds).
    """

    offload: bool = field(default=False, metadata=_key("offload", request=True))
    tokens: int = field(default=0, metadata=_key("host_tokens"))
    recall: int = field(default=0, metadata=_key("recall", request=True))
    rounds: int = field(default=4, metadata=_key("recall_rounds", request=True))

    def __post_init__(self) -> None:
        check_int("host_tokens", self.tokens, 0)
        check_int("recall", self.recall, 0)
        check_int("recall_rounds", self.rounds, 1)
        if not isinstance(self.offload, bool):
            raise ValueError(f"EvictConfig.offload must be true or false (got {self.offload!r})")
        if self.recall and not self.offload:
            raise ValueError(
                f"EvictConfig.recall {self.recall} needs offload: true (recalled tokens come "
                "from the host store)"
            )
        if self.offload and self.tokens < 1:
            raise ValueError(
                "EvictConfig.offload needs host_tokens >= 1: the server's host store "
                "capacity (--kv-evict-config '{\"host_tokens\": N}')"
            )


def check_choice(name: str, value: Any, allowed: tuple[str, ...], more: str = "") -> None:
    """ValueError naming `EvictConfig.<name>` unless `value` is one of `allowed` (`more`: what
    else the message names as allowed)."""
    if value not in allowed:
        tail = f" {more}" if more else ""
        raise ValueError(f"EvictConfig.{name} must be one of {list(allowed)}{tail} (got {value!r})")


def check_int(name: str, value: Any, lo: int, hi: int | None = None, why: str = "") -> None:
    """ValueError naming `EvictConfig.<name>` unless `value` is an integer in [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"EvictConfig.{name} must be an integer (got {value!r})")
    bound = f">= {lo}" + (f" ({why})" if why else "") if hi is None else f"in [{lo}, {hi}]"
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"EvictConfig.{name} must be {bound} (got {value})")
