"""The decode-batch benchmark without a server: a batch size's step time comes only from SGLang's
decode records taken at exactly that many running requests, and the scaling line is relative to
one request."""

import pytest


@pytest.fixture(scope="module")
def bench(command):
    return command("decode_batch")


def test_step_time_reads_only_records_at_the_batch(bench):
    records = [(1, 50.0), (4, 100.0), (4, 120.0), (4, 110.0), (3, 999.0), (4, 0.0)]
    line = bench.batch_line(records, 4)
    # the ramp-up (3 running) and an idle record (0 tok/s) are left out; median 110 tok/s
    assert line == {
        "batch": 4,
        "records": 3,
        "decode_tok_s": 110.0,
        "step_ms": 36.36,
        "per_request_tok_s": 27.5,
    }
    assert bench.batch_line(records, 8) == {
        "batch": 8,
        "records": 0,
        "decode_tok_s": None,
        "step_ms": None,
    }


def test_scaling_is_relative_to_one_request(bench):
    lines = [
        {"batch": 1, "step_ms": 20.0, "decode_tok_s": 50.0},
        {"batch": 1, "step_ms": 22.0, "decode_tok_s": 45.0},
        {"batch": 8, "step_ms": 80.0, "decode_tok_s": 100.0},
        {"batch": 8, "step_ms": None, "decode_tok_s": None},
    ]
    out = bench.scaling(lines)
    assert out["kind"] == "scaling"
    assert out["batches"] == [
        {
            "batch": 1,
            "step_ms": 21.0,
            "decode_tok_s": 47.5,
            "step_vs_b1": 1.0,
            "throughput_vs_b1": 1.0,
        },
        {
            "batch": 8,
            "step_ms": 80.0,
            "decode_tok_s": 100.0,
            "step_vs_b1": 3.81,
            "throughput_vs_b1": 2.11,
        },
    ]


@pytest.mark.parametrize(
    "flags,need",
    [
        (["--batches", "4", "--prompt-tokens", "256"], 1152),  # the largest batch
        (["--batches", "1", "--prefill-lengths", "2000"], 2001),  # a prefill length
    ],
)
def test_a_pool_too_small_is_refused(bench, flags, need):
    with pytest.raises(SystemExit, match=f"--pool 1000 is below the {need} tokens"):
        bench.run(bench.build_parser().parse_args(["--pool", "1000", *flags]))


def test_prefill_line_is_the_median_run_in_prompt_tokens_per_second(bench):
    assert bench.prefill_line(2000, [4.0, 5.0, 40.0]) == {
        "kind": "prefill",
        "prompt_tokens": 2000,
        "runs": 3,
        "seconds": 5.0,
        "prefill_tok_s": 400.0,
    }
