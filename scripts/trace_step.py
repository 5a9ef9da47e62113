"""Which project files one eviction step enters, in call order, from the scheduler hook down.

Runs `runtime.around_update_running_batch` on a fake page-16 pool and the holed radix tree
(`sgl_vtoken_tools.fake_pool`, as in `tests/patches/test_radix.py`; one request, a 128-token prompt, budget 96, interval 16): one
step untraced (the first eviction builds the step context), then the row grows to its trigger
and the second step is traced with `sys.setprofile`. Prints one JSON line: `stays` (entries into
a file, consecutive calls in one file counted once), `files` (distinct), `returns` (stays -
files: entries into a file already left) and the route.

    python scripts/trace_step.py [--policy streamingllm] [--reclaim vtoken|naive]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from sgl_vtoken_tools.fake_pool import Batch, PagedAllocator, Req, ReqToToken

REPO = Path(__file__).resolve().parents[1]
RUNTIME = ("sgl_vtoken/", "patches/", "kernels/")  # the installed runtime's sources


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--policy", default="streamingllm", help="a policy that needs no attention statistics"
    )
    ap.add_argument("--reclaim", default="vtoken", choices=("vtoken", "naive"))
    args = ap.parse_args()
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    from sgl_vtoken.config import EvictConfig
    from sgl_vtoken.patches import runtime
    from sgl_vtoken.patches.cache import radix
    from sgl_vtoken.patches.core.process import start

    ps, prompt_len = 16, 128
    start(holed=True)
    alloc = PagedAllocator(64, ps)
    cache = radix.HoledRadixCache(
        CacheInitParams(
            disable=False,
            req_to_token_pool=ReqToToken(),
            token_to_kv_pool_allocator=alloc,
            page_size=ps,
        )
    )
    scheduler = type(
        "Scheduler",
        (),
        {
            "tree_cache": cache,
            "req_to_token_pool": cache.req_to_token_pool,
            "token_to_kv_pool_allocator": alloc,
            "max_total_num_tokens": 64 * ps,
            "page_size": ps,
            "_reqs_finishing_inflight": lambda self, b: [],
        },
    )()
    cfg = EvictConfig(
        policy=args.policy, budget=96, sink=16, interval=16, page_size=ps, reclaim=args.reclaim
    )
    st = runtime.new_state(cfg, "r0", holed=radix.tree_mode(cfg))
    req = Req(list(range(1000, 1000 + prompt_len)), st)
    req.kv.kv_committed_len = req.kv.kv_allocated_len = prompt_len
    req.kv.swa_evict_floor, req.extend_end, req.kv.holds_kv = 0, prompt_len, True
    req.refresh_fill_ids()
    rtt = cache.req_to_token_pool.req_to_token
    rtt[0, :prompt_len] = alloc.alloc(prompt_len).to(torch.int32)
    runtime.around_update_running_batch(lambda s, b: None, scheduler, Batch([req], [prompt_len]))
    n = req.kv.kv_committed_len
    while not cfg.should_evict(n):  # decode to the next trigger
        rtt[0, n] = int(rtt[0, n - 1]) + 1 if n % ps else int(alloc.alloc(ps)[0])
        n += 1
        req.output_ids.append(2000 + n)
    req.kv.kv_committed_len = req.kv.kv_allocated_len = n
    req.refresh_fill_ids()
    route: list[str] = []

    def profile(frame, event, arg):
        if event != "call":
            return
        rel = os.path.relpath(os.path.realpath(frame.f_code.co_filename), REPO)
        if rel.startswith(RUNTIME) and (not route or route[-1] != rel):
            route.append(rel)

    sys.setprofile(profile)
    runtime.around_update_running_batch(lambda s, b: None, scheduler, Batch([req], [n]))
    sys.setprofile(None)
    if req.kv.kv_committed_len >= n:
        raise SystemExit("the traced step did not evict")
    print(
        json.dumps(
            {
                "policy": args.policy,
                "reclaim": args.reclaim,
                "stays": len(route),
                "files": len(set(route)),
                "returns": len(route) - len(set(route)),
                "route": route,
            }
        )
    )


if __name__ == "__main__":
    main()
