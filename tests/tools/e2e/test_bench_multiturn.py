"""SGLang's multi-turn chat benchmark (`sglang.bench_serving`, generated-shared-prefix, chat
backend) runs against an evicting page-16 server: every conversation completes, later turns reuse
cached prompt tokens (stored histories, cut where the re-sent reply re-tokenizes differently), and
no KV slot leaks, also on a pool too small to keep every stored history (the tree evicts them
like any unlocked node, SGLang's memory checkers on)."""

import pytest
from servers import BENCH_FLAGS, wait_pool_free

from sgl_vtoken_tools.bench.multiturn import Workload, run_bench

pytestmark = pytest.mark.server


@pytest.mark.parametrize(
    "pool",
    [
        pytest.param(4096, marks=pytest.mark.server_group("bench16")),
        pytest.param(640, marks=pytest.mark.server_group("bench16-640")),
    ],
)
def test_bench_serving_multi_turn_chat_completes_and_reuses_histories(
    server_factory, tiny_model, pool
):
    client = server_factory(page_size=16, extra=BENCH_FLAGS, pool=pool)
    work = Workload(
        groups=1, prompts_per_group=3, system_len=48, question_len=24, output_len=24, turns=3
    )
    before = client.vtoken_state()
    out = run_bench(client.base_url, str(tiny_model), str(tiny_model), work, timeout=600)
    after = client.vtoken_state()
    assert out["completed"] == 3 * 3 and out["aborted"] == 0  # every turn of every conversation
    assert out["total_output_tokens"] == 3 * 3 * 24
    assert after["history_hits"] - before["history_hits"] >= 3  # turns 2 and 3 continued histories
    assert out["cached_tokens"] > 0
    st = wait_pool_free(client)
    assert st["pool_available_tokens"] + st["pool_evictable_tokens"] == st["pool_total_tokens"]
