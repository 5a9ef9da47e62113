"""A simple concurrent load: `num` greedy `/generate` requests of seeded random token ids, one
thread each, timed as a whole (`python -m sgl_vtoken_tools eviction`'s capacity part)."""

from __future__ import annotations

import random
import statistics
import threading
import time

from sgl_vtoken_tools.bench.http_client import generate


def random_ids(n: int, seed: int) -> list[int]:
    """`n` token ids in [10, 2000) from `random.Random(seed)` (the e2e tests' prompts)."""
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(n)]


def run_load(base_url: str, num: int, prompt_len: int, max_new_tokens: int, timeout: float) -> dict:
    """`num` concurrent requests (prompt i: `random_ids(prompt_len, seed=i)`, rid `bench-{i}`);
    completed and full-length counts, output tokens, wall time, latency median and max, errors."""
    results: list[dict | None] = [None] * num
    errors: list[str] = []

    def one(i: int) -> None:
        t0 = time.perf_counter()
        try:
            out = generate(
                base_url, random_ids(prompt_len, seed=i), max_new_tokens, timeout, rid=f"bench-{i}"
            )
            results[i] = {
                "tokens": out["meta_info"]["completion_tokens"],
                "latency": time.perf_counter() - t0,
            }
        except Exception as e:  # noqa: BLE001 - reported in the result
            errors.append(f"request {i}: {type(e).__name__}: {e}"[:300])

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(num)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(1.0, timeout + 30 - (time.perf_counter() - t0)))
    wall = time.perf_counter() - t0
    done = [r for r in results if r is not None]
    out_tokens = sum(r["tokens"] for r in done)
    lat = sorted(r["latency"] for r in done)
    return {
        "completed": len(done),
        "full_length": sum(r["tokens"] == max_new_tokens for r in done),
        "output_tokens": out_tokens,
        "wall_s": round(wall, 2),
        "output_tokens_per_s": round(out_tokens / wall, 1) if wall > 0 else None,
        "latency_median_s": round(statistics.median(lat), 2) if lat else None,
        "latency_max_s": round(lat[-1], 2) if lat else None,
        "request_errors": errors[:5],
        "num_request_errors": len(errors),
    }
