"""Reading SGLang's log text: decode batches, retractions, failures (hand-written log lines in
the shape SGLang 0.5.23 writes them)."""

from sgl_vtoken_tools.bench import server_log

# Shaped like SGLang 0.5.23's scheduler output (metrics_reporter.py, scheduler.py).
SAMPLE_LOG = """\
[2026-12-01 10:00:01] Prefill batch, #new-seq: 3, #new-token: 144, #cached-token: 0, token usage: 0.04, #running-req: 0, #queue-req: 13,
[2026-12-01 10:00:02] Decode batch, #running-req: 3, #token: 208, token usage: 0.05, gen throughput (token/s): 310.22, #queue-req: 13,
[2026-12-01 10:00:03] Decode batch [412], #running-req: 12, #token: 3900, token usage: 0.95, gen throughput (token/s): 990.10, #queue-req: 4,
[2026-12-01 10:00:03] KV cache pool is full. Retract requests. #retracted_reqs: 2, #new_tokens_gained: 2048, #new_token_ratio: 0.4100 -> 0.7000
[2026-12-01 10:00:04] Decode batch, #running-req: 10, #token: 3000, token usage: 0.73, gen throughput (token/s): 805.00, #queue-req: 6,
[2026-12-01 10:00:04] Testing retraction. #retracted_reqs: 1, #new_tokens_gained: 64
[2026-12-01 10:00:05] KV cache pool is full. Retract requests. #retracted_reqs: 1, #new_tokens_gained: 1024, #new_token_ratio: 0.6000 -> 0.9000
[2026-12-01 10:00:06] Decode batch, #running-req: 9, #token: 2900, token usage: 0.70, gen throughput (token/s): 700.00, #queue-req: 7,
"""
TRACEBACK = (
    'Traceback (most recent call last):\n  File "x.py", line 1, in f\n    g()\nValueError: boom\n'
)


def test_peak_running_is_the_largest_decode_batch():
    assert server_log.peak_running_from_log(SAMPLE_LOG) == 12  # the "[iter]" form counts too
    # The prefill line's "#running-req: 0" is not a decode batch; neither is a "#running-req: 99"
    # in a line that is not a Decode batch record.
    assert (
        server_log.peak_running_from_log("Prefill batch, #running-req: 99, #queue-req: 0,\n")
        is None
    )
    assert server_log.peak_running_from_log("") is None
    assert server_log.peak_running_from_log("Decode batch, #running-req: 1, #token: 5,\n") == 1


def test_retractions_count_only_the_pool_full_lines():
    assert server_log.count_retractions(SAMPLE_LOG) == 2  # "Testing retraction." is not one
    assert server_log.retracted_requests(SAMPLE_LOG) == 3
    assert server_log.count_retractions("Decode batch, #running-req: 3,\n") == 0
    assert server_log.retracted_requests("") == 0


def test_parse_log_sums_up_a_run():
    assert server_log.parse_log(SAMPLE_LOG) == {
        "peak_running_requests": 12,
        "mean_running_requests": 8.5,  # (3 + 12 + 10 + 9) / 4 decode steps
        "decode_steps": 4,
        "retraction_events": 2,
        "retracted_requests": 3,
    }
    assert server_log.parse_log("")["peak_running_requests"] == 0
    assert server_log.parse_log("")["mean_running_requests"] == 0
    assert server_log.mean_running_from_log("") is None


def test_error_lines_and_tracebacks():
    text = SAMPLE_LOG + TRACEBACK
    assert server_log.error_lines(text) == [
        "Traceback (most recent call last):",
        "ValueError: boom",
    ]
    assert server_log.error_lines(SAMPLE_LOG) == []
    tbs = server_log.tracebacks(
        text + "[t] Scheduler hit an exception: " + TRACEBACK + "later line\n"
    )
    assert len(tbs) == 2 and tbs[0] == TRACEBACK.rstrip("\n")
    assert tbs[1].startswith("[t] Scheduler hit an exception: Traceback") and tbs[1].endswith(
        "ValueError: boom"
    )
    assert server_log.tracebacks(SAMPLE_LOG) == []


def test_read_from_returns_what_the_file_gained(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("before\n")
    offset = log.stat().st_size
    with open(log, "a") as f:
        f.write("during\n")
    assert server_log.read_from(log, offset) == "during\n"
    assert server_log.read_from(tmp_path / "missing.log", 0) == ""
