"""The stress table's row is read from a run's JSON lines alone."""

import json

from sgl_vtoken_tools.bench.stress_table import row


def test_a_row_counts_outcomes_shortages_and_the_pool(tmp_path):
    summary = {
        "kind": "summary",
        "ok": True,
        "checks": {"no_stall": True},
        "requests": 10,
        "by_kind": {
            "generate": {"ok": 5, "clipped": 1},
            "abort": {"aborted": 1},
            "invalid": {"rejected": 1},
            "over_pool": {"ok": 1, "rejected": 0},
            "shortage": {"unavailable": 1},
        },
        "unexpected": 0,
        "counters": {"evicted_tokens": 99, "history_hits": 3},
        "retracted_requests": 2,
        "shortages": {"eviction_deferred": 4, "forced:admission_aborted:tail": 1},
        "longest_gap_s": 1.5,
        "pool_after_drain": {
            "pool_total_tokens": 64,
            "pool_available_tokens": 60,
            "pool_evictable_tokens": 4,
        },
        "pool_after_flush": {"pool_available_tokens": 64},
    }
    path = tmp_path / "stress_page1_x.jsonl"
    path.write_text(json.dumps({"kind": "server", "page_size": 1}) + "\n" + json.dumps(summary))
    assert row(path) == (
        "| `stress-page1_x` | 1 | 10 (6 + 1 clipped / 1 / 1 / 1 / 0) | 1 / 0 / 0 | 99 | 3 | 2 "
        "| eviction_deferred 4 | admission_aborted:tail 1 | 1.5 | 60 + 4 = 64 | 64 free | all pass |"
    )
    summary["ok"], summary["checks"] = False, {"no_stall": False}
    path.write_text(json.dumps({"kind": "server", "page_size": 1}) + "\n" + json.dumps(summary))
    assert row(path).endswith("| FAIL: no_stall |")
