"""The host tier (`offload`, `recall`): evicted tokens' K/V kept in host memory with the stored
history, and recalled by a later turn's question. Every turn equals the Hugging Face reference
that makes the same recall decisions with the independent oracles (`tests/runtime/oracles`); the host
store is released with the histories."""

import random
import threading
import time

import pytest
import requests
from servers import MEMORY_CHECKS, SHORTAGE, evict_flags, shortages_met
from test_eviction import generate, masked_turn, random_ids, wait_pool_free
from test_exactness import HOST_TOKENS, evict_server

from sgl_vtoken.config import EvictConfig, HostTier, Scoring

pytestmark = [pytest.mark.server, pytest.mark.server_group("holed{page_size}", page_size=1)]

BUDGET, SINK, RECALL = 48, 4, 8
NONE = {"policy": "none"}
SMALL_HOST = 300  # tokens: less than one stored history of the cap test needs


@pytest.fixture
def client(server_factory):
    """The exactness matrix's page-1 server, which has a host store."""
    return evict_server(server_factory, 1)


def flush(client, timeout=30.0):
    """Flush the radix cache. SGLang refuses while a request is still being released (an abort's
    response can reach the client first): retry until it is idle."""
    deadline = time.monotonic() + timeout
    while True:
        r = requests.post(client.base_url + "/flush_cache", timeout=60)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert r.status_code == 200, r.text


def session(
    client,
    hf_eager,
    policy,
    rid,
    recall,
    turns=5,
    n=24,
    page_size=1,
    rounds=1,
    between=None,
    span=0,
):
    """One conversation with offload (and `recall` in `rounds`, words kept whole with `span`);
    asserts each turn equals the reference and returns the per-turn reports. `between(k)` runs
    before turn k >= 1."""
    rng = random.Random(sum(map(ord, rid)))
    prompt = random_ids(30 if page_size == 1 else 70, seed=300 + recall)
    messages = [
        [rng.randrange(10, 2000) for _ in range(rng.randrange(17, 24))] for _ in range(turns - 1)
    ]
    budget, window = (BUDGET, 0) if page_size == 1 else (64, 0)
    window = 16 if policy == "h2o" else window
    interval = 16 if page_size > 1 and policy == "streamingllm" else 1
    kv = {
        "policy": policy,
        "budget": budget,
        "offload": True,
        "recall": recall,
        "interval": interval,
        "window": window,
        "recall_rounds": rounds,
        "span": span,
    }
    cfg = EvictConfig(
        policy=policy,
        budget=budget,
        sink=SINK,
        window=window,
        interval=interval,
        page_size=page_size,
        scoring=Scoring(span=span),
        host=HostTier(offload=True, tokens=HOST_TOKENS, recall=recall, rounds=rounds),
    )
    history, reports, out = None, [], []
    for k in range(turns):
        if k:
            prompt = prompt + out + messages[k - 1]
            if between is not None:
                between(k)
        got = generate(client, prompt, n, f"{rid}-{k}", kv)
        out = got["output_ids"]
        if k:  # the logical tokens not prefilled: the whole history, the recalled ones included
            assert got["meta_info"]["cached_tokens"] == len(history[0]), f"turn {k}"
        expected, _, history = masked_turn(
            hf_eager, prompt, n, cfg, rid=f"{rid}-{k}", history=history
        )
        assert out == expected, f"turn {k}"
        reports.append(got["meta_info"]["kv_evict"][0])
    return reports


