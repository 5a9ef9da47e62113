"""Decode-time recall (`recall_steps`, `recall_span`): each of a turn's first decode steps scores
its history's host store with its own query, the best candidate comes back with those after it,
and the step is computed again with them visible before its token is taken. Every turn equals
the Hugging Face reference that recalls with the independent oracles (`tests/oracles`); SGLang's
memory checkers on; the pool is whole after."""

import random

import pytest
from conftest import SHORTAGE, shortages_met
from test_eviction import generate, random_ids, wait_pool_free
from test_host_tier import flush
from test_prefill import BUDGET, HOST_TOKENS, config, masked_turn, prefill_server

from sgl_vtoken.config import HostTier

pytestmark = [pytest.mark.server, pytest.mark.server_group("prefill{page_size}", page_size=16)]

STEPS, SPAN = 4, 4


def conversation(client, hf_eager, policy, page_size, rid, host, reference=None, turns=3):
    """`turns` turns of 24 tokens (a 60-token first message, then 18-23 tokens each), with `host`
    the request's host settings; returns the per-turn reports and outputs, each output asserted
    equal to the reference applying the same settings (or those of `reference`)."""
    rng = random.Random(sum(map(ord, rid)))
    prompt, window = random_ids(60, seed=510 + page_size), 16 if policy == "h2o" else 0
    kv = {"policy": policy, "window": window, "offload": True, **host}
    ref = host if reference is None else reference
    cfg = config(
        policy,
        page_size,
        host=HostTier(
            offload=True,
            tokens=HOST_TOKENS,
            steps=ref.get("recall_steps", 0),
            span=ref.get("recall_span", 8),
        ),
    )
    history, reports, outs, out = None, [], [], []
    for k in range(turns):
        if k:
            prompt = prompt + out + [rng.randrange(10, 2000) for _ in range(rng.randrange(18, 24))]
        got = generate(client, prompt, 24, f"{rid}-{k}", kv)
        out = got["output_ids"]
        if k:  # the whole history was not prefilled; what the decode steps recalled is no prompt
            assert got["meta_info"]["cached_tokens"] == len(history[0]), f"turn {k}"
        expected, _, history = masked_turn(
            hf_eager, prompt, 24, cfg, rid=f"{rid}-{k}", history=history
        )
        assert out == expected, f"turn {k}"
        reports.append(got["meta_info"]["kv_evict"][0])
        outs.append(out)
    return reports, outs


@pytest.mark.parametrize("page_size,policy", [(1, "h2o"), (16, "streamingllm")])
def test_decode_steps_recall_exactly_and_free_what_they_recalled(
    server_factory, hf_eager, page_size, policy
):
    """recall_steps 4, recall_span 4, budget 64: from the second turn on (the first one's
    victims in the host store) each of the first four decode steps recalls the best candidate
    with those after it within 4 positions and is computed again with them visible; the turns
    equal the reference that does the same, and not the one without decode-time recall. The
    report counts the steps that recalled and what came back (all of it pinned, at distinct
    positions); the recalled tokens leave the row before the history is stored, and after a
    flush the pool is whole and the host store empty."""
    client = prefill_server(server_factory, page_size)
    flush(client)
    host = {"recall_steps": STEPS, "recall_span": SPAN}
    rid = f"drecall-{policy}-{page_size}"
    reports, outs = conversation(client, hf_eager, policy, page_size, rid, host)
    assert "recalling_steps" not in reports[0] and reports[0]["offloaded_tokens"] > 0
    for r in reports[1:]:
        assert r["recalling_steps"] == STEPS
        assert STEPS <= r["decode_recalled_tokens"] <= STEPS * SPAN
        assert r["pinned_tokens"] == r["recalled_tokens"] == r["decode_recalled_tokens"]
        assert r["recalled_positions"] == sorted(set(r["recalled_positions"]))
        assert r["live_tokens"] <= BUDGET + 1
    _, plain = conversation(client, hf_eager, policy, page_size, f"{rid}-plain", {})
    assert outs[0] == plain[0] and outs[1:] != plain[1:]
    st = wait_pool_free(client)
    assert st["recalled_tokens"] >= sum(r["decode_recalled_tokens"] for r in reports[1:])
    flush(client)
    st = wait_pool_free(client)
    assert st["host_tokens_held"] == 0
    assert st["pool_available_tokens"] == st["pool_total_tokens"]
    assert "Traceback" not in client.server.log_text()


def test_a_decode_recall_without_free_pages_is_skipped_and_counted(server_factory, hf_eager):
    """Every page refused to the conversation named SHORTAGE: its second turn's decode steps find
    no page for what they would recall, so each goes on unrecalled (one forward, the reference
    without decode-time recall), and the report, the server's counters and its shortages say
    so; the pool is whole after."""
    client = prefill_server(server_factory, 1)
    before = client.vtoken_state()
    host = {"recall_steps": STEPS, "recall_span": SPAN}
    reports, _ = conversation(
        client, hf_eager, "h2o", 1, f"{SHORTAGE}drecall", host, reference={}, turns=2
    )
    assert reports[1]["recall_skipped_tokens"] > 0 and "recalling_steps" not in reports[1]
    st = wait_pool_free(client)
    assert st["skipped_recalls"] - before["skipped_recalls"] == STEPS
    assert shortages_met(before, st) == {"forced:recall_skipped:page": STEPS}
    assert st["pool_available_tokens"] + st["pool_evictable_tokens"] == st["pool_total_tokens"]
