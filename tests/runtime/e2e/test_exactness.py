"""Exactness through the path every `--kv-evict` server takes (holed radix cache on): every policy x
page size {1, 16} x interval {1, 16}, token for token equal to the Hugging Face reference that
masks exactly the evicted keys at their original positions, its victims chosen by the
independent oracles (`tests/runtime/oracles`); plus chunked prefill under the
attention policies and forced retractions. One server per page size (the interval comes with
each request), SGLang's memory checkers on."""

import threading
import time

import pytest
from servers import MEMORY_CHECKS, SHORTAGE, evict_flags, kept_floor, shortages_met
from test_eviction import generate, masked_greedy, post_generate, random_ids, wait_pool_free

from sgl_vtoken.config import EvictConfig

pytestmark = pytest.mark.server

BUDGET = 64
POLICIES = ["streamingllm", "random", "knorm", "h2o", "tova", "scissorhands"]
WINDOW = {"h2o": 16, "scissorhands": 16}  # as in their papers: heavy hitters plus a recent window


HOST_TOKENS = 100_000


def evict_server(server_factory, page_size, *extra, env=MEMORY_CHECKS, host_tokens=HOST_TOKENS):
    """A server whose own policy is streamingllm (interval 1) with a host store of `host_tokens`
    (recalls fill holes of up to `recall.GAP` candidates); the policy of each request, its
    interval, offload and recall come with the request."""
    flags = (*evict_flags("streamingllm", BUDGET, config={"host_tokens": host_tokens}), *extra)
    return server_factory(page_size=page_size, extra=flags, env=env)


def expected_output(hf_eager, prompt, n, policy, page_size, interval, rid):
    cfg = EvictConfig(
        policy=policy,
        budget=BUDGET,
        sink=4,
        window=WINDOW.get(policy, 0),
        interval=interval,
        page_size=page_size,
    )
    return masked_greedy(hf_eager, prompt, n, cfg, rid=rid)[0]


def per_request(policy, interval=1):
    """The request's `kv_evict`."""
    return {"interval": interval, "policy": policy, "window": WINDOW.get(policy, 0)}


@pytest.mark.server_group("chunked16")
@pytest.mark.parametrize("policy", ["h2o", "tova", "scissorhands"])
def test_attention_policies_are_exact_under_chunked_prefill(server_factory, hf_eager, policy):
    """A 100-token prompt prefilled in chunks of 32: the observation window (the prompt's last 16
    queries) spans the last two chunks; the statistics and the output equal the unchunked
    reference."""
    client = evict_server(server_factory, 16, "--chunked-prefill-size", "32")
    prompt, n, rid = random_ids(100, seed=1200 + POLICIES.index(policy)), 120, f"chunked-{policy}"
    out = generate(client, prompt, n, rid, per_request(policy))
    assert out["output_ids"] == expected_output(hf_eager, prompt, n, policy, 16, 1, rid)


