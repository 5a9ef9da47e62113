"""Eviction policies and their registry: ``make_policy("h2o", window=64)``.

Adding a policy: see docs/adding-a-policy.md (one file, one line below, one test-matrix line).
"""

from __future__ import annotations

from typing import Any

from sgl_vtoken.policies.base import EvictionPolicy, aggregate
from sgl_vtoken.policies.h2o import H2O
from sgl_vtoken.policies.knorm import KNorm
from sgl_vtoken.policies.random_policy import RandomPolicy
from sgl_vtoken.policies.scissorhands import Scissorhands
from sgl_vtoken.policies.sharing_aware import SharingAware
from sgl_vtoken.policies.streaming_llm import StreamingLLM
from sgl_vtoken.policies.tova import TOVA
from sgl_vtoken.selection import top_budget

POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (StreamingLLM, RandomPolicy, KNorm, H2O, TOVA, Scissorhands)
}


def make_policy(name: str, **kwargs: Any) -> EvictionPolicy:
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


__all__ = [
    "POLICIES",
    "EvictionPolicy",
    "H2O",
    "KNorm",
    "RandomPolicy",
    "Scissorhands",
    "SharingAware",
    "StreamingLLM",
    "TOVA",
    "aggregate",
    "make_policy",
    "top_budget",
]
