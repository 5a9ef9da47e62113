"""The pressure trigger on a 256-token pool under SGLang's overlap scheduler (the edge servers of
`test_pool_edge.py`, their StreamingLLM budget-64 policy overridden per request with
`"trigger": "pressure"`): alone, a request keeps every token and its output is full attention's;
three at once outgrow the pool, and the rows the shortage compacts (each request's
`evicted_at` and `evicted_to`) give outputs equal to the masked reference evicting exactly there
to as many tokens, victims chosen by the independent oracles; the pool is whole afterwards under
SGLang's checkers."""

import threading

import pytest
from servers import MEMORY_CHECKS
from test_eviction import generate, masked_greedy, random_ids, wait_pool_free

from sgl_vtoken.config import EvictConfig

pytestmark = [pytest.mark.server]

BUDGET, INTERVAL, POOL = 64, 16, 256
WINDOW = {"h2o": 16}


def edge_server(server_factory, page_size):
    """The server of `test_pool_edge.py` (one start per page size for both files)."""
    return server_factory(
        page_size=page_size,
        extra=("--kv-evict", "streamingllm", "--kv-budget", "64", "--kv-evict-interval", "16"),
        env=MEMORY_CHECKS,
        pool=POOL,
    )


def pressure(policy: str) -> dict:
    return {"policy": policy, "trigger": "pressure", "window": WINDOW.get(policy, 0)}


def config(policy: str, page_size: int) -> EvictConfig:
    return EvictConfig(
        policy=policy,
        budget=BUDGET,
        window=WINDOW.get(policy, 0),
        interval=INTERVAL,
        page_size=page_size,
        trigger="pressure",
    )


@pytest.mark.server_group("edge{page_size}")
@pytest.mark.parametrize("page_size", [1, 16], ids=["page1", "page16"])
@pytest.mark.parametrize("policy", ["streamingllm", "h2o"])
def test_a_request_alone_keeps_every_token_and_equals_full_attention(
    server_factory, hf_eager, page_size, policy
):
    """60 prompt tokens and 150 generated: a 210-token row, more than three times the budget,
    that the pool holds with room for its next page: nothing is evicted (0 evicted tokens, no
    `evicted_at`) and the output is full attention's, token for token."""
    client = edge_server(server_factory, page_size)
    prompt, n = random_ids(60, seed=400 + page_size), 150
    rid = f"alone-{policy}-{page_size}"
    out = generate(client, prompt, n, rid, pressure(policy))
    report = out["meta_info"]["kv_evict"][0]
    assert report["evicted_tokens"] == 0 and report["evictions"] == 0, report
    assert "evicted_at" not in report
    assert out["output_ids"] == masked_greedy(hf_eager, prompt, n, EvictConfig())[0]


