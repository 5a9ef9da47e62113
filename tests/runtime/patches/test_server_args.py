"""The `--kv-*` flags through SGLang's own parser, start-up validation, and how the settings
reach the scheduler processes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sgl_vtoken.config import ENV_VAR, EvictConfig

# A server policy the parser accepts: the cases below add to it what they check.
STREAMING = ("--kv-evict", "streamingllm", "--kv-budget", "64")


def test_default_is_none_and_published(parse):
    args = parse()
    assert args.radix_cache_backend is None
    assert EvictConfig.from_env() == EvictConfig()


def test_flags_build_the_config(parse):
    args = parse(
        "--kv-evict",
        "random",
        "--kv-budget",
        "96",
        "--kv-sink",
        "8",
        "--kv-window",
        "4",
        "--kv-evict-interval",
        "16",
        "--kv-reclaim",
        "naive",
        "--page-size",
        "16",
        "--kv-evict-config",
        '{"seed": 7}',
    )
    expected = EvictConfig(
        policy="random",
        budget=96,
        sink=8,
        window=4,
        interval=16,
        reclaim="naive",
        page_size=16,
        seed=7,
    )
    assert EvictConfig.from_env() == expected
    assert args.page_size == 16


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--kv-evict", "bogus"], "argument --kv-evict: invalid choice: 'bogus'"),
        (
            ["--kv-evict", "streamingllm"],
            "argument --kv-budget: required with --kv-evict streamingllm",
        ),
        (["--kv-evict", "streamingllm", "--kv-budget", "4"], "argument --kv-budget:"),
        (
            ["--kv-evict", "streamingllm", "--kv-budget", "20", "--page-size", "16"],
            "argument --kv-budget:",
        ),
        (
            [*STREAMING, "--kv-window", "-1"],
            "argument --kv-window:",
        ),
        (
            [*STREAMING, "--kv-evict-interval", "0"],
            "argument --kv-evict-interval:",
        ),
        (
            [*STREAMING, "--kv-reclaim", "lazy"],
            "argument --kv-reclaim: invalid choice",
        ),
        (
            ["--kv-evict", "random", "--kv-budget", "64", "--kv-evict-config", "{oops"],
            "argument --kv-evict-config: not valid JSON",
        ),
        (
            [
                "--kv-evict",
                "random",
                "--kv-budget",
                "64",
                "--kv-evict-config",
                '{"temperature": 1}',
            ],
            "argument --kv-evict-config:",
        ),
        (["--kv-evict-config", '{"seed": 1}'], "argument --kv-evict-config: needs --kv-evict"),
        (
            [*STREAMING, "--enable-mixed-chunk"],
            "argument --enable-mixed-chunk:",
        ),
        (
            [*STREAMING, "--speculative-algorithm", "EAGLE"],
            "argument --speculative-algorithm:",
        ),
        (
            [*STREAMING, "--pp-size", "2"],
            "argument --pp-size:",
        ),
        (
            ["--kv-evict", "streamingllm", "--kv-budget", "40000"],
            "argument --kv-budget: must be <= the model's context length 32768 (got 40000)",
        ),
        (["--kv-evict", "streamingllm", "--kv-budget", str(2**63)], "argument --kv-budget:"),
        (
            ["--kv-evict", "streamingllm", "--kv-budget", "4000", "--max-total-tokens", "4000"],
            "argument --kv-budget 4000: an evicting request holds up to budget + interval + page_size = 4002 KV "
            "tokens, more than the pool's 4000",
        ),
        (
            [
                "--kv-evict",
                "h2o",
                "--kv-budget",
                "64",
                "--kv-evict-config",
                '{"score_layers": [1, 99]}',
            ],
            "argument --kv-evict-config: score_layers [1, 99] must be layer ids < 2 (the model's layers)",
        ),
        (
            ["--model-path", "/nonexistent", *STREAMING],
            "argument --kv-evict: cannot read the config of --model-path '/nonexistent'",
        ),
        (
            [*STREAMING, "--kv-evict-config", '{"prefill_chunk": 32}'],
            "argument --kv-evict-config: prefill_chunk needs --disable-overlap-schedule",
        ),
        (
            [
                *STREAMING,
                "--kv-evict-config",
                '{"prefill_chunk": 32}',
                "--disable-overlap-schedule",
                "--chunked-prefill-size",
                "-1",
            ],
            "argument --kv-evict-config: prefill_chunk needs SGLang's chunked prefill (--chunked-prefill-size > 0)",
        ),
        (
            [
                *STREAMING,
                "--page-size",
                "16",
                "--kv-evict-config",
                '{"prefill_chunk": 24}',
                "--disable-overlap-schedule",
            ],
            "argument --kv-evict-config: EvictConfig.prefill_chunk must be a multiple of page_size 16",
        ),
        (
            [
                *STREAMING,
                "--max-total-tokens",
                "100",
                "--kv-evict-config",
                '{"prefill_chunk": 64}',
                "--disable-overlap-schedule",
            ],
            "argument --kv-evict-config: prefill_chunk 64: a prefill evicting request holds up to budget + "
            "prefill_chunk + recall + page_size = 129 KV tokens, more than the pool's 100",
        ),
        (
            [
                "--kv-evict",
                "h2o",
                "--kv-budget",
                "256",
                "--chunked-prefill-size",
                "-1",
                "--kv-evict-config",
                '{"host_tokens": 65536, "offload": true, "recall": 32}',
            ],
            "argument --kv-evict-config: recall 32 needs SGLang's chunked prefill "
            "(--chunked-prefill-size > 0)",
        ),
    ],
)
def test_invalid_settings_exit_naming_the_flag(refused, flags, needle):
    assert needle in refused(*flags)


def test_attention_policy_settings(parse):
    parse(
        "--kv-evict",
        "scissorhands",
        "--kv-budget",
        "64",
        "--kv-window",
        "16",
        "--kv-evict-config",
        '{"history": 8, "obs_window": 4, "score_layers": [1]}',
    )
    cfg = EvictConfig.from_env()
    assert (
        cfg.policy,
        cfg.params["history"],
        cfg.scoring.obs_window,
        cfg.scoring.score_layers,
    ) == ("scissorhands", 8, 4, (1,))


@pytest.mark.parametrize(
    "config,needle",
    [
        ('{"history": 99}', "history must be an integer in [1, 62]"),
        ('{"obs_window": 0}', "obs_window must be"),
        ('{"score_layers": []}', "score_layers must be"),
    ],
)
def test_attention_policy_settings_are_validated(parse, capsys, config, needle):
    with pytest.raises(SystemExit):
        parse("--kv-evict", "scissorhands", "--kv-budget", "64", "--kv-evict-config", config)
    err = capsys.readouterr().err
    assert "argument --kv-evict-config:" in err and needle in err


def test_hooks_are_verified_before_serving(parse, monkeypatch, capsys):
    from sgl_vtoken.patches.core import contract

    monkeypatch.setattr(contract, "check_hooks_applied", lambda: ["Scheduler.update_running_batch"])
    with pytest.raises(SystemExit):
        parse(*STREAMING)
    assert "hooks are not in place (Scheduler.update_running_batch)" in capsys.readouterr().err


def test_malformed_environment_is_an_error(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "{not json")
    with pytest.raises(ValueError, match="malformed"):
        EvictConfig.from_env()


SGLANG_SERVE = [str(Path(sys.executable).parent / "sglang"), "serve"]


@pytest.mark.parametrize("entry", [[sys.executable, "-m", "sglang.launch_server"], SGLANG_SERVE])
def test_launcher_fails_fast_on_bogus_policy(tiny_model, entry):
    """Both entry points exit non-zero before loading a model, naming the flag and choices."""
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    proc = subprocess.run(
        [*entry, "--model-path", str(tiny_model), "--device", "cpu", "--kv-evict", "bogus"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode != 0
    assert (
        "argument --kv-evict: invalid choice: 'bogus' (choose from 'none', 'streamingllm', "
        "'random', 'knorm', 'h2o', 'tova', 'scissorhands')"
    ) in proc.stderr
    assert "Load weight" not in proc.stdout + proc.stderr


def test_holed_radix_cache_is_chosen_with_a_server_policy(parse):
    assert parse(*STREAMING).radix_cache_backend == "vtoken"
    assert parse(*STREAMING, "--page-size", "16").radix_cache_backend == "vtoken"
    assert parse(*STREAMING, "--disable-radix-cache").radix_cache_backend is None
    assert parse().radix_cache_backend is None  # no server policy: stock cache unless asked
    assert parse("--radix-cache-backend", "vtoken").radix_cache_backend == "vtoken"
    parse(*STREAMING, "--kv-evict-config", '{"reuse_history": false}')
    assert EvictConfig.from_env().history.reuse is False
    parse(*STREAMING, "--page-size", "16", "--kv-evict-config", '{"reuse_history": true}')
    assert EvictConfig.from_env().history.reuse is True  # every page size


@pytest.mark.parametrize(
    "flags,needle",
    [
        (
            ["--radix-cache-backend", "vtoken", "--disable-radix-cache"],
            "argument --radix-cache-backend: vtoken cannot run with --disable-radix-cache",
        ),
        (
            [*STREAMING, "--kv-evict-config", '{"reuse_history": 1}'],
            "argument --kv-evict-config: EvictConfig.reuse_history must be true or false",
        ),
    ],
)
def test_holed_radix_cache_refusals_name_the_flag(refused, flags, needle):
    assert needle in refused(*flags)


def test_a_span_without_the_tokenizer_is_refused_at_start_up(parse, refused):
    """h2o's default span reads words from the tokenizer: `--skip-tokenizer-init` is refused
    naming both, and `"span": 0` starts."""
    err = refused("--kv-evict", "h2o", "--kv-budget", "64", "--skip-tokenizer-init")
    assert "argument --kv-evict-config: span 8" in err and "--skip-tokenizer-init" in err
    parse(
        *"--kv-evict h2o --kv-budget 64 --skip-tokenizer-init".split(),
        "--kv-evict-config",
        '{"span": 0}',
    )
    assert EvictConfig.from_env().span == 0
    parse(*STREAMING, "--skip-tokenizer-init")  # no span
