"""Eviction during prefill (`--kv-evict-config '{"prefill_chunk": C}'`): a long prompt is prefilled
chunk by chunk and evicted to the budget whenever its row reaches budget + C, token for token
equal to the Hugging Face reference that masks the same way, at page sizes 1 and 16, for a fresh
prompt, a cached one and a turn continuing from a stored history; with offload and recall the
prompt's last chunk brings back what the prefill evicted, exactly as the reference that applies
the same rule; SGLang's memory checkers on. The reference's victims and recalled tokens are
chosen by the independent oracles (`tests/runtime/oracles`)."""

import random
import threading

import pytest
import requests
from servers import MEMORY_CHECKS, SHORTAGE, evict_flags, shortages_met, wait_pool_free
from test_eviction import generate, masked_greedy, masked_turn, post_generate, random_ids

from sgl_vtoken.config import EvictConfig, HostTier, Prefill, Scoring

pytestmark = [pytest.mark.server, pytest.mark.server_group("prefill{page_size}", page_size=16)]

BUDGET, CHUNK, SINK = 64, 32, 4
HOST_TOKENS, RECALL = 100_000, 16


def prefill_server(server_factory, page_size, pool=4096):
    """A host store too: requests may ask for offload and recall (`kv_evict`)."""
    settings = {"prefill_chunk": CHUNK, "host_tokens": HOST_TOKENS}
    flags = (
        *evict_flags("streamingllm", BUDGET, sink=SINK, config=settings),
        "--disable-overlap-schedule",
        "--chunked-prefill-size",
        "512",
    )
    return server_factory(page_size=page_size, extra=flags, env=MEMORY_CHECKS, pool=pool)


def config(policy, page_size, **kw):
    window = 16 if policy == "h2o" else 0
    return EvictConfig(
        policy=policy,
        budget=BUDGET,
        sink=SINK,
        window=window,
        page_size=page_size,
        prefill=Prefill(chunk=CHUNK),
        **kw,
    )


def prefill_evictions(prompt_len: int, pos: int = 0, row: int = 0) -> int:
    """Prompt tokens evicted while prefilling a prompt of `prompt_len` tokens from logical
    position `pos` onto a row of `row` tokens: budget + chunk - budget at each chunk's end."""
    n, peak = 0, BUDGET + CHUNK
    while pos + peak - row < prompt_len:
        pos, row, n = pos + peak - row, BUDGET, n + CHUNK
    return n


def test_the_reference_never_lets_a_prompt_token_see_more_than_the_peak(hf_eager):
    """The oracle itself: with prefill_chunk every prompt token attends to at most
    budget + prefill_chunk tokens (itself included), the row is cut to the budget at each chunk's
    end, and a prompt that fits under the peak is prefilled whole, as without the setting."""
    cfg = config("h2o", 1, scoring=Scoring(span=0))  # exact sizes: every token on its own
    prompt = random_ids(200, seed=990)
    _, _, (allowed, _) = masked_turn(hf_eager, prompt, 4, cfg, rid="ref")
    sizes = [len(a) for a in allowed[: len(prompt)]]
    assert max(sizes) == BUDGET + CHUNK and sizes[BUDGET + CHUNK] == BUDGET + 1
    assert all(a == sorted(set(a)) and a[-1] == i for i, a in enumerate(allowed[: len(prompt)]))
    short = prompt[: BUDGET + CHUNK]
    whole = EvictConfig.from_dict({**cfg.to_dict(), "prefill_chunk": None})
    assert (
        masked_turn(hf_eager, short, 8, cfg, rid="ref")[0]
        == masked_turn(hf_eager, short, 8, whole, rid="ref")[0]
    )


