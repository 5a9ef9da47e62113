"""Eviction policies and their registry: ``make_policy("h2o", window=64)``.

Adding a policy: see docs/adding-a-policy.md (one file, one line below, one test-matrix line).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from sgl_vtoken.policies.base import EvictionPolicy, aggregate, top_budget
from sgl_vtoken.policies.h2o import H2O
from sgl_vtoken.policies.knorm import KNorm
from sgl_vtoken.policies.kvp import KVP
from sgl_vtoken.policies.random_policy import RandomPolicy
from sgl_vtoken.policies.scissorhands import Scissorhands
from sgl_vtoken.policies.sharing_aware import SharingAware
from sgl_vtoken.policies.streaming_llm import StreamingLLM
from sgl_vtoken.policies.tova import TOVA

if TYPE_CHECKING:
    from sgl_vtoken.config import EvictConfig

POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (StreamingLLM, RandomPolicy, KNorm, H2O, TOVA, Scissorhands, KVP)
}


def make_policy(name: str, **kwargs) -> EvictionPolicy:
    """Instantiate the policy registered as `name` with its hyperparameters.

    Raises:
        ValueError: unknown name (the message lists the registered names).
        TypeError: a keyword the policy does not have.
    """
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(POLICIES)}") from None
    return cls(**kwargs)


@functools.lru_cache(maxsize=64)
def policy_from_config(cfg: "EvictConfig") -> EvictionPolicy:
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
        raise ValueError(f"EvictConfig.params {dict(cfg.params)} do not fit policy "
                         f"{cfg.policy!r}: {exc}") from None
    return SharingAware(policy, mode="never")


__all__ = ["POLICIES", "EvictionPolicy", "H2O", "KNorm", "KVP", "RandomPolicy", "Scissorhands",
           "SharingAware", "StreamingLLM", "TOVA", "aggregate", "make_policy",
           "policy_from_config", "top_budget"]
