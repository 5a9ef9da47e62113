"""`--kv-evict` through SGLang's own parser, and how the settings reach the scheduler."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sgl_vtoken.patches import server_args


@pytest.fixture
def parse(monkeypatch):
    """SGLang's `prepare_server_args` with the plugin's hooks applied, as in the launcher."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    monkeypatch.delenv(server_args.ENV_VAR, raising=False)

    def run(*flags):
        return prepare_server_args(["--model-path", "/nonexistent", *flags])

    return run


def test_default_is_none_and_published(parse):
    import os

    args = parse()
    assert args._vtoken_config == {"policy": "none"}
    assert json.loads(os.environ[server_args.ENV_VAR]) == {"policy": "none"}
    assert server_args.current_settings() == {"policy": "none"}


def test_explicit_none(parse):
    assert parse("--kv-evict", "none")._vtoken_config["policy"] == "none"


def test_unknown_policy_is_rejected_with_the_choices(parse, capsys):
    with pytest.raises(SystemExit) as e:
        parse("--kv-evict", "bogus")
    assert e.value.code != 0
    err = capsys.readouterr().err
    assert "--kv-evict" in err and "invalid choice: 'bogus'" in err and "'none'" in err


def test_settings_survive_pickling(parse):
    import pickle

    args = pickle.loads(pickle.dumps(parse()))
    assert args._vtoken_config == {"policy": "none"}


def test_malformed_environment_is_an_error(monkeypatch):
    monkeypatch.setenv(server_args.ENV_VAR, "{not json")
    with pytest.raises(ValueError, match=server_args.ENV_VAR):
        server_args.current_settings()
    monkeypatch.setenv(server_args.ENV_VAR, '{"policy": "h2o-bogus"}')
    with pytest.raises(ValueError, match="policy must be one of"):
        server_args.current_settings()


SGLANG_SERVE = [str(Path(sys.executable).parent / "sglang"), "serve"]


@pytest.mark.parametrize("entry", [[sys.executable, "-m", "sglang.launch_server"], SGLANG_SERVE])
def test_launcher_fails_fast_on_bogus_policy(tiny_model, entry):
    """Both entry points exit non-zero before loading a model, naming the flag and choices."""
    proc = subprocess.run([*entry, "--model-path", str(tiny_model), "--device", "cpu",
                           "--kv-evict", "bogus"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "argument --kv-evict: invalid choice: 'bogus' (choose from 'none')" in proc.stderr
    assert "Load weight" not in proc.stdout + proc.stderr
