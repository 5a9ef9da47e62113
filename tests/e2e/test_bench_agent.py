"""The agent benchmark and the quality harness against one evicting test server: the report's
numbers agree with the server's own counters, and eval_quality's mechanics run end to end."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.server

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
BUDGET, INTERVAL = 64, 16
FLAGS = ("--kv-evict", "streamingllm", "--kv-budget", str(BUDGET), "--kv-evict-interval", str(INTERVAL),
         "--enable-metrics", "--decode-log-interval", "1")
SESSIONS, TURNS, REPLY = 4, 3, 48


@pytest.fixture(scope="module")
def client(server_factory):
    return server_factory(page_size=16, extra=FLAGS)


def run_script(name: str, *argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(SCRIPTS / name), *argv], capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc


def test_agent_report_agrees_with_server_counters(client, tmp_path):
    before = client.vtoken_state()
    out = tmp_path / "agent.jsonl"
    run_script("bench_agent.py", "--base-url", client.base_url, "--sessions", str(SESSIONS),
               "--turns", str(TURNS), "--reply-tokens", str(REPLY), "--system-tokens", "96",
               "--user-tokens", "20", "--tool-tokens", "120", "--tool-max", "240", "--rate", "8",
               "--seed", "3", "--server-log", str(client.server.log_path), "--sample-interval", "0.05",
               "--out", str(out), "--no-progress")
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
        prompts = [r["prompt_tokens"] for r in sorted(requests_, key=lambda r: r["turn"]) if r["session"] == sess]
        assert all(b > a + REPLY for a, b in zip(prompts, prompts[1:])), prompts
    assert all(0 < r["ttft"] <= r["e2e"] and r["tpot"] > 0 for r in requests_)
    assert s["completed"] == SESSIONS * TURNS and s["failed"] == 0 and s["output_tokens_per_s"] > 0

    # Client-side usage == the server's Prometheus counters over the run.
    m = s["metrics_delta"]
    assert m["num_requests_total"] == SESSIONS * TURNS
    assert m["generation_tokens_total"] == s["completion_tokens"] == SESSIONS * TURNS * REPLY
    assert m["prompt_tokens_total"] == s["prompt_tokens"]
    assert m["cached_tokens_total"] == s["cached_tokens"]
    # Retractions: the metrics counter and the server log agree.
    assert s["retractions_source"] == "metrics" and s["retractions"] == s["log"]["retracted_requests"]

    # vToken counters: the report's deltas are the server's, and they are what the policy implies:
    # each request ends with between `budget` and `budget + interval` tokens (its prompt is
    # longer than that, so it was evicted).
    vt = s["vtoken"]
    for key in ("evictions", "evicted_tokens", "pages_freed", "tokens_moved", "bytes_moved"):
        assert vt["delta"][key] == after[key] - before[key], key
    assert all(r["prompt_tokens"] > BUDGET + INTERVAL for r in requests_)
    kept = sum(r["prompt_tokens"] + r["completion_tokens"] for r in requests_) - vt["delta"]["evicted_tokens"]
    n = len(requests_)
    assert n * BUDGET <= kept <= n * (BUDGET + INTERVAL), (kept, n)
    assert vt["delta"]["evictions"] >= n

    # Peak running requests: the log's largest decode batch of the run is the plugin's counter
    # (largest decode batch of an evicting server since start-up); the samples see no more.
    assert 1 <= s["peak_running_log"] <= SESSIONS
    assert after["peak_running_requests"] == max(before["peak_running_requests"], s["peak_running_log"])
    assert 1 <= s["peak_running_sampled"] <= s["peak_running_log"]
    assert s["peak_running"] == s["peak_running_log"]
    # Retained pages: the sampled gauge never exceeds the server's peak; per request it stays
    # within the budget's pages (+ the interval, + one partial page).
    assert 0 < vt["peak_retained_pages_sampled"] <= after["peak_retained_pages"]
    assert 0 < vt["retained_pages_per_req"] <= (BUDGET + INTERVAL) / 16 + 1


def test_eval_quality_smoke(client, tmp_path):
    out = tmp_path / "quality.jsonl"
    run_script("eval_quality.py", "--base-url", client.base_url, "--smoke", "--budgets", str(BUDGET),
               "--policies", "streamingllm", "random", "--out", str(out))
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    summaries = {r["setting"]: r for r in recs if r["kind"] == "summary"}
    assert list(summaries) == ["none", f"streamingllm-{BUDGET}", f"random-{BUDGET}"]
    ppl = next(r for r in recs if r["kind"] == "ppl")
    assert ppl["tokens"] == 2 * 127 and 1.0 < ppl["ppl"] < 1e6  # 256 tokens, 2 windows of 128
    for r in summaries.values():
        assert 0.0 <= r["needle_accuracy"] <= 1.0 and r["needle_trials"] == 1
        assert 0.0 <= r["agreement"] <= 1.0
    # The baseline agrees with itself (greedy, same server); eviction really ran.
    assert summaries["none"]["agreement"] == 1.0
    server = next(r for r in recs if r["kind"] == "server")
    assert server["evicted_tokens"] > 0
