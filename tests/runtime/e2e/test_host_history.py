"""Host histories: a stored history the radix cache evicts for room moves to host memory with
offload, and the next turn restores it instead of prefilling its conversation again. Restored
turns equal the Hugging Face reference with the independent oracles (tests/runtime/oracles), as if the
history had never left the device; a host store too small drops histories, counted; nothing
leaks."""

import pytest
from servers import MEMORY_CHECKS
from test_eviction import generate, masked_greedy, masked_turn, random_ids, wait_pool_free
from test_exactness import HOST_TOKENS, evict_server
from test_host_tier import BUDGET, NONE, RECALL, SINK, flush, session, unchunked_server

from sgl_vtoken.config import EvictConfig, HostTier

pytestmark = [pytest.mark.server, pytest.mark.server_group("holed{page_size}", page_size=1)]


def assert_released_after_flush(client):
    """A flush leaves no history nor token in host memory, and every KV slot free."""
    flush(client)
    st = wait_pool_free(client)
    assert st["host_histories_held"] == 0 and st["host_tokens_held"] == 0
    assert st["pool_available_tokens"] == st["pool_total_tokens"]


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_history_the_tree_evicts_moves_to_host_and_its_next_turn_restores_it(
    server_factory, hf_eager, page_size
):
    """Before each later turn a full-cache request needs nearly the whole pool, so the radix cache
    evicts the conversation's stored history: with offload it moves to host memory (its kept K/V,
    positions and evicted tokens' store) and the next turn restores it into fresh slots, prefilling
    only its new message, with recall in rounds from the restored store; every turn equals the
    reference, as if the history had never left the device. A flush empties the host store."""
    client = evict_server(server_factory, page_size)
    flush(client)
    base = client.vtoken_state()
    held = []

    def push_out(k):
        generate(client, random_ids(4060, seed=40 + k), 4, f"host-fill-{page_size}-{k}", NONE)
        held.append(client.vtoken_state()["host_histories_held"])

    reports = session(
        client,
        hf_eager,
        "h2o",
        f"host-history-{page_size}",
        RECALL,
        turns=4,
        page_size=page_size,
        rounds=2,
        between=push_out,
    )
    # before each later turn its history is in host memory: the first turn's moved there when the
    # tree evicted it, a restored turn's goes back there when it ends
    assert held == [1, 1, 1]
    assert reports[0]["history_source"] == "none"
    for r in reports[1:]:
        assert r["history_source"] == "host"
        assert r["history_restored_tokens"] == r["history_view_tokens"] > 0
        assert r["recalled_tokens"] > 0
    st = wait_pool_free(client)
    grew = {k: st[k] - base[k] for k in base if k.startswith("host_")}
    assert grew["host_histories_restored"] == 3 and grew["host_histories_stored"] == 4
    assert grew["host_bytes_to_host"] > 0 and grew["host_bytes_to_device"] > 0
    assert_released_after_flush(client)


