"""Shared prompts under eviction at page size 16 (`--radix-cache-backend vtoken`): a request
matches the whole cached prompt, keeps what its policy keeps (whole shared pages by reference,
the rest copied into its own pages, shared pages never written) and drops the rest from its
view; the prompt is held once however many requests use it."""

import threading

import pytest
from servers import MEMORY_CHECKS
from test_eviction import generate, masked_greedy, random_ids, wait_pool_free

from sgl_vtoken.config import EvictConfig

pytestmark = [pytest.mark.server, pytest.mark.server_group("sharing16")]

SESSIONS, SYSTEM, BUDGET, PAGE = 16, 2048, 512, 16
FLAGS = ("--kv-evict", "streamingllm", "--kv-budget", str(BUDGET), "--kv-evict-interval", str(PAGE))


@pytest.fixture(scope="module")
def client(server_factory):
    return server_factory(page_size=PAGE, extra=FLAGS, env=MEMORY_CHECKS, pool=16384)


@pytest.mark.parametrize("policy", ["streamingllm", "random", "h2o"])
def test_shared_prefix_leaves_the_view_exactly(client, hf_eager, policy):
    """A request whose 96-token prefix (6 pages) is cached by another request generates exactly
    what HF generates with the same masks (the server's interval 16): shared tokens are evicted
    like its own, kept ones of partially kept pages are copied. H2O reads attention: its match
    stops `obs_window` (16) tokens short of the prompt's end, rounded down to a page (80 of
    96), so the queries that seed its statistics are those of a fresh prefill."""
    shared = random_ids(96, seed=120)
    generate(client, shared + [7, 8, 9], 4, f"owner-{policy}", {"policy": "none"})
    prompt = shared + [11, 12, 13, 14, 15]
    window = 16 if policy == "h2o" else 0
    kv = {"policy": policy, "budget": 64, "window": window}
    out = generate(client, prompt, 120, f"sharer-{policy}", kv)
    cached = 80 if policy == "h2o" else 96
    assert out["meta_info"]["cached_tokens"] == cached
    cfg = EvictConfig(
        policy=policy, budget=64, sink=4, window=window, page_size=PAGE, interval=PAGE
    )
    expected, _ = masked_greedy(hf_eager, prompt, 120, cfg, rid=f"sharer-{policy}", cached=cached)
    assert out["output_ids"] == expected
    if policy == "h2o":
        assert expected == masked_greedy(hf_eager, prompt, 120, cfg, rid=f"sharer-{policy}")[0]


@pytest.mark.parametrize("policy", ["tova", "scissorhands"])
def test_attention_policy_output_does_not_depend_on_the_prefix_cache(client, hf_eager, policy):
    """The same request, first with a cold cache, then after its prompt was cached by a
    full-attention request: the same output, that of HF with a fresh prefill's statistics."""
    prompt = random_ids(150, seed=140 + len(policy))
    kv = {"policy": policy, "budget": 64, "window": 16}
    cold = generate(client, prompt, 80, f"cold-{policy}", kv)
    generate(client, prompt + [3], 2, f"warm-{policy}", {"policy": "none"})
    hot = generate(client, prompt, 80, f"hot-{policy}", kv)
    assert hot["meta_info"]["cached_tokens"] == (150 - 16) // PAGE * PAGE
    cfg = EvictConfig(policy=policy, budget=64, sink=4, window=16, page_size=PAGE, interval=PAGE)
    expected, _ = masked_greedy(hf_eager, prompt, 80, cfg, rid=f"cold-{policy}")
    assert cold["output_ids"] == hot["output_ids"] == expected


def test_sixteen_sessions_hold_the_shared_prompt_once(client):
    """16 sessions sharing a 2048-token system prompt, budget 512, page 16: every session matches
    the whole prompt, the pool never holds more than the prompt once plus 16 x (budget/page + 2)
    pages (server counter), and it is whole afterwards."""
    system = random_ids(SYSTEM, seed=130)
    generate(client, system + [1, 2], 40, "system-warm")
    outs = [None] * SESSIONS

    def one(i):
        outs[i] = generate(client, system + [100 + i] * 20, 200, f"session-{i}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(SESSIONS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    assert all(o["meta_info"]["cached_tokens"] == SYSTEM for o in outs)
    assert all(len(o["output_ids"]) == 200 for o in outs)
    st = client.vtoken_state()
    bound_pages = SYSTEM // PAGE + SESSIONS * (BUDGET // PAGE + 2)
    assert st["peak_pool_held_tokens"] <= bound_pages * PAGE  # 16 copies would be 16 x 2048
    st = wait_pool_free(client)
    assert st["pool_available_tokens"] + st["pool_evictable_tokens"] == st["pool_total_tokens"]
    log = client.server.log_text()
    assert "Traceback" not in log and "leak" not in log.lower()
