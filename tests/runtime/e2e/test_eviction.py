"""Eviction in the server, on CPU: exact against a masked Hugging Face reference, bounded memory
under SGLang's own checkers, more concurrent requests, and the Naive-Evict baseline."""

import json
import random
import threading
import time
from functools import partial

import pytest
import requests
from oracles import ORACLE_RECALL, oracle_policy
from servers import BENCH_FLAGS, MEMORY_CHECKS, kept_floor, wait_pool_free

from sgl_vtoken.config import EvictConfig
from sgl_vtoken_tools import hf_reference

# The reference chooses victims with the oracles written apart from the runtime
# (tests/runtime/oracles): every end-to-end test takes its references from these two.
masked_greedy = partial(hf_reference.masked_greedy, policy=oracle_policy, recall=ORACLE_RECALL)
masked_turn = partial(hf_reference.masked_turn, policy=oracle_policy, recall=ORACLE_RECALL)

pytestmark = [pytest.mark.server, pytest.mark.server_group("stock")]

RETRACT_LINE = "KV cache pool is full. Retract requests."


def evict_server(server_factory, page_size, policy, budget, *flags):
    extra = ("--kv-evict", policy, "--kv-budget", str(budget), *flags)
    return server_factory(page_size=page_size, extra=extra, env=MEMORY_CHECKS)


def random_ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(n)]


def generate_payload(prompt, n, rid, kv_evict=None) -> dict:
    """A greedy /generate request for `n` tokens (with `kv_evict` if given)."""
    params = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
    if kv_evict is not None:
        params["custom_params"] = {"kv_evict": kv_evict}
    return {"rid": rid, "input_ids": prompt, "sampling_params": params}


def generate(client, prompt, n, rid, kv_evict=None, timeout=120.0):
    return client.post("/generate", generate_payload(prompt, n, rid, kv_evict), timeout=timeout)


def post_generate(client, prompt, n, rid, kv_evict=None, timeout=120.0) -> requests.Response:
    """`generate` for a request that may be refused: the response, whatever its status."""
    return requests.post(
        client.base_url + "/generate",
        json=generate_payload(prompt, n, rid, kv_evict),
        timeout=timeout,
    )


POLICIES = ["streamingllm", "random", "knorm", "h2o", "tova", "scissorhands"]
WINDOW = {"h2o": 16, "scissorhands": 16}  # as in their papers: heavy hitters plus a recent window