@pytest.mark.server_group("retract1")
def test_a_turn_resumed_after_forced_retractions_goes_to_host_and_its_next_turn_restores_it(
    server_factory, hf_eager
):
    """SGLang retracts running requests every few steps (page size 1, overlap scheduler): a
    retracted turn resumes from its stashed row in a namespace of its own, and when it ends its
    history goes to host memory, where the next turn restores it from (a turn never retracted
    leaves its history in the device tree). Both turns of both conversations equal the
    reference; the pool is whole and the host store empty after a flush."""
    env = {**MEMORY_CHECKS, "SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "9"}
    client = evict_server(server_factory, 1, env=env)
    flush(client)
    kv = {"policy": "h2o", "budget": BUDGET, "window": 16, "interval": 1, "offload": True}
    cfg = EvictConfig(
        policy="h2o",
        budget=BUDGET,
        sink=SINK,
        window=16,
        interval=1,
        host=HostTier(offload=True, tokens=HOST_TOKENS),
    )
    prompts = [random_ids(60, seed=900 + k) for k in range(2)]
    histories: list = [None, None]
    retracted = [0, 0]
    for turn in range(2):
        rids = [f"host-retract-{k}-{turn}" for k in range(2)]
        params = {
            "temperature": 0,
            "max_new_tokens": 60,
            "ignore_eos": True,
            "custom_params": {"kv_evict": kv},
        }
        outs = client.post(
            "/generate", {"rid": rids, "input_ids": prompts, "sampling_params": params}, timeout=900
        )
        for k in range(2):
            report = outs[k]["meta_info"]["kv_evict"][0]
            if turn:
                assert report["history_source"] == ("host" if retracted[k] else "device"), k
            retracted[k] = outs[k]["meta_info"].get("num_retractions", 0)
            expected, _, histories[k] = masked_turn(
                hf_eager, prompts[k], 60, cfg, rid=rids[k], history=histories[k]
            )
            assert outs[k]["output_ids"] == expected, (turn, k, retracted[k])
            prompts[k] = prompts[k] + outs[k]["output_ids"] + random_ids(20, seed=950 + k)
        if turn == 0:
            assert sum(retracted) > 0, "no turn was retracted"
    assert_released_after_flush(client)


@pytest.mark.server_group("unchunked1")
def test_a_history_over_the_host_cap_is_dropped_counted_and_its_next_turn_prefilled_again(
    server_factory, hf_eager
):
    """A host store too small for the history the tree evicts: the history is dropped (counted),
    the next turn is prefilled whole and answered equal to the reference without a history, and
    nothing leaks (pool whole, host store empty after a flush)."""
    client = unchunked_server(server_factory)
    flush(client)
    base = client.vtoken_state()
    kv = {"policy": "streamingllm", "budget": BUDGET, "offload": True}
    cfg = EvictConfig(policy="streamingllm", budget=BUDGET, sink=SINK, interval=1)
    prompt, out = random_ids(400, seed=77), []  # its evicted tokens alone fill the host store
    for k in range(2):
        if k:
            generate(client, random_ids(4060, seed=78), 4, "cap-fill", NONE)
            st = client.vtoken_state()
            assert st["host_histories_dropped"] == base["host_histories_dropped"] + 1
            assert st["host_histories_held"] == 0
            prompt = prompt + out + random_ids(20, seed=79)
        got = generate(client, prompt, 24, f"cap-{k}", kv)
        out = got["output_ids"]
        assert got["meta_info"]["kv_evict"][0]["history_source"] == "none"
        expected, _, _ = masked_turn(hf_eager, prompt, 24, cfg, rid=f"cap-{k}")
        assert out == expected, f"turn {k}"
    assert_released_after_flush(client)


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_host_history_that_kept_nothing_of_a_shared_opening_is_not_waited_for(
    server_factory, hf_eager, page_size
):
    """Conversation A (StreamingLLM, no sinks) keeps only its newest tokens; its history goes to
    host memory. Conversation B shares only A's 40-token opening, with the same settings: A's
    host history is the deepest B's prompt continues, cut at 40, where A kept nothing. B is
    prefilled as a new conversation and equals the reference; it was kept waiting for pages the
    empty restore could never use, then ended with HTTP 503 on the idle pool."""
    client = evict_server(server_factory, page_size)
    flush(client)
    interval = 1 if page_size == 1 else 16
    kv = {"policy": "streamingllm", "budget": 32, "sink": 0, "interval": interval}
    kv = {**kv, "offload": True, "recall": 0}
    opening = random_ids(40, seed=501)
    a = opening + random_ids(40, seed=502)
    generate(client, a, 40, f"opening-a-{page_size}", kv)
    for k in range(2):  # the second fill needs what the first and A hold: A's history goes
        generate(client, random_ids(4060, seed=503 + k), 4, f"opening-fill-{page_size}-{k}", NONE)
    assert client.vtoken_state()["host_histories_held"] == 1  # A's history is in host memory
    b = opening + random_ids(40, seed=504)
    rid = f"opening-b-{page_size}"
    out = generate(client, b, 40, rid, kv)
    assert out["meta_info"]["kv_evict"][0]["history_source"] == "none"
    cfg = EvictConfig(
        policy="streamingllm", budget=32, sink=0, interval=interval, page_size=page_size
    )
    want = masked_greedy(hf_eager, b, 40, cfg, rid=rid)
    assert out["output_ids"] == want[0]
    flush(client)
    st = wait_pool_free(client)
    assert st["pool_available_tokens"] == st["pool_total_tokens"]
