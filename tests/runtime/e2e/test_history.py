"""Multi-turn sessions continue from their compacted history (`--radix-cache-backend vtoken`, page
size 1 and 16): each turn prefills only its new tokens, the output equals a Hugging Face reference
that runs the whole conversation with the same masking, other requests never see a holed history,
and the pool stays whole under SGLang's checkers."""

import random
import threading

import pytest
from servers import SHORTAGE, shortages_met, wait_pool_free
from test_eviction import generate, masked_greedy, masked_turn, post_generate, random_ids
from test_exactness import evict_server

from sgl_vtoken.config import EvictConfig

pytestmark = [pytest.mark.server, pytest.mark.server_group("holed{page_size}", page_size=1)]

BUDGET, SINK = 48, 4  # the servers' sinks; the budget comes with each request


@pytest.fixture
def client(server_factory):
    """The exactness matrix's page-1 server (started again if the factory stopped it)."""
    return evict_server(server_factory, 1)


def session_kv(policy, interval=1):
    """The `kv_evict` of the page-1 sessions: `policy` at BUDGET."""
    return {"policy": policy, "budget": BUDGET, "interval": interval}


def run_session(client, first, messages, n, kv, rid):
    """Turns of one conversation asking for `kv`: each prompt is the previous prompt + reply + a
    new message."""
    prompt, turns = list(first), []
    for k, message in enumerate([[]] + messages):
        if k:
            prompt = prompt + turns[-1]["output_ids"] + message
        out = generate(client, prompt, n, f"{rid}-{k}", kv)
        turns.append({"prompt": prompt, **out})
    return turns


def check_turns(hf_eager, turns, n, cfg, rid):
    """Every turn of `run_session` equals the reference continuing the previous turn's history,
    and each later turn continued from all of it: the stored history and view, the logical
    tokens not prefilled (`cached_tokens`)."""
    history = None
    for k, turn in enumerate(turns):
        expected, _, new_history = masked_turn(
            hf_eager, turn["prompt"], n, cfg, rid=f"{rid}-{k}", history=history
        )
        assert turn["output_ids"] == expected, f"turn {k}"
        report = turn["meta_info"]["kv_evict"][0]  # every turn evicted
        if k:
            assert report["history_tokens"] == len(history[0]), f"turn {k}"
            assert report["history_view_tokens"] == len(history[1]), f"turn {k}"
            assert turn["meta_info"]["cached_tokens"] == len(history[0]), f"turn {k}"
        history = new_history


@pytest.mark.parametrize("policy", ["streamingllm", "random"])
def test_six_turns_continue_from_compacted_history_exactly(client, hf_eager, policy):
    """fp32, interval 1: every turn matches the previous turn's stored view, prefills only the new
    tokens (prompt_tokens counts the prompt as sent, cached_tokens the logical tokens not
    prefilled), and generates exactly what HF generates when it runs the whole conversation with
    the same masks; re-prefilling the history would differ."""
    rng = random.Random(7)
    first = random_ids(30, seed=70)
    messages = [[rng.randrange(10, 2000) for _ in range(rng.randrange(5, 12))] for _ in range(5)]
    n = 24
    turns = run_session(client, first, messages, n, session_kv(policy), f"hist-{policy}")
    cfg = EvictConfig(policy=policy, budget=BUDGET, sink=SINK)
    check_turns(hf_eager, turns, n, cfg, f"hist-{policy}")
    for k, turn in enumerate(turns[1:], 1):  # the prompt as sent
        assert turn["meta_info"]["prompt_tokens"] == len(turn["prompt"]), f"turn {k}"
    last = turns[-1]
    full, _ = masked_greedy(hf_eager, last["prompt"], n, cfg, rid=f"hist-{policy}-5")
    assert full != last["output_ids"]  # a re-prefill of the whole history is another semantics
    st = wait_pool_free(client)
    assert st["pool_available_tokens"] + st["pool_evictable_tokens"] == st["pool_total_tokens"]


