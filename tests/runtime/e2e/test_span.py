"""Span-aware keeping through the server (`"span"` in a request's `kv_evict`): words and digit
runs are kept or dropped whole, read from the served model's tokenizer. Token for token equal to
the Hugging Face reference that masks the same keys, its victims chosen by the independent
oracles applying the definition (`tests/runtime/oracles/units.py`), at page sizes 1 and 16, with
eviction during prefill and with recall; the pool whole afterwards (SGLang's checkers on)."""

from dataclasses import replace

import pytest
from test_eviction import generate, masked_turn, random_ids, wait_pool_free
from test_exactness import BUDGET, evict_server
from test_host_tier import flush, session
from test_prefill import config, prefill_server

from sgl_vtoken.config import EvictConfig, Scoring

pytestmark = pytest.mark.server

SPAN = 4
WINDOW = {"h2o": 16, "scissorhands": 16}


@pytest.mark.server_group("holed{page_size}")
@pytest.mark.parametrize("policy", ["streamingllm", "random", "h2o", "scissorhands"])
@pytest.mark.parametrize("page_size,interval", [(1, 1), (16, 1), (16, 16)])
def test_words_are_kept_whole_exactly(server_factory, hf_eager, page_size, interval, policy):
    """A prompt longer than the budget, 96 new tokens, `span` 4: the output equals the
    reference applying the same rule, in which some token sees other keys than without it."""
    client = evict_server(server_factory, page_size)
    window = WINDOW.get(policy, 0)
    prompt, n = random_ids(100, seed=2000 + page_size + interval), 96
    rid = f"span-{policy}-{page_size}-{interval}"
    kv = {"policy": policy, "window": window, "interval": interval, "span": SPAN}
    out = generate(client, prompt, n, rid, kv)
    cfg = EvictConfig(
        policy=policy,
        budget=BUDGET,
        window=window,
        interval=interval,
        page_size=page_size,
        scoring=Scoring(span=SPAN),
    )
    # the reference's (tokens, row, history), the oracles choosing (with a span, from the
    # texts of the tiny tokenizer's tokens)
    expected, _, (masks, _) = masked_turn(hf_eager, prompt, n, cfg, rid=rid)
    assert out["output_ids"] == expected
    plain = replace(cfg, scoring=Scoring(span=0))
    plain_masks = masked_turn(hf_eager, prompt, n, plain, rid=rid)[2][0]
    assert plain_masks != masks, "span changed no token's visible keys"
    report = out["meta_info"]["kv_evict"][0]
    assert report["live_tokens"] < BUDGET + interval
    st = wait_pool_free(client)
    assert st["pool_available_tokens"] + st["pool_evictable_tokens"] == st["pool_total_tokens"]


@pytest.mark.server_group("holed{page_size}")
@pytest.mark.parametrize("page_size", [1, 16])
def test_words_are_kept_whole_across_recalling_turns(server_factory, hf_eager, page_size):
    """Three turns of h2o with offload and recall 8, `span` 4: every turn, its recall cut and
    its evictions equal the reference's (the host tier's conversation, `test_host_tier.session`)."""
    client = evict_server(server_factory, page_size)
    flush(client)
    rid = f"span-recall-{page_size}"
    reports = session(client, hf_eager, "h2o", rid, 8, turns=3, page_size=page_size, span=SPAN)
    assert all(r["recalled_tokens"] > 0 for r in reports[1:])
    wait_pool_free(client)


@pytest.mark.server_group("prefill{page_size}")
@pytest.mark.parametrize("page_size,policy", [(1, "h2o"), (16, "streamingllm")])
def test_words_are_kept_whole_during_prefill(server_factory, hf_eager, page_size, policy):
    """A 300-token prompt evicted chunk by chunk (`prefill_chunk` 32), `span` 4: equal to the
    reference evicting each chunk by the same rule."""
    client = prefill_server(server_factory, page_size)
    window = 16 if policy == "h2o" else 0
    prompt, n, rid = random_ids(300, seed=2300 + page_size), 40, f"span-prefill-{page_size}"
    out = generate(client, prompt, n, rid, {"policy": policy, "window": window, "span": SPAN})
    cfg = config(policy, page_size, scoring=Scoring(span=SPAN))
    assert out["output_ids"] == masked_turn(hf_eager, prompt, n, cfg, rid=rid)[0]
    assert out["meta_info"]["kv_evict"][0]["prefill_evicted_tokens"] > 0
    st = wait_pool_free(client)
    assert st["pool_available_tokens"] + st["pool_evictable_tokens"] == st["pool_total_tokens"]