@pytest.mark.parametrize("page_size,policy", [(1, "h2o"), (16, "random")])
def test_a_long_prompt_is_evicted_chunk_by_chunk_exactly(
    server_factory, hf_eager, page_size, policy
):
    """A 300-token prompt with budget 64 and chunks of 32: the row never holds more than 96 tokens;
    the output equals the chunked masked reference (not the whole-prompt one), the report counts
    the prompt tokens evicted in the prefill, none of which is reported cached; the same prompt
    again reuses at most the first chunk from the radix cache and gives the same output."""
    client = prefill_server(server_factory, page_size)
    prompt, n, rid = (
        random_ids(300, seed=900 + page_size + len(policy)),
        40,
        f"prefill-{policy}-{page_size}",
    )
    # span 0: the report counts budget + chunk - budget at each chunk's end (spans: test_span.py)
    kv = {"policy": policy, "window": 16 if policy == "h2o" else 0, "span": 0}
    out = generate(client, prompt, n, rid, kv)
    cfg = config(policy, page_size, scoring=Scoring(span=0))
    assert out["output_ids"] == masked_greedy(hf_eager, prompt, n, cfg, rid=rid)[0]
    whole_cfg = EvictConfig.from_dict({**cfg.to_dict(), "prefill_chunk": None})
    whole = masked_greedy(hf_eager, prompt, n, whole_cfg, rid=rid)[0]
    assert whole != out["output_ids"]
    report, meta = out["meta_info"]["kv_evict"][0], out["meta_info"]
    assert report["prefill_evicted_tokens"] == prefill_evictions(len(prompt))
    assert meta["prompt_tokens"] == len(prompt) and meta["cached_tokens"] == 0
    again = generate(client, prompt, n, rid, kv)
    assert again["output_ids"] == out["output_ids"]
    assert 0 < again["meta_info"]["cached_tokens"] < BUDGET + CHUNK
    st = wait_pool_free(client)
    assert st["pool_available_tokens"] + st["pool_evictable_tokens"] == st["pool_total_tokens"]
    assert "Traceback" not in client.server.log_text()


@pytest.mark.parametrize("page_size", [1, 16])
def test_turns_with_long_messages_continue_from_history_exactly(
    server_factory, hf_eager, page_size
):
    """Three turns whose new messages (80-120 tokens) are longer than a chunk: each turn continues
    from the stored view of the one before and evicts during its own prefill, exactly as the
    reference that runs the whole conversation with the same masks."""
    client = prefill_server(server_factory, page_size)
    rng = random.Random(31)
    cfg = config("streamingllm", page_size)
    prompt, n, rid, history = (
        random_ids(150, seed=950 + page_size),
        20,
        f"prefill-hist-{page_size}",
        None,
    )
    for k in range(3):
        out = generate(client, prompt, n, f"{rid}-{k}", {"policy": "streamingllm"})
        expected, _, new_history = masked_turn(
            hf_eager, prompt, n, cfg, rid=f"{rid}-{k}", history=history
        )
        assert out["output_ids"] == expected, f"turn {k}"
        report = out["meta_info"]["kv_evict"][0]
        if k:
            assert report["history_tokens"] == len(history[0]), f"turn {k}"
            assert out["meta_info"]["cached_tokens"] == len(history[0])
        start = (len(history[0]), len(history[1])) if k else ()
        assert report["prefill_evicted_tokens"] == prefill_evictions(len(prompt), *start) > 0, (
            f"turn {k}"
        )
        history = new_history
        prompt = (
            prompt
            + out["output_ids"]
            + [rng.randrange(10, 2000) for _ in range(rng.randrange(80, 120))]
        )
    st = wait_pool_free(client)
    assert st["pool_available_tokens"] + st["pool_evictable_tokens"] == st["pool_total_tokens"]
    assert "Traceback" not in client.server.log_text()