@pytest.mark.server_group("holed16")
@pytest.mark.parametrize("policy,interval", [("streamingllm", 16), ("random", 1), ("h2o", 1)])
def test_six_turns_at_page_size_16_continue_from_stored_pages_exactly(
    server_factory, hf_eager, policy, interval
):
    """Page size 16 (the exactness matrix's server): every turn continues from the previous
    turn's stored view, whose partial last page is copied into the new turn's own page, and
    generates exactly what HF generates over the whole conversation with the same masks."""
    client = evict_server(server_factory, 16)
    budget, window = 64, 16 if policy == "h2o" else 0
    rng = random.Random(11)
    first = random_ids(70, seed=170 + interval)
    messages = [[rng.randrange(10, 2000) for _ in range(rng.randrange(5, 20))] for _ in range(5)]
    n, rid = 24, f"hist16-{policy}"
    kv = {"policy": policy, "window": window, "interval": interval}
    turns = run_session(client, first, messages, n, kv, rid)
    cfg = EvictConfig(
        policy=policy, budget=budget, sink=4, window=window, interval=interval, page_size=16
    )
    check_turns(hf_eager, turns, n, cfg, rid)
    st = wait_pool_free(client)
    assert st["pool_available_tokens"] + st["pool_evictable_tokens"] == st["pool_total_tokens"]
    assert "Traceback" not in client.server.log_text()


@pytest.mark.server_group("holed16")
def test_a_turn_without_a_page_for_its_views_last_page_waits_then_ends_with_503(server_factory):
    """The view-tail pages refused to requests named SHORTAGE + "tail-" (`shortage.py`): a turn
    continuing a stored page-16 view whose last page is partly filled needs its own copy of that
    page when it is admitted. It waits (counted); on an idle pool no page will come, so it ends
    with HTTP 503 naming the shortage instead of holding up the queue or raising in the
    scheduler. The same turn under another id continues from the view; the pool is whole."""
    client = evict_server(server_factory, 16)
    kv = {"policy": "streamingllm", "interval": 16}
    first = random_ids(70, seed=190)
    prompt = (
        first + generate(client, first, 24, "tail-0", kv)["output_ids"] + random_ids(7, seed=191)
    )
    before = client.vtoken_state()
    r = post_generate(client, prompt, 8, SHORTAGE + "tail-1", kv)
    assert r.status_code == 503, r.text[:500]
    assert "no free KV page for the copy of a stored view's last page" in r.text
    st = client.vtoken_state()
    assert st["deferred_admissions"] > before["deferred_admissions"]
    assert st["shortage_aborts"] == before["shortage_aborts"] + 1
    assert shortages_met(before, st) == {
        "forced:admission_aborted:tail": 1,
        "forced:admission_deferred:tail": st["deferred_admissions"] - before["deferred_admissions"],
    }
    report = generate(client, prompt, 8, "tail-1", kv)["meta_info"]["kv_evict"][0]
    assert report["history_tokens"] == len(first) + 23 and report["history_view_tokens"] % 16
    st = wait_pool_free(client)
    assert st["pool_available_tokens"] + st["pool_evictable_tokens"] == st["pool_total_tokens"]
    log = client.server.log_text()
    assert "kv_evict shortage (admission_deferred" in log and "Traceback" not in log


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_prompt_that_leaves_the_history_continues_from_the_view_cut_there(
    request, server_factory, hf_eager, page_size
):
    """A next turn whose ids differ from the stored history inside the previous reply (a reply
    that re-tokenizes differently) continues from the stored view cut before the first differing
    id: it reuses the view's entries before that point, prefills the rest, and generates exactly
    what HF generates with that cut history; its own history is stored for the turn after."""
    client = (
        request.getfixturevalue("client") if page_size == 1 else evict_server(server_factory, 16)
    )
    budget, interval = (BUDGET, 1) if page_size == 1 else (64, 16)
    kv = {"policy": "streamingllm", "budget": budget, "interval": interval}
    cfg = EvictConfig(
        policy="streamingllm", budget=budget, sink=SINK, interval=interval, page_size=page_size
    )
    first, n, rid = random_ids(70, seed=270 + page_size), 40, f"cut-{page_size}"
    turn1 = generate(client, first, n, f"{rid}-0", kv)
    reply = list(turn1["output_ids"])
    cut = len(first) + 30  # the 31st reply token comes back changed
    reply[30] = reply[30] % 1000 + 7 if reply[30] % 1000 + 7 != reply[30] else reply[30] + 1
    prompt = first + reply + [11, 12, 13, 14, 15]
    turn2 = generate(client, prompt, n, f"{rid}-1", kv)
    expected1, _, history = masked_turn(hf_eager, first, n, cfg, rid=f"{rid}-0")
    assert turn1["output_ids"] == expected1
    view = [q for q in history[1] if q < cut]
    expected2, _, history2 = masked_turn(
        hf_eager, prompt, n, cfg, rid=f"{rid}-1", history=(history[0][:cut], view)
    )
    report = turn2["meta_info"]["kv_evict"][0]
    assert report["history_tokens"] == cut and report["history_view_tokens"] == len(view)
    assert turn2["meta_info"]["cached_tokens"] == cut
    assert turn2["output_ids"] == expected2
    # Turn 2's own history was stored on its new branch: turn 3 continues from all of it.
    prompt3 = prompt + turn2["output_ids"] + [21, 22, 23]
    turn3 = generate(client, prompt3, n, f"{rid}-2", kv)
    assert turn3["meta_info"]["kv_evict"][0]["history_tokens"] == len(history2[0])
    assert (
        turn3["output_ids"]
        == masked_turn(hf_eager, prompt3, n, cfg, rid=f"{rid}-2", history=history2)[0]
    )
    st = wait_pool_free(client)
    assert st["pool_available_tokens"] + st["pool_evictable_tokens"] == st["pool_total_tokens"]