@pytest.mark.parametrize(
    "policy,page_size", [("streamingllm", 1), ("h2o", 1), ("streamingllm", 16), ("h2o", 16)]
)
def test_recall_turns_equal_the_reference_and_the_store_is_released(
    server_factory, hf_eager, policy, page_size
):
    """Five turns, budget 48 (64 at page size 16), recall 8: from turn 2 on each turn's prefill
    is cut in two, the first chunk's window recalls up to 8 of its history's evicted tokens, and
    the second chunk recomputes that window (16 tokens, one page at page size 16, fewer when the
    view ends inside that page) with them visible; they are kept through the turn (at page size
    16 page-dense, then compacted away before the history is stored); outputs equal HF applying
    the oracles' recall rule. The stored history holds the host chunks until the tree lets it go
    (flush), and the pool is whole under SGLang's checkers."""
    client = evict_server(server_factory, page_size)
    flush(client)
    reports = session(
        client, hf_eager, policy, f"recall-{policy}-{page_size}", RECALL, page_size=page_size
    )
    assert all(r["offloaded_tokens"] > 0 for r in reports)
    assert "recalled_tokens" not in reports[0]
    for r in reports[1:]:
        assert r["recalled_tokens"] == r["pinned_tokens"] == min(RECALL, r["recall_candidates"]) > 0
        assert r["recall_ms"] > 0 and r["host_bytes"] > 0 and 0 < r["recomputed_tokens"] <= 16
    assert reports[-1]["recalled_tokens"] == RECALL
    st = wait_pool_free(client)
    assert (
        st["host_tokens_held"] > 0
        and st["host_bytes_held"] > 0
        and st["recalled_tokens"] >= sum(r["recalled_tokens"] for r in reports[1:])
    )
    flush(client)
    st = wait_pool_free(client)
    assert st["host_tokens_held"] == 0 and st["host_bytes_held"] == 0
    assert st["pool_available_tokens"] == st["pool_total_tokens"]


@pytest.mark.parametrize("page_size", [1, 16])
def test_recall_in_rounds_equals_the_reference(server_factory, hf_eager, page_size):
    """`recall_rounds` 3 (per request), recall 8: each recalling turn's prefill is cut once per
    round; the scoring window, recomputed with what the rounds before brought back visible,
    recalls 2, 2, then the 4 left of the candidates left. Every turn equals HF replaying the same
    rounds, and the report sums the rounds (all recalled positions, each round's recomputed
    window)."""
    client = evict_server(server_factory, page_size)
    flush(client)
    reports = session(
        client, hf_eager, "h2o", f"rounds-{page_size}", RECALL, page_size=page_size, rounds=3
    )
    full = [r for r in reports[1:] if r["recall_candidates"] >= RECALL]
    assert full, reports
    for r in full:
        assert r["recall_rounds"] == 3 and r["recalled_tokens"] == r["pinned_tokens"] == RECALL
        assert (
            r["recalled_positions"] == sorted(set(r["recalled_positions"]))
            and len(r["recalled_positions"]) == RECALL
        )
        assert 3 <= r["recomputed_tokens"] <= 3 * 16
    wait_pool_free(client)
    flush(client)
    st = wait_pool_free(client)
    assert st["pool_available_tokens"] == st["pool_total_tokens"]


