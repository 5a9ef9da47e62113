"""Each oracle chooses what the runtime policy's `keep` chooses (`sgl_vtoken.policies`, through
`sgl_vtoken_tools.runtime_choice`), on seeded random rows: lengths, budgets, sinks, windows,
page sizes, shared entries, aggregations, pools and scored layers drawn per case; the attention
policies over a prompt window then decode steps, each evicting when due. And the recall rule's
cut, rounds and choice equal `sgl_vtoken.recall`'s. Exact agreement, a few hundred cases each.
"""

import random

import pytest
import torch

from oracles import ORACLE_RECALL, oracle_policy
from oracles.recall import pick
from sgl_vtoken.config import EvictConfig, HostTier, Scoring
from sgl_vtoken.recall import pick as runtime_pick
from sgl_vtoken_tools.runtime_choice import RUNTIME_RECALL, runtime_policy

L, H, D, CASES = 4, 2, 8, 200


def draw_config(rng: random.Random, policy: str, **scoring) -> EvictConfig:
    page = rng.choice([1, 1, 4, 16])
    sink, window = rng.choice([0, 2, 4]), rng.choice([0, 0, 3, 8])
    params: dict = {}
    if policy in ("h2o", "tova", "scissorhands"):
        params["pool"] = rng.choice([1, 3, 5, 5])
        scoring.setdefault("score_layers", rng.choice(["upper", "all", (0, 2)]))
    if policy == "scissorhands":
        params.update(history=rng.choice([1, 4, 32]), threshold=rng.choice([0.5, 1.0]))
    if policy == "random":
        params["seed"] = rng.randrange(2**32)
    scoring.setdefault("aggregation", rng.choice([None, "sum", "max"]))
    scoring.setdefault("span", 0)  # spans: their own test below (budgets here can be < a unit)
    budget = -(-sink // page) * page + window + page + rng.randrange(1, 24)
    return EvictConfig(
        policy=policy,
        budget=budget,
        sink=sink,
        window=window,
        page_size=page,
        interval=rng.choice([1, 1, 5]),
        params=params,
        scoring=Scoring(**scoring),
    )


def probs_block(g: torch.Generator, lengths: list[int], n: int) -> torch.Tensor:
    """``[q, n, L, H]`` group-summed probabilities: zeros beyond each query's length; sometimes
    rounded to a few levels, so that statistics tie."""
    logits = torch.randn(len(lengths), n, L, H, 2, generator=g) * 3
    hidden = torch.arange(n)[None, :] >= torch.tensor(lengths)[:, None]
    logits[hidden] = float("-inf")
    p = torch.softmax(logits, dim=1).sum(-1)
    return torch.round(p * 8) / 8 if torch.rand(1, generator=g) < 0.3 else p


VOCAB = ["a", "bc", " d", " ef", "1", "23", " 4", ".", ", ", ":", " ", "\n", "x9", "7y", ""]


def run_request(cfg: EvictConfig, seed: int, make) -> list[list[int]]:
    """The kept rows of one request: a prompt, its window observed, then decode steps, each
    evicting when due; keys and values drawn per position (sometimes integer, so norms tie)."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    chooser = make(cfg, f"req-{seed}")
    ints = rng.random() < 0.3
    kv = torch.randint(-1, 2, (400, 2, L, H, D), generator=g).float()
    kv = kv if ints else torch.randn(400, 2, L, H, D, generator=g)
    row = sorted(rng.sample(range(3 * cfg.budget + 40), cfg.budget + rng.randrange(1, 30)))
    shared = set(rng.sample(row, rng.randrange(0, 3)))
    window = min(len(row), rng.choice([1, 8, 16]))
    lengths = list(range(len(row) - window + 1, len(row) + 1))
    tokens = [rng.randrange(len(VOCAB)) for _ in range(4 * cfg.budget + 80)]
    out = []
    for step in range(12):
        if "attn" in chooser.needs:
            chooser.observe(row, probs_block(g, lengths, len(row)), torch.tensor(lengths))
        if step == 0 or cfg.should_evict(len(row)):
            keep = chooser.keep(
                list(row),
                [p in shared for p in row],
                kv[row, 0] if "keys" in chooser.needs else None,
                cfg.budget,
                [VOCAB[t] for t in tokens],
            )
            out.append(keep)
            row = [row[i] for i in keep]
        row.append(row[-1] + 1 + rng.randrange(2))
        lengths = [len(row)]
    return out


@pytest.mark.parametrize(
    "policy", ["streamingllm", "random", "knorm", "h2o", "tova", "scissorhands"]
)
def test_the_oracle_keeps_what_the_runtime_policy_keeps(policy):
    """The runtime keeps exactly what the definition keeps, every option drawn at random."""
    for case in range(CASES):
        rng = random.Random(f"{policy}-{case}")
        cfg = draw_config(rng, policy)
        seed = 1000 * case + len(policy)
        want = run_request(cfg, seed, runtime_policy)
        assert run_request(cfg, seed, oracle_policy) == want, (case, cfg)


@pytest.mark.parametrize("policy", ["streamingllm", "random", "h2o", "scissorhands"])
def test_span_aware_keeping_keeps_what_the_definition_keeps(policy):
    """With a span, words and digit runs (a toy vocabulary whose texts open and close with
    letters, digits, spaces and punctuation) are kept or dropped whole as the definition says,
    units cut at the span, every other option drawn at random."""
    for case in range(CASES // 2):
        rng = random.Random(f"span-{policy}-{case}")
        cfg = draw_config(rng, policy, span=rng.choice([1, 2, 3, 8]))
        seed = 1000 * case + 7
        want = run_request(cfg, seed, runtime_policy)
        assert run_request(cfg, seed, oracle_policy) == want, (case, cfg)


def test_scissorhands_ignores_the_layers_it_does_not_score():
    """By the definition, a layer left out of `score_layers` feeds no statistic. The server
    stages such a layer as zeros; Scissorhands must not count them as low importance (under
    ``sum`` every unscored layer would otherwise favour the tokens fewer recent queries
    attended)."""
    for case in range(CASES):
        rng = random.Random(case)
        cfg = draw_config(rng, "scissorhands", score_layers="upper", aggregation="sum")
        seed = 7 * case
        assert run_request(cfg, seed, oracle_policy) == run_request(cfg, seed, runtime_policy)


def test_the_recall_rule_equals_the_runtime_one():
    """Cut, rounds, quotas and the candidates chosen (pool, gap, scored layers), on random
    windows over random rows and candidates; the pick alone on integer scores (many ties).

    Not compared: candidates with identical keys. Their masses are equal by definition, but
    `sgl_vtoken.recall.candidate_mass` computes the last of them one rounding apart (its
    vectorized softmax), so such ties fall by rounding, not by the tie rule."""
    rng, g = random.Random(5), torch.Generator().manual_seed(5)
    for prefix in range(0, 80, 7):
        for total in range(prefix, prefix + 70, 3):
            for window in (1, 16, 20):
                for page in (1, 4, 16):
                    cfg = EvictConfig(
                        policy="h2o", budget=400, page_size=page, scoring=Scoring(obs_window=window)
                    )
                    assert ORACLE_RECALL.split(cfg, prefix, total) == RUNTIME_RECALL.split(
                        cfg, prefix, total
                    )
    for case in range(CASES):
        recall, rounds = rng.randrange(1, 20), rng.randrange(1, 6)
        cfg = EvictConfig(
            policy="h2o",
            budget=64,
            sink=0,
            scoring=Scoring(score_layers=rng.choice(["upper", "all", (1, 3)])),
            host=HostTier(
                offload=True,
                tokens=1000,
                recall=recall,
                rounds=rounds,
            ),
        )
        assert ORACLE_RECALL.rounds(cfg) == RUNTIME_RECALL.rounds(cfg)
        for done in range(recall + 1):
            for last in (False, True):
                assert ORACLE_RECALL.quota(cfg, done, last) == RUNTIME_RECALL.quota(cfg, done, last)
        n, c, nq, hq = rng.randrange(4, 40), rng.randrange(1, 40), rng.randrange(1, 6), 2 * H
        lengths = torch.tensor(sorted(rng.randrange(1, n + 1) for _ in range(nq)))
        layers = []
        for _ in range(L):
            q = torch.randn(nq, hq, D, generator=g)
            row_keys = torch.randn(n, H, D, generator=g)
            cand = torch.randn(c, H, D, generator=g)
            layers.append((q, D**-0.5, row_keys, cand))
        k = rng.randrange(1, c + 3)
        scores = [float(rng.randrange(4)) for _ in range(c)]
        pool, gap = rng.choice([1, 3, 5]), rng.choice([0, 0, 2, 8])
        assert (
            pick(scores, k, pool, gap) == runtime_pick(torch.tensor(scores), k, pool, gap).tolist()
        )
        assert ORACLE_RECALL.choose(cfg, layers, lengths, k) == RUNTIME_RECALL.choose(
            cfg, layers, lengths, k
        ), case
        # A later round: the candidates left between the positions its earlier rounds recalled.
        spots = sorted(rng.sample(range(3 * c + 10), c + rng.randrange(0, 8)))
        recalled = sorted(rng.sample(spots, len(spots) - c))
        positions = [p for p in spots if p not in recalled]
        assert (
            pick(scores, k, pool, gap, positions, recalled)
            == runtime_pick(
                torch.tensor(scores), k, pool, gap, torch.tensor(positions), torch.tensor(recalled)
            ).tolist()
        ), case
        assert ORACLE_RECALL.choose(
            cfg, layers, lengths, k, positions, recalled
        ) == RUNTIME_RECALL.choose(cfg, layers, lengths, k, positions, recalled), case