@pytest.mark.server_group("edge{page_size}")
@pytest.mark.parametrize("page_size", [1, 16], ids=["page1", "page16"])
@pytest.mark.parametrize("policy", ["streamingllm", "h2o"])
def test_rows_compacted_when_the_pool_is_short_equal_the_reference_evicting_there(
    server_factory, hf_eager, page_size, policy
):
    """Three requests of 60 prompt tokens and 120 generated would hold 540 tokens in a 256-token
    pool: the shortage compacts the longest rows, never below the budget and never a row within
    the interval of it, by at least the interval, and admits the third request when the others
    can give back its room; no request is retracted or refused. Each output equals the masked
    reference evicting at the logical lengths the server reports (`evicted_at`) to the tokens it
    kept (`evicted_to`); the pool is whole afterwards."""
    client = edge_server(server_factory, page_size)
    n = 120
    prompts = {
        f"pressed-{policy}-{page_size}-{k}": random_ids(60, seed=500 + 10 * page_size + k)
        for k in range(3)
    }
    results = {}

    def one(rid):
        results[rid] = generate(client, prompts[rid], n, rid, pressure(policy))

    threads = [threading.Thread(target=one, args=(rid,)) for rid in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cfg = config(policy, page_size)
    compacted = 0
    for rid, prompt in prompts.items():
        out = results[rid]
        report = out["meta_info"]["kv_evict"][0]
        at, to = report.get("evicted_at", []), report.get("evicted_to", [])
        assert report["evictions"] == len(at) == len(to), report
        assert all(BUDGET <= k <= t - INTERVAL for t, k in zip(at, to)), report
        assert not report.get("retracted_reprefill"), report
        compacted += len(at)
        expected = masked_greedy(hf_eager, prompt, n, cfg, rid=rid, evicted_at=at, evicted_to=to)[0]
        assert out["output_ids"] == expected, (rid, at)
    assert compacted, "the pool never ran short: the test no longer exercises the trigger"
    st = wait_pool_free(client)
    assert st["pool_available_tokens"] + st["pool_evictable_tokens"] == st["pool_total_tokens"]
    assert "Traceback" not in client.server.log_text()


@pytest.mark.server_group("prefill{page_size}")
@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_is_evicted_only_when_the_prompt_cannot_fit_the_pool(
    server_factory, hf_eager, page_size
):
    """The prefill servers of `test_prefill.py` (StreamingLLM budget 64, prefill_chunk 32, no
    overlap scheduler). Under the pressure trigger a 400-token prompt on the 4,096-token pool is
    prefilled whole and nothing is evicted: full attention's output. A prompt three times the
    256-token pool cannot be held whole: it is evicted chunk by chunk as under the budget
    trigger, and its output equals the chunked masked reference."""
    from test_prefill import SMALL_POOL, config, prefill_server

    kv = {"policy": "streamingllm", "trigger": "pressure"}
    client = prefill_server(server_factory, page_size)
    prompt, n = random_ids(400, seed=960 + page_size), 40
    out = generate(client, prompt, n, f"whole-prefill-{page_size}", kv)
    report = out["meta_info"]["kv_evict"][0]
    assert "prefill_evicted_tokens" not in report and report["evicted_tokens"] == 0, report
    assert out["output_ids"] == masked_greedy(hf_eager, prompt, n, EvictConfig())[0]

    small = prefill_server(server_factory, page_size, pool=SMALL_POOL)
    prompt, rid = random_ids(3 * SMALL_POOL, seed=970 + page_size), f"long-pressed-{page_size}"
    out = generate(small, prompt, 24, rid, kv)
    report = out["meta_info"]["kv_evict"][0]
    assert report["prefill_evicted_tokens"] > 2 * SMALL_POOL, report
    cfg = config("streamingllm", page_size, trigger="pressure")
    at, to = report.get("evicted_at", []), report.get("evicted_to", [])
    expected = masked_greedy(hf_eager, prompt, 24, cfg, rid=rid, evicted_at=at, evicted_to=to)
    assert out["output_ids"] == expected[0]
    for c in (client, small):
        st = wait_pool_free(c)
        assert st["pool_available_tokens"] + st["pool_evictable_tokens"] == st["pool_total_tokens"]


@pytest.mark.server_group("holed{page_size}", page_size=1)
def test_an_idle_pool_chat_through_the_chat_api_equals_the_full_cache(server_factory):
    """A client's chat through `/v1/chat/completions` (the whole conversation re-sent as text each
    turn, the replies fed back) with the chat settings of the README under the pressure trigger,
    alone on a 4,096-token pool: every turn's reply is the full cache's (`{"policy": "none"}`),
    nothing is evicted, and each later turn continues its history from the radix cache. The
    same chat under the budget trigger evicts (the rows do pass the budget)."""
    from test_exactness import evict_server

    client = evict_server(server_factory, 1)
    chat = {"policy": "h2o", "budget": 64, "sink": 16, "window": 32, "interval": 16}
    chat |= {"offload": True, "recall": 8}
    settings = {
        "full": {"policy": "none"},
        "pressure": {**chat, "trigger": "pressure"},
        "budget": chat,
    }
    words = "pool page slot row budget window sink token cache tree history reply".split()
    messages = {name: [] for name in settings}
    replies = {name: [] for name in settings}
    figures = {name: [] for name in settings}
    for turn in range(4):
        text = " ".join(words[(turn * 7 + k * 5) % len(words)] for k in range(60))
        for name, kv in settings.items():
            messages[name].append({"role": "user", "content": f"Turn {turn}: {text}"})
            r = client.chat(messages[name], 40, kv)
            reply = r.choices[0].message.content
            messages[name].append({"role": "assistant", "content": reply})
            replies[name].append(reply)
            figures[name].append((r.usage.model_extra or {}).get("kv_evict"))
            if name == "pressure" and turn:
                assert r.usage.prompt_tokens_details.cached_tokens > 0, turn
    assert replies["pressure"] == replies["full"]
    assert all(f["evicted_tokens"] == 0 and "evicted_at" not in f for f in figures["pressure"])
    assert sum(f["evicted_tokens"] for f in figures["budget"]) > 0
    st = wait_pool_free(client)
    assert st["pool_available_tokens"] + st["pool_evictable_tokens"] == st["pool_total_tokens"]


@pytest.mark.server_group("holed{page_size}", page_size=1)
@pytest.mark.parametrize("page_size", [1, 16])
def test_a_whole_history_the_tree_evicts_moves_to_host_whole_and_comes_back(
    server_factory, hf_eager, page_size
):
    """Under the pressure trigger with offload a finished turn that never evicted is stored whole;
    when a full-cache request then needs nearly the whole pool, the tree's LRU moves that history
    to host memory, whole, and the next turn restores it (`history_source` "host", every token
    of the first turn back) and prefills only its new message: nothing is evicted in either turn
    and both outputs are full attention's."""
    from test_exactness import evict_server
    from test_host_tier import NONE, flush

    client = evict_server(server_factory, page_size)
    flush(client)
    kv = {"policy": "h2o", "window": 16, "trigger": "pressure", "offload": True}
    first, n = random_ids(300, seed=990 + page_size), 40
    out1 = generate(client, first, n, f"whole-host-{page_size}-0", kv)
    generate(client, random_ids(4060, seed=995), 4, f"whole-host-fill-{page_size}", NONE)
    assert client.vtoken_state()["host_histories_held"] == 1
    second = first + out1["output_ids"] + random_ids(50, seed=996 + page_size)
    out2 = generate(client, second, n, f"whole-host-{page_size}-1", kv)
    report = out2["meta_info"]["kv_evict"][0]
    assert report["history_source"] == "host", report
    assert report["history_restored_tokens"] >= len(first) + n - 1 - page_size, report
    assert out2["meta_info"]["cached_tokens"] >= len(first) + n - 1 - page_size
    assert out1["meta_info"]["kv_evict"][0]["evicted_tokens"] == report["evicted_tokens"] == 0
    assert out1["output_ids"] == masked_greedy(hf_eager, first, n, EvictConfig())[0]
    assert out2["output_ids"] == masked_greedy(hf_eager, second, n, EvictConfig())[0]
    flush(client)
    st = wait_pool_free(client)
    assert st["host_histories_held"] == 0
    assert st["pool_available_tokens"] + st["pool_evictable_tokens"] == st["pool_total_tokens"]


@pytest.mark.server_group("prefill{page_size}", page_size=16)
def test_a_chat_that_outgrows_the_pool_is_answered_every_turn(server_factory):
    """A chat client's conversation through `/v1/chat/completions` (the text re-sent each turn)
    on the 256-token pool of the prefill server, under the pressure trigger: it grows to several
    times the pool and every turn is answered (HTTP 200), its later turns continuing what the
    server stored, evicted during prefill only once a prompt could not be held whole; the pool
    is whole afterwards."""
    from test_prefill import SMALL_POOL, prefill_server

    client = prefill_server(server_factory, 16, pool=SMALL_POOL)
    kv = {"policy": "streamingllm", "trigger": "pressure"}
    words = "pool page slot row budget window sink token cache tree history reply".split()
    messages, prompts, prefill_evicted = [], [], 0
    for turn in range(12):
        text = " ".join(words[(turn * 5 + k * 7) % len(words)] for k in range(50))
        messages.append({"role": "user", "content": f"Turn {turn}: {text}"})
        r = client.chat(messages, 24, kv)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        prompts.append(r.usage.prompt_tokens)
        prefill_evicted += r.usage.model_extra["kv_evict"].get("prefill_evicted_tokens", 0)
    assert prompts[-1] > 3 * SMALL_POOL, prompts
    assert prefill_evicted > 0
    st = wait_pool_free(client)
    assert st["pool_available_tokens"] + st["pool_evictable_tokens"] == st["pool_total_tokens"]