def test_requests_without_eviction_never_see_holed_histories(client, hf_eager):
    """On the same server, an opted-out request whose prompt extends a stored compacted history
    is computed with full attention (bit-identical to HF), and repeats hit the prefix cache."""
    turns = run_session(
        client, random_ids(30, seed=80), [[5, 6, 7, 8]], 24, session_kv("streamingllm"), "plain"
    )
    assert turns[1]["meta_info"]["cached_tokens"] > 0  # the evicting session reused its history
    prompt = turns[1]["prompt"]
    full, _ = masked_greedy(hf_eager, prompt, 16, EvictConfig())
    for attempt in range(2):
        out = generate(client, prompt, 16, f"plain-optout-{attempt}", {"policy": "none"})
        assert out["output_ids"] == full and "kv_evict" not in out["meta_info"]
    assert out["meta_info"]["cached_tokens"] == len(prompt) - 1  # normal prefix hit on the repeat


@pytest.mark.parametrize("page_size", [1, 16])
def test_concurrent_sessions_share_the_system_prompt_without_leaks(
    request, server_factory, page_size
):
    """8 sessions x 4 turns at once, sharing a 200-token system prompt: every later turn reuses
    its history, the pool is whole afterwards, and SGLang's checkers stay quiet."""
    client = (
        request.getfixturevalue("client") if page_size == 1 else evict_server(server_factory, 16)
    )
    interval = 1 if page_size == 1 else 16
    system = random_ids(200, seed=90)
    kv = session_kv("streamingllm", interval)
    generate(client, system + [1, 2], 24, "warm-system", kv)
    results = [None] * 8

    def one(i):
        rng = random.Random(i)
        msgs = [[rng.randrange(10, 2000) for _ in range(8)] for _ in range(3)]
        results[i] = run_session(client, system + [3 + i], msgs, 20, kv, f"conc-{i}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    for turns in results:
        assert (
            turns[0]["meta_info"]["cached_tokens"] >= 200 // page_size * page_size
        )  # the system prompt
        assert all(
            t["meta_info"]["cached_tokens"] == t["meta_info"]["kv_evict"][0]["history_tokens"]
            for t in turns[1:]
        )
    st = wait_pool_free(client)
    assert st["pool_available_tokens"] + st["pool_evictable_tokens"] == st["pool_total_tokens"]
    log = client.server.log_text()
    assert "Traceback" not in log and "leak" not in log.lower()