SMALL_POOL = 256


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_prompt_three_times_the_pool_is_answered_exactly(server_factory, hf_eager, page_size):
    """On a 256-token pool a 768-token prompt evicted during prefill holds at most budget + chunk
    (+ a page) tokens, so SGLang's input limit (pool - 6) does not refuse it: its output equals
    the chunked masked reference, twice in a row; a request that does not evict during prefill
    gets HTTP 400 naming `prefill_chunk`, and one over the model's context a 400 naming the
    context length. The pool is whole afterwards under SGLang's checkers."""
    client = prefill_server(server_factory, page_size, pool=SMALL_POOL)
    prompt, n, rid = random_ids(3 * SMALL_POOL, seed=930 + page_size), 24, f"long-{page_size}"
    expected = masked_greedy(hf_eager, prompt, n, config("streamingllm", page_size), rid=rid)[0]
    for k in range(2):
        out = generate(client, prompt, n, rid, {"policy": "streamingllm"})
        assert out["output_ids"] == expected, k
        assert out["meta_info"]["prompt_tokens"] == len(prompt)
    report = out["meta_info"]["kv_evict"][0]
    assert report["prefill_evicted_tokens"] == prefill_evictions(len(prompt)) > 2 * SMALL_POOL

    def refused(ids, kv):
        params = {"temperature": 0, "max_new_tokens": 4, "custom_params": {"kv_evict": kv}}
        r = requests.post(
            client.base_url + "/generate",
            timeout=120,
            json={"input_ids": ids, "sampling_params": params},
        )
        assert r.status_code == 400, r.text[:300]
        return r.json()["error"]["message"]

    # not evicted (opted out): the pool bounds the prompt, and the message says what lifts it
    assert "prefill_chunk" in refused(prompt, {"policy": "none"})
    assert "context length" in refused(random_ids(32_800, seed=1), {"policy": "streamingllm"})
    st = wait_pool_free(client)
    assert st["pool_available_tokens"] + st["pool_evictable_tokens"] == st["pool_total_tokens"]
    assert "Traceback" not in client.server.log_text()


def test_concurrent_long_prompts_share_a_system_prompt_exactly(server_factory, hf_eager):
    """Six requests at once, each a shared 200-token system prompt + its own 100 tokens, at page
    size 16: SGLang carries one chunked prefill at a time, so the others wait their turn; every
    output equals its chunked masked reference (a cached system prompt is reused only inside the
    first chunk), and the pool is whole afterwards under SGLang's checkers."""
    client = prefill_server(server_factory, 16)
    system, n = random_ids(200, seed=991), 24
    prompts = [system + random_ids(100, seed=1000 + i) for i in range(6)]
    results = [None] * len(prompts)

    def one(i):
        results[i] = generate(
            client, prompts[i], n, f"prefill-conc-{i}", {"policy": "streamingllm"}
        )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cfg = config("streamingllm", 16)
    for i, out in enumerate(results):
        meta = {k: v for k, v in out["meta_info"].items() if k != "output_token_logprobs"}
        assert (
            out["output_ids"]
            == masked_greedy(hf_eager, prompts[i], n, cfg, rid=f"prefill-conc-{i}")[0]
        ), (i, meta)
        assert out["meta_info"]["cached_tokens"] < BUDGET + CHUNK
    assert any(out["meta_info"]["cached_tokens"] > 0 for out in results)
    st = wait_pool_free(client)
    assert st["pool_available_tokens"] + st["pool_evictable_tokens"] == st["pool_total_tokens"]
    assert "Traceback" not in client.server.log_text()


def test_a_page_shortage_ends_or_defers_one_request_and_the_server_goes_on(server_factory):
    """Page size 16, every page refused to the requests named SHORTAGE (`shortage.py`), Random
    policy (it keeps scattered tokens, so partly kept cached pages must be copied): a long prompt
    whose first chunk is cached cannot copy the cached tokens its eviction during prefill keeps,
    so that request ends with HTTP 503 naming the shortage; a short prompt that another request
    cached cannot copy the shared tokens its decode evictions keep (nor leave the tree: it is not
    its own), so they are deferred and counted, and it still returns every token. The server goes on: the counters
    moved, the same prompt is served as before, the pool is whole, the running gauges read zero
    once nothing runs, no traceback."""
    client = prefill_server(server_factory, 16)
    prompt, kv = random_ids(300, seed=950), {"policy": "random"}
    first = generate(client, prompt, 8, "neighbour", kv)
    before = client.vtoken_state()
    r = post_generate(client, prompt, 8, SHORTAGE + "prefill", kv)
    assert r.status_code == 503, r.text[:500]
    assert "no free KV page" in r.text and "prefill_chunk" in r.text
    short = random_ids(40, seed=951)
    generate(client, short, 20, "neighbour-short", kv)  # its pages are cached, not its own
    out = generate(client, short, 80, SHORTAGE + "decode", kv)
    report = out["meta_info"]["kv_evict"][0]
    assert len(out["output_ids"]) == 80 and report["deferred_evictions"] > 0
    again = generate(client, prompt, 8, "neighbour", kv)
    assert again["output_ids"] == first["output_ids"] and again["meta_info"]["cached_tokens"] > 0
    st = wait_pool_free(client)
    assert st["shortage_aborts"] == before["shortage_aborts"] + 1
    assert st["deferred_evictions"] - before["deferred_evictions"] == report["deferred_evictions"]
    assert shortages_met(before, st) == {
        "forced:prefill_aborted": 1,
        "forced:eviction_deferred": report["deferred_evictions"],
    }
    assert (
        st["running_evicting_requests"] == st["live_tokens"] == st["retained_pages"] == 0
    )  # idle now
    assert st["pool_available_tokens"] + st["pool_evictable_tokens"] == st["pool_total_tokens"]
    assert "Traceback" not in client.server.log_text()


