"""A prompt that nearly fills the pool, under SGLang's default overlap scheduler: its first
eviction must free most of the pool before decoding goes on, which needs its own prompt to leave
its lock (docs/design/cache.md, "Own prompt"); before, SGLang's out-of-memory abort ended it (HTTP
500), at page size 16 until its own prompt could leave the tree with packed pages."""

import threading

import pytest
from servers import MEMORY_CHECKS
from test_eviction import generate, masked_greedy, random_ids, wait_pool_free

from sgl_vtoken.config import EvictConfig

pytestmark = [pytest.mark.server]


@pytest.mark.server_group("edge{page_size}")
@pytest.mark.parametrize(
    "page_size,sizes", [(1, (240, 245, 249)), (16, (221, 228, 235))], ids=["page1", "page16"]
)
def test_prompts_near_the_pool_size_are_answered_under_the_overlap_scheduler(
    server_factory, hf_eager, page_size, sizes
):
    """A 256-token pool, SGLang's overlap scheduler on, StreamingLLM budget 64 every 16 steps (no
    prefill_chunk): a prompt of 240-249 tokens (page size 16: 221-235, the most SGLang admits)
    fills the pool, and its first eviction must free most of it before decoding goes on. Its
    prompt is in the tree, locked by it alone, and no page is free for the copies of what it
    keeps: its own prompt leaves the tree with the row, the kept entries packed onto its first
    pages (docs/design/cache.md, "Own prompt"), so it is answered rather than ended by SGLang's
    out-of-memory abort (HTTP 500), and so are six 200-235-token prompts at once; every output
    equals the masked reference, and the pool is whole afterwards under SGLang's checkers."""
    client = server_factory(
        page_size=page_size,
        extra=("--kv-evict", "streamingllm", "--kv-budget", "64", "--kv-evict-interval", "16"),
        env=MEMORY_CHECKS,
        pool=256,
    )
    cfg = EvictConfig(policy="streamingllm", budget=64, interval=16, page_size=page_size)
    n = 40
    prompts = {f"edge-{page_size}-{k}": random_ids(k, seed=k) for k in sizes}
    results = {rid: generate(client, p, n, rid) for rid, p in prompts.items()}
    many = {f"edge-many-{page_size}-{i}": random_ids(200 + 7 * i, seed=300 + i) for i in range(6)}

    def one(rid):
        results[rid] = generate(client, many[rid], n, rid)

    threads = [threading.Thread(target=one, args=(rid,)) for rid in many]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rid, prompt in {**prompts, **many}.items():
        assert results[rid]["output_ids"] == masked_greedy(hf_eager, prompt, n, cfg, rid=rid)[0], (
            rid
        )
    st = wait_pool_free(client)
    assert st["pool_available_tokens"] + st["pool_evictable_tokens"] == st["pool_total_tokens"]
    assert "Traceback" not in client.server.log_text()