@pytest.mark.parametrize("policy", ["random", "h2o"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_per_request_eviction_on_a_stock_cache_is_exact(
    server_factory, hf_eager, policy, page_size
):
    """A `--kv-evict none` server keeps SGLang's own radix cache; a request asking for eviction
    (`kv_evict`) is exact there too: fp32, interval 1, 200 tokens, token for token equal to HF
    attending exactly to the kept keys at their original positions, and not equal to full
    attention. (Every policy through the holed cache: test_exactness.py.)"""
    client = server_factory(page_size=page_size)
    seed = 100 + 10 * POLICIES.index(policy) + page_size
    prompt, n, rid = random_ids(100, seed=seed), 200, f"exact-{policy}-{page_size}"
    window = WINDOW.get(policy, 0)
    out = generate(client, prompt, n, rid, {"policy": policy, "budget": 64, "window": window})
    cfg = EvictConfig(policy=policy, budget=64, sink=4, window=window, page_size=page_size)
    expected, _ = masked_greedy(hf_eager, prompt, n, cfg, rid=rid)
    assert out["output_ids"] == expected
    full, _ = masked_greedy(hf_eager, prompt, n, EvictConfig())
    assert expected != full
    report = out["meta_info"]["kv_evict"][0]
    assert report["policy"] == policy and kept_floor(policy, 64) <= report["live_tokens"] <= 64
    assert report["evicted_tokens"] >= len(prompt) + n - 2 - 64
    # The same prompt without eviction on the same server is stock SGLang: full attention.
    assert generate(client, prompt, n, rid + "-stock")["output_ids"] == full
    assert "kv_evict" not in generate(client, prompt, 4, rid + "-stock2")["meta_info"]


def test_shared_prefix_is_pinned_and_capped(server_factory, hf_eager):
    """An evicting request matching another request's cached prompt keeps the tree-owned prefix
    (capped at budget - window tokens) and evicts only its own tokens, exactly."""
    client = server_factory(page_size=1)
    shared = random_ids(100, seed=42)
    generate(client, shared + [7, 8, 9], 4, "owner")  # inserted into the radix cache
    prompt = shared + [11, 12, 13, 14]
    kv = {"policy": "streamingllm", "budget": 64, "window": 16}
    out = generate(client, prompt, 80, "pinned", kv)
    assert out["meta_info"]["cached_tokens"] == 48  # budget - window
    cfg = EvictConfig(policy="streamingllm", budget=64, window=16)
    expected, _ = masked_greedy(hf_eager, prompt, 80, cfg, rid="pinned", tree_owned=48)
    assert out["output_ids"] == expected


def test_invalid_request_settings_are_rejected_naming_the_field(server_factory):
    client = server_factory(page_size=1)
    cases = [
        ({"policy": "bogus"}, "kv_evict.policy must be one of"),
        ({"policy": "streamingllm", "budget": 2}, "kv_evict.budget must be >="),
        ({"policy": "streamingllm"}, "kv_evict.budget is required"),
        (
            {"policy": "random", "budget": 64, "temperature": 1},
            "kv_evict.temperature: unknown field",
        ),
        ({"policy": "random", "budget": 64.5}, "kv_evict.budget must be an integer"),
        ({"policy": "random", "budget": True}, "kv_evict.budget must be an integer"),
        ({"policy": "random", "budget": None}, "kv_evict.budget is required"),
        ({"policy": "random", "budget": 64, "sink": -1}, "kv_evict.sink must be >= 0"),
        ({"policy": "random", "budget": 64, "interval": 0}, "kv_evict.interval must be >= 1"),
        (
            {"policy": "random", "budget": 40000},
            "kv_evict.budget: must be <= the model's context length",
        ),
        (
            {"policy": "random", "budget": 5000},  # fits the context, not the 4096-token pool
            "kv_evict.budget 5000: an evicting request holds up to budget + interval + page_size = 5002",
        ),
        ("streamingllm", "kv_evict must be a JSON object"),
    ]
    for kv, needle in cases:
        r = requests.post(
            client.base_url + "/generate",
            timeout=60,
            json={
                "input_ids": [1, 2, 3],
                "sampling_params": {"max_new_tokens": 2, "custom_params": {"kv_evict": kv}},
            },
        )
        assert r.status_code == 400 and needle in r.text, (kv, r.status_code, r.text)
    assert generate(client, [1, 2, 3], 2, "still-serving")["output_ids"]  # the server still serves
    r = requests.post(
        client.base_url + "/v1/chat/completions",
        timeout=60,
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "custom_params": {"kv_evict": {"policy": "knorm", "budget": 1}},
        },
    )
    assert r.status_code == 400 and "kv_evict.budget" in r.text


def test_openai_extra_body_carries_kv_evict(server_factory):
    """Per-request eviction through the OpenAI client; the eviction figures ride in `usage`
    (an extra field standard clients keep aside), streamed ones with the usage chunk and with the
    final chunk of a /generate stream, never the stale figures of the first token."""
    client = server_factory(page_size=1)
    messages = [{"role": "user", "content": "Tell me everything about paged attention. " * 12}]
    kv = {"policy": "streamingllm", "budget": 32}
    evicted = client.chat(messages, 40, kv)
    stock = client.chat(messages, 40)
    assert evicted.usage.completion_tokens > 0
    assert evicted.choices[0].message.content != stock.choices[0].message.content
    figures = evicted.usage.model_extra["kv_evict"]
    total = evicted.usage.prompt_tokens + evicted.usage.completion_tokens
    assert figures["policy"] == "streamingllm" and figures["live_tokens"] == 32
    # every token but the last has KV; the last step's row is the budget plus that step's token
    assert figures["evicted_tokens"] == total - 2 - 32 and figures["evictions"] > 1
    assert "kv_evict" not in (stock.usage.model_extra or {})
    chunks = list(
        client.chat(
            [{"role": "user", "content": "Now stream it. " * 20}],
            40,
            kv,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = chunks[-1].usage
    streamed = usage.model_extra["kv_evict"]
    assert streamed["evicted_tokens"] == usage.prompt_tokens + usage.completion_tokens - 2 - 32
    r = requests.post(
        client.base_url + "/generate",
        stream=True,
        timeout=120,
        json={
            "input_ids": random_ids(60, seed=3),
            "stream": True,
            "sampling_params": {
                "temperature": 0,
                "max_new_tokens": 30,
                "ignore_eos": True,
                "custom_params": {"kv_evict": {"policy": "streamingllm", "budget": 32}},
            },
        },
    )
    events = [
        json.loads(line[6:])
        for line in r.iter_lines(decode_unicode=True)
        if line.startswith("data: {")
    ]
    reports = [e["meta_info"]["kv_evict"] for e in events if e["meta_info"].get("kv_evict")]
    assert len(reports) == 1 and events[-1]["meta_info"]["kv_evict"] == reports[0]
    assert reports[0][0]["evicted_tokens"] == 60 + 30 - 2 - 32


def run_concurrent(client, num, max_new_tokens, abort_after=None, abort_every=2, kv_evict=None):
    """`num` concurrent /generate requests (with `kv_evict` if given); optionally abort every
    `abort_every`-th after a delay."""
    outs = [None] * num
    params = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    if kv_evict is not None:
        params["custom_params"] = {"kv_evict": kv_evict}

    def one(i):
        r = requests.post(
            client.base_url + "/generate",
            timeout=1800,
            json={
                "rid": f"load-{i}",
                "input_ids": random_ids(48, seed=i),
                "sampling_params": params,
            },
        )
        outs[i] = r.json()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(num)]
    for t in threads:
        t.start()
    if abort_after is not None:
        time.sleep(abort_after)
        for i in range(0, num, abort_every):
            requests.post(client.base_url + "/abort_request", json={"rid": f"load-{i}"}, timeout=30)
    for t in threads:
        t.join(600)
    return outs


@pytest.mark.server_group("bench16")
def test_sixteen_long_requests_run_at_once_without_leaks(server_factory):
    """16 x 512 new tokens, pool 4096, page 16, budget 128 (per request, on the bench tests'
    StreamingLLM server): stock SGLang admits 7 at a time; here all 16 run together, none is
    retracted, the checkers stay quiet, and the pool is whole after. The server's peaks cover
    the earlier bench traffic too, which runs fewer requests at once on smaller rows."""
    client = server_factory(page_size=16, extra=BENCH_FLAGS)
    log_start = len(client.server.log_text())
    outs = run_concurrent(client, 16, 512, kv_evict={"budget": 128})
    assert all(len(o["output_ids"]) == 512 for o in outs)
    st = wait_pool_free(client)
    assert st["peak_running_requests"] == 16
    assert st["pool_available_tokens"] + st["pool_evictable_tokens"] == st["pool_total_tokens"]
    assert st["peak_retained_pages"] <= 16 * ((128 + 16 + 16) // 16)
    log = client.server.log_text()[log_start:]
    assert RETRACT_LINE not in log and "Traceback" not in log
    metrics = requests.get(client.base_url + "/metrics", timeout=30).text
    exported = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("sglang:vtoken_")
    }
    assert exported["sglang:vtoken_evicted_tokens"] == st["evicted_tokens"] > 0
    assert exported["sglang:vtoken_peak_running_requests"] == 16
    # Aborts in the middle of eviction free everything too.
    run_concurrent(client, 16, 512, abort_after=2.0, kv_evict={"budget": 128})
    st = wait_pool_free(client)
    assert st["pool_available_tokens"] + st["pool_evictable_tokens"] == st["pool_total_tokens"]
    assert "Traceback" not in client.server.log_text()[log_start:] and client.server.healthy()


@pytest.mark.server_group("bench16")
def test_request_can_opt_out_on_an_evicting_server(server_factory, hf_eager):
    client = server_factory(page_size=16, extra=BENCH_FLAGS)
    prompt = random_ids(150, seed=5)
    out = generate(client, prompt, 60, "opt-out", {"policy": "none"})
    full, _ = masked_greedy(hf_eager, prompt, 60, EvictConfig())
    assert out["output_ids"] == full and "kv_evict" not in out["meta_info"]


@pytest.mark.server_group("bench16")
def test_a_prompt_within_a_page_of_the_pool_is_answered_not_queued_forever(server_factory):
    """Page size 16, a 4096-token pool: a 4085-token prompt passes SGLang's input check (< 4090)
    but `prompt + page` never fits, so stock SGLang would refuse it at every pass, first in line
    for ever (docs/upstream-admission-livelock.md). With eviction (the server's StreamingLLM, no
    prefill_chunk) and without it (`kv_evict` none) it is answered with HTTP 400 naming the
    reason, and a request sent behind it is served."""
    client = server_factory(page_size=16, extra=BENCH_FLAGS)
    prompt = random_ids(4085, seed=4085)
    for kv in (None, {"policy": "none"}):
        params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
        if kv is not None:
            params["custom_params"] = {"kv_evict": kv}
        r = requests.post(
            client.base_url + "/generate",
            json={"input_ids": prompt, "sampling_params": params},
            timeout=120,
        )
        assert r.status_code == 400 and "can never be scheduled" in r.text, (
            r.status_code,
            r.text[:300],
        )
        assert len(generate(client, random_ids(50, seed=1), 4, None, kv)["output_ids"]) == 4
    assert "Traceback" not in client.server.log_text()


@pytest.mark.server_group("reclaim16")
def test_naive_reclaim_holds_more_pages_with_identical_outputs(server_factory):
    """Scattered victims (random, then H2O, page 16): Naive-Evict frees a page only when all its
    tokens are dead, so it retains more pages than vToken's compaction for the same victims and
    outputs (server counters and per-request reports). Both cache the prompt and store the
    compacted history the same way.
    H2O keeps most of its tokens in the (tree-owned) prompt, whose pages neither mode frees
    itself: the emulated Naive-Evict may then free as many private pages as vToken."""
    prompt = random_ids(200, seed=11)
    results = {}
    for reclaim in ("vtoken", "naive"):
        client = evict_server(server_factory, 16, "random", 96, "--kv-reclaim", reclaim)
        out = generate(client, prompt, 120, "naive-vs-vtoken")
        st = wait_pool_free(client)
        # Both store the compacted history the same way: the next turn continues from all of it.
        turn2 = generate(client, prompt + out["output_ids"] + [5, 6, 7], 24, "naive-vs-vtoken-2")
        assert turn2["meta_info"]["kv_evict"][0]["history_tokens"] == len(prompt) + 120 - 1
        again = generate(client, prompt, 4, "naive-vs-vtoken-again", {"policy": "none"})
        assert (
            again["meta_info"]["cached_tokens"] == len(prompt) // 16 * 16
        )  # the prompt was cached
        # Another prompt: a prefix hit on the first one would seed H2O's statistics differently.
        h2o = generate(
            client,
            random_ids(200, seed=12),
            120,
            "naive-vs-vtoken-h2o",
            {"policy": "h2o", "window": 16},
        )
        end = wait_pool_free(client)
        assert (
            end["pool_available_tokens"] + end["pool_evictable_tokens"] == end["pool_total_tokens"]
        )
        assert end["naive_held_requests"] == 0
        results[reclaim] = (
            out["output_ids"],
            st["peak_retained_pages"],
            out["meta_info"]["kv_evict"][0],
            h2o["output_ids"],
            h2o["meta_info"]["kv_evict"][0],
            turn2["output_ids"],
        )
    vt, nv = results["vtoken"], results["naive"]
    assert vt[0] == nv[0] and vt[3] == nv[3] and vt[5] == nv[5]
    assert nv[1] > vt[1]
    assert vt[1] == -(-(96 + 1) // 16)  # ideal: ceil(live / page) at the peak step
    assert nv[2]["pages_freed"] < vt[2]["pages_freed"]
    assert nv[4]["pages_freed"] <= vt[4]["pages_freed"]


@pytest.mark.server_group("retract16")
def test_forced_retractions_do_not_leak(server_factory):
    """SGLang's forced retraction mode: evicting requests (H2O with its attention statistics,
    naive reclaim holding pages back) are retracted and re-prefilled again and again, under
    concurrent load; all finish and every page comes back."""
    env = {**MEMORY_CHECKS, "SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "25"}
    extra = ("--kv-evict", "h2o", "--kv-budget", "64", "--kv-window", "16", "--kv-reclaim", "naive")
    client = server_factory(page_size=16, extra=extra, env=env)
    outs = run_concurrent(client, 6, 200)
    assert all(len(o["output_ids"]) == 200 for o in outs)
    # --kv-reclaim naive resumes by re-prefilling (its held pages are not kept): the report says
    # so (a request retracted while its own prefill was in flight is prefilled again as it was
    # first, with nothing to say)
    retracted = [o for o in outs if o["meta_info"].get("num_retractions", 0) > 0]
    assert any(o["meta_info"]["kv_evict"][0].get("retracted_reprefill") for o in retracted)
    st = wait_pool_free(client)
    assert st["pool_available_tokens"] + st["pool_evictable_tokens"] == st["pool_total_tokens"]
    assert st["naive_held_requests"] == 0
    log = client.server.log_text()
    assert "Testing retraction" in log and "Traceback" not in log
