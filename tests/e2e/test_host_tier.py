"""The host tier (`offload`, `recall`): evicted tokens' K/V kept in host memory with the stored
history, and recalled by a later turn's question. Every turn equals the Hugging Face reference
that recomputes the same recall decisions; the host store is released with the histories."""

import random

import pytest
import requests

from sgl_vtoken.config import EvictConfig
from sgl_vtoken.hf_reference import masked_turn
from test_eviction import generate, random_ids, wait_pool_free
from test_exactness import HOST_TOKENS, evict_server

pytestmark = pytest.mark.server

BUDGET, SINK, RECALL = 48, 4, 8


@pytest.fixture
def client(server_factory, kvp_checkpoint):
    """The exactness matrix's page-1 server, which has a host store."""
    return evict_server(server_factory, kvp_checkpoint, 1)


def flush(client):
    r = requests.post(client.base_url + "/flush_cache", timeout=60)
    assert r.status_code == 200, r.text


def session(client, hf_eager, policy, rid, recall, turns=5, n=24):
    """One conversation with offload (and `recall`); asserts each turn equals the reference and
    returns the per-turn reports."""
    rng = random.Random(hash(rid) % 1000)
    prompt = random_ids(30, seed=300 + recall)
    messages = [[rng.randrange(10, 2000) for _ in range(rng.randrange(17, 24))] for _ in range(turns - 1)]
    kv = {"policy": policy, "budget": BUDGET, "offload": True, "recall": recall}
    cfg = EvictConfig(policy=policy, budget=BUDGET, sink=SINK, window=16 if policy == "h2o" else 0,
                      offload=True, host_tokens=HOST_TOKENS, recall=recall)
    if policy == "h2o":
        kv["window"] = 16
    history, reports, out = None, [], []
    for k in range(turns):
        if k:
            prompt = prompt + out + messages[k - 1]
        got = generate(client, prompt, n, f"{rid}-{k}", kv)
        out = got["output_ids"]
        expected, _, history = masked_turn(hf_eager, prompt, n, cfg, rid=f"{rid}-{k}", history=history)
        assert out == expected, f"turn {k}"
        reports.append(got["meta_info"]["kv_evict"][0])
    return reports


@pytest.mark.parametrize("policy", ["streamingllm", "h2o"])
def test_recall_turns_equal_the_reference_and_the_store_is_released(client, hf_eager, policy):
    """Five turns, budget 48, recall 8: from turn 2 on each turn recalls up to 8 of its history's
    evicted tokens, kept through the turn; outputs equal HF replaying the same recall rule.
    The stored history holds the host chunks until the tree lets it go (flush)."""
    reports = session(client, hf_eager, policy, f"recall-{policy}", RECALL)
    assert all(r["offloaded_tokens"] > 0 for r in reports)
    assert "recalled_tokens" not in reports[0]
    for r in reports[1:]:
        assert r["recalled_tokens"] == r["pinned_tokens"] == min(RECALL, r["recall_candidates"]) > 0
        assert r["recall_ms"] > 0 and r["host_bytes"] > 0
    assert reports[-1]["recalled_tokens"] == RECALL
    st = wait_pool_free(client)
    assert st["host_tokens_held"] > 0 and st["host_bytes_held"] > 0 and st["recalled_tokens"] >= sum(r["recalled_tokens"] for r in reports[1:])
    flush(client)
    st = wait_pool_free(client)
    assert st["host_tokens_held"] == 0 and st["host_bytes_held"] == 0
    assert st["pool_available_tokens"] == st["pool_total_tokens"]


def test_offload_without_recall_changes_no_output_and_requests_without_it_hold_no_host_memory(client, hf_eager):
    """Offload alone only copies: the turns equal the reference without a host tier; requests
    that do not offload leave the host store empty."""
    flush(client)
    reports = session(client, hf_eager, "streamingllm", "offload-only", 0, turns=3)
    assert all("recalled_tokens" not in r for r in reports)
    flush(client)
    prompt = random_ids(80, seed=5)
    generate(client, prompt, 40, "no-offload", {"policy": "streamingllm", "budget": BUDGET})
    st = wait_pool_free(client)
    assert st["host_tokens_held"] == 0 and st["offloaded_tokens"] > 0  # the earlier session's


def test_invalid_offload_settings_are_refused_naming_the_field(client):
    for kv, field in (({"recall": 8}, "kv_evict.recall"), ({"offload": "yes"}, "kv_evict.offload"),
                      ({"offload": True, "recall": 60}, "kv_evict.recall")):
        params = {"max_new_tokens": 1, "custom_params": {"kv_evict": {"policy": "streamingllm", "budget": BUDGET, **kv}}}
        r = requests.post(client.base_url + "/generate", timeout=60,
                          json={"input_ids": [1, 2, 3], "sampling_params": params})
        assert r.status_code == 400 and field in r.text, (kv, r.text)