@pytest.mark.server_group("busy1")
def test_turns_that_wait_for_admission_still_recall(server_factory, hf_eager):
    """Four conversations' recalling turns sent at once on a 256-token pool: not all fit, so
    some are refused a place after their recall was planned and wait, and SGLang matches each
    waiting request again every round. Each plans its recall again from its new match: all four
    recall and equal the reference. (A turn not admitted at its first try went on unrecalled: on
    a busy pool the question turns of most chats recalled nothing.)"""
    flags = evict_flags("streamingllm", 64, config={"host_tokens": HOST_TOKENS})
    client = server_factory(page_size=1, extra=flags, env=MEMORY_CHECKS, pool=256)
    flush(client)
    n, conversations = 24, 4
    kv = {
        "policy": "streamingllm",
        "budget": BUDGET,
        "interval": 1,
        "offload": True,
        "recall": RECALL,
        "recall_rounds": 1,
    }
    cfg = EvictConfig(
        policy="streamingllm",
        budget=BUDGET,
        sink=SINK,
        interval=1,
        host=HostTier(offload=True, tokens=HOST_TOKENS, recall=RECALL, rounds=1),
    )
    turns = []
    for i in range(conversations):
        prompt = random_ids(30, seed=400 + i)
        out = generate(client, prompt, n, f"wait-{i}-0", kv)["output_ids"]
        expected, _, history = masked_turn(hf_eager, prompt, n, cfg, rid=f"wait-{i}-0")
        assert out == expected, f"conversation {i}, turn 0"
        turns.append((prompt + out + random_ids(20, seed=500 + i), history))
    got: dict[int, dict] = {}

    def question(i: int) -> None:
        got[i] = generate(client, turns[i][0], n, f"wait-{i}-1", kv)

    threads = [threading.Thread(target=question, args=(i,)) for i in range(conversations)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for i, (prompt, history) in enumerate(turns):
        report = got[i]["meta_info"]["kv_evict"][0]
        assert report.get("recalled_tokens", 0) == min(RECALL, report["recall_candidates"]) > 0, (
            report
        )
        expected, _, _ = masked_turn(hf_eager, prompt, n, cfg, rid=f"wait-{i}-1", history=history)
        assert got[i]["output_ids"] == expected, f"conversation {i}, turn 1"
    flush(client)
    st = wait_pool_free(client)
    assert st["pool_available_tokens"] == st["pool_total_tokens"]


def test_a_recall_without_free_pages_is_skipped_and_counted(client, hf_eager):
    """Every page refused to the session named SHORTAGE (`shortage.py`): from its second turn on,
    the recall finds no free page, so the turn goes on without recalled tokens and says how many
    it skipped; the server counts the skipped recalls, logs the shortage once, and its pool is
    whole after."""
    flush(client)
    before = client.vtoken_state()
    rng, prompt = random.Random(7), random_ids(30, seed=307)
    kv = {"policy": "streamingllm", "budget": BUDGET, "offload": True, "recall": RECALL}
    out, reports = [], []
    for k in range(3):
        if k:
            prompt = prompt + out + [rng.randrange(10, 2000) for _ in range(20)]
        got = generate(client, prompt, 24, f"{SHORTAGE}recall-{k}", kv)
        out = got["output_ids"]
        assert len(out) == 24
        reports.append(got["meta_info"]["kv_evict"][0])
    assert all(r["recall_skipped_tokens"] > 0 and not r.get("recalled_tokens") for r in reports[1:])
    st = wait_pool_free(client)
    assert st["skipped_recalls"] - before["skipped_recalls"] == 2
    assert shortages_met(before, st) == {"forced:recall_skipped:page": 2}
    assert st["pool_available_tokens"] + st["pool_evictable_tokens"] == st["pool_total_tokens"]
    log = client.server.log_text()
    assert log.count("kv_evict shortage (recall_skipped") == 1 and "Traceback" not in log


def test_offload_without_recall_changes_no_output_and_requests_without_it_hold_no_host_memory(
    client, hf_eager
):
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
    for kv, field in (
        ({"recall": 8}, "kv_evict.recall"),
        ({"offload": "yes"}, "kv_evict.offload"),
        ({"offload": True, "recall": 60}, "kv_evict.recall"),
    ):
        params = {
            "max_new_tokens": 1,
            "custom_params": {"kv_evict": {"policy": "streamingllm", "budget": BUDGET, **kv}},
        }
        r = requests.post(
            client.base_url + "/generate",
            timeout=60,
            json={"input_ids": [1, 2, 3], "sampling_params": params},
        )
        assert r.status_code == 400 and field in r.text, (kv, r.text)


def test_host_store_moves_with_a_history_the_tree_evicts_and_goes_with_an_aborted_request(client):
    """A stored history whose node the radix cache evicts for room moves to host memory with its
    host store (a flush releases both); an aborted offloading request's chunks go to its stored
    view or are released (after a flush nothing is left)."""
    flush(client)
    kv = {"policy": "streamingllm", "budget": BUDGET, "offload": True}
    generate(client, random_ids(3000, seed=11), 8, "host-lru-a", kv)
    st = wait_pool_free(client)
    held, stored = st["host_tokens_held"], st["host_histories_stored"]
    assert held > 2000 and st["host_histories_held"] == 0
    # B needs all but 38 slots of the pool: A's evictable prompt and its stored history too
    generate(client, random_ids(4050, seed=12), 8, "host-lru-b", NONE)
    st = wait_pool_free(client)
    assert st["host_histories_held"] == 1 and st["host_histories_stored"] == stored + 1
    # every token of its history (prompt, outputs but the last) is in host memory: the evicted
    # ones in its store, the kept ones with their K/V
    assert st["host_tokens_held"] == 3000 + 8 - 1 > held
    flush(client)
    st = wait_pool_free(client)
    assert st["host_tokens_held"] == 0 and st["host_bytes_held"] == 0

    flush(client)
    done = []
    worker = threading.Thread(
        target=lambda: done.append(
            requests.post(
                client.base_url + "/generate",
                timeout=600,
                json={
                    "rid": "host-abort",
                    "input_ids": random_ids(200, seed=13),
                    "sampling_params": {
                        "max_new_tokens": 3000,
                        "ignore_eos": True,
                        "custom_params": {"kv_evict": kv},
                    },
                },
            )
        )
    )
    worker.start()
    deadline = time.monotonic() + 120
    while client.vtoken_state()["host_tokens_held"] == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    requests.post(client.base_url + "/abort_request", json={"rid": "host-abort"}, timeout=30)
    worker.join(600)
    assert done and done[0].status_code == 200
    flush(client)  # the aborted turn's chunks went to its stored view or were released: none left
    st = wait_pool_free(client)
    assert st["host_tokens_held"] == 0 and st["host_bytes_held"] == 0
    assert st["pool_available_tokens"] + st["pool_evictable_tokens"] == st["pool_total_tokens"]


def unchunked_server(server_factory):
    """Page size 1 without SGLang's chunked prefill, and a host store of only SMALL_HOST tokens."""
    return evict_server(
        server_factory,
        1,
        "--chunked-prefill-size",
        "-1",
        "--mem-fraction-static",
        "0.8",  # SGLang derives a negative one without chunked prefill
        host_tokens=SMALL_HOST,
    )


@pytest.mark.server_group("unchunked1")
def test_recall_without_chunked_prefill_answers_unrecalled_and_counts_it(server_factory, hf_eager):
    """A server without SGLang's chunked prefill (`--chunked-prefill-size -1`) cannot cut a
    turn's prefill where recall needs it: a request asking for recall gets every turn answered,
    equal to the reference that recalls nothing, and the skip is counted (the request's
    `recall_skipped_tokens`, the server's `recall_skipped:cut`); the scheduler goes on."""
    client = unchunked_server(server_factory)
    before = client.vtoken_state()
    kv = {"policy": "streamingllm", "budget": BUDGET, "offload": True, "recall": RECALL}
    cfg = EvictConfig(
        policy="streamingllm",
        budget=BUDGET,
        sink=SINK,
        interval=1,
        host=HostTier(offload=True, tokens=HOST_TOKENS, recall=0),
    )
    prompt, history, out = random_ids(30, seed=404), None, []
    for k in range(3):
        if k:
            prompt = prompt + out + random_ids(20, seed=405 + k)
        got = generate(client, prompt, 24, f"unchunked-{k}", kv)
        out = got["output_ids"]
        expected, _, history = masked_turn(
            hf_eager, prompt, 24, cfg, rid=f"unchunked-{k}", history=history
        )
        assert out == expected, f"turn {k}"
        report = got["meta_info"]["kv_evict"][0]
        assert "recalled_tokens" not in report
        if k:
            assert report["recall_skipped_tokens"] > 0, report
    assert shortages_met(before, client.vtoken_state()).get("recall_skipped:cut", 0) >= 2
    assert client.server.healthy()