@pytest.mark.parametrize(
    "page_size,policy,rounds", [(1, "h2o", 1), (16, "streamingllm", 1), (16, "h2o", 2)]
)
def test_the_last_chunk_recalls_what_the_prefill_evicted_exactly(
    server_factory, hf_eager, page_size, policy, rounds
):
    """A 310-token prompt evicted chunk by chunk with offload + recall 16: its victims go to the
    host store, and the last chunk's first part scores them and brings the best 16 back before
    the rest (and the first output token) is computed (with `recall_rounds` 2: 8, then the
    window recomputed with them scores again and brings 8 more). Two turns, the second continuing
    the stored view and recalling from its store and its own prefill's victims; each equal to the
    reference that applies the same rule, and different from the outputs without recall."""
    client = prefill_server(server_factory, page_size)
    rng = random.Random(77 + page_size)
    window = 16 if policy == "h2o" else 0
    kv = {
        "policy": policy,
        "window": window,
        "offload": True,
        "recall": RECALL,
        "recall_rounds": rounds,
    }
    cfg = config(
        policy,
        page_size,
        host=HostTier(offload=True, tokens=HOST_TOKENS, recall=RECALL, rounds=rounds),
    )
    plain_cfg = config(policy, page_size)
    prompt, n, rid, history, plain_history = (
        random_ids(310, seed=970 + page_size + 100 * rounds),
        24,
        f"prefill-rc-{page_size}-{rounds}",
        None,
        None,
    )
    for k in range(2):
        out = generate(client, prompt, n, f"{rid}-{k}", kv)
        # cached_tokens: the logical prompt tokens not prefilled, the recalled ones included
        assert out["meta_info"]["cached_tokens"] == (len(history[0]) if k else 0), f"turn {k}"
        expected, _, history = masked_turn(
            hf_eager, prompt, n, cfg, rid=f"{rid}-{k}", history=history
        )
        plain, _, plain_history = masked_turn(
            hf_eager, prompt, n, plain_cfg, rid=f"{rid}-{k}", history=plain_history
        )
        assert out["output_ids"] == expected, f"turn {k}"
        assert plain != expected, f"turn {k}: recall changed nothing"
        report = out["meta_info"]["kv_evict"][0]
        assert report["recalled_tokens"] == report["pinned_tokens"] == RECALL, f"turn {k}"
        assert report["recall_rounds"] == rounds, f"turn {k}"
        evicted = report["prefill_evicted_tokens"]
        assert evicted > 0 and report["offloaded_tokens"] >= evicted, f"turn {k}"
        assert len(set(report["recalled_positions"])) == RECALL and max(
            report["recalled_positions"]
        ) < len(prompt)
        prompt = prompt + out["output_ids"] + [rng.randrange(10, 2000) for _ in range(100)]
    st = wait_pool_free(client)
    assert st["pool_available_tokens"] + st["pool_evictable_tokens"] == st["pool_total_tokens"]
    assert "Traceback" not in client.server.log_text()