@pytest.mark.server_group("retract{page_size}")
@pytest.mark.parametrize(
    "page_size,overlap,interval",
    [(1, True, 1), (1, False, 1), (16, False, 16), (16, True, 16), (16, True, 1)],
    ids=["page1", "page1-no-overlap", "page16-no-overlap", "page16", "page16-interval1"],
)
@pytest.mark.parametrize("policy", ["streamingllm", "random", "h2o", "scissorhands"])
def test_forced_retractions_resume_from_the_compacted_row_exactly(
    server_factory, hf_eager, policy, page_size, overlap, interval
):
    """SGLang retracts a running request every few steps; two requests of one policy run together,
    so one of them is retracted again and again after it has evicted. Each resumes from its
    stashed compacted row with its policy state (eviction count, attention statistics), so both
    outputs stay the masked reference's and neither is re-prefilled; the pool is whole
    afterwards. Under the overlap scheduler a retraction in a step that evicted resumes from the
    row before that eviction (at page size 16 the repack wrote over it: its victims were kept)."""
    env = {**MEMORY_CHECKS, "SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "9"}
    extra = () if overlap else ("--disable-overlap-schedule",)
    client = evict_server(server_factory, page_size, *extra, env=env)
    seed = 1300 + 10 * POLICIES.index(policy) + 100 * (interval < page_size)  # no shared prompt
    prompts = [random_ids(100, seed=seed + k) for k in range(2)]
    rids = [f"retract-{policy}-{page_size}-{interval}-{k}" for k in range(2)]
    params = {
        "temperature": 0,
        "max_new_tokens": 120,
        "ignore_eos": True,
        "custom_params": {"kv_evict": per_request(policy, interval)},
    }
    # One batch request: both are admitted together, so they decode together and are retracted.
    outs = client.post(
        "/generate", {"rid": rids, "input_ids": prompts, "sampling_params": params}, timeout=900
    )
    assert sum(o["meta_info"].get("num_retractions", 0) for o in outs) > 0
    for k in range(2):
        assert not outs[k]["meta_info"]["kv_evict"][0].get("retracted_reprefill")
        expected = expected_output(hf_eager, prompts[k], 120, policy, page_size, interval, rids[k])
        assert outs[k]["output_ids"] == expected, (k, outs[k]["meta_info"].get("num_retractions"))
    st = wait_pool_free(client)
    assert st["pool_available_tokens"] + st["pool_evictable_tokens"] == st["pool_total_tokens"]
    log = client.server.log_text()
    assert "Testing retraction" in log and "Traceback" not in log


@pytest.mark.server_group("retract{page_size}")
@pytest.mark.parametrize(
    "page_size,overlap,policy",
    [(16, False, "h2o"), (1, True, "tova")],
    ids=["page16-no-overlap-h2o", "page1-tova"],
)
def test_a_retracted_row_with_no_page_to_come_back_to_waits_then_ends_with_503(
    server_factory, hf_eager, page_size, overlap, policy
):
    """The resume pages refused to requests named SHORTAGE + "resume-" (`shortage.py`), forced
    retractions: a request that evicted is retracted (it has decoded less than its neighbour) and
    cannot write its row back. It waits (counted) while its neighbour runs, which still equals the
    masked reference; once the pool is idle no page will come, so it ends with HTTP 503 naming the
    shortage instead of holding up the queue. The pool is whole, the server up. At page size 1
    under the overlap scheduler, the ended request's attention statistics once still described the
    stashed row, and the step SGLang runs an aborted request through took the server down."""
    env = {**MEMORY_CHECKS, "SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "9"}
    extra = () if overlap else ("--disable-overlap-schedule",)
    client = evict_server(server_factory, page_size, *extra, env=env)
    kv = per_request(policy, 16)
    prompts = [random_ids(100, seed=1400 + k) for k in range(2)]
    before = client.vtoken_state()
    keeper = {}
    thread = threading.Thread(
        target=lambda: keeper.update(generate(client, prompts[0], 200, "keeper", kv))
    )
    thread.start()
    while not client.vtoken_state()["running_evicting_requests"]:
        time.sleep(0.05)
    r = post_generate(client, prompts[1], 120, SHORTAGE + "resume-0", kv, timeout=300)
    thread.join(300)
    assert r.status_code == 503, r.text[:500]
    assert "no free KV page for a retracted row written back" in r.text
    assert keeper["output_ids"] == expected_output(
        hf_eager, prompts[0], 200, policy, page_size, 16, "keeper"
    )
    st = wait_pool_free(client)
    assert st["deferred_admissions"] > before["deferred_admissions"]
    assert st["shortage_aborts"] == before["shortage_aborts"] + 1
    assert shortages_met(before, st) == {
        "forced:admission_aborted:resume": 1,
        "forced:admission_deferred:resume": st["deferred_admissions"]
        - before["deferred_admissions"],
    }
    assert st["pool_available_tokens"] + st["pool_evictable_tokens"] == st["pool_total_tokens"]
    log = client.server.log_text()
    assert "kv_evict shortage (admission_deferred" in log and "Traceback" not in log


# Last in the file: the page-16 server stays up for test_history.py, which uses it next.
@pytest.mark.server_group("holed{page_size}")
@pytest.mark.parametrize("page_size", [1, 16])
def test_attention_policies_are_exact_with_decode_scoring_as_a_cuda_graph_runs_it(
    server_factory, hf_eager, page_size, tmp_path_factory
):
    """h2o, tova and scissorhands at once (a decode batch of 3, padded to 4 lanes): each decode
    step scored on the static buffers a decode CUDA graph captures, loaded before the forward and
    copied to the requests after it (`graph_stub.py` stands in for the capture on CPU), gives
    the masked reference's output token for token, as the eager scoring does; no step ran
    eagerly."""
    log = tmp_path_factory.getbasetemp() / f"graph_stub{page_size}.log"
    env = {**MEMORY_CHECKS, "VTOKEN_TEST_GRAPH_STUB": str(log)}
    client = evict_server(server_factory, page_size, env=env)
    policies = ["h2o", "tova", "scissorhands"]
    cases = {
        p: (random_ids(100, seed=2000 + i + page_size), f"graph-{p}-{page_size}")
        for i, p in enumerate(policies)
    }
    outs: dict = {}

    def run(policy):
        prompt, rid = cases[policy]
        outs[policy] = generate(client, prompt, 64, rid, per_request(policy, 16))

    threads = [threading.Thread(target=run, args=(p,)) for p in policies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for policy, (prompt, rid) in cases.items():
        expected = expected_output(hf_eager, prompt, 64, policy, page_size, 16, rid)
        assert outs[policy]["output_ids"] == expected, policy
        assert outs[policy]["meta_info"]["kv_evict"][0]["evictions"] > 0
    assert client.vtoken_state()["graph_eager_steps"] == 0
    steps = [tuple(map(int, line.split())) for line in log.read_text().splitlines()]
    assert len(steps) >= 63 and (3, 4) in steps  # every decode step; a batch of 3 in 4 lanes


@pytest.mark.server_group("holed{page_size}")
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("page_size,interval", [(1, 1), (1, 16), (16, 1), (16, 16)])
def test_every_policy_is_exact_through_the_holed_cache(
    server_factory, hf_eager, page_size, interval, policy
):
    """fp32, a prompt longer than the budget, 96 new tokens: equal to the masked reference, not to
    full attention (the same server, `{"policy": "none"}`), and the row ends at the budget."""
    client = evict_server(server_factory, page_size)
    seed = 1000 + 10 * POLICIES.index(policy) + page_size + interval
    prompt, n, rid = random_ids(100, seed=seed), 96, f"matrix-{policy}-{page_size}-{interval}"
    out = generate(client, prompt, n, rid, per_request(policy, interval))
    expected = expected_output(hf_eager, prompt, n, policy, page_size, interval, rid)
    assert out["output_ids"] == expected
    full = generate(client, prompt, n, rid + "-full", {"policy": "none"})["output_ids"]
    assert full != expected
    report = out["meta_info"]["kv_evict"][0]
    assert report["policy"] == policy
    assert kept_floor(policy, BUDGET) <= report["live_tokens"] < BUDGET + interval
