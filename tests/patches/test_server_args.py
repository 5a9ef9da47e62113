"""The `--kv-*` flags through SGLang's own parser, start-up validation, and how the settings
reach the scheduler processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sgl_vtoken.config import ENV_VAR, EvictConfig


@pytest.fixture
def parse(monkeypatch, tiny_model):
    """SGLang's `prepare_server_args` with the plugin's hooks applied, as in the launcher (the
    tiny model unless the flags name another `--model-path`)."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    monkeypatch.delenv(ENV_VAR, raising=False)

    def run(*flags):
        return prepare_server_args(["--model-path", str(tiny_model), *flags])

    return run


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
            ["--kv-evict", "streamingllm", "--kv-budget", "64", "--kv-window", "-1"],
            "argument --kv-window:",
        ),
        (
            ["--kv-evict", "streamingllm", "--kv-budget", "64", "--kv-evict-interval", "0"],
            "argument --kv-evict-interval:",
        ),
        (
            ["--kv-evict", "streamingllm", "--kv-budget", "64", "--kv-reclaim", "lazy"],
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
            ["--kv-evict", "streamingllm", "--kv-budget", "64", "--enable-mixed-chunk"],
            "argument --enable-mixed-chunk:",
        ),
        (
            ["--kv-evict", "streamingllm", "--kv-budget", "64", "--speculative-algorithm", "EAGLE"],
            "argument --speculative-algorithm:",
        ),
        (
            ["--kv-evict", "streamingllm", "--kv-budget", "64", "--pp-size", "2"],
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
            ["--model-path", "/nonexistent", "--kv-evict", "streamingllm", "--kv-budget", "64"],
            "argument --kv-evict: cannot read the config of --model-path '/nonexistent'",
        ),
        (
            [
                "--kv-evict",
                "streamingllm",
                "--kv-budget",
                "64",
                "--kv-evict-config",
                '{"prefill_chunk": 32}',
            ],
            "argument --kv-evict-config: prefill_chunk needs --disable-overlap-schedule",
        ),
        (
            [
                "--kv-evict",
                "streamingllm",
                "--kv-budget",
                "64",
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
                "--kv-evict",
                "streamingllm",
                "--kv-budget",
                "64",
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
                "--kv-evict",
                "streamingllm",
                "--kv-budget",
                "64",
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
def test_invalid_settings_exit_naming_the_flag(parse, capsys, flags, needle):
    with pytest.raises(SystemExit) as e:
        parse(*flags)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_a_server_that_cannot_evict_refuses_per_request_eviction_naming_why(monkeypatch):
    """The tokenizer manager asks `refusals` of its own server args: the SGLang setting eviction
    cannot run with, hooks that failed to apply, or (GPU) decode CUDA graphs for attention
    policies; `resolve` then refuses the request (HTTP 400) naming it."""
    from types import SimpleNamespace

    from sgl_vtoken.patches.core import contract
    from sgl_vtoken.patches.surface import server_args
    from sgl_vtoken.patches.surface.request_options import resolve
    from sgl_vtoken.patches.surface.server_args import KV_EVICT_CHOICES, refusals

    monkeypatch.setattr(contract, "check_hooks_applied", lambda: [])
    assert refusals(SimpleNamespace(device="cpu")) == ("", "")
    mixed = refusals(SimpleNamespace(device="cpu", enable_mixed_chunk=True))
    assert mixed == (
        "the server runs with --enable-mixed-chunk (mixed batches bypass the eviction hook)",
        "",
    )
    with pytest.raises(
        ValueError,
        match="kv_evict.policy: eviction is not available on this server: the server runs with --enable-mixed-chunk",
    ):
        resolve(EvictConfig(), {"policy": "streamingllm", "budget": 64}, KV_EVICT_CHOICES, mixed)
    assert not resolve(EvictConfig(), {"policy": "none"}, KV_EVICT_CHOICES, mixed).enabled
    monkeypatch.setattr(server_args, "_has_cuda", lambda: True)
    graphs = refusals(SimpleNamespace(device="cuda"))
    assert graphs[0] == "" and "decode CUDA graphs off" in graphs[1]
    with pytest.raises(
        ValueError,
        match="kv_evict.policy: h2o is not available on this server: needs decode CUDA graphs off",
    ):
        resolve(EvictConfig(), {"policy": "h2o", "budget": 64}, KV_EVICT_CHOICES, graphs)
    assert resolve(
        EvictConfig(), {"policy": "streamingllm", "budget": 64}, KV_EVICT_CHOICES, graphs
    ).enabled
    monkeypatch.setattr(contract, "check_hooks_applied", lambda: ["a.b.c"])
    assert refusals(SimpleNamespace(device="cpu"))[0] == "hooks not in place: a.b.c"


def test_flags_are_per_request_defaults_without_a_policy(parse):
    """On a `--kv-evict none` server the other flags are what per-request `kv_evict` starts from."""
    from sgl_vtoken.patches.surface.request_options import resolve
    from sgl_vtoken.patches.surface.server_args import KV_EVICT_CHOICES

    parse(
        "--kv-budget",
        "96",
        "--kv-evict-interval",
        "16",
        "--kv-reclaim",
        "naive",
        "--page-size",
        "16",
    )
    server = EvictConfig.from_env()
    assert not server.enabled
    cfg = resolve(server, {"policy": "random"}, KV_EVICT_CHOICES)
    assert (cfg.budget, cfg.interval, cfg.reclaim, cfg.page_size) == (96, 16, "naive", 16)
    assert resolve(server, {"policy": "random", "budget": 64}, KV_EVICT_CHOICES).budget == 64


@pytest.mark.parametrize(
    "server",
    [
        dict(policy="streamingllm", budget=64, page_size=16, interval=16, prefill_chunk=64),
        dict(policy="streamingllm", budget=64, page_size=16, interval=16, host_tokens=4096),
        dict(policy="streamingllm", budget=64, page_size=1),
    ],
    ids=["prefill_chunk", "host_store", "plain"],
)
@pytest.mark.parametrize("field", ["budget", "sink", "window", "interval", "recall"])
@pytest.mark.parametrize("value", ["many", 1.5, True, [64]])
def test_every_request_field_is_type_checked_before_arithmetic(server, field, value):
    """A wrong type in any numeric `kv_evict` field is a ValueError naming the field (HTTP 400),
    never a TypeError from arithmetic on it (HTTP 500), on every kind of server."""
    from sgl_vtoken.patches.surface.request_options import resolve
    from sgl_vtoken.patches.surface.server_args import KV_EVICT_CHOICES

    obj = {"offload": True, field: value} if field == "recall" else {field: value}
    with pytest.raises(ValueError, match=rf"kv_evict\.(offload|{field}) "):
        resolve(EvictConfig.from_dict(server), obj, KV_EVICT_CHOICES)


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
        parse("--kv-evict", "streamingllm", "--kv-budget", "64")
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
        "'random', 'knorm', 'h2o', 'tova', 'scissorhands', 'kvp')"
    ) in proc.stderr
    assert "Load weight" not in proc.stdout + proc.stderr


@pytest.fixture
def kvp_checkpoint(tmp_path):
    """`kvp_checkpoint(layers)`: an (untrained) KVP scorer for a tiny-model-shaped model."""
    from sgl_vtoken.kvp import KVPScorer, ModelIdentity, save_checkpoint

    def make(layers=2, heads=2, head_dim=32):
        idt = ModelIdentity("llama", num_layers=layers, num_kv_heads=heads, head_dim=head_dim)
        return str(
            save_checkpoint(
                KVPScorer(idt, hidden=4), tmp_path / f"kvp-{layers}-{heads}-{head_dim}.st"
            )
        )

    return make


def test_kvp_checkpoint_for_the_served_model_is_accepted(parse, tiny_model, kvp_checkpoint):
    path = kvp_checkpoint()
    parse(
        "--model-path",
        str(tiny_model),
        "--kv-evict",
        "kvp",
        "--kv-budget",
        "64",
        "--kv-evict-config",
        json.dumps({"checkpoint": path}),
    )
    cfg = EvictConfig.from_env()
    assert (cfg.policy, cfg.params["checkpoint"]) == ("kvp", path)


@pytest.mark.parametrize(
    "kind,needle",
    [
        ("none", "KVP.checkpoint is required"),
        ("missing", "KVP checkpoint '{path}': no such file"),
        ("garbage", "KVP checkpoint '{path}': not a readable safetensors file"),
        ("layers", "is for another model (num_layers: checkpoint 3, model 2)"),
        ("heads", "num_kv_heads: checkpoint 4, model 2; head_dim: checkpoint 16, model 32"),
    ],
)
def test_kvp_bad_checkpoints_exit_at_start_up_naming_the_cause(
    parse, capsys, tiny_model, tmp_path, kvp_checkpoint, kind, needle
):
    path = {
        "none": "",
        "missing": str(tmp_path / "nope.st"),
        "garbage": str(tmp_path / "garbage.st"),
        "layers": kvp_checkpoint(layers=3),
        "heads": kvp_checkpoint(heads=4, head_dim=16),
    }[kind]
    (tmp_path / "garbage.st").write_bytes(b"\x00" * 64)
    config = "{}" if kind == "none" else json.dumps({"checkpoint": path})
    with pytest.raises(SystemExit) as e:
        parse(
            "--model-path",
            str(tiny_model),
            "--kv-evict",
            "kvp",
            "--kv-budget",
            "64",
            "--kv-evict-config",
            config,
        )
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "argument --kv-evict-config:" in err and needle.format(path=path) in err, err


def test_kvp_needs_a_readable_model_config(parse, capsys, kvp_checkpoint):
    with pytest.raises(SystemExit):
        parse(
            "--model-path",
            "/nonexistent",
            "--kv-evict",
            "kvp",
            "--kv-budget",
            "64",
            "--kv-evict-config",
            json.dumps({"checkpoint": kvp_checkpoint()}),
        )
    assert "cannot read the config of --model-path '/nonexistent'" in capsys.readouterr().err


def test_holed_radix_cache_is_chosen_with_a_server_policy(parse):
    assert parse("--kv-evict", "streamingllm", "--kv-budget", "64").radix_cache_backend == "vtoken"
    assert (
        parse(
            "--kv-evict", "streamingllm", "--kv-budget", "64", "--page-size", "16"
        ).radix_cache_backend
        == "vtoken"
    )
    assert (
        parse(
            "--kv-evict", "streamingllm", "--kv-budget", "64", "--disable-radix-cache"
        ).radix_cache_backend
        is None
    )
    assert parse().radix_cache_backend is None  # no server policy: stock cache unless asked
    assert parse("--radix-cache-backend", "vtoken").radix_cache_backend == "vtoken"
    parse(
        "--kv-evict",
        "streamingllm",
        "--kv-budget",
        "64",
        "--kv-evict-config",
        '{"reuse_history": false}',
    )
    assert EvictConfig.from_env().history.reuse is False
    parse(
        "--kv-evict",
        "streamingllm",
        "--kv-budget",
        "64",
        "--page-size",
        "16",
        "--kv-evict-config",
        '{"reuse_history": true}',
    )
    assert EvictConfig.from_env().history.reuse is True  # every page size


@pytest.mark.parametrize(
    "flags,needle",
    [
        (
            ["--radix-cache-backend", "vtoken", "--disable-radix-cache"],
            "argument --radix-cache-backend: vtoken cannot run with --disable-radix-cache",
        ),
        (
            [
                "--kv-evict",
                "streamingllm",
                "--kv-budget",
                "64",
                "--kv-evict-config",
                '{"reuse_history": 1}',
            ],
            "argument --kv-evict-config: EvictConfig.reuse_history must be true or false",
        ),
    ],
)
def test_holed_radix_cache_refusals_name_the_flag(parse, capsys, flags, needle):
    with pytest.raises(SystemExit) as e:
        parse(*flags)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err
