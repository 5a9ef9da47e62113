"""Exactness through the path every `--kv-evict` server takes (holed radix cache on): every policy x
page size {1, 16} x interval {1, 16}, token for token equal to the Hugging Face reference that
masks exactly the evicted keys at their original positions; plus chunked prefill under the
attention policies and forced retractions. One server per page size (the interval comes with
each request), SGLang's memory checkers on."""

import json
import threading

import pytest

from conftest import MEMORY_CHECKS
from sgl_vtoken.config import EvictConfig
from sgl_vtoken_tools.hf_reference import masked_greedy
from test_eviction import generate, random_ids, wait_pool_free

pytestmark = pytest.mark.server

BUDGET = 64
POLICIES = ["streamingllm", "random", "knorm", "h2o", "tova", "scissorhands", "kvp"]
WINDOW = {"h2o": 16, "scissorhands": 16}  # as in their papers: heavy hitters plus a recent window


HOST_TOKENS, RECALL_GAP = 100_000, 4


def evict_server(server_factory, kvp_checkpoint, page_size, *extra, env=MEMORY_CHECKS):
    """A server whose own policy is kvp (its checkpoint loaded, interval 1) with a host store of
    HOST_TOKENS (recalls take holes of up to RECALL_GAP); other policies, intervals, offload and
    recall come per request."""
    flags = ("--kv-evict", "kvp", "--kv-budget", str(BUDGET),
             "--kv-evict-config", json.dumps({"checkpoint": kvp_checkpoint, "host_tokens": HOST_TOKENS,
                                                   "recall_gap": RECALL_GAP}), *extra)
    return server_factory(page_size=page_size, extra=flags, env=env)


def expected_output(hf_eager, kvp_checkpoint, prompt, n, policy, page_size, interval, rid):
    params = {"checkpoint": kvp_checkpoint} if policy == "kvp" else {}
    cfg = EvictConfig(policy=policy, budget=BUDGET, sink=4, window=WINDOW.get(policy, 0), interval=interval,
                      page_size=page_size, params=params)
    return masked_greedy(hf_eager, prompt, n, cfg, rid=rid)[0]


def per_request(policy, interval=1):
    """The request's `kv_evict` (policy kvp: the server's own, with its checkpoint)."""
    kv = {"interval": interval}
    return kv if policy == "kvp" else {**kv, "policy": policy, "window": WINDOW.get(policy, 0)}


@pytest.mark.server_group("chunked16")
@pytest.mark.parametrize("policy", ["h2o", "tova", "scissorhands"])
def test_attention_policies_are_exact_under_chunked_prefill(server_factory, hf_eager, kvp_checkpoint, policy):
    """A 100-token prompt prefilled in chunks of 32: the observation window (the prompt's last 16
    queries) spans the last two chunks; the statistics and the output equal the unchunked
    reference."""
    client = evict_server(server_factory, kvp_checkpoint, 16, "--chunked-prefill-size", "32")
    prompt, n, rid = random_ids(100, seed=1200 + POLICIES.index(policy)), 120, f"chunked-{policy}"
    out = generate(client, prompt, n, rid, per_request(policy))
    assert out["output_ids"] == expected_output(hf_eager, kvp_checkpoint, prompt, n, policy, 16, 1, rid)


@pytest.mark.server_group("retract1")
@pytest.mark.parametrize("policy", ["random", "h2o", "scissorhands"])
def test_forced_retractions_resume_from_the_compacted_row_exactly(server_factory, hf_eager, kvp_checkpoint,
                                                                  policy):
    """SGLang retracts a running request every few steps (page size 1); two requests of one policy
    run at once, so one of them is retracted again and again after it has evicted. Each resumes
    from its stashed compacted row with its policy state (eviction count, attention statistics),
    so both outputs stay the masked reference's; the pool is whole afterwards."""
    env = {**MEMORY_CHECKS, "SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "9"}
    client = evict_server(server_factory, kvp_checkpoint, 1, env=env)
    prompts = [random_ids(100, seed=1300 + 10 * POLICIES.index(policy) + k) for k in range(2)]
    outs = [None, None]

    def one(k):
        outs[k] = generate(client, prompts[k], 120, f"retract-{policy}-{k}", per_request(policy))

    threads = [threading.Thread(target=one, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    assert sum(o["meta_info"].get("num_retractions", 0) for o in outs) > 0
    for k in range(2):
        expected = expected_output(hf_eager, kvp_checkpoint, prompts[k], 120, policy, 1, 1, f"retract-{policy}-{k}")
        assert outs[k]["output_ids"] == expected, (k, outs[k]["meta_info"].get("num_retractions"))
    st = wait_pool_free(client)
    assert st["pool_available_tokens"] + st["pool_evictable_tokens"] == st["pool_total_tokens"]
    log = client.server.log_text()
    assert "Testing retraction" in log and "Traceback" not in log


# Last in the file: the page-16 server stays up for test_history.py, which uses it next.
@pytest.mark.server_group("holed{page_size}")
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("page_size,interval", [(1, 1), (1, 16), (16, 1), (16, 16)])
def test_every_policy_is_exact_through_the_holed_cache(server_factory, hf_eager, kvp_checkpoint,
                                                       page_size, interval, policy):
    """fp32, a prompt longer than the budget, 96 new tokens: equal to the masked reference, not to
    full attention (the same server, `{"policy": "none"}`), and the row ends at the budget."""
    client = evict_server(server_factory, kvp_checkpoint, page_size)
    seed = 1000 + 10 * POLICIES.index(policy) + page_size + interval
    prompt, n, rid = random_ids(100, seed=seed), 96, f"matrix-{policy}-{page_size}-{interval}"
    out = generate(client, prompt, n, rid, per_request(policy, interval))
    expected = expected_output(hf_eager, kvp_checkpoint, prompt, n, policy, page_size, interval, rid)
    assert out["output_ids"] == expected
    full = generate(client, prompt, n, rid + "-full", {"policy": "none"})["output_ids"]
    assert full != expected
    report = out["meta_info"]["kv_evict"][0]
    assert report["policy"] == policy and BUDGET <= report["live_tokens"] < BUDGET + interval
