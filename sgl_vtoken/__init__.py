"""sgl-vtoken: token-level KV-cache virtualization for SGLang.

The library (this package, no sglang import): eviction settings, policies, selection
(`selection`), the batched eviction step and its repack planner (`step`, `step_plan`), page
accounting (`pages`). The SGLang plugin lives in `sgl_vtoken.patches`, the kernels in
`sgl_vtoken.kernels`. This is the runtime; the tooling around it (benchmarks, quality harness,
models, launcher, references) is the package `sgl_vtoken_tools`.
"""

from sgl_vtoken.config import EvictConfig, History, HostTier, Prefill, Scoring, policy_from_config
from sgl_vtoken.policies import POLICIES, EvictionPolicy, make_policy
from sgl_vtoken.types import TokenView

__version__ = "0.1.0"

__all__ = [
    "EvictConfig",
    "EvictionPolicy",
    "History",
    "HostTier",
    "POLICIES",
    "Prefill",
    "Scoring",
    "TokenView",
    "make_policy",
    "policy_from_config",
]
