"""Invariants every policy must hold, bare and inside SharingAware (kvpress-style matrix)."""

import itertools

import pytest
import torch

from sgl_vtoken.policies import POLICIES, SharingAware, make_policy
from sgl_vtoken.types import TokenView

L, H, D = 2, 3, 4

# The policy matrix: every registered policy with an easy and a hard set of hyperparameters.
# Adding a policy = one line here (docs/adding-a-policy.md); test_registry_covered fails otherwise.
MATRIX = {
    "streamingllm": [dict(), dict(sink=2, window=3)],
    "random": [dict(seed=0), dict(seed=12345, sink=0, window=5)],
    "knorm": [dict(), dict(aggregation="max", window=2)],
    "h2o": [dict(window=2), dict(aggregation="max", sink=1, window=6, pool=5)],
    "tova": [dict(), dict(aggregation="max", window=1, pool=3)],
    "scissorhands": [dict(window=2), dict(history=5, threshold=0.5, aggregation="max", pool=3)],
}
CASES = [(name, kw) for name, kws in MATRIX.items() for kw in kws]


def make_view(n: int, seed: int, gap: int = 1, shared_prefix: int = 0, rid: int = 7, step: int = 3):
    g = torch.Generator().manual_seed(seed)
    positions = torch.arange(n, dtype=torch.int64) * gap  # gaps: an already-evicted row
    shared = torch.zeros(n, dtype=torch.bool)
    shared[:shared_prefix] = True
    return TokenView(
        positions=positions,
        keys=torch.randn(n, L, H, D, generator=g),
        attn=torch.rand(n, L, H, generator=g),
        shared=shared,
        rid=rid,
        step=step,
    )


def test_registry_covered():
    assert set(MATRIX) == set(POLICIES), (
        "add the new policy to tests/runtime/lib/policies/matrix.py"
    )


@pytest.mark.parametrize("wrapped", [False, True], ids=["bare", "sharing"])
@pytest.mark.parametrize(
    "name,kwargs", CASES, ids=[f"{n}-{i}" for n, kws in MATRIX.items() for i in range(len(kws))]
)
@pytest.mark.parametrize(
    "n,budget,gap,shared_prefix", [(40, 20, 1, 5), (33, 12, 3, 2), (16, 16, 1, 4), (9, 20, 1, 0)]
)
def test_invariants(name, kwargs, wrapped, n, budget, gap, shared_prefix):
    policy = make_policy(name, **kwargs)
    if wrapped:
        policy = SharingAware(policy)
    view = make_view(n, seed=n * 31 + budget, gap=gap, shared_prefix=shared_prefix)
    keep = policy.keep(view, budget)
    assert keep.dtype == torch.int64
    assert keep.numel() == min(n, budget)  # exactly budget kept
    assert torch.equal(keep, torch.unique(keep))  # unique, ascending
    kept = torch.zeros(n, dtype=torch.bool)
    kept[keep] = True
    sink, window = policy.sink, policy.window
    assert kept[view.positions < sink].all()  # sinks kept
    assert kept[max(n - window, 0) :].all()  # recent window kept
    if wrapped:
        assert kept[view.shared].all()  # shared kept under the wrapper
    again = policy.keep(
        make_view(n, seed=n * 31 + budget, gap=gap, shared_prefix=shared_prefix), budget
    )
    assert torch.equal(keep, again)  # deterministic


@pytest.mark.parametrize("name,kwargs", CASES)
def test_sharing_aware_budget_too_small_is_an_error(name, kwargs):
    policy = SharingAware(make_policy(name, **kwargs))
    view = make_view(30, seed=1, shared_prefix=20)
    with pytest.raises(ValueError, match=r"budget 10 is smaller than the \d+ tokens .* must keep"):
        policy.keep(view, 10)


def test_consensus_mode_evicts_shared_tokens_only_when_all_holders_agree():
    view = make_view(12, seed=0, shared_prefix=8)
    agreed = torch.zeros(12, dtype=torch.bool)
    agreed[2:6] = True  # holders agree on rows 2..5
    view = TokenView(view.positions, view.keys, view.attn, view.shared, agreed)
    inner = make_policy("streamingllm", sink=0)
    never = SharingAware(inner).keep(view, 8)
    consensus = SharingAware(inner, mode="consensus").keep(view, 8)
    assert never.tolist() == list(range(8))  # all shared kept
    # rows 2..5 may go; the newest win the remaining 4 places: 0,1,6,7 shared + 8..11
    assert consensus.tolist() == [0, 1, 6, 7, 8, 9, 10, 11]


def test_unknown_policy_lists_names():
    with pytest.raises(ValueError, match=r"unknown policy 'lru'; choose from \['h2o', 'knorm'"):
        make_policy("lru")


@pytest.mark.parametrize("name", ["knorm", "h2o", "tova", "scissorhands"])
def test_missing_statistic_is_a_clear_error(name):
    view = TokenView(positions=torch.arange(10))
    with pytest.raises(ValueError, match=f"policy '{name}' needs TokenView"):
        make_policy(name, **MATRIX[name][0]).keep(view, 5)


def test_seeded_policies_depend_on_seed_request_and_step():
    pol = lambda s: make_policy("random", seed=s, sink=0)  # noqa: E731
    picks = {}
    for seed, rid, step in itertools.product((0, 1), (7, 8), (3, 4)):
        view = make_view(64, seed=0, rid=rid, step=step)
        picks[(seed, rid, step)] = tuple(pol(seed).keep(view, 16).tolist())
    assert len(set(picks.values())) == len(picks)
