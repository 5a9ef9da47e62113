"""The fast masked reference computes what the full-recompute oracle computes: the same greedy
tokens under every policy, at page sizes 1 and 16, one turn or a conversation continuing from
its compacted history; teacher-forced chunks give the logits of one-by-one decoding."""

import random

import pytest
import torch

from sgl_vtoken.config import EvictConfig, Prefill, Scoring
from sgl_vtoken.units import Words
from sgl_vtoken_tools.hf_reference import masked_greedy, masked_turn
from sgl_vtoken_tools.quality.fastref import Request, prefill
from sgl_vtoken_tools.runtime_choice import RUNTIME_RECALL, runtime_policy

RUNTIME = {"policy": runtime_policy, "recall": RUNTIME_RECALL}  # the fast reference's own choice

POLICIES = ["streamingllm", "random", "knorm", "h2o", "tova", "scissorhands"]
WINDOW = {"h2o": 8, "scissorhands": 8}


def fast_greedy(model, prompt, max_new_tokens, cfg, rid="", words=None):
    """`masked_greedy` computed incrementally: (tokens, the logical positions the last forward
    attended to)."""
    req = Request(model, cfg, rid, words=words)
    req.start(prefill(model, prompt, cfg.scoring.obs_window))
    return req.generate(max_new_tokens), req.row.positions.tolist()


def ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(n)]


@pytest.fixture(scope="module")
def words(tiny_tok):
    """The tiny tokenizer's words: the attention policies keep spans of up to 8 by default."""
    return Words.from_tokenizer(tiny_tok)


def config(policy, page_size, interval, **kw):
    return EvictConfig(
        policy=policy,
        budget=48,
        sink=4,
        window=WINDOW.get(policy, 0),
        page_size=page_size,
        interval=interval,
        **kw,
    )


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("page_size,interval", [(1, 1), (16, 16)])
def test_greedy_equals_masked_greedy(hf_eager, tiny_fast, words, policy, page_size, interval):
    """60 tokens after an 80-token prompt, budget 48: equal token for token, and not the full
    cache's output (the eviction changed something)."""
    prompt = ids(80, seed=POLICIES.index(policy) * 7 + page_size)
    cfg = config(policy, page_size, interval)
    expected, _ = masked_greedy(hf_eager, prompt, 60, cfg, rid="q", **RUNTIME)
    got, _ = fast_greedy(tiny_fast, prompt, 60, cfg, rid="q", words=words)
    assert got == expected
    assert got != fast_greedy(tiny_fast, prompt, 60, EvictConfig())[0]


def play_turns(eager, fast, words, cfg, prompt, turns, n, rid, seed):
    """`turns` turns of `n` tokens, each continuing from the previous turn's kept row (request
    ids `rid` + turn), each equal to masked_turn's, its row at masked_turn's positions; a turn
    adds 6 new ids (seeds from `seed`) to the previous prompt and reply."""
    history, req = None, None
    for turn in range(turns):
        expected, _, history = masked_turn(
            eager, prompt, n, cfg, rid=f"{rid}{turn}", history=history, **RUNTIME
        )
        if req is None:
            req = Request(fast, cfg, f"{rid}0", words=words)
            req.start(prefill(fast, prompt, cfg.scoring.obs_window))
        else:
            nxt = Request(fast, cfg, f"{rid}{turn}", req.row, words, req.ids)
            nxt.prompt(prompt[len(req.ids) :])
            req = nxt
        got = req.generate(n)
        assert got == expected, f"turn {turn}"
        assert req.row.positions.tolist() == list(history[1])
        prompt = prompt + got + ids(6, seed=seed + turn)


@pytest.mark.parametrize("policy", ["streamingllm", "h2o", "random"])
def test_turns_continue_from_history_like_masked_turn(hf_eager, tiny_fast, words, policy):
    """Three turns, each continuing from the previous turn's kept row: equal to masked_turn."""
    play_turns(hf_eager, tiny_fast, words, config(policy, 1, 1), ids(40, seed=3), 3, 20, "t", 10)


@pytest.mark.parametrize("page_size,interval", [(1, 1), (16, 16)])
def test_span_aware_keeping_equals_masked_greedy_across_turns(
    hf_eager, tiny_fast, words, page_size, interval
):
    """`span` 4 (units from the tiny tokenizer): each of two turns equal to masked_turn, the
    second continuing from the first's row with its token ids."""
    cfg = config("h2o", page_size, interval, scoring=Scoring(span=4))
    play_turns(hf_eager, tiny_fast, words, cfg, ids(80, seed=21), 2, 30, "s", 30)
    with pytest.raises(ValueError, match="needs the tokenizer's Words"):
        Request(tiny_fast, cfg, "s")


@pytest.mark.parametrize("policy", ["h2o", "scissorhands", "knorm"])
def test_teacher_forced_chunks_equal_one_by_one(tiny_fast, words, policy):
    """feed() runs up to the next eviction in one forward; feeding token by token gives the same
    predictions (fp32 rounding aside) and the same kept row."""
    cfg = config(policy, 1, 16)
    prompt, cont = ids(70, seed=5), ids(50, seed=6)
    pf = prefill(tiny_fast, prompt, cfg.scoring.obs_window)
    a, b = Request(tiny_fast, cfg, "f", words=words), Request(tiny_fast, cfg, "f", words=words)
    a.start(pf)
    b.start(pf)
    chunked = a.feed(cont)
    single = torch.cat([b.feed([x]) for x in cont])
    assert a.steps == b.steps > 1
    assert torch.allclose(chunked, single, atol=1e-4)
    assert torch.equal(chunked.argmax(-1), single.argmax(-1))
    assert torch.equal(a.row.positions, b.row.positions)


def test_load_model_is_required_for_attention_statistics(hf_eager, words):
    """A model without the probing attention cannot feed attention policies: a clear error."""
    cfg = EvictConfig(policy="tova", budget=48, sink=4)
    with pytest.raises(RuntimeError, match="load_model"):
        Request(hf_eager, cfg, words=words).start(prefill(hf_eager, ids(60, 1), 16))


def test_eviction_during_prefill_is_refused_not_ignored(tiny_fast):
    """The fast reference prefills whole prompts: a `prefill_chunk` setting is an error."""
    cfg = EvictConfig(policy="streamingllm", budget=48, sink=4, prefill=Prefill(chunk=32))
    with pytest.raises(
        ValueError, match="prefill_chunk 32: the fast reference prefills whole prompts"
    ):
        Request(tiny_fast, cfg)
