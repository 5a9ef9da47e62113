"""Scoring of the agent benchmark: a session is right exactly when the first number of its last
reply is the whole key; summaries turn known answers into accuracy (by where the fact was) and
agreement with the full cache; cell lines give spreads and the throughput ratio to stock."""

import pytest

from sgl_vtoken_tools.bench.agent_chat import answer_record
from sgl_vtoken_tools.bench.agent_score import cell_lines, summarize, table
from sgl_vtoken_tools.quality.agent_sessions import AgentSession


def session(i: int, key: str, fact_turn: int) -> AgentSession:
    turns = (("user", "task"), ("tool", "out"), ("user", "What is the secret number?"))
    return AgentSession(f"s{i}", turns, key, {"fact_turn": fact_turn, "phrasing": "p"})


@pytest.mark.parametrize(
    "reply,hit",
    [
        ("The secret number is 54288.", True),
        ("54288", True),
        ("542880", False),  # a longer number
        ("It is 542.", False),  # a partial number
        ("54,288", False),  # not written whole
        ("Not 12345, it is 54288.", False),  # the first number written counts
        ("I do not know.", False),
        ("", False),
    ],
)
def test_whole_value_scoring(reply, hit):
    rec = answer_record(session(0, "54288", 1), reply, failed=False, kv_tokens=9)
    assert rec["hit"] is hit and rec["expected"] == "54288" and rec["kv_tokens"] == 9
    assert rec["turns"] == 3 and rec["fact_turn"] == 1 and rec["conversation"] == "s0"


def test_failed_session_is_wrong_whatever_it_says():
    assert not answer_record(session(0, "54288", 2), "54288", failed=True, kv_tokens=0)["hit"]


def request(completion=10, prompt=100, cached=40, ttft=0.2, error=None, turn=1, source=None):
    return {
        "error": error,
        "conversation": "s0",
        "turn": turn,
        "history_source": source,
        "history_restored_tokens": 300 if source == "host" else 0,
        "completion_tokens": completion,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "ttft": ttft,
    }


def test_summary_accuracy_agreement_and_counts():
    sess = [session(i, f"1000{i}", 1 + i % 2) for i in range(4)]
    replies = ["10000", "no", "It is 10002.", "7"]  # right: 0 (task) and 2 (task)
    answers = [
        answer_record(s, r, False, 100 * (i + 1)) for i, (s, r) in enumerate(zip(sess, replies))
    ]
    reference = [answer_record(s, r, False, 0) for s, r in zip(sess, ["10000", "5", "x", "7"])]
    reqs = [
        request(source="none"),
        request(ttft=0.4, turn=2, source="host"),
        request(error="HTTP 500", turn=3, source="device"),
    ]
    host = {"host_bytes_to_host": 1000, "host_bytes_to_device": 600, "host_histories_restored": 1}
    log = (
        "Decode batch, #running-req: 3, x\nDecode batch, #running-req: 5, x\n"
        "KV cache pool is full. Retract requests. #retracted_reqs: 2\n"
    )
    s = summarize(reqs, answers, 4.0, log, reference, host)
    assert (s["accuracy"], s["accuracy_task"], s["accuracy_tool"]) == (0.5, 1.0, 0.0)
    assert s["agreement"] == 0.5  # sessions 0 and 3 gave the full cache's first number
    assert (s["requests"], s["failed"], s["output_tokens"]) == (3, 1, 20)
    assert s["output_tokens_per_s"] == 5.0 and s["prefill_tokens"] == 120
    assert s["mean_ttft_ms"] == 300.0 and (s["kv_tokens_mean"], s["kv_tokens_max"]) == (250, 400)
    assert (s["retractions"], s["peak_running"]) == (2, 5)
    # the answered later turn came back from host memory; the failed one counts nowhere
    assert (s["turns_from_host"], s["turns_from_device"], s["turns_prefilled_again"]) == (1, 0, 0)
    assert s["history_restored_tokens"] == 300 and s["host_bytes_per_turn"] == 800.0
    assert s["host_histories_restored"] == 1
    bare = summarize(reqs, answers, 4.0)
    assert bare["agreement"] is None and bare["retractions"] is None
    assert bare["host_bytes_per_turn"] is None


def test_cell_lines_ratio_to_stock_of_the_same_repeat():
    rows = [
        {"cell": c, "repeat": r, "output_tokens_per_s": v, "accuracy": a}
        for c, r, v, a in [
            ("stock", 0, 10.0, 0.5),
            ("stock", 1, 20.0, 0.5),
            ("h2o", 0, 30.0, 0.25),
            ("h2o", 1, 30.0, 0.75),
        ]
    ]
    stock, h2o = cell_lines(rows)
    assert (stock["cell"], stock["repeats"], stock["throughput_ratio"]["median"]) == (
        "stock",
        2,
        1.0,
    )
    assert h2o["throughput_ratio"]["min"] == 1.5 and h2o["throughput_ratio"]["max"] == 3.0
    assert h2o["accuracy"]["median"] == 0.5 and h2o["agreement"] is None
    md = table([stock, h2o]).splitlines()
    assert len(md) == 4 and md[3].startswith("| h2o | 30.0 | 2.25 (1.50-3.00) |")
    assert "| 50 (25-75) |" in md[3]
    (alone,) = cell_lines([r for r in rows if r["cell"] == "h2o"])
    assert alone["throughput_ratio"] is None
